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
    """

    name: str
    layout: LayoutFn
    hops: HopsFn | None = None
    programs_fn: Callable[[int], Sequence[Program]] | None = None
    mask_aware: bool = False
    build: Callable[[int, np.ndarray | None], Sequence[Program]] | None = None

    def __post_init__(self) -> None:
        given = sum(x is not None for x in (self.hops, self.programs_fn, self.build))
        if given != 1:
            raise ValueError(f"schedule {self.name!r}: give exactly one of hops=, programs_fn= "
                             f"or build=")

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
