"""User-written collective schedules (op objects, written without the mask): fringe prunes
them to the mask, derives their backward under either kv policy, and runs them exactly.

Chains of collectives (a two-level all-gather), a collective then point-to-point hops of what
it brought, own slots either way; causal and document masks; several (P, group size); each
against dense attention in float64 on the virtual mesh, and one case per kind per kv policy
on gloo ranks (one worker pool).
"""
from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

import fringe
from fringe import masks
from fringe.launch import Workers
from fringe.ops import reference
from fringe.schedules import Buffer, Collective, Compute, ScheduleError, check, prune, reverse
from fringe.testing import make_qkv, oracle, tolerances
from fringe.testing.user_schedules import allgather_then_ring, two_level_allgather

BLOCK = 4
KINDS = {"two_level_same": lambda g: two_level_allgather(g, own="same"),
         "two_level_none": lambda g: two_level_allgather(g, own="none"),
         "two_level_mixed": lambda g: two_level_allgather(g, own="mixed"),
         "ag_ring_same": lambda g: allgather_then_ring(g, own="same"),
         "ag_ring_none": lambda g: allgather_then_ring(g, own="none")}
SIZES = [(4, 2), (6, 3), (8, 4), (8, 2)]


def _docs(S: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    cuts = torch.randperm(S - 1, generator=g)[:3].sort().values + 1
    return torch.bucketize(torch.arange(S), cuts, right=True)


def _mask(kind: str, S: int, seed: int):
    return masks.causal() if kind == "causal" else masks.causal() & masks.document(_docs(S, seed))


def _case(kind, mask_kind, kv, P, g, seed=0):
    S = P * BLOCK * 3
    mask = _mask(mask_kind, S, seed)
    plan = fringe.plan(KINDS[kind](g), mask, seq_len=S, world_size=P, block_size=BLOCK, kv=kv)
    q, k, v = make_qkv(B=1, H=2, G=1, S=S, D=4, seed=seed)
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(seed + 1),
                       dtype=torch.float64)
    return plan, mask, q, k, v, dout


def _dense(mask, q, k, v, dout):
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    out, _ = reference.attention(qg, kg, vg, mask_mod=mask)
    return [out.detach(), *torch.autograd.grad(out, (qg, kg, vg), dout)]


CASES = [(kind, m, kv, P, g) for kind in KINDS for m in ("causal", "docs")
         for kv in ("resend", "keep") for (P, g) in SIZES
         if (P, g) == (4, 2) or (SIZES.index((P, g)) + len(kind) + len(m) + len(kv)) % 3 == 0]


@pytest.mark.parametrize("kind,mask_kind,kv,P,g", CASES)
def test_user_collective_schedules_match_dense_in_float64(kind, mask_kind, kv, P, g):
    plan, mask, q, k, v, dout = _case(kind, mask_kind, kv, P, g, seed=P + g)
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    out = fringe.simulate.attention(qg, kg, vg, plan=plan)
    got = [out.detach(), *torch.autograd.grad(out, (qg, kg, vg), dout)]
    for what, a, b in zip(("out", "dq", "dk", "dv"), got, _dense(mask, q, k, v, dout)):
        assert_close(a, b, **tolerances(torch.float64), msg=lambda s: f"{what}: {s}")


def _kv_slots(programs):
    return sum(len(op.sparse_sends[0]) for p in programs for _, op in p.ops()
               if type(op) is Collective)


def test_prune_thins_collective_contributions_to_what_the_mask_needs():
    P, g, S = 8, 4, 8 * BLOCK * 2
    sched = two_level_allgather(g)
    full = sched.programs(P)
    causal = fringe.plan(sched, masks.causal(), seq_len=S, world_size=P, block_size=BLOCK)
    # every contribution kept is computed with by its receiver or forwarded by it later
    for prog in causal.forward:
        r = prog.rank
        used = {b for _, op in prog.ops() if type(op) is not Collective for b in op.reads()}
        for t, op in prog.ops():
            if type(op) is not Collective:
                continue
            for k, b in zip(*op.sparse_recvs):
                if op.group[k] == r:
                    continue
                later = any(type(o) is Collective and any(
                    x == b and o.group[kk] != r for kk, x in zip(*o.sparse_sends))
                    for t2, o in prog.ops() if t2 > t)
                assert b in used or later, (r, t, str(op))
    # the last group's first-level gather: kv of later chunks is neither used nor forwarded
    last = causal.forward[P - g]
    first = next(op for _, op in last.ops() if type(op) is Collective)
    assert [b.chunk for b in first.sparse_recvs[1]] == [P - g]
    # a block-diagonal document mask (one document per group): nothing crosses groups
    docs = torch.arange(S) // (S // (P // g))
    diag = fringe.plan(sched, masks.document(docs), seq_len=S, world_size=P, block_size=BLOCK)
    for prog in diag.forward:
        for _, op in prog.ops():
            assert type(op) is not Collective or set(op.group) == set(range(
                prog.rank // g * g, prog.rank // g * g + g)), str(op)


def test_a_chain_of_collectives_gets_as_many_prologue_steps_as_it_needs():
    P, g = 4, 2
    progs = two_level_allgather(g).programs(P)
    bwd = reverse(progs, kv="resend")
    check(bwd, backward=True, kv="resend")
    # forward steps 0..2; the re-issued outer gathers need the inner ones a step earlier
    firsts = [p.steps[0].index for p in bwd]
    assert min(firsts) == 0
    assert max(s.index for p in bwd for s in p.steps) == 4       # T=3 plus one more prologue
    inner = [op for p in bwd for s in p.steps if s.index == 0 for op in s.ops
             if type(op) is Collective]
    assert inner and all(op.kind == "AG" and len(op.group) == g for op in inner)


@pytest.mark.parametrize("kv", ["resend", "keep"])
def test_own_slot_conventions_do_not_change_the_result(kv):
    P, g = 4, 2
    res = []
    for own in ("same", "none", "mixed"):
        S = P * BLOCK * 3
        mask = _mask("docs", S, 3)
        plan = fringe.plan(two_level_allgather(g, own=own), mask, seq_len=S, world_size=P,
                           block_size=BLOCK, kv=kv)
        q, k, v = make_qkv(B=1, H=2, G=1, S=S, D=4, seed=3)
        qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
        out = fringe.simulate.attention(qg, kg, vg, plan=plan)
        res.append([out.detach(), *torch.autograd.grad(out.sum(), (qg, kg, vg))])
    for other in res[1:]:
        for a, b in zip(res[0], other):
            assert torch.equal(a, b)


def test_a_reduce_scatters_own_slot_is_not_a_read():
    """The derived backward's reduce-scatter names its own slot: the check does not ask for
    that gradient to be present (the runtime moves nothing for it)."""
    P, g = 4, 2
    progs = two_level_allgather(g, own="same").programs(P)
    need = torch.ones(P, P, dtype=torch.bool)
    need[0, 1] = False                       # rank 0 never computes with kv1, yet it forwards it
    fwd = prune(progs, need)
    check(fwd, need=need)
    bwd = reverse(fwd, kv="keep")
    check(bwd, need=need, backward=True, kv="keep")


def test_reverse_names_what_it_cannot_deliver():
    with pytest.raises(ScheduleError, match="reverse takes forward programs"):
        reverse(reverse(two_level_allgather(2).programs(4)))


# ---- gloo: one case per kind per kv policy, in one pool --------------------------------------
GLOO = [(kind, kv) for kind in ("two_level_same", "two_level_mixed", "ag_ring_none")
        for kv in ("resend", "keep")]


def worker_user_collectives(rank: int, world_size: int, cases):
    res = {}
    for kind, kv in cases:
        plan, mask, q, k, v, dout = _case(kind, "docs", kv, world_size, 2, seed=5)
        lay = plan.layout
        ql, kl, vl = (lay.shard(t, rank).requires_grad_() for t in (q, k, v))
        out = fringe.attention(ql, kl, vl, plan=plan, timeout_s=60)
        res[(kind, kv)] = [out.detach(), *torch.autograd.grad(out, (ql, kl, vl),
                                                              lay.shard(dout, rank))]
    return res


def test_gloo_user_collective_schedules_match_dense():
    P = 4
    with Workers(P, timeout_s=120) as w:
        res = w.run(worker_user_collectives, GLOO)
    for kind, kv in GLOO:
        plan, mask, q, k, v, dout = _case(kind, "docs", kv, P, 2, seed=5)
        want = _dense(mask, q, k, v, dout)
        for i, what in enumerate(("out", "dq", "dk", "dv")):
            got = plan.layout.unshard([res[r][(kind, kv)][i] for r in range(P)])
            assert_close(got, want[i], **tolerances(torch.float64),
                         msg=lambda s: f"{kind} {kv} {what}: {s}")


# ---- the column passes give what the op rules give, on user collective schedules -------------
@pytest.mark.parametrize("kind,g", [("two_level_same", 2), ("two_level_none", 2),
                                    ("two_level_mixed", 4), ("ag_ring_same", 2),
                                    ("ag_ring_none", 4)])
@pytest.mark.parametrize("seed", [0, 1])
def test_column_prune_and_reverse_equal_the_op_rules_on_user_schedules(kind, g, seed):
    import numpy as np
    from fringe.schedules import passes
    from fringe.schedules.ir import ProgramTable, format_programs
    from fringe.testing import oracle
    P = 8
    progs = KINDS[kind](g).programs(P)
    rng = np.random.default_rng(seed)
    need = rng.random((P, P)) < 0.5
    need[np.arange(P), np.arange(P)] = True
    plain = oracle.prune(progs, need)
    assert passes._general_prune(ProgramTable.of(progs), need) == plain
    tab = ProgramTable.of(plain)
    for kv in ("resend", "keep"):
        want = oracle.reverse(plain, kv=kv)
        got = passes._general_reverse(tab, kv)
        assert format_programs(got) == format_programs(want), kv
        check(want, need=torch.from_numpy(need), backward=True, kv=kv)


# ---- faults in a user's programs are named, whatever form they are given in --------------------
def _faulty(kind: str):
    from fringe.schedules import Program, Recv, Step
    progs = two_level_allgather(2).programs_fn(4)
    p0 = progs[0]
    if kind == "early compute":         # kv2 arrives at step 1: computing with it at 1 is early
        steps = (p0.steps[0], Step(1, p0.steps[1].ops + (Compute(0, 2),)),
                 Step(2, tuple(op for op in p0.steps[2].ops if op != Compute(0, 2))))
    elif kind == "unmatched receive":
        steps = (Step(0, p0.steps[0].ops + (Recv(Buffer.of("kv", 3), 3),)), *p0.steps[1:])
    else:                               # a member skips a collective
        steps = (Step(0, tuple(op for op in p0.steps[0].ops if type(op) is not Collective)),
                 *p0.steps[1:])
    return [Program(0, steps)] + progs[1:]


@pytest.mark.parametrize("kind,match", [("early compute", "needs kv2, which is not on rank 0"),
                                        ("unmatched receive", "has no matching send"),
                                        ("skipped collective", "issues 0 collective")])
@pytest.mark.parametrize("form", ["ops", "text"])
def test_faults_in_user_programs_are_named(kind, match, form):
    from fringe import layout
    from fringe.schedules import Schedule, format_programs, parse_programs
    progs = _faulty(kind)
    fn = ((lambda P: progs) if form == "ops" else
          (lambda P, text=format_programs(progs): parse_programs(text)))
    sched = Schedule("faulty", layout=layout.contiguous, programs_fn=fn)
    with pytest.raises(ScheduleError, match=match) as e:
        fringe.plan(sched, masks.causal(), seq_len=4 * BLOCK * 2, world_size=4, block_size=BLOCK)
    assert "<-- ERROR HERE" in str(e.value)
    with pytest.raises(ScheduleError) as want:          # the op-by-op rules say the same
        oracle.check(fn(4))
    with pytest.raises(ScheduleError) as got:
        check(fn(4))
    assert str(got.value) == str(want.value)
