"""Structural properties of plans: no tensors through attention, only programs."""
from __future__ import annotations

import collections
import os
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings, strategies as st

import fringe
from fringe import masks, render, schedules
from fringe.testing import oracle, probe_adjoint
from fringe.runtime.engine import kept_names
from fringe.schedules import (Compute, GradCompute, Program, Recv, ScheduleError, Send, Step,
                              check, parse_op, reverse)
from fringe.schedules.ir import (Buffer, Family, ProgramTable, buffer_name, format_programs,
                                 parse_programs, steps_of)
from fringe.schedules.passes import Hop, HopTable

GOLDEN = Path(__file__).parent / "golden"
SCHEDULES = {"ring": schedules.ring, "zigzag": schedules.zigzag, "striped": schedules.striped,
             "balanced": schedules.balanced}


def random_mask(seed: int, S: int):
    g = torch.Generator().manual_seed(seed)
    kind = int(torch.randint(0, 7, (), generator=g))
    if kind == 0:
        return masks.full()
    if kind == 1:
        return masks.causal()
    if kind == 2:
        return masks.sliding_window(int(torch.randint(1, S + 1, (), generator=g)))
    if kind == 3:
        cuts = torch.randint(0, 2, (S,), generator=g).cumsum(0) // 3
        return masks.causal() & masks.document(cuts)
    if kind == 4:
        return masks.prefix_lm(int(torch.randint(0, S + 1, (), generator=g)))
    if kind == 5:
        w = int(torch.randint(1, S + 1, (), generator=g))
        return (masks.causal() & masks.sliding_window(w, causal=False)) | masks.prefix_lm(S // 8)
    return lambda b, h, q, kv: ((q * 7 + kv * 3) % 5) < 2     # arbitrary mask_mod


def build(name: str, seed: int, P: int, *, kv: str = "resend"):
    g = torch.Generator().manual_seed(seed)
    bs = [1, 2, 4][seed % 3]
    S = 2 * P * bs * int(torch.randint(1, 4, (), generator=g))
    return fringe.plan(SCHEDULES[name](), random_mask(seed, S), seq_len=S, world_size=P,
                       block_size=bs, kv=kv)


plans = st.tuples(st.sampled_from(sorted(SCHEDULES)), st.integers(0, 10_000), st.integers(1, 8),
                  st.sampled_from(["resend", "keep"]))


@settings(deadline=None, max_examples=60)
@given(plans)
def test_every_nonempty_tile_is_computed_exactly_once(args):
    name, seed, P, kv = args
    p = build(name, seed, P, kv=kv)
    for progs in (p.forward, p.backward):
        count = collections.Counter((op.q, op.kv) for prog in progs for _, op in prog.ops()
                                    if isinstance(op, (Compute, GradCompute)))
        want = {(i, j) for i in range(P) for j in range(P) if int(p.tiles[i, j]) != 0}
        assert set(count) == want
        assert all(n == 1 for n in count.values())


@settings(deadline=None, max_examples=60)
@given(plans)
def test_every_send_has_its_receive_in_the_same_step(args):
    name, seed, P, kv = args
    p = build(name, seed, P, kv=kv)
    for progs in (p.forward, p.backward):
        sends = collections.Counter((t, prog.rank, op.peer, op.buf) for prog in progs
                                    for t, op in prog.ops() if isinstance(op, Send))
        recvs = collections.Counter((t, op.peer, prog.rank, op.buf) for prog in progs
                                    for t, op in prog.ops() if isinstance(op, Recv))
        assert sends == recvs


@settings(deadline=None, max_examples=60)
@given(plans)
def test_text_form_round_trips(args):
    name, seed, P, kv = args
    p = build(name, seed, P, kv=kv)
    for prog in p.forward + p.backward:
        assert Program.parse(str(prog)) == prog
        assert Program.parse(prog.ascii()) == prog
        assert prog.ascii().isascii()
        for step in prog.steps:
            assert Step.parse(str(step)) == step == Step.parse(step.ascii())
            for op in step.ops:
                assert parse_op(str(op)) == op == parse_op(op.ascii())
    for progs in (p.forward, p.backward):
        assert parse_programs(format_programs(progs)) == list(progs)
        assert parse_programs(format_programs(progs, ascii=False)) == list(progs)


@settings(deadline=None, max_examples=60)
@given(plans)
def test_reverse_is_the_adjoint_of_every_op_plus_kv_rematerialisation(args):
    name, seed, P, kv = args
    p = build(name, seed, P, kv=kv)
    T = steps_of(p.forward)
    adjoints = collections.Counter((prog.rank, T - t, op.adjoint()) for prog in p.forward
                                   for t, op in prog.ops())
    backward = collections.Counter((prog.rank, t, op) for prog in p.backward for t, op in prog.ops())
    extra = backward - adjoints
    assert adjoints - backward == collections.Counter()          # every adjoint is there
    # what is left re-materialises kv (none with kv="keep"), and no kv moves in step T
    assert all(isinstance(op, (Send, Recv)) and op.buf.family is Family.KV and t < T
               for (_, t, op) in extra)
    assert (kv == "keep") <= (not extra)
    for prog in p.forward + p.backward:
        for _, op in prog.ops():
            assert op.adjoint().adjoint() == op


def _kv_last_uses(program) -> dict[str, int]:
    """The rule the interpreter used before ops declared their buffers (kv and dkv only)."""
    last: dict[str, int] = {}
    for t, op in program.ops():
        if isinstance(op, (Compute, GradCompute)):
            last[buffer_name("kv", op.kv)] = t
            if isinstance(op, GradCompute):
                last[buffer_name("dkv", op.kv)] = t
        else:
            last[op.buf] = t
    return last


@settings(deadline=None, max_examples=30)
@given(plans)
def test_ops_answer_buffer_use_as_the_runtime_worked_it_out(args):
    name, seed, P, kv = args
    p = build(name, seed, P, kv=kv)
    for progs in (p.forward, p.backward):
        for prog in progs:
            mine = prog.last_uses()
            theirs = _kv_last_uses(prog)
            assert {b: t for b, t in mine.items() if b.family in (Family.KV, Family.DKV)} == theirs
    for r in range(P):
        want = [buffer_name("kv", j) for j in sorted({op.kv for _, op in p.forward[r].ops()
                                                       if isinstance(op, Compute) and op.kv != r})]
        assert p.forward[r].remote_reads(Family.KV) == sorted(want)
        assert kept_names(p, r) == (sorted(want) if kv == "keep" else [])


@settings(deadline=None, max_examples=60)
@given(plans)
def test_backward_communication_is_the_adjoint_and_gradients_return_home(args):
    name, seed, P, kv = args
    p = build(name, seed, P, kv=kv)
    ax_y, x_aty, seen_fwd, seen_bwd, x, leftovers = probe_adjoint(p, seed=seed)
    assert ax_y == pytest.approx(x_aty, rel=1e-12, abs=1e-12)
    # every tile saw the right kv in both passes (forward routes and backward re-sends)
    assert set(seen_fwd) == set(seen_bwd)
    for (i, j), val in list(seen_fwd.items()) + list(seen_bwd.items()):
        assert torch.equal(val, x[j])
    # no gradient buffer is left behind on a rank that does not own it
    assert not leftovers


def _plain(programs):
    """The same programs as values not backed by a ProgramTable (the op-by-op passes run)."""
    return [Program(prog.rank, prog.steps) for prog in programs]


@settings(deadline=None, max_examples=25)
@given(plans)
def test_columnar_passes_equal_the_op_by_op_rules(args):
    name, seed, P, kv = args
    p = build(name, seed, P, kv=kv)
    assert p.forward[0].table is not None and p.backward[0].table is not None
    plain = _plain(p.forward)
    assert plain[0].table is None
    assert reverse(plain, kv=kv) == list(p.backward)
    check(_plain(p.backward), need=p.tiles != 0, backward=True, kv=kv)
    assert ProgramTable.of(plain).programs() == tuple(p.forward)
    assert ProgramTable.of(plain).digest() == ProgramTable.of(p.forward).digest()
    assert (ProgramTable.of(p.forward).digest() == ProgramTable.of(p.backward).digest()) == (
        list(p.forward) == list(p.backward))


def test_columnar_check_finds_the_faults_the_op_by_op_check_finds():
    rng = torch.Generator().manual_seed(7)
    verdicts = collections.Counter()
    for case in range(120):
        P = 2 + case % 5
        need = torch.rand(P, P, generator=rng) < 0.6
        fwd = schedules.lower(P, schedules.ring_hops(P), need=need)
        kv = ["resend", "keep"][case % 2]
        progs, backward = (fwd, False) if case % 3 == 0 else (reverse(fwd, kv=kv), True)
        tab = ProgramTable.of(progs)
        if not len(tab):                                       # nothing to break
            continue
        cols = [torch.tensor(x) for x in (tab.rank, tab.step, tab.kind, tab.a,
                                          tab.b, tab.c)]
        i = int(torch.randint(len(cols[0]), (), generator=rng))
        what = case % 3
        if what == 0:                                          # drop an op
            cols = [torch.cat([x[:i], x[i + 1:]]) for x in cols]
        elif what == 1:                                        # change a chunk or a peer
            cols[[4, 5][case % 2]][i] = int(torch.randint(P, (), generator=rng))
        else:                                                  # change the op's kind
            cols[2][i] = int(torch.randint(4, (), generator=rng))
        bad = _ops_of_rows(P, *(x.tolist() for x in cols))
        messages = []
        for run in (check, oracle.check):       # the columns, and the op-by-op rules
            try:
                run(bad, need=need if case % 2 else None, backward=backward, kv=kv)
                messages.append(None)
            except ScheduleError as err:
                messages.append(str(err))
        assert messages[0] == messages[1]
        verdicts[messages[0] is None] += 1
    assert verdicts[False] > 40 and verdicts[True] > 0


def _ops_of_rows(P, rank, step, kind, a, b, c):
    """Programs (op objects) of rows (rank, step, kind, a, b, c), whatever they hold."""
    ops = [collections.defaultdict(list) for _ in range(P)]
    for r, t, k, x, y, z in zip(rank, step, kind, a, b, c):
        if k <= 1:
            ops[r][t].append((Compute, GradCompute)[k](x, y))
        else:
            ops[r][t].append((Send, Recv)[k - 2](Buffer.of(tuple(Family)[x], y), z))
    return [Program(r, tuple(Step(t, tuple(o[t])) for t in sorted(o))) for r, o in enumerate(ops)]


@pytest.mark.parametrize("P", [2, 4, 8])
def test_causal_work_balance(P):
    bs = 8
    S = 2 * P * bs * 16
    stats = {name: fringe.plan(make(), masks.causal(), seq_len=S, world_size=P,
                               block_size=bs).stats()
             for name, make in SCHEDULES.items()}
    assert stats["ring"].balance == pytest.approx((2 * P - 1) / P, rel=0.05)
    assert stats["zigzag"].balance <= 1.05
    assert stats["striped"].balance <= 1.05
    # pruning: the last rank's kv never leaves it under causal ring
    ring = fringe.plan(schedules.ring(), masks.causal(), seq_len=S, world_size=P, block_size=bs)
    assert not any(isinstance(op, Send) and op.buf == Buffer.of("kv", P - 1)
                   for _, op in ring.forward[P - 1].ops())
    assert ring.stats().rows[P - 1]["fwd_sent"] == 0


def test_document_mask_prunes_tiles_and_sends():
    P, bs, S = 4, 4, 64
    docs = torch.arange(S) // (S // P)           # one document per rank: block diagonal
    p = fringe.plan(schedules.ring(), masks.causal() & masks.document(docs), seq_len=S,
                    world_size=P, block_size=bs)
    assert [len(prog.steps) for prog in p.forward] == [1] * P
    assert not any(isinstance(op, (Send, Recv)) for prog in p.forward for _, op in prog.ops())


def _golden_text(p) -> str:
    head = f"{p.schedule.name} causal S={p.seq_len} P={p.world_size} block={p.block_size}"
    return (f"# {head} forward\n" + format_programs(p.forward) +
            f"# {head} backward kv={p.kv}\n" + format_programs(p.backward))


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_golden_programs(name):
    """Goldens hold the plain-ASCII program text (forward, then backward), not a rendered grid."""
    p = fringe.plan(SCHEDULES[name](), masks.causal(), seq_len=64, world_size=4, block_size=4)
    text = _golden_text(p)
    path = GOLDEN / f"{name}_p4_causal.txt"
    if os.environ.get("FRINGE_REGOLD"):
        path.parent.mkdir(exist_ok=True)
        path.write_text(text)
    golden = path.read_text()
    assert golden.isascii()
    fwd, bwd = golden.split("\n# ", 1)
    assert parse_programs(fwd) == list(p.forward) and parse_programs("# " + bwd) == list(p.backward)
    assert text == golden, "regenerate with FRINGE_REGOLD=1 if the change is intended"


def test_schedule_module_docstrings_show_their_grid():
    import doctest
    import fringe.schedules.rings as ring_mod
    result = doctest.testmod(ring_mod, optionflags=doctest.NORMALIZE_WHITESPACE,
                             extraglobs=dict(fringe=fringe, masks=masks, render=render,
                                             schedules=schedules))
    assert result.attempted >= 3 and result.failed == 0


def test_ir_module_docstrings_run():
    import doctest
    import fringe.schedules.ir as ir_mod
    result = doctest.testmod(ir_mod)
    assert result.attempted >= 4 and result.failed == 0


# ---- bad input -------------------------------------------------------------------------
def test_world_size_below_one_is_rejected():
    with pytest.raises(ValueError, match="world_size must be an int >= 1"):
        fringe.plan(schedules.ring(), masks.causal(), seq_len=64, world_size=0)


def test_indivisible_sequence_names_the_padding():
    with pytest.raises(ValueError, match=r"S=1000 is not divisible by 2\*P\*block=2\*4\*64=?.*"
                                         r"pad the sequence to 1024"):
        fringe.plan(schedules.zigzag(), masks.causal(), seq_len=1000, world_size=4, block_size=64)


def test_custom_program_with_unmatched_receive_names_rank_and_step():
    def progs(P):
        return [Program(0, (Step(0, (Compute(0, 0),)),)),
                Program(1, (Step(0, (Compute(1, 1), Recv("kv0", 0))),
                            Step(1, (Compute(1, 0),))))]
    sched = schedules.Schedule("broken", layout=fringe.layout.contiguous, programs_fn=progs)
    with pytest.raises(ScheduleError, match=r"rank 1, step 0: 'R kv0←r0' has no matching send "
                                            r"on rank 0"):
        fringe.plan(sched, masks.full(), seq_len=8, world_size=2, block_size=2)


def test_check_marks_the_offending_step_in_the_rank_program():
    progs = [Program(0, (Step(0, (Compute(0, 0), Send("kv0", 1))),)),
             Program(1, (Step(0, (Compute(1, 1),)), Step(1, (Compute(1, 0),)),
                         Step(2, (Compute(1, 1),))))]
    with pytest.raises(ScheduleError) as err:
        check(progs)
    lines = str(err.value).splitlines()
    assert lines[0] == "rank 0, step 0: 'S kv0→r1' has no matching receive on rank 1 in the same step"
    assert lines[1:] == ["r0:", "  t0: C q0·kv0 | S kv0→r1    <-- ERROR HERE"]
    progs[0] = Program(0, (Step(0, (Compute(0, 0),)),))
    with pytest.raises(ScheduleError) as err:
        check(progs)
    lines = str(err.value).splitlines()
    assert lines[0] == "rank 1, step 1: 'C q1·kv0' needs kv0, which is not on rank 1 yet"
    assert [ln for ln in lines if "<-- ERROR HERE" in ln] == ["  t1: C q1·kv0    <-- ERROR HERE"]
    assert lines[1:] == ["r1:", "  t0: C q1·kv1", "  t1: C q1·kv0    <-- ERROR HERE", "  t2: C q1·kv1"]


def test_buffer_ids_are_typed_values_that_print_as_names():
    b = Buffer("dkv12")
    assert (b.family, b.chunk) == (Family.DKV, 12) and b.family.is_gradient
    assert b == "dkv12" and str(b) == "dkv12" and Buffer.of("dkv", 12) is b is buffer_name("dkv", 12)
    assert b.cotangent == Buffer.of(Family.KV, 12) and not b.cotangent.family.is_gradient
    assert Send("kv3", 1).buf.family is Family.KV and Send("kv3", 1) == Send(Buffer("kv3"), 1)
    for fam in Family:
        assert Buffer.of(fam, 0).family is fam
    with pytest.raises(ValueError, match=r"buffer name 'kvx' is not one of q<chunk>, kv<chunk>"):
        Buffer("kvx")
    with pytest.raises(ValueError, match="has no adjoint"):
        Buffer("acc0").cotangent
    with pytest.raises(AttributeError):
        b.chunk = 3


def test_ops_declare_reads_writes_and_adjoint():
    assert Compute(3, 5).reads() == ("q3", "kv5") and Compute(3, 5).writes() == ("out3",)
    assert GradCompute(3, 5).reads() == ("q3", "kv5", "out3", "dout3")
    assert GradCompute(3, 5).writes() == ("dq3", "dkv5")
    assert Send("kv5", 2).reads() == ("kv5",) and Send("kv5", 2).writes() == ()
    assert Recv("kv5", 0).writes() == ("kv5",) and Recv("kv5", 0).reads() == ()
    assert Compute(3, 5).adjoint() == GradCompute(3, 5)
    assert Send("kv5", 2).adjoint() == Recv("dkv5", 2)
    assert Recv("kv5", 0).adjoint() == Send("dkv5", 0)
    assert [parse_op(t) for t in ("C q3.kv5", "G q3.kv5", "S kv5->r2", "R kv5<-r0")] == [
        Compute(3, 5), GradCompute(3, 5), Send("kv5", 2), Recv("kv5", 0)]
    with pytest.raises(ValueError, match="a send uses '->'"):
        parse_op("S kv5<-r2")


def test_program_table_rows_must_be_sorted_by_rank_then_step():
    progs = [Program(0, (Step(0, (Compute(0, 0), Send("kv0", 1))),)),
             Program(1, (Step(0, (Recv("kv0", 0), Compute(1, 1))), Step(1, (Compute(1, 0),))))]
    tab = ProgramTable.of(progs)
    assert tab.programs() == tuple(progs) and len(tab) == 5
    with pytest.raises(ValueError, match="sorted by rank"):
        ProgramTable(2, tab.rank[::-1], tab.step, tab.kind, tab.a, tab.b, tab.c)
    with pytest.raises(ValueError, match="sorted by rank"):
        ProgramTable(2, tab.rank, tab.step[::-1], tab.kind, tab.a, tab.b, tab.c)


def test_hop_table_is_a_mapping_of_hops():
    table = schedules.ring_hops(4)
    assert table[1] == [Hop(0, 1, 2), Hop(1, 2, 3), Hop(2, 3, 0)] and sorted(table) == [0, 1, 2, 3]
    as_dict = {j: table[j] for j in table}
    assert schedules.lower(4, as_dict) == schedules.lower(4, table)
    assert HopTable.of(as_dict)[3] == table[3]
    need = torch.ones(4, 4, dtype=torch.bool).tril()
    assert schedules.lower(4, table, need=need) == schedules.prune(schedules.lower(4, table), need)


@pytest.mark.parametrize("hops, message", [
    ({0: [Hop(0, 0, 1), Hop(1, 2, 3)]}, r"kv0 is sent from rank 2 at step 1 before it is there"),
    ({0: [Hop(0, 0, 1), Hop(1, 1, 0)]}, r"kv0 reaches rank 0 twice \(again at step 1\)"),
    ({1: [Hop(0, 1, 7)]}, r"hop Hop\(step=0, src=1, dst=7\) of kv1 names rank 7, outside \[0, 4\)"),
])
def test_lower_rejects_hops_that_are_not_a_tree(hops, message):
    with pytest.raises(ScheduleError, match=message):
        schedules.lower(4, hops)


def test_custom_program_missing_a_tile_is_rejected():
    def progs(P):
        return [Program(0, (Step(0, (Compute(0, 0),)),)), Program(1, (Step(0, (Compute(1, 1),)),))]
    sched = schedules.Schedule("lazy", layout=fringe.layout.contiguous, programs_fn=progs)
    with pytest.raises(ScheduleError, match=r"tile q1·kv0 is never computed"):
        fringe.plan(sched, masks.causal(), seq_len=8, world_size=2, block_size=2)


def test_hand_written_program_gets_pruning_and_a_backward():
    def progs(P):   # a full ring written by hand, with a useless last hop
        return schedules.lower(P, schedules.ring_hops(P))
    sched = schedules.Schedule("by-hand", layout=fringe.layout.contiguous, programs_fn=progs)
    p = fringe.plan(sched, masks.causal(), seq_len=32, world_size=4, block_size=2)
    ref = fringe.plan(schedules.ring(), masks.causal(), seq_len=32, world_size=4, block_size=2)
    assert p.forward == ref.forward and p.backward == ref.backward
    check(list(p.backward), backward=True)
    assert reverse(list(p.forward)) == list(p.backward)


def test_timeline_and_chrome_trace_from_a_virtual_run(tmp_path):
    import json
    from fringe.testing import make_qkv
    P, S = 4, 64
    p = fringe.plan(schedules.zigzag(), masks.causal(), seq_len=S, world_size=P, block_size=4)
    q, k, v = make_qkv(B=1, H=2, G=1, S=S, D=4, seed=0)
    states = fringe.simulate.forward_states(q, k, v, plan=p)
    records = [rec for st in states.values() for rec in st.records]
    assert len(records) == sum(len(prog.steps) for prog in p.forward)
    trace = render.chrome_trace(records, tmp_path / "trace.json")
    loaded = json.loads((tmp_path / "trace.json").read_text())
    assert loaded == json.loads(json.dumps(trace))
    spans = [e for e in trace["traceEvents"] if e["cat"] == "compute"]
    assert {e["pid"] for e in spans} == set(range(P)) and len(spans) == len(records)
    ax = render.timeline(records, title="zigzag")
    assert len(ax.patches) == 2 * len(records)


# The balanced layout now minimises predicted step time (calls, pairs, bytes), not block-count
# balance: tests/test_balanced.py::test_predicted_time_is_never_worse_than_contiguous_or_zigzag.


def test_balanced_reuses_the_sequence_order_classification():
    ids = torch.repeat_interleave(torch.arange(5), torch.tensor([100, 7, 90, 30, 29]))
    mask = masks.causal() & masks.document(ids)
    p = fringe.plan(schedules.balanced(), mask, seq_len=256, world_size=4, block_size=4)
    again = masks.classify(mask, p.layout.order, p.layout.order, block_size=4)
    assert torch.equal(p.blocks, again)
