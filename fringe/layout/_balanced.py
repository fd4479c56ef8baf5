"""The balanced layout: a solver that chooses a block order for the mask, balanced first and
then the least predicted step time (kernel calls, pairs and the kv blocks its ranged hops
carry, per rank), keeping packed documents whole where that balances and cutting them where
a cut sends the fewest kv blocks (:func:`balanced`), and the prediction it scores candidates
with (:func:`predict`, :func:`block_costs`, :func:`segments`, :func:`candidates`). Public
names are re-exported by :mod:`fringe.layout`."""
from __future__ import annotations

import dataclasses
import functools
import math

import numpy as np
import torch

from ..masks import DEFAULT_BLOCK_SIZE, BlockMap
from ._layout import Layout, _check, _granularity_error
from ..cost import hardware as _hardware, work as _work   # the cost model's bottom layer

#: How many starting offsets the "laps" candidate of :func:`balanced` tries (a search budget).
_LAP_OFFSETS = 128  # not a block size

#: Shape the balanced layout predicts time for when none is given: the shape the ``cpu``
#: hardware preset was calibrated with (:func:`fringe.cost.calibrate.calibrate`'s defaults:
#: H=G=8, D=64, float32). Only the ratio of per-call to per-pair cost depends on it.
BALANCE_SHAPE = dict(batch=1, heads=8, kv_heads=8, head_dim=64, dtype="float32")

#: For masks with no document structure, :func:`balanced` considers only layouts whose heaviest
#: rank has at most this factor times the pair work (:func:`block_costs`) of the best balanced
#: candidate; calls and bytes decide among those.
BALANCE_SLACK = 1.05

#: For masks with document structure (or windows), :func:`balanced` considers only layouts
#: whose heaviest rank has at most ``1 + SPREAD`` times the mean pair work and the mean
#: non-empty blocks (or, where none does, of the best candidate): with ranged hops a split
#: document costs only the kv blocks that cross, so balance comes first and bytes decide
#: among the balanced layouts.
SPREAD = 0.04

#: ... but only among layouts predicted within ``1 + BALANCE_COST`` of the fastest candidate
#: (:func:`predict`): a layout that balances by moving far more kv than its balance saves
#: (e.g. long documents striped round the ring on a slow link) is not taken for balance.
BALANCE_COST = 0.10

#: :func:`balanced` takes, among the candidates predicted within this factor of the fastest,
#: the one whose ranged hops move the fewest kv blocks (then the fastest of those). The cost
#: model counts a hop's bytes and latency but not all it costs besides: measured with
#: whole-chunk hops (before ranged ones) on the 2-core CPU runner (4 gloo ranks, CPU seconds
#: per fwd+bwd step, S=8192, sliding window 512), a two-lap chain (4 hops) predicted 4% faster
#: than contiguous (3 hops) took 5% more CPU on its busiest rank and 8% more in all; on 16
#: documents (S=4096, P=4) one extra hop cost ~7x its modelled bytes/bandwidth. So a near tie
#: goes to the layout that sends less.
HOP_SLACK = 0.05

_EMPTY, _PARTIAL, _FULL = 0, 1, 2      # fringe.masks.BlockKind codes, as plain ints for numpy

#: :func:`predict` splits tiles into kernel calls exactly (the tile grouping of
#: :mod:`fringe.ops.tile`, through the cost model) up to this many blocks in the sequence, and
#: estimates calls from runs of blocks above it (planning 1M tokens stays a few seconds).
EXACT_BLOCKS = 512


def balanced(seq_len: int, world_size: int, *, block_size: int = DEFAULT_BLOCK_SIZE,
             block_work: torch.Tensor | None = None, natural=None,
             hardware="cpu", shape=None) -> Layout:
    """A balanced layout for the mask with the least predicted step time, among a few candidates.

    A rank computes its own q blocks against whatever kv they need, so what a layout decides
    is (1) the work of each rank, (2) how many kernel calls that work takes (scattered blocks
    fragment a tile into many small calls and break the causal diagonal runs that run with
    ``is_causal``) and (3) which kv blocks travel: a ring hop carries only the blocks its
    receiver and the ranks it forwards to read (ranged hops), so a document cut in two sends
    the blocks of it before the cut, once per rank on the way to the farthest reader. Dealing
    single blocks by work balances (1) perfectly and ruins (2) and (3); measured on CPU it was
    the slowest layout on document and window masks. So the candidates keep runs of blocks
    together, and the prediction counts all three:

    * ``contiguous`` and ``zigzag`` (the fixed layouts; zigzag is the fallback for masks
      with no document structure, such as plain causal);
    * *segments*: the sequence is cut where no non-empty block crosses (packed documents
      whose boundaries fall on blocks, read from the natural-order block map ``natural``);
      whole segments are packed by predicted work, heaviest first, onto the least loaded
      rank that has room (LPT with a capacity of ``L = S/P`` tokens); a segment too long for
      any rank is cut at block boundaries into contiguous pieces on consecutive ranks;
    * *chain*: the sequence is cut into ``2P`` contiguous pieces, piece ``k`` on rank
      ``k mod P`` (two laps round the ring; trailing pieces of lap two may be empty), with
      every piece non-empty and no document spanning a whole piece, so a piece needs kv only
      from the piece before it, on the previous rank: every kv chunk travels one hop, ``P``
      hops in all (``contiguous``: ``P - 1``, the fewest any layout of whole blocks can send
      when document boundaries fall inside blocks, since every rank but the one holding the
      first block then needs a peer's kv; zigzag: about ``P (P - 1)`` minus a few). The
      piece sizes minimise the heaviest rank's pair work (:func:`block_costs`) exactly, by
      dynamic programming over the ranks for every start of lap two (a greedy search above
      :data:`_LAP_DP_BUDGET` steps);
    * *chain2*: the same with a document allowed to span one whole piece (cut in three on
      consecutive ranks; its first chunk travels two hops): long documents that no cut in
      two balances (searched exactly within the budget, and only when the chain's heaviest
      rank is above :data:`CHAIN_BALANCED` times the mean pair work);
    * *laps*: the same pieces with no chaining rule (work spread like zigzag; documents
      may span several pieces), sizes chosen greedily rank by rank;
    * for masks with document structure (or windows) also *cheap*: two laps of non-empty
      pieces on consecutive ranks whose cuts send the fewest kv blocks in all
      (:func:`_cut_costs`: a cut sends the blocks of its document before it) among those
      whose every rank is within :data:`SPREAD` of the mean pair work and non-empty blocks
      (looser where none fits); searched exactly by dynamic programming within
      :data:`_LAP_DP_BUDGET`, greedily above it;
    * and *rotations*: laps of ``P`` equal pieces (fine through long documents, coarse
      through short ones), each group of laps rotated round the ring to keep the heaviest
      rank lightest (:func:`_rotations`), for sequences whose work piles up in a few long
      documents, where two laps of any sizes cannot balance.

    For a mask with no document structure (one segment, every q block's kv starting at the
    same block: causal, full, prefix-LM), candidates whose heaviest rank has more than
    :data:`BALANCE_SLACK` times the pair work of the best balanced one are dropped, so such
    masks are balanced even where kernel calls dominate (tiny blocks). For other masks the
    balance comes first: among the candidates predicted within :data:`BALANCE_COST` of the
    fastest, only those within :data:`SPREAD` of the mean (or of the best of them) in both pair
    work and non-empty blocks are kept (:func:`_balanced_enough`). The candidates left are
    scored by :func:`predict` (per rank: kernel calls and (q, kv) pairs of every tile from
    :func:`fringe.cost.work.tile_work`, forward and backward, plus the latency of its hops and
    the bytes of the kv blocks its ranged hops send and receive, not overlapped); among those
    whose slowest rank is within :data:`HOP_SLACK` of the fastest, the one that moves the
    fewest kv blocks wins, then the fastest of those (ties: the earlier candidate). When
    ring's contiguous layout is kept and itself predicted fastest (ties included), it is
    returned as is: the order is exactly :func:`contiguous`'s, so the plan is ring's plan.

    Several masks at once (the layer kinds of one model: full causal and sliding-window
    layers, sharing one layout): pass ``natural=[(map, weight), ...]``, e.g. each kind's map
    with its number of layers. The predicted time of a rank is then the weighted sum of its
    time under each map, block work is the weighted sum, segments are cut only where no map
    crosses, and the mask counts as "no document structure" only if every map does. A single
    pair ``[(map, 1)]`` gives the same layout as ``natural=map``.

    Everything is computed from the sparse map (rectangles: per-row FULL / PARTIAL counts,
    first and last non-empty block per row, runs of rows per kv chunk), so 1M tokens never
    densify the ``(S/block)^2`` map; a dense map is only painted for the exact call count of
    sequences of at most :data:`EXACT_BLOCKS` blocks.

    The constants come from ``hardware`` (a :class:`fringe.cost.hardware.Hardware` or a
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
        natural: the mask's block map in sequence order (``[S/block, S/block]`` blocks): a
            :class:`fringe.masks.BlockMap` (``masks.classify(mask, arange(S), arange(S),
            block_size=..., sparse=True)``; :func:`fringe.plan` passes it), the dense int8
            map, or a list of ``(map, weight)`` pairs (weights > 0, e.g. layers per mask).
        hardware: cost constants (default the ``cpu`` preset): a preset name or a
            :class:`fringe.cost.hardware.Hardware`; not ``"this"`` (a calibration made
            now differs between ranks: calibrate once, broadcast, pass the Hardware).
        shape: a :class:`fringe.cost.hardware.Shape` (default :data:`BALANCE_SHAPE`).

    Raises:
        ValueError: sizes that do not divide, a block map / work of the wrong size, or
            ``hardware="this"``.
        TypeError: ``natural`` of another type.
    """
    _check(seq_len, world_size, block_size)
    if seq_len % (world_size * block_size):
        raise _granularity_error(seq_len, world_size * block_size,
                                 f"P*block={world_size}*{block_size}")
    nb = seq_len // block_size
    if natural is None:
        if block_work is None:
            raise ValueError("balanced needs natural= (the mask's block map in sequence order, "
                             "from fringe.masks.classify) or block_work= (per-block work)")
        return _deal_blocks(seq_len, world_size, block_size, block_work)
    rows = _rows_of(natural, nb)
    w = _block_costs(rows, hardware, shape)
    nz = _block_counts(rows)
    segs = _segments(rows)
    plain = len(segs) == 1 and all(r.plain for r in rows)        # e.g. causal
    seen: list[torch.Tensor] = []
    for _, blocks in _candidates(w, segs, nb, world_size, _reach(rows),
                                 cheap=None if plain else (_cut_costs(rows), nz)):
        if not any(torch.equal(blocks, b) for b in seen):
            seen.append(blocks)
    pred = {}

    def predicted(i: int) -> tuple[float, float]:
        if i not in pred:
            t, moved = _predict_moves(rows, seen[i], world_size, block_size=block_size,
                                      hardware=hardware, shape=shape)
            pred[i] = (float(t.max()), moved)
        return pred[i]
    times = None if plain else [predicted(i)[0] for i in range(len(seen))]
    keep = _balanced_enough(w, nz, seen, world_size, plain=plain, times=times)
    scored = [(*predicted(i), seen[i]) for i, k in enumerate(keep) if k]
    fastest = min(t for t, _, _ in scored)
    ring = scored[0] if torch.equal(scored[0][2], seen[0]) else None    # contiguous, if scored
    if ring is not None and ring[0] <= fastest:
        best = ring                           # ring's layout predicted fastest: exactly ring's
    else:
        close = [c for c in scored if c[0] <= fastest * (1 + HOP_SLACK)]
        fewest = min(h for _, h, _ in close)  # then the fastest of those; ties: the earlier
        best = min((c for c in close if c[1] <= fewest + 1e-9), key=lambda c: c[0])
    order = (best[2][:, None] * block_size + torch.arange(block_size)).reshape(-1)
    return Layout("balanced", order, world_size)


def _balanced_enough(w: torch.Tensor, nz: torch.Tensor, orders: list[torch.Tensor], P: int, *,
                     plain: bool, times: list[float] | None = None) -> list[bool]:
    """Which block orders :func:`balanced` chooses among: for a mask with no document
    structure, those whose heaviest rank's pair work ``w`` is within :data:`BALANCE_SLACK` of
    the best order's; otherwise, among the orders predicted (``times``: the slowest rank's
    seconds) within ``1 + BALANCE_COST`` of the fastest, those within ``1 + SPREAD`` of
    ``max(mean, best of them)`` in both pair work and non-empty blocks ``nz`` (else those
    within ``1 + SPREAD`` of the best pair work)."""
    heavy = [(float(w[b].view(P, -1).sum(1).max()), float(nz[b].view(P, -1).sum(1).max()))
             for b in orders]
    if plain:
        floor_w = min(h for h, _ in heavy)
        return [h <= BALANCE_SLACK * floor_w + 1e-300 for h, _ in heavy]
    cheap = [t <= (1 + BALANCE_COST) * min(times) for t in times]
    floor_w = min(h for (h, _), c in zip(heavy, cheap) if c)
    floor_b = min(b for (_, b), c in zip(heavy, cheap) if c)
    lim_w = (1 + SPREAD) * max(floor_w, float(w.sum()) / P) * (1 + 1e-12)
    lim_b = (1 + SPREAD) * max(floor_b, float(nz.sum()) / P) * (1 + 1e-12)
    keep = [c and h <= lim_w and b <= lim_b for (h, b), c in zip(heavy, cheap)]
    if not any(keep):
        keep = [c and h <= (1 + SPREAD) * floor_w * (1 + 1e-12) for (h, _), c in zip(heavy, cheap)]
    return keep


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
    if isinstance(hardware, str) and hardware == "this":
        raise ValueError("hardware='this' calibrates now, and measured constants differ from "
                         "rank to rank and call to call, so ranks would plan different layouts; "
                         "run costmodel.calibrate() once (on rank 0, broadcast the Hardware to "
                         "every rank) and pass that Hardware, or use a preset such as 'cpu'")
    hw = _hardware.get_hardware(hardware)
    sh = _hardware.Shape(**BALANCE_SHAPE) if shape is None else shape
    return _hardware, hw, sh


@dataclasses.dataclass(frozen=True, eq=False)
class _Rows:
    """What the prediction needs from one natural-order block map, computed once per map
    from its rectangles (O(rectangles + blocks), no dense map)."""

    bm: object                # fringe.masks.BlockMap [nb, nb] in sequence order
    weight: float             # its weight in a sum of maps (1 for a single map)
    first: torch.Tensor       # int64 [nb]: first non-empty kv block of each q block (nb: none)
    end: torch.Tensor         # int64 [nb]: one past its last non-empty kv block (0: none)
    full: torch.Tensor        # float64 [nb]: FULL blocks per q block
    part: torch.Tensor        # float64 [nb]: PARTIAL blocks per q block

    @classmethod
    def of(cls, bm, weight: float = 1.0) -> _Rows:
        first, end = bm.row_spans()
        full, part = bm.row_kind_counts()
        return cls(bm, float(weight), first, end, full.to(torch.float64), part.to(torch.float64))

    @property
    def nb(self) -> int:
        return self.bm.shape[0]

    @property
    def plain(self) -> bool:
        """Every non-empty q block's kv starts at the same block (causal, full, prefix-LM)."""
        starts = self.first[self.first < self.nb]
        return bool((starts == starts[:1]).all())

    @functools.cached_property
    def dense(self) -> torch.Tensor:
        """The dense map (only for :data:`EXACT_BLOCKS`-sized sequences)."""
        return self.bm.dense(limit=EXACT_BLOCKS * EXACT_BLOCKS)


def _rows_of(natural, nb: int | None) -> list[_Rows]:
    """``natural`` (a BlockMap, a dense map, or ``[(map, weight), ...]``) as per-map rows."""
    def one(m, where: str):
        if isinstance(m, BlockMap):
            bm = m
        elif isinstance(m, torch.Tensor) or hasattr(m, "__array__"):
            bm = BlockMap.from_dense(torch.as_tensor(m))
        else:
            raise TypeError(f"{where} must be a fringe.masks.BlockMap (masks.classify(..., "
                            f"sparse=True)) or a dense int8 block map, got {type(m).__name__}")
        if nb is not None and tuple(bm.shape) != (nb, nb):
            raise ValueError(f"{where} block map has shape {tuple(bm.shape)}; expected "
                             f"[S/block_size, S/block_size] = [{nb}, {nb}]")
        if bm.shape[0] != bm.shape[1]:
            raise ValueError(f"{where} block map has shape {tuple(bm.shape)}; a natural-order "
                             f"map is square (q and kv are the same sequence)")
        return bm

    if isinstance(natural, (list, tuple)):
        if not natural:
            raise ValueError("natural=[] has no maps; give [(block_map, weight), ...]")
        rows = []
        for k, pair in enumerate(natural):
            if not (isinstance(pair, (list, tuple)) and len(pair) == 2):
                raise TypeError(f"natural[{k}] must be a (block_map, weight) pair, got "
                                f"{type(pair).__name__}; pass natural=[(map, layers), ...]")
            m, wt = pair
            if isinstance(wt, bool) or not isinstance(wt, (int, float)) or not \
                    math.isfinite(wt) or wt <= 0:
                raise ValueError(f"natural[{k}] has weight {wt!r}; a weight is a finite number "
                                 f"> 0 (e.g. the number of layers with that mask)")
            bm = one(m, f"natural[{k}]")
            if rows and bm.shape != rows[0].bm.shape:
                raise ValueError(f"natural[{k}] block map has shape {tuple(bm.shape)} but "
                                 f"natural[0] has {tuple(rows[0].bm.shape)}; classify every mask "
                                 f"over the same sequence and block size")
            rows.append(_Rows.of(bm, wt))
        return rows
    return [_Rows.of(one(natural, "natural"))]


def _block_costs(rows: list[_Rows], hardware, shape) -> torch.Tensor:
    cm, hw, sh = _model(hardware, shape)
    BHD = sh.batch * sh.heads * sh.head_dim
    unit = cm.FWD_FLOPS_PER_PAIR * BHD / hw.fwd_flops + cm.BWD_FLOPS_PER_PAIR * BHD / hw.bwd_flops
    total = None
    for r in rows:
        w = r.weight * (unit * (r.full + hw.causal * r.part))   # per block_size**2 pairs
        total = w if total is None else total + w             # (relative only); x * 1.0 == x
    return total


def _block_counts(rows: list[_Rows]) -> torch.Tensor:
    """float64 ``[nb]``: non-empty blocks of each q block row (weighted over the maps): the
    work :meth:`fringe.plan.Plan.stats` balances."""
    total = None
    for r in rows:
        c = r.weight * (r.full + r.part)
        total = c if total is None else total + c
    return total


def block_costs(natural, *, hardware="cpu", shape=None) -> torch.Tensor:
    """Predicted seconds (forward + backward) of each q block's pairs, float64 ``[nb]``.

    Layout-independent (the pairs a q block needs do not depend on where it lives): FULL
    blocks cost a FULL pair each, PARTIAL blocks a causal one (most PARTIAL blocks of
    document and window masks are causal diagonals run with ``is_causal``). Kernel calls,
    which do depend on the layout, are counted by :func:`predict`. ``natural`` as in
    :func:`balanced` (a list of ``(map, weight)`` pairs: the weighted sum).
    """
    return _block_costs(_rows_of(natural, None), hardware, shape)


def predict(natural, blocks: torch.Tensor, world_size: int, *,
            block_size: int = DEFAULT_BLOCK_SIZE, hardware="cpu", shape=None) -> torch.Tensor:
    """Predicted seconds of one forward + backward per rank for a block order, float64 ``[P]``.

    Compute: the tiles of the ring schedule over this layout, each costed by
    :func:`fringe.cost.work.tile_work` (calls, FULL / masked / causal pairs, as
    :mod:`fringe.ops.tile` splits them; above :data:`EXACT_BLOCKS` blocks the calls are
    estimated from runs of blocks) with ``hardware``'s per-call and per-pair constants.
    Communication: kv chunk ``j`` travels the ring ``j -> j+1 -> ...`` up to the farthest
    rank that needs it (ring pruning), each hop carrying the blocks the rest of its route
    reads (ranged hops: a block travels to its own farthest reader, :func:`_ranged_moves`);
    each hop costs latency on both ends, and each block it carries bytes over bandwidth,
    three times (kv forward, kv again and dkv back in the backward), counted as not
    overlapped (on CPU gloo copies run on the same cores as the kernels).

    Args:
        natural: the block map in sequence order, as in :func:`balanced`: a
            :class:`fringe.masks.BlockMap`, the dense int8 ``[nb, nb]`` map, or a list of
            ``(map, weight)`` pairs (then the weighted sum of the per-map times).
        blocks: int64 ``[nb]``: the layout's blocks, rank 0's first (``order // block_size``
            taken per block).
        world_size: P.
        block_size: tokens per block.
        hardware, shape: as in :func:`balanced`.
    """
    blocks = torch.as_tensor(blocks, dtype=torch.int64).flatten()
    rows = _rows_of(natural, None)
    nb = rows[0].nb
    if blocks.numel() != nb or nb % world_size:
        raise ValueError(f"blocks has {blocks.numel()} entries for a map of {nb} blocks and "
                         f"P={world_size}; expected a permutation of range({nb}), {nb} divisible "
                         f"by P")
    return _predict(rows, blocks, world_size, block_size=block_size, hardware=hardware,
                    shape=shape)


def _predict(rows: list[_Rows], blocks: torch.Tensor, P: int, *, block_size: int, hardware,
             shape) -> torch.Tensor:
    return _predict_moves(rows, blocks, P, block_size=block_size, hardware=hardware,
                          shape=shape)[0]


def _predict_moves(rows: list[_Rows], blocks: torch.Tensor, P: int, *, block_size: int,
                   hardware, shape) -> tuple[torch.Tensor, float]:
    """(:func:`predict`'s seconds per rank, the kv blocks the forward's ranged hops carry,
    summed over the maps with their weights)."""
    if len(rows) == 1 and rows[0].weight == 1.0:
        return _predict_one(rows[0], blocks, P, block_size=block_size, hardware=hardware,
                            shape=shape)
    total = torch.zeros(P, dtype=torch.float64)
    hops = 0.0
    for r in rows:
        t, h = _predict_one(r, blocks, P, block_size=block_size, hardware=hardware, shape=shape)
        total += r.weight * t
        hops += r.weight * h
    return total, hops


def _predict_one(rows: _Rows, blocks: torch.Tensor, P: int, *, block_size: int, hardware,
                 shape) -> tuple[torch.Tensor, float]:
    cm, hw, sh = _model(hardware, shape)
    nb = rows.nb
    n = nb // P
    L = n * block_size
    BHD = sh.batch * sh.heads * sh.head_dim
    if nb <= EXACT_BLOCKS:
        bmap = rows.dense[blocks][:, blocks]
        grid = bmap.view(P, n, P, n)
        nonempty = (grid != _EMPTY).any(dim=3).any(dim=1)
        full = (grid == _FULL).all(dim=3).all(dim=1)
        tiles = torch.full((P, P), _PARTIAL, dtype=torch.int8)
        tiles[~nonempty] = _EMPTY
        tiles[full] = _FULL
        work = torch.as_tensor(_work.dense_tile_work(tiles, bmap, block_size=block_size)
                               ).sum(dim=1)                                 # [P, 4]
        needer, chunk = torch.nonzero(nonempty, as_tuple=True)
    else:
        work, needer, chunk = _approx_work(rows, blocks, P, block_size)
    secs = torch.zeros(P, dtype=torch.float64)
    for bwd in (False, True):
        unit = (cm.BWD_FLOPS_PER_PAIR if bwd else cm.FWD_FLOPS_PER_PAIR) * BHD / \
            (hw.bwd_flops if bwd else hw.fwd_flops)
        call = hw.bwd_call_s if bwd else hw.call_s
        calls, fp, mp, cp = (work[..., i] for i in range(4))
        secs += calls * call + unit * (fp + hw.masked * mp + hw.causal * cp)
    moves = _ring_moves(needer, chunk, P)
    blocks_moved, total = _ranged_moves(rows, blocks, P)
    kv = sh.buffer_bytes("kv", block_size)
    dkv = sh.buffer_bytes("dkv", block_size)
    comm = moves * 3 * hw.latency_s + blocks_moved * (2 * kv + dkv) / hw.bandwidth
    return secs + comm, total


def _ring_moves(needer: torch.Tensor, chunk: torch.Tensor, P: int) -> torch.Tensor:
    """Sends + receives per rank, float64 ``[P]``, when kv chunk ``j`` goes round the ring
    ``j -> j+1 -> ... -> j+d_j``, ``d_j`` the distance to the farthest rank that needs it
    (``needer[k]`` needs ``chunk[k]``; a rank's own chunk travels nowhere)."""
    off = needer != chunk
    dist = (needer[off] - chunk[off]) % P
    hops = torch.zeros(P, dtype=torch.int64).scatter_reduce_(0, chunk[off], dist, "amax")
    j = torch.arange(P)
    diff = torch.zeros(2 * P + 1, dtype=torch.int64)
    for lo, hi in ((j, j + hops), (j + 1, j + hops + 1)):      # sends at j..j+d-1, receives j+1..j+d
        diff.index_add_(0, lo, torch.ones(P, dtype=torch.int64))
        diff.index_add_(0, hi, -torch.ones(P, dtype=torch.int64))
    cnt = diff.cumsum(0)
    return (cnt[:P] + cnt[P:2 * P]).to(torch.float64)


def _runs(owner: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Runs of equal ``owner`` along the blocks: (start [R], end [R], run id of each block)."""
    nb = owner.numel()
    new = torch.ones(nb, dtype=torch.bool)
    new[1:] = owner[1:] != owner[:-1]
    start = torch.nonzero(new).flatten()
    end = torch.cat([start[1:], torch.tensor([nb])])
    return start, end, new.cumsum(0) - 1


def _expand(lo: torch.Tensor, hi: torch.Tensor, rid: torch.Tensor):
    """For intervals ``[lo, hi)`` of blocks: (interval index, run index) of every run each
    interval touches."""
    a, b = rid[lo], rid[hi - 1]
    cnt = b - a + 1
    idx = torch.repeat_interleave(torch.arange(lo.numel()), cnt)
    run = a[idx] + torch.arange(idx.numel()) - torch.repeat_interleave(cnt.cumsum(0) - cnt, cnt)
    return idx, run


def _approx_work(rows: _Rows, blocks: torch.Tensor, P: int,
                 block_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``[P, 4]`` (calls, full, masked, causal pairs) per rank estimated from runs of blocks,
    and the non-empty tiles as (q rank, kv rank) index pairs (possibly repeated).

    A tile's calls: runs of its q rows that are non-empty against the kv chunk, broken where
    the next row is not the next block of the sequence or starts a new document (its first
    non-empty kv block is itself); a run on the rank's own chunk counts two (the causal
    diagonal and the rectangle below it). Pairs: FULL blocks full, PARTIAL blocks causal.

    Computed from the rectangles: each is split at the runs of kv blocks one rank holds,
    the row intervals live against each kv chunk are merged, split at the runs of q blocks
    one rank holds, and each piece counts one call plus one per break inside it.
    """
    nb = blocks.numel()
    n = nb // P
    pos = torch.empty(nb, dtype=torch.int64)
    pos[blocks] = torch.arange(nb)               # layout row of each sequence block
    owner = pos // n
    rs, re, rid = _runs(owner)
    # cont[g]: the row before g in the layout is g - 1, on the same rank, in the same document
    cont = torch.zeros(nb, dtype=torch.bool)
    cont[1:] = (pos[1:] % n != 0) & (pos[1:] - 1 == pos[:-1]) & \
        (rows.first[1:] < torch.arange(1, nb))
    brk = torch.cat([torch.zeros(1, dtype=torch.int64), (~cont).to(torch.int64).cumsum(0)])
    # rows live against each kv chunk: rectangles x kv runs, merged per chunk
    R = rows.bm.rects
    k, run = _expand(R[:, 2], R[:, 3], rid)
    j = owner[rs[run]]
    key0 = j * (nb + 1) + R[k, 0]
    key1 = j * (nb + 1) + R[k, 1]
    order = torch.argsort(key0)
    key0, key1 = key0[order], key1[order]
    reach = torch.cummax(key1, 0).values
    new = torch.ones(key0.numel(), dtype=torch.bool)
    new[1:] = key0[1:] > reach[:-1]
    grp = new.cumsum(0) - 1
    ng = int(grp[-1]) + 1 if grp.numel() else 0
    a = key0[new]
    b = torch.zeros(ng, dtype=torch.int64).scatter_reduce_(0, grp, key1, "amax", include_self=False)
    jj = torch.div(a, nb + 1, rounding_mode="floor")
    a, b = a - jj * (nb + 1), b - jj * (nb + 1)
    # split at the runs of q rows one rank holds
    i, run = _expand(a, b, rid)
    lo = torch.maximum(a[i], rs[run])
    hi = torch.minimum(b[i], re[run])
    q_rank, kv_rank = owner[rs[run]], jj[i]
    count = 1 + brk[hi] - brk[lo + 1]            # the piece's first row and every break after it
    count = count * (1 + (q_rank == kv_rank).to(torch.int64))
    calls = torch.zeros(P, dtype=torch.float64).index_add_(0, q_rank, count.to(torch.float64))
    bs2 = float(block_size) ** 2
    g = blocks.view(P, n)
    full = rows.full[g].sum(dim=1) * bs2
    part = rows.part[g].sum(dim=1) * bs2
    work = torch.stack([calls, full, torch.zeros_like(full), part], dim=-1)
    return work, q_rank, kv_rank


def _segments(rows: list[_Rows]) -> list[tuple[int, int]]:
    lo, hi = rows[0].first, rows[0].end
    for r in rows[1:]:
        lo, hi = torch.minimum(lo, r.first), torch.maximum(hi, r.end)
    nb = lo.numel()
    idx = torch.arange(nb)
    # suffix min of lo over rows >= i; prefix max of hi over rows < i
    suf = torch.flip(torch.cummin(torch.flip(lo, [0]), 0).values, [0])
    pre = torch.cummax(hi, 0).values
    cuts = (torch.nonzero((suf[1:] >= idx[1:]) & (pre[:-1] <= idx[1:])).flatten() + 1).tolist()
    bounds = [0] + cuts + [nb]
    return [(a, b) for a, b in zip(bounds[:-1], bounds[1:])]


def segments(natural) -> list[tuple[int, int]]:
    """Runs ``[b0, b1)`` of blocks that no non-empty block pair crosses, in sequence order.

    A cut before block ``i`` is free when no q block at or after ``i`` needs a kv block
    before ``i`` and no q block before ``i`` needs one at or after ``i``: the boundaries of
    packed documents that fall on block boundaries. Empty rows and columns never cross.
    ``natural`` as in :func:`balanced` (several maps: cut only where none crosses).
    """
    return _segments(_rows_of(natural, None))


def candidates(natural, world_size: int, *, hardware="cpu",
               shape=None) -> list[tuple[str, torch.Tensor]]:
    """The block orders :func:`balanced` chooses from, as ``(name, blocks [nb])`` pairs."""
    rows = _rows_of(natural, None)
    segs = _segments(rows)
    plain = len(segs) == 1 and all(r.plain for r in rows)
    return _candidates(_block_costs(rows, hardware, shape), segs, rows[0].nb,
                       world_size, _reach(rows),
                       cheap=None if plain else (_cut_costs(rows), _block_counts(rows)))


def _candidates(w: torch.Tensor, segs: list[tuple[int, int]], nb: int, P: int,
                reach: torch.Tensor, cheap=None) -> list[tuple[str, torch.Tensor]]:
    cap = nb // P
    out = [("contiguous", torch.arange(nb))]
    if cheap is not None:                   # (cut costs, non-empty blocks per row)
        cost, nz = cheap
        out.append(("rotations", _rotations(w, P, cap, cost)))
        laps = None
        for f in (1, 2, 4):                 # SPREAD, else looser until a layout fits
            lim_w = (1 + f * SPREAD) * float(w.sum()) / P
            lim_b = (1 + f * SPREAD) * float(nz.sum()) / P
            if _lap_steps(P, cap) <= _LAP_DP_BUDGET:
                laps = _cheap_exact(w, P, cap, cost, lim_w, nz, lim_b)
            else:
                laps = _cheap_greedy(w, P, cap, cost, f * SPREAD * float(w.sum()) / P)
            if laps is not None:
                out.append(("cheap", laps))
                break
    if nb % (2 * P) == 0:
        half = nb // (2 * P)
        ch = torch.arange(nb).view(2 * P, half)
        out.append(("zigzag", torch.cat([ch[:P], ch.flip(0)[:P]], dim=1).reshape(-1)))
    out.append(("segments", _pack_segments(segs, w, P, cap)))
    search = _laps_exact if _lap_steps(P, cap) <= _LAP_DP_BUDGET else _laps
    chain = search(w, P, cap, reach)
    if chain is not None:
        out.append(("chain", chain))
    mean = float(w.sum()) / P
    if (chain is None or float(w[chain].view(P, cap).sum(1).max()) > CHAIN_BALANCED * mean) \
            and _lap_steps(P, cap) * (cap + 1) <= _LAP_DP_BUDGET:
        chain = _chain_two(w, P, cap, reach)
        if chain is not None:
            out.append(("chain2", chain))
    out.append(("laps", _laps(w, P, cap)))
    return out


def _pack_segments(segs: list[tuple[int, int]], w: torch.Tensor, P: int, cap: int) -> torch.Tensor:
    """LPT over whole segments with capacity ``cap`` blocks; too-long ones cut in order."""
    pre_t = torch.cat([torch.zeros(1, dtype=torch.float64), w.cumsum(0)])
    pre = pre_t.tolist()
    room = np.full(P, cap, dtype=np.int64)
    load = np.zeros(P, dtype=np.float64)
    owner = np.empty(P * cap, dtype=np.int64)
    order = sorted(segs, key=lambda s: (-(pre[s[1]] - pre[s[0]]), s[0]))
    for a, b in order:
        fits = room >= b - a
        if fits.any():
            r = int(np.argmin(np.where(fits, load, np.inf)))     # least load, then lowest rank
            owner[a:b] = r
            room[r] -= b - a
            load[r] += pre[b] - pre[a]
            continue
        for r in range(P):              # too long: contiguous pieces on consecutive ranks
            if a == b:
                break
            take = min(int(room[r]), b - a)
            if take:
                owner[a:a + take] = r
                room[r] -= take
                load[r] += pre[a + take] - pre[a]
                a += take
    return torch.from_numpy(np.argsort(owner, kind="stable"))


def _laps(w: torch.Tensor, P: int, cap: int,
          reach: torch.Tensor | None = None) -> torch.Tensor | None:
    """2P contiguous pieces, piece k on rank k mod P, sized so each rank's work is the mean.

    Lap one covers blocks ``[0, X)``, lap two ``[X, nb)``; rank r holds ``s_r`` blocks of lap
    one and ``cap - s_r`` of lap two. For each X on a grid, the ``s_r`` are chosen rank by
    rank (scanning every feasible size) to bring the rank's work closest to the mean; the X
    with the smallest max/mean wins. (All X are searched at once, rank by rank.)

    With ``reach`` (int64 ``[nb]``: the first kv block any q block at or after each block
    needs, :func:`_reach`), the pieces are also *chained*: none is empty, and no q block
    after a piece needs kv before it (a document never spans a whole piece), so every piece
    needs kv only from the piece before it, which sits on the previous rank of the ring:
    each kv chunk travels one hop, P hops in all (contiguous: P - 1). ``None`` when no
    chained sizes exist.
    """
    nb = P * cap
    pre = torch.cat([torch.zeros(1, dtype=torch.float64), w.cumsum(0)]).numpy()
    target = float(pre[-1]) / P
    # offsets that become infeasible run on with indices up to 2 nb + cap: pad, do not clip
    pre = np.concatenate([pre, np.full(nb + cap, pre[-1])])
    chained = reach is not None
    if chained:
        if cap < 2:
            return None
        suf = np.concatenate([reach.numpy(), np.full(nb + 2 * cap + 1, 3 * nb + 1)])
    X = np.arange(0, nb + 1, max(1, nb // _LAP_OFFSETS))   # ~_LAP_OFFSETS starts tried
    m = X.size
    a, b = np.zeros(m, dtype=np.int64), X.copy()
    ok = np.ones(m, dtype=bool)
    worst = np.zeros(m, dtype=np.float64)
    sizes = np.zeros((m, P), dtype=np.int64)
    s = np.arange(cap + 1)
    rows = np.arange(m)
    for r in range(P):
        lo = np.maximum(0, X - a - cap * (P - 1 - r))
        hi = np.minimum(cap, X - a)
        if chained:
            lo, hi = np.maximum(lo, 1), np.minimum(hi, cap - 1)
        f = pre[a[:, None] + s] - pre[a][:, None] + pre[b[:, None] + (cap - s)] - pre[b][:, None]
        dev = np.abs(f - target)
        dev[(s < lo[:, None]) | (s > hi[:, None])] = np.inf
        if chained:        # nothing after either piece reaches back before it
            dev[(suf[a[:, None] + s] < a[:, None]) |
                (suf[b[:, None] + (cap - s)] < b[:, None])] = np.inf
        k = np.argmin(dev, axis=1)
        ok &= np.isfinite(dev[rows, k])
        k = np.where(ok, k, 0)
        sizes[:, r] = k
        worst = np.maximum(worst, f[rows, k])
        a = a + k
        b = b + (cap - k)
    best = None
    for x in range(m):
        if ok[x] and (best is None or worst[x] < best[0] - 1e-15):
            best = (float(worst[x]), int(X[x]), sizes[x].tolist())
    if best is None:
        return None
    _, X, sizes = best
    parts, a, b = [], 0, X
    for s in sizes:
        parts.append(torch.cat([torch.arange(a, a + s), torch.arange(b, b + cap - s)]))
        a, b = a + s, b + cap - s
    return torch.cat(parts)


#: The exact (dynamic programming) search of :func:`_laps_exact` runs when offsets x ranks x
#: blocks x piece sizes stays under this many steps; larger sequences use the greedy search.
_LAP_DP_BUDGET = 2 * 10**7  # not a block size


#: :func:`_candidates` searches *chain2* only when the one-hop chain's heaviest rank has more
#: than this factor times the mean pair work (else the extra hops cannot pay).
CHAIN_BALANCED = 1.02


def _lap_steps(P: int, cap: int) -> int:
    nb = P * cap
    return len(range(1, nb, max(1, nb // _LAP_OFFSETS))) * P * (nb + 1) * (cap + 1)


def _laps_exact(w: torch.Tensor, P: int, cap: int,
                reach: torch.Tensor | None = None) -> torch.Tensor | None:
    """:func:`_laps` with the piece sizes chosen to minimise the heaviest rank's work exactly
    (dynamic programming over ranks: the state is how far lap one has got, which fixes lap
    two), for every offset X at once. Same pieces and chaining rule; ``None`` when none fit."""
    nb = P * cap
    pre = torch.cat([torch.zeros(1, dtype=torch.float64), w.cumsum(0)]).numpy()
    pre = np.concatenate([pre, np.full(2 * nb + 2 * cap + 2, pre[-1])])
    chained = reach is not None
    if chained:
        if cap < 2:
            return None
        suf = np.concatenate([reach.numpy(), np.full(2 * nb + 2 * cap + 2, 3 * nb + 1)])
    X = np.arange(1, nb, max(1, nb // _LAP_OFFSETS))       # both laps non-empty
    m = X.size
    if m == 0:
        return None
    pos = np.arange(nb + 1)
    dp = np.full((m, nb + 1), np.inf)
    dp[:, 0] = 0.0
    choice = np.zeros((P, m, nb + 1), dtype=np.int64)
    s_lo = 1 if chained else 0
    for r in range(P):
        a = pos[None, :]                                   # lap one so far: [0, a)
        b = X[:, None] + r * cap - a                      # lap two so far: [X, b)
        live = np.isfinite(dp) & (b >= X[:, None]) & (b <= nb)
        bc = np.clip(b, 0, nb)
        new = np.full((m, nb + 1), np.inf)
        arg = np.zeros((m, nb + 1), dtype=np.int64)
        for sz in range(s_lo, cap + 1):
            a2, b2 = a + sz, bc + (cap - sz)
            ok = live & (a2 <= X[:, None])
            if chained:                   # nothing after either piece reaches back before it
                ok &= (suf[np.minimum(a2, nb)] >= a) & (suf[np.minimum(b2, nb)] >= bc)
                if sz == cap:             # an empty lap-two piece only once lap two is done
                    ok &= bc == nb
            f = np.maximum(dp, pre[np.minimum(a2, nb)] - pre[a] + pre[np.minimum(b2, nb)] - pre[bc])
            f = np.where(ok, f, np.inf)
            sl = slice(sz, nb + 1)                         # a + sz: the state shifts by sz
            better = f[:, :nb + 1 - sz] < new[:, sl]
            new[:, sl] = np.where(better, f[:, :nb + 1 - sz], new[:, sl])
            arg[:, sl] = np.where(better, sz, arg[:, sl])
        dp = new
        choice[r] = arg
    final = dp[np.arange(m), X]                           # lap one ends exactly at X
    if not np.isfinite(final).any():
        return None
    x = int(np.argmin(final))                             # ties: the smallest X
    sizes, a = [], int(X[x])
    for r in range(P - 1, -1, -1):
        sz = int(choice[r, x, a])
        sizes.append(sz)
        a -= sz
    sizes.reverse()
    parts, a, b = [], 0, int(X[x])
    for sz in sizes:
        parts.append(torch.cat([torch.arange(a, a + sz), torch.arange(b, b + cap - sz)]))
        a, b = a + sz, b + cap - sz
    return torch.cat(parts)


def _chain_two(w: torch.Tensor, P: int, cap: int, reach: torch.Tensor) -> torch.Tensor | None:
    """The chained :func:`_laps_exact` with a document allowed to span one whole piece: a
    piece needs kv only from the two pieces before it (a long document is cut in three on
    consecutive ranks, its first chunk travelling two hops). The state also holds the
    previous rank's lap-one size, which fixes where the previous pieces start; the piece
    before rank 0's lap-two piece is taken as starting ``cap`` blocks back (the search only
    shapes the candidates: :func:`predict` counts the hops of whatever it returns)."""
    nb = P * cap
    if cap < 2:
        return None
    pre = torch.cat([torch.zeros(1, dtype=torch.float64), w.cumsum(0)]).numpy()
    pre = np.concatenate([pre, np.full(2 * nb + 2 * cap + 2, pre[-1])])
    suf = np.concatenate([reach.numpy(), np.full(2 * nb + 2 * cap + 2, 3 * nb + 1)])
    X = np.arange(1, nb, max(1, nb // _LAP_OFFSETS))
    m = X.size
    if m == 0:
        return None
    sp = np.arange(cap + 1)[None, None, :]                # [1, 1, cap+1]: previous lap-one size
    dp = np.full((m, nb + 1, cap + 1), np.inf)
    dp[:, 0, 0] = 0.0
    back = np.zeros((P, m, nb + 1, cap + 1), dtype=np.int64)
    Xc = X[:, None, None]
    for r in range(P):
        A = min(r * cap, nb) + 1                          # lap one has got at most r * cap far
        cur = dp[:, :A]
        a = np.arange(A)[None, :, None]                   # [1, A, 1]: lap one so far
        b = Xc + r * cap - a                              # [m, A, 1]: lap two so far
        live = np.isfinite(cur) & (b >= Xc) & (b <= nb)
        bc = np.clip(b, 0, nb)
        prev1 = a - sp                                    # start of the previous lap-one piece
        prev2 = (bc - (cap - sp)) if r else (Xc - cap)    # ... and of the piece before lap two's
        new = np.full((m, nb + 1, cap + 1), np.inf)
        for sz in range(1, cap + 1):
            n = min(A, nb + 1 - sz)                       # states that stay inside the sequence
            if n <= 0:
                break
            a2, b2 = np.minimum(a + sz, nb), np.minimum(bc + (cap - sz), nb)
            ok = live & (a + sz <= Xc) & (suf[a2] >= prev1) & (suf[b2] >= prev2)
            if sz == cap:
                ok &= bc == nb
            f = np.maximum(cur, pre[a2] - pre[a] + pre[b2] - pre[bc])
            f = np.where(ok, f, np.inf)                   # [m, A, cap+1] over previous sizes
            k = np.argmin(f, axis=2)
            val = np.take_along_axis(f, k[:, :, None], axis=2)[:, :, 0]
            new[:, sz:sz + n, sz] = val[:, :n]
            back[r, :, sz:sz + n, sz] = k[:, :n]
        dp = new
    final = dp[np.arange(m), X]                           # [m, cap+1]: lap one ends at X
    if not np.isfinite(final).any():
        return None
    x, last = np.unravel_index(int(np.argmin(final)), final.shape)
    sizes, pos, cur = [], int(X[x]), int(last)
    for r in range(P - 1, -1, -1):
        sizes.append(cur)
        prev = int(back[r, x, pos, cur])
        pos, cur = pos - cur, prev
    sizes.reverse()
    parts, a0, b0 = [], 0, int(X[x])
    for sz in sizes:
        parts.append(torch.cat([torch.arange(a0, a0 + sz), torch.arange(b0, b0 + cap - sz)]))
        a0, b0 = a0 + sz, b0 + cap - sz
    return torch.cat(parts)


def _reach(rows: list[_Rows]) -> torch.Tensor:
    """int64 ``[nb]``: the first kv block that any q block at or after each block needs (in
    any map; ``nb`` past the last non-empty row): a suffix minimum of the rows' first block."""
    lo = rows[0].first
    for r in rows[1:]:
        lo = torch.minimum(lo, r.first)
    return torch.flip(torch.cummin(torch.flip(lo, [0]), 0).values, [0])


# ---- ranged hops: what a split costs ---------------------------------------------------------
def _cut_costs(rows: list[_Rows]) -> np.ndarray:
    """int64 ``[nb + 1]``: kv blocks a cut before block ``c`` makes a chain send: the blocks
    ``[reach[c], c)`` that q blocks at or after ``c`` attend (0 at ``c = 0`` and ``nb``, and
    where no non-empty block crosses). For document and window masks every block of that span
    is attended (a document's prefix, a window's width), so along a chain of pieces on
    consecutive ranks (each piece's kv relayed on by the ranks that read it) the ranged
    hops of the forward carry exactly the sum of the costs of the cuts. Only a search
    estimate: :func:`predict` counts the blocks of any order."""
    nb = rows[0].nb
    reach = _reach(rows).numpy()
    c = np.arange(nb + 1)
    out = np.zeros(nb + 1, dtype=np.int64)
    out[:nb] = np.maximum(0, c[:nb] - np.minimum(reach, c[:nb]))
    return out


def _ranged_moves(rows: _Rows, blocks: torch.Tensor, P: int) -> tuple[torch.Tensor, float]:
    """Forward kv blocks each rank sends + receives, float64 ``[P]``, and their total over
    the hops, when each kv chunk goes round the ring only as far as its farthest reader and
    every hop carries the blocks the rest of the route reads (ranged hops: a block ``k`` of
    rank ``j`` travels ``e_k`` hops, ``e_k`` the ring distance to the farthest rank whose q
    blocks attend it)."""
    nb = blocks.numel()
    n = nb // P
    pos = torch.empty(nb, dtype=torch.int64)
    pos[blocks] = torch.arange(nb)
    owner = pos // n
    rs, re, rid = _runs(owner)
    R = rows.bm.rects
    if not len(R):
        return torch.zeros(P, dtype=torch.float64), 0.0
    k, run = _expand(R[:, 0], R[:, 1], rid)          # rectangle rows split at q-rank runs
    q_rank = owner[rs[run]]
    c0, c1 = R[k, 2], R[k, 3]
    # the q ranks reading each column: a rectangle's column range for each of its q ranks
    # (merged per q rank first, so a document's rows on one rank count once)
    key0 = q_rank * (nb + 1) + c0
    key1 = q_rank * (nb + 1) + c1
    o = torch.argsort(key0)
    key0, key1 = key0[o], key1[o]
    hi = torch.cummax(key1, 0).values
    new = torch.ones(key0.numel(), dtype=torch.bool)
    new[1:] = key0[1:] > hi[:-1]
    grp = new.cumsum(0) - 1
    a = key0[new]
    b = torch.zeros(int(grp[-1]) + 1, dtype=torch.int64).scatter_reduce_(
        0, grp, key1, "amax", include_self=False)
    i = torch.div(a, nb + 1, rounding_mode="floor")
    a, b = a - i * (nb + 1), b - i * (nb + 1)
    w = b - a
    col = torch.repeat_interleave(a, w) + torch.arange(int(w.sum())) - \
        torch.repeat_interleave(w.cumsum(0) - w, w)
    dist = (torch.repeat_interleave(i, w) - owner[col]) % P
    far = torch.zeros(nb, dtype=torch.int64).scatter_reduce_(0, col, dist, "amax")
    total = float(far.sum())
    j = owner
    diff = torch.zeros(2 * P + 1, dtype=torch.float64)
    one = torch.ones(nb, dtype=torch.float64)
    for lo, hi_ in ((j, j + far), (j + 1, j + far + 1)):    # sent at j..j+e-1, received j+1..j+e
        diff.index_add_(0, lo, one)
        diff.index_add_(0, hi_, -one)
    cnt = diff.cumsum(0)
    return cnt[:P] + cnt[P:2 * P], total


def _lap_parts(sizes: list[int], X: int, cap: int) -> torch.Tensor:
    parts, a, b = [], 0, X
    for sz in sizes:
        parts.append(torch.cat([torch.arange(a, a + sz), torch.arange(b, b + cap - sz)]))
        a, b = a + sz, b + cap - sz
    return torch.cat(parts)


def _cheap_exact(w: torch.Tensor, P: int, cap: int, cost: np.ndarray,
                 wmax: float, blocks_w: torch.Tensor | None = None,
                 bmax: float = math.inf) -> torch.Tensor | None:
    """Two laps of non-empty pieces (rank ``r`` holds piece ``r`` of each lap; trailing pieces
    of lap two may be empty) with the least summed cut cost (:func:`_cut_costs`) among those
    whose every rank's work is at most ``wmax`` (and non-empty blocks ``blocks_w`` at most
    ``bmax``): dynamic programming over the ranks for every
    start of lap two on a grid (the state is how far lap one has got, which fixes lap two).
    ``None`` when none fits."""
    nb = P * cap
    if cap < 2:
        return None
    pre = torch.cat([torch.zeros(1, dtype=torch.float64), w.cumsum(0)]).numpy()
    bw = w if blocks_w is None else blocks_w
    preb = torch.cat([torch.zeros(1, dtype=torch.float64), bw.to(torch.float64).cumsum(0)]).numpy()
    cst = cost.astype(np.float64)
    X = np.arange(1, nb, max(1, nb // _LAP_OFFSETS))
    m = X.size
    if m == 0:
        return None
    pos = np.arange(nb + 1)
    dp = np.full((m, nb + 1), np.inf)
    dp[:, 0] = 0.0
    choice = np.zeros((P, m, nb + 1), dtype=np.int64)
    lim = wmax * (1 + 1e-12)
    for r in range(P):
        a = pos[None, :]
        b = X[:, None] + r * cap - a
        live = np.isfinite(dp) & (b >= X[:, None]) & (b <= nb)
        bc = np.clip(b, 0, nb)
        start = dp + cst[a] + np.where(bc < nb, cst[bc], 0.0)   # the cuts this rank's pieces open
        new = np.full((m, nb + 1), np.inf)
        arg = np.zeros((m, nb + 1), dtype=np.int64)
        for sz in range(1, cap + 1):
            a2, b2 = np.minimum(a + sz, nb), np.minimum(bc + (cap - sz), nb)
            ok = live & (a + sz <= X[:, None]) & (bc + (cap - sz) <= nb)
            if sz == cap:                  # an empty lap-two piece only once lap two is done
                ok &= bc == nb
            ok &= pre[a2] - pre[a] + pre[b2] - pre[bc] <= lim
            ok &= preb[a2] - preb[a] + preb[b2] - preb[bc] <= bmax * (1 + 1e-12)
            f = np.where(ok, start, np.inf)
            sl = slice(sz, nb + 1)
            better = f[:, :nb + 1 - sz] < new[:, sl]
            new[:, sl] = np.where(better, f[:, :nb + 1 - sz], new[:, sl])
            arg[:, sl] = np.where(better, sz, arg[:, sl])
        dp = new
        choice[r] = arg
    final = dp[np.arange(m), X]
    if not np.isfinite(final).any():
        return None
    x = int(np.argmin(final))
    sizes, a = [], int(X[x])
    for r in range(P - 1, -1, -1):
        sz = int(choice[r, x, a])
        sizes.append(sz)
        a -= sz
    sizes.reverse()
    return _lap_parts(sizes, int(X[x]), cap)


def _cheap_greedy(w: torch.Tensor, P: int, cap: int, cost: np.ndarray,
                  slack: float) -> torch.Tensor | None:
    """:func:`_cheap_exact` searched greedily (for sequences past its budget): rank by rank,
    the piece sizes that keep the work so far within ``slack / 2`` of ``r + 1`` means
    (cumulative, so errors do not add up) and open the cheapest cuts; the closest to the
    target where none does. Every start of lap two on a grid at once; the cheapest start
    whose ranks all fit ``mean + slack`` wins, else the one whose heaviest rank is least
    over the mean."""
    nb = P * cap
    if cap < 2:
        return None
    pre = torch.cat([torch.zeros(1, dtype=torch.float64), w.cumsum(0)]).numpy()
    target = np.full(P, float(pre[-1]) / P)
    cum_t = np.cumsum(target)
    band = slack / 2                          # half the slack for each end of a rank's work
    pre = np.concatenate([pre, np.full(2 * cap + 2, pre[-1])])
    cst = np.concatenate([cost.astype(np.float64), np.zeros(2 * cap + 2)])
    X = np.arange(1, nb, max(1, nb // _LAP_OFFSETS))
    m = X.size
    s = np.arange(1, cap + 1)[None, :]
    rows = np.arange(m)
    a, b = np.zeros(m, dtype=np.int64), X.copy()
    ok = np.ones(m, dtype=bool)
    worst = np.full(m, -np.inf)
    spent = cst[X].copy()                     # the cut where lap two starts
    sizes = np.zeros((m, P), dtype=np.int64)
    for r in range(P):
        a2, b2 = a[:, None] + s, b[:, None] + (cap - s)
        feas = (a2 <= X[:, None]) & (b2 <= nb)
        feas &= (s > 0) & ((s < cap) | (b[:, None] == nb))
        if r == P - 1:
            feas &= a2 == X[:, None]
        f = pre[a2] - pre[a][:, None] + pre[b2] - pre[b][:, None]
        cum = pre[a2] + pre[b2] - pre[X][:, None]            # work of ranks 0..r
        err = np.abs(cum - cum_t[r])
        nxt = np.where(a2 < X[:, None], cst[a2], 0.0) + np.where(b2 < nb, cst[b2], 0.0)
        inband = feas & (err <= band) & (f <= target[r] + slack)
        key = np.where(inband, nxt, np.inf)
        pick_band = np.argmin(key, axis=1)
        close = np.where(feas, err, np.inf)
        pick_close = np.argmin(close, axis=1)
        has = np.isfinite(key[rows, pick_band])
        k = np.where(has, pick_band, pick_close)
        ok &= np.isfinite(close[rows, pick_close])
        sizes[:, r] = s[0, k]
        worst = np.maximum(worst, f[rows, k] - target[r])
        spent += nxt[rows, k]
        a, b = a2[rows, k], b2[rows, k]
    ok &= (a == X) & (b == nb)
    if not ok.any():
        return None
    fits = ok & (worst <= slack * (1 + 1e-12))
    x = int(np.argmin(np.where(fits, spent, np.inf))) if fits.any() else \
        int(np.argmin(np.where(ok, worst, np.inf)))
    return _lap_parts(sizes[x].tolist(), int(X[x]), cap)



#: :func:`_rotations` cuts a lap into pieces of ``g`` blocks, ``g`` the largest power of two up
#: to :data:`ROT_BLOCKS` whose pieces each hold at most this fraction of a rank's mean work.
ROT_PIECE = 0.10
ROT_BLOCKS = 32  # blocks, not tokens
#: ... and gives two consecutive laps one rotation when the cut between them sends more
#: than this many kv blocks (:func:`_cut_costs`), so that cut is one hop, not a relay round
#: the ring through ranks that do not read the blocks.
ROT_LINK = 24
#: Rounds of :func:`_rotations`' second pass (each group's rotation chosen again).
ROT_ROUNDS = 4


#: Rotations :func:`_rotated_tops` sums at a time (an ``[n, P]`` float64 block: 8 MB).
ROT_CELLS = 1 << 20


def _rotated_tops(tot: np.ndarray, piece: np.ndarray) -> np.ndarray:
    """``[max_r tot[r] + piece[(r - rho) % P] for rho in range(P)]``: the heaviest rank when
    a lap's pieces are rotated by ``rho``. The rotations are windows of the pieces written
    twice (views, no ``[P, P]`` index), summed a block of rotations at a time: at P=4,096 a
    ``[P, P]`` gather and sum were 268 MB of fresh pages per lap group and round."""
    P = len(piece)
    win = np.lib.stride_tricks.sliding_window_view(np.concatenate([piece, piece])[1:], P)
    out = np.empty(P)                   # win[i] is the rotation rho = P - 1 - i
    n = max(1, ROT_CELLS // max(P, 1))
    for a in range(0, P, n):
        out[a:a + n] = (win[a:a + n] + tot).max(axis=1)
    return out[::-1]


def _rotations(w: torch.Tensor, P: int, cap: int, cost: np.ndarray) -> torch.Tensor:
    """Laps of ``P`` equal pieces dealt round the ring, each lap rotated to keep the heaviest
    rank lightest.

    The sequence is cut into laps in order; a lap is ``P`` pieces of ``g`` blocks (the
    largest power of two up to :data:`ROT_BLOCKS` whose pieces hold at most
    :data:`ROT_PIECE` of a rank's mean work: fine pieces through long documents, coarse ones
    through short), and ``sum g = cap``, so every rank holds exactly ``cap`` blocks. Piece
    ``j`` of a lap goes to rank ``(j + rho) mod P``: consecutive pieces sit on consecutive
    ranks (a document's kv relayed only through ranks that read it), and ``rho``, chosen lap
    by lap (heaviest pieces first), keeps the heaviest rank's work least (LPT over
    rotations). For masks whose work is spread unevenly along the sequence (long documents
    among short ones), where two laps cannot balance."""
    nb = P * cap
    C = torch.cat([torch.zeros(1, dtype=torch.float64), w.cumsum(0)]).numpy()
    mean = C[-1] / P
    laps, pos, used = [], 0, 0
    while used < cap:
        g = min(ROT_BLOCKS, cap - used)
        g = 1 << (g.bit_length() - 1) if g < cap - used or g == ROT_BLOCKS else g
        while g > 1 and np.diff(C[pos + np.arange(P + 1) * g]).max() > ROT_PIECE * mean:
            g //= 2
        laps.append((pos, g))
        pos, used = pos + P * g, used + g
    # laps whose boundary cuts a document deeper than ROT_LINK blocks share one rotation
    group = np.cumsum([0] + [int(cost[a] > ROT_LINK) ^ 1 for a, _ in laps[1:]])
    pw = np.zeros((int(group[-1]) + 1, P))
    for (a, g), k in zip(laps, group):
        pw[k] += np.diff(C[a + np.arange(P + 1) * g])
    tot = np.zeros(P)
    rot = np.zeros(len(pw), dtype=np.int64)
    for k in sorted(range(len(pw)), key=lambda k: (-pw[k].max(), k)):
        rot[k] = int(np.argmin(_rotated_tops(tot, pw[k])))
        tot = tot + np.roll(pw[k], rot[k])
    for _ in range(ROT_ROUNDS):         # then each group again, given all the others
        for k in sorted(range(len(pw)), key=lambda k: (-pw[k].max(), k)):
            rest = tot - np.roll(pw[k], rot[k])
            top = _rotated_tops(rest, pw[k])
            if top.min() < top[rot[k]]:
                rot[k] = int(np.argmin(top))
            tot = rest + np.roll(pw[k], rot[k])
    rho = rot[group].tolist()
    owner = np.concatenate([np.repeat((np.arange(P) + r) % P, g) for (_, g), r in zip(laps, rho)])
    return torch.from_numpy(np.argsort(owner, kind="stable"))
