"""The cost model at scale keeps the programs' int32 columns (no int64 copy of millions of
transfer rows) and widens only the products that could pass int32: forced wide everywhere, it
predicts the same numbers, bit for bit."""
from __future__ import annotations

import numpy as np
import pytest

import fringe
from fringe.cost import cli as cost_cli, programs as cost_programs, simulate as cost_simulate
from fringe.cost.hardware import Shape
from fringe.schedules import registry

SHAPE = Shape(heads=8, kv_heads=4, head_dim=64, dtype="bfloat16")


@pytest.mark.parametrize("spec", ["zigzag", "allgather", "compose:zigzag+ulysses:4"])
def test_int32_columns_predict_what_int64_ones_do(spec, monkeypatch):
    S, P = 8192, 16
    p = fringe.plan(registry.get(spec), cost_cli.mask_from_spec("document:9", S), seq_len=S,
                    world_size=P, block_size=64)
    narrow = cost_simulate.simulate(p, "h100-ib", SHAPE)
    monkeypatch.setattr(cost_simulate, "_WIDE", 0)
    monkeypatch.setattr(cost_programs, "_WIDE", 0)
    p.cache.simulate.clear()
    wide = cost_simulate.simulate(p, "h100-ib", SHAPE)
    for which in ("forward", "backward"):
        for field in ("compute", "wait", "sent", "recv", "tiles", "active"):
            np.testing.assert_array_equal(getattr(narrow, field)[which],
                                          getattr(wide, field)[which])
    np.testing.assert_array_equal(narrow.memory, wide.memory)
    assert narrow.sent["forward"].sum() > 0 and narrow.step_s > 0


def test_live_tile_work_is_the_grid_without_its_empty_tiles():
    from fringe.cost import work as cost_work
    p = fringe.plan(registry.get("zigzag"), cost_cli.mask_from_spec("document:9", 8192),
                    seq_len=8192, world_size=16, block_size=64)
    keys, work = cost_work.live_tile_work(p)
    grid = cost_work.tile_work(p).reshape(-1, 4)
    tiles = p.tiles.numpy().reshape(-1)
    np.testing.assert_array_equal(keys, np.flatnonzero(tiles != 0))
    np.testing.assert_array_equal(grid[keys], work)
    assert not grid[tiles == 0].any() and (work[:, 0] > 0).all() and len(keys) < len(tiles)


@pytest.mark.parametrize("spec", ["zigzag", "striped", "compose:zigzag+ulysses:4"])
def test_a_plan_simulated_again_predicts_what_a_fresh_one_does(spec):
    """The simulator keeps what does not depend on the hardware (the steps, the active cells
    and the live-buffer peak, derived once from the touches, which it then drops): a second
    preset on the same plan predicts, bit for bit, what that preset predicts on a fresh plan."""
    S, P = 8192, 16
    mask = cost_cli.mask_from_spec("document:9", S)

    def make():
        return fringe.plan(registry.get(spec), mask, seq_len=S, world_size=P, block_size=64)
    p = make()
    cost_simulate.simulate(p, "cpu", SHAPE)
    assert all(c.touch == () and c.static is not None
               for k, c in p.cache.simulate.items() if k != "work")
    again = cost_simulate.simulate(p, "h100-ib", SHAPE)
    fresh = cost_simulate.simulate(make(), "h100-ib", SHAPE)
    for which in ("forward", "backward"):
        for field in ("compute", "wait", "sent", "recv", "tiles", "active", "steps"):
            np.testing.assert_array_equal(getattr(again, field)[which],
                                          getattr(fresh, field)[which])
    np.testing.assert_array_equal(again.memory, fresh.memory)
    assert again.step_s == fresh.step_s > 0


@pytest.mark.parametrize("path", [dict(LIVE_DENSE_SHARE=0, LIVE_SMALL=0),
                                  dict(LIVE_DENSE_SHARE=0, LIVE_SMALL=700),
                                  dict(LIVE_DENSE_SHARE=2, LIVE_PIECE=7),
                                  dict(LIVE_DENSE_BYTES=0, LIVE_PIECE=5)])
def test_the_live_buffer_peak_is_one_answer_by_every_path(path, monkeypatch):
    """The peak of other ranks' buffers alive at once: every cell of a dense [rank, buffer]
    table binned one rank at a time, or a few ranks at a time with a shorter last block
    (zigzag at P=4,096), its live pairs in pieces (a ring on documents), or the live pairs
    compacted by a sort; whole bytes, so the same integers whatever the order of the sums."""
    S, P = 8192, 16
    for spec in ("zigzag", "compose:zigzag+ulysses:4"):
        p = fringe.plan(registry.get(spec), cost_cli.mask_from_spec("document:9", S),
                        seq_len=S, world_size=P, block_size=64)
        want = cost_simulate.simulate(p, "h100-ib", SHAPE).memory
        with monkeypatch.context() as m:
            for k, v in path.items():
                m.setattr(cost_simulate, k, v)
            p.cache.simulate.clear()
            got = cost_simulate.simulate(p, "h100-ib", SHAPE).memory
        np.testing.assert_array_equal(got, want)
        assert want.max() > 0


@pytest.mark.parametrize("cells", [0, 50])
def test_transfers_priced_a_block_of_steps_at_a_time_give_the_same_prediction(cells, monkeypatch):
    """The simulator runs a block of steps at a time (STEP_CELLS): one step a block, or
    blocks that end mid-plan, predict what one block of every step does, field by field and
    total by total (a rank sending twice in a step, collectives and the cpu preset's host
    bytes included)."""
    S, P = 8192, 16
    for spec, hw in (("zigzag", "h100-ib"), ("compose:zigzag+ulysses:4", "cpu"),
                     ("allgather", "h100-ib")):
        p = fringe.plan(registry.get(spec), cost_cli.mask_from_spec("document:9", S),
                        seq_len=S, world_size=P, block_size=64)
        want = cost_simulate.simulate(p, hw, SHAPE)
        with monkeypatch.context() as m:
            m.setattr(cost_simulate, "STEP_CELLS", cells)
            got = cost_simulate.simulate(p, hw, SHAPE)
        for which in ("forward", "backward"):
            for field in ("compute", "wait", "sent", "recv", "tiles", "active", "steps"):
                np.testing.assert_array_equal(getattr(got, field)[which],
                                              getattr(want, field)[which])
            for field, total in want.totals[which].items():
                np.testing.assert_array_equal(got.totals[which][field], total)
        assert got.step_s == want.step_s > 0


def test_totals_are_the_timelines_summed_and_need_no_timelines(monkeypatch):
    """A prediction's per-rank totals are its per-(rank, step) timelines summed over the
    steps, and a rank's end is its compute plus its waits; a prediction that keeps no
    timelines (timelines=False, or the default past TIMELINE_CELLS) gives the same totals
    and summaries bit for bit, and reading its timelines says how to keep them."""
    S, P = 8192, 16
    for spec, hw in (("zigzag", "cpu"), ("compose:zigzag+ulysses:4", "h100-ib")):
        p = fringe.plan(registry.get(spec), cost_cli.mask_from_spec("document:9", S),
                        seq_len=S, world_size=P, block_size=64)
        full = cost_simulate.simulate(p, hw, SHAPE, timelines=True)
        bare = cost_simulate.simulate(p, hw, SHAPE, timelines=False)
        with monkeypatch.context() as m:
            m.setattr(cost_simulate, "TIMELINE_CELLS", P - 1)      # one step is too many
            default = cost_simulate.simulate(p, hw, SHAPE)
        assert cost_simulate.simulate(p, hw, SHAPE).timelines.keys() == {"forward", "backward"}
        for which in ("forward", "backward"):
            t = full.totals[which]
            for field in ("compute", "wait", "sent", "recv", "tiles"):
                np.testing.assert_allclose(t[field], getattr(full, field)[which].sum(1),
                                           rtol=1e-12)
            np.testing.assert_allclose(t["end"], t["compute"] + t["wait"], rtol=1e-12)
            assert t["compute"].max() > 0 and t["sent"].max() > 0
            for pred in (bare, default):
                assert pred.totals[which].keys() == t.keys()
                for field, x in t.items():
                    np.testing.assert_array_equal(pred.totals[which][field], x)
                with pytest.raises(ValueError, match="timelines=True"):
                    pred.compute[which]
                with pytest.raises(ValueError, match="timelines=True"):
                    pred.records(which)
        with monkeypatch.context() as m:         # one direction's cells at the limit: both
            m.setattr(cost_simulate, "TIMELINE_CELLS", P * len(full.steps["forward"]))
            edge = cost_simulate.simulate(p, hw, SHAPE)          # directions kept, or neither
        assert set(edge.timelines) in (set(), {"forward", "backward"})
        assert list(edge.compute) == list(edge.timelines)
        assert ("backward" in edge.compute) == ("backward" in edge.timelines)
        assert "backward" not in bare.compute and not list(bare.compute)
        for pred in (bare, default):
            assert not pred.timelines
            assert (pred.step_s, pred.balance, pred.exposed(), pred.bytes_per_rank(),
                    pred.row()) == (full.step_s, full.balance, full.exposed(),
                                    full.bytes_per_rank(), full.row())


@pytest.mark.parametrize("piece", [1, 3, 1 << 20])
def test_the_transfers_step_order_is_a_stable_sort_by_step(piece, monkeypatch):
    """The simulator orders transfers by step with a counting sort a piece of rows at a
    time (int32 indices): the stable argsort, whatever the piece size."""
    monkeypatch.setattr(cost_simulate, "ORDER_PIECE", piece)
    rng = np.random.default_rng(7)
    for T, n in ((1, 5), (6, 40), (300, 2000)):
        spos = rng.integers(0, T, n).astype(np.int32)
        per_step = np.bincount(spos, minlength=T + 2)      # steps no transfer has, too
        got = cost_simulate._step_order(spos, per_step)
        assert got.dtype == np.int32
        np.testing.assert_array_equal(got, np.argsort(spos, kind="stable"))
