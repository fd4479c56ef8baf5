"""The one tile-call planner: how a tile's block map is split into kernel calls.

:func:`fringe.ops.tile.tile_forward` / ``tile_backward`` run the calls it plans for one tile
(:func:`plan_tile`), and the cost model (:mod:`fringe.cost.work`) counts the calls and pairs
of thousands of distinct maps at once with the same functions (:func:`fused_pieces` on the
maps stacked into one column, an all-EMPTY block row between them: an empty q-block row
always ends a group, so one pass plans them all exactly as one by one).

Always: consecutive q-block rows are grouped over their non-empty kv block ranges (a row
joins while the group's rectangle costs at most :data:`GROUP_SLACK` times the exact cost).

With ``fused`` (kernels that like few large calls without masks, ``fused_calls``), the first
of these plans that makes no more calls than the plain grouping (else the plain one):

1. *causal runs*: a diagonal run of PARTIAL blocks ``(i+t, j+t)``, ``t < n``, with FULL
   blocks below the diagonal and EMPTY ones above inside the square (and, when a tile gives
   ``causal_block``, each diagonal block exactly lower-triangular), is one square ``causal``
   call (the fused op skips the upper half itself); without ``causal_block`` (the cost model,
   which sees block maps only) the block pattern decides;
2. the rest is grouped by rows as above, and each group's kv range is cut where its columns
   switch between all-FULL (a call without a mask) and mixed (a float mask only over the
   columns that need one); all-EMPTY columns and rows are dropped;
3. or the same without the column cuts.

Every non-empty block is covered by exactly one sub-problem, so the results sum (dk, dv) or
merge (out, lse) to the unsplit ones. Pieces are block-index rectangles ``(qb0, qb1, kb0,
kb1)``; callers clip the last block to the tile's length.
"""
from __future__ import annotations

from typing import Callable

import numpy as np

from fringe.masks import BlockKind

__all__ = ["GROUP_SLACK", "causal_squares", "fused_pieces", "plan_tile", "row_runs", "split_cols"]

#: A q-block row joins the current group while the group's rectangle costs at most this factor
#: times the exact (per-row range) cost: fewer, larger sub-problems for a little masked waste.
GROUP_SLACK = 1.25

_FULL, _PARTIAL, _EMPTY = int(BlockKind.FULL), int(BlockKind.PARTIAL), int(BlockKind.EMPTY)

CausalCheck = Callable[[int, int], bool]


def row_runs(ne: np.ndarray, slack: float = GROUP_SLACK) -> tuple[list, list, list, list]:
    """Group consecutive q-block rows of a bool map of non-EMPTY blocks over their non-empty
    kv ranges, while the rectangle costs at most ``slack`` times the exact blocks: block-index
    lists ``(qb0, qb1, kb0, kb1)`` in row order."""
    nk = ne.shape[1]
    live = ne.any(axis=1)
    rows = np.flatnonzero(live)
    lo = ne[rows].argmax(axis=1)
    hi = nk - ne[rows, ::-1].argmax(axis=1)
    groups = group_spans(rows.tolist(), lo.tolist(), hi.tolist(), slack)
    return tuple(list(x) for x in zip(*groups)) if groups else ([], [], [], [])


def group_spans(rows, lo, hi, slack: float = GROUP_SLACK) -> list[tuple[int, int, int, int]]:
    """The row-grouping rule of :func:`row_runs`, written once, on rows given as spans: row
    ``rows[m]`` (increasing) has non-empty kv blocks in ``[lo[m], hi[m])``; consecutive rows
    join a group while its rectangle costs at most ``slack`` times their exact blocks. The
    cost model's sparse work counts group by it too (:mod:`fringe.cost.work`)."""
    out = []
    cur = None
    exact = 0
    for i, a, b in zip(rows, lo, hi):
        w = b - a
        if cur is not None:
            qb0, qb1, kb0, kb1 = cur
            if qb1 == i:                               # the row right below: may join
                nlo, nhi = min(kb0, a), max(kb1, b)
                if (i + 1 - qb0) * (nhi - nlo) <= slack * (exact + w):
                    cur, exact = (qb0, i + 1, nlo, nhi), exact + w
                    continue
            out.append(cur)
        cur, exact = (i, i + 1, a, b), w
    if cur is not None:
        out.append(cur)
    return out


def causal_squares(blocks: np.ndarray, nqf: int, nkf: int,
                   check: CausalCheck | None = None) -> list[tuple[int, int, int]]:
    """Maximal diagonal runs ``(i, j, n)`` of PARTIAL blocks with FULL blocks left of the
    diagonal and EMPTY ones above it inside the square, streamed in row-major order, over
    the first ``nqf`` x ``nkf`` blocks (the full-size ones). ``check(i, j)``: the exact
    element-level test of one diagonal block (a block failing it ends its run; None: the
    block pattern decides)."""
    nq, nk = blocks.shape
    if nqf == 0 or nkf == 0:
        return []
    E = blocks == _EMPTY
    c = blocks[:nqf, :nkf]
    right = np.ones((nqf, nkf), dtype=bool)
    right[:, :nkf - 1] = E[:nqf, 1:nkf]
    if nkf < nk:
        right[:, nkf - 1] = E[:nqf, nkf]
    above = np.ones((nqf, nkf), dtype=bool)
    above[1:] = E[:nqf - 1, :nkf]
    ci, cj = np.nonzero((c == _PARTIAL) & right & above)
    if check is not None and len(ci):
        ok = np.array([bool(check(i, j)) for i, j in zip(ci.tolist(), cj.tolist())], dtype=bool)
        ci, cj = ci[ok], cj[ok]
    if not len(ci):
        return []
    # FULL blocks just left of (i, j) in its row, EMPTY blocks just above it in its column
    idx = np.arange(nk)
    last = np.maximum.accumulate(np.where(blocks == _FULL, -1, idx[None, :]), axis=1)
    left_full = np.where(cj > 0, cj - 1 - last[ci, np.maximum(cj - 1, 0)], 0)
    ridx = np.arange(nq)[:, None]
    lastr = np.maximum.accumulate(np.where(E, -1, ridx), axis=0)
    up_empty = np.where(ci > 0, ci - 1 - lastr[np.maximum(ci - 1, 0), cj], 0)
    runs: list[list[int]] = []
    ends: dict[int, int] = {}                          # diagonal j - i -> run index
    for i, j, f, e in zip(ci.tolist(), cj.tolist(), left_full.tolist(), up_empty.tolist()):
        r = ends.get(j - i)
        if r is not None:
            run = runs[r]
            n = run[2]
            if run[0] + n == i and f >= n and e >= n:
                run[2] = n + 1
                continue
        ends[j - i] = len(runs)
        runs.append([i, j, 1])
    return [tuple(r) for r in runs]


def split_cols(codes: np.ndarray, qb0: int, kb0: int, out: list) -> None:
    """Cut a group's kv range where its columns switch between all-FULL and mixed, appending
    ``(qb0, qb1, kb0, kb1)`` pieces to ``out`` (step 2 of the module's plan; the whole group
    when it need not be cut). A run of live columns of one kind becomes a piece over the rows
    that have a non-EMPTY block in it; a mixed piece with fewer rows than its parent is split
    again (a column may have become all-FULL)."""
    ne = codes != _EMPTY
    runs = column_runs((codes == _FULL).all(0).tolist(), ne.any(0).tolist())
    nr = codes.shape[0]
    if runs is None:
        out.append((qb0, qb0 + nr, kb0, kb0 + codes.shape[1]))
        return
    for j, e, full in runs:
        rows = np.flatnonzero(ne[:, j:e].any(1))
        r0, r1 = int(rows[0]), int(rows[-1]) + 1
        if full or (r0, r1) == (0, nr):
            out.append((qb0 + r0, qb0 + r1, kb0 + j, kb0 + e))
        else:
            split_cols(codes[r0:r1, j:e], qb0 + r0, kb0 + j, out)


def column_runs(full: list[bool], live: list[bool]) -> list[tuple[int, int, bool]] | None:
    """Where :func:`split_cols` cuts a group's columns (``full[j]``: column j is all-FULL,
    ``live[j]``: it has a non-EMPTY block): None when the group stays whole (every column
    all-FULL, or none all-FULL and every column live); else the runs ``(start, stop,
    all-FULL)`` of live columns of one kind, left to right. The rule, written once: the
    cost model's sparse work counts cut by it too (:mod:`fringe.cost.work`)."""
    if all(full) or (not any(full) and all(live)):
        return None
    runs, j, n = [], 0, len(live)
    while j < n:
        if not live[j]:
            j += 1
            continue
        e = j + 1
        while e < n and live[e] and full[e] == full[j]:
            e += 1
        runs.append((j, e, full[j]))
        j = e
    return runs


def fused_pieces(tall: np.ndarray, *, per: int, Lq: int, Lk: int, block_size: int,
                 runs_ok: bool, check: CausalCheck | None = None, ordered: bool = False):
    """The fused plan (steps 1-3 of the module's plan) of the maps stacked in ``tall``
    ``[N * per, n]`` (each map's last row all EMPTY), decided map by map.

    Args:
        tall: int8 ``BlockKind`` codes of the stacked maps.
        per: block rows per map, its EMPTY row included.
        Lq, Lk: element length of the q rows of ``tall`` and of the kv columns (blocks past
            them are not full-size: never in a causal square).
        block_size: tokens per block.
        runs_ok: look for causal squares (False: no mask to run them by).
        check: the exact test of one diagonal block (see :func:`causal_squares`).
        ordered: pieces in the order one tile runs them (squares, then row groups in row
            order, each group's column cuts left to right) instead of by category.

    Returns:
        ``(q0, q1, k0, k1, causal, codes_of, work)``: block-index arrays per piece, whether it
        is a causal square, which map its codes come from (0: ``tall``, 1: ``work``, the map
        with the chosen squares emptied), and ``work``.
    """
    slack = GROUP_SLACK
    bs = block_size
    nq, nk = tall.shape
    N = nq // per
    base = row_runs(tall != _EMPTY, slack)
    runs = (causal_squares(tall, min(nq, Lq // bs), min(nk, Lk // bs), check) if runs_ok else [])
    work = tall
    if runs:
        work = tall.copy()
        for i, j, n in runs:
            work[i:i + n, j:j + n] = _EMPTY
    rest = row_runs(work != _EMPTY, slack) if runs else base
    # the column split of every rest group (most are kept whole: find those without Python)
    split: list = []
    rq0, rq1, rk0, rk1 = (np.asarray(x, dtype=np.int64) for x in rest)
    if len(rq0):
        cf = np.zeros((nq + 1, nk), dtype=np.int32)
        cf[1:] = np.cumsum(work == _FULL, axis=0)
        cl = np.zeros((nq + 1, nk), dtype=np.int32)
        cl[1:] = np.cumsum(work != _EMPTY, axis=0)
        h = (rq1 - rq0)[:, None]
        inside = (np.arange(nk)[None, :] >= rk0[:, None]) & (np.arange(nk)[None, :] < rk1[:, None])
        fullc = (cf[rq1] - cf[rq0]) == h
        livec = (cl[rq1] - cl[rq0]) > 0
        all_full = (fullc | ~inside).all(1)
        none_full_all_live = ~(fullc & inside).any(1) & (livec | ~inside).all(1)
        whole = all_full | none_full_all_live
        for g in np.flatnonzero(~whole).tolist():
            a, b, c, d = int(rq0[g]), int(rq1[g]), int(rk0[g]), int(rk1[g])
            pieces: list = []
            split_cols(work[a:b, c:d], a, c, pieces)
            split.append((g, pieces))
    # per map: squares + split, else squares + rest, else base (the fewest calls wins)
    def per_map(q0):
        return np.bincount(np.asarray(q0, dtype=np.int64) // per, minlength=N)
    n_base, n_rest = per_map(base[0]), per_map(rest[0])
    n_sq = per_map([r[0] for r in runs])
    extra = np.zeros(N, dtype=np.int64)                # pieces beyond one per split group
    for g, pieces in split:
        extra[int(rq0[g]) // per] += len(pieces) - 1
    n_split = n_rest + extra
    choice = np.where(n_sq + n_split <= n_base, 0, np.where(n_sq + n_rest <= n_base, 1, 2))
    parts = []                                         # (pieces, order keys (group, piece))
    # base (codes of tall)
    bq0 = np.asarray(base[0], dtype=np.int64)
    sel = choice[bq0 // per] == 2
    parts.append(((bq0[sel], np.asarray(base[1], dtype=np.int64)[sel],
                   np.asarray(base[2], dtype=np.int64)[sel],
                   np.asarray(base[3], dtype=np.int64)[sel],
                   np.zeros(int(sel.sum()), bool), np.zeros(int(sel.sum()), np.int8)),
                  (np.flatnonzero(sel), np.zeros(int(sel.sum()), np.int64))))
    if runs:
        R = np.asarray(runs, dtype=np.int64)
        sel = choice[R[:, 0] // per] != 2
        i, j, n = R[sel, 0], R[sel, 1], R[sel, 2]
        parts.append(((i, i + n, j, j + n, np.ones(len(i), bool), np.ones(len(i), np.int8)),
                      (np.flatnonzero(sel) - len(R), np.zeros(len(i), np.int64))))  # first
    # rest groups: kept whole for choice 1, and for choice 0 when not split
    m_rest = choice[rq0 // per] if len(rq0) else np.zeros(0, np.int64)
    keep = m_rest == 1
    if len(rq0):
        keep |= (m_rest == 0) & whole
    parts.append(((rq0[keep], rq1[keep], rk0[keep], rk1[keep], np.zeros(int(keep.sum()), bool),
                   np.ones(int(keep.sum()), np.int8)),
                  (np.flatnonzero(keep), np.zeros(int(keep.sum()), np.int64))))
    sp = [(g, k, *p) for g, pieces in split if m_rest[g] == 0 for k, p in enumerate(pieces)]
    if sp:
        S_ = np.asarray(sp, dtype=np.int64)
        parts.append(((S_[:, 2], S_[:, 3], S_[:, 4], S_[:, 5], np.zeros(len(S_), bool),
                       np.ones(len(S_), np.int8)), (S_[:, 0], S_[:, 1])))
    cat = [np.concatenate([p[0][k] for p in parts]) for k in range(6)]
    if ordered:                                        # one map's pieces as a tile runs them
        o = np.lexsort((np.concatenate([p[1][1] for p in parts]),
                        np.concatenate([p[1][0] for p in parts])))
        cat = [x[o] for x in cat]
    return (*cat, work)


def plan_tile(blocks: np.ndarray, *, Lq: int, Lk: int, block_size: int, fused: bool = False,
              causal_block: CausalCheck | None = None) -> list[tuple[int, int, int, int, bool]]:
    """One tile's kernel calls: ``(qb0, qb1, kb0, kb1, causal)`` block rectangles in the order
    they run (see the module's plan; ``fused``: steps 1-3, else the row groups).

    With ``causal_block``, the element checks cost a mask evaluation per diagonal block: they
    run only when the block pattern alone already gives a plan with causal squares (a window
    never does), and the plan is made again with them only when a block fails.
    """
    blocks = np.asarray(blocks, dtype=np.int8)
    nq, nk = blocks.shape
    if not fused:
        return [(a, b, c, d, False) for a, b, c, d in zip(*row_runs(blocks != _EMPTY))]
    tall = np.full((nq + 1, nk), _EMPTY, dtype=np.int8)
    tall[:nq] = blocks

    def pieces(check):
        q0, q1, k0, k1, causal, _, _ = fused_pieces(tall, per=nq + 1, Lq=Lq, Lk=Lk,
                                                    block_size=block_size, runs_ok=True,
                                                    check=check, ordered=True)
        return list(zip(q0.tolist(), q1.tolist(), k0.tolist(), k1.tolist(), causal.tolist()))

    plan = pieces(None)
    if causal_block is None or not any(p[4] for p in plan):
        return plan
    memo: dict = {}

    def check(i: int, j: int) -> bool:
        if (i, j) not in memo:
            memo[i, j] = bool(causal_block(i, j))
        return memo[i, j]

    if all(check(a + t, c + t) for a, b, c, d, sq in plan if sq for t in range(b - a)):
        return plan
    return pieces(check)
