"""The benchmark runs end to end on tiny sizes. Its figures are never compared with a clock;
the report's structure is: every row present, every figure a number in its range, and every
target verdict a whole word that agrees with the figure printed beside it."""
from __future__ import annotations

import re

import pytest

from fringe import schedules
from fringe.bench import (EXPOSED_TARGET, PLAN_BLOCKS, PLAN_HEADS, PLAN_TARGET_MB, PLAN_TARGET_S,
                          SPEEDUP_TARGET, AttnCase, check_sizes, packed_docs, run)

SMALL = AttnCase(seq_len=512, heads=2, kv_heads=1, head_dim=16, n_docs=4, block_size=32, iters=1)


def test_packed_docs_are_sorted_and_counted():
    ids = packed_docs(1000, 7, seed=0)
    assert ids.numel() == 1000 and int(ids.max()) == 6
    assert bool((ids[1:] >= ids[:-1]).all())


def _tables(text: str) -> list[tuple[str, list[str], list[list[str]]]]:
    """(title, headers, rows of cells) for each tabulate table, cut at its dashed rule."""
    lines = text.splitlines()
    tables = []
    for i, line in enumerate(lines):
        if "-" in line and set(line) <= {"-", " "}:
            spans = [m.span() for m in re.finditer(r"-+", line)]

            def cells(row: str) -> list[str]:
                return [row[a:b].strip() for a, b in spans]
            rows = []
            for row in lines[i + 1:]:
                if not row.strip():
                    break
                rows.append(cells(row))
            tables.append((lines[i - 2], cells(lines[i - 1]), rows))
    return tables


def _agrees(verdict: str, figure: float, target: float, ok_if_at_least: bool) -> bool:
    """The verdict matches the printed figure (which is rounded to 2 decimals: at the
    boundary either verdict is right)."""
    if abs(figure - target) <= 0.005 + 1e-12:
        return verdict in ("ok", "MISS")
    ok = figure >= target if ok_if_at_least else figure <= target
    return verdict == ("ok" if ok else "MISS")


def test_bench_report_rows_figures_and_verdicts():
    text = run(world_sizes=(2,), plan_size=4096, case=SMALL, plan_world_sizes=(2,))
    tables = _tables(text)
    assert len(tables) == 2, text
    (plan_title, plan_head, plan_rows), (attn_title, attn_head, attn_rows) = tables

    assert plan_title.startswith("plan: S=4,096 tokens"), text
    assert plan_head == ["schedule", "P", "block", "seconds", "cpu s", "peak MB",
                         "empty blocks", "work max/mean", "target"]
    names = schedules.names(world_size=2, heads=PLAN_HEADS[0], kv_heads=PLAN_HEADS[1])
    assert names == schedules.names()              # at P=2 every built-in plans
    assert [(r[0], r[1], r[2]) for r in plan_rows] == \
        [(n, "2", str(bs)) for bs in PLAN_BLOCKS for n in names]
    for name, _, bs, seconds, cpu, peak, empty, balance, target in plan_rows:
        assert float(seconds) >= 0.0 and float(cpu) >= 0.0, (name, seconds, cpu)
        assert peak == "n/a" or float(peak) >= 0.0, (name, peak)
        assert empty.endswith("%") and 0.0 <= float(empty[:-1]) <= 100.0, (name, empty)
        assert float(balance) >= 1.0 - 1e-3, (name, balance)          # max/mean
        assert target in ("ok", "MISS"), (name, target)
        limit = PLAN_TARGET_S[int(bs)]
        if abs(float(seconds) - limit) > 0.005 and (peak == "n/a" or
                                                    abs(float(peak) - PLAN_TARGET_MB) > 0.5):
            ok = float(seconds) < limit and (peak == "n/a" or float(peak) < PLAN_TARGET_MB)
            assert (target == "ok") == ok, (name, seconds, peak, target)

    assert attn_title.startswith("attention fwd+bwd: S=512, H=2, G=1, D=16"), text
    assert attn_head == ["run", "P", "seconds", "vs 1-process fringe", "exposed comm fwd / bwd",
                         "target"]
    assert [r[0] for r in attn_rows] == ["1 process, dense SDPA + bool mask",
                                         "1 process, fringe (block-sparse)", "2 gloo ranks, fringe"]
    for row in attn_rows[:2]:
        assert row[1] == "1" and float(row[2]) > 0.0 and row[3:] == ["", "", ""], row
    m = re.search(r"agreement exchange \(runs on every fringe.attention call; .*\): P=2 (\S+) ms$",
                  text)
    assert m and float(m.group(1)) > 0.0, text
    _, P, seconds, speedup, exposed, target = attn_rows[2]
    assert P == "2" and float(seconds) > 0.0
    assert re.fullmatch(r"\d+\.\d\dx", speedup), speedup
    fwd, bwd = (float(x) for x in exposed.split(" / "))
    assert 0.0 <= fwd <= 1.0 and 0.0 <= bwd <= 1.0, exposed
    m = re.fullmatch(rf"speedup >= {SPEEDUP_TARGET:g}: (ok|MISS); fwd exposed <= "
                     rf"{EXPOSED_TARGET:g}: (ok|MISS)", target)
    if m is None:       # a 1-core box prints no target for P=2
        assert re.fullmatch(r"none: P=2 > 1 cores, waits include waiting for a core", target), target
    else:
        assert _agrees(m.group(1), float(speedup[:-1]), SPEEDUP_TARGET, True), target
        assert _agrees(m.group(2), fwd, EXPOSED_TARGET, False), target


@pytest.mark.parametrize("kwargs,match", [
    (dict(plan_size=100),
     r"plan_size=100 is not a positive multiple of 2\*P\*block=2\*2\*128=512 .*; use 512"),
    (dict(plan_size=4096, case=AttnCase(seq_len=500, block_size=32)),
     r"seq_len=500 is not divisible by 2\*P\*block=2\*1\*32=64; use 512"),
    (dict(plan_size=4096, world_sizes=(3,), case=AttnCase(seq_len=512, block_size=32)),
     r"2\*3\*32=192; use 576"),
    (dict(plan_size=4096, world_sizes=()), "world_sizes is empty"),
    (dict(plan_size=4096, case=AttnCase(iters=0)), "AttnCase.iters must be a positive integer"),
    (dict(plan_size=4096, case=AttnCase(heads=3, kv_heads=2)), "multiple of kv_heads=2"),
    (dict(plan_size=4096, case=AttnCase(schedule="rng", seq_len=512, block_size=32)),
     r"unknown schedule 'rng'; valid: ring, zigzag, .*ulysses"),
    (dict(plan_size=4096, world_sizes=(2, 4), case=AttnCase(
        schedule="compose:zigzag+ulysses:4", seq_len=512, heads=4, kv_heads=1, block_size=32)),
     r"cannot run on P=2 with H=4, G=1: compose:zigzag\+ulysses:4 puts 4 ranks in a group"),
])
def test_bench_rejects_sizes_it_cannot_use_before_any_work(kwargs, match):
    kwargs = dict(dict(world_sizes=(2,), case=SMALL, plan_world_sizes=(2,)), **kwargs)
    with pytest.raises(ValueError, match=match):
        check_sizes(**kwargs)
    with pytest.raises(ValueError, match=match):      # run() checks first, before planning
        run(**kwargs)
