"""One rank's bad input of any kind fails every rank at once, with that rank's reason.

Since fringe attention became a custom op, inputs that cannot enter the op (a q that is not
a tensor, a plan that is not a Plan, sinks that are not a tensor, a bad timeout) must still
travel through the per-call agreement exchange (DESIGN.md: "one rank's bad input fails every
rank at once with that rank's reason, instead of leaving peers to time out").
"""
from __future__ import annotations

import pytest
import torch

import fringe
from fringe import masks, schedules
from fringe.launch import Workers
from fringe.testing import make_qkv

BLOCK = 2


@pytest.fixture(scope="module")
def pool2():
    with Workers(2, timeout_s=300, threads=1) as w:
        yield w


def worker_bad(rank: int, world_size: int, what: str):
    S = 2 * world_size * BLOCK * 2
    p = fringe.plan(schedules.zigzag(), masks.causal(), seq_len=S, world_size=world_size,
                    block_size=BLOCK)
    q, k, v = (p.layout.shard(t, rank) for t in make_qkv(B=1, H=2, G=1, S=S, D=4, seed=0))
    kw = dict(plan=p, timeout_s=20)
    sinks = None
    if rank == 1:
        if what == "q list":
            q = q.tolist()
        elif what == "v None":
            v = None
        elif what == "plan layout":
            kw["plan"] = p.layout
        elif what == "sinks list":
            sinks = [0.0, 0.0]
        elif what == "sinks shape":
            sinks = torch.zeros(3, dtype=torch.float64)
        elif what == "q int":
            q = q.long()
        elif what == "q meta":
            q = q.to("meta")
        elif what == "timeout":
            kw["timeout_s"] = "5"
    try:
        fringe.attention(q, k, v, sinks=sinks, **kw)
    except Exception as e:      # noqa: BLE001 - the test reads every rank's error
        return f"{type(e).__name__}: {e}"
    return "no error"


@pytest.mark.parametrize("what,cause", [
    ("q list", "q must be a torch.Tensor"),
    ("v None", "v must be a torch.Tensor"),
    ("plan layout", "plan must be a fringe.Plan"),
    ("sinks list", "sinks must be a tensor"),
    ("sinks shape", "sinks must have shape"),
    ("q int", "float"),
    ("q meta", "device"),
    ("timeout", "timeout_s must be a"),
])
def test_one_ranks_bad_input_of_any_kind_fails_every_rank_with_its_reason(pool2, what, cause):
    msgs = pool2.run(worker_bad, what)
    for msg in msgs:
        assert msg.startswith("ValueError: rank 1 of 2 got invalid input"), msgs
        assert cause in msg, msgs


# -------------------------------------------------------------------------------------
# fringe.train: the CP ranks of one replica describe one batch, so they must give one count
# -------------------------------------------------------------------------------------
def worker_train_counts(rank: int, world_size: int, what: str):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.nn.parallel import DistributedDataParallel

    import fringe.titan
    import fringe.train
    mesh = init_device_mesh("cpu", (1, world_size), mesh_dim_names=("dp", "cp"))
    model = DistributedDataParallel(torch.nn.Linear(2, 2),
                                    process_group=fringe.train.dp_cp_mesh(mesh).get_group())
    sync = fringe.train.GradSync(model, mesh)
    try:
        if what == "local counts":      # each CP rank its own targets, not the replica's
            sync.step(num_items=5 if rank == 0 else 7)
        else:                           # titan's Plans over the dp dimension, not cp
            p = fringe.plan(schedules.zigzag(), masks.causal(), seq_len=16,
                            world_size=world_size, block_size=BLOCK)
            sync.check_plans(fringe.titan.Plans((p,), group=mesh["dp"]))
    except ValueError as e:
        return f"ValueError: {e}"
    return "no error"


@pytest.mark.parametrize("what,cause", [
    ("local counts", "num_items differs between the CP ranks"),
    ("titan plans", "make them with"),
])
def test_grad_sync_refuses_what_would_scale_gradients_wrongly(pool2, what, cause):
    msgs = pool2.run(worker_train_counts, what)
    for msg in msgs:
        assert cause in msg, msgs


def test_one_meta_tensor_among_real_ones_raises_instead_of_running_the_fake_kernel():
    S = 16
    p = fringe.plan(schedules.zigzag(), masks.causal(), seq_len=S, world_size=2,
                    block_size=BLOCK)
    q, k, v = make_qkv(B=1, H=2, G=1, S=S, D=4, seed=0)
    with pytest.raises(ValueError, match="must be on one device, got q on meta"):
        fringe.simulate.attention(q.to("meta"), k, v, plan=p)
    out = fringe.simulate.attention(q.to("meta"), k.to("meta"), v.to("meta"), plan=p)
    assert out.is_meta and out.shape == q.shape        # all on meta: shapes only, as before
