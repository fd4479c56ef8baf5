"""Handles: a 0-d int64 tensor that names a live Python object (a plan) to a custom op.

``torch.compile`` guards on the Python values a traced function reads, so an object that
changes every batch (a plan: new document ids, same shapes) would recompile every batch. A
tensor is guarded by its metadata only (shape, dtype, device), so the plan reaches fringe's
custom op as its handle, and the op looks the plan up here when it runs. The registry holds
weak references and drops an entry when its owner is collected (``weakref.finalize``).

Keys carry a random per-process prefix, so a handle carried to another process (a pickled
tensor) finds nothing instead of another plan; a plan that is copied or unpickled gets a
handle of its own.

The handle also holds its owner (an attribute of the tensor: a reference cycle, freed by the
cycle collector): autograd saves the handle for the backward, and that keeps the plan alive
for a backward that runs after the caller dropped the plan (``model(x, fringe.plan(...))``).
"""
from __future__ import annotations

import itertools
import random
import weakref

import torch

_OBJECTS: dict[int, weakref.ref] = {}
_PREFIX = random.SystemRandom().getrandbits(30) << 32     # this process's keys
_NEXT = itertools.count(1)


def new_handle(obj) -> torch.Tensor:
    """Register ``obj`` (weakly) and return its handle, a 0-d int64 CPU tensor."""
    key = _PREFIX | next(_NEXT)
    _OBJECTS[key] = weakref.ref(obj)
    weakref.finalize(obj, _OBJECTS.pop, key, None)
    handle = torch.tensor(key, dtype=torch.int64)
    handle.owner = obj          # see the module docstring: saved for backward, it keeps obj
    return handle


def resolve(handle: torch.Tensor):
    """The object a handle names.

    Raises:
        RuntimeError: the handle names nothing alive in this process.
    """
    key = int(handle)
    ref = _OBJECTS.get(key)
    obj = None if ref is None else ref()
    if obj is None:
        raise RuntimeError(f"fringe: handle {key:#x} names no live plan in this process (a handle "
                           f"tensor carried from another process, or its plan was freed); pass "
                           f"the plan itself to fringe.attention")
    return obj


def live() -> int:
    """How many registered objects are alive (tests: entries leave with their owners)."""
    return len(_OBJECTS)
