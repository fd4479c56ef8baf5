"""Structured block rules: per-block summaries of position sets (min / max, stride) on every
level of the classification quadtree, the leaf rules (band, kv-below, document) that decide a
block pair from them, and the AND / OR algebra of their codes."""
from __future__ import annotations

import dataclasses
from typing import Callable

import torch

from ._kinds import _EMPTY, _FULL, _PARTIAL, _UNKNOWN, MaskError


@dataclasses.dataclass(frozen=True)
class _Blocks:
    """Per-block summaries of a position tensor split into blocks.

    Attributes:
        pos: ``[n, bs]`` int64 positions of each block (layout order).
        lo, hi: ``[n]`` min / max position of each block (attained).
        stride: ``[n]`` the common difference if the block's sorted positions form an
            arithmetic progression with a positive step (1 = contiguous run), else 0.
    """

    pos: torch.Tensor
    lo: torch.Tensor
    hi: torch.Tensor
    stride: torch.Tensor

    @staticmethod
    def of(pos: torch.Tensor, block_size: int) -> _Blocks:
        pos = pos.to(torch.int64).view(-1, block_size)
        if block_size == 1:
            return _Blocks(pos=pos, lo=pos[:, 0], hi=pos[:, 0], stride=torch.ones_like(pos[:, 0]))
        d = pos[:, 1:] - pos[:, :-1]
        if bool((d > 0).all()):         # every block already increasing (sequence order, the
            srt = pos                   # built-in layouts): its sort is itself
        else:
            srt = pos.sort(dim=1).values
            d = srt[:, 1:] - srt[:, :-1]
        step = d[:, 0]
        is_ap = (d == step[:, None]).all(dim=1) & (step > 0)
        stride = torch.where(is_ap, step, torch.zeros_like(step))
        return _Blocks(pos=pos, lo=srt[:, 0], hi=srt[:, -1], stride=stride)

    @property
    def block_size(self) -> int:
        return self.pos.shape[1]


def _pair_reduce(x: torch.Tensor, op) -> torch.Tensor:
    """One level up a binary tree: ``op`` of elements ``2t`` and ``2t + 1`` (a last odd
    element is its own parent)."""
    n = x.numel()
    out = x[0::2].clone()
    out[:n // 2] = op(out[:n // 2], x[1::2])
    return out


class _Tree:
    """Block summaries of one side (q or kv) at every level of the classification quadtree.

    Level 0 is the blocks themselves (:class:`_Blocks`); node ``t`` of level ``l`` covers
    blocks ``[t * 2**l, min((t + 1) * 2**l, n))``. Upper levels keep the min / max position
    (attained), which decide FULL / EMPTY exactly for every rule; rules add their own
    min / max summaries through :meth:`up`.
    """

    def __init__(self, pos: torch.Tensor, block_size: int, levels: int):
        self.leaf = _Blocks.of(pos, block_size)
        self.levels = levels
        self.lo = self.up(self.leaf.lo, torch.minimum)
        self.hi = self.up(self.leaf.hi, torch.maximum)

    def up(self, x: torch.Tensor, op) -> list[torch.Tensor]:
        out = [x]
        for _ in range(self.levels):
            out.append(_pair_reduce(out[-1], op))
        return out

    def count(self, level: int) -> int:
        return self.lo[level].numel()


# A rule sees the q and kv trees once and returns a function of (level, i, j), index
# tensors of cells, giving int8 codes in {EMPTY, PARTIAL, FULL, UNKNOWN}. Above level 0 only
# FULL / EMPTY matter (anything else is refined), and must be exact.
_CellCodes = Callable[[int, torch.Tensor, torch.Tensor], torch.Tensor]


def _codes(full: torch.Tensor, empty: torch.Tensor, partial: torch.Tensor | None) -> torch.Tensor:
    """int8 codes from exact FULL / EMPTY predicates; ``partial`` marks the pairs that are
    certainly PARTIAL when neither FULL nor EMPTY (None: all of them), the rest UNKNOWN."""
    rest = _PARTIAL if partial is None else torch.where(partial, _PARTIAL, _UNKNOWN)
    return torch.where(empty, _EMPTY, torch.where(full, _FULL, rest)).to(torch.int8)


def _node_codes(full: torch.Tensor, empty: torch.Tensor) -> torch.Tensor:
    """Codes of quadtree nodes above the blocks: FULL / EMPTY or UNKNOWN (refine)."""
    return torch.where(empty, _EMPTY, torch.where(full, _FULL, _UNKNOWN)).to(torch.int8)


@dataclasses.dataclass(frozen=True)
class _Band:
    """``lo <= q_idx - kv_idx <= hi`` (None = unbounded). Causal is ``lo=0``.

    FULL / EMPTY are exact for any position sets, because the extreme differences
    ``min(q) - max(kv)`` and ``max(q) - min(kv)`` are attained. A one-sided band is then
    PARTIAL for every other pair. A two-sided band whose extremes both fall outside it is
    PARTIAL exactly when some difference lands inside; that is decided when both blocks are
    arithmetic progressions with the same stride (contiguous runs, striped layouts): the
    differences are then ``q.lo - kv.lo + k * stride`` for every ``|k| < bs``.
    """

    lo: int | None
    hi: int | None

    def _extremes(self, dmin, dmax):
        lo, hi = self.lo, self.hi
        full = torch.ones_like(dmin, dtype=torch.bool)
        empty = torch.zeros_like(dmin, dtype=torch.bool)
        if lo is not None:
            full &= dmin >= lo
            empty |= dmax < lo
        if hi is not None:
            full &= dmax <= hi
            empty |= dmin > hi
        return full, empty

    def prepare(self, qt: _Tree, kt: _Tree) -> _CellCodes:
        qb, kb = qt.leaf, kt.leaf
        bs = qb.block_size
        lo, hi = self.lo, self.hi

        def cells(level: int, i: torch.Tensor, j: torch.Tensor) -> torch.Tensor:
            qlo, kHi = qt.lo[level][i], kt.hi[level][j]
            dmin, dmax = qlo - kHi, qt.hi[level][i] - kt.lo[level][j]
            full, empty = self._extremes(dmin, dmax)
            if level:
                return _node_codes(full, empty)
            if lo is None or hi is None:
                return _codes(full, empty, None)
            inside = ((dmin >= lo) & (dmin <= hi)) | ((dmax >= lo) & (dmax <= hi))
            s = qb.stride[i]
            same = (s > 0) & (s == kb.stride[j])
            s1 = torch.where(same, s, torch.ones_like(s))
            d0 = qlo - kb.lo[j]
            kmin = torch.clamp(-torch.div(d0 - lo, s1, rounding_mode="floor"), min=-(bs - 1))
            kmax = torch.clamp(torch.div(hi - d0, s1, rounding_mode="floor"), max=bs - 1)
            decided = inside | same
            hit = inside | (same & (kmin <= kmax))
            out = _codes(full, empty, decided)
            # decided and no difference inside the band: EMPTY after all
            return torch.where(decided & ~hit & ~full, torch.tensor(_EMPTY, dtype=torch.int8), out)

        return cells


@dataclasses.dataclass(frozen=True)
class _KvBelow:
    """``kv_idx < n``: exact for any sets from min / max."""

    n: int

    def prepare(self, qt: _Tree, kt: _Tree) -> _CellCodes:
        def cells(level: int, i: torch.Tensor, j: torch.Tensor) -> torch.Tensor:
            full, empty = kt.hi[level][j] < self.n, kt.lo[level][j] >= self.n
            return _codes(full, empty, None) if level == 0 else _node_codes(full, empty)

        return cells


@dataclasses.dataclass(frozen=True, eq=False)
class _Document:
    """``doc_ids[q_idx] == doc_ids[kv_idx]``.

    FULL iff all four doc min / max are equal; PARTIAL if they are not all equal and some
    doc is shared; EMPTY iff no doc is shared. A shared doc is certain when the doc ranges
    overlap and both blocks are contiguous runs over non-decreasing ``doc_ids`` (packed
    documents: a run's docs are every doc id in its range), or when an endpoint of one range
    is a single-doc block lying inside a contiguous block's range; else disjoint doc ranges
    give EMPTY and the rest is UNKNOWN. Quadtree nodes use the doc min / max of their blocks
    (FULL iff one doc on both sides; EMPTY if the doc ranges are disjoint).

    ``sorted_ids`` is a check cached from ``doc_ids``: it must not outlive an in-place edit
    of them, so the ids' ``_version`` is recorded and classifying edited ids raises.
    """

    doc_ids: torch.Tensor
    sorted_ids: bool

    def __post_init__(self) -> None:
        object.__setattr__(self, "_ids_version", self.doc_ids._version)

    def _summ(self, b: _Blocks) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if self.doc_ids._version != self._ids_version:
            raise MaskError("document: its doc_ids were edited in place after masks.document() "
                            "built the mask (which recorded whether they were sorted, and named "
                            "it by their count), so its block rule no longer describes them; "
                            "build a new mask for new ids: masks.document(new_ids)")
        n = self.doc_ids.numel()
        if b.pos.numel() and (int(b.hi.max()) >= n or int(b.lo.min()) < 0):
            raise MaskError(
                f"document: positions span [{int(b.lo.min())}, {int(b.hi.max())}] but doc_ids "
                f"has {n} entries; give one doc id per global position (0..S-1)"
            )
        ids = self.doc_ids.to(b.pos.device)
        if self.sorted_ids:  # non-decreasing ids: the extremes sit at the extreme positions
            dlo, dhi = ids[b.lo], ids[b.hi]
        else:
            d = ids[b.pos]
            dlo, dhi = d.min(dim=1).values, d.max(dim=1).values
        run = (b.stride == 1) & self.sorted_ids
        return dlo, dhi, run

    def prepare(self, qt: _Tree, kt: _Tree) -> _CellCodes:
        qlo, qhi, qrun = self._summ(qt.leaf)
        klo, khi, krun = self._summ(kt.leaf)
        qlo_, qhi_ = qt.up(qlo, torch.minimum), qt.up(qhi, torch.maximum)
        klo_, khi_ = kt.up(klo, torch.minimum), kt.up(khi, torch.maximum)

        def cells(level: int, i: torch.Tensor, j: torch.Tensor) -> torch.Tensor:
            a, b = qlo_[level][i], qhi_[level][i]
            c, d = klo_[level][j], khi_[level][j]
            full = (a == b) & (c == d) & (a == c)
            empty = (b < c) | (d < a)
            if level:
                return _node_codes(full, empty)
            qr, kr = qrun[i], krun[j]
            shared = (qr & kr) | (qr & (c == d)) | (kr & (a == b))
            return _codes(full, empty, shared)

        return cells


def _and_codes(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    unk = torch.tensor(_UNKNOWN, dtype=torch.int8)
    out = torch.where(a == _FULL, b, torch.where(b == _FULL, a, unk))
    return torch.where((a == _EMPTY) | (b == _EMPTY), torch.tensor(_EMPTY, dtype=torch.int8), out)


def _or_codes(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    unk = torch.tensor(_UNKNOWN, dtype=torch.int8)
    out = torch.where(a == _EMPTY, b, torch.where(b == _EMPTY, a, unk))
    return torch.where((a == _FULL) | (b == _FULL), torch.tensor(_FULL, dtype=torch.int8), out)
