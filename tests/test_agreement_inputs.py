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
