"""How :func:`fringe.plan` resolves ``schedules.auto()``: plan every candidate that runs,
predict each with the cost model, keep the fastest, and record why.

The plan layer (it asks the cost model, which sits below it); :func:`fringe.plan` calls
:func:`resolve` with a function that plans one schedule for the call at hand, so this module
never imports the plan (``tests/test_layers.py`` holds the order).

The rule, in one place:

* **candidates** (:func:`candidates`), in one fixed order: ring, zigzag, striped, balanced,
  allgather, ulysses, then ``compose:OUTER+INNER:K`` for OUTER in (zigzag, ring, balanced),
  INNER in (ulysses, zigzag), K in (2, 4, 8) with K < P and P % K == 0 (K = P would be the inner
  schedule alone). A candidate that cannot run is listed with the reason and never planned:
  the registry's rule (:func:`~fringe.schedules.registry.why_not`: world size, group size,
  head divisibility for the shape's H and G). That is the cheap bound, applied before any
  planning: no compose form below P = 4, no Ulysses split the heads do not allow. Nothing
  else is pruned: at P=8, S=8192 the whole search (18 candidates) plans and simulates in
  ~0.26 s on one core, inside the cost target (``tests/test_auto.py`` measures it).
* **prediction**: each candidate is planned exactly as the call asked (mask, S, P, block size,
  kv policy, kernel, ...) and simulated on the hardware with the shape
  (:func:`fringe.cost.simulate.simulate`); a candidate whose layout refuses the sizes (zigzag
  needs S % (2 P block) == 0) is listed with the planner's message.
* **memory**: a candidate whose predicted peak bytes on some rank
  (:attr:`fringe.cost.simulate.Prediction.memory`: resident q, k, v, out and gradients plus
  the received buffers alive at once) exceed the hardware's ``memory_bytes`` cannot run: it
  is listed with both numbers and never picked (a hardware with ``memory_bytes=None`` states
  no limit).
* **layer kinds** (:func:`resolve_kinds`, what ``fringe.hf.plans`` asks): where several kinds
  of attention layer share one layout, a candidate plans every kind, and its predicted step
  time is the sum over the kinds of (the kind's step time x its number of layers); bytes and
  balance are summed per rank the same way, memory is the largest of the kinds'. One plan is
  one kind with weight 1.
* **pick**: the least predicted step time (forward + backward) among those that can run;
  predictions within a relative :data:`TIE` of the least are ties, broken by the candidate's
  name (its spec), so that every rank picks the same one from the same constants.
* **constants**: a preset, or a :class:`Hardware` every rank shares; one that this process
  measured for itself (``fringe.cost.calibrate.calibrate()``, named ``"this"``) is refused:
  ranks that measure apart can choose apart. ``fringe.cost.calibrate.shared()`` measures once
  and gives every rank the same constants (named :data:`SHARED`).
"""
from __future__ import annotations

import dataclasses
import time
from typing import Callable, Sequence

import numpy as np

from tabulate import tabulate

from .cost.hardware import HARDWARE, PER_RANK, SHARED, Hardware, Shape, get_hardware
from .cost.simulate import simulate
from .runtime.contract import PlanLike
from .schedules import registry
from .schedules.auto import Auto
from .schedules.base import AUTO, COMPOSE, Schedule

__all__ = ["CALIBRATION_SHAPES", "Candidate", "Choice", "TIE", "candidates", "resolve",
           "resolve_kinds"]

#: Relative difference of predicted step times below which two candidates tie (broken by name).
TIE = 1e-9
#: The single schedules auto compares, in the order it visits them.
SINGLE = ("ring", "zigzag", "striped", "balanced", "allgather", "ulysses")
#: The 2D forms: ``compose:OUTER+INNER:K`` for each outer, inner and K (< P, dividing P).
COMPOSE_OUTERS = ("zigzag", "ring", "balanced")
COMPOSE_INNERS = ("ulysses", "zigzag")
GROUP_SIZES = (2, 4, 8)
#: The shape each preset's constants were measured or quoted for (``Hardware.shape``: ``cpu``
#: what :func:`fringe.cost.calibrate.calibrate` times by default; the H100 presets
#: FlashAttention-3's head dim 128 in bfloat16, on the Llama-3-like default :class:`Shape`).
CALIBRATION_SHAPES = {name: hw.shape for name, hw in HARDWARE.items()}
#: For a :class:`Hardware` that records no shape (``shape=None``): calibrate's default.
OWN_SHAPE = Shape(heads=8, kv_heads=8, head_dim=64, dtype="float32")
#: Presets whose constants were measured on the machine they describe; the others are datasheet
#: and paper numbers never checked on a GPU.
MEASURED = ("cpu",)


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One row of the search.

    Attributes:
        name: the candidate's spec (``"zigzag"``, ``"compose:zigzag+ulysses:2"``), or its
            display name for a schedule no registered name builds.
        step_s: predicted seconds of forward + backward; None when it was not planned.
        forward_s / backward_s: the two halves.
        forward_bytes: the most bytes one rank sends in the forward.
        balance: max / mean compute per rank.
        memory_bytes: the predicted peak bytes of the busiest rank.
        parts: with several layer kinds, each kind's predicted step time (one layer), in the
            order of :attr:`Choice.kinds`; ``step_s`` is their sum weighted by layer count.
        excluded: why it cannot run (not planned, or planned and over the memory), or None.
    """

    name: str
    step_s: float | None = None
    forward_s: float | None = None
    backward_s: float | None = None
    forward_bytes: float | None = None
    balance: float | None = None
    memory_bytes: float | None = None
    parts: tuple[float, ...] = ()
    excluded: str | None = None

    @property
    def runs(self) -> bool:
        """Planned, simulated, and within the memory: it may be picked."""
        return self.step_s is not None and self.excluded is None


@dataclasses.dataclass(frozen=True)
class Choice:
    """What ``schedules.auto()`` compared and chose (``plan.choice``; :meth:`table` is what
    :meth:`fringe.Plan.explain` prints).

    Attributes:
        winner: the chosen candidate's name.
        candidates: every candidate, in the order visited.
        hardware: the constants used.
        shape: the shape predicted for, and ``shape_from``: where it came from.
        source: where the constants come from, in words.
        why: why the winner won, in words.
        reused: for ``auto(reuse=plan)``: the schedule planned again (the table is then the
            earlier search's, or empty if that plan has none); None after a search.
        search_s: wall seconds the search took (planning and simulating every candidate).
        kinds: with several layer kinds (``fringe.hf.plans``), ``(kind, number of layers)``
            for each, in the order of :attr:`Candidate.parts`; empty for one plan.
        searched: the call the search predicted for (mask, S, P, block), which a reused
            choice's table describes, not the reusing call's; empty when unknown.
    """

    winner: str
    candidates: tuple[Candidate, ...]
    hardware: Hardware
    shape: Shape
    shape_from: str
    source: str
    why: str
    reused: str | None = None
    search_s: float = 0.0
    kinds: tuple[tuple[str, int], ...] = ()
    searched: str = ""

    def ranked(self) -> list[Candidate]:
        """The candidates that can run, fastest first (ties by name), then those that cannot
        (planned ones first, fastest first; then the ones never planned, in visiting order)."""
        def fastest(cs):
            return sorted(cs, key=lambda c: (c.step_s, c.name))
        return (fastest(c for c in self.candidates if c.runs)
                + fastest(c for c in self.candidates if c.step_s is not None and not c.runs)
                + [c for c in self.candidates if c.step_s is None])

    def table(self, title: str = "") -> str:
        """The candidates with their predictions, the winner and why, and the constants."""
        rows, left = [], []
        won = next((c for c in self.candidates if c.name == self.winner), None)
        # a tie is within TIE of the least (what resolve_kinds broke by name), not of the winner
        least = min((c.step_s for c in self.candidates if c.runs), default=None)
        for c in self.ranked():
            if not c.runs:
                left.append(f"  {c.name}: {c.excluded}")
                continue
            if c is won:
                note = "chosen"
            else:
                slower = c.step_s / won.step_s - 1 if won is not None else float("nan")
                note = f"{slower:+.1%}" + (" (tie)" if c.step_s <= least * (1 + TIE)
                                           else "")
            rows.append([c.name, f"{c.step_s * 1e3:.4g}", f"{c.forward_s * 1e3:.4g}",
                         f"{c.backward_s * 1e3:.4g}", f"{c.forward_bytes / 1e6:.4g}",
                         f"{c.balance:.3f}", f"{c.memory_bytes / 1e6:.4g}"]
                        + [f"{x * 1e3:.4g}" for x in c.parts] + [note])
        sh = self.shape
        lines = [f"schedules.auto() chose {self.winner}" + (f" · {title}" if title else "")]
        if self.reused is not None:
            lines.append(f"reused the choice of an earlier plan ({self.reused}): planned it "
                         f"again with no search" + (
                             "; the table and why are that search's"
                             + (f", predicted for {self.searched}" if self.searched else "")
                             if rows else "; that plan kept no table"))
        if rows:
            lines.append(tabulate(rows, headers=["candidate", "step ms", "fwd ms", "bwd ms",
                                                 "fwd MB/rank", "balance", "mem MB/rank"]
                                  + [f"{k} ms" for k, _ in self.kinds] + ["vs chosen"],
                                  disable_numparse=True))
        if left:
            lines.append("cannot run here:")
            lines.extend(left)
        lines.append(f"why: {self.why}")
        if not (self.reused is not None and not self.candidates):    # no search to describe
            lines.append(f"constants: {self.source}")
            lines.append(f"shape: B={sh.batch} H={sh.heads} G={sh.kv_heads} D={sh.head_dim} "
                         f"{sh.dtype} ({self.shape_from})")
        if self.kinds:
            lines.append("layer kinds sharing one layout, one schedule for all: step = "
                         + " + ".join(f"{n} x {k}" for k, n in self.kinds)
                         + " (each kind's column: one layer of it)")
        if self.reused is None:
            n = sum(c.step_s is not None for c in self.candidates)
            mem = (f"{self.hardware.memory_bytes / 1e9:.4g} GB per rank" if
                   self.hardware.memory_bytes is not None else "not stated by the hardware")
            lines.append(f"search: {n} planned and simulated, {len(self.candidates) - n} "
                         f"not planned, {self.search_s:.2f} s; step: forward + backward of "
                         f"{'every attention layer' if self.kinds else 'one attention layer'};"
                         f" fwd MB/rank: the most one rank sends forward; balance: max/mean "
                         f"compute per rank; mem MB/rank: predicted peak of the busiest rank "
                         f"(memory: {mem})")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()


def source_of(hw: Hardware) -> str:
    """Where ``hw``'s constants come from, in words."""
    if hw.name == SHARED:
        return f"calibration shared by every rank: {hw.source}"
    if HARDWARE.get(hw.name) == hw:
        if hw.name in MEASURED:
            return f"preset {hw.name!r} calibrated on {hw.source}"
        return (f"preset {hw.name!r}: {hw.source}; GPU presets never checked on a GPU "
                f"(datasheet and paper numbers)")
    return f"Hardware {hw.name!r} given by the caller: {hw.source}"


def _shape(marker: Auto, hw: Hardware, num_heads: int | None) -> tuple[Shape, str]:
    if marker.shape is not None:
        if not isinstance(marker.shape, Shape):
            raise TypeError(f"schedules.auto(shape=) takes a fringe.cost.hardware.Shape or None, "
                            f"got {type(marker.shape).__name__}")
        if num_heads is not None and marker.shape.heads != num_heads:
            raise ValueError(f"schedules.auto(shape=...) has H={marker.shape.heads} but "
                             f"fringe.plan(num_heads={num_heads}): give the same H to both (or "
                             f"leave shape= out to predict for H=G={num_heads})")
        return marker.shape, "given: auto(shape=)"
    preset = HARDWARE.get(hw.name) == hw
    base = hw.shape if hw.shape is not None else OWN_SHAPE
    what = (f"the calibration shape of preset {hw.name!r}" if preset
            else "the shape its constants were measured for" if hw.shape is not None
            else "the default shape of calibrate() (the Hardware records none)")
    if num_heads is None:
        return base, what
    return (dataclasses.replace(base, heads=num_heads, kv_heads=num_heads),
            f"{what}, H=G={num_heads} from fringe.plan(num_heads=); pass auto(shape=) for GQA")


def candidates(world_size: int, *, heads: int | None = None, kv_heads: int | None = None,
               given: tuple | None = None) -> list[tuple[str, Schedule | None, str | None]]:
    """``(name, schedule, None)`` for each candidate that can run, ``(name, None, reason)`` for
    each that cannot, in the order auto visits them (see the module docstring).

    ``given``: spec strings or schedules instead of the default list (checked by the same
    rule; a schedule no registered name builds is taken as it is).
    """
    if given is None:
        names = list(SINGLE) + [f"{COMPOSE}:{o}+{i}:{k}" for o in COMPOSE_OUTERS
                                for i in COMPOSE_INNERS for k in GROUP_SIZES
                                if k < world_size and world_size % k == 0]
    else:
        names = list(given)
    out = []
    for item in names:
        if isinstance(item, Schedule):
            if item.spec is None:            # a schedule of the caller's own: no rule to ask
                out.append((item.name, item, None))
                continue
            item = registry.spec(item)
        name = registry.canonical(item)      # unknown or malformed specs raise, listing valid
        sched = registry.get(name)
        if sched.kind == AUTO:
            raise ValueError("schedules.auto(candidates=) cannot list auto itself")
        why = registry.why_not(name, world_size=world_size, heads=heads, kv_heads=kv_heads)
        out.append((name, None, why) if why else (name, sched, None))
    seen = [n for n, _, _ in out]
    twice = sorted({n for n in seen if seen.count(n) > 1})
    if twice:      # the search keys plans and ties by name: one name, one candidate
        raise ValueError(f"schedules.auto(candidates=) lists {twice} more than once (a spec "
                         f"and a schedule of that spec, or two schedules of one name): give "
                         f"each candidate once, hand-made schedules each a name of their own")
    return out


def resolve(marker: Auto, plan_one: Callable[[Schedule], PlanLike], *, world_size: int,
            num_heads: int | None) -> PlanLike:
    """The plan :func:`fringe.plan` returns for ``marker`` (see the module docstring), with
    the :class:`Choice` in ``plan.cache.auto``: :func:`resolve_kinds` for one layer kind.

    Args:
        marker: ``schedules.auto(...)``.
        plan_one: plans one schedule exactly as the caller's :func:`fringe.plan` call asked.
        world_size, num_heads: P, and H when the call gave it.

    Raises:
        ValueError: no candidate can be planned (the first one's reason), none fits in the
            memory, per-rank calibration, or a bad option.
    """
    return resolve_kinds(marker, lambda s: [plan_one(s)], world_size=world_size,
                         num_heads=num_heads)[0]


def resolve_kinds(marker: Auto, plan_kinds: Callable[[Schedule], Sequence[PlanLike]],
                  kinds: Sequence[tuple[str, int]] = (), *, world_size: int,
                  num_heads: int | None) -> list[PlanLike]:
    """One schedule for several kinds of attention layer that share a layout: the plans of
    the candidate with the least predicted step time summed over the kinds, each weighted by
    its number of layers (see the module docstring); every plan gets the one :class:`Choice`
    in ``plan.cache.auto``.

    Args:
        marker: ``schedules.auto(...)``.
        plan_kinds: plans one schedule for every kind, in the order of ``kinds`` (over one
            layout, as the caller shares it).
        kinds: ``(kind, number of layers)`` for each kind; empty: one plan of weight 1.
        world_size, num_heads: P, and H when the call gave it.

    Raises:
        ValueError: as :func:`resolve`.
    """
    weights = [int(n) for _, n in kinds] or [1]
    if any(w < 1 for w in weights):
        raise ValueError(f"every layer kind needs at least one layer, got {list(kinds)}")
    if marker.reuse is not None:
        prev = marker.reuse
        ps = list(plan_kinds(prev.schedule))
        old = getattr(prev, "choice", None)
        name = old.winner if old is not None else _name(prev.schedule)
        if old is not None:
            choice = dataclasses.replace(old, reused=name)
        else:
            choice = Choice(name, (), get_hardware("cpu"), CALIBRATION_SHAPES["cpu"],
                            shape_from="none: no search", source="none: no search",
                            why="auto(reuse=plan) plans plan.schedule again; the earlier plan "
                                "keeps no choice (it was not made by schedules.auto(), or it is "
                                "a copy)", reused=name)
        for p in ps:
            p.cache.auto = choice
        return ps
    t0 = time.perf_counter()
    hw = get_hardware(marker.hardware)
    if hw.name == PER_RANK:
        raise ValueError(
            "schedules.auto(hardware=<a Hardware named 'this'>) is refused: it was measured by "
            "fringe.cost.calibrate.calibrate() for this process alone, and ranks that measure "
            "apart can choose different schedules. Measure once for every rank: hw = "
            "fringe.cost.calibrate.shared(group=group, path='calib.json') on every rank "
            "(rank 0 measures or loads the file and broadcasts), then schedules.auto("
            "hardware=hw); or use a preset ('cpu', 'h100-nvlink', 'h100-ib')")
    shape, shape_from = _shape(marker, hw, num_heads)
    rows: list[Candidate] = []
    plans: dict[str, list[PlanLike]] = {}
    failed: list[tuple[str, ValueError]] = []
    for name, sched, why in candidates(world_size, heads=shape.heads, kv_heads=shape.kv_heads,
                                       given=marker.candidates):
        if why is not None:
            rows.append(Candidate(name, excluded=why))
            continue
        try:
            ps = list(plan_kinds(sched))
        except ValueError as e:              # the planner refuses these sizes: say so
            failed.append((name, e))
            rows.append(Candidate(name, excluded=_one_line(e)))
            continue
        c = _predict(name, ps, weights, hw, shape, several=bool(kinds))
        rows.append(c)
        if c.runs:
            plans[name] = ps                 # kept only while it can still win
            best = min(r.step_s for r in rows if r.runs)
            step = {r.name: r.step_s for r in rows}
            plans = {n: q for n, q in plans.items() if step[n] <= best * (1 + TIE)}
    ran = [c for c in rows if c.runs]
    if not ran:
        over = sorted((c for c in rows if c.step_s is not None),
                      key=lambda c: (c.memory_bytes, c.name))
        if over:
            c = over[0]
            raise ValueError(f"schedules.auto(): no candidate fits in the memory of hardware "
                             f"{hw.name!r} ({hw.memory_bytes / 1e9:.4g} GB per rank); the "
                             f"least, {c.name}, needs {c.memory_bytes / 1e9:.4g} GB on its "
                             f"busiest rank: use more ranks (world_size), a shorter sequence "
                             f"or a smaller batch, or a Hardware with more memory_bytes")
        if failed:
            name, e = failed[0]
            raise ValueError(f"schedules.auto(): no candidate could be planned; the first, "
                             f"{name}, says: {e}") from e
        raise ValueError(f"schedules.auto(): no candidate can run at P={world_size} with "
                         f"H={shape.heads}, G={shape.kv_heads}: "
                         + "; ".join(f"{c.name}: {c.excluded}" for c in rows))
    best = min(c.step_s for c in ran)
    tied = sorted(c.name for c in ran if c.step_s <= best * (1 + TIE))
    winner = tied[0]
    choice = Choice(winner, tuple(rows), hw, shape, shape_from, source_of(hw),
                    _why(winner, tied, ran), search_s=time.perf_counter() - t0,
                    kinds=tuple((str(k), int(n)) for k, n in kinds),
                    searched=_sizes(plans[winner][0]))
    for p in plans[winner]:
        p.cache.auto = choice
    return plans[winner]


def _predict(name: str, ps: Sequence[PlanLike], weights: Sequence[int], hw: Hardware,
             shape: Shape, *, several: bool) -> Candidate:
    """One candidate's row: its plans (one per layer kind) simulated, summed per rank with
    each kind's number of layers as weight; over the hardware's memory: excluded, saying so."""
    preds = [simulate(p, hw, shape, name=name, timelines=False) for p in ps]
    step = fwd = bwd = 0.0
    sent = compute = 0
    for w, pr in zip(weights, preds):
        step += w * pr.step_s
        fwd += w * pr.forward_s
        bwd += w * pr.backward_s
        sent = sent + w * pr.totals["forward"]["sent"]
        compute = compute + w * (pr.totals["forward"]["compute"]
                                 + pr.totals["backward"]["compute"])
    mean = float(np.mean(compute))
    memory = max(float(pr.memory.max(initial=0)) for pr in preds)
    excluded = None
    if hw.memory_bytes is not None and memory > hw.memory_bytes:
        excluded = (f"predicted {memory / 1e6:.4g} MB on its busiest rank, over the "
                    f"{hw.memory_bytes / 1e6:.4g} MB per rank of hardware {hw.name!r} "
                    f"(predicted step {step * 1e3:.4g} ms)")
    return Candidate(name, step_s=step, forward_s=fwd, backward_s=bwd,
                     forward_bytes=float(np.max(sent, initial=0)),
                     balance=float(np.max(compute) / mean) if mean > 0 else 1.0,
                     memory_bytes=memory,
                     parts=tuple(pr.step_s for pr in preds) if several else (),
                     excluded=excluded)


def _why(winner: str, tied: list[str], ran: list[Candidate]) -> str:
    by = {c.name: c for c in ran}
    w = by[winner]
    if len(tied) > 1:
        return (f"least predicted step time, {w.step_s * 1e3:.4g} ms, tied within a relative "
                f"{TIE:g} with {', '.join(tied[1:])}; ties go to the first by name")
    rest = sorted((c for c in ran if c.name != winner), key=lambda c: (c.step_s, c.name))
    if not rest:
        return f"the only candidate that can run ({w.step_s * 1e3:.4g} ms predicted)"
    r = rest[0]
    return (f"least predicted step time, {w.step_s * 1e3:.4g} ms, {1 - w.step_s / r.step_s:.1%} "
            f"below the runner-up {r.name} ({r.step_s * 1e3:.4g} ms)")


def _sizes(p: PlanLike) -> str:
    """The call a plan was made for, in words (what :meth:`fringe.Plan.explain` titles)."""
    try:
        return (f"{getattr(p.mask_mod, '__name__', 'mask')} · S={p.seq_len} "
                f"P={p.world_size} block={p.block_size}")
    except AttributeError:
        return ""


def _name(s: Schedule) -> str:
    return registry.spec(s) if s.spec is not None else s.name


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split())
