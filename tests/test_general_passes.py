"""The passes on a general ProgramTable (head slices and collectives as columns) give the
programs the op-by-op rules give, and reject what those reject.

The collective schedules (allgather, ulysses, compose) build general tables so that a
P=1024 plan does not build millions of op objects; the column passes must stay op-for-op
equal to the rules they replace, for any tile map, or ranks would run different plans than
the documented rules say.
"""
from __future__ import annotations

import numpy as np
import pytest

from fringe import schedules
from fringe.schedules import ScheduleError, passes
from fringe.schedules.ir import (Buffer, Collective, Compute, Program, ProgramTable, Step,
                                 format_programs)
from fringe.schedules.passes._columns import _GENS
from fringe.testing import oracle

SPECS = ("allgather", "allgather:3", "ulysses", "compose:zigzag+ulysses:2",
         "compose:ring+ulysses:4", "compose:striped+ulysses:2", "compose:allgather+ulysses:2",
         "compose:balanced+ulysses:2", "compose:zigzag+ring:2", "compose:zigzag+allgather:2:2",
         "zigzag")


def _need(P: int, seed: int, density: float) -> np.ndarray:
    rng = np.random.default_rng(seed)
    need = rng.random((P, P)) < density
    need[np.arange(P), np.arange(P)] |= rng.random(P) < 0.5
    return need


def _op_programs(spec: str, P: int, need: np.ndarray) -> list[Program]:
    """The schedule's programs as plain op values (no table behind them)."""
    progs = schedules.get(spec).programs(P, need)
    return [Program(p.rank, p.steps) for p in progs]


def _cases():
    for spec in SPECS:
        for P in ((2, 4) if spec == "ulysses" else (4, 8)):
            for seed, density in ((0, 0.3), (1, 0.7), (2, 1.0)):
                yield spec, P, seed, density


@pytest.mark.parametrize("spec,P,seed,density", list(_cases()))
def test_column_passes_equal_the_op_rules(spec, P, seed, density):
    need = _need(P, seed, density)
    plain = _op_programs(spec, P, need)
    tab = ProgramTable.of(plain)
    assert list(tab.programs()) == plain
    assert passes._general_ok(tab, need, False, "resend") is True
    assert passes._general_prune(tab, need) == plain
    less = need & _need(P, seed + 10, 0.8)           # a map the programs were not built for
    if less.any():
        got = passes._general_prune(tab, less)
        assert got == oracle.prune(plain, less), (spec, "prune")
    for kv in ("resend", "keep"):
        want = oracle.reverse(plain, kv=kv)
        got = passes._general_reverse(tab, kv)
        assert format_programs(got) == format_programs(want), (spec, kv)
        assert got[0].table is not None
        assert passes._general_ok(got[0].table, need, True, kv) is True
        if kv == "resend":                              # keep: the kv is kept anyway
            assert passes._general_ok(got[0].table, need, True, "keep") is True
        else:                                           # nothing re-sends the kv kept
            with pytest.raises(ScheduleError, match="which is not on rank"):
                passes._general_ok(got[0].table, need, True, "resend")


def _plan_programs():
    need = np.ones((8, 8), dtype=bool) & np.tri(8, dtype=bool)
    return need, _op_programs("compose:zigzag+ulysses:2", 8, need)


def _edit(progs, rank, fn):
    progs = list(progs)
    p = progs[rank]
    progs[rank] = Program(rank, tuple(fn(list(p.steps))))
    return progs


def _drop_compute(steps):
    i = next(i for i, s in enumerate(steps) if s.computes)
    ops = list(steps[i].ops)
    del ops[next(j for j, o in enumerate(ops) if isinstance(o, Compute))]
    steps[i] = Step(steps[i].index, tuple(ops))
    return steps


def _compute_too_early(steps):
    late = next(o for o in steps[-2].ops if isinstance(o, Compute))
    steps[0] = Step(steps[0].index, steps[0].ops + (late,))
    del_ops = [o for o in steps[-2].ops if o is not late]
    steps[-2] = Step(steps[-2].index, tuple(del_ops))
    return steps


def _swap_collectives(steps):
    ops = list(steps[0].ops)
    a, b = [i for i, o in enumerate(ops) if isinstance(o, Collective)][:2]
    ops[a], ops[b] = ops[b], ops[a]
    steps[0] = Step(steps[0].index, tuple(ops))
    return steps


def _wrong_slot(steps):
    ops = list(steps[0].ops)
    i = next(i for i, o in enumerate(ops) if isinstance(o, Collective))
    op = ops[i]
    si, sb = op.sparse_sends
    first = sb[0]                 # the slot to member 0 (rank 1's own slot is the last)
    other = Buffer.of(first.family, first.chunk, (1 - first.heads[0], first.heads[1]))
    ops[i] = Collective.sparse(op.kind, op.group, (si, (other,) + sb[1:]), op.sparse_recvs)
    steps[0] = Step(steps[0].index, tuple(ops))
    return steps


@pytest.mark.parametrize("fault,message", [
    (_drop_compute, "computed 1 times"), (_compute_too_early, "not on rank"),
    (_swap_collectives, "receives kv0h1/2 from rank 0"), (_wrong_slot, "but rank 0's side")])
def test_a_fault_in_a_general_table_is_named_by_check(fault, message):
    need, progs = _plan_programs()
    bad = _edit(progs, 3 if fault in (_drop_compute, _compute_too_early) else 1, fault)
    tab = ProgramTable.of(bad)
    with pytest.raises(ScheduleError, match=message):
        passes._general_ok(tab, need, False, "resend")
    with pytest.raises(ScheduleError, match=message):
        passes.check(list(tab.programs()), need=need)


def test_general_digest_follows_the_programs():
    need, progs = _plan_programs()
    a = ProgramTable.of(progs)
    b = ProgramTable.of([Program(p.rank, p.steps) for p in progs])
    c = ProgramTable.of(_edit(progs, 3, _drop_compute))
    assert a.digest() == b.digest() != c.digest()


def test_a_general_table_has_no_row_columns():
    _, progs = _plan_programs()
    tab = ProgramTable.of(progs)
    with pytest.raises(TypeError, match="are a view of tables"):
        tab.kind
    assert len(tab) == sum(len(s.ops) for p in progs for s in p.steps)


def test_a_table_checked_once_is_still_checked_for_its_tiles_and_cannot_be_refilled():
    """check() remembers on a table which structural checks its columns passed (plans check
    a forward twice); the columns are read-only, and the tile map is checked every call."""
    need, progs = _plan_programs()
    tab = ProgramTable.of(progs)
    cut = list(tab.programs())
    passes.check(cut, need=need)
    assert (False, None) in tab._passed
    with pytest.raises(ValueError, match="read-only"):
        tab._parts[0]["q"][0] = 5
    other = need.copy()
    other[0, 7] = True                     # a tile nobody computes
    with pytest.raises(ScheduleError, match="never computed"):
        passes.check(cut, need=other)
    passes.check(cut, need=need)


def test_past_the_plane_limit_the_checks_sort_and_the_rules_decide(monkeypatch):
    """Plans too large for a dense (rank, buffer) plane check presence, re-send and prune by
    sorting keys: the oracle's answers, faults still found."""
    need, progs = _plan_programs()
    monkeypatch.setattr(passes, "PLANE_CELLS", 0)
    tab = ProgramTable.of(progs)
    assert passes._general_ok(tab, need, False, "resend") is True
    for kv in ("resend", "keep"):
        assert format_programs(passes._general_reverse(tab, kv)) == format_programs(
            oracle.reverse(progs, kv=kv))
    less = need & ~np.eye(8, k=-1, dtype=bool)      # a map the programs were not built for
    assert passes._general_prune(tab, less) == oracle.prune(progs, less)
    bad = ProgramTable.of(_edit(progs, 3, _compute_too_early))
    with pytest.raises(ScheduleError, match="not on rank"):
        passes._general_ok(bad, need, False, "resend")


def test_shared_columns_derive_a_table_once_and_change_no_result():
    """Inside ``shared_columns()`` (what fringe.plan runs its passes in) a table's general
    columns are derived once, read-only, and dropped on exit; the passes answer the same."""
    need, progs = _plan_programs()
    tab = ProgramTable.of(progs)

    def run():
        return (format_programs(passes._general_prune(tab, need & ~np.eye(8, dtype=bool))),
                format_programs(passes._general_reverse(tab, "resend")),
                format_programs(passes._general_reverse(tab, "keep")),
                passes._general_ok(tab, need, False, "resend"))
    alone = run()
    with passes.shared_columns():
        a, b = passes._Gen(tab), passes._Gen(tab)
        assert a.inst is b.inst and a.cq is b.cq
        # no chunk or member past P - 1: the lenient form (what check reads) is the same one
        assert passes._Gen(tab, lenient=True).inst is a.inst
        with pytest.raises(ValueError, match="read-only"):
            a.me[0] = 1
        with passes.shared_columns():          # nests
            assert passes._Gen(tab).sidx is a.sidx
        assert passes._Gen(tab).sidx is a.sidx
        shared = run()
    assert passes._Gen(tab).sidx is not a.sidx
    assert shared == alone


def test_shared_columns_keep_the_newest_table_only():
    """The passes read one table after another; shared_columns() keeps the newest table's
    columns (both forms) and drops older ones, so dead tables and their int64 copies do not
    pile up over a plan (memory at P=1024), and a dropped table is derived again, equal."""
    need, progs = _plan_programs()
    tab = ProgramTable.of(progs)
    other = ProgramTable.of(passes.reverse(progs, kv="resend"))
    with passes.shared_columns():
        a = passes._Gen(tab)
        assert passes._Gen(tab, lenient=True).cq is a.cq
        b = passes._Gen(other)
        assert {k[0] for k in _GENS[0]} == {id(other)}
        assert passes._Gen(other).cq is b.cq
        again = passes._Gen(tab)                     # derived anew: equal, not the same
        assert again.cq is not a.cq and again.cq.tolist() == a.cq.tolist()
        assert {k[0] for k in _GENS[0]} == {id(tab)}


@pytest.mark.parametrize("x", [[], [5], [3, 3, 3], [7, -2, 7, 0, -2], [2 ** 40, 7, 2 ** 40, 9]])
def test_unique_by_marks_or_by_sort_is_numpys(x):
    x = np.array(x, dtype=np.int64)
    got, inv = passes._unique(x)
    want, want_inv = np.unique(x, return_inverse=True)
    assert got.tolist() == want.tolist() and inv.tolist() == want_inv.ravel().tolist()


def _verdict(tab):
    try:
        return passes._general_ok(tab, None, False, "resend")
    except ScheduleError as e:
        return str(e)


@pytest.mark.parametrize("spec,P", [("allgather:3", 6), ("compose:zigzag+ulysses:2", 8),
                                    ("two-level(2)", 8)])
def test_dense_slot_matching_agrees_with_sorted_keys(spec, P, monkeypatch):
    """check matches a collective's sends with receives through a dense [side, member]
    table (``_slots_matched``) up to MATCH_CELLS, by sorted keys past it (and to name a
    fault): the same verdict both ways on valid tables and on tables with one slot's buffer
    changed or one slot dropped."""
    need = np.tri(P, dtype=bool)
    from fringe.testing.user_schedules import two_level_allgather_columns
    sched = two_level_allgather_columns(2) if spec == "two-level(2)" else schedules.get(spec)
    tab = ProgramTable.of(sched.programs(P, need))
    comp, xfer, coll = tab._parts
    n = len(coll["slot_side"])
    assert n
    rng = np.random.default_rng(P)
    cases = [coll]
    for i in rng.choice(n, size=min(n, 12), replace=False).tolist():
        bumped = {k: np.array(v) if k != "groups" else v for k, v in coll.items()}
        bumped["slot_chunk"][i] = (bumped["slot_chunk"][i] + 1) % P
        dropped = {k: np.delete(v, i) if k.startswith("slot_") else v for k, v in coll.items()}
        cases += [bumped, dropped]
    verdicts = []
    for c in cases:
        dense = _verdict(ProgramTable._of_parts(P, dict(comp), dict(xfer), dict(c)))
        with monkeypatch.context() as m:
            m.setattr(passes, "MATCH_CELLS", 0)
            assert _verdict(ProgramTable._of_parts(P, dict(comp), dict(xfer), dict(c))) == dense
        verdicts.append(dense)
    assert verdicts[0] is True and any(v is not True for v in verdicts)
    assert any("sends" in v and "receives" in v for v in verdicts if v is not True)


@pytest.mark.parametrize("n_keys", [3, 4000])           # by search / by a dense table
def test_lookup_by_search_or_by_a_dense_table(n_keys):
    rng = np.random.default_rng(n_keys)
    table = np.unique(rng.integers(-5, 300, 120)).astype(np.int64)
    values = rng.integers(0, 100, len(table))
    keys = rng.integers(-20, 320, n_keys).astype(np.int64)
    got, hit = passes._lookup(keys, table, values, -7)
    want = dict(zip(table.tolist(), values.tolist()))
    assert got.tolist() == [want.get(k, -7) for k in keys.tolist()]
    assert hit.tolist() == [k in want for k in keys.tolist()]


def _wide(tab: ProgramTable) -> ProgramTable:
    """``tab`` with its transfer columns as int64 (the passes read the table's own columns,
    int32 where they fit: :class:`fringe.schedules.passes._columns._Gen`)."""
    comp, xfer, coll = tab._parts
    x = {}
    for k, v in xfer.items():
        if isinstance(v, np.ndarray):
            v = np.array(v, dtype=np.int64)
            v.setflags(write=False)
        x[k] = v
    wide = object.__new__(ProgramTable)
    wide._init(tab.world_size, (dict(comp), x, dict(coll)))
    return wide


@pytest.mark.parametrize("spec,P", [("zigzag", 8), ("ring", 8), ("compose:zigzag+ulysses:2", 8),
                                    ("allgather", 4), ("compose:ring+ulysses:4", 8)])
def test_narrow_and_wide_transfer_columns_give_one_answer(spec, P):
    """The general passes read the table's transfer columns as they are (int32 at any size
    that fits: 16.8M rows a direction at P=4,096), casting to int64 wherever a product could
    pass 2**31: the same programs as from int64 columns, ranged ones too."""
    import torch
    import fringe
    from fringe import masks
    from fringe.masks import BlockKind
    S = P * 2 * 4 * 16                                  # 4 blocks of 16 a chunk
    docs = torch.tensor([0] * (S // 3) + [1] * (S // 2) + [2] * (S - S // 3 - S // 2))
    plan = fringe.plan(schedules.get(spec), masks.causal() & masks.document(docs), seq_len=S,
                       world_size=P, block_size=16)
    need = (plan.tiles != BlockKind.EMPTY).numpy()
    kv = str(getattr(plan.kv, "value", plan.kv))
    assert ProgramTable.of(plan.forward).ranged          # block ranges: the general passes
    for progs, backward in ((plan.forward, False), (plan.backward, True)):
        tab = ProgramTable.of(progs)
        assert tab._parts[1]["src"].dtype == np.int32          # what production reads
        wide = _wide(tab)
        assert wide._parts[1]["src"].dtype == np.int64
        assert wide.digest() == tab.digest()
        if not backward:
            for kv in ("resend", "keep"):
                assert format_programs(passes._general_reverse(wide, kv)) == format_programs(
                    passes._general_reverse(tab, kv)), (spec, kv)
        assert passes._general_ok(wide, need, backward, kv) is True
        assert passes._general_ok(tab, need, backward, kv) is True
        less = need & ~np.eye(P, dtype=bool)
        if not backward and less.any():
            assert passes._general_prune(wide, less) == passes._general_prune(tab, less)


def test_a_pass_output_concatenates_narrow_without_wrapping():
    """The backward's transfer columns are concatenated as int32 only where every value fits
    (else int64, exact), all zeros as zeroed pages; ``_of_parts(fresh=True)`` takes such an
    array as the table's own, read-only."""
    from fringe.schedules.ir import column_dtype, concat_column as _cat_narrow, step_scalar
    for lo, hi in ((0, 0), (-1, 0), (-2 ** 31, 2 ** 31 - 1), (0, 2 ** 31), (-2 ** 31 - 1, 0)):
        col = ProgramTable._of_parts(1, dict(rank=[], step=[], kind=[], q=[], kv=[], order=[]),
                                     dict(step=[lo, hi], src=[0, 0], dst=[0, 0], fam=[1, 1],
                                          chunk=[0, 0], order=[0, 1]))._parts[1]["step"]
        want = column_dtype(lo, hi)      # one rule: the table's width is the pass outputs'
        assert col.dtype == (want or np.int32) == _cat_narrow([np.array([lo, hi])]).dtype
    t32 = np.array([0, 7], np.int32)
    assert (step_scalar(2 ** 31) - t32).tolist() == [2 ** 31, 2 ** 31 - 7]
    assert (step_scalar(9) - t32).dtype == np.int32
    a, b = np.array([1, 2 ** 31 - 1], np.int64), np.array([-2 ** 31], np.int64)
    got = _cat_narrow([a, b])
    assert got.dtype == np.int32 and got.tolist() == [1, 2 ** 31 - 1, -2 ** 31]
    big = _cat_narrow([a, np.array([2 ** 31], np.int64)])
    assert big.dtype == np.int64 and big.tolist() == [1, 2 ** 31 - 1, 2 ** 31]
    z = _cat_narrow([np.zeros(3, np.int64), np.zeros(0, np.int64)])
    assert z.dtype == np.int32 and z.tolist() == [0, 0, 0]
    step = _cat_narrow([np.array([0, 1], np.int64), np.array([1], np.int64)])
    cols = dict(step=step, src=np.array([0, 1, 0]), dst=np.array([1, 0, 1]),
                fam=np.array([1, 1, 1]), chunk=np.array([0, 1, 0]), order=np.array([0, 0, 1]))
    empty = dict(rank=[], step=[], kind=[], q=[], kv=[], order=[])
    tab = ProgramTable._of_parts(2, empty, cols, fresh=True)
    assert tab._parts[1]["step"] is step and not step.flags.writeable
    cols2 = dict(cols, step=np.array([0, 1, 1], np.int64))
    kept = ProgramTable._of_parts(2, empty, cols2)          # not fresh: the table's own copy
    assert kept._parts[1]["step"] is not cols2["step"]
    cols2["step"][0] = 5
    assert kept._parts[1]["step"].tolist() == [0, 1, 1]


def test_int32_transfer_steps_neither_wrap_nor_overflow():
    """Transfer steps read as int32 (the table's own columns) give the int64 answer: a write
    step ``t + 1`` and the "never written" sentinel do not wrap (check would pass programs
    that read a buffer before it arrives), and a backward ``T - t`` past 2**31 is exact."""
    from fringe.schedules.ir import Recv, Send
    kv1, dq = Buffer.of("kv", 1), Buffer.of("dq", 0, (0, 60000))   # HS ~ 1.8e9: sorted keys
    cases = [[Program(0, (Step(0, (Send(dq, 1),)),)), Program(1, (Step(0, (Recv(dq, 0),)),))],
             [Program(0, (Step(0, (Compute(0, 1),)), Step(2 ** 31 - 1, (Recv(kv1, 1),)))),
              Program(1, (Step(0, (Compute(1, 1),)), Step(2 ** 31 - 1, (Send(kv1, 0),))))]]
    for progs, what in zip(cases, ("sends dq0h0/60000, which is not on rank 0",
                                   "needs kv1, which is not on rank 0")):
        tab = ProgramTable.of(progs)
        assert tab._parts[1]["step"].dtype == np.int32
        for t in (tab, _wide(tab)):
            with pytest.raises(ScheduleError, match=what):
                passes._general_ok(t, None, False, "resend")
    late = [Program(0, (Step(0, (Recv(kv1, 1),)), Step(2 ** 31 + 5, (Compute(0, 1),)))),
            Program(1, (Step(0, (Send(kv1, 0), Compute(1, 1))),))]
    tab = ProgramTable.of(late)
    assert tab._parts[1]["step"].dtype == np.int32
    for kv in ("resend", "keep"):
        assert format_programs(passes._general_reverse(tab, kv)) == format_programs(
            passes._general_reverse(_wide(tab), kv))


def _orders_spread(tab: ProgramTable) -> ProgramTable:
    """``tab`` with every order raised by ``(T - step) * 2**22``: the same programs (orders
    only rank the ops of one rank's step), orders as large as a plan's row indices at
    P=4,096 and, across steps, decreasing (a ``ProgramBuilder`` may number them so)."""
    comp, xfer, coll = (dict(p) for p in tab._parts)
    T = 1 + max(int(np.max(x["step"])) for x in (comp, xfer, coll) if len(x["step"]))

    def spread(part, col):
        return (T - np.asarray(part["step"], np.int64)) * (1 << 22) + np.asarray(part[col],
                                                                                 np.int64)
    comp["order"] = spread(comp, "order")
    xfer["order"], xfer["rorder"] = spread(xfer, "order"), spread(xfer, "rorder")
    coll["order"] = spread(coll, "order")
    return ProgramTable._of_parts(tab.world_size, comp, xfer, coll)


@pytest.mark.parametrize("spec", SPECS)
def test_reverse_orders_ops_by_program_order_however_large_the_orders(spec):
    """The backward's re-sends go in the op rules' order (buffers by first read in program
    order, then by first hop), keyed by (rank, step, order) with fields as wide as the
    columns (a packed key with 20-bit fields would let such orders spill into the step
    field): the same backward however the orders are numbered."""
    need = _need(8, 3, 0.6)
    progs = _op_programs(spec, 8, need)
    tab = ProgramTable.of(progs)
    big = _orders_spread(tab)
    assert list(big.programs()) == list(tab.programs())
    for kv in ("resend", "keep"):
        want = format_programs(oracle.reverse(progs, kv=kv))
        assert format_programs(passes._general_reverse(big, kv)) == want, kv
        assert format_programs(passes._general_reverse(tab, kv)) == want, kv
