"""``auto()``: a marker schedule that :func:`fringe.plan` resolves with the cost model.

``schedules.auto()`` is not a schedule that runs: it has no layout and no programs. Given to
:func:`fringe.plan`, it plans every candidate schedule that can run (ring, zigzag, striped,
balanced, allgather, ulysses and the 2D ``compose`` forms; the rule lives in
``fringe/_auto.py``, the plan layer, since it asks the cost model), predicts each one's step
time on a hardware preset and returns the plan of the fastest, with the choice recorded
(:meth:`fringe.Plan.explain` prints it). This layer holds only the marker and its options,
as data: it imports neither the cost model nor the plan.

>>> p = fringe.plan(schedules.auto(), masks.causal(), seq_len=4096, world_size=2, block_size=256)
>>> p.schedule.name, p.choice.winner
('allgather', 'allgather')
>>> p2 = fringe.plan(schedules.auto(reuse=p), masks.causal(), seq_len=4096, world_size=2,
...                  block_size=256)         # next batch: one plan of the last winner, no search
>>> p2.schedule.name, p2.fingerprint() == p.fingerprint()
('allgather', True)

Determinism: every rank must choose the same schedule, so the choice reads only constants
every rank shares (a preset, or a :class:`~fringe.cost.hardware.Hardware` value the caller
gives every rank) and visits the candidates in one fixed order; predictions within a relative
``1e-9`` are ties, broken by name. Per-rank calibration (``hardware="this"``, or the
Hardware ``fringe.cost.calibrate.calibrate()`` returns, which measure the machine a rank runs
on and can differ between ranks) is refused: ``fringe.cost.calibrate.shared(group=,
path=)`` measures once (rank 0, broadcast over the group; or a file every rank loads) and
returns constants bit-identical on every rank; pass those as ``hardware=``.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Sequence

from .base import AUTO, Schedule, Spec

__all__ = ["Auto", "auto"]


def _unresolved(*args, **kwargs):
    raise ValueError("schedules.auto() is a marker that fringe.plan resolves to a concrete "
                     "schedule: it has no layout or programs of its own. Pass it to fringe.plan "
                     "(the plan it returns holds the chosen schedule: plan.schedule), not to "
                     "schedules.compose() or a Schedule method")


@dataclasses.dataclass(frozen=True, repr=False)
class Auto(Schedule):
    """The options of :func:`auto` (see there), carried by the marker schedule.

    Attributes:
        hardware: a preset name (``"cpu"``, ``"h100-nvlink"``, ``"h100-ib"``) or a
            :class:`fringe.cost.hardware.Hardware` value.
        shape: the :class:`fringe.cost.hardware.Shape` to predict for, or None (the preset's
            calibration shape; H from ``fringe.plan(num_heads=)`` when given).
        candidates: spec strings or schedules to choose among, or None (the default list).
        reuse: a previous plan whose schedule to plan again, with no search, or None.
    """

    hardware: Any = "cpu"
    shape: Any = None
    candidates: tuple | None = None
    reuse: Any = dataclasses.field(default=None, compare=False)


def auto(*, hardware: Any = "cpu", shape: Any = None,
         candidates: Sequence[str | Schedule] | None = None, reuse: Any = None) -> Auto:
    """Let :func:`fringe.plan` choose the schedule: the candidate with the least predicted step
    time (forward + backward of one attention layer) on ``hardware``.

    The candidates, each only where it can run (world size, group sizes, and head
    divisibility for the head count the prediction uses): ring, zigzag, striped, balanced,
    allgather, ulysses, and ``compose(outer, inner, inner_size=k)`` for outer in (zigzag,
    ring), inner in (ulysses, zigzag) and k in (2, 4, 8) a divisor of P below P. Each is
    planned with the same mask, sequence length, world size, block size, kv policy and kernel
    as the call, and simulated with :func:`fringe.cost.simulate.simulate`. auto chooses the
    schedule only. The plan returned *is* the winner's plan (same fingerprint as
    ``fringe.plan(<winner>, ...)``); ``plan.choice`` and :meth:`fringe.Plan.explain` say what
    was compared and why it won.

    Args:
        hardware: a preset name or a :class:`fringe.cost.hardware.Hardware` (the same on
            every rank). ``"this"`` is refused: see the module docstring.
        shape: the :class:`fringe.cost.hardware.Shape` to predict for; None: the preset's
            calibration shape (``cpu``: H=G=8, D=64, float32; the GPU presets: the
            defaults of ``Shape()``), with H = G = ``num_heads`` when :func:`fringe.plan` is given
            ``num_heads=`` (pass ``shape=`` for GQA). The shape's H and G decide which head
            splits are candidates: give ``num_heads=`` (or ``shape=``) so that auto never
            picks a Ulysses split your model's heads cannot make.
        candidates: spec strings (``"zigzag"``, ``"compose:zigzag+ulysses:2"``) or schedules
            to choose among instead of the default list.
        reuse: a plan an earlier ``auto`` call returned: plan its schedule again for this call
            (a new batch of the same kind), one plan and no search. Takes no other option.

    Raises:
        ValueError: ``hardware="this"``, an empty or malformed ``candidates``, ``auto`` among
            them, or ``reuse=`` with other options or not a plan.
    """
    if isinstance(hardware, str) and hardware == "this":
        raise ValueError(
            "schedules.auto(hardware='this') is refused: 'this' calibrates the machine each "
            "rank runs on, and ranks that measure different constants can choose different "
            "schedules. Calibrate once for every rank: hw = fringe.cost.calibrate.shared("
            "group=group, path='calib.json') on every rank (rank 0 measures or loads the file "
            "and broadcasts), then schedules.auto(hardware=hw); or use a preset "
            "('cpu', 'h100-nvlink', 'h100-ib')")
    if reuse is not None:
        if hardware != "cpu" or shape is not None or candidates is not None:
            raise ValueError("schedules.auto(reuse=plan) plans the previous winner "
                             "(plan.schedule) again, with no search: hardware=, shape= and "
                             "candidates= choose among candidates and do not apply; give "
                             "reuse= alone")
        s = getattr(reuse, "schedule", None)
        if not isinstance(s, Schedule) or s.kind == AUTO:
            raise ValueError(f"schedules.auto(reuse=) takes a plan an earlier fringe.plan("
                             f"schedules.auto(), ...) returned (its .schedule is the winner), "
                             f"got {type(reuse).__name__}")
        return Auto(f"auto(reuse={s.name})", layout=_unresolved, build=_unresolved, kind=AUTO,
                    reuse=reuse)
    if candidates is not None:
        if isinstance(candidates, (str, Schedule)) or not isinstance(candidates, Sequence):
            raise ValueError(f"schedules.auto(candidates=) takes a list of spec strings or "
                             f"schedules, e.g. ['zigzag', 'ring'], got {candidates!r}")
        candidates = tuple(candidates)
        bad = [c for c in candidates if not isinstance(c, (str, Schedule))
               or (isinstance(c, Schedule) and c.kind == AUTO)
               or (isinstance(c, str) and c.strip().partition(":")[0] == AUTO)]
        if not candidates or bad:
            raise ValueError(f"schedules.auto(candidates=) takes a non-empty list of spec "
                             f"strings or schedules other than auto, e.g. ['zigzag', 'ring'], "
                             f"got {list(candidates)!r}")
    default = hardware == "cpu" and shape is None and candidates is None
    return Auto(AUTO, layout=_unresolved, build=_unresolved, kind=AUTO,
                spec=Spec(AUTO) if default else None, hardware=hardware, shape=shape,
                candidates=candidates)
