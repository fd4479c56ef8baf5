"""No silent fallback (issue 18): every built-in schedule's plan runs the passes (check,
prune, reverse) on columns; a program the column path does not take is counted by (pass,
reason), and raises naming both inside ``passes.no_fallbacks()`` or with
``FRINGE_STRICT_PASSES=1``, while still getting the op rules' answer outside."""
from __future__ import annotations

import pytest

from fringe import masks, schedules
from fringe.testing import packed_docs
from fringe.cost import programs as cost_programs
from fringe.plan import plan as make_plan
from fringe.runtime import costmodel
from fringe.schedules import passes
from fringe.schedules.ir import Recv, program_from_ops
from fringe.schedules.passes import ScheduleError
from fringe.testing import user_schedules

P, S, BLOCK = 16, 2048, 16

SPECS = ["ring", "zigzag", "striped", "balanced", "allgather", "allgather:3", "ulysses",
         "compose:zigzag+ulysses:2", "compose:zigzag+allgather:2:2", "compose:zigzag+ring:2",
         "compose:allgather:4+ulysses:2", "compose:ring+ulysses:4"]
USER = {"two_level_allgather(4)": lambda: user_schedules.two_level_allgather(4),
        "allgather_then_ring(4)": lambda: user_schedules.allgather_then_ring(4),
        "two_level_allgather_columns(4)": lambda: user_schedules.two_level_allgather_columns(4)}

#: What still falls back today, by schedule: a new fallback fails the test, a legitimate one
#: is listed here with its reason. The passes (check, prune, reverse), the cost model's
#: program reader and plan stats (general tables too: head slices, collectives) take every
#: built-in and user schedule here on columns: nothing is listed.
KNOWN = {name: set() for name in SPECS + sorted(USER)}


def _mask(name: str):
    return {"causal": masks.causal(),
            "documents": masks.causal() & masks.document(packed_docs(S, 5, 1)),
            "window": masks.sliding_window(3 * S // P)}[name]


def _schedule(name: str):
    return USER[name]() if name in USER else schedules.get(name)


def _text(programs) -> list[str]:
    return [p.ascii() for p in programs]


def test_the_registry_is_covered():
    """Every registered name (the compose variants and user schedules besides) is planned."""
    assert set(schedules.names()) <= {s.split(":")[0] for s in SPECS}


@pytest.mark.parametrize("name", SPECS + sorted(USER))
def test_builtin_plans_take_the_column_paths(name):
    """plan (check, prune, reverse), the cost model's reader and plan stats inside
    no_fallbacks, or exactly the fallbacks listed in KNOWN."""
    for mname in ("causal", "documents", "window"):
        for kv in ("resend", "keep"):
            before = passes.fallbacks()
            with passes.no_fallbacks():
                p = make_plan(_schedule(name), _mask(mname), seq_len=S, world_size=P,
                              block_size=BLOCK, kv=kv)
                pred = costmodel.simulate(p, "cpu")
            assert len(p.forward) == P and len(p.backward) == P and pred.forward_s > 0
            if KNOWN[name]:
                p.stats(heads=16)
            else:
                with passes.no_fallbacks():
                    p.stats(heads=16)
            got = set(passes.fallbacks() - before)
            assert got == KNOWN[name], (name, mname, kv, got)


def _allgather_forward():
    sched = schedules.get("allgather")
    need = make_plan(sched, _mask("documents"), seq_len=S, world_size=P,
                     block_size=BLOCK).tiles != 0
    progs = sched.programs(P)             # unpruned, one general table
    assert passes._table(progs) is not None
    return progs, need


def test_past_plane_cells_reverse_and_prune_fall_back_by_name(monkeypatch):
    """A (rank, buffer) plane past PLANE_CELLS: the general re-send and prune give up; inside
    no_fallbacks that raises naming the pass and the reason, outside the op rules answer
    what the columns answer below the limit, and the fallback is counted."""
    progs, need = _allgather_forward()
    with passes.no_fallbacks():           # below the limit: the columns take both
        want_prune = _text(passes.prune(progs, need))
        fwd = passes.prune(progs, need)
        want_rev = _text(passes.reverse(fwd, kv="resend"))
    monkeypatch.setattr(passes, "PLANE_CELLS", 1)
    with passes.no_fallbacks():
        with pytest.raises(NotImplementedError, match=r"reverse: .*_general_resend: .*PLANE_CELLS"):
            passes.reverse(fwd, kv="resend")
        with pytest.raises(NotImplementedError, match=r"prune: .*_general_prune: .*PLANE_CELLS"):
            passes.prune(progs, need)
    before = passes.fallbacks()
    assert _text(passes.reverse(fwd, kv="resend")) == want_rev
    assert _text(passes.prune(progs, need)) == want_prune
    got = passes.fallbacks() - before
    assert got == {("reverse", "_general_resend: (rank, buffer) plane past PLANE_CELLS"): 1,
                   ("prune", "_general_prune: (buffer, rank) plane past PLANE_CELLS"): 1}


def _rebuilt(programs, drop_recv: bool = False):
    """The same programs as op objects (not cut from a table); ``drop_recv``: rank 1's first
    receive left out (an invalid program)."""
    out = []
    for prog in programs:
        ops: dict = {}
        dropped = False
        for t, op in prog.ops():
            if drop_recv and prog.rank == 1 and not dropped and isinstance(op, Recv):
                dropped = True
                continue
            ops.setdefault(t, []).append(op)
        out.append(program_from_ops(prog.rank, ops))
    return out


def test_programs_written_as_op_objects_plan_on_the_one_table(monkeypatch):
    """Op objects (hand-written, rebuilt, parsed) become one table up front: every pass and
    reader runs on its columns, with no fallback, and gives what the built programs give."""
    fwd = schedules.get("ring").programs(P)
    progs = _rebuilt(fwd)
    assert progs[0].table is None and passes._table(progs) is not None
    coll = schedules.get("allgather").programs(P)
    ops = _rebuilt(coll)
    monkeypatch.setenv("FRINGE_STRICT_PASSES", "1")      # the environment's switch too
    before = passes.fallbacks()
    with passes.no_fallbacks():
        passes.check(progs)
        assert _text(passes.reverse(progs)) == _text(passes.reverse(fwd))
        want_cols = cost_programs.columns(coll, 128, costmodel.Shape())
        got = cost_programs.columns(ops, 128, costmodel.Shape())
    assert passes.fallbacks() == before
    assert len(got.comp[0]) == len(want_cols.comp[0])


def test_an_invalid_program_still_raises_its_schedule_error():
    """Inside no_fallbacks the op rules still name a fault: no NotImplementedError instead."""
    bad = _rebuilt(schedules.get("ring").programs(P), drop_recv=True)
    before = passes.fallbacks()
    with passes.no_fallbacks():
        with pytest.raises(ScheduleError, match="no matching"):
            passes.check(bad)
    assert passes.fallbacks() == before
