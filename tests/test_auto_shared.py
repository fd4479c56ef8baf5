"""One calibration every rank shares (fringe.cost.calibrate.shared): rank 0 measures or loads
the file and broadcasts, every rank gets bit-identical constants and schedules.auto() picks the
same schedule on every rank; per-rank calibration stays refused, naming the fix."""
from __future__ import annotations

import dataclasses
import json

import pytest
import torch

import fringe
from fringe import masks, schedules
from fringe.cost import calibrate
from fringe.cost.hardware import Hardware, get_hardware
from fringe.launch import run

S, P, BS = 1024, 4, 32
#: A small kernel timing (H=1, D=8, one repeat): the test checks sharing, not the numbers.
QUICK = dict(heads=1, head_dim=8, repeats=1)


def _bits(hw: Hardware) -> tuple:
    """Every field, floats as their exact hex (``==`` on floats would let -0.0 == 0.0 pass)."""
    return tuple(v.hex() if isinstance(v, float) else v for v in dataclasses.astuple(hw))


def _pick(hw: Hardware) -> tuple:
    p = fringe.plan(schedules.auto(hardware=hw), masks.causal(), seq_len=S, world_size=P,
                    block_size=BS)
    return p.choice.winner, p.fingerprint(), tuple((c.name, c.step_s) for c in p.choice.candidates)


def worker_shared(rank: int, world_size: int, path: str, bad: str) -> dict:
    torch.set_num_threads(1)
    measured = calibrate.shared(path=path, **QUICK)            # rank 0 measures, saves, sends
    loaded = calibrate.shared(path=path, **QUICK)              # rank 0 loads the file, sends
    if rank == 0:                                              # a file only rank 0 sees, broken
        with open(bad, "w") as f:
            f.write("{not json")
    try:
        calibrate.shared(path=bad, **QUICK)
        error = None
    except ValueError as e:
        error = str(e)
    return dict(measured=_bits(measured), loaded=_bits(loaded), hw=measured,
                pick=_pick(measured), error=error)


def test_two_ranks_share_bit_identical_constants_and_pick_the_same(tmp_path):
    path, bad = str(tmp_path / "calib.json"), str(tmp_path / "rank0_only.json")
    res = run(worker_shared, path, bad, world_size=2, timeout_s=180)
    a, b = res
    assert a["measured"] == b["measured"] and a["loaded"] == b["loaded"] == a["measured"]
    hw = a["hw"]
    assert hw.name == calibrate.SHARED and "rank 0 of 2" in hw.source
    assert "over the process group" in hw.source               # transport measured on the group
    assert a["pick"] == b["pick"]                               # winner, plan and every prediction
    # the file rank 0 saved holds the same constants: a later run that loads it picks the same
    assert _bits(calibrate.load(path)) == a["measured"] and _pick(calibrate.load(path)) == a["pick"]
    # rank 0 could not read its file: every rank raises rank 0's reason, none waits for it
    for r in res:
        assert "rank 0 could not calibrate" in r["error"] and "is not JSON" in r["error"]


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


def test_per_rank_calibration_is_refused_naming_the_fix(tmp_path):
    own = dataclasses.replace(get_hardware("cpu"), name="this",
                              source="calibrated here: ...")   # what calibrate() returns
    with pytest.raises(ValueError, match=r"for this process alone.*calibrate\.shared\("):
        fringe.plan(schedules.auto(hardware=own), masks.causal(), seq_len=S, world_size=P,
                    block_size=BS)
    with pytest.raises(ValueError, match=r"calibrate\.shared\(group=group, path="):
        schedules.auto(hardware="this")
    with pytest.raises(ValueError, match="torch.distributed is not initialized"):
        calibrate.shared(group=object())
    # a file that is not a calibration says so and how to fix it
    for text, what in (("[1, 2]", "not a calibration file"),
                       (json.dumps({"format": calibrate.FORMAT, "hardware": {"name": "x"}}),
                        "missing"),
                       ("{", "is not JSON")):
        (tmp_path / "c.json").write_text(text)
        with pytest.raises(ValueError, match=what) as e:
            calibrate.load(tmp_path / "c.json")
        assert "run fringe.cost.calibrate.shared(path=...)" in str(e.value)
