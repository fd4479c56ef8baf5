"""The cost model: symbolic runs of real programs, checked by hand and against invariants."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import fringe
from fringe import masks, schedules
from fringe.masks import BlockKind
from fringe.ops import tile as tile_ops
from fringe.runtime import costmodel
from fringe.runtime.interpreter import StepRecord
from fringe.schedules.ir import Compute, GradCompute, Send

SHAPE = costmodel.Shape(batch=1, heads=2, kv_heads=1, head_dim=4, dtype="float32")


def _calls_only(latency: float, **kw) -> costmodel.Hardware:
    """A machine where a kernel call costs 1 s, pairs cost nothing and transfers ``latency``."""
    return costmodel.Hardware("unit", "test", fwd_flops=1e30, bwd_flops=1e30, call_s=1.0,
                              bwd_call_s=2.0, latency_s=latency, bandwidth=1e30, **kw)


def _issue(pred, which):
    """Issue time of each (rank, step): the rank's clock when the step starts."""
    c, w = pred.compute[which], pred.wait[which]
    return np.cumsum(c + w, axis=1) - (c + w)


def test_two_rank_ring_by_hand():
    # ring, causal, one block per rank: r0 computes q0·kv0 and sends kv0; r1 computes q1·kv1
    # while kv0 arrives (3 s), then q1·kv0. Compute overlaps the transfer; the rest is waiting.
    p = fringe.plan(schedules.ring(), masks.causal(), seq_len=8, world_size=2, block_size=4)
    pred = costmodel.simulate(p, _calls_only(3.0), SHAPE)
    assert pred.compute["forward"].tolist() == [[1.0, 0.0], [1.0, 1.0]]
    assert pred.wait["forward"].tolist() == [[2.0, 0.0], [2.0, 0.0]]
    assert pred.forward_s == 4.0
    assert pred.active["forward"].tolist() == [[True, False], [True, True]]
    kv_bytes = 2 * 1 * 1 * 4 * 4 * 4                   # [2, B, G, L, D] float32
    assert pred.sent["forward"][0, 0] == kv_bytes and pred.recv["forward"][1, 0] == kv_bytes
    assert pred.exposed("forward") == pytest.approx(4.0 / 7.0)


def test_a_transfer_waits_for_both_ends_to_issue():
    for name in ("ring", "zigzag", "balanced"):
        ids = torch.repeat_interleave(torch.arange(3), torch.tensor([40, 8, 16]))
        p = fringe.plan(getattr(schedules, name)(), masks.causal() & masks.document(ids),
                        seq_len=64, world_size=4, block_size=4)
        lat = 0.25
        pred = costmodel.simulate(p, _calls_only(lat), SHAPE)
        for which, progs in (("forward", p.forward), ("backward", p.backward)):
            issue = _issue(pred, which)
            end = issue + pred.compute[which] + pred.wait[which]
            pos = {int(t): i for i, t in enumerate(pred.steps[which])}
            n = 0
            for prog in progs:
                for step in prog.steps:
                    for op in step.comms:
                        if isinstance(op, Send):
                            i, a, b = pos[step.index], prog.rank, op.peer
                            start = max(issue[a, i], issue[b, i])
                            assert end[a, i] >= start + lat - 1e-12
                            assert end[b, i] >= start + lat - 1e-12
                            n += 1
            assert n > 0
            # each step ends exactly when its compute or its last transfer is done
            assert (pred.wait[which] >= -1e-12).all()


def test_compute_is_the_sum_of_tile_costs_and_records_match_the_programs():
    ids = torch.repeat_interleave(torch.arange(4), torch.tensor([70, 10, 100, 76]))
    p = fringe.plan(schedules.zigzag(), masks.causal() & masks.document(ids), seq_len=256,
                    world_size=4, block_size=8)
    hw = costmodel.HARDWARE["cpu"]
    pred = costmodel.simulate(p, hw, SHAPE)
    for which, progs, cls in (("forward", p.forward, Compute),
                              ("backward", p.backward, GradCompute)):
        cost = costmodel.tile_costs(p, hw, SHAPE, backward=which == "backward")
        for prog in progs:
            want = sum(cost[op.q, op.kv] for _, op in prog.ops() if isinstance(op, cls))
            assert pred.compute[which][prog.rank].sum() == pytest.approx(want)
        recs = pred.records(which)
        assert all(isinstance(r, StepRecord) for r in recs)
        assert len(recs) == sum(len(prog.steps) for prog in progs)
        assert sum(r.tiles for r in recs) == sum(len(s.computes) for prog in progs for s in prog.steps)
    stats = p.stats(batch=1, heads=2, kv_heads=1, head_dim=4, dtype=torch.float32)
    for row in stats.rows:
        assert pred.sent["forward"][row["rank"]].sum() == row["fwd_sent"]
        assert pred.sent["backward"][row["rank"]].sum() == row["bwd_sent"]


def test_work_counts_follow_the_tile_grouping():
    # the stacked evaluation gives, map by map, the calls and pairs of fringe.ops.tile._plan
    g = torch.Generator().manual_seed(3)
    n, bs = 6, 4
    maps = torch.randint(0, 3, (12, n, n), generator=g).to(torch.int8)
    maps[3] = int(BlockKind.FULL)
    maps[4, 2:4] = int(BlockKind.EMPTY)
    got = costmodel._maps_work(maps, L=n * bs, block_size=bs, masked_ok=True)
    for m, row in zip(maps, got):
        groups = tile_ops._plan(m, Lq=n * bs, Lk=n * bs, block_size=bs)
        assert row[0] == len(groups)
        full = sum((gr.q1 - gr.q0) * (gr.k1 - gr.k0) for gr in groups
                   if bool((gr.codes == int(BlockKind.FULL)).all()))
        total = sum((gr.q1 - gr.q0) * (gr.k1 - gr.k0) for gr in groups)
        assert (row[1], row[1] + row[2] + row[3]) == (full, total)


def test_balance_and_schedules_rank_as_expected():
    m = masks.causal()
    preds = {name: costmodel.simulate(fringe.plan(getattr(schedules, name)(), m, seq_len=4096,
                                                  world_size=8), "h100-nvlink")
             for name in ("ring", "zigzag")}
    assert preds["zigzag"].balance == pytest.approx(1.0, abs=0.02)
    assert preds["ring"].balance > 1.5
    assert preds["zigzag"].forward_s < preds["ring"].forward_s
    for pred in preds.values():
        assert pred.backward_s > pred.forward_s > 0
        assert 0.0 <= pred.exposed() < 1.0
        row = pred.row()
        assert row["memory MB/rank"] > 0 and row["sent MB/rank"] > 0


def test_memory_counts_received_buffers_alive_at_once():
    p = fringe.plan(schedules.ring(), None, seq_len=64, world_size=4, block_size=4)
    pred = costmodel.simulate(p, "cpu", SHAPE)
    L = 16
    resident = (2 * SHAPE.buffer_bytes("q", L) + SHAPE.buffer_bytes("kv", L)
                + SHAPE.buffer_bytes("out", L) + SHAPE.buffer_bytes("dq", L)
                + SHAPE.buffer_bytes("dkv", L))
    extra = pred.memory - resident
    kv = SHAPE.buffer_bytes("kv", L)
    assert (extra >= kv).all() and (extra <= 8 * kv).all()


def test_hardware_between_nodes_is_slower():
    p = fringe.plan(schedules.ring(), None, seq_len=2048, world_size=16, block_size=64)
    one_node = costmodel.simulate(p, "h100-nvlink")
    ib = costmodel.simulate(p, "h100-ib")
    assert ib.forward_s > one_node.forward_s


def test_errors_say_what_to_do():
    with pytest.raises(ValueError, match="choose one of"):
        costmodel.get_hardware("tpu")
    with pytest.raises(ValueError, match="bandwidth must be > 0"):
        costmodel.Hardware("x", "test", fwd_flops=1, bwd_flops=1, call_s=0, bwd_call_s=0,
                           bandwidth=0)
    with pytest.raises(ValueError, match="multiple of kv_heads"):
        costmodel.Shape(heads=6, kv_heads=4)
    with pytest.raises(ValueError, match="document:N"):
        costmodel.mask_from_spec("docs=3", 1024)
    assert costmodel.mask_from_spec("full", 1024) is None


def test_cli_simulate_prints_a_row_per_schedule_and_writes_the_timeline(tmp_path, capsys):
    from fringe.__main__ import main
    png = tmp_path / "t.png"
    rc = main(["simulate", "--world-size", "8", "--seq-len", "8192", "--mask", "document:10",
               "--hardware", "h100-ib", "--schedules", "ring", "zigzag", "--png", str(png)])
    out = capsys.readouterr().out
    assert rc == 0
    assert "ring" in out and "zigzag" in out and "exposed comm" in out
    assert (tmp_path / "t.ring.png").stat().st_size > 1000
    assert (tmp_path / "t.zigzag.png").stat().st_size > 1000


@pytest.mark.parametrize("argv, needle", [
    (["--world-size", "0"], "positive integer"),
    (["--schedules", "spiral"], "unknown schedule"),
    (["--mask", "docs"], "--mask 'docs' is not understood"),
    (["--hardware", "abacus"], "unknown hardware"),
    (["--png", "out.jpg"], "ending in .png"),
])
def test_cli_simulate_rejects_bad_arguments(argv, needle, capsys):
    from fringe.__main__ import main
    rc = main(["simulate", "--world-size", "2", "--seq-len", "1024", *argv])  # last one wins
    assert rc == 2
    assert needle in capsys.readouterr().err


def test_columns_from_the_program_table_equal_walking_the_ops(monkeypatch):
    from fringe.schedules import ir
    ids = torch.repeat_interleave(torch.arange(3), torch.tensor([30, 20, 14]))
    p = fringe.plan(schedules.striped(), masks.causal() & masks.document(ids), seq_len=64,
                    world_size=4, block_size=4)
    fast = costmodel.simulate(p, "h100-ib", SHAPE)
    monkeypatch.setattr(ir, "ProgramTable", None)
    slow = costmodel.simulate(p, "h100-ib", SHAPE)
    for which in ("forward", "backward"):
        for field in ("compute", "wait", "sent", "recv", "tiles", "active"):
            np.testing.assert_array_equal(getattr(fast, field)[which], getattr(slow, field)[which])
    np.testing.assert_array_equal(fast.memory, slow.memory)


def test_collectives_are_refused_with_a_clear_message():
    if not hasattr(schedules, "allgather"):
        return                                   # no collective schedule in this build
    p = fringe.plan(schedules.allgather(), masks.causal(), seq_len=256, world_size=4,
                    block_size=16)
    with pytest.raises(ValueError, match="does not model Collective ops yet"):
        costmodel.simulate(p, "h100-ib")
