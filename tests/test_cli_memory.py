"""``predict`` / ``show --png`` / ``bench`` estimate their peak memory before allocating it
(issue 17 item 5): over the budget (80% of the memory available, or ``--max-memory``) they exit
2 with one ``error:`` line giving the estimate and the flag. The estimate is a model of the
dominant allocation (the cost model's tile work: linear in the rectangles of the PARTIAL tiles,
plus the P^2 tile arrays), checked here to bound what ``tile_work`` really allocates (numpy's
allocations, traced)."""
from __future__ import annotations

import dataclasses

import os
import subprocess
import sys
import tracemalloc

import numpy as np
import pytest
import torch

from fringe.__main__ import main, memory_size
from fringe.masks import BlockKind
from fringe.plan import plan as make_plan
from fringe.runtime import costmodel
from fringe.schedules import registry

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def error_lines(err: str) -> list[str]:
    return [line for line in err.splitlines() if "error:" in line]


@pytest.mark.parametrize("sched,spec,S", [("striped", "document:40", 32768),
                                          ("zigzag", "document:40", 65536),
                                          ("ring", "window:3000", 65536),
                                          ("zigzag", "causal", 32768),
                                          ("striped", "document:1000", 262144)])
def test_estimate_bounds_what_tile_work_allocates(sched, spec, S):
    # the sparse work model allocates with the block-row runs of the PARTIAL tiles'
    # rectangles (never a dense map): the estimate counts them and bounds the traced peak
    p = make_plan(registry.get(sched), costmodel.mask_from_spec(spec, S), seq_len=S,
                  world_size=8, block_size=64)
    n = p.local_len // p.block_size
    tiles = torch.as_tensor(p.tiles).numpy().reshape(-1)
    R = p.block_map.rects.numpy()
    part = tiles[(R[:, 0] // n) * 8 + R[:, 2] // n] == int(BlockKind.PARTIAL)
    runs = int((R[part, 1] - R[part, 0]).sum())
    need, how = costmodel.tile_work_bytes(p)
    assert need == (costmodel.TILE_WORK_BYTES_PER_RUN * runs
                    + costmodel.TILE_WORK_BYTES_PER_TILE * 64) and runs > 0
    assert f"{runs:,} block-row runs of the partial tiles" in how
    p.forward, p.backward                                # built outside the traced window
    tracemalloc.start()
    try:
        costmodel.tile_work(p)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak <= need, (peak, need)


def test_predict_over_the_budget_exits_2_before_allocating(capsys):
    # striped documents at 2M tokens: one rectangle per block, ~1.1M runs (~440 MB estimated)
    argv = ["predict", "--world-size", "8", "--seq-len", str(1 << 21), "--schedules", "striped",
            "--max-memory", "200M"]
    tracemalloc.start()
    try:
        assert main(argv) == 2
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 200 << 20                              # the estimate, not the allocation
    err = capsys.readouterr().err
    (line,) = error_lines(err)
    assert err.strip() == line and line.startswith("error: predicting striped at S=2,097,152")
    assert "MiB" in line and "384 bytes x" in line and "block-row runs" in line
    assert "budget of 200 MiB (--max-memory 200 MiB)" in line
    assert "--max-memory 1G" in line and "Traceback" not in line


def test_seq_len_past_any_memory_exits_2_before_planning(capsys):
    for argv in (["predict", "--seq-len", str(1 << 40), "--world-size", "8"],
                 ["show", "--seq-len", str(1 << 40)],
                 ["bench", "--plan-size", str(1 << 40)]):
        assert main(argv) == 2
        err = capsys.readouterr().err
        (line,) = error_lines(err)
        flag = "--plan-size" if argv[0] == "bench" else "--seq-len"
        assert line.startswith(f"error: {flag} {1 << 40} would need about 48 TiB"), line
        assert f"use a smaller {flag}" in line and "--max-memory" in line


def test_show_png_over_the_budget_writes_nothing(tmp_path, capsys):
    png = tmp_path / "grid.png"
    assert main(["show", "--seq-len", "262144", "--world-size", "2", "--png", str(png),
                 "--max-memory", "16M"]) == 2        # the plan fits (12 MiB); not its timeline
    err = capsys.readouterr().err
    (line,) = error_lines(err)
    assert line.startswith("error: --png (the cost model's timeline) at S=262,144 would need")
    assert "--max-memory" in line and not png.exists()


def test_the_normal_case_still_runs(capsys):
    assert main(["predict", "--world-size", "8", "--seq-len", "65536", "--schedules", "zigzag",
                 "striped"]) == 0                      # default budget: 80% of what is free
    out = capsys.readouterr().out
    assert "zigzag" in out and "striped" in out
    assert main(["predict", "--world-size", "8", "--seq-len", "65536", "--schedules", "zigzag",
                 "--max-memory", "1G"]) == 0


def test_memory_sizes_parse_in_binary_units():
    assert memory_size("4G") == memory_size("4GB") == memory_size("4 GiB") == 4 << 30
    assert memory_size("512m") == 512 << 20 and memory_size("1.5G") == 3 << 29
    assert memory_size("1000") == 1000 and memory_size("2T") == 2 << 40


def test_over_the_budget_through_the_shell():
    r = subprocess.run([sys.executable, "-m", "fringe", "predict", "--world-size", "8",
                        "--seq-len", "262144", "--schedules", "striped", "--max-memory", "8M"],
                       capture_output=True, text=True, cwd=ROOT, timeout=120,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 2, r.stderr
    assert r.stderr.count("error:") == 1 and "Traceback" not in r.stderr
    assert "--max-memory" in r.stderr and r.stdout == ""


def test_the_estimate_counts_the_simulators_timelines_and_transfers():
    """A ring that forwards every kv chunk through nearly every rank (zigzag on many short
    documents) holds far more transfers than tiles: the check before simulate counts the
    [P, T] cells (their timelines where the prediction keeps them) and the transfer rows,
    and bounds what simulate allocates either way (traced)."""
    from fringe.cost import cli as cost_cli
    from fringe.cost.simulate import simulate
    from fringe.schedules.ir import ProgramTable
    S, P = 1 << 20, 1024                                 # (below, fixed costs of ~30 MB lead)
    p = make_plan(registry.get("zigzag"), costmodel.mask_from_spec("document:4000", S),
                  seq_len=S, world_size=P)
    cells, moves = cost_cli._timeline_size(p)
    fwd, bwd = (ProgramTable.of(x)._parts for x in (p.forward, p.backward))
    T = 1 + max(int(x[k]["step"].max()) for x in (fwd, bwd) for k in (0, 1)
                if len(x[k]["step"]))
    assert cells == P * T and moves == max(len(fwd[1]["step"]), len(bwd[1]["step"]))
    live = int((torch.as_tensor(p.tiles) != int(BlockKind.EMPTY)).sum())
    assert moves > 4 * live                              # transfers, not tiles, set the size
    work, _ = costmodel.tile_work_bytes(p)
    for keep, per_cell in ((True, cost_cli.BYTES_PER_CELL),
                           (False, cost_cli.BYTES_PER_STEP_CELL)):
        need = (work + cost_cli.BYTES_PER_TILE * live + per_cell * cells
                + cost_cli.BYTES_PER_TRANSFER * moves)
        with pytest.raises(MemoryError, match=f"{moves:,} transfers of the simulation"):
            cost_cli.check_memory(p, (need - 1, "test"), what="predicting", timelines=keep)
        cost_cli.check_memory(p, (need + cost_cli.KEPT_BYTES_PER_TOKEN * S, "test"),
                              what="predicting", timelines=keep)
        tracemalloc.start()
        try:
            pred = simulate(dataclasses.replace(p), "h100-ib", timelines=keep)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert bool(pred.timelines) == keep
        assert peak <= need, (keep, peak, need)


def test_the_cli_frees_each_schedules_plan_before_the_next(monkeypatch, capsys):
    """A plan's tables and their op views hold each other (and the plan its handle), so a
    dropped plan waits for the cycle collector: the CLI collects after each schedule, or the
    next plan is made beside the last (zigzag's 1.2 GB under balanced's at P=4,096)."""
    import gc
    import weakref
    from fringe.cost import cli as cost_cli
    from fringe.schedules.ir import ProgramTable
    tables, alive = [], []

    def spy(*args, **kw):
        alive.append([t() is not None for t in tables])
        p = make_plan(*args, **kw)
        tables.append(weakref.ref(ProgramTable.of(p.forward)))
        return p
    monkeypatch.setattr(cost_cli, "make_plan", spy)
    enabled = gc.isenabled()
    gc.disable()                             # (no collection by chance in between)
    try:
        assert main(["simulate", "--world-size", "4", "--seq-len", "512", "--mask",
                     "document:3", "--hardware", "h100-ib", "--schedules", "zigzag",
                     "ring", "balanced"]) == 0
    finally:
        if enabled:
            gc.enable()
    assert alive == [[], [False], [False, False]]
    assert "zigzag" in capsys.readouterr().out
