"""``predict`` / ``show --png`` / ``bench`` estimate their peak memory before allocating it
(issue 17 item 5): over the budget (80% of the memory available, or ``--max-memory``) they exit
2 with one ``error:`` line giving the estimate and the flag. The estimate is a model of the
dominant allocation (the cost model's tile work, quadratic in S/block), checked here against
what ``tile_work`` really allocates (numpy's allocations, traced) and the distinct maps it
really paints."""
from __future__ import annotations

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
                                          ("zigzag", "causal", 32768)])
def test_estimate_is_what_tile_work_allocates(sched, spec, S):
    p = make_plan(registry.get(sched), costmodel.mask_from_spec(spec, S), seq_len=S,
                  world_size=8, block_size=64)
    n = p.local_len // p.block_size
    tiles = torch.as_tensor(p.tiles).numpy().reshape(-1)
    part = np.flatnonzero(tiles == int(BlockKind.PARTIAL))
    painted = {p.tile_blocks(int(k) // 8, int(k) % 8).numpy().tobytes() for k in part}
    assert costmodel.distinct_partial_maps(p) == len(painted) > 0
    need, how = costmodel.tile_work_bytes(p)
    assert need == costmodel.TILE_WORK_BYTES_PER_BLOCK * len(painted) * (n + 1) * n
    assert f"{len(painted):,} distinct partial tile maps" in how
    p.forward, p.backward                                # built outside the traced window
    tracemalloc.start()
    try:
        costmodel.tile_work(p)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert 0.9 * need <= peak <= 1.25 * need, (peak, need)


def test_predict_over_the_budget_exits_2_before_allocating(capsys):
    argv = ["predict", "--world-size", "8", "--seq-len", str(1 << 21), "--schedules", "ring",
            "--max-memory", "1G"]
    tracemalloc.start()
    try:
        assert main(argv) == 2
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 256 << 20                              # the estimate, not the allocation
    err = capsys.readouterr().err
    (line,) = error_lines(err)
    assert err.strip() == line and line.startswith("error: predicting ring at S=2,097,152")
    assert "GiB" in line and "28 bytes x" in line and "budget of 1 GiB (--max-memory 1 GiB)" in line
    assert "--max-memory 9G" in line and "Traceback" not in err


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
                 "--max-memory", "64M"]) == 2
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
                        "--seq-len", "262144", "--schedules", "striped", "--max-memory", "64M"],
                       capture_output=True, text=True, cwd=ROOT, timeout=120,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 2, r.stderr
    assert r.stderr.count("error:") == 1 and "Traceback" not in r.stderr
    assert "--max-memory" in r.stderr and r.stdout == ""
