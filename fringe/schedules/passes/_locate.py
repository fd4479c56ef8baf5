"""Locating a fault: program order over a table's parts, the op a row is in its rank's
program view, and the :class:`~fringe.schedules.ir.ScheduleError` that names it with the
program and ``<-- ERROR HERE`` on the step."""
from __future__ import annotations

import numpy as np

from ..ir import Op, ProgramTable, ScheduleError, marked


def _where_cols(tab: ProgramTable, tie: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(rank, step, order) of the ops of one part: ``tie`` 0 computes, 1 sends (a transfer
    on its source), 2 receives (on its destination), 3 collective sides; within a rank's step
    ops go by (order, tie, row), as the program views list them."""
    comp, xfer, coll = tab._parts
    part, names = {0: (comp, ("rank", "step", "order")), 1: (xfer, ("src", "step", "order")),
                   2: (xfer, ("dst", "step", "rorder")),
                   3: (coll, ("rank", "step", "order"))}[tie]
    return tuple(np.asarray(part[k], dtype=np.int64) for k in names)


def _first_in_order(tab: ProgramTable, cands: list) -> tuple[int, int]:
    """The first in program order of candidate ops ``[(tie, rows, sub), ...]`` (``sub``:
    None, or each entry's place within its op, an int or an array): ``(k, j)``, entry j of
    ``cands[k]``."""
    keys = []
    for k, (tie, rows, sub) in enumerate(cands):
        rows = np.asarray(rows, dtype=np.int64)
        n = len(rows)
        r, t, o = (c[rows] for c in _where_cols(tab, tie))
        keys.append(np.stack([r, t, o, np.full(n, tie), rows,
                              np.broadcast_to(np.asarray(0 if sub is None else sub, np.int64), (n,)),
                              np.full(n, k), np.arange(n)]))
    a = np.concatenate(keys, axis=1)
    w = int(np.lexsort(a[5::-1])[0])         # by rank, step, order, tie, row, sub
    return int(a[6, w]), int(a[7, w])


def _located(tab: ProgramTable, tie: int, row: int) -> tuple[int, int, Op]:
    """``(rank, step, op)`` of row ``row`` of part ``tie`` (:func:`_where_cols`): the op
    object in its rank's program view (:meth:`ProgramTable.programs`)."""
    r, t, o = (int(c[row]) for c in _where_cols(tab, tie))
    before = 0
    for k, (order, bounds) in enumerate(tab._general_index()[0]):
        rows = order[bounds[r]:bounds[r + 1]]
        _, st, oo = (c[rows] for c in _where_cols(tab, k))
        here = st == t
        rows, oo = rows[here], oo[here]
        before += int(((oo < o) | ((oo == o) & ((k < tie) | ((k == tie) & (rows < row))))).sum())
    step = next(s for s in tab.programs()[r].steps if s.index == t)
    return r, t, step.ops[before]


def _fail(tab: ProgramTable, rank: int, step: int, what: str):
    raise ScheduleError(f"rank {rank}, step {step}: {what}\n{marked(tab.programs()[rank], step)}")
