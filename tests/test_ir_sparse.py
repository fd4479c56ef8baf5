"""Sparse collective slots, the check memo and the hop-space kv re-send: each mechanism gives
what the plain form gives (structure only, no timing)."""
from __future__ import annotations

import dataclasses
import pickle

import numpy as np
import pytest
import torch

from fringe import schedules
from fringe.schedules import (Collective, Compute, Program, ScheduleError, Step, check, parse_op,
                              reverse)
from fringe.schedules.ir import Buffer, Family, ProgramTable, format_programs, parse_programs
from fringe.schedules.passes import _resend_parts
from fringe.testing import oracle


def _dense_copy(programs):
    """The same programs rebuilt from their text: every collective by the dense constructor."""
    return parse_programs(format_programs(programs))


def test_a_sparse_collective_is_the_dense_one():
    g = tuple(range(6))
    kv = [Buffer.of(Family.KV, k) for k in g]
    dense = Collective("AG", g, (kv[2], None, kv[2], None, kv[2], None),
                       (None, kv[1], kv[2], None, None, kv[5]))
    sparse = Collective.sparse("AG", g, ((0, 2, 4), (kv[2],) * 3), ((1, 2, 5), (kv[1], kv[2], kv[5])))
    assert sparse == dense and hash(sparse) == hash(dense)
    assert sparse.sends == dense.sends and sparse.recvs == dense.recvs
    assert sparse.ascii() == dense.ascii() and parse_op(sparse.ascii()) == dense
    assert sparse.reads() == (kv[2],) and sparse.writes() == (kv[1], kv[2], kv[5])
    assert sparse.received(2) == {kv[1], kv[5]}          # its own slot stays in place
    assert sparse.adjoint() == Collective("RS", g, tuple(None if b is None else b.cotangent
                                                         for b in dense.recvs),
                                          tuple(None if b is None else b.cotangent
                                                for b in dense.sends))
    assert sparse.adjoint().adjoint() == dense
    assert pickle.loads(pickle.dumps(sparse)) == dense
    assert Collective.sparse("AG", g, ((), ()), ((), ())).sends == (None,) * 6
    with pytest.raises(ValueError, match="strictly increasing"):
        Collective.sparse("AG", g, ((2, 1), (kv[2], kv[2])), ((), ()))
    with pytest.raises(ValueError, match="strictly increasing"):
        Collective.sparse("AG", g, ((6,), (kv[2],)), ((), ()))
    with pytest.raises(dataclasses.FrozenInstanceError):
        sparse.kind = "RS"


@pytest.mark.parametrize("P,seed", [(5, 0), (8, 1), (16, 2)])
def test_sparse_gathers_reverse_and_check_as_dense_copies_do(P, seed):
    gen = torch.Generator().manual_seed(seed)
    need = (torch.rand(P, P, generator=gen) < 0.4) | torch.eye(P, dtype=torch.bool)
    fwd = schedules.allgather(pieces=3).programs(P, need)
    dense = _dense_copy(fwd)
    assert dense == fwd and all(a is not b for a, b in zip(dense, fwd))
    check(dense, need=need)
    check(fwd, need=need)
    bwd = reverse(fwd)
    assert bwd == reverse(dense)
    assert format_programs(bwd) == format_programs(reverse(dense))
    check(bwd, need=need, backward=True)
    check(_dense_copy(bwd), need=need, backward=True)
    # every gathered chunk is one occupied slot on each side, nothing per empty member
    moved = sum(len(op.sparse_recvs[0]) for prog in fwd for _, op in prog.ops()
                if isinstance(op, Collective))
    assert moved == int(need.sum()) - int(need.diagonal().sum())


def test_a_mismatched_slot_names_the_first_sender_and_receiver():
    g = (0, 1, 2)
    kv = [Buffer.of(Family.KV, k) for k in g]
    sides = [Collective("AG", g, (None, kv[0], kv[0]), (None, kv[1], None)),
             Collective("AG", g, (kv[1], None, None), (kv[0], None, None)),
             Collective("AG", g, (None, None, None), (kv[0], None, None))]
    progs = [Program(r, (Step(0, (op,)),)) for r, op in enumerate(sides)]
    check(progs)
    bad = list(sides)
    bad[2] = Collective("AG", g, (None, None, None), (None, None, None))   # drops kv0 from rank 0
    with pytest.raises(ScheduleError, match=r"rank 0, step 0: .*sends kv0 to rank 2, but rank 2's "
                                            r"side .* receives nothing from rank 0"):
        check([Program(r, (Step(0, (op,)),)) for r, op in enumerate(bad)])
    with pytest.raises(ScheduleError, match="slot of rank 1 itself"):
        check([progs[0], Program(1, (Step(0, (Collective("AG", g, (kv[1], kv[1], None),
                                                                (kv[0], None, None)),)),)),
               progs[2]])


def test_check_remembers_only_the_very_programs_it_passed():
    P = 4
    need = torch.ones(P, P, dtype=torch.bool)
    fwd = schedules.allgather().programs(P, need)
    check(fwd, need=need)
    check(fwd, need=need)                                # again: the tiles are still checked
    wrong_need = need.clone()
    wrong_need[0, 1] = False
    with pytest.raises(ScheduleError, match="q0·kv1 is empty but computed"):
        check(fwd, need=wrong_need)
    # an equal but distinct list is checked in full, and a changed one fails
    broken = list(fwd)
    steps = broken[1].steps
    broken[1] = Program(1, (Step(steps[0].index, tuple(op for op in steps[0].ops
                                                       if not isinstance(op, Collective))),)
                        + steps[1:])
    with pytest.raises(ScheduleError, match="collective"):
        check(broken)
    with pytest.raises(ScheduleError):
        check(broken, backward=True)


def test_prune_keeps_unchanged_programs_as_they_are():
    P = 6
    need = torch.ones(P, P, dtype=torch.bool)
    need[0, P - 1] = False                   # rank 0 drops a tile; kv{P-1} need not reach it
    fwd = schedules.allgather().programs(P, torch.ones(P, P, dtype=torch.bool))
    pruned = schedules.prune(fwd, need)
    assert pruned[0] != fwd[0] and pruned[1] == fwd[1]     # rank 1 needs every tile
    assert pruned[P - 1] != fwd[P - 1]       # its contribution to rank 0 is thinned away
    plain = _dense_copy(fwd)                 # op values: the unchanged ones come back as is
    by_ops = schedules.prune(plain, need)
    assert by_ops[0] != plain[0] and by_ops[1] == plain[1]
    assert pruned == by_ops
    assert schedules.prune(fwd, torch.ones(P, P, dtype=torch.bool)) == list(fwd)


def _ring_parts(P, need):
    return ProgramTable.of(schedules.lower(P, schedules.ring_hops(P), need=need))._parts[:2]


@pytest.mark.parametrize("seed", range(6))
def test_hop_space_resend_takes_the_chain_and_the_tree_route_to_one_answer(seed):
    """Ring hops are chains in hop order (prefix sums); shuffling the hops' order forces the
    pass in arrival order: both give the same re-sends, equal to the op-by-op rules."""
    gen = torch.Generator().manual_seed(seed)
    P = 3 + seed
    need = torch.rand(P, P, generator=gen) < 0.5
    comp, xfer = _ring_parts(P, need)
    T = 1 + max([-1] + [int(d["step"].max()) for d in (comp, xfer) if len(d["step"])])
    args = (comp["rank"], comp["step"], comp["kv"])
    x = [xfer[k].astype(np.int64) for k in ("step", "src", "dst", "chunk", "order")]
    chain = _resend_parts(P, T, *args, *x[:4], x[4], 10 ** 6)
    perm = np.random.default_rng(seed).permutation(len(x[0]))
    tree = _resend_parts(P, T, *args, *(a[perm] for a in x[:4]), x[4][perm], 10 ** 6)

    def rows(d):
        return sorted(zip(*(d[k].tolist() for k in ("order", "step", "src", "dst", "chunk"))))
    assert rows(chain) == rows(tree)
    fwd = schedules.lower(P, schedules.ring_hops(P), need=need)
    assert reverse(fwd) == oracle.reverse([Program(p.rank, p.steps) for p in fwd])


def test_a_1024_rank_document_allgather_plan_reverses_and_checks():
    from fringe import masks
    from fringe.testing import packed_docs
    from fringe.plan import BlockKind, plan
    S, P = 1 << 17, 1024
    ids = packed_docs(S, 100, 0)
    p = plan(schedules.allgather(), masks.causal() & masks.document(ids), seq_len=S,
             world_size=P, block_size=64)
    need = p.tiles != BlockKind.EMPTY
    gathers = [op for prog in p.forward for _, op in prog.ops() if isinstance(op, Collective)]
    assert len(gathers) == 2 * P and all(len(op.group) == P for op in gathers)
    moved = sum(len(op.sparse_recvs[0]) for op in gathers)
    assert moved == int(need.sum()) - int(need.diagonal().sum()) > 0
    back = [op for prog in p.backward for _, op in prog.ops() if isinstance(op, Collective)]
    assert sorted({op.kind for op in back}) == ["AG", "RS"]
    r = next(i for i in range(P) if need[i].sum() > 1)
    mine = [op for _, op in p.forward[r].ops() if isinstance(op, Collective)]
    got = {b for op in mine for b in op.received(r)}
    assert got == {Buffer.of(Family.KV, j) for j in need[r].nonzero().flatten().tolist() if j != r}
    assert {(op.q, op.kv) for _, op in p.forward[r].ops() if isinstance(op, Compute)} == {
        (r, j) for j in need[r].nonzero().flatten().tolist()}


@pytest.mark.parametrize("outer", ["ring", "zigzag", "allgather"])
def test_compose_with_ulysses_is_built_pruned(outer):
    """The head-slice transfers stop where no later group uses the chunk: pruning the built
    programs changes nothing, and every slice a rank receives it computes with or sends on."""
    from fringe.schedules.collectives import _composed_programs
    gen = torch.Generator().manual_seed(3)
    for m, k in ((3, 2), (4, 4), (6, 2)):
        P = m * k
        need = torch.rand(P, P, generator=gen) < 0.35
        progs = _composed_programs(schedules.get(outer), k, P, need.numpy())
        check(progs)
        assert all(a is b for a, b in zip(schedules.prune(progs, need), progs))
        check(progs, need=need)
        for prog in progs:
            used = {b for _, op in prog.ops() if isinstance(op, Compute) for b in op.reads()}
            sent = [(t, op.buf) for t, op in prog.ops() if isinstance(op, schedules.Send)]
            for t, op in prog.ops():
                if isinstance(op, schedules.Recv):
                    assert op.buf in used or any(b == op.buf and u > t for u, b in sent), (prog.rank, t, op)
