"""Plan-side passes at P=1024 ranks: lower, prune, check and reverse with no recursion.

Structure only (no timing assertions). The ``need`` tile maps are built directly, as a plan
would classify them, without planning a million tokens.
"""
from __future__ import annotations

import collections

import torch

from fringe import schedules
from fringe.schedules import Compute, GradCompute, Program, Recv, Send, check, reverse
from fringe.schedules.ir import Family, steps_of

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
    slow = reverse([Program(p.rank, p.steps) for p in fwd])                  # the op-by-op rules
    for r in (0, 1, n // 2, n - 1):         # a rank's program, built when looked at, is the same
        assert slow[r] == bwd[r]
