"""Sparse block maps: a classification stored as the disjoint rectangles of its non-empty
blocks (:class:`BlockMap`)."""
from __future__ import annotations

import dataclasses

import torch

from ._kinds import _EMPTY, _FULL, _PARTIAL, BlockKind

#: :meth:`BlockMap.dense` (and ``Plan.blocks``) refuses to build a dense map of more blocks
#: than this (16 MB of int8; S = 512k tokens at block 128): ask for a window (``rows=`` /
#: ``cols=``) or per tile instead.
DENSE_LIMIT = 1 << 24



def _paint(rects: torch.Tensor, codes: torch.Tensor, r0: int, r1: int, c0: int,
           c1: int) -> torch.Tensor:
    """int8 ``[r1 - r0, c1 - c0]`` map of disjoint ``rects`` (clipped to the window) by a 2-D
    difference array: four corner updates per rect, then two cumulative sums."""
    h, w = r1 - r0, c1 - c0
    if len(rects):
        hit = (rects[:, 0] < r1) & (rects[:, 1] > r0) & (rects[:, 2] < c1) & (rects[:, 3] > c0)
        rects, codes = rects[hit], codes[hit]
    if not len(rects) or h == 0 or w == 0:
        return torch.zeros((h, w), dtype=torch.int8)
    a = rects[:, 0].clamp(min=r0) - r0
    b = rects[:, 1].clamp(max=r1) - r0
    c = rects[:, 2].clamp(min=c0) - c0
    d = rects[:, 3].clamp(max=c1) - c0
    v = codes.to(torch.int8)
    diff = torch.zeros((h + 1) * (w + 1), dtype=torch.int8)
    for rows, cols, sign in ((a, c, v), (a, d, -v), (b, c, -v), (b, d, v)):
        diff.index_put_((rows * (w + 1) + cols,), sign, accumulate=True)
    diff = diff.view(h + 1, w + 1)
    return diff.cumsum(0, dtype=torch.int8).cumsum(1, dtype=torch.int8)[:h, :w].contiguous()


def _runs(index: torch.Tensor, cut: int | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Maximal runs of consecutive blocks that stay consecutive under ``index`` (and do not
    cross a multiple of ``cut`` there): ``(starts, ends, run_of_block)``."""
    n = index.numel()
    brk = torch.ones(n, dtype=torch.bool)
    brk[1:] = index[1:] != index[:-1] + 1
    if cut:
        brk[1:] |= torch.div(index[1:], cut, rounding_mode="floor") != \
            torch.div(index[:-1], cut, rounding_mode="floor")
    starts = brk.nonzero().flatten()
    ends = torch.cat([starts[1:], torch.tensor([n])])
    return starts, ends, brk.cumsum(0) - 1


def _merge_rows(i: torch.Tensor, j: torch.Tensor, c: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Single blocks ``(i, j)`` of kind ``c`` as rects, horizontal neighbours of one kind merged."""
    if not i.numel():
        return torch.zeros((0, 4), dtype=torch.int64), torch.zeros(0, dtype=torch.int8)
    key = i * (int(j.max()) + 1) + j
    order = key.argsort()
    i, j, c = i[order], j[order], c[order]
    start = torch.ones(i.numel(), dtype=torch.bool)
    start[1:] = (i[1:] != i[:-1]) | (j[1:] != j[:-1] + 1) | (c[1:] != c[:-1])
    first = start.nonzero().flatten()
    last = torch.cat([first[1:], torch.tensor([i.numel()])]) - 1
    rects = torch.stack([i[first], i[first] + 1, j[first], j[last] + 1], dim=1)
    return rects, c[first]


@dataclasses.dataclass(frozen=True, eq=False)
class BlockMap:
    """A block classification stored sparsely: the non-empty blocks as disjoint rectangles.

    The dense int8 ``[nQb, nKb]`` map costs ``(S/bs)^2`` bytes (268 MB for S = 1M tokens at
    block 64); structured masks have a few rectangles per block row instead (a FULL square
    per quadtree cell inside a document or below the causal diagonal, single blocks along
    the diagonal and document boundaries).

    Attributes:
        shape: ``(nQb, nKb)``.
        rects: int64 ``[N, 4]``: block rows ``[r0, r1)`` x block columns ``[c0, c1)``;
            rectangles are disjoint, sorted by ``(r0, c0)``; EMPTY blocks are not stored.
        codes: int8 ``[N]``: the :class:`BlockKind` of every block of each rectangle (FULL or
            PARTIAL; ``CAUSAL`` is reserved).

    >>> bm = classify(causal(), torch.arange(8), torch.arange(8), block_size=2, sparse=True)
    >>> bm.rects.tolist()[:4]           # rows [r0, r1) x columns [c0, c1), in blocks
    [[0, 1, 0, 1], [1, 2, 0, 1], [1, 2, 1, 2], [2, 4, 0, 2]]
    >>> bm.codes.tolist()               # PARTIAL diagonal blocks, FULL below
    [1, 2, 1, 2, 1, 2, 1]
    >>> bm.dense().tolist()
    [[1, 0, 0, 0], [2, 1, 0, 0], [2, 2, 1, 0], [2, 2, 2, 1]]
    """

    shape: tuple[int, int]
    rects: torch.Tensor
    codes: torch.Tensor

    def __len__(self) -> int:
        return self.rects.shape[0]

    @property
    def nbytes(self) -> int:
        """Bytes held by the rectangles and their codes."""
        return self.rects.numel() * self.rects.element_size() + self.codes.numel()

    def dense(self, rows: tuple[int, int] | None = None, cols: tuple[int, int] | None = None, *,
              limit: int | None = DENSE_LIMIT) -> torch.Tensor:
        """The dense int8 map (or the window ``rows`` x ``cols``, half-open block ranges).

        Raises:
            ValueError: the window has more than ``limit`` blocks (None: no limit).
        """
        nq, nk = self.shape
        r0, r1 = rows if rows is not None else (0, nq)
        c0, c1 = cols if cols is not None else (0, nk)
        r0, r1, c0, c1 = max(0, r0), min(nq, r1), max(0, c0), min(nk, c1)
        r1, c1 = max(r0, r1), max(c0, c1)
        if limit is not None and (r1 - r0) * (c1 - c0) > limit:
            raise ValueError(f"a dense block map of {r1 - r0} x {c1 - c0} blocks exceeds the "
                             f"limit of {limit:,} blocks; read it by tile (plan.tile_blocks(i, "
                             f"j)) or by window (block_map.dense(rows=, cols=)), or pass "
                             f"limit=None")
        return _paint(self.rects, self.codes, r0, r1, c0, c1)

    def take(self, rows, cols) -> torch.Tensor:
        """int8 ``[len(rows), len(cols)]``: the codes of blocks ``(rows[a], cols[b])`` for any
        block indices (a sampled picture of a map too large to densify)."""
        rows = torch.as_tensor(rows, dtype=torch.int64).flatten()
        cols = torch.as_tensor(cols, dtype=torch.int64).flatten()
        m, nk = rows.numel(), self.shape[1]
        srt, order = rows.sort()
        R = self.rects
        a = torch.searchsorted(srt, R[:, 0].contiguous())     # selected rows inside each rect
        b = torch.searchsorted(srt, R[:, 1].contiguous())
        cnt = b - a
        rep = torch.repeat_interleave(torch.arange(len(R)), cnt)
        k = a[rep] + torch.arange(int(cnt.sum())) - torch.repeat_interleave(cnt.cumsum(0) - cnt, cnt)
        v = self.codes[rep]
        diff = torch.zeros(m * (nk + 1), dtype=torch.int8)
        diff.index_put_((k * (nk + 1) + R[rep, 2],), v, accumulate=True)
        diff.index_put_((k * (nk + 1) + R[rep, 3],), -v, accumulate=True)
        dense_rows = diff.view(m, nk + 1).cumsum(1, dtype=torch.int8)[:, :nk]
        out = torch.empty((m, nk), dtype=torch.int8)
        out[order] = dense_rows
        return out[:, cols].contiguous()

    def _areas(self) -> torch.Tensor:
        return (self.rects[:, 1] - self.rects[:, 0]) * (self.rects[:, 3] - self.rects[:, 2])

    def count(self, kind: BlockKind | int) -> int:
        """Number of blocks of ``kind`` (EMPTY: the blocks not stored)."""
        if int(kind) == _EMPTY:
            return self.shape[0] * self.shape[1] - int(self._areas().sum())
        return int(self._areas()[self.codes == int(kind)].sum())

    def nonzero(self, kind: BlockKind | int = BlockKind.PARTIAL) -> tuple[torch.Tensor, torch.Tensor]:
        """Row and column indices of the blocks of ``kind`` (not EMPTY), in row-major order."""
        sel = self.codes == int(kind)
        rects = self.rects[sel]
        if not len(rects):
            z = torch.zeros(0, dtype=torch.int64)
            return z, z
        w = rects[:, 3] - rects[:, 2]
        area = (rects[:, 1] - rects[:, 0]) * w
        rep = torch.repeat_interleave(torch.arange(len(rects)), area)
        k = torch.arange(int(area.sum())) - torch.repeat_interleave(area.cumsum(0) - area, area)
        i = rects[rep, 0] + torch.div(k, w[rep], rounding_mode="floor")
        j = rects[rep, 2] + k % w[rep]
        order = (i * self.shape[1] + j).argsort()
        return i[order], j[order]

    def row_counts(self) -> torch.Tensor:
        """int64 ``[nQb]``: non-empty blocks in each block row."""
        nq = self.shape[0]
        diff = torch.zeros(nq + 1, dtype=torch.int64)
        w = self.rects[:, 3] - self.rects[:, 2]
        diff.index_add_(0, self.rects[:, 0], w)
        diff.index_add_(0, self.rects[:, 1], -w)
        return diff.cumsum(0)[:nq]

    def row_kind_counts(self) -> tuple[torch.Tensor, torch.Tensor]:
        """int64 ``[nQb]`` twice: the FULL and the PARTIAL blocks of each block row, in
        O(rectangles + rows) (no dense map).

        >>> bm = classify(causal(), torch.arange(8), torch.arange(8), block_size=2, sparse=True)
        >>> [t.tolist() for t in bm.row_kind_counts()]
        [[0, 1, 2, 3], [1, 1, 1, 1]]
        """
        nq = self.shape[0]
        w = self.rects[:, 3] - self.rects[:, 2]
        out = []
        for kind in (_FULL, _PARTIAL):
            sel = self.codes == kind
            diff = torch.zeros(nq + 1, dtype=torch.int64)
            diff.index_add_(0, self.rects[sel, 0], w[sel])
            diff.index_add_(0, self.rects[sel, 1], -w[sel])
            out.append(diff.cumsum(0)[:nq])
        return out[0], out[1]

    def row_spans(self) -> tuple[torch.Tensor, torch.Tensor]:
        """int64 ``[nQb]`` twice: the first non-empty block column of each block row and one
        past its last (``nKb`` and ``0`` for an empty row), without a dense map.

        Costs the row-rectangle incidences (the per-row runs: O(log) a row for the
        structured masks).

        >>> ids = torch.tensor([0] * 4 + [1] * 4)
        >>> bm = classify(causal() & document(ids), torch.arange(8), torch.arange(8),
        ...               block_size=2, sparse=True)
        >>> [t.tolist() for t in bm.row_spans()]
        [[0, 0, 2, 2], [1, 2, 3, 4]]
        """
        nq, nk = self.shape
        first = torch.full((nq,), nk, dtype=torch.int64)
        end = torch.zeros(nq, dtype=torch.int64)
        R = self.rects
        if len(R):
            h = R[:, 1] - R[:, 0]
            rep = torch.repeat_interleave(torch.arange(len(R)), h)
            row = R[rep, 0] + torch.arange(rep.numel()) - torch.repeat_interleave(h.cumsum(0) - h, h)
            first.scatter_reduce_(0, row, R[rep, 2], "amin")
            end.scatter_reduce_(0, row, R[rep, 3], "amax")
        return first, end

    @staticmethod
    def from_dense(dense: torch.Tensor) -> BlockMap:
        """The sparse map of a dense int8 ``[nQb, nKb]`` map of :class:`BlockKind` codes (one
        rectangle per run of equal codes along a row).

        Raises:
            ValueError: not a 2-D map of codes EMPTY / PARTIAL / FULL.
        """
        d = torch.as_tensor(dense)
        if d.dim() != 2 or d.dtype.is_floating_point or d.dtype == torch.bool:
            raise ValueError(f"a dense block map is a 2-D integer tensor of BlockKind codes "
                             f"[nQb, nKb], got {d.dtype} shape={tuple(d.shape)}")
        d = d.to(torch.int8)
        if d.numel() and not bool(((d == _EMPTY) | (d == _PARTIAL) | (d == _FULL)).all()):
            raise ValueError("a dense block map holds BlockKind codes only (0 EMPTY, 1 PARTIAL, "
                             "2 FULL)")
        nq, nk = d.shape
        dp = torch.nn.functional.pad(d, (1, 1))                     # [nq, nk + 2], zero edges
        edge = dp[:, 1:] != dp[:, :-1]                              # [nq, nk + 1]: code changes
        r, c = torch.nonzero(edge & (dp[:, 1:] != _EMPTY), as_tuple=True)      # run starts
        re, ce = torch.nonzero(edge & (dp[:, :-1] != _EMPTY), as_tuple=True)   # run ends
        rects = torch.stack([r, r + 1, c, ce], dim=1)
        return BlockMap.of((nq, nk), rects, d[r, c] if len(r) else torch.zeros(0, dtype=torch.int8))

    def pieces(self, q_index: torch.Tensor, kv_index: torch.Tensor, *,
               cut: int | None = None) -> int:
        """How many rectangles :meth:`permute` with these arguments makes (cheap)."""
        qrid, krid = _runs(q_index, cut)[2], _runs(kv_index, cut)[2]
        R = self.rects
        nr = qrid[R[:, 1] - 1] - qrid[R[:, 0]] + 1
        nc = krid[R[:, 3] - 1] - krid[R[:, 2]] + 1
        return int((nr * nc).sum())

    def permute(self, q_index: torch.Tensor, kv_index: torch.Tensor, *,
                cut: int | None = None) -> BlockMap:
        """The same classification with block row ``r`` moved to ``q_index[r]`` and block
        column ``c`` to ``kv_index[c]`` (permutations of the block indices: e.g. sequence
        order to a block-aligned layout's order).

        Each rectangle is split into the runs of rows (and columns) that stay consecutive
        under the index, and, with ``cut``, at multiples of ``cut`` in the new order (tile
        boundaries: no rectangle of the result crosses one).
        """
        q_index = torch.as_tensor(q_index, dtype=torch.int64)
        kv_index = torch.as_tensor(kv_index, dtype=torch.int64)
        if q_index.numel() != self.shape[0] or kv_index.numel() != self.shape[1]:
            raise ValueError(f"permute: q_index has {q_index.numel()} and kv_index "
                             f"{kv_index.numel()} entries; the map is {self.shape}")
        qs, qe, qrid = _runs(q_index, cut)
        ks, ke, krid = _runs(kv_index, cut)
        R = self.rects
        ra, ca = qrid[R[:, 0]], krid[R[:, 2]]
        nr, nc = qrid[R[:, 1] - 1] - ra + 1, krid[R[:, 3] - 1] - ca + 1
        total = nr * nc
        rep = torch.repeat_interleave(torch.arange(len(R)), total)
        k = torch.arange(int(total.sum())) - torch.repeat_interleave(total.cumsum(0) - total, total)
        ncr = nc[rep]
        rr = ra[rep] + torch.div(k, ncr, rounding_mode="floor")
        cc = ca[rep] + k % ncr
        r0 = torch.maximum(R[rep, 0], qs[rr])
        r1 = torch.minimum(R[rep, 1], qe[rr])
        c0 = torch.maximum(R[rep, 2], ks[cc])
        c1 = torch.minimum(R[rep, 3], ke[cc])
        nr0, nc0 = q_index[r0], kv_index[c0]
        rects = torch.stack([nr0, nr0 + (r1 - r0), nc0, nc0 + (c1 - c0)], dim=1)
        return BlockMap.of(self.shape, rects, self.codes[rep])

    @staticmethod
    def of(shape: tuple[int, int], rects: torch.Tensor, codes: torch.Tensor) -> BlockMap:
        """A map from disjoint rectangles in any order (sorted here by ``(r0, c0)``)."""
        if len(rects):
            order = (rects[:, 0] * (shape[1] + 1) + rects[:, 2]).argsort()
            rects, codes = rects[order], codes[order]
        return BlockMap((int(shape[0]), int(shape[1])), rects.to(torch.int64).contiguous(),
                        codes.to(torch.int8).contiguous())

    def __repr__(self) -> str:
        return (f"BlockMap({self.shape[0]} x {self.shape[1]} blocks, {len(self)} rects, "
                f"{self.count(_FULL):,} full, {self.count(_PARTIAL):,} partial)")
