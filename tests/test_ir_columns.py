"""The public column builder (fringe.schedules.columns.ProgramBuilder): programs without a
Python object per op, equal to the same programs written op by op, planned on columns."""
from __future__ import annotations

import doctest

import numpy as np
import pytest
import torch
from torch.testing import assert_close

import fringe
from fringe import masks
from fringe.ops import reference
from fringe.schedules import columns
from fringe.schedules.columns import ProgramBuilder
from fringe.testing import make_qkv, tolerances
from fringe.testing.user_schedules import two_level_allgather, two_level_allgather_columns


def test_module_docstring_runs():
    result = doctest.testmod(columns)
    assert result.attempted >= 4 and result.failed == 0


@pytest.mark.parametrize("P,g", [(4, 2), (8, 4), (8, 2), (6, 3)])
def test_builder_programs_equal_the_op_written_ones(P, g):
    a = two_level_allgather_columns(g).programs(P)
    b = two_level_allgather(g).programs(P)
    assert a == b
    assert a[0].table is not None


@pytest.mark.parametrize("kv", ["resend", "keep"])
def test_a_builder_schedule_plans_and_matches_dense(kv):
    P, g, S = 8, 4, 8 * 4 * 3
    docs = torch.arange(S) * 5 // S
    mask = masks.causal() & masks.document(docs)
    cols = fringe.plan(two_level_allgather_columns(g), mask, seq_len=S, world_size=P,
                       block_size=4, kv=kv)
    ops = fringe.plan(two_level_allgather(g), mask, seq_len=S, world_size=P, block_size=4, kv=kv)
    assert list(cols.forward) == list(ops.forward) and list(cols.backward) == list(ops.backward)
    from fringe.schedules.ir import ProgramTable
    for a, b in ((cols.forward, ops.forward), (cols.backward, ops.backward)):
        assert ProgramTable.of(a).digest() == ProgramTable.of(b).digest()   # any builder's order
    q, k, v = make_qkv(B=1, H=2, G=1, S=S, D=4, seed=1)
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    out = fringe.simulate.attention(qg, kg, vg, plan=cols)
    got = [out.detach(), *torch.autograd.grad(out.sum(), (qg, kg, vg))]
    qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
    ref, _ = reference.attention(qr, kr, vr, mask_mod=mask)
    want = [ref.detach(), *torch.autograd.grad(ref.sum(), (qr, kr, vr))]
    for a, b in zip(got, want):
        assert_close(a, b, **tolerances(torch.float64))


def test_transfers_and_head_slices_as_columns():
    b = ProgramBuilder(2)
    b.computes(rank=[0, 1], step=0, q=[0, 1], kv=[0, 1], heads=([0, 1], 2))
    b.transfers(step=0, src=[0, 1], dst=[1, 0], chunk=[0, 1])
    progs = b.programs()
    assert progs[0].ascii() == "r0:\n  t0: C q0.kv0 h0/2 | S kv0->r1 | R kv1<-r1"


@pytest.mark.parametrize("call,match", [
    (lambda b: b.computes(rank=[0, 5], step=0, q=0, kv=0), r"ranks and chunks must lie in \[0, 4\)"),
    (lambda b: b.transfers(step=0, src=1, dst=1, chunk=0), "does not send to itself"),
    (lambda b: b.collective("XX", step=0, group=(0, 1), src=0, dst=1, chunk=0), "kind must be"),
    (lambda b: b.collective("AG", step=0, group=(0, 0), src=0, dst=1, chunk=0), "distinct ranks"),
    (lambda b: b.collective("AG", step=0, group=(0, 1), src=[0, 0], dst=[1, 1], chunk=0),
     "one contribution per"),
    (lambda b: b.collective("AG", step=0, group=(0, 1), src=0, dst=2, chunk=0), "member indices"),
    (lambda b: b.transfers(step=0, src=0, dst=1, family="zz", chunk=0), "family must be"),
    (lambda b: b.allgather(step=0, group=(0, 1), chunk=[0, 1], want=np.ones((3, 3))), "want must"),
    # not integers: these were truncated (q=1.5 ran as q1, step 0.5 as step 0)
    (lambda b: b.computes(rank=1, step=0, q=1.5, kv=0), "must be integers"),
    (lambda b: b.computes(rank=1, step=[0.5], q=1, kv=0), "must be integers"),
    (lambda b: b.computes(rank=1, step=0, q=1, kv=0, heads=(0.5, 2)), "must be integers"),
    (lambda b: b.transfers(step=0, src=0, dst=1.9, chunk=0), "must be integers"),
    (lambda b: b.collective("AG", step=0.5, group=(0, 1), src=0, dst=1, chunk=0),
     "must be integers"),
    (lambda b: b.collective("AG", step=0, group=(0, 1.5), src=0, dst=1, chunk=0),
     "must be integers"),
    (lambda b: b.allgather(step=0, group=(0, 1), chunk=[0, 1.5]), "must be integers"),
])
def test_builder_names_what_is_wrong(call, match):
    with pytest.raises(ValueError, match=match):
        call(ProgramBuilder(4))


def test_a_fault_in_builder_programs_is_named_by_check():
    from fringe.schedules import ScheduleError, check
    b = ProgramBuilder(2)
    b.allgather(step=0, group=(0, 1), chunk=[0, 1])
    b.computes(rank=0, step=0, q=0, kv=1)          # kv1 arrives at the end of step 0
    with pytest.raises(ScheduleError, match="ERROR HERE"):
        check(b.programs())


def test_a_mask_aware_builder_plans_the_same_programs():
    P, g, S = 8, 2, 8 * 4 * 2
    mask = masks.causal() & masks.document(torch.arange(S) * 3 // S)
    a = fringe.plan(two_level_allgather_columns(g, mask_aware=True), mask, seq_len=S,
                    world_size=P, block_size=4)
    b = fringe.plan(two_level_allgather(g), mask, seq_len=S, world_size=P, block_size=4)
    assert list(a.forward) == list(b.forward) and list(a.backward) == list(b.backward)


def test_collective_contributions_in_any_order_give_the_same_sides():
    """Contributions (with their own chunks and head slices) may come in any order: each
    side's slots are those of the op written by hand, in member order."""
    from fringe.schedules.ir import Buffer, Collective, Program, ProgramTable, Step
    group, pairs = (3, 0, 2), [(1, 0), (2, 1), (0, 2), (0, 1), (1, 1), (2, 0)]
    rng = np.random.default_rng(0)
    pairs = [pairs[i] for i in rng.permutation(len(pairs))]
    si, di = np.array(pairs).T
    chunk, hi = (si + 2 * di) % 4, (2 * si + di) % 3
    b = ProgramBuilder(4)
    b.collective("A2A", step=0, group=group, src=si, dst=di, family="q", chunk=chunk,
                 heads=(hi, 3))
    bufs = {(s, d): Buffer.of("q", int(c), (int(h), 3)) for s, d, c, h in zip(si, di, chunk, hi)}
    want = []
    for r in range(4):
        if r not in group:
            want.append(Program(r, ()))
            continue
        m = group.index(r)
        sends = sorted((d, bufs[m, d]) for s, d in bufs if s == m)
        recvs = sorted((s, bufs[s, m]) for s, d in bufs if d == m)
        op = Collective.sparse("A2A", group, tuple(zip(*sends)) or ((), ()),
                               tuple(zip(*recvs)) or ((), ()))
        want.append(Program(r, (Step(0, (op,)),)))
    got = b.programs()
    assert got == want
    assert ProgramTable.of(want).digest() == got[0].table.digest()
