"""A schedule is a value: a layout plus a communication pattern.

``Schedule.programs(need)`` lowers the pattern to one forward program per rank and prunes
it by the mask's tile classification; the backward comes from
:func:`fringe.schedules.reverse`. Users build their own schedule from the same parts:

>>> from fringe import layout
>>> from fringe.schedules import Schedule, ring_hops
>>> mine = Schedule("ring-on-striped(4)",
...                 layout=lambda S, P, block_size: layout.striped(S, P, stripe=4, block_size=block_size),
...                 hops=ring_hops)
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Mapping, Sequence

import numpy as np
import torch

from ..layout import Layout
from .ir import Program, ProgramTable
from .passes import Hop, HopTable, check, gc_paused, lower, prune

LayoutFn = Callable[..., Layout]          # (seq_len, world_size, *, block_size) -> Layout
HopsFn = Callable[[int], Mapping[int, Sequence[Hop]]]

#: What a schedule is, a field set by the constructor that builds it (never read from its
#: name): the built-ins' kinds, ``"auto"`` for the marker :func:`fringe.plan` resolves to one of
#: them (:func:`~fringe.schedules.auto`), and ``"user"`` for any other schedule (the default).
KINDS = ("ring", "zigzag", "striped", "balanced", "allgather", "ulysses", "compose", "auto",
         "user")
#: Kinds that split heads, nest others or choose one; every other kind moves sequence chunks
#: (what :func:`~fringe.schedules.compose` takes as its outer schedule, or as a double ring's
#: inner).
NOT_SEQUENCE = ("ulysses", "compose", "auto")
#: The name of a :class:`Spec` of two composed schedules (``compose:OUTER+INNER:K``).
COMPOSE = "compose"
#: The kind (and registered name) of :func:`~fringe.schedules.auto`: a marker, not a schedule
#: that runs; :func:`fringe.plan` resolves it.
AUTO = "auto"


@dataclasses.dataclass(frozen=True)
class Spec:
    """How the registry builds a schedule, as a value: a registered name with its optional
    positive-integer argument, or :data:`COMPOSE` of two specs with the group size.

    ``str(spec)`` is its text (``"striped:4"``, ``"compose:zigzag+ulysses:2"``), the form
    :func:`fringe.schedules.get` parses; the registry prints specs from these fields and never
    parses a schedule's display name.

    >>> str(Spec(COMPOSE, outer=Spec("allgather", 3), inner=Spec("ulysses"), inner_size=2))
    'compose:allgather:3+ulysses:2'
    """

    name: str
    arg: int | None = None
    outer: Spec | None = None
    inner: Spec | None = None
    inner_size: int | None = None

    def __post_init__(self) -> None:
        composed = (self.outer, self.inner, self.inner_size)
        if self.name == COMPOSE:
            if not (isinstance(self.outer, Spec) and isinstance(self.inner, Spec)
                    and _positive_int(self.inner_size)) or self.arg is not None:
                raise ValueError(f"Spec({COMPOSE!r}) takes outer= and inner= specs and "
                                 f"inner_size= a positive int (no arg), got {self!r}")
        elif any(x is not None for x in composed) or not (self.arg is None or
                                                          _positive_int(self.arg)):
            raise ValueError(f"Spec({self.name!r}) takes an optional positive int arg= only "
                             f"(outer=, inner=, inner_size= are for {COMPOSE!r}), got {self!r}")

    def __str__(self) -> str:
        if self.name == COMPOSE:
            return f"{COMPOSE}:{self.outer}+{self.inner}:{self.inner_size}"
        return self.name if self.arg is None else f"{self.name}:{self.arg}"

    def names(self) -> tuple[str, ...]:
        """The registered names it uses (a compose: its parts', outer first)."""
        return (self.outer.names() + self.inner.names() if self.name == COMPOSE
                else (self.name,))


def _positive_int(n) -> bool:
    return isinstance(n, int) and not isinstance(n, bool) and n >= 1


def ring_hops(world_size: int) -> HopTable:
    """The ring: kv chunk j moves j → j+1 → ... (mod P), one hop per step.

    A :class:`HopTable` (a compact ``{chunk: [Hop, ...]}``): ``ring_hops(4)[1]`` is
    ``[Hop(0, 1, 2), Hop(1, 2, 3), Hop(2, 3, 0)]``.
    """
    return HopTable._of_ring(world_size)


@dataclasses.dataclass(frozen=True)
class Schedule:
    """A named (layout, communication pattern) pair, or a fixed list of programs.

    Args:
        name: display name.
        layout: ``layout(seq_len, world_size, block_size=...) -> Layout``.
        hops: ``hops(world_size) -> {kv_chunk: [Hop, ...]}`` (or a :class:`HopTable`); each
            chunk's hops form a tree rooted at its owner. Mutually exclusive with ``programs``.
        programs: ``programs(world_size) -> [Program]`` — hand-written forward programs
            (still pruned, checked and reversed like any other).
        mask_aware: the layout function also takes ``block_work=`` (per-q-block work of the
            mask in sequence order, from the plan's classification), as
            :func:`fringe.layout.balanced` does.
        build: ``build(world_size, need) -> [Program]`` — programs made for the mask's tile
            map (``need``: bool numpy ``[P, P]``, or None for every tile), as the collective
            schedules are (a rank gathers only what its queries need); still checked, pruned
            and reversed like any other.
        kind: what the schedule is, one of :data:`KINDS`; ``"user"`` (the default) for a
            schedule of your own. fringe's constructors set the built-in kinds, and fringe
            reads a schedule's kind only from here (a user schedule named ``"ulysses"`` or
            ``"compose(x)"`` is still a user schedule: a sequence schedule).
        inner_size: k, the ranks per inner group, for ``kind="compose"`` (and only then):
            what a 2D DeviceMesh is checked against.
        spec: the :class:`Spec` the registry builds it from (set by the built-in constructors
            and by :func:`fringe.schedules.get` for registered names), or None: no registered
            name builds it, and :func:`fringe.schedules.registry.spec` says so.
    """

    name: str
    layout: LayoutFn
    hops: HopsFn | None = None
    programs_fn: Callable[[int], Sequence[Program]] | None = None
    mask_aware: bool = False
    build: Callable[[int, np.ndarray | None], Sequence[Program]] | None = None
    kind: str = "user"
    inner_size: int | None = None
    spec: Spec | None = None

    def __post_init__(self) -> None:
        given = sum(x is not None for x in (self.hops, self.programs_fn, self.build))
        if given != 1:
            raise ValueError(f"schedule {self.name!r}: give exactly one of hops=, programs_fn= "
                             f"or build=")
        if self.kind not in KINDS:
            raise ValueError(f"schedule {self.name!r}: kind must be one of {KINDS}, got "
                             f"{self.kind!r} (leave it out for a schedule of your own: 'user')")
        if (self.kind == COMPOSE) != (self.inner_size is not None) or not (
                self.inner_size is None or _positive_int(self.inner_size)):
            raise ValueError(f"schedule {self.name!r}: inner_size (a positive int) is given for "
                             f"kind='compose' and only then, got kind={self.kind!r}, "
                             f"inner_size={self.inner_size!r}; build 2D schedules with "
                             f"schedules.compose(outer, inner, inner_size=k)")
        if self.spec is not None and not isinstance(self.spec, Spec):
            raise TypeError(f"schedule {self.name!r}: spec must be a fringe.schedules.base.Spec "
                            f"or None, got {type(self.spec).__name__}")

    @property
    def moves_sequence(self) -> bool:
        """It moves sequence chunks between ranks (every kind but ulysses, compose and auto): what
        :func:`~fringe.schedules.compose` takes as its outer schedule or a double ring's inner."""
        return self.kind not in NOT_SEQUENCE

    def make_layout(self, seq_len: int, world_size: int, *, block_size: int,
                    block_work: torch.Tensor | None = None) -> Layout:
        if self.mask_aware:
            if block_work is None:
                raise ValueError(f"schedule {self.name!r} balances the mask's work: give "
                                 f"block_work= (fringe.plan does)")
            return self.layout(seq_len, world_size, block_size=block_size, block_work=block_work)
        return self.layout(seq_len, world_size, block_size=block_size)

    def programs(self, world_size: int, need: torch.Tensor | None = None) -> list[Program]:
        """Forward programs for P ranks, pruned by ``need`` (bool [P, P]) when given."""
        if self.hops is not None:       # lowered and pruned in one pass over the hop arrays
            return lower(world_size, self.hops(world_size), need=need)
        with gc_paused():               # building many ops that all live on
            if self.build is not None:
                arr = None if need is None else np.asarray(
                    need.numpy() if isinstance(need, torch.Tensor) else need, dtype=bool)
                progs = list(self.build(world_size, arr))
            else:
                progs = list(self.programs_fn(world_size))
        if len(progs) != world_size:
            raise ValueError(f"schedule {self.name!r} gave {len(progs)} programs for "
                             f"world_size={world_size}")
        with gc_paused():               # one tuple per op: no collection scans them all
            progs = _as_table(progs)
        check(progs)          # before pruning, so errors name the steps as written
        return prune(progs, need) if need is not None else progs

    def __repr__(self) -> str:
        return f"Schedule({self.name})"


def _as_table(progs: list[Program]) -> list[Program]:
    """Programs given as op objects, as the programs of their one table, so that every pass
    after runs on columns (:meth:`ProgramTable.of` names a transfer without its partner).
    Programs out of rank order stay as they are: ``check`` names that."""
    if not progs or any(p.rank != r for r, p in enumerate(progs)):
        return progs
    tab = ProgramTable.of(progs)
    return list(tab.programs())
