"""Plan-side passes at P=1024 ranks: lower, prune, check and reverse with no recursion.

Structure only (no timing assertions). The ``need`` tile maps are built directly, as a plan
would classify them, without planning a million tokens.
"""
from __future__ import annotations

import collections

import numpy as np
import torch

from fringe import schedules
from fringe.schedules import (Collective, Compute, GradCompute, Program, Recv, Send, check,
                              reverse)
from fringe.schedules.ir import C_, G_, S_, Family, ProgramTable, steps_of
from fringe.testing import oracle

FAMILY_CODE = {f: n for n, f in enumerate(Family)}

P = 1024


def document_need(world_size: int, n_docs: int, local_len: int = 1024) -> torch.Tensor:
    """Tile map of causal & document over the contiguous layout: ``need[i, j]`` is True when
    rank i's queries see any of rank j's keys (j <= i and a document spans both)."""
    S = world_size * local_len
    bounds = torch.linspace(0, S, n_docs + 1).long()[1:-1]
    doc = torch.bucketize(torch.arange(S), bounds, right=True).view(world_size, local_len)
    first, last = doc[:, 0], doc[:, -1]
    return (last[None, :] >= first[:, None]) & torch.ones(world_size, world_size).tril().bool()


def tiles(programs, cls) -> collections.Counter:
    return collections.Counter((op.q, op.kv) for prog in programs for _, op in prog.ops()
                               if isinstance(op, cls))


def test_thousand_document_causal_mask_at_1024_ranks_plans_reverses_and_checks():
    need = document_need(P, 1000)
    want = {tuple(ij) for ij in need.nonzero().tolist()}
    assert P < len(want) < 3 * P                      # a band: each rank needs one or two kv
    fwd = schedules.ring().programs(P, need)
    check(fwd, need=need)
    for kv in ("resend", "keep"):
        bwd = reverse(fwd, kv=kv)
        check(bwd, need=need, backward=True, kv=kv)
        assert steps_of(bwd) == steps_of(fwd) + 1
        for programs, cls in ((fwd, Compute), (bwd, GradCompute)):
            count = tiles(programs, cls)
            assert set(count) == want and set(count.values()) == {1}      # every tile once
        # gradients go home along the reversed forward route
        fwd_moves = collections.Counter((prog.rank, op.peer, op.buf.chunk) for prog in fwd
                                        for _, op in prog.ops() if isinstance(op, Recv))
        bwd_grads = collections.Counter((prog.rank, op.peer, op.buf.chunk) for prog in bwd
                                        for _, op in prog.ops()
                                        if isinstance(op, Send) and op.buf.family is Family.DKV)
        assert bwd_grads == fwd_moves and len(fwd_moves) > 0
        kv_moves = sum(isinstance(op, Send) and op.buf.family is Family.KV
                       for prog in bwd for _, op in prog.ops())
        assert kv_moves == (len(fwd_moves) if kv == "resend" else 0)


def test_a_kv_chunk_crossing_all_1024_ranks_reverses_without_recursion():
    need = torch.eye(P, dtype=torch.bool)
    need[:, 1] = True                  # every rank needs kv1: 1 -> 2 -> ... -> 1023 -> 0
    fwd = schedules.ring().programs(P, need)
    check(fwd, need=need)
    bwd = reverse(fwd)                 # the recursive kv re-send search hit RecursionError here
    check(bwd, need=need, backward=True)
    kv1 = [(t, prog.rank, op.peer) for prog in bwd for t, op in prog.ops()
           if isinstance(op, Send) and op.buf == "kv1"]
    assert len(kv1) == P - 1
    # the last rank on the route (0) fetches kv1 in the prologue; every other rank gets it
    # relayed back along the ring one step ahead of its gradient tile
    assert [(t, src) for t, src, dst in kv1 if dst == 0] == [(0, 1)]
    assert sorted(x for x in kv1 if x[2] != 0) == sorted((P - r, (r + 1) % P, r) for r in range(2, P))


def test_causal_ring_on_columns_matches_the_op_by_op_rules_at_128_ranks():
    n = 128
    need = torch.ones(n, n, dtype=torch.bool).tril()
    fwd = schedules.ring().programs(n, need)
    check(fwd, need=need)
    bwd = reverse(fwd)
    check(bwd, need=need, backward=True)
    assert fwd[0].table is not None and bwd[0].table is not None      # the columnar path ran
    hops = n * (n - 1) // 2                 # kv_j travels j -> ... -> n-1
    assert len(bwd[0].table) == len(need.nonzero()) + 2 * hops + 2 * hops    # G, dkv and kv moves
    slow = oracle.reverse([Program(p.rank, p.steps) for p in fwd])           # the op-by-op rules
    for r in (0, 1, n // 2, n - 1):         # a rank's program, built when looked at, is the same
        assert slow[r] == bwd[r]


# ---------------------------------------------------------------------------------------
# zigzag and allgather at P=1024, and the columnar passes against the op-by-op rules
# ---------------------------------------------------------------------------------------
def zigzag_need(world_size: int, n_docs: int, local_len: int = 1024) -> torch.Tensor:
    """Tile map of causal & document over the zigzag layout (rank r holds chunks r and
    2P-1-r): the chunk-level map of :func:`document_need`, folded onto ranks."""
    P = world_size
    chunks = document_need(2 * P, n_docs, local_len // 2)          # [2P, 2P] chunk tiles
    owner = torch.cat([torch.arange(P), torch.arange(P).flip(0)])   # chunk -> rank
    need = torch.zeros(P, P, dtype=torch.int64)
    i, j = chunks.nonzero().unbind(1)
    need.index_put_((owner[i], owner[j]), torch.ones(len(i), dtype=torch.int64), accumulate=True)
    return need > 0


def _cols(programs):
    tab = ProgramTable.of(programs)
    return tab.kind, tab.rank, tab.a, tab.b, tab.c


def test_zigzag_on_a_thousand_documents_at_1024_ranks_checks_and_reverses_on_columns():
    need = zigzag_need(P, 1000)
    n_tiles = int(need.sum())
    assert 2 * P < n_tiles < 6 * P            # a band on the early chunks and one on the late
    fwd = schedules.zigzag().programs(P, need)
    assert fwd[0].table is not None
    check(fwd, need=need)
    kind, rank, a, b, c = _cols(fwd)
    hops = np.sort((rank[kind == S_] * P + c[kind == S_]) * P + b[kind == S_])  # src, dst, chunk
    # a kv chunk goes around the ring to the last rank that needs it: far for the late chunks
    assert len(hops) > P * (P - 1) // 2
    count = np.bincount(a[kind == C_] * P + b[kind == C_], minlength=P * P).reshape(P, P)
    assert np.array_equal(count, need.numpy().astype(np.int64))      # every tile once
    keep = reverse(fwd, kv="keep")
    check(keep, need=need, backward=True, kv="keep")
    assert len(keep[0].table) == len(fwd[0].table)        # one adjoint per op, nothing more
    bwd = reverse(fwd)
    assert bwd[0].table is not None
    check(bwd, need=need, backward=True)
    bkind, brank, ba, bb, bc = _cols(bwd)
    dkv = (bkind == S_) & (ba == FAMILY_CODE[Family.DKV])
    grads = np.sort((bc[dkv] * P + brank[dkv]) * P + bb[dkv])    # dkv goes back hop by hop
    assert np.array_equal(grads, hops)
    g = bkind == G_
    count = np.bincount(ba[g] * P + bb[g], minlength=P * P).reshape(P, P)
    assert np.array_equal(count, need.numpy().astype(np.int64))
    # each rank gets a remote kv it computes with again exactly once, before it needs it
    moved = (bkind == S_) & (ba == FAMILY_CODE[Family.KV])
    got = np.unique(bc[moved] * P + bb[moved], return_counts=True)       # (rank, chunk)
    remote = np.unique((brank * P + bb)[g & (brank != bb)])
    assert got[1].max() == 1 and np.isin(remote, got[0]).all()
    assert len(bwd[0].table) == len(fwd[0].table) + 2 * int(moved.sum())
    r = P // 3                                 # one rank's program, built from the columns
    assert bwd[r].steps[0].index >= 0 and all(isinstance(op, (GradCompute, Send, Recv))
                                              for _, op in bwd[r].ops())


def test_allgather_on_a_thousand_documents_at_1024_ranks_reverses_to_reduce_scatter():
    need = zigzag_need(P, 1000)
    fwd = schedules.allgather().programs(P, need)
    check(fwd, need=need)
    assert tiles(fwd, Compute) == collections.Counter(
        {tuple(ij): 1 for ij in need.nonzero().tolist()})
    gathers = [(t, op) for prog in fwd for t, op in prog.ops() if isinstance(op, Collective)]
    received = sum(len(op.received(prog.rank)) for prog in fwd for _, op in prog.ops()
                   if isinstance(op, Collective))
    assert received == int(need.sum()) - int(need.diagonal().sum())   # only what is needed
    bwd = reverse(fwd)
    check(bwd, need=need, backward=True)
    colls = collections.Counter(op.kind for prog in bwd for _, op in prog.ops()
                                if isinstance(op, Collective))
    # every gather becomes a reduce-scatter, and comes again to bring kv back for the backward
    assert colls == {"RS": len(gathers), "AG": len(gathers)}
    assert tiles(bwd, GradCompute) == tiles(fwd, Compute)


def _random_tree_hops(P: int, gen: torch.Generator) -> dict:
    """Each kv chunk reaches every other rank once, from a random rank that already has it,
    at a random later step (several sends of one rank may share a step)."""
    hops = {}
    for j in range(P):
        arrival = {j: 0}
        hs = []
        for dst in torch.randperm(P, generator=gen).tolist():
            if dst == j:
                continue
            holders = sorted(arrival)
            src = holders[int(torch.randint(len(holders), (), generator=gen))]
            t = arrival[src] + int(torch.randint(3, (), generator=gen))
            hs.append(schedules.Hop(t, src, dst))
            arrival[dst] = t + 1
        hops[j] = hs
    return hops


def test_columnar_lower_reverse_and_check_equal_the_op_by_op_rules_on_random_maps():
    gen = torch.Generator().manual_seed(11)
    for case in range(40):
        n = 2 + case % 8
        need = torch.rand(n, n, generator=gen) < [0.3, 0.6, 1.0][case % 3]
        hops = schedules.ring_hops(n) if case % 2 else _random_tree_hops(n, gen)
        fwd = schedules.lower(n, hops, need=need)
        plain = [Program(p.rank, p.steps) for p in schedules.lower(n, hops)]
        slow_fwd = oracle.prune(plain, need)
        assert fwd[0].table is not None
        assert list(fwd) == slow_fwd
        check(fwd, need=need)
        check(slow_fwd, need=need)
        assert ProgramTable.of(slow_fwd).digest() == ProgramTable.of(fwd).digest()
        for kv in ("resend", "keep"):
            bwd = reverse(fwd, kv=kv)
            assert bwd == oracle.reverse(slow_fwd, kv=kv)
            check(bwd, need=need, backward=True, kv=kv)
            oracle.check(bwd, need=need, backward=True, kv=kv)
