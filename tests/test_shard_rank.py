"""A shard cut for another CP rank than the one it runs attention as (``shard_batch(...,
rank=)`` given the dp coordinate, or a group other than the plans') must raise on every rank
of the attention group, not run the wrong tokens silently: both ranks' digests agree (one
batch), so only the shard's rank can tell."""
from __future__ import annotations

import types

import pytest
import torch

from fringe.launch import Workers

S, BLOCK = 32, 4


def worker(rank, world_size, *, wrong: bool):
    import fringe
    import fringe.hf
    from fringe import masks, packing, schedules
    ids = (torch.arange(S) % 7).unsqueeze(0)
    p = fringe.plan(schedules.zigzag(), masks.causal(), seq_len=S, world_size=world_size,
                    block_size=BLOCK)
    plans = fringe.hf.Plans((fringe.hf.LayerPlan(p),), group=None)
    shard = packing.shard_batch(ids, ids, plan=p, rank=0 if wrong else rank)
    kw = fringe.hf.model_inputs(shard, plans)
    q = torch.randn(1, 2, S // world_size, 4, dtype=torch.float64,
                    generator=torch.Generator().manual_seed(rank))
    try:
        fringe.hf.attention_forward(types.SimpleNamespace(is_causal=True), q, q, q, None,
                                    fringe=kw["fringe"])
    except Exception as e:   # noqa: BLE001 - reported to the test
        return f"{type(e).__name__}: {e}"
    return None


@pytest.fixture(scope="module")
def pool():
    with Workers(2, timeout_s=60, threads=1) as w:
        yield w


def test_shard_of_another_rank_raises_on_every_rank(pool):
    got = pool.run(worker, wrong=True)
    for r, msg in enumerate(got):
        assert msg is not None, f"rank {r} ran attention on the shard cut for rank 0"
        assert "cut for plan rank 0" in msg and "rank 1" in msg, (r, msg)


def test_right_shards_run(pool):
    assert pool.run(worker, wrong=False) == [None, None]
