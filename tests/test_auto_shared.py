"""One calibration every rank shares (fringe.cost.calibrate.shared): rank 0 measures or loads
the file and broadcasts, every rank gets bit-identical constants and schedules.auto() picks the
same schedule on every rank; per-rank calibration stays refused, naming the fix."""
from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch

import fringe
from fringe import masks, schedules
from fringe.cost import calibrate
from fringe.cost.hardware import Hardware
from fringe.launch import run

S, P, BS = 1024, 4, 32
#: A small kernel timing (H=1, D=8, one repeat) and byte_s step (S=256): the test checks
#: sharing, not the numbers.
QUICK = dict(heads=1, head_dim=8, repeats=1, moved_len=256)


def _bits(hw: Hardware) -> tuple:
    """Every field, floats as their exact hex (``==`` on floats would let -0.0 == 0.0 pass)."""
    return tuple(v.hex() if isinstance(v, float) else v for v in dataclasses.astuple(hw))


def _pick(hw: Hardware) -> tuple:
    p = fringe.plan(schedules.auto(hardware=hw), masks.causal(), seq_len=S, world_size=P,
                    block_size=BS)
    return p.choice.winner, p.fingerprint(), tuple((c.name, c.step_s) for c in p.choice.candidates)


def worker_shared(rank: int, world_size: int, path: str, sub_path: str, bad: str) -> dict:
    import torch.distributed as dist
    torch.set_num_threads(1)
    measured = calibrate.shared(path=path, **QUICK)            # rank 0 measures, saves, sends
    loaded = calibrate.shared(path=path, **QUICK)              # rank 0 loads the file, sends
    # a group without global rank 0: its first member (global rank 1) measures and sends
    sub = dist.new_group([1, 2])
    in_sub = calibrate.shared(group=sub, path=sub_path, **QUICK) if rank in (1, 2) else None
    if rank == 0:                                              # a file only rank 0 sees, broken
        with open(bad, "w") as f:
            f.write("{not json")
    try:
        calibrate.shared(path=bad, **QUICK)
        error = None
    except ValueError as e:
        error = str(e)
    try:                                    # a folder rank 0 cannot save in: said, not measured
        calibrate.shared(path=bad + ".d/calib.json", **QUICK)
        unsaved = None
    except ValueError as e:
        unsaved = str(e)
    return dict(measured=_bits(measured), loaded=_bits(loaded), hw=measured,
                sub=None if in_sub is None else _bits(in_sub), pick=_pick(measured), error=error,
                unsaved=unsaved)


def test_ranks_share_bit_identical_constants_and_pick_the_same(tmp_path):
    path, sub_path = str(tmp_path / "calib.json"), str(tmp_path / "sub.json")
    bad = str(tmp_path / "rank0_only.json")
    res = run(worker_shared, path, sub_path, bad, world_size=3, timeout_s=180)
    first = res[0]
    for r in res:
        assert r["measured"] == first["measured"] and r["loaded"] == first["measured"]
        assert r["pick"] == first["pick"]                       # winner, plan, every prediction
    hw = first["hw"]
    assert hw.name == calibrate.SHARED and "rank 0 of 3" in hw.source
    assert "over the process group" in hw.source               # transport measured on the group
    # byte_s measured through fringe on the pair, and the source says how (explain() shows it)
    assert f"byte_s={hw.byte_s:.3g} s/B" in hw.source and "whole kv chunks" in hw.source
    assert np.isfinite(hw.byte_s) and hw.byte_s >= 0
    # the file rank 0 saved holds the same constants: a later run that loads it picks the same
    assert _bits(calibrate.load(path)) == first["measured"]
    assert _pick(calibrate.load(path)) == first["pick"]
    # the subgroup's two members agree with each other and with the file its rank 0 wrote
    assert res[0]["sub"] is None and res[1]["sub"] == res[2]["sub"] == _bits(
        calibrate.load(sub_path)) != first["measured"]
    assert "rank 0 of 2" in calibrate.load(sub_path).source
    # rank 0 could not read its file: every rank raises rank 0's reason, none waits for it
    for r in res:
        assert "rank 0 could not calibrate" in r["error"] and "is not JSON" in r["error"]
        assert "rank 0 could not calibrate" in r["unsaved"] and "does not exist" in r["unsaved"]


def test_one_process_saves_and_every_later_call_loads(tmp_path, monkeypatch):
    path = tmp_path / "calib.json"
    hw = calibrate.shared(path=path, comm=False, **QUICK)      # no process group: measure, save
    assert hw.name == calibrate.SHARED and path.exists()
    assert json.loads(path.read_text())["format"] == calibrate.FORMAT

    def no_measuring(**kw):
        raise AssertionError("shared(path=) measured although the file exists")
    monkeypatch.setattr(calibrate, "_kernels", no_measuring)
    again = calibrate.shared(path=path, comm=False, **QUICK)
    assert _bits(again) == _bits(hw) == _bits(calibrate.load(path)) and again == hw
    assert _pick(again) == _pick(hw)
    text = fringe.plan(schedules.auto(hardware=again), masks.causal(), seq_len=S,
                       world_size=P, block_size=BS).explain()
    assert "constants: calibration shared by every rank: calibrated once on rank 0" in text


def test_a_calibration_that_cannot_be_saved_is_refused_before_measuring(tmp_path,
                                                                         monkeypatch):
    def no_measuring(**kw):
        raise AssertionError("measured although the file could not be saved")
    monkeypatch.setattr(calibrate, "_kernels", no_measuring)
    with pytest.raises(ValueError, match="does not exist; create it"):
        calibrate.shared(path=tmp_path / "missing" / "calib.json", comm=False, **QUICK)


def test_per_rank_calibration_is_refused_naming_the_fix(tmp_path):
    own = calibrate.calibrate(comm=False, **QUICK)              # this process, for itself
    assert own.name == "this"
    with pytest.raises(ValueError, match=r"for this process alone.*calibrate\.shared\("):
        fringe.plan(schedules.auto(hardware=own), masks.causal(), seq_len=S, world_size=P,
                    block_size=BS)
    with pytest.raises(ValueError, match=r"calibrate\.shared\(group=group, path="):
        schedules.auto(hardware="this")
    with pytest.raises(ValueError, match="torch.distributed is not initialized"):
        calibrate.shared(group=object())
    # a file of one process's own calibration is not a shared one: shared(path=) says so
    # (it returned the Hardware named 'this', which auto then refused, blaming calibrate())
    calibrate.save(own, tmp_path / "own.json")
    with pytest.raises(ValueError, match="holds a per-process calibration"):
        calibrate.shared(path=tmp_path / "own.json", comm=False, **QUICK)
    # a file that is not a calibration says so and how to fix it
    for text, what in (("[1, 2]", "not a calibration file"),
                       (json.dumps({"format": calibrate.FORMAT, "hardware": {"name": "x"}}),
                        "missing"),
                       ("{", "is not JSON")):
        (tmp_path / "c.json").write_text(text)
        with pytest.raises(ValueError, match=what) as e:
            calibrate.load(tmp_path / "c.json")
        assert "run fringe.cost.calibrate.shared(path=...)" in str(e.value)


def test_the_cli_predicts_auto_on_this_machine_with_one_shared_calibration(tmp_path, capsys,
                                                                          monkeypatch):
    """`python -m fringe predict --hardware this --schedules auto` measures once (the shared
    calibration auto accepts, not a per-process one it refuses), or loads --calibration FILE,
    and prints why auto chose what it chose; --calibration with a preset is refused."""
    from fringe.__main__ import main
    path = tmp_path / "calib.json"
    hw = calibrate.shared(path=path, comm=False, **QUICK)       # the file a later run loads

    def no_measuring(**kw):
        raise AssertionError("--calibration FILE measured although the file exists")
    monkeypatch.setattr(calibrate, "_kernels", no_measuring)
    argv = ["predict", "--hardware", "this", "--calibration", str(path), "--schedules", "auto",
            "--world-size", str(P), "--seq-len", str(S), "--block-size", str(BS),
            "--mask", "causal", "--heads", "8", "--kv-heads", "8"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    winner = fringe.plan(schedules.auto(hardware=hw, shape=fringe.cost.hardware.Shape(
        heads=8, kv_heads=8, head_dim=128, dtype="bfloat16")), masks.causal(), seq_len=S,
        world_size=P, block_size=BS).choice.winner
    assert f"auto={winner}" in out and f"schedules.auto() chose {winner}" in out
    assert "calibration shared by every rank" in out
    assert main(["predict", "--hardware", "cpu", "--calibration", str(path),
                 "--world-size", str(P), "--seq-len", str(S)]) == 2
    assert "--calibration" in capsys.readouterr().err


@pytest.mark.parametrize("field, value", [
    ("byte_s", float("nan")), ("latency_s", float("inf")), ("call_s", float("nan")),
    ("masked", -1.0), ("causal", 0.0), ("bwd_masked", float("nan")), ("row_s", float("inf")),
    ("fwd_flops", float("inf")), ("memory_bytes", float("nan")), ("memory_bytes", -1.0),
    ("memory_bytes", "8e9"), ("byte_s", True), ("bwd_causal", "x"), ("node_size", 2.5),
    ("name", None)])
def test_a_calibration_file_edited_by_hand_is_refused_naming_the_field(tmp_path, field, value):
    """NaN, inf, a negative or zero factor, a string or a bool in a calibration file would
    predict NaN (auto crashed: IndexError) or a wrong pick (a negative masked factor): load
    refuses it, naming the field, and so does Hardware itself."""
    good = dataclasses.replace(fringe.cost.hardware.HARDWARE["cpu"], name=calibrate.SHARED)
    d = json.loads(calibrate._to_text(good))
    d["hardware"][field] = value
    path = tmp_path / "c.json"
    path.write_text(json.dumps(d))                   # json writes NaN / Infinity as Python does
    with pytest.raises(ValueError, match=rf"{field}.*run fringe\.cost\.calibrate\.shared"):
        calibrate.load(path)
    with pytest.raises(ValueError, match=field):
        dataclasses.replace(good, **{field: value})


def test_a_calibration_path_that_is_a_folder_or_unreadable_is_one_error_line(tmp_path, capsys,
                                                                           monkeypatch):
    """`--calibration DIR` (or a file that is not text) is a bad argument: exit 2 with one
    line, no traceback and nothing measured (it was an IsADirectoryError traceback)."""
    from fringe.__main__ import main

    def no_measuring(**kw):
        raise AssertionError("measured although --calibration cannot be loaded")
    monkeypatch.setattr(calibrate, "_kernels", no_measuring)
    binary = tmp_path / "calib.bin"
    binary.write_bytes(b"\xff\xfe\x00garbage")
    for path, what in ((tmp_path, "is a folder"), (binary, "is not text"),
                       (f"{tmp_path / 'new'}/", "names a folder")):
        argv = ["predict", "--hardware", "this", "--calibration", str(path), "--schedules",
                "auto", "--world-size", "2", "--seq-len", "1024", "--mask", "causal"]
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and what in err and err.count("\n") == 1
        with pytest.raises(ValueError, match=what):
            calibrate.shared(path=path, comm=False, **QUICK)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["calib.bin"]     # nothing left


def worker_settings_differ(rank: int, world_size: int, which: str) -> str | None:
    torch.set_num_threads(1)
    kw = dict(QUICK)
    kw.update({"comm": dict(comm=rank == 0), "heads": dict(heads=1 + rank),
               "moved_len": dict(moved_len=256 * (1 + rank))}[which])
    try:
        calibrate.shared(**kw)
    except ValueError as e:
        return str(e)
    return None


def test_ranks_given_different_settings_all_raise_before_measuring():
    """shared() with comm=/heads=/moved_len= differing between ranks: rank 0 waited in the
    pair measurement for a rank that never came (a gloo timeout, 30 min by default); now every
    rank raises at once, naming the setting."""
    import time
    t0 = time.perf_counter()
    for which in ("comm", "heads"):
        res = run(worker_settings_differ, which, world_size=2, timeout_s=60)
        for r in res:
            assert r is not None and "different settings" in r and which in r
    assert time.perf_counter() - t0 < 50


def test_auto_predicts_for_the_shape_the_constants_were_measured_for(tmp_path):
    """A calibration records the tensors it timed (Hardware.shape) and keeps them through its
    file; auto predicts for that shape when not given shape=, and a preset changed with
    dataclasses.replace keeps the preset's (both fell back to calibrate()'s H=8 D=64 float32,
    saying so only in explain()). A file without the shape is refused, naming the fix."""
    from fringe.cost.hardware import HARDWARE, Shape
    path = tmp_path / "calib.json"
    hw = calibrate.shared(path=path, comm=False, heads=2, head_dim=8, dtype=torch.float64,
                          repeats=1, moved_len=256)
    want = Shape(heads=2, kv_heads=2, head_dim=8, dtype="float64")
    assert hw.shape == want and calibrate.load(path).shape == want
    p = fringe.plan(schedules.auto(hardware=hw), masks.causal(), seq_len=S, world_size=P,
                    block_size=BS)
    assert p.choice.shape == want
    assert "the shape its constants were measured for" in p.explain()
    roomy = dataclasses.replace(HARDWARE["h100-ib"], memory_bytes=80e9)
    q = fringe.plan(schedules.auto(hardware=roomy), masks.causal(), seq_len=S, world_size=P,
                    block_size=BS)
    assert q.choice.shape == HARDWARE["h100-ib"].shape == Shape()
    old = json.loads(path.read_text())
    del old["hardware"]["shape"]                     # a file written before shapes were kept
    (tmp_path / "old.json").write_text(json.dumps(old))
    with pytest.raises(ValueError, match=r"missing \['shape'\].*delete it and run"):
        calibrate.load(tmp_path / "old.json")


def test_a_saved_calibration_is_readable_as_open_makes_files_and_leaves_nothing_else(
        tmp_path, monkeypatch):
    """save() writes beside the file and renames: the file gets open()'s mode (0666 less the
    umask, so other users' ranks can read it; mkstemp's 0600 hid it) and no temporary file
    stays, also when the rename fails."""
    import os
    from fringe.cost.hardware import HARDWARE
    path = tmp_path / "calib.json"
    calibrate.save(HARDWARE["cpu"], path)
    umask = os.umask(0)
    os.umask(umask)
    assert (path.stat().st_mode & 0o777) == 0o666 & ~umask
    assert [p.name for p in tmp_path.iterdir()] == ["calib.json"]
    assert calibrate.load(path) == HARDWARE["cpu"]

    def refuse(src, dst):
        raise OSError("disk full")
    monkeypatch.setattr(os, "replace", refuse)
    with pytest.raises(OSError, match="disk full"):
        calibrate.save(HARDWARE["h100-ib"], tmp_path / "other.json")
    assert [p.name for p in tmp_path.iterdir()] == ["calib.json"]


def _measure_or_load(path: str, out: str) -> None:
    """One process calling shared(path=) with no process group: writes whether it measured
    and the constants it got (exact bits) to ``out``."""
    from fringe.cost import calibrate as cal
    measured = []
    kernels = cal._kernels

    def counted(**kw):
        measured.append(1)
        return kernels(**kw)
    cal._kernels = counted
    hw = cal.shared(path=path, comm=False, **QUICK)
    with open(out, "w") as f:
        json.dump({"measured": len(measured), "bits": [str(x) for x in _bits(hw)]}, f)


def test_processes_started_together_measure_once_and_share_the_file(tmp_path):
    """shared(path=) in several processes at once, before any process group (every rank of
    a launcher): they take turns on the folder, so one measures and saves and the others load
    that file: the same constants everywhere (each measured its own before, and ranks then
    disagreed at their first attention call). No lock file is left."""
    import multiprocessing as mp
    path = tmp_path / "calib.json"
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_measure_or_load, args=(str(path), str(tmp_path / f"{i}.out")))
             for i in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        assert p.exitcode == 0
    got = [json.loads((tmp_path / f"{i}.out").read_text()) for i in range(3)]
    assert sum(g["measured"] for g in got) == 1
    assert all(g["bits"] == got[0]["bits"] for g in got)
    assert sorted(x.name for x in tmp_path.iterdir()) == ["0.out", "1.out", "2.out", "calib.json"]
