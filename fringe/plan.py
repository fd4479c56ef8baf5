"""Plans: a schedule lowered for one mask, sequence length and world size.

>>> import fringe
>>> from fringe import masks, schedules
>>> p = fringe.plan(schedules.ring(), masks.causal(), seq_len=512, world_size=4, block_size=32)
>>> p.tiles.tolist()[3]     # rank 3's queries against each rank's kv: 2 FULL, 1 PARTIAL
[2, 2, 2, 1]
>>> p.block_map             # the classification as rectangles, cut at tile boundaries
BlockMap(16 x 16 blocks, 34 rects, 120 full, 16 partial)
"""
from __future__ import annotations

import dataclasses
import hashlib
import math
import operator
import warnings
from typing import Callable

import torch

from . import _auto, masks as _masks
from .masks._blockmap import _paint
from .masks._guard import guard as _guard_state, rebound as _rebound
from ._handle import new_handle
from ._stats import PlanStats, _OpCounts, _op_counts  # noqa: F401 (re-exported)
from .layout import DEFAULT_BLOCK_SIZE, Layout
from .ops import get_kernel
from .ops.reference import apply_score_mod
from .runtime.contract import PlanCache, PlanLike as PlanLike   # the runtime's view of a plan
from .schedules import KVPolicy, Program, Schedule, check, reverse
from .schedules.base import AUTO
from .schedules.ir import ProgramTable
from .schedules.passes import BlockNeed, narrow, shared_columns

BlockKind = _masks.BlockKind


@dataclasses.dataclass(frozen=True, eq=False)
class Plan:
    """Everything the interpreter needs, computed once per mask.

    Attributes:
        schedule: the schedule it was built from.
        mask_mod: the mask (global positions).
        layout: which tokens each rank holds.
        block_size: mask-classification block, in tokens.
        block_map: the block classification, sparse (:class:`fringe.masks.BlockMap`):
            rectangles of FULL / PARTIAL blocks, rows and columns in layout order (rank 0's
            blocks first), none crossing a tile boundary. :meth:`tile_blocks` gives one
            tile's dense map; :attr:`blocks` the whole dense ``[S/block, S/block]`` map
            (small plans only).
        tiles: int8 ``[P, P]``: the kind of tile (q of rank i, kv of rank j).
        forward / backward: one program per rank.
        kv: the :class:`~fringe.KVPolicy` (how the backward gets kv again).
        score_mod, scale, kernel: passed to the tile ops.
        batch_size, num_heads: the B and H the mask was classified for, and the only ones a
            call may use (another raises before any communication). None: any; the mask
            is declared or proven not to depend on b / h (FlexAttention's ``B=None,
            H=None``). A mask evaluated per scalar index and not declared
            ``bh_invariant=True`` records 1 for the one :func:`plan` was not given (see
            :func:`classified_bh`).
        score_params: tensors the score_mod reads that require grad (found by
            :func:`captured_params`, or given); attention returns their gradients.
        reads_batch: the mask or the score_mod depends on ``b`` (``torch.func.vmap`` then
            runs each vmapped slice alone instead of folding it into the batch).
        handle: set on construction: the plan's name for fringe's custom op.
        cache: set on construction: the :class:`~fringe.runtime.contract.PlanCache` of what
            is derived from the plan in this process (positions, tile maps, digests, head
            shifts, the cost model's columns), each entry written by the one module it names.
            Never compared, copied or pickled: a copy starts with an empty one.

    The runtime and autograd read a plan through
    :class:`~fringe.runtime.contract.PlanLike` (``fringe.plan.PlanLike``): those members and
    no others.

    Mutable state. A plan is immutable, and two rules keep it so:

    * accessors that compute or hand out tensors (:meth:`positions`, :meth:`tile_blocks`,
      :attr:`blocks`, :meth:`tile_block_counts`, ``layout.positions`` / ``shard`` /
      ``owner``) return **copies** or new tensors: edit them freely;
    * the tensors the plan holds as attributes (``layout.order``, ``tiles``,
      ``block_map.rects`` / ``codes``, the tensors its ``mask_mod`` and ``score_mod``
      captured, e.g. document ids) are its state: read them, never write them. Their
      ``_version`` is recorded when the plan is built and checked on every call
      (:meth:`check_unchanged`, run by :func:`fringe.attention` and the virtual mesh before
      any communication): an in-place edit raises instead of running a plan whose
      classification, programs and digest no longer describe it. :meth:`digests` is cached
      only while those versions are unchanged. ``score_params`` are exempt: they are the
      live learnable tensors, meant to change.
    * what the mask_mod and score_mod read through objects the snapshot cannot copy (a bound
      method's ``self.doc_ids``, a closure's ``batch.ids``) is recorded by identity too:
      rebinding it (``docs.doc_ids = next_ids``) makes the next call raise, naming the
      attribute (parameters excepted; ``nn.Module.training`` where the code reads it; only
      the attributes the code can read: a step counter beside them is not recorded).
    """

    schedule: Schedule
    mask_mod: Callable
    layout: Layout
    block_size: int
    block_map: _masks.BlockMap
    tiles: torch.Tensor
    forward: tuple[Program, ...]
    backward: tuple[Program, ...]
    kv: KVPolicy = KVPolicy.RESEND
    score_mod: Callable | None = None
    scale: float | None = None
    kernel: str | None = None
    batch_size: int | None = None
    num_heads: int | None = None
    score_params: tuple = ()
    reads_batch: bool = False
    #: whether :func:`plan` gave hops block ranges (``ranges=``; the programs say what moves)
    ranges: bool = True
    #: a 0-d int64 tensor naming this plan to fringe's custom op (:mod:`fringe._handle`), so
    #: ``torch.compile`` guards on tensor metadata, not on the plan: no recompile per batch
    handle: torch.Tensor = dataclasses.field(init=False, repr=False, compare=False)
    cache: PlanCache = dataclasses.field(default_factory=PlanCache, init=False, repr=False,
                                         compare=False)
    #: True for a plan :func:`plan` built (kept by copies and pickles); False for one made by
    #: ``Plan(...)`` or ``dataclasses.replace(plan, ...)``, whose tiles, block map and programs
    #: were derived from other fields than it holds: :meth:`check_unchanged` refuses to run it
    made_by_plan: bool = dataclasses.field(default=False, init=False, repr=False, compare=False)

    def __setstate__(self, state: dict) -> None:
        """A copied or unpickled plan gets a handle and an empty cache of its own (handles are
        per process; the copy's tensors are others, at their versions now)."""
        for name, value in state.items():
            object.__setattr__(self, name, value)
        object.__setattr__(self, "cache", PlanCache())
        self._guard()
        object.__setattr__(self, "handle", new_handle(self))

    def __post_init__(self) -> None:
        object.__setattr__(self, "made_by_plan", _MAKING[0] > 0)
        self._guard()
        object.__setattr__(self, "handle", new_handle(self))

    def __getstate__(self) -> dict:
        """The plan's fields, less its handle and cache: a copy or a pickle gets its own
        (recording its tensors' versions afresh, so a plan edited in place is refused here:
        its copy would pass every later check)."""
        self._check_versions()
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if f.name not in _LOCAL_FIELDS}

    def _guard(self) -> list:
        """``(what, tensor, version)`` of every tensor of the plan's state
        (``cache.guarded``), and the bindings of what its mask_mod and score_mod read through
        objects (``cache.bindings``). Recorded when the plan is built, copied or unpickled."""
        if self.cache.guarded is None:
            tensors, self.cache.bindings = _covered(self)
            self.cache.guarded = [(what, t, t._version) for what, t in tensors]
        return self.cache.guarded

    def _versions(self) -> tuple[int, ...]:
        return tuple(t._version for _, t, _ in self._guard())

    def check_unchanged(self) -> None:
        """Raise if a tensor of the plan's state was edited in place since it was built, or a
        value its mask_mod or score_mod reads through an object was rebound.

        Covers ``layout.order``, ``tiles``, ``block_map``, the tensors the mask_mod and the
        score_mod captured (``score_params`` excepted) and the plan's own cached positions
        and tile maps, by version; and by identity what the mask_mod and score_mod read that
        :func:`fringe.masks.snapshot` cannot copy: the attributes of a bound method's instance
        or of an object a closure or global holds (``self.doc_ids``, ``batch.ids``,
        ``self.cfg.ids``; an ``nn.Module``'s buffers and submodules, not its parameters;
        only the attributes the code can read, ``training`` included where it does), list items and lengths, dict entries, closure cells, the globals a
        bound method loads (:func:`fringe.masks._guard.guard`). Cheap (one ``_version`` read
        per tensor, one identity compare per value); runs on every call.

        Raises:
            ValueError: naming the edited tensor or the rebound attribute (``mask_mod reads
                self.doc_ids, rebound since the plan was made``) and the fix; or the plan was
                not built by :func:`plan` (``dataclasses.replace(plan, mask_mod=...)`` keeps
                the old mask's tiles and programs: a wrong answer, not an error, if it ran).
        """
        if not self.made_by_plan:
            raise ValueError(
                f"{self!r} was not built by fringe.plan (it was made with Plan(...) or "
                f"dataclasses.replace), so its tiles, block map and programs were derived from "
                f"other fields than it holds (a replaced mask_mod, kv, layout or programs would "
                f"run on the old classification: a wrong answer, not an error); call "
                f"fringe.plan(schedule, mask_mod, ...) with what you changed")
        self._check_versions()

    def _check_versions(self) -> None:
        """Raise if a tensor of the plan's state was edited in place since it was built, or a
        value its mask_mod or score_mod reads through an object was rebound."""
        guarded = self._guard()
        for what, binds in self.cache.bindings:
            hit = _rebound(binds)
            if hit is not None:
                path, how = hit
                raise ValueError(
                    f"{self!r}: {what} reads {path}, {how}: {_REBOUND_WHY[what]} (a wrong "
                    f"answer, not an error, if it ran). {_REBOUND_FIX[what]}. If the {what} "
                    f"itself sets {path} when called, it keeps state the plan cannot see: keep "
                    f"that state out of the objects it reads")
        for what, t, v in guarded:
            if t._version != v:
                raise ValueError(
                    f"{self!r}: {what} was edited in place after the plan was built, so the "
                    f"plan's block classification, programs and digest no longer describe it "
                    f"(a wrong answer, not an error, if it ran). A plan is immutable: edit a "
                    f"copy (layout.positions(rank), plan.positions(rank) and plan.tile_blocks() "
                    f"return copies; tensor.clone() for the rest) and build a new plan for "
                    f"changed data")

    def _cached(self, cache: dict, what: str, key, make):
        """``make()`` cached under ``key`` in ``cache`` (an entry of :attr:`cache`; internal:
        never handed out; its version is guarded like the plan's own tensors)."""
        guard = self._guard()
        hit = cache.get(key)
        if hit is None:
            hit = cache[key] = make()
            guard.append((f"the plan's cached {what} {key} (a mask_mod or kernel wrote into "
                          f"its arguments?)", hit, hit._version))
        return hit

    # ---- sizes ---------------------------------------------------------------------
    @property
    def world_size(self) -> int:
        return self.layout.world_size

    @property
    def seq_len(self) -> int:
        return self.layout.seq_len

    @property
    def local_len(self) -> int:
        return self.layout.local_len

    # ---- per tile ------------------------------------------------------------------
    def positions(self, rank: int, device: torch.device | str | None = None) -> torch.Tensor:
        """Global positions of ``rank``'s tokens (int64 ``[L]`` on ``device``): a **copy**,
        yours to edit (the runtime's cached tensor is never handed out)."""
        return self._positions(rank, device).clone()

    def _positions(self, rank: int, device: torch.device | str | None = None) -> torch.Tensor:
        """The runtime's cached positions (per rank and device; internal, never handed out:
        the tile kernels' call cache keys on this very object and its ``_version``)."""
        return self._cached(self.cache.positions, "positions", (rank, str(device or "cpu")),
                            lambda: self.layout.positions(rank).to(device or "cpu"))

    def tile_kind(self, i: int, j: int) -> BlockKind:
        return BlockKind(int(self.tiles[i, j]))

    @property
    def blocks(self) -> torch.Tensor:
        """The dense int8 ``[S/block, S/block]`` block map in layout order, built on demand
        from :attr:`block_map` (tests, small plans).

        Raises:
            ValueError: above :data:`fringe.masks.DENSE_LIMIT` blocks (use
                :meth:`tile_blocks` or ``block_map.dense(rows=, cols=)``).
        """
        return self.block_map.dense()

    def _tile_index(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Rectangles grouped by tile: ``(sorted tile keys i*P+j, order, counts)``."""
        idx = self.cache.tile_index
        if idx is None:
            n, P = self.local_len // self.block_size, self.world_size
            r = self.block_map.rects
            key = torch.div(r[:, 0], n, rounding_mode="floor") * P + \
                torch.div(r[:, 2], n, rounding_mode="floor")
            key, order = key.sort(stable=True)
            idx = self.cache.tile_index = (key, order)
        return idx

    def tile_blocks(self, i: int, j: int) -> torch.Tensor:
        """int8 ``[L/block, L/block]`` block map of tile (q of rank i, kv of rank j): a
        **copy**, yours to edit (the runtime's cached map is never handed out)."""
        return self._tile_blocks(i, j).clone()

    def _tile_blocks(self, i: int, j: int) -> torch.Tensor:
        """The runtime's cached :meth:`tile_blocks` (built from :attr:`block_map` on first
        use; a rank reads its own row of tiles: ``P * (L/block)^2`` bytes). Internal."""
        return self._cached(self.cache.tiles, "tile", (i, j), lambda: self._paint_tile(i, j))

    def _paint_tile(self, i: int, j: int) -> torch.Tensor:
        n, P = self.local_len // self.block_size, self.world_size
        kind = int(self.tiles[i, j])
        if kind == BlockKind.FULL:
            out = torch.full((n, n), int(BlockKind.FULL), dtype=torch.int8)
        elif kind == BlockKind.EMPTY:
            out = torch.zeros((n, n), dtype=torch.int8)
        else:
            key, order = self._tile_index()
            t = i * P + j
            a, b = int(torch.searchsorted(key, t)), int(torch.searchsorted(key, t, right=True))
            sel = order[a:b]
            out = _paint(self.block_map.rects[sel], self.block_map.codes[sel],
                         i * n, (i + 1) * n, j * n, (j + 1) * n)
        return out

    def tile_block_counts(self) -> torch.Tensor:
        """int64 ``[P, P]``: non-empty blocks of each tile."""
        P, n = self.world_size, self.local_len // self.block_size
        return _tile_areas(self.block_map, P, n)[0]

    def digests(self) -> dict[str, str]:
        """One content digest per component that decides the numbers. Ranks exchange these
        on every call.

        Cached while the tensors they cover are unchanged: the cache is keyed on the
        ``_version`` of every tensor :meth:`check_unchanged` guards, so an in-place edit of
        plan state hashes again (and :meth:`check_unchanged` raises before any call runs).

        ``layout``: the permutation; ``programs``: schedule name, forward and backward
        programs; ``blocks``: the block classification; ``mask``: the mask's content
        (:func:`fringe.masks.digest`: factory parameters such as document ids, window and
        prefix sizes; for plain callables the mask evaluated over every PARTIAL block);
        ``score_mod``: :func:`fringe.masks.fn_digest` of the score_mod (code, constants,
        captured tensors' values and the attributes of the objects it is bound to or reads;
        learnable tensors by shape and dtype only) and the shapes
        of ``score_params``; ``options``: scale, kernel, kv policy, block size, B / H the
        mask was classified for.
        """
        vers = self._versions()
        cached = self.cache.digests
        if cached and cached[0] == vers:
            return cached[1]

        def sha(*parts) -> str:
            h = hashlib.sha1()
            for part in parts:
                h.update(part if isinstance(part, bytes) else str(part).encode())
                h.update(b"\0")
            return h.hexdigest()[:16]

        progs = hashlib.sha1(self.schedule.name.encode())
        for programs in (self.forward, self.backward):
            # columns: no op objects built (millions at P=1024); equal programs digest
            # equal however they were built or pickled
            progs.update(ProgramTable.of(programs).digest().encode())
        out = {
            "layout": sha(self.layout.fingerprint(), self.layout.order.numpy().tobytes()),
            "programs": progs.hexdigest()[:16],
            "blocks": sha(self.tiles.numpy().tobytes(), self.block_map.shape,
                          self.block_map.rects.numpy().tobytes(),
                          self.block_map.codes.numpy().tobytes()),
            "mask": _masks.digest(self.mask_mod, order=self.layout.order,
                                  blocks=self.block_map,
                                  block_size=self.block_size, B=self.batch_size,
                                  H=self.num_heads),
            "score_mod": sha("none" if self.score_mod is None else
                             _masks.fn_digest(self.score_mod),
                             [(tuple(t.shape), str(t.dtype)) for t in self.score_params]),
            "options": sha(self.scale, _kernel_name(self.kernel), self.kv, self.block_size,
                           self.batch_size, self.num_heads),
        }
        self.cache.digests = (vers, out)
        return out

    def fingerprint(self) -> str:
        """A short hash of all :meth:`digests`, equal on ranks that built the same plan."""
        d = self.digests()
        return f"{self.schedule.name}:" + hashlib.sha1(
            "/".join(f"{k}={d[k]}" for k in sorted(d)).encode()).hexdigest()[:16]

    # ---- reporting -----------------------------------------------------------------
    def stats(self, *, batch: int = 1, heads: int | None = None, kv_heads: int | None = None,
              head_dim: int = 64, v_head_dim: int | None = None,
              dtype: torch.dtype = torch.bfloat16) -> "PlanStats":
        """Per-rank work and communication; see :class:`PlanStats`.

        ``heads=None``: 1, or for a plan that splits heads n ways (Ulysses, compose) the
        least common multiple of its splits, the fewest heads it runs with; ``kv_heads=None``:
        ``heads``. ``head_dim`` is D of q and k; ``v_head_dim`` is Dv of v and out (None:
        ``head_dim``; MLA has its own, e.g. DeepSeek-V3 has Dv = 2D/3). A plan does not depend
        on head dims, so they enter here, as the batch and heads do.
        """
        return PlanStats.of(self, batch=batch, heads=heads, kv_heads=kv_heads,
                            head_dim=head_dim, v_head_dim=v_head_dim, dtype=dtype)

    @property
    def choice(self) -> "_auto.Choice | None":
        """What ``schedules.auto()`` compared and chose, for a plan :func:`plan` resolved from
        it (a frozen :class:`fringe._auto.Choice`); None for any other plan. Kept in
        :attr:`cache`: a copy or a pickle of the plan does not carry it."""
        return self.cache.auto

    def explain(self) -> str:
        """For a plan of ``schedules.auto()``: the candidates with their predicted step time,
        forward bytes and balance, which won and why, and where the constants come from
        (``print(plan.explain())``).

        Raises:
            ValueError: the plan was not made from ``schedules.auto()`` (or is a copy of one,
                which keeps no choice).
        """
        if self.cache.auto is None:
            raise ValueError(f"{self!r} was not chosen by schedules.auto(), so there is no "
                             f"choice to explain (a copy or pickle of an auto plan keeps none "
                             f"either): plan with fringe.plan(schedules.auto(), ...) and call "
                             f"explain() on that plan")
        mask = getattr(self.mask_mod, "__name__", "mask")
        return self.cache.auto.table(f"{mask} · S={self.seq_len} P={self.world_size} "
                                     f"block={self.block_size}")

    def __repr__(self) -> str:
        return (f"Plan({self.schedule.name}, mask={getattr(self.mask_mod, '__name__', 'mask')}, "
                f"S={self.seq_len}, P={self.world_size}, block={self.block_size})")


def _tile_areas(bm: _masks.BlockMap, P: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(non-empty blocks, FULL blocks)`` per tile, int64 ``[P, P]`` each, from a block map
    whose rectangles do not cross tile boundaries (``n`` blocks a side)."""
    r = bm.rects
    key = torch.div(r[:, 0], n, rounding_mode="floor") * P + \
        torch.div(r[:, 2], n, rounding_mode="floor")
    area = (r[:, 1] - r[:, 0]) * (r[:, 3] - r[:, 2])
    is_full = bm.codes == BlockKind.FULL
    nonempty = torch.zeros(P * P, dtype=torch.int64).index_add_(0, key, area)
    full = torch.zeros(P * P, dtype=torch.int64).index_add_(0, key[is_full], area[is_full])
    return nonempty.view(P, P), full.view(P, P)


def _tile_kinds(bm: _masks.BlockMap, P: int) -> torch.Tensor:
    """int8 ``[P, P]`` tile kinds: EMPTY without blocks, FULL when every block is FULL."""
    n = bm.shape[0] // P
    nonempty, full = _tile_areas(bm, P, n)
    # EMPTY 0 (no block) + 1 for some block + 1 more when all n*n are FULL: PARTIAL 1, FULL 2
    assert (BlockKind.EMPTY, BlockKind.PARTIAL, BlockKind.FULL) == (0, 1, 2)
    return (nonempty > 0).to(torch.int8) + (full == n * n).to(torch.int8)


#: Above this many rectangles, a sequence-order classification is not permuted into a
#: layout's order (a layout that scatters single blocks, e.g. striped by blocks, would cut
#: every FULL rectangle into single blocks); the layout order is classified instead.
PERMUTE_PIECES = 1 << 22


def _classify_layout(mask_mod, lay: Layout, block_size: int, *, B, H,
                     natural: _masks.BlockMap | None) -> _masks.BlockMap:
    """The sparse block map in layout order, rectangles cut at tile boundaries.

    A layout of whole blocks is classified in sequence order (the quadtree then only splits
    cells along the diagonal and document boundaries) and permuted; other layouts are
    classified in their own order.
    """
    bs, S = block_size, lay.seq_len
    nb, n = S // bs, lay.local_len // bs
    block_order = lay.order.view(-1, bs)
    aligned = bool((block_order == block_order[:, :1] + torch.arange(bs)).all()) and \
        bool((block_order[:, 0] % bs == 0).all())
    if aligned:
        inv = torch.empty(nb, dtype=torch.int64)
        inv[block_order[:, 0] // bs] = torch.arange(nb)    # sequence block -> layout block
        if natural is None:
            natural = _masks.classify(mask_mod, torch.arange(S), torch.arange(S), block_size=bs,
                                      B=B, H=H, sparse=True)
        if natural.pieces(inv, inv, cut=n) <= max(PERMUTE_PIECES, 4 * len(natural)):
            return natural.permute(inv, inv, cut=n)
    bm = _masks.classify(mask_mod, lay.order, lay.order, block_size=bs, B=B, H=H, sparse=True)
    return _cut_at_tiles(bm, n)


def _cut_at_tiles(bm: _masks.BlockMap, n: int) -> _masks.BlockMap:
    """``bm`` with its rectangles cut at tile boundaries (multiples of ``n`` blocks).

    The identity ``permute(..., cut=n)``; when no rectangle crosses a boundary (a quadtree
    over a power-of-two ``n`` never makes one that does) the map is returned as it is, which
    is what that permute would rebuild (the same rectangles in the same order): a striped
    causal map at P=1024 has ~9.4M rectangles and the rebuild cost ~6 s.
    """
    R = bm.rects
    if len(R):
        rows = torch.div(R[:, 0], n, rounding_mode="floor") != \
            torch.div(R[:, 1] - 1, n, rounding_mode="floor")
        if not bool(rows.any()):
            cols = torch.div(R[:, 2], n, rounding_mode="floor") != \
                torch.div(R[:, 3] - 1, n, rounding_mode="floor")
            if not bool(cols.any()):
                return bm
    same = torch.arange(bm.shape[0])
    return bm.permute(same, same, cut=n)


def padded_len(seq_len: int, world_size: int, *, block_size: int = DEFAULT_BLOCK_SIZE,
               tp_size: int = 1, stripe: int | None = None) -> int:
    """The smallest length >= ``seq_len`` that every built-in layout accepts for P ranks of
    whole blocks, with each rank's L tokens divisible by ``tp_size``.

    That is the next multiple of ``lcm(2 * P * block_size, P * tp_size)`` (zigzag cuts the
    sequence into 2P chunks of whole blocks; sequence parallelism splits L by the TP degree).
    Pad a packed batch to it with :func:`fringe.packing.pad_batch`.

    A striped layout with its own stripe (``schedules.striped(stripe)``, ``"striped:N"``)
    also needs whole stripes on every rank, ``S % (stripe * P) == 0``, which that length
    need not meet (the default stripe, the block size, always does): give ``stripe=`` and
    the unit takes ``stripe * P`` in too.

    >>> padded_len(1000, 4, block_size=64, tp_size=3)
    1536
    >>> padded_len(100, 2, block_size=4), padded_len(100, 2, block_size=4, stripe=3)
    (112, 144)
    """
    S, P = _size("seq_len", seq_len), _size("world_size", world_size)
    bs, tp = _size("block_size", block_size), _size("tp_size", tp_size)
    unit = math.lcm(2 * P * bs, P * tp)
    if stripe is not None:
        unit = math.lcm(unit, P * _size("stripe", stripe))
    return -(-S // unit) * unit


def _kernel_name(kernel) -> str:
    if kernel is None or isinstance(kernel, str):
        return str(kernel)
    return f"{type(kernel).__module__}.{type(kernel).__qualname__}:{getattr(kernel, 'name', '')}"


def _size(name: str, val, low: int = 1) -> int:
    """An int >= low; numpy and torch integers are accepted, bools and floats are not."""
    if isinstance(val, bool) or (isinstance(val, torch.Tensor) and val.dim() != 0):
        raise ValueError(f"{name} must be an int >= {low}, got {val!r}")
    try:
        n = operator.index(val)
    except TypeError:
        raise ValueError(f"{name} must be an int >= {low}, got {val!r} "
                         f"({type(val).__name__})") from None
    if n < low:
        raise ValueError(f"{name} must be an int >= {low}, got {n}")
    return n


#: The fields a plan makes for this process only (copies and pickles make their own).
_LOCAL_FIELDS = ("handle", "cache")
_MAKING = [0]           # > 0 while plan() builds its Plan (Plan.made_by_plan)


def _covered(plan: Plan) -> tuple[list[tuple[str, torch.Tensor]], list]:
    """The tensors a plan holds as state, and the bindings of what its mask_mod and score_mod
    read through objects (what :meth:`Plan.check_unchanged` guards: versions, identities)."""
    out = [("its layout's order (plan.layout.order)", plan.layout.order),
           ("plan.tiles", plan.tiles), ("plan.block_map.rects", plan.block_map.rects),
           ("plan.block_map.codes", plan.block_map.codes)]
    seen = {id(t) for _, t in out}
    bindings = []
    for what, fn in (("mask_mod", plan.mask_mod), ("score_mod", plan.score_mod)):
        tensors, binds = _guard_state(fn, what)
        bindings.append((what, binds))
        for where, t in tensors:
            # inference tensors keep no version counter: an object's cannot be guarded
            if id(t) not in seen and not t.requires_grad and not t.is_inference():
                seen.add(id(t))
                out.append((f"a tensor its {where} holds", t))
    return out, bindings


_REBOUND_WHY = {
    "mask_mod": "the plan classified the mask's blocks with the old value and its tiles would "
                "evaluate the new one",
    "score_mod": "the plan's digest, which the ranks compare, describes the old value and "
                 "each rank would run whatever it holds now",
}
_REBOUND_FIX = {
    "mask_mod": "Make a new plan for the new documents (fringe.plan(...)) or pass the ids to a "
                "mask built with masks.document(...), which keeps its own copy",
    "score_mod": "Make a new plan (fringe.plan(..., score_mod=...)) after changing what the "
                 "score_mod reads, or bind the values it reads in a closure, which the plan "
                 "copies",
}


def _document_leaves(m):
    """The document-id tensors inside a Mask tree (to check their length against S)."""
    if not isinstance(m, _masks.Mask):
        return
    rule = m.rule
    if rule is not None and isinstance(getattr(rule, "doc_ids", None), torch.Tensor):
        yield m.name, rule.doc_ids
    for c in m.children:
        yield from _document_leaves(c)


def captured_params(score_mod: Callable | None, *, seq_len: int) -> tuple[torch.Tensor, ...]:
    """The tensors that require grad which ``score_mod`` reads, found through autograd.

    The score_mod is applied to a small probe (zero scores, global positions 0..6) with
    grad enabled; the leaves of the resulting autograd graph are exactly the learnable
    tensors it used, wherever they live (closure, global, module attribute). A tensor the
    score_mod reads only for positions outside the probe would be missed: pass
    ``score_params=`` to :func:`plan` explicitly in that case.
    """
    if score_mod is None:
        return ()
    nq, nk = min(5, seq_len), min(7, seq_len)
    s = torch.zeros(1, 1, nq, nk, dtype=torch.float64)     # b = h = 0: valid for any B, H
    with torch.enable_grad():
        out = apply_score_mod(s, score_mod, torch.arange(nq), torch.arange(nk))
    if not isinstance(out, torch.Tensor) or out.grad_fn is None:
        return ()
    found: dict[int, torch.Tensor] = {}
    seen, stack = set(), [out.grad_fn]
    while stack:
        fn = stack.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        var = getattr(fn, "variable", None)          # AccumulateGrad: a leaf that needs grad
        if isinstance(var, torch.Tensor):
            found.setdefault(id(var), var)
        stack.extend(nxt for nxt, _ in fn.next_functions)
    return tuple(found.values())


def _block_table_mod(bm) -> Callable:
    """A mask_mod that is a BlockMask's block tables: ``(b, h, q_idx, kv_idx)`` is allowed iff
    its block is listed (partial or full), as FlexAttention runs a BlockMask whose mask_mod
    is ``noop_mask`` (``BlockMask.from_kv_blocks`` without one)."""
    dense = bm.to_dense().to(torch.bool).cpu()             # [B, H, S/bq, S/bkv]
    nb, nh = int(dense.shape[0]), int(dense.shape[1])
    bq, bkv = (int(n) for n in bm.BLOCK_SIZE)

    table = dense[:, 0] if nh == 1 else dense              # B = 1 / H = 1 broadcast: the
    table = table[0] if nb == 1 else table                 # mod then does not read b / h

    def block_table_mod(b, h, q_idx, kv_idx):
        bh = (() if nb == 1 else (b,)) + (() if nh == 1 else (h,))
        return table.to(q_idx.device)[bh + (torch.div(q_idx, bq, rounding_mode="floor"),
                                            torch.div(kv_idx, bkv, rounding_mode="floor"))]
    block_table_mod.__name__ = f"block_table(BLOCK_SIZE=({bq}, {bkv}))"
    if nb == 1 and nh == 1:
        block_table_mod.bh_invariant = True
    return block_table_mod


def _from_block_mask(bm, *, seq_len: int, block_size: int, batch_size: int | None,
                     num_heads: int | None) -> tuple[Callable, int | None, int | None]:
    """The mask_mod :func:`plan` classifies for a FlexAttention ``BlockMask``, and the B / H
    it records. See :func:`plan` (``mask_mod``)."""
    from torch.nn.attention.flex_attention import noop_mask
    q_len, kv_len = (int(n) for n in bm.seq_lengths)
    if (q_len, kv_len) != (seq_len, seq_len):
        raise ValueError(
            f"the BlockMask was built for Q_LEN={q_len}, KV_LEN={kv_len} but seq_len={seq_len}: "
            f"context-parallel attention is self-attention over the S global tokens, so build it "
            f"with create_block_mask(mask_mod, B, H, {seq_len}, {seq_len}, device=...) or plan "
            f"with the length it was made for")
    B, H = int(bm.shape[0]), int(bm.shape[1])
    for n, given, arg, dim in ((B, batch_size, "batch_size", "B"), (H, num_heads, "num_heads", "H")):
        if n > 1 and given is not None and given != n:
            raise ValueError(f"the BlockMask was built for {dim}={n} but {arg}={given}; pass "
                             f"{arg}={n} (or build the BlockMask with {dim}={given}, or {dim}=None "
                             f"to broadcast)")
    batch_size = B if B > 1 else batch_size                # B=None / H=None broadcast: any
    num_heads = H if H > 1 else num_heads
    mod = bm.mask_mod
    tables = mod is None or mod is noop_mask
    if tables:                                             # its block tables are the mask
        dense = bm.to_dense()
        mod = _masks.full() if bool(dense.all()) else _block_table_mod(bm)
    bq, bkv = (int(n) for n in bm.BLOCK_SIZE)
    if (bq, bkv) != (block_size, block_size):
        what = ("its block tables (it has no mask_mod: they are the mask) at token level" if tables
                else "its mask_mod")
        warnings.warn(
            f"fringe.plan: the BlockMask has BLOCK_SIZE=({bq}, {bkv}) but the plan's "
            f"block_size={block_size}, so fringe re-blocked it: it classified {what} in "
            f"{block_size}-token blocks (the attention is the same; only the granularity of "
            f"skipped and masked blocks differs). Pass block_size={bq if bq == bkv else 'n'} to "
            f"keep the BlockMask's blocking (L=S/P must be a multiple of it), or build the "
            f"BlockMask with BLOCK_SIZE={block_size}", stacklevel=3)
    return mod, batch_size, num_heads


def plan(schedule: Schedule, mask_mod: Callable | None = None, *, seq_len: int,
         world_size: int, block_size: int = DEFAULT_BLOCK_SIZE,
         score_mod: Callable | None = None, scale: float | None = None,
         kv: KVPolicy | str = KVPolicy.RESEND,
         kernel: str | None = None, batch_size: int | None = None,
         num_heads: int | None = None, layout: Layout | None = None,
         score_params: tuple[torch.Tensor, ...] | None = None, tp_size: int = 1,
         ranges: bool = True) -> Plan:
    """Lower ``schedule`` for ``mask_mod`` on ``seq_len`` tokens over ``world_size`` ranks.

    Args:
        schedule: e.g. ``schedules.zigzag()``; ``schedules.auto()`` plans the candidates that
            run, predicts each with the cost model and returns the plan of the fastest (the
            same plan as ``plan(<winner>, ...)``; :meth:`Plan.explain` says why).
        mask_mod: FlexAttention-style ``mask_mod(b, h, q_idx, kv_idx)`` on global
            positions; ``None`` means full attention. The plan keeps a snapshot
            (:func:`fringe.masks.snapshot`): refilling a tensor the mask captured (next
            batch's document ids) does not change a plan already made. A FlexAttention
            ``BlockMask`` (``create_block_mask(mask_mod, B, H, S, S, ...)``) is taken as its
            ``mask_mod``: the plan equals one made from that mask_mod (same digests), since
            fringe classifies blocks from the mask_mod itself and does not read the
            BlockMask's tables. Its ``seq_lengths`` must be ``(seq_len, seq_len)``; a B or H
            above 1 must agree with ``batch_size`` / ``num_heads`` and is recorded as them
            (B=None / H=None broadcast: nothing recorded). A ``BLOCK_SIZE`` other than
            ``(block_size, block_size)`` is re-blocked: the mask_mod is classified at
            ``block_size``, with a warning saying so. A BlockMask without a mask_mod
            (``BlockMask.from_kv_blocks(...)``: ``noop_mask``) is its block tables, as
            FlexAttention runs it: a token pair is allowed iff its block is listed.
        seq_len: S, the global sequence length.
        world_size: P, the context-parallel group size.
        block_size: mask block in tokens (classification and kernel granularity).
        score_mod: optional ``score_mod(score, b, h, q_idx, kv_idx)`` (global positions).
        scale: softmax scale (default ``1/sqrt(D)``).
        kv: a :class:`~fringe.KVPolicy` or its string: ``"resend"`` (backward re-sends kv;
            O(L) memory) or ``"keep"``.
        kernel: tile kernel name (``None`` chooses; see :mod:`fringe.ops`).
        batch_size, num_heads: the B and H the mask is classified for, and the only ones
            the plan then accepts. Give them if the mask depends on b or h. A mask fringe
            evaluates per scalar index (not elementwise on broadcast index tensors: a
            ``.any()``, ``.all()``, a read of ``q_idx.numel()``) cannot be proven by a probe
            to ignore b and h: it needs them (one given: the other is 1) or a declaration
            ``masks.as_mask(fn, bh_invariant=True)``; see :func:`classified_bh`.
        layout: plan over this existing layout instead of the schedule's own (several
            masks over one batch, e.g. full and sliding-window layers, share the tokens'
            sharding). Must be for ``seq_len`` and ``world_size``.
        score_params: the learnable tensors the score_mod reads (default: found by
            :func:`captured_params`); attention gives them gradients (this rank's share,
            to be reduced across ranks like any data-parallel gradient).
        tp_size: tensor-parallel degree when sequence parallelism splits each rank's L
            tokens again by it (Megatron-style): L must then be divisible by it too.
            :func:`padded_len` gives the length to pad a batch to.
        ranges: ``True`` (default): every point-to-point hop of kv (or q) carries only the
            blocks that its receiver, and the ranks it forwards the buffer to, attend
            (:func:`fringe.schedules.passes.narrow`; ``S kv3[0:5]->r2`` in the programs'
            text), and the backward's dkv and kv re-sends the same blocks. ``False`` moves
            whole chunks (for A/B runs and debugging). Collectives move whole chunks either
            way.

    Raises:
        ValueError / TypeError: with the fix, for arguments that do not fit.
    """
    if not isinstance(schedule, Schedule):
        raise TypeError(f"schedule must be a fringe.schedules.Schedule (e.g. schedules.zigzag()), "
                        f"got {type(schedule).__name__}")
    seq_len = _size("seq_len", seq_len)
    world_size = _size("world_size", world_size)
    block_size = _size("block_size", block_size)
    tp_size = _size("tp_size", tp_size)
    batch_size = None if batch_size is None else _size("batch_size", batch_size)
    num_heads = None if num_heads is None else _size("num_heads", num_heads)
    kv = KVPolicy.parse(kv)        # a member or its string; the error lists the valid values
    if score_mod is not None and not callable(score_mod):
        raise TypeError(f"score_mod must be callable (score, b, h, q_idx, kv_idx) -> score, got "
                        f"{type(score_mod).__name__}")
    if scale is not None:
        if isinstance(scale, bool) or not isinstance(scale, (int, float)) or \
                not math.isfinite(scale):
            raise ValueError(f"scale must be a finite number (or None for 1/sqrt(D)), got {scale!r}")
        scale = float(scale)
    if kernel is not None:
        get_kernel(kernel)                  # unknown names raise here, not at the first tile
    if schedule.kind == AUTO:               # choose with the cost model: fringe/_auto.py
        if layout is not None:
            raise ValueError("schedules.auto() chooses the schedule and its layout; it does "
                             "not plan over a given layout= (the candidates would differ only "
                             "in name). Plan the schedule you want over that layout instead, "
                             "e.g. the one another plan's .schedule holds")

        def plan_one(s: Schedule) -> Plan:
            return plan(s, mask_mod, seq_len=seq_len, world_size=world_size,
                        block_size=block_size, score_mod=score_mod, scale=scale, kv=kv,
                        kernel=kernel, batch_size=batch_size, num_heads=num_heads,
                        score_params=score_params, tp_size=tp_size, ranges=ranges)
        return _auto.resolve(schedule, plan_one, world_size=world_size, num_heads=num_heads)
    from torch.nn.attention.flex_attention import BlockMask
    if isinstance(mask_mod, BlockMask):
        mask_mod, batch_size, num_heads = _from_block_mask(
            mask_mod, seq_len=seq_len, block_size=block_size, batch_size=batch_size,
            num_heads=num_heads)
    if mask_mod is not None and not callable(mask_mod):
        raise TypeError(f"mask_mod must be callable (b, h, q_idx, kv_idx) -> bool tensor, or a "
                        f"FlexAttention BlockMask, got {type(mask_mod).__name__}")
    mask_mod = mask_mod if mask_mod is not None else _masks.full()
    mask_mod = _masks.snapshot(mask_mod)
    for leaf, ids in _document_leaves(mask_mod):
        if ids.shape[-1] != seq_len:
            raise ValueError(f"{leaf}: doc_ids has {ids.shape[-1]} entries but seq_len={seq_len}; "
                             f"give one document id per global position")
    if score_mod is not None:
        score_mod = _masks.snapshot(score_mod)      # learnable tensors stay live parameters
    if score_params is None:
        score_params = captured_params(score_mod, seq_len=seq_len)
    else:
        score_params = tuple(score_params)
        for t in score_params:
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"score_params must be tensors, got {type(t).__name__}")
    reads_b, _, _, batch_size, num_heads = classified_bh(
        mask_mod, seq_len=seq_len, batch_size=batch_size, num_heads=num_heads)
    natural = None
    if layout is not None:
        if not isinstance(layout, Layout):
            raise TypeError(f"layout must be a fringe.Layout (e.g. another plan's .layout), got "
                            f"{type(layout).__name__}")
        layout._check_unchanged()   # an order edited in place may not even be a permutation
        lay = layout
    elif schedule.mask_aware:      # classify in sequence order once, deal blocks, permute
        natural = _masks.classify(mask_mod, torch.arange(seq_len), torch.arange(seq_len),
                                  block_size=block_size, B=batch_size, H=num_heads, sparse=True)
        work = natural.row_counts()
        import inspect
        if "natural" in inspect.signature(schedule.layout).parameters:   # the sparse map itself
            lay = schedule.layout(seq_len, world_size, block_size=block_size, block_work=work,
                                  natural=natural)
        else:
            lay = schedule.make_layout(seq_len, world_size, block_size=block_size,
                                       block_work=work)
    else:
        lay = schedule.make_layout(seq_len, world_size, block_size=block_size)
    if lay.seq_len != seq_len or lay.world_size != world_size:
        src = "the given layout is" if layout is not None else \
            f"schedule {schedule.name!r} built a layout"
        raise ValueError(f"{src} for S={lay.seq_len}, P={lay.world_size}; expected S={seq_len}, "
                         f"P={world_size}")
    if lay.local_len % block_size:
        raise ValueError(f"L=S/P={lay.local_len} tokens per rank is not a multiple of "
                         f"block_size={block_size}")
    if lay.local_len % tp_size:
        raise ValueError(f"L=S/P={lay.local_len} tokens per rank is not divisible by "
                         f"tp_size={tp_size} (sequence parallelism splits each of the P="
                         f"{world_size} context-parallel ranks' tokens again by the TP degree); "
                         f"pad the sequence to "
                         f"{padded_len(seq_len, world_size, block_size=block_size, tp_size=tp_size)}"
                         f" (fringe.packing.pad_batch) for CP={world_size} x TP={tp_size}")
    block_map = _classify_layout(mask_mod, lay, block_size, B=batch_size, H=num_heads,
                                 natural=natural)
    tiles = _tile_kinds(block_map, world_size)
    need = tiles != BlockKind.EMPTY
    with shared_columns():          # the passes derive each table's columns once
        fwd = schedule.programs(world_size, need)
        blocks = BlockNeed(world_size, lay.local_len // block_size, block_map.rects.numpy())
        if ranges:
            fwd = narrow(fwd, blocks)
        check(fwd, need=need, blocks=blocks)
        bwd = reverse(fwd, kv=kv)
        check(bwd, need=need, backward=True, kv=kv, blocks=blocks)
    reads_batch = reads_b or (score_mod is not None and
                              _masks.reads_bh(score_mod, seq_len=seq_len, score=True).b)
    _MAKING[0] += 1
    try:
        return Plan(schedule=schedule, mask_mod=mask_mod, layout=lay, block_size=block_size,
                    block_map=block_map, tiles=tiles, forward=tuple(fwd), backward=tuple(bwd),
                    kv=kv, score_mod=score_mod, scale=scale, kernel=kernel,
                    batch_size=batch_size, num_heads=num_heads, score_params=score_params,
                    reads_batch=reads_batch, ranges=bool(ranges))
    finally:
        _MAKING[0] -= 1


def classified_bh(mask_mod: Callable, *, seq_len: int, batch_size: int | None,
                  num_heads: int | None) -> tuple[bool, bool, tuple[str, ...], int | None,
                                                  int | None]:
    """The ``(B, H)`` :func:`plan` classifies ``mask_mod`` for, and why.

    A probe proves nothing about values it did not try. A mask fringe evaluates by
    broadcasting reads ``b`` / ``h`` exactly when its output varies along that axis; one it
    evaluates per scalar index (vmap) may read them only for values a probe never tries (a
    rule for heads >= 4), so unless it is declared ``masks.as_mask(fn, bh_invariant=True)``
    (or built from factories) it is classified for every ``b < batch_size`` and
    ``h < num_heads``: with one of them given the other is taken as 1, with neither it is
    refused. The plan records the result and a call with another B or H raises before
    any communication.

    Returns:
        ``(reads_b, reads_h, unproven, batch_size, num_heads)``: ``reads_*`` and ``unproven``
        (the names of the parts that cannot be proven to ignore b and h, which count as
        reading both) as :func:`fringe.masks.reads_bh` answers, and the B and H to classify
        for and record (None: any).

    Raises:
        ValueError: the mask is seen reading b or h and the count is not given; it (or a
            part of it) is declared ``bh_invariant=True`` but is seen reading one; or it
            cannot be proven to ignore them and neither count is given (naming both
            remedies).
    """
    r = _masks.reads_bh(mask_mod, seq_len=seq_len, witness=True)
    name = getattr(mask_mod, "__name__", "mask_mod")
    for seen, reads, given, arg, idx in ((r.seen_b, r.b, batch_size, "batch_size", "b"),
                                         (r.seen_h, r.h, num_heads, "num_heads", "h")):
        if seen and given is None:
            raise ValueError(f"{name} reads the {idx} index (its output varies with {idx}), so "
                             f"its empty/full blocks depend on {idx}; pass {arg}= to "
                             f"fringe.plan so every {idx} is classified")
        if seen and not reads:                  # only a declaration answers "no" to a witness
            raise ValueError(f"{name} is declared bh_invariant but reads the {idx} index; "
                             f"wrap it with masks.as_mask(fn, bh_invariant=False)")
    unproven = r.unproven
    if unproven:
        if batch_size is None and num_heads is None:
            parts = ", ".join(unproven)
            raise ValueError(
                f"{name}: {parts} cannot be proven to ignore b and h: it is evaluated per "
                f"scalar index (torch.vmap, as FlexAttention does: it is not elementwise on "
                f"broadcast index tensors) or fails when called on broadcast b and h, and a "
                f"probe proves nothing about values it did not try (a mask may read h only for "
                f"heads >= 4). Either pass num_heads= and batch_size= to fringe.plan (every b "
                f"and h is then classified, and calls must use that B and H), or, if it "
                f"ignores b and h, declare it: "
                f"fringe.masks.as_mask(fn, bh_invariant=True)")
        batch_size, num_heads = batch_size or 1, num_heads or 1
    return r.b, r.h, unproven, batch_size, num_heads
