"""Multi-process (gloo) runs of the same plans: dense parity, bitwise parity with the
virtual mesh, agreement errors and timeouts. One worker pool per world size."""
from __future__ import annotations

import os

import pytest
import torch
from torch.testing import assert_close

import fringe
from fringe import masks, schedules
from fringe.launch import LaunchError, Workers
from fringe.ops import reference
from fringe.testing import mask_family, make_qkv, tolerances

SCHEDULES = {"ring": schedules.ring, "zigzag": schedules.zigzag, "striped": schedules.striped,
             "balanced": schedules.balanced}
MASKS = ["causal", "document", "sliding_window", "lambda"]
BLOCK = 2


def _mask(kind: str, S: int):
    return mask_family(kind, S)


def _case(P: int, name: str, mask_kind: str, seed: int, kv: str = "resend"):
    S = 2 * P * BLOCK * 3
    mask = _mask(mask_kind, S)
    plan = fringe.plan(SCHEDULES[name](), mask, seq_len=S, world_size=P, block_size=BLOCK, kv=kv)
    q, k, v = make_qkv(B=2, H=4, G=2, S=S, D=8, seed=seed)
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(seed + 1),
                       dtype=torch.float64)
    return plan, mask, q, k, v, dout


def worker_parity(rank: int, world_size: int, name: str, mask_kind: str, seed: int, kv: str):
    """Runs on every rank: distributed forward + backward on this rank's shard."""
    plan, mask, q, k, v, dout = _case(world_size, name, mask_kind, seed, kv)
    lay = plan.layout
    ql, kl, vl = (lay.shard(t, rank).requires_grad_() for t in (q, k, v))
    out = fringe.attention(ql, kl, vl, plan=plan)
    dq, dk, dv = torch.autograd.grad(out, (ql, kl, vl), lay.shard(dout, rank))
    result = dict(out=out.detach(), dq=dq, dk=dk, dv=dv, stats=fringe.last_run().summary())
    if rank == 0:   # the virtual mesh, in the same kind of process (same threads)
        qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
        sim = fringe.simulate.attention(qg, kg, vg, plan=plan)
        result["sim"] = [sim.detach(), *torch.autograd.grad(sim, (qg, kg, vg), dout)]
    return result


@pytest.fixture(scope="module")
def pools():
    opened: dict[int, Workers] = {}

    def get(P: int) -> Workers:
        if P not in opened:
            opened[P] = Workers(P, timeout_s=60).__enter__()
        return opened[P]
    yield get
    for w in opened.values():
        w.close()


@pytest.mark.parametrize("P", [2, 3, 4])
@pytest.mark.parametrize("name", sorted(SCHEDULES))
@pytest.mark.parametrize("mask_kind", MASKS)
def test_distributed_matches_dense_and_virtual_mesh(pools, P, name, mask_kind):
    seed = 7 * P + len(name) + len(mask_kind)
    kv = "keep" if (P + len(mask_kind)) % 4 == 0 else "resend"
    res = pools(P).run(worker_parity, name, mask_kind, seed, kv)
    plan, mask, q, k, v, dout = _case(P, name, mask_kind, seed, kv)
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    ref, _ = reference.attention(qg, kg, vg, mask_mod=mask)
    grads = torch.autograd.grad(ref, (qg, kg, vg), dout)
    lay = plan.layout
    for r in range(P):
        assert_close(res[r]["out"], lay.shard(ref.detach(), r), **tolerances(torch.float64))
        for what, g in zip(("dq", "dk", "dv"), grads):
            assert_close(res[r][what], lay.shard(g, r), **tolerances(torch.float64),
                         msg=lambda s: f"rank {r} {what}: {s}")
    # same interpreter, different transport: bit for bit
    sim_out, sim_dq, sim_dk, sim_dv = res[0]["sim"]
    for what, sim in (("out", sim_out), ("dq", sim_dq), ("dk", sim_dk), ("dv", sim_dv)):
        got = lay.unshard([res[r][what] for r in range(P)])
        assert torch.equal(got, sim), f"{what} differs from the virtual mesh"
    # the interpreter recorded per-step compute and wait time on every rank
    for r in range(P):
        assert res[r]["stats"]["forward"]["steps"] == len(plan.forward[r].steps)
        assert 0.0 <= res[r]["stats"]["forward"]["exposed"] <= 1.0


def worker_mismatch(rank: int, world_size: int, what: str):
    S = 2 * world_size * BLOCK * 2
    plan = fringe.plan(schedules.zigzag(), masks.causal(), seq_len=S, world_size=world_size,
                       block_size=BLOCK)
    q, k, v = make_qkv(B=1, H=2, G=2, S=S, D=4, seed=0)
    ql, kl, vl = (plan.layout.shard(t, rank) for t in (q, k, v))
    if rank == 1 and what == "dtype":
        ql, kl, vl = ql.float(), kl.float(), vl.float()
    if rank == 1 and what == "seq_len":
        ql, kl, vl = (torch.cat([t, t], dim=-2) for t in (ql, kl, vl))
    try:
        fringe.attention(ql, kl, vl, plan=plan, timeout_s=20)
    except (fringe.runtime.distributed.RankMismatch, ValueError) as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


@pytest.mark.parametrize("what,expect", [
    ("dtype", "RankMismatch: rank 1 disagrees with rank 0 on dtype"),
    # rank 1's own validation fails; the reason reaches every rank in the same exchange
    ("seq_len", "ValueError: rank 1 of 3 got invalid input"),
])
def test_rank_inconsistent_inputs_fail_on_every_rank(pools, what, expect):
    messages = pools(3).run(worker_mismatch, what)
    for msg in messages:
        assert msg.startswith(expect), msg
    if what == "seq_len":
        assert all("the plan expects local (per-rank) length" in m for m in messages), messages


def worker_dies(rank: int, world_size: int):
    S = 2 * world_size * BLOCK * 2
    plan = fringe.plan(schedules.ring(), masks.full(), seq_len=S, world_size=world_size,
                       block_size=BLOCK)
    q, k, v = make_qkv(B=1, H=2, G=2, S=S, D=4, seed=0)
    ql, kl, vl = (plan.layout.shard(t, rank) for t in (q, k, v))
    if rank == 1:
        # pass the agreement like a healthy rank, then die before sending anything
        from fringe.runtime.distributed import DistRuntime
        DistRuntime(None, timeout_s=3.0).agree(plan, ql, kl, vl)
        os._exit(3)
    fringe.attention(ql, kl, vl, plan=plan, timeout_s=3.0)
    return "finished"


def test_a_rank_that_exits_early_makes_the_others_time_out():
    with Workers(2, timeout_s=30) as w:
        with pytest.raises(LaunchError) as info:
            w.run(worker_dies)
    errors = info.value.errors
    assert errors[1][0] == "ProcessDied"
    kind, tb = errors[0]
    assert kind == "CommTimeout", tb
    assert "rank 0, step 0" in tb and "kv" in tb and "rank 1" in tb


def test_attention_without_process_group_says_what_to_do():
    plan = fringe.plan(schedules.ring(), masks.causal(), seq_len=16, world_size=2, block_size=2)
    q, k, v = make_qkv(B=1, H=1, G=1, S=8, D=4, seed=0)
    with pytest.raises(RuntimeError, match="needs an initialised process group"):
        fringe.attention(q, k, v, plan=plan)


def worker_fails(rank: int, world_size: int):
    if rank == 1:
        raise ValueError("boom on rank 1")
    return rank


def test_launch_reports_the_failing_rank():
    with pytest.raises(LaunchError, match="rank 1 failed with ValueError") as info:
        fringe.launch.run(worker_fails, world_size=2, timeout_s=30)
    assert info.value.rank == 1 and "boom on rank 1" in info.value.remote_traceback
