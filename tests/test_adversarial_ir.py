"""Adversarial probes of the one-IR / layers changes: ways a user could get a wrong number, a
hang or a silent fallback. Each probe compares the column passes with the op-by-op oracle
(``fringe.testing.oracle``) and/or runs the plan on the virtual mesh against dense attention
in float64. A probe that found a defect keeps its repro (fixed, or ``xfail(strict=True)``
with the defect named)."""
from __future__ import annotations

import copy
import dataclasses
import pickle

import numpy as np
import pytest
import torch
from torch.testing import assert_close

import fringe
from fringe import layout as _layout
from fringe import masks
from fringe.ops import reference
from fringe.schedules import (Compute, Program, Recv, Schedule, ScheduleError, Send, Step, check,
                              passes)
from fringe.schedules.ir import Buffer, ProgramTable, format_programs
from fringe.testing import make_qkv, oracle, tolerances

BLOCK = 4
H0, H1 = (0, 2), (1, 2)


def _kv(chunk: int, heads=None) -> Buffer:
    return Buffer.of("kv", chunk, heads)


def _run(plan, mask, S: int, *, H: int = 2, G: int = 1, seed: int = 0):
    """(got, want): out, dq, dk, dv of the plan on the virtual mesh and of dense attention."""
    q, k, v = make_qkv(B=1, H=H, G=G, S=S, D=4, seed=seed)
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(seed + 1),
                       dtype=torch.float64)
    res = []
    for f in (lambda a, b, c: fringe.simulate.attention(a, b, c, plan=plan),
              lambda a, b, c: reference.attention(a, b, c, mask_mod=mask)[0]):
        qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
        out = f(qg, kg, vg)
        res.append([out.detach(), *torch.autograd.grad(out, (qg, kg, vg), dout)])
    return res


def _assert_dense(plan, mask, S: int, **kw) -> None:
    got, want = _run(plan, mask, S, **kw)
    for what, a, b in zip(("out", "dq", "dk", "dv"), got, want):
        assert_close(a, b, **tolerances(torch.float64), msg=lambda s: f"{what}: {s}")


def _same_as_oracle(progs, need) -> None:
    """prune, check and reverse (both kv policies) of the passes equal the oracle's (or both
    raise)."""
    def outcome(fn):
        try:
            return "ok", fn()
        except (ScheduleError, NotImplementedError) as e:
            return type(e).__name__, str(e).splitlines()[0]
    calls = {"prune": lambda m: format_programs(m.prune(progs, need)),
             "check": lambda m: m.check(progs, need=need),
             "reverse resend": lambda m: format_programs(m.reverse(progs, kv="resend")),
             "reverse keep": lambda m: format_programs(m.reverse(progs, kv="keep"))}
    for what, call in calls.items():
        assert outcome(lambda: call(passes)) == outcome(lambda: call(oracle)), what


def _ring_with_gap(P: int, t0: int = 1, t1: int = 3) -> list[Program]:
    """A hand-written one-hop ring whose steps start late and leave a gap."""
    return [Program(r, (Step(t0, (Compute(r, r), Send(_kv(r), (r + 1) % P),
                                  Recv(_kv((r - 1) % P), (r - 1) % P))),
                        Step(t1, (Compute(r, (r - 1) % P),)))) for r in range(P)]


def test_edge_shaped_programs_equal_the_oracle():
    """Empty programs, P=1, a rank with no ops, steps with gaps: the chain shortcuts and the
    general passes agree with the op rules."""
    _same_as_oracle([Program(0, ()), Program(1, ())], torch.zeros(2, 2, dtype=torch.bool))
    _same_as_oracle([Program(0, (Step(0, (Compute(0, 0),)),))], torch.ones(1, 1, dtype=torch.bool))
    _same_as_oracle(_ring_with_gap(2), torch.ones(2, 2, dtype=torch.bool))
    _same_as_oracle(_ring_with_gap(3), torch.tensor([[1, 0, 1], [1, 1, 0], [0, 1, 1]]).bool())
    idle = [Program(0, (Step(0, (Compute(0, 0), Send(_kv(0), 1))),)),
            Program(1, (Step(0, (Compute(1, 1), Recv(_kv(0), 0))), Step(1, (Compute(1, 0),)))),
            Program(2, ())]
    _same_as_oracle(idle, torch.tensor([[1, 0, 0], [1, 1, 0], [0, 0, 0]]).bool())


@pytest.mark.parametrize("kv", ["resend", "keep"])
def test_steps_with_gaps_run_exactly(kv):
    P, S = 2, 2 * BLOCK * 2
    plan = fringe.plan(Schedule("gap", layout=_layout.contiguous, programs_fn=_ring_with_gap),
                       masks.full(), seq_len=S, world_size=P, block_size=BLOCK, kv=kv)
    _assert_dense(plan, masks.full(), S)


def test_send_order_differs_from_receive_order_runs_exactly():
    """A receive written before its send on one rank (``rorder`` != ``order``): the table
    keeps each side's order, digests differently, and runs exactly (transports pair point to
    point messages in the canonical (peer, buffer) order, not program order)."""
    def progs(P, swap=True):
        out = []
        for r in range(P):
            s, rv = Send(_kv(r), (r + 1) % P), Recv(_kv((r - 1) % P), (r - 1) % P)
            comm = (rv, s) if swap and r % 2 == 0 else (s, rv)
            out.append(Program(r, (Step(0, (Compute(r, r), *comm)),
                                   Step(1, (Compute(r, (r - 1) % P),)))))
        return out
    swapped, plain = ProgramTable.of(progs(2)), ProgramTable.of(progs(2, swap=False))
    assert format_programs(swapped.programs()) == format_programs(progs(2))
    assert swapped.digest() != plain.digest()
    S = 2 * BLOCK * 2
    plan = fringe.plan(Schedule("swap", layout=_layout.contiguous, programs_fn=progs),
                       masks.full(), seq_len=S, world_size=2, block_size=BLOCK)
    _assert_dense(plan, masks.full(), S)


def test_duplicate_transfers_of_one_buffer_in_one_step_are_named():
    def dup(P):
        return [Program(r, (Step(0, (Compute(r, r), Send(_kv(r), 1 - r), Send(_kv(r), 1 - r),
                                     Recv(_kv(1 - r), 1 - r), Recv(_kv(1 - r), 1 - r))),
                            Step(1, (Compute(r, 1 - r),)))) for r in range(P)]
    with pytest.raises(ScheduleError, match="arrives at rank 0 again"):
        fringe.plan(Schedule("dup", layout=_layout.contiguous, programs_fn=dup), masks.full(),
                    seq_len=16, world_size=2, block_size=BLOCK)


def test_pickled_tables_and_programs_digest_alike():
    progs = _ring_with_gap(3)
    tab = ProgramTable.of(progs)
    loaded = pickle.loads(pickle.dumps(tab))
    assert loaded.digest() == tab.digest()
    assert format_programs(loaded.programs()) == format_programs(progs)
    views = pickle.loads(pickle.dumps(tab.programs()))      # views pickle as op objects
    assert ProgramTable.of(views).digest() == tab.digest()
    with pytest.raises(ValueError):                           # still read-only after loading
        loaded._parts[0]["q"][0] = 1


def test_a_checked_table_cannot_have_a_column_swapped():
    """Found (fixed): the arrays were read-only but the part dicts were not, so
    ``tab._parts[0]["kv"] = other`` changed a table that ``check`` had already passed (it
    remembers passing per table). The parts are read-only mappings now."""
    progs = _ring_with_gap(2)
    tab = ProgramTable.of(progs)
    check(tab.programs(), need=torch.ones(2, 2, dtype=torch.bool))
    with pytest.raises(TypeError):
        tab._parts[0]["kv"] = np.zeros(len(tab._parts[0]["kv"]), np.int32)
    with pytest.raises(TypeError):
        del tab._parts[1]["chunk"]


def _overlapping_heads(P: int) -> list[Program]:
    """kv0 reaches rank 1 twice with overlapping heads: its h0/2 slice (forwarded on to rank
    2, which computes with it) and then whole (rank 1 computes with it)."""
    kv = _kv
    return [Program(0, (Step(0, (Compute(0, 0), Send(kv(0, H0), 1), Send(kv(0, H1), 2),
                                 Recv(kv(1), 1), Recv(kv(2), 2))),
                        Step(1, (Send(kv(0), 1), Compute(0, 1), Compute(0, 2))))),
            Program(1, (Step(0, (Compute(1, 1), Recv(kv(0, H0), 0), Send(kv(1), 0), Send(kv(1), 2),
                                 Recv(kv(2), 2))),
                        Step(1, (Send(kv(0, H0), 2), Recv(kv(0), 0), Compute(1, 2))),
                        Step(2, (Compute(1, 0),)))),
            Program(2, (Step(0, (Compute(2, 2), Recv(kv(0, H1), 0), Recv(kv(1), 1), Send(kv(2), 0),
                                 Send(kv(2), 1))),
                        Step(1, (Recv(kv(0, H0), 1), Compute(2, 1), Compute(2, 0, H1))),
                        Step(2, (Compute(2, 0, H0),))))]


@pytest.mark.parametrize("kv", ["resend", "keep"])
def test_an_input_arriving_whole_and_as_an_overlapping_slice_is_named(kv):
    """Defect found (fixed): reverse returned the gradient of the overlapping heads along
    both routes (dkv0 whole and dkv0h0/2 from rank 1), so dk/dv were wrong by O(1) with no
    error; ``check`` accepted the derived backward. It is now named like any second
    arrival."""
    P = 3
    check(_overlapping_heads(P), need=torch.ones(P, P, dtype=torch.bool))   # a valid forward
    with pytest.raises(ScheduleError, match="rank 1, step 1: kv0 arrives at rank 1, which also "
                                            "receives heads of it that overlap"):
        passes.reverse(_overlapping_heads(P), kv=kv)
    with pytest.raises(ScheduleError, match="overlap"):
        fringe.plan(Schedule("overlap", layout=_layout.contiguous,
                             programs_fn=_overlapping_heads), masks.full(), seq_len=P * 8,
                    world_size=P, block_size=BLOCK, kv=kv)


def test_disjoint_head_slices_still_reverse_and_run_exactly():
    """h0/2 and h1/2 of one buffer do not overlap: no false alarm, and the run is exact; the
    overlap rule itself tells slices of two splits apart exactly."""
    def progs(P):
        return [Program(0, (Step(0, (Compute(0, 0), Send(_kv(0, H0), 1))),
                            Step(1, (Send(_kv(0, H1), 1),)))),
                Program(1, (Step(0, (Compute(1, 1), Recv(_kv(0, H0), 0))),
                            Step(1, (Compute(1, 0, H0), Recv(_kv(0, H1), 0))),
                            Step(2, (Compute(1, 0, H1),))))]
    for kv in ("resend", "keep"):
        passes.reverse(progs(2), kv=kv)
    S = 2 * 8
    plan = fringe.plan(Schedule("split", layout=_layout.contiguous, programs_fn=progs),
                       masks.causal(), seq_len=S, world_size=2, block_size=BLOCK)
    _assert_dense(plan, masks.causal(), S, H=2, G=2)
    from fringe.schedules.passes._reverse import _overlapping_heads
    # one buffer at one rank: h0/2, h2/4, h3/4 (disjoint); h1/4 then overlaps h0/2 (later step)
    whole, t = np.zeros(4, np.int64), np.array([0, 1, 2, 3])
    hi, hn = np.array([0, 2, 3, 1]), np.array([2, 4, 4, 4])
    assert _overlapping_heads(whole[:3], t[:3], hi[:3], hn[:3]).tolist() == [False] * 3
    assert _overlapping_heads(whole, t, hi, hn).tolist() == [False, False, False, True]
    # a whole buffer overlaps every slice; other buffers (keys) never interfere
    assert _overlapping_heads(np.array([0, 0, 1]), np.array([2, 0, 1]), np.array([0, 1, 0]),
                              np.array([0, 2, 2])).tolist() == [True, False, False]


def test_compose_with_an_inner_collective_whose_own_slots_hold_the_buffer():
    """Defect found (fixed): compose lowered an inner all-gather's own slot (the buffer on
    both sides, the ``own="same"`` convention) to a send to itself, so compose(zigzag,
    two_level_allgather(2, own="same")) failed with "names an invalid peer". Own-slot
    conventions now give the same programs, and the run is exact."""
    from fringe import schedules
    from fringe.testing.user_schedules import two_level_allgather
    P, S = 8, 64
    plans = {own: fringe.plan(schedules.compose(schedules.zigzag(), two_level_allgather(2, own=own),
                                                inner_size=4),
                              masks.causal(), seq_len=S, world_size=P, block_size=2)
             for own in ("same", "none")}
    assert format_programs(plans["same"].forward) == format_programs(plans["none"].forward)
    assert format_programs(plans["same"].backward) == format_programs(plans["none"].backward)
    _assert_dense(plans["same"], masks.causal(), S)


def test_compose_refuses_an_inner_of_kind_ulysses_with_programs_of_its_own():
    """Defect found (fixed): compose read the inner's ``kind`` and built the built-in head
    split, silently ignoring the programs of a schedule made by
    ``dataclasses.replace(ulysses(), build=mine)`` (the kind field was copied along)."""
    from fringe import schedules
    calls = []
    u = schedules.ulysses()
    mine = dataclasses.replace(u, name="mine", build=lambda P, need: calls.append(P) or u.build(P, need))
    with pytest.raises(ValueError, match="kind='ulysses' but programs or a layout of its own"):
        schedules.compose(schedules.zigzag(), mine, inner_size=2)
    schedules.compose(schedules.zigzag(), u, inner_size=2)      # the built-in still composes
    assert calls == []


@pytest.mark.parametrize("name", ["ring", "ulysses", "compose(zigzag, ulysses, inner_size=2)"])
def test_a_user_schedule_named_like_a_built_in_runs_its_own_programs(name):
    """Names are display only: a user schedule named like a built-in plans and runs its own
    programs, and the registry does not claim to build it."""
    from fringe.schedules import registry
    from fringe.testing.user_schedules import two_level_allgather
    s = dataclasses.replace(two_level_allgather(2), name=name)
    plan = fringe.plan(s, masks.causal(), seq_len=32, world_size=4, block_size=BLOCK)
    want = fringe.plan(two_level_allgather(2), masks.causal(), seq_len=32, world_size=4,
                       block_size=BLOCK)
    assert format_programs(plan.forward) == format_programs(want.forward)
    _assert_dense(plan, masks.causal(), 32)
    with pytest.raises(ValueError, match="not built by a registered name"):
        registry.spec(s)


_Q1, _OUT1 = Buffer.of("q", 1), Buffer.of("out", 1)


def _move_q(P: int, *, again: str = "") -> list[Program]:
    """Rank 0 computes tile q1·kv0 on q1 brought from rank 1 and sends the partial out1 home;
    ``again``: "same" sends it twice in one step, "later" once more a step later."""
    r0 = [Step(0, (Compute(0, 0), Recv(_Q1, 1))), Step(1, (Compute(1, 0),)),
          Step(2, (Send(_OUT1, 1),) * (2 if again == "same" else 1))]
    r1 = [Step(0, (Compute(1, 1), Send(_Q1, 0))),
          Step(2, (Recv(_OUT1, 0),) * (2 if again == "same" else 1))]
    if again == "later":
        r0.append(Step(3, (Send(_OUT1, 1),)))
        r1.append(Step(3, (Recv(_OUT1, 0),)))
    return [Program(0, tuple(r0)), Program(1, tuple(r1))]


@pytest.mark.parametrize("kv", ["resend", "keep"])
def test_moving_q_and_partial_out_home_runs_exactly(kv):
    plan = fringe.plan(Schedule("move_q", layout=_layout.contiguous, programs_fn=_move_q),
                       masks.causal(), seq_len=16, world_size=2, block_size=BLOCK, kv=kv)
    _assert_dense(plan, masks.causal(), 16)
    assert format_programs(passes.reverse(_move_q(2), kv=kv)) == \
        format_programs(oracle.reverse(_move_q(2), kv=kv))


@pytest.mark.parametrize("again", ["same", "later"])
def test_a_partial_out_sent_home_twice_is_named(again):
    """Defect found (fixed): a partial out sent twice (a step later) was merged twice by its
    owner, so out and every gradient were wrong by O(0.1) with no error (twice in one step
    failed only mid-run, in the interpreter). reverse now names the second send, and check
    does too (the rule that also names a gradient sent on twice)."""
    def progs(P):
        return _move_q(P, again=again)
    for m in (passes, oracle):
        with pytest.raises(ScheduleError, match=r"rank 0, step \d: rank 0 sends out1 again"):
            m.check(progs(2))
    with pytest.raises(ScheduleError, match=r"rank 0, step \d: rank 0 sends out1 again"):
        fringe.plan(Schedule("twice", layout=_layout.contiguous, programs_fn=progs),
                    masks.causal(), seq_len=16, world_size=2, block_size=BLOCK)


def test_a_mask_whose_bh_probe_raises_is_taken_to_read_b_and_h():
    """A mask_mod that fails on the probe's h = 1 (it indexes a one-head table) cannot be
    decided: it reads b and h, so plan asks for num_heads instead of classifying it for head
    0 only; given H=1 it runs exactly."""
    win = torch.tensor([3])

    def per_head_window(b, h, q, kv):
        return (q >= kv) & (q - kv < win[h])
    assert masks.reads_bh(per_head_window, seq_len=16).h
    with pytest.raises(ValueError, match="num_heads"):
        fringe.plan(fringe.schedules.get("ring"), per_head_window, seq_len=16, world_size=2,
                    block_size=BLOCK)
    plan = fringe.plan(fringe.schedules.get("ring"), per_head_window, seq_len=16, world_size=2,
                       block_size=BLOCK, num_heads=1, batch_size=1)
    _assert_dense(plan, per_head_window, 16, H=1, G=1)


def test_replacing_a_plans_mask_is_refused_or_exact():
    """dataclasses.replace(plan, mask_mod=m) kept the old mask's tiles, programs and block map
    and ran the new mask on the old classification (out off by 1.10, no error): a plan not
    built by fringe.plan is refused before any communication; copies and pickles still run."""
    S = 16
    plan = fringe.plan(fringe.schedules.get("ring"), masks.causal(), seq_len=S, world_size=2,
                       block_size=BLOCK)
    swapped = dataclasses.replace(plan, mask_mod=masks.full())
    assert plan.made_by_plan and not swapped.made_by_plan
    with pytest.raises(ValueError, match="not built by fringe.plan"):
        _assert_dense(swapped, masks.full(), S)
    again = pickle.loads(pickle.dumps(plan)) if _picklable(plan) else copy.deepcopy(plan)
    assert again.made_by_plan                    # copies and pickles of a made plan still run
    _assert_dense(again, masks.causal(), S)
    _assert_dense(copy.copy(plan), masks.causal(), S)


def _picklable(obj) -> bool:
    try:
        pickle.dumps(obj)
        return True
    except Exception:            # factory masks are local closures (they do not pickle)
        return False


def test_shared_columns_never_serve_a_dead_tables_columns():
    """``shared_columns`` caches by ``id(table)`` while it is open; it keeps each table alive,
    so a new table can never reuse a cached id: a bad table made after a good one (whose
    programs were dropped) is still named."""
    import gc
    good = _ring_with_gap(2)
    bad = [Program(0, (Step(0, (Compute(0, 0), Compute(0, 1))),)), Program(1, ())]
    with passes.shared_columns():
        for _ in range(3):
            tab = ProgramTable.of([Program(p.rank, p.steps) for p in good])
            check(tab.programs(), need=torch.ones(2, 2, dtype=torch.bool))
            del tab
            gc.collect()
            other = ProgramTable.of([Program(p.rank, p.steps) for p in bad])
            with pytest.raises(ScheduleError, match="needs kv1"):
                check(other.programs())
            del other


def test_the_ring_chain_shortcuts_equal_the_general_passes_on_edge_shapes():
    """Steps with gaps and a late start, a rank with no ops, empty programs, P=1: the chain
    shortcuts (``_reverse_parts``, ``_parts_ok``) give what the general passes give."""
    from fringe.schedules.passes import _check, _reverse
    idle = [Program(0, (Step(0, (Compute(0, 0), Send(_kv(0), 1))),)),
            Program(1, (Step(0, (Compute(1, 1), Recv(_kv(0), 0))), Step(1, (Compute(1, 0),)))),
            Program(2, ())]
    cases = [_ring_with_gap(2), _ring_with_gap(3), _ring_with_gap(5, 4, 9), idle,
             [Program(0, ()), Program(1, ())], [Program(0, (Step(0, (Compute(0, 0),)),))]]
    for progs in cases:
        tab = ProgramTable.of(progs)
        assert tab.chain
        for kv in ("resend", "keep"):
            fast = _reverse._reverse_parts(tab, kv)
            assert fast is not None
            assert format_programs(fast) == format_programs(_reverse._general_reverse(tab, kv))
        assert _check._parts_ok(tab, None, False, "resend") is True
        _check._general_ok(tab, None, False, "resend")


def _two_rank(peer=1, q=1, step=1, blocks=None, heads=None) -> list[Program]:
    """Rank 0 sends kv0 to rank 1, which computes q1·kv0 (fields as given)."""
    return [Program(0, (Step(0, (Compute(0, 0), Send(_kv(0), peer, blocks))),)),
            Program(1, (Step(0, (Compute(1, 1), Recv(_kv(0), 0, blocks))),
                        Step(step, (Compute(q, 0, heads),) + (
                            () if heads is None else (Compute(q, 0, (1, 2)),)))))]


@pytest.mark.parametrize("field,kw", [
    ("q", dict(q=1.5)), ("step", dict(step=1.5)), ("block", dict(blocks=((0.9, 4),))),
    ("block", dict(blocks=((0, 3.99),))), ("block", dict(blocks=(("0", "4"),))),
    ("heads", dict(heads=(0.5, 2)))])
def test_a_non_integer_op_field_is_refused_not_truncated(field, kw):
    """A compute's chunk, a step index, a block range or a head slice that is not an integer
    was truncated (q=1.5 ran as q1, step 1.5 as step 1, blocks (0.9, 4) as [0:4], heads
    (0.5, 2) as h0/2): refused instead."""
    with pytest.raises((ValueError, TypeError), match="integer|int"):
        progs = _two_rank(**kw)
        fringe.plan(Schedule("f", layout=_layout.contiguous, programs_fn=lambda P: progs),
                    masks.causal(), seq_len=32, world_size=2, block_size=BLOCK)
    progs = _two_rank(peer=np.int64(1), q=np.int32(1), step=np.int8(1),   # numpy ints are ints
                      blocks=((np.int16(0), np.uint8(4)),))
    fringe.plan(Schedule("f", layout=_layout.contiguous, programs_fn=lambda P: progs),
                masks.causal(), seq_len=32, world_size=2, block_size=BLOCK)


def _without(progs, rank: int, op_text: str) -> list[Program]:
    """``progs`` with the op written ``op_text`` left out of ``rank``'s program."""
    text = str(progs[rank])
    assert op_text in text, text
    out = list(progs)
    out[rank] = Program.parse(text.replace(" | " + op_text, "").replace(op_text + " | ", ""))
    return out


def test_a_gradient_that_never_goes_home_is_named(monkeypatch):
    """Defect found (fixed): a backward that drops one matched dkv send / receive pair (a
    reverse bug) passed every check, and dk, dv came out wrong by O(0.5) with no error.
    check now asks every partial result of another rank's chunk to be sent on after its
    last write."""
    import sys
    plan_mod = sys.modules["fringe.plan"]
    real = plan_mod.reverse

    def lossy(fwd, **kw):
        return _without(_without(real(fwd, **kw), 0, "S dkv3→r3"), 3, "R dkv3←r0")
    good = fringe.plan(fringe.schedules.zigzag(), masks.causal(), seq_len=32, world_size=4,
                       block_size=2)
    bad = _without(_without(list(good.backward), 0, "S dkv3→r3"), 3, "R dkv3←r0")
    for m in (passes, oracle):
        with pytest.raises(ScheduleError, match=r"rank 0, step 3: dkv3 .* never reaches rank 3"):
            m.check(bad, need=good.tiles != 0, backward=True)
    monkeypatch.setattr(plan_mod, "reverse", lossy)
    with pytest.raises(ScheduleError, match="dkv3 .* never sent on"):
        fringe.plan(fringe.schedules.zigzag(), masks.causal(), seq_len=32, world_size=4,
                    block_size=2)


def test_a_gradient_sent_on_twice_is_named(monkeypatch):
    """Defect found (fixed): a backward whose last dkv hop is sent again a step later (a
    reverse bug) passed every check, and its owner added the partial dkv twice: dk, dv wrong
    by O(0.5) with no error."""
    import sys
    plan_mod = sys.modules["fringe.plan"]
    real = plan_mod.reverse

    def again(progs):
        out = list(progs)
        for r, text in ((0, "  t5: S dkv3→r3"), (3, "  t5: R dkv3←r0")):
            out[r] = Program.parse(f"{progs[r]}\n{text}")
        return out
    good = fringe.plan(fringe.schedules.zigzag(), masks.causal(), seq_len=32, world_size=4,
                       block_size=2)
    for m in (passes, oracle):
        with pytest.raises(ScheduleError, match=r"rank 0, step 5: rank 0 sends dkv3 again "
                                                r"\(first at step 4\)"):
            m.check(again(good.backward), need=good.tiles != 0, backward=True)
    monkeypatch.setattr(plan_mod, "reverse", lambda fwd, **kw: again(real(fwd, **kw)))
    with pytest.raises(ScheduleError, match="sends dkv3 again"):
        fringe.plan(fringe.schedules.zigzag(), masks.causal(), seq_len=32, world_size=4,
                    block_size=2)


def test_a_partial_out_that_never_goes_home_is_named_in_the_forward():
    """A forward that computes q1·kv0 on rank 0 and keeps out1 there: named by the forward's
    check (before, only the derived backward's presence check saw it, naming out1 missing
    from a gradient tile); sent home at the same step it is written, it is still lost."""
    def lost(P):
        return [Program(0, (Step(0, (Compute(0, 0), Recv(_Q1, 1))), Step(1, (Compute(1, 0),)))),
                Program(1, (Step(0, (Compute(1, 1), Send(_Q1, 0))),))]

    def early(P):                   # out1 sent home before its last tile (q1·kv1 at step 2)
        return [Program(0, (Step(0, (Compute(0, 0), Recv(_Q1, 1), Recv(_kv(1), 1))),
                            Step(1, (Compute(1, 0),)), Step(2, (Send(_OUT1, 1), Compute(1, 1))))),
                Program(1, (Step(0, (Send(_Q1, 0), Send(_kv(1), 0))), Step(2, (Recv(_OUT1, 0),))))]
    for progs, what in (((lost, 1), "never sent on"),
                        ((early, 2), r"not sent on after it \(last sent at step 2\)")):
        progs, t = progs
        for m in (passes, oracle):
            with pytest.raises(ScheduleError, match=f"rank 0, step {t}: out1 .* {what}"):
                m.check(progs(2))
        with pytest.raises(ScheduleError, match="out1 .* never reaches rank 1"):
            fringe.plan(Schedule("lost", layout=_layout.contiguous, programs_fn=progs),
                        masks.causal(), seq_len=16, world_size=2, block_size=BLOCK)


def _sliced_out_home(again: bool) -> list[Program]:
    """_move_q with the tile computed in two head slices, each partial out sent home; again:
    slice 1 is sent once more a step later."""
    r0 = ("r0:\n  t0: C q0·kv0 | R q1←r1\n  t1: C q1·kv0 h0/2 | C q1·kv0 h1/2\n"
          "  t2: S out1h0/2→r1 | S out1h1/2→r1" + ("\n  t3: S out1h1/2→r1" if again else ""))
    r1 = ("r1:\n  t0: C q1·kv1 | S q1→r0\n  t2: R out1h0/2←r0 | R out1h1/2←r0"
          + ("\n  t3: R out1h1/2←r0" if again else ""))
    return [Program.parse(r0), Program.parse(r1)]


def test_results_home_head_slices_fast_and_named(monkeypatch):
    """Head slices of one result are separate buffers for the sent-once rule: two slices
    sent once each pass, one slice sent twice is named, by the fast path and the sorted one."""
    from fringe.schedules.passes import _check as chk
    from fringe.schedules.passes import _columns
    passes.check(_sliced_out_home(False))
    oracle.check(_sliced_out_home(False))
    msgs = []
    for cells in (None, 0):
        if cells is not None:
            monkeypatch.setattr(_columns, "PLANE_CELLS", cells)
        with pytest.raises(ScheduleError, match=r"rank 0, step 3: rank 0 sends out1h1/2 again"):
            chk._results_home_ok(ProgramTable.of(_sliced_out_home(True)), False)
    with pytest.raises(ScheduleError, match=r"rank 0, step 3: rank 0 sends out1h1/2 again"):
        oracle.check(_sliced_out_home(True))


@pytest.mark.parametrize("spec", ["zigzag", "ring", "compose:zigzag+zigzag:2"])
def test_results_home_fast_path_agrees_with_the_named_rules(spec, monkeypatch):
    """check runs the results-home rules on dense (family, rank, chunk) arrays and names a
    fault through the sorted-key rules; both must pass a valid plan and both must name a
    second send of a result (whole heads and head slices), the fast path a few rows at a
    time too (LATE_PIECE), and the sorted rules alone (past PLANE_CELLS)."""
    from fringe.schedules.passes import _check as chk
    from fringe.schedules.passes import _columns
    p = fringe.plan(fringe.schedules.get(spec), masks.causal(), seq_len=32, world_size=4,
                    block_size=2, **({} if spec == "zigzag" else {"num_heads": 4}))
    exercised = []
    for progs, back in ((p.forward, False), (p.backward, True)):
        tab = ProgramTable.of(progs)
        chk._results_home_ok(tab, back)
        chk._results_home_named(tab, back)
        sends = [(r, s.index, op) for r, prog in enumerate(progs) for s in prog.steps
                 for op in s.ops if type(op).__name__ == "Send"
                 and op.buf.family in chk.result_families(back) and op.buf.chunk != r]
        if not sends:
            continue
        r, t, op = sends[-1]
        T = 1 + max(s.index for prog in progs for s in prog.steps)
        twice = list(progs)                      # the same send once more, after the end
        twice[r] = Program.parse(f"{progs[r]}\n  t{T}: {op.ascii()}")
        peer = op.peer
        recv = op.ascii().replace("S ", "R ", 1).replace(f"->r{peer}", f"<-r{r}")
        twice[peer] = Program.parse(f"{progs[peer]}\n  t{T}: {recv}")
        exercised.append((spec, back, op.buf.heads is not None))
        tab2 = ProgramTable.of(twice)
        with pytest.raises(ScheduleError, match="again") as fast:
            chk._results_home_ok(tab2, back)
        monkeypatch.setattr(chk, "LATE_PIECE", 2)        # the fast path two rows at a time
        chk._results_home_ok(tab, back)
        with pytest.raises(ScheduleError, match="again") as pieces:
            chk._results_home_ok(tab2, back)
        monkeypatch.undo()
        assert str(pieces.value) == str(fast.value)
        monkeypatch.setattr(_columns, "PLANE_CELLS", 0)
        with pytest.raises(ScheduleError, match="again") as slow:
            chk._results_home_ok(tab2, back)
        monkeypatch.undo()
        assert str(fast.value) == str(slow.value)
    assert exercised, spec


def test_a_gradient_sent_on_with_fewer_blocks_than_it_holds_is_named(monkeypatch):
    """Defect found (fixed): a backward whose dkv hop carries fewer block ranges than the
    relaying rank holds (``dkv0[0:1]`` for ``[0:2]``, both ends: a reverse or narrow bug)
    passed every check (covered() trusted the gradients' ranges to reverse), and the blocks
    left out never reached their owner: dk, dv wrong by O(0.2) with no error."""
    import sys
    plan_mod = sys.modules["fringe.plan"]
    real = plan_mod.reverse

    def fewer(progs):
        out = list(progs)
        for r, old, new in ((3, "S dkv0[0:2]→r2", "S dkv0[0:1]→r2"),
                            (2, "R dkv0[0:2]←r3", "R dkv0[0:1]←r3")):
            assert old in str(progs[r])
            out[r] = Program.parse(str(progs[r]).replace(old, new))
        return out
    monkeypatch.setattr(plan_mod, "reverse", lambda fwd, **kw: fewer(real(fwd, **kw)))
    with pytest.raises(ScheduleError, match=r"rank 3, step 2: a gradient sent on leaves out "
                                            r"blocks this rank holds"):
        fringe.plan(fringe.schedules.zigzag(), masks.causal(), seq_len=32, world_size=4,
                    block_size=2)


def _cut(ranges, rng: int, n: int):
    """A range set (``rng`` -1: the whole chunk of ``n`` blocks) with its longest range cut
    by a block at both ends; None where no range is 3 blocks long."""
    rs = list(ranges[rng]) if rng >= 0 else [(0, n)]
    k = max(range(len(rs)), key=lambda i: rs[i][1] - rs[i][0])
    lo, hi = rs[k]
    if hi - lo < 3:
        return None
    rs[k] = (lo + 1, hi - 1)
    return tuple(rs)


@pytest.mark.parametrize("spec,S", [("zigzag", 64), ("striped", 64), ("allgather", 64),
                                    ("compose:zigzag+ulysses:2", 64), ("zigzag", 1024),
                                    ("move_q", 32)])
def test_gradients_sent_whole_fast_rule_agrees_with_the_named_rule(spec, S, monkeypatch):
    """covered() checks that a gradient sent on carries every block its rank holds on dense
    (family, chunk, head slice, rank) words and names a fault through the sorted-key rule;
    both pass a valid plan and both decide alike (with one message) on faults made by cutting
    one range of a gradient hop or collective slot (both ends of it) at a block each side
    (S=1024: 128 blocks a chunk, rows wider than one word; move_q: a dq sent home)."""
    from fringe.schedules.passes import _blocks, _columns
    from fringe.schedules.passes._columns import _FAMILY_CODE
    from fringe.schedules.passes._narrow import _slot_moves
    P, B = (2, 2) if spec == "move_q" else (4, 2)
    sched = (Schedule("move_q", layout=_layout.contiguous, programs_fn=_move_q)
             if spec == "move_q" else fringe.schedules.get(spec))
    p = fringe.plan(sched, masks.causal(), seq_len=S, world_size=P, block_size=B, num_heads=4)
    n = S // P // B
    need = passes.BlockNeed(P, n, p.block_map.rects.numpy())
    tab = ProgramTable.of(p.backward)
    comp, xfer, coll = tab._parts
    g = _columns._Gen(tab)
    grads = [_FAMILY_CODE[f] for f in (fringe.schedules.ir.Family.DQ,
                                       fringe.schedules.ir.Family.DKV)]
    s_send, s_recv = (np.zeros(0, np.int64),) * 2
    if len(g.sf):
        g.sf, g.sc, g.shs = g.sf.copy(), g.sc.copy(), g.shs.copy()
        inputs = np.isin(g.sf, grads)           # the gradient slots' moves, by narrow's
        g.sf[inputs] = np.where(g.sf[inputs] == grads[0], 0, 1)     # matching of q, kv
        s_send, s_recv = _slot_moves(g)
        keep = np.isin(coll["slot_fam"][s_send], grads) & (g.sc[s_send] != g.kr[g.ss[s_send]])
        s_send, s_recv = s_send[keep], s_recv[keep]
    hops = np.flatnonzero(np.isin(xfer["fam"], grads) & (xfer["src"] != xfer["chunk"]))
    cases = [("x", int(i)) for i in hops] + [("s", k) for k in range(len(s_send))]
    assert cases, spec

    def decide(progs):
        out = []
        for cells in (None, 0):                 # dense, then the sorted rule
            if cells is not None:
                monkeypatch.setattr(_columns, "PLANE_CELLS", cells)
            try:
                _blocks.covered(progs, need, backward=True)
                out.append(None)
            except ScheduleError as e:
                out.append(str(e))
            monkeypatch.undo()
        assert out[0] == out[1]
        return out[0]
    assert decide(p.backward) is None
    order = np.random.default_rng(7).permutation(len(cases))
    faults = tried = 0
    for part, i in (cases[k] for k in order):
        x, c = dict(xfer), dict(coll)
        if part == "x":
            rng, ranges = np.array(x["rng"], dtype=np.int64), tuple(x["ranges"])
            new = _cut(ranges, int(rng[i]), n)
            rows = [i]
        else:
            rng, ranges = np.array(c["slot_rng"], dtype=np.int64), tuple(c["ranges"])
            new = _cut(ranges, int(rng[s_send[i]]), n)
            rows = [int(s_send[i]), int(s_recv[i])]
        if new is None:
            continue
        rng[rows] = len(ranges)
        if part == "x":
            x["rng"], x["ranges"] = rng, ranges + (new,)
        else:
            c["slot_rng"], c["ranges"] = rng, ranges + (new,)
        got = decide(list(ProgramTable._of_parts(P, comp, x, c).programs()))
        tried += 1
        faults += got is not None
        if got is not None:
            assert "a gradient sent on leaves out blocks this rank holds" in got
        if tried == 4:
            break
    assert faults, spec
