"""What the runtime and autograd read from a plan (:class:`PlanLike`), and the state a plan
derives and keeps for this process (:class:`PlanCache`).

A :class:`fringe.Plan` is a frozen value built by :func:`fringe.plan` (a layer above this
one): the interpreter, the engine, torch.distributed's agreement, the custom ops and the
autograd Function name what they read from it here, and check a plan with
``isinstance(plan, PlanLike)`` without importing the layer that builds it.

Derived state (positions per device, painted tile maps, digests, head shifts, the cost
model's columns) never goes into the plan's ``__dict__``: it lives in the plan's one
:class:`PlanCache` (``plan.cache``), each entry written by the module named beside it. Copies
and pickles of a plan start with an empty cache.
"""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Callable, Protocol, runtime_checkable

import torch

if TYPE_CHECKING:                       # annotations only
    from ..layout import Layout
    from ..schedules import KVPolicy, Program, Schedule


@dataclasses.dataclass(eq=False)
class PlanCache:
    """A plan's derived state, for this process only (copies and pickles get a fresh one).

    Each entry has one writer; everyone else only reads it. Tensors put here are guarded
    like the plan's own (``guarded``): an in-place edit of a cached map makes the plan's next
    call raise instead of running on it.

    Attributes:
        guarded: ``[(what, tensor, version)]`` of every tensor of the plan's state, recorded
            when the plan is built, copied or unpickled, and of each cached tensor when it is
            made. Writer: :meth:`fringe.Plan._guard` / ``Plan._cached`` (``fringe/plan.py``).
        bindings: ``[(what, records)]`` for the mask_mod and the score_mod: the identity of
            every value they read through objects the plan cannot copy (attributes, list
            items, dict entries, closure cells, live globals), recorded with ``guarded``.
            Writer: :meth:`fringe.Plan._guard` (records from ``fringe.masks._guard.guard``; an
            equal immutable scalar rebound in place is recorded by ``rebound``).
        positions: ``(rank, device) -> int64 [L]`` global positions, the tile kernels' call
            cache keys on these very tensors. Writer: ``Plan._positions``.
        tiles: ``(i, j) -> int8 [L/block, L/block]`` painted block map of a tile. Writer:
            ``Plan._tile_blocks``.
        tile_index: ``(sorted tile keys i*P+j, order)`` of the block map's rectangles. Writer:
            ``Plan._tile_index``.
        digests: ``(versions of the guarded tensors, {component: digest})``, valid while the
            versions are unchanged. Writer: :meth:`fringe.Plan.digests`.
        head_splits: the ``n`` of every ``h<i>/<n>`` buffer the programs move, sorted.
            Writer: :func:`fringe.runtime.engine.head_splits`.
        head_shift: ``offset -> (mask_mod, score_mod)`` seeing global head ``h + offset``.
            Writer: ``fringe.runtime.engine._shifted``.
        simulate: what the cost model's ``simulate`` derives from the plan independent of the
            hardware (program columns per direction and shape, tile work), so that several
            presets price one plan once. Writer: the cost model's ``simulate``.
        auto: for a plan :func:`fringe.plan` resolved from ``schedules.auto()``, the choice
            it made (``fringe._auto.Choice``: the candidates, their predictions, why the
            winner won); None for any other plan, and for a copy. Writer: ``fringe._auto``.
    """

    guarded: list | None = None
    bindings: list | None = None
    positions: dict = dataclasses.field(default_factory=dict)
    tiles: dict = dataclasses.field(default_factory=dict)
    tile_index: tuple | None = None
    digests: tuple | None = None
    head_splits: tuple[int, ...] | None = None
    head_shift: dict = dataclasses.field(default_factory=dict)
    simulate: dict = dataclasses.field(default_factory=dict)
    auto: object | None = None


class _Structural(type(Protocol)):
    """``isinstance(x, PlanLike)``: ``x`` has every member. typing's own check collects the
    members by walking the protocol's MRO on every call (~100 us on Python 3.11, and a call
    of attention checks two or three times); they are fixed, so they are listed once."""

    def __init__(cls, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        cls._members = tuple(cls.__annotations__) + tuple(
            n for n, v in vars(cls).items()
            if not n.startswith("__") and (callable(v) or isinstance(v, property)))

    def __instancecheck__(cls, obj) -> bool:
        return all(hasattr(obj, m) for m in cls._members)


@runtime_checkable
class PlanLike(Protocol, metaclass=_Structural):
    """What the runtime (``fringe/runtime/``), the custom ops (``fringe/_attention_op.py``)
    and the autograd Function (``fringe/autograd.py``) read from a plan: nothing else.

    :class:`fringe.Plan` is the one implementation; ``isinstance(x, PlanLike)`` checks that
    ``x`` has every member (a structural check, as :func:`typing.runtime_checkable` does,
    with the member list made once).
    The meaning of each member is documented on :class:`fringe.Plan`.
    """

    # what was planned
    schedule: Schedule              # .name for messages, .inner_size for a 2D mesh
    layout: Layout                  # .order: global tensors <-> rank shards (virtual mesh)
    block_size: int
    forward: tuple[Program, ...]
    backward: tuple[Program, ...]
    kv: KVPolicy
    # what the tile ops are given
    mask_mod: Callable
    score_mod: Callable | None
    scale: float | None
    kernel: str | None
    score_params: tuple
    # what a call must fit, and how it is vmapped and named to the custom op
    batch_size: int | None
    num_heads: int | None
    reads_batch: bool
    handle: torch.Tensor
    # derived state, written only by the modules PlanCache names
    cache: PlanCache

    @property
    def world_size(self) -> int: ...

    @property
    def seq_len(self) -> int: ...

    @property
    def local_len(self) -> int: ...

    def check_unchanged(self) -> None: ...

    def digests(self) -> dict[str, str]: ...

    def tile_kind(self, i: int, j: int): ...

    def _positions(self, rank: int, device=None) -> torch.Tensor: ...

    def _tile_blocks(self, i: int, j: int) -> torch.Tensor: ...
