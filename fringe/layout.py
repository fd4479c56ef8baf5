"""Layouts: which global tokens each rank holds.

A :class:`Layout` is a permutation of the ``S`` global positions into ``P`` equal shards
of ``L = S / P`` tokens. Rank ``r`` holds global positions ``positions(r)`` in that order;
``shard`` / ``unshard`` move tensors between the global and the per-rank view, and
``positions`` is also what RoPE needs.

Kinds (chunk = a contiguous run of global positions):

* ``contiguous``: rank r holds ``[r*L, (r+1)*L)``.
* ``zigzag``: the sequence is cut into 2P chunks; rank r holds chunks r and 2P-1-r,
  which balances causal work.
* ``striped``: round robin in stripes of ``stripe`` tokens: stripe i goes to rank i % P.
* ``balanced``: mask-aware: the block order with the least predicted step time (kernel
  calls, pairs and bytes per rank), keeping packed documents whole where that balances
  (:func:`balanced`).

>>> zigzag(8, 2, block_size=2).positions(0).tolist()
[0, 1, 6, 7]
>>> zigzag(8, 2, block_size=2).positions(1).tolist()
[2, 3, 4, 5]
"""
from __future__ import annotations

import dataclasses
import hashlib

import torch

#: Default mask-block size (tokens per side of a classification block). A parameter
#: everywhere; this is only its default.
DEFAULT_BLOCK_SIZE = 64

#: How many starting offsets the "laps" candidate of :func:`balanced` tries (a search budget).
_LAP_OFFSETS = 128  # not a block size


@dataclasses.dataclass(frozen=True, eq=False)
class Layout:
    """A permutation of ``S`` global positions into ``P`` equal shards.

    Args:
        kind: display name (``"contiguous"``, ``"zigzag"``, ``"striped"``, or yours).
        order: int64 ``[S]``; ``order[r*L:(r+1)*L]`` are the global positions of rank r.
        world_size: P.
    """

    kind: str
    order: torch.Tensor
    world_size: int

    def __post_init__(self) -> None:
        S, P = self.order.numel(), self.world_size
        if P < 1:
            raise ValueError(f"world_size must be >= 1, got {P}")
        if self.order.dim() != 1:
            raise ValueError(f"layout order must be 1-D [S], got shape {tuple(self.order.shape)}")
        if S % P:
            raise ValueError(f"S={S} tokens cannot be split into P={P} equal shards")
        check = torch.zeros(S, dtype=torch.bool)
        check[self.order] = True
        if not bool(check.all()):
            raise ValueError(f"layout order must be a permutation of range({S})")
        object.__setattr__(self, "order", self.order.to(torch.int64).contiguous())

    # ---- sizes -------------------------------------------------------------------
    @property
    def seq_len(self) -> int:
        """S, the global sequence length."""
        return self.order.numel()

    @property
    def local_len(self) -> int:
        """L = S / P, tokens per rank."""
        return self.seq_len // self.world_size

    # ---- maps --------------------------------------------------------------------
    def positions(self, rank: int) -> torch.Tensor:
        """Global positions held by ``rank`` (int64 ``[L]``), in local order."""
        self._check_rank(rank)
        L = self.local_len
        return self.order[rank * L:(rank + 1) * L]

    def owner(self) -> torch.Tensor:
        """int64 ``[S]``: the rank that holds each global position."""
        own = torch.empty(self.seq_len, dtype=torch.int64)
        own[self.order] = torch.arange(self.seq_len) // self.local_len
        return own

    def shard(self, x: torch.Tensor, rank: int, *, dim: int = -2) -> torch.Tensor:
        """Rank ``rank``'s tokens of a global tensor (sequence along ``dim``)."""
        self._check_len(x, dim)
        return x.index_select(dim, self.positions(rank).to(x.device))

    def unshard(self, shards: list[torch.Tensor] | tuple[torch.Tensor, ...], *,
                dim: int = -2) -> torch.Tensor:
        """Inverse of :meth:`shard`: the global tensor from all P shards in rank order."""
        if len(shards) != self.world_size:
            raise ValueError(f"unshard needs {self.world_size} shards (one per rank), "
                             f"got {len(shards)}")
        cat = torch.cat(list(shards), dim=dim)
        self._check_len(cat, dim)
        inverse = torch.empty_like(self.order)
        inverse[self.order] = torch.arange(self.seq_len)
        return cat.index_select(dim, inverse.to(cat.device))

    def fingerprint(self) -> str:
        """A short hash of the permutation, equal on every rank that built the same layout."""
        digest = hashlib.sha1(self.order.numpy().tobytes()).hexdigest()[:12]
        return f"{self.kind}/P{self.world_size}/S{self.seq_len}/{digest}"

    def __repr__(self) -> str:
        return f"Layout({self.kind}, S={self.seq_len}, P={self.world_size})"

    # ---- checks ------------------------------------------------------------------
    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank must be in [0, {self.world_size}), got {rank}")

    def _check_len(self, x: torch.Tensor, dim: int) -> None:
        if x.shape[dim] != self.seq_len:
            raise ValueError(f"tensor has {x.shape[dim]} tokens along dim {dim}, but the layout "
                             f"is for S={self.seq_len}; shape {tuple(x.shape)}")


def _granularity_error(S: int, unit: int, what: str) -> ValueError:
    pad = -(-S // unit) * unit if S > 0 else unit
    return ValueError(f"S={S} is not divisible by {what}={unit}; pad the sequence to {pad} "
                      f"tokens (or choose a smaller block size)")


def _check(S: int, P: int) -> None:
    if P < 1:
        raise ValueError(f"world_size must be >= 1, got {P}")
    if S < 1:
        raise ValueError(f"seq_len must be >= 1, got {S}")


def contiguous(seq_len: int, world_size: int, *, block_size: int = DEFAULT_BLOCK_SIZE) -> Layout:
    """Rank r holds ``[r*L, (r+1)*L)``. Needs ``S % (P*block_size) == 0``."""
    _check(seq_len, world_size)
    if seq_len % (world_size * block_size):
        raise _granularity_error(seq_len, world_size * block_size, f"P*block={world_size}*{block_size}")
    return Layout("contiguous", torch.arange(seq_len), world_size)


def zigzag(seq_len: int, world_size: int, *, block_size: int = DEFAULT_BLOCK_SIZE) -> Layout:
    """2P chunks; rank r holds chunks r and 2P-1-r. Needs ``S % (2*P*block_size) == 0``."""
    _check(seq_len, world_size)
    unit = 2 * world_size * block_size
    if seq_len % unit:
        raise _granularity_error(seq_len, unit, f"2*P*block=2*{world_size}*{block_size}")
    chunk = seq_len // (2 * world_size)
    chunks = torch.arange(seq_len).view(2 * world_size, chunk)
    order = torch.cat([torch.cat([chunks[r], chunks[2 * world_size - 1 - r]])
                       for r in range(world_size)])
    return Layout("zigzag", order, world_size)


def striped(seq_len: int, world_size: int, *, stripe: int = 1,
            block_size: int = DEFAULT_BLOCK_SIZE) -> Layout:
    """Stripe i (``stripe`` tokens) goes to rank ``i % P``.

    Needs ``S % (stripe*P) == 0`` and the local length to be a multiple of ``block_size``.
    """
    _check(seq_len, world_size)
    if stripe < 1:
        raise ValueError(f"stripe must be >= 1 token, got {stripe}")
    unit = stripe * world_size
    if seq_len % unit:
        raise _granularity_error(seq_len, unit, f"stripe*P={stripe}*{world_size}")
    if (seq_len // world_size) % block_size:
        raise _granularity_error(seq_len, world_size * block_size, f"P*block={world_size}*{block_size}")
    stripes = torch.arange(seq_len).view(seq_len // unit, world_size, stripe)
    order = stripes.transpose(0, 1).reshape(-1)
    return Layout(f"striped({stripe})" if stripe != 1 else "striped", order, world_size)


def from_order(order: torch.Tensor, world_size: int, *, kind: str = "custom",
               block_size: int = DEFAULT_BLOCK_SIZE) -> Layout:
    """A user-defined layout from an explicit permutation (``order[r*L:(r+1)*L]`` → rank r)."""
    order = torch.as_tensor(order, dtype=torch.int64)
    _check(order.numel(), world_size)
    if order.numel() % (world_size * block_size):
        raise _granularity_error(order.numel(), world_size * block_size,
                                 f"P*block={world_size}*{block_size}")
    return Layout(kind, order, world_size)


#: Shape the balanced layout predicts time for when none is given: the shape the ``cpu``
#: hardware preset was calibrated with (:func:`fringe.runtime.costmodel.calibrate`'s defaults:
#: H=G=8, D=64, float32). Only the ratio of per-call to per-pair cost depends on it.
BALANCE_SHAPE = dict(batch=1, heads=8, kv_heads=8, head_dim=64, dtype="float32")

#: For masks with no document structure, :func:`balanced` considers only layouts whose heaviest
#: rank has at most this factor times the pair work (:func:`block_costs`) of the best balanced
#: candidate; calls and bytes decide among those.
BALANCE_SLACK = 1.05

_EMPTY, _PARTIAL, _FULL = 0, 1, 2      # fringe.masks.BlockKind codes (masks imports this module)

#: :func:`predict` splits tiles into kernel calls exactly (the tile grouping of
#: :mod:`fringe.ops.tile`, through the cost model) up to this many blocks in the sequence, and
#: estimates calls from runs of blocks above it (planning 1M tokens stays a few seconds).
EXACT_BLOCKS = 512


def balanced(seq_len: int, world_size: int, *, block_size: int = DEFAULT_BLOCK_SIZE,
             block_work: torch.Tensor | None = None, natural: torch.Tensor | None = None,
             hardware="cpu", shape=None) -> Layout:
    """The layout with the least predicted step time for the mask, among a few candidates.

    A rank computes its own q blocks against whatever kv they need, so what a layout decides
    is (1) the work of each rank, (2) how many kernel calls that work takes (scattered blocks
    fragment a tile into many small calls and break the causal diagonal runs that run with
    ``is_causal``) and (3) which kv chunks travel (a rank that needs nothing from a peer
    receives nothing from it). Dealing single blocks by work balances (1) perfectly and ruins
    (2) and (3); measured on CPU it was the slowest layout on document and window masks.
    So the candidates keep runs of blocks together, and the prediction counts all three:

    * ``contiguous`` and ``zigzag`` (the fixed layouts; zigzag is the fallback for masks
      with no document structure, such as plain causal);
    * *segments*: the sequence is cut where no non-empty block crosses (packed documents
      whose boundaries fall on blocks, read from the natural-order block map ``natural``);
      whole segments are packed by predicted work, heaviest first, onto the least loaded
      rank that has room (LPT with a capacity of ``L = S/P`` tokens); a segment too long for
      any rank is cut at block boundaries into contiguous pieces on consecutive ranks;
    * *laps*: the sequence is cut into ``2P`` contiguous pieces, piece ``k`` on rank
      ``k mod P`` (two laps round the ring), the piece sizes chosen so every rank's predicted
      work is the mean. Every cut then joins ring neighbours, so a document cut between two
      pieces costs one ring hop (as in ``contiguous``), while work is spread like zigzag.

    For a mask with no document structure (one segment, every q block's kv starting at the
    same block: causal, full, prefix-LM), candidates whose heaviest rank has more than
    :data:`BALANCE_SLACK` times the pair work of the best balanced one are dropped, so such
    masks are balanced even where kernel calls dominate (tiny blocks). The candidates left are
    scored by :func:`predict` (per rank: kernel calls and (q, kv) pairs of every
    tile from :func:`fringe.runtime.costmodel.tile_work`, forward and backward, plus the
    bytes it sends and receives, not overlapped) and the one whose slowest rank is fastest
    wins (ties: the earlier candidate in the list above).

    The constants come from ``hardware`` (a :class:`fringe.runtime.costmodel.Hardware` or a
    preset name) and are plain data, so every rank plans the same layout; values measured by
    ``costmodel.calibrate()`` differ from rank to rank and must be broadcast from rank 0
    before planning, or ranks disagree on the layout (the plan fingerprint check then fails).

    Args:
        seq_len: S.
        world_size: P.
        block_size: tokens per block; ``S`` must be a multiple of ``P * block_size``.
        block_work: float/int ``[S / block_size]``: work of each q block. Used only without
            ``natural``: then blocks are dealt one by one, heaviest first, to the least loaded
            rank with room (LPT; each rank keeps its blocks in sequence order).
        natural: int8 ``[S/block, S/block]`` block map of the mask in sequence order
            (:func:`fringe.masks.classify` over ``arange(S)``; :func:`fringe.plan` passes it).
        hardware: cost constants (default the ``cpu`` preset).
        shape: a :class:`fringe.runtime.costmodel.Shape` (default :data:`BALANCE_SHAPE`).

    Raises:
        ValueError: sizes that do not divide, or a block map / work of the wrong size.
    """
    _check(seq_len, world_size)
    if seq_len % (world_size * block_size):
        raise _granularity_error(seq_len, world_size * block_size,
                                 f"P*block={world_size}*{block_size}")
    nb = seq_len // block_size
    if natural is None:
        if block_work is None:
            raise ValueError("balanced needs natural= (the mask's block map in sequence order, "
                             "from fringe.masks.classify) or block_work= (per-block work)")
        return _deal_blocks(seq_len, world_size, block_size, block_work)
    natural = torch.as_tensor(natural)
    if tuple(natural.shape) != (nb, nb):
        raise ValueError(f"natural block map has shape {tuple(natural.shape)}; expected "
                         f"[S/block_size, S/block_size] = [{nb}, {nb}]")
    rows = _Rows.of(natural)
    w = block_costs(natural, hardware=hardware, shape=shape)
    seen: list[torch.Tensor] = []
    for _, blocks in candidates(natural, world_size, hardware=hardware, shape=shape):
        if not any(torch.equal(blocks, b) for b in seen):
            seen.append(blocks)
    pair_max = [float(w[b].view(world_size, -1).sum(1).max()) for b in seen]
    floor = min(pair_max)
    live = rows.first < nb
    starts = rows.first[live]
    plain = len(segments(natural)) == 1 and bool((starts == starts[:1]).all())   # e.g. causal
    best = None
    for blocks, pm in zip(seen, pair_max):
        if plain and pm > BALANCE_SLACK * floor + 1e-300:
            continue
        t = float(_predict(rows, blocks, world_size, block_size=block_size,
                           hardware=hardware, shape=shape).max())
        if best is None or t < best[0] * (1 - 1e-9):
            best = (t, blocks)
    order = (best[1][:, None] * block_size + torch.arange(block_size)).reshape(-1)
    return Layout("balanced", order, world_size)


def _deal_blocks(seq_len: int, world_size: int, block_size: int, block_work) -> Layout:
    """LPT deal of single blocks by ``block_work`` (the layout when no block map is given)."""
    nb = seq_len // block_size
    work = torch.as_tensor(block_work, dtype=torch.float64).flatten()
    if work.numel() != nb:
        raise ValueError(f"block_work has {work.numel()} entries; expected S/block_size={nb}")
    cap = nb // world_size
    load = [0.0] * world_size
    members: list[list[int]] = [[] for _ in range(world_size)]
    for b in torch.argsort(work, descending=True, stable=True).tolist():
        r = min((r for r in range(world_size) if len(members[r]) < cap), key=lambda r: load[r])
        members[r].append(b)
        load[r] += float(work[b])
    blocks = torch.tensor([b for m in members for b in sorted(m)], dtype=torch.int64)
    order = (blocks[:, None] * block_size + torch.arange(block_size)).reshape(-1)
    return Layout("balanced", order, world_size)


def _model(hardware, shape):
    from .runtime import costmodel
    hw = costmodel.get_hardware(hardware)
    sh = costmodel.Shape(**BALANCE_SHAPE) if shape is None else shape
    return costmodel, hw, sh


def block_costs(natural: torch.Tensor, *, hardware="cpu", shape=None) -> torch.Tensor:
    """Predicted seconds (forward + backward) of each q block's pairs, float64 ``[nb]``.

    Layout-independent (the pairs a q block needs do not depend on where it lives): FULL
    blocks cost a FULL pair each, PARTIAL blocks a causal one (most PARTIAL blocks of
    document and window masks are causal diagonals run with ``is_causal``). Kernel calls,
    which do depend on the layout, are counted by :func:`predict`.
    """
    cm, hw, sh = _model(hardware, shape)
    BHD = sh.batch * sh.heads * sh.head_dim
    unit = cm.FWD_FLOPS_PER_PAIR * BHD / hw.fwd_flops + cm.BWD_FLOPS_PER_PAIR * BHD / hw.bwd_flops
    n = torch.as_tensor(natural)
    full = (n == _FULL).sum(1).to(torch.float64)
    part = (n == _PARTIAL).sum(1).to(torch.float64)
    return unit * (full + hw.causal * part)       # per block_size**2 pairs: relative only


def predict(natural: torch.Tensor, blocks: torch.Tensor, world_size: int, *,
            block_size: int = DEFAULT_BLOCK_SIZE, hardware="cpu", shape=None) -> torch.Tensor:
    """Predicted seconds of one forward + backward per rank for a block order, float64 ``[P]``.

    Compute: the tiles of the ring schedule over this layout, each costed by
    :func:`fringe.runtime.costmodel.tile_work` (calls, FULL / masked / causal pairs, as
    :mod:`fringe.ops.tile` splits them; above :data:`EXACT_BLOCKS` blocks the calls are
    estimated from runs of blocks) with ``hardware``'s per-call and per-pair constants.
    Communication: kv chunk ``j`` travels the ring ``j -> j+1 -> ...`` up to the farthest
    rank that needs it (ring pruning); each hop costs latency plus bytes over bandwidth on
    both ends, three times (kv forward, kv again and dkv back in the backward), counted as
    not overlapped (on CPU gloo copies run on the same cores as the kernels).

    Args:
        natural: int8 ``[nb, nb]`` block map in sequence order.
        blocks: int64 ``[nb]``: the layout's blocks, rank 0's first (``order // block_size``
            taken per block).
        world_size: P.
        block_size: tokens per block.
        hardware, shape: as in :func:`balanced`.
    """
    return _predict(_Rows.of(torch.as_tensor(natural)), blocks, world_size,
                    block_size=block_size, hardware=hardware, shape=shape)


@dataclasses.dataclass(frozen=True)
class _Rows:
    """What :func:`_predict` needs from the natural block map, computed once per map."""

    natural: torch.Tensor     # int8 [nb, nb]
    nonempty: torch.Tensor    # bool [nb, nb]
    first: torch.Tensor       # int64 [nb]: first non-empty kv block of each q block (nb: none)
    full: torch.Tensor        # float64 [nb]: FULL blocks per q block
    part: torch.Tensor        # float64 [nb]: PARTIAL blocks per q block

    @classmethod
    def of(cls, natural: torch.Tensor) -> _Rows:
        nz = natural != _EMPTY
        nb = natural.shape[0]
        first = torch.where(nz, torch.arange(nb), nb).min(dim=1).values
        return cls(natural, nz, first, (natural == _FULL).sum(1).to(torch.float64),
                   (natural == _PARTIAL).sum(1).to(torch.float64))


def _predict(rows: _Rows, blocks: torch.Tensor, P: int, *, block_size: int, hardware,
             shape) -> torch.Tensor:
    import types

    cm, hw, sh = _model(hardware, shape)
    nb = rows.natural.shape[0]
    n = nb // P
    L = n * block_size
    BHD = sh.batch * sh.heads * sh.head_dim
    if nb <= EXACT_BLOCKS:
        bmap = rows.natural[blocks][:, blocks]
        grid = bmap.view(P, n, P, n)
        nonempty = (grid != _EMPTY).any(dim=3).any(dim=1)
        full = (grid == _FULL).all(dim=3).all(dim=1)
        tiles = torch.full((P, P), _PARTIAL, dtype=torch.int8)
        tiles[~nonempty] = _EMPTY
        tiles[full] = _FULL
        fake = types.SimpleNamespace(      # what the cost model reads of a Plan
            world_size=P, local_len=L, block_size=block_size, mask_mod=True, tiles=tiles,
            blocks=bmap, tile_blocks=lambda i, j: bmap[i * n:(i + 1) * n, j * n:(j + 1) * n])
        work = torch.as_tensor(cm.tile_work(fake)).sum(dim=1)               # [P, 4]
    else:
        work, nonempty = _approx_work(rows, blocks, P, block_size)
    secs = torch.zeros(P, dtype=torch.float64)
    for bwd in (False, True):
        unit = (cm.BWD_FLOPS_PER_PAIR if bwd else cm.FWD_FLOPS_PER_PAIR) * BHD / \
            (hw.bwd_flops if bwd else hw.fwd_flops)
        call = hw.bwd_call_s if bwd else hw.call_s
        calls, fp, mp, cp = (work[..., i] for i in range(4))
        secs += calls * call + unit * (fp + hw.masked * mp + hw.causal * cp)
    # ring hops: chunk j goes to (j + 1), ..., (j + d_j) where d_j is the farthest needer
    need = nonempty.clone()
    need.fill_diagonal_(False)
    dist = (torch.arange(P)[:, None] - torch.arange(P)[None, :]) % P      # [needer i, owner j]
    hops = torch.where(need, dist, torch.zeros_like(dist)).max(dim=0).values   # [P] per chunk
    moves = torch.zeros(P, dtype=torch.float64)        # sends + receives per rank
    for j, d in enumerate(hops.tolist()):
        for s in range(d):
            moves[(j + s) % P] += 1
            moves[(j + s + 1) % P] += 1
    kv = sh.buffer_bytes("kv", L)
    dkv = sh.buffer_bytes("dkv", L)
    per_move = 3 * hw.latency_s + (2 * kv + dkv) / hw.bandwidth
    return secs + moves * per_move


def _approx_work(rows: _Rows, blocks: torch.Tensor, P: int,
                 block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``[P, 4]`` (calls, full, masked, causal pairs) per rank estimated from runs of blocks,
    and the ``[P, P]`` non-empty tiles.

    A tile's calls: runs of its q rows that are non-empty against the kv chunk, broken where
    the next row is not the next block of the sequence or starts a new document (its first
    non-empty kv block is itself); a run on the rank's own chunk counts two (the causal
    diagonal and the rectangle below it). Pairs: FULL blocks full, PARTIAL blocks causal.
    """
    nb = blocks.numel()
    n = nb // P
    g = blocks.view(P, n)
    # live[r, k, j]: row k of rank r has a non-empty block in chunk j
    live = rows.nonempty[blocks][:, blocks].view(P, n, P, n).any(dim=3)
    starts_doc = rows.first[g] >= g
    consecutive = torch.zeros(P, n, dtype=torch.bool)
    consecutive[:, 1:] = (g[:, 1:] == g[:, :-1] + 1) & ~starts_doc[:, 1:]
    prev = torch.zeros_like(live)
    prev[:, 1:] = live[:, :-1]
    new_run = live & ~(prev & consecutive[:, :, None])
    calls = new_run.sum(dim=1).to(torch.float64)                              # [P, P]
    calls += torch.diag(torch.diagonal(calls))
    bs2 = float(block_size) ** 2
    full = rows.full[g].sum(dim=1) * bs2
    part = rows.part[g].sum(dim=1) * bs2
    work = torch.stack([calls.sum(dim=1), full, torch.zeros_like(full), part], dim=-1)
    return work, live.any(dim=1)


def segments(natural: torch.Tensor) -> list[tuple[int, int]]:
    """Runs ``[b0, b1)`` of blocks that no non-empty block pair crosses, in sequence order.

    A cut before block ``i`` is free when no q block at or after ``i`` needs a kv block
    before ``i`` and no q block before ``i`` needs one at or after ``i``: the boundaries of
    packed documents that fall on block boundaries. Empty rows and columns never cross.
    """
    n = torch.as_tensor(natural) != _EMPTY
    nb = n.shape[0]
    idx = torch.arange(nb)
    live = n.any(dim=1)
    lo = torch.where(live, torch.where(n, idx, nb).min(dim=1).values, torch.full_like(idx, nb))
    hi = torch.where(live, torch.where(n, idx + 1, 0).max(dim=1).values, torch.zeros_like(idx))
    # suffix min of lo over rows >= i; prefix max of hi over rows < i
    suf = torch.flip(torch.cummin(torch.flip(lo, [0]), 0).values, [0])
    pre = torch.cummax(hi, 0).values
    cuts = (torch.nonzero((suf[1:] >= idx[1:]) & (pre[:-1] <= idx[1:])).flatten() + 1).tolist()
    bounds = [0] + cuts + [nb]
    return [(a, b) for a, b in zip(bounds[:-1], bounds[1:])]


def candidates(natural: torch.Tensor, world_size: int, *, hardware="cpu",
               shape=None) -> list[tuple[str, torch.Tensor]]:
    """The block orders :func:`balanced` chooses from, as ``(name, blocks [nb])`` pairs."""
    P, nb = world_size, natural.shape[0]
    cap = nb // P
    w = block_costs(natural, hardware=hardware, shape=shape)
    out = [("contiguous", torch.arange(nb))]
    if nb % (2 * P) == 0:
        half = nb // (2 * P)
        ch = torch.arange(nb).view(2 * P, half)
        out.append(("zigzag", torch.cat([torch.cat([ch[r], ch[2 * P - 1 - r]]) for r in range(P)])))
    out.append(("segments", _pack_segments(segments(natural), w, P, cap)))
    out.append(("laps", _laps(w, P, cap)))
    return out


def _pack_segments(segs: list[tuple[int, int]], w: torch.Tensor, P: int, cap: int) -> torch.Tensor:
    """LPT over whole segments with capacity ``cap`` blocks; too-long ones cut in order."""
    pre = torch.cat([torch.zeros(1, dtype=torch.float64), w.cumsum(0)]).tolist()
    room = [cap] * P
    load = [0.0] * P
    members: list[list[int]] = [[] for _ in range(P)]
    order = sorted(segs, key=lambda s: (-(pre[s[1]] - pre[s[0]]), s[0]))
    for a, b in order:
        fits = [r for r in range(P) if room[r] >= b - a]
        if fits:
            r = min(fits, key=lambda r: (load[r], r))
            members[r].extend(range(a, b))
            room[r] -= b - a
            load[r] += pre[b] - pre[a]
            continue
        for r in range(P):              # too long: contiguous pieces on consecutive ranks
            if a == b:
                break
            take = min(room[r], b - a)
            if take:
                members[r].extend(range(a, a + take))
                room[r] -= take
                load[r] += pre[a + take] - pre[a]
                a += take
    return torch.tensor([b for m in members for b in sorted(m)], dtype=torch.int64)


def _laps(w: torch.Tensor, P: int, cap: int) -> torch.Tensor:
    """2P contiguous pieces, piece k on rank k mod P, sized so each rank's work is the mean.

    Lap one covers blocks ``[0, X)``, lap two ``[X, nb)``; rank r holds ``s_r`` blocks of lap
    one and ``cap - s_r`` of lap two. For each X on a grid, the ``s_r`` are chosen rank by
    rank (scanning every feasible size) to bring the rank's work closest to the mean; the X
    with the smallest max/mean wins.
    """
    nb = P * cap
    pre = torch.cat([torch.zeros(1, dtype=torch.float64), w.cumsum(0)])
    target = float(pre[-1]) / P
    best = None
    for X in range(0, nb + 1, max(1, nb // _LAP_OFFSETS)):   # ~_LAP_OFFSETS starts tried
        a, b, sizes, worst = 0, X, [], 0.0
        for r in range(P):
            lo = max(0, X - a - cap * (P - 1 - r))
            hi = min(cap, X - a)
            if lo > hi:
                break
            s = torch.arange(lo, hi + 1)
            f = pre[a + s] - pre[a] + pre[b + cap - s] - pre[b]
            k = int(torch.argmin((f - target).abs()))
            sizes.append(int(s[k]))
            worst = max(worst, float(f[k]))
            a, b = a + int(s[k]), b + cap - int(s[k])
        if len(sizes) == P and (best is None or worst < best[0] - 1e-15):
            best = (worst, X, sizes)
    _, X, sizes = best
    parts, a, b = [], 0, X
    for s in sizes:
        parts.append(torch.cat([torch.arange(a, a + s), torch.arange(b, b + cap - s)]))
        a, b = a + s, b + cap - s
    return torch.cat(parts)
