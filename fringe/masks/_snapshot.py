"""Snapshots: a planned mask (or score_mod) that does not alias the caller's tensors."""
from __future__ import annotations

import dataclasses
import functools
import types
import weakref

import numpy as np
import torch

from ._eval import _cached, _remember
from ._mask import Mask, _combined_mod


def snapshot(mask_mod):
    """An equivalent mask_mod (or score_mod) that does not alias the caller's tensors.

    A plan classifies a mask once and its tiles evaluate it later: if the mask reads a
    tensor the caller refills (``ids.copy_(next_batch_ids)``), the two would disagree. So
    :func:`fringe.plan` keeps a snapshot:

    * :class:`Mask` trees are rebuilt with snapshotted children (names, ``bh_invariant``
      preserved). Factory leaves already own copies (:func:`document` clones ``doc_ids``).
    * A plain Python function whose closure cells or defaults hold tensors is rebuilt as a
      new function (same code and globals, attributes such as ``bh_invariant`` copied)
      whose cells hold clones. Cells holding functions, Masks, ``functools.partial``
      objects, tuples, lists or dicts are snapshotted recursively; lists, dicts and numpy
      arrays are always copied (editing the caller's ``cut[0]`` or ``ids_np`` in place
      changes no plan).
    * Tensors that require grad are **not** cloned: a score_mod's learnable bias must stay
      the live parameter (its values are meant to change, and get gradients).
    * Module globals the function reads by name and that hold data (not callables, classes
      or modules; see :func:`global_data`) are snapshotted the same way: the copy reads a
      copy of its globals dict in which those names hold their snapshots (refilling or
      rebinding a module-level ``doc_ids`` or ``WINDOW`` for the next batch changes no plan).
    * Other callables (bound methods, objects with ``__call__``, functions called through a
      global name) and other objects a closure or global holds (``batch`` of ``batch.ids``)
      are returned / left as they are: those cannot be copied safely, so refilling them in
      place or rebinding their attributes still changes the mask. :func:`fringe.plan`
      guards them instead (:mod:`fringe.masks._guard`): the versions of the tensors such
      objects hold and the identity of every value in their attributes (``self.doc_ids =
      next_ids`` raises on the next call).

    Objects with nothing to copy (no tensors, arrays, lists, dicts or global data) are
    returned unchanged (the same object). Cost: one copy of each captured tensor that does
    not require grad, per call.
    """
    return _snap(mask_mod, {})


def _snap_tensor(t: torch.Tensor) -> torch.Tensor:
    return t if t.requires_grad else t.detach().clone()


def _snap(obj, memo: dict):
    key = id(obj)  # identity memo for this one call only (cycles, shared cells)
    if key in memo:
        return memo[key]
    memo[key] = obj
    out = obj
    if isinstance(obj, torch.Tensor):
        out = _snap_tensor(obj)
    elif isinstance(obj, Mask):
        out = _snap_mask(obj, memo)
    elif isinstance(obj, types.FunctionType):
        out = _snap_function(obj, memo)
    elif isinstance(obj, functools.partial):
        f = _snap(obj.func, memo)
        args = tuple(_snap(a, memo) for a in obj.args)
        kw = {k: _snap(v, memo) for k, v in obj.keywords.items()}
        if f is not obj.func or any(a is not b for a, b in zip(args, obj.args)) or \
                any(kw[k] is not obj.keywords[k] for k in kw):
            out = functools.partial(f, *args, **kw)
            _COPIES.add(out)
    elif isinstance(obj, np.ndarray):     # no version counter to guard: copy it
        out = obj.copy()
    elif type(obj) is tuple:
        items = [_snap(v, memo) for v in obj]
        if any(a is not b for a, b in zip(items, obj)):
            out = tuple(items)
    elif type(obj) is list:               # mutable: the caller may edit it, so always a copy
        out = [_snap(v, memo) for v in obj]
    elif type(obj) is dict:
        out = {k: _snap(v, memo) for k, v in obj.items()}
    memo[key] = out
    return out


def _snap_function(fn: types.FunctionType, memo: dict):
    cells = fn.__closure__ or ()
    contents = []
    for c in cells:
        try:
            contents.append(c.cell_contents)
        except ValueError:  # an empty cell (a name not yet bound in the enclosing scope)
            contents.append(_EMPTY_CELL)
    new_contents = [v if v is _EMPTY_CELL else _snap(v, memo) for v in contents]
    defaults = fn.__defaults__
    new_defaults = None if defaults is None else tuple(_snap(v, memo) for v in defaults)
    kwdefaults = fn.__kwdefaults__
    new_kwdefaults = None if kwdefaults is None else {k: _snap(v, memo) for k, v in kwdefaults.items()}
    # module globals the code reads by name (``doc_ids[q_idx]`` of a module-level tensor that
    # the training loop refills or rebinds): the copy reads a dict with those snapshotted
    # (numbers and strings too: rebinding ``WINDOW = 64`` must not reach the plan either)
    glob = fn.__globals__
    new_glob = {n: _snap(v, memo) for n, v in global_data(fn).items()}
    changed = bool(new_glob) or any(a is not b for a, b in zip(new_contents, contents)) or \
        (defaults is not None and any(a is not b for a, b in zip(new_defaults, defaults))) or \
        (kwdefaults is not None and any(new_kwdefaults[k] is not kwdefaults[k] for k in kwdefaults))
    if not changed:
        return fn
    closure = tuple(types.CellType() if v is _EMPTY_CELL else types.CellType(v) for v in new_contents)
    new = types.FunctionType(fn.__code__, {**glob, **new_glob} if new_glob else glob,
                             fn.__name__, new_defaults, closure if cells else None)
    new.__kwdefaults__ = new_kwdefaults
    new.__dict__.update(fn.__dict__)
    new.__qualname__, new.__module__, new.__doc__ = fn.__qualname__, fn.__module__, fn.__doc__
    new.__annotations__ = dict(getattr(fn, "__annotations__", {}) or {})
    _COPIES.add(new)
    hit = _cached(fn)  # same code on equal values: the same evaluation method
    if hit is not None:
        _remember(new, hit)
    return new


_EMPTY_CELL = object()
#: the functions and partials :func:`snapshot` made: their cells, defaults, globals dict and
#: the lists / dicts / tuples in them are copies only the copy holds (objects are not copied)
_COPIES: weakref.WeakSet = weakref.WeakSet()


def owns(fn) -> bool:
    """Whether ``fn`` is a copy :func:`snapshot` made (so what it holds directly is its own:
    :func:`fringe.masks._guard.guard` records no bindings there)."""
    try:
        return fn in _COPIES
    except TypeError:                   # not weak-referenceable: not a copy
        return False


def global_data(fn: types.FunctionType) -> dict:
    """The module globals ``fn`` reads by name that hold data (tensors, arrays, containers,
    objects): not callables, classes or modules, whose globals are not followed (that would
    walk the libraries they come from). Names are those of ``fn``'s code and the code nested
    in it (lambdas, comprehensions); attribute names are listed there too, and only names
    bound in ``fn.__globals__`` are kept."""
    names, todo = set(), [fn.__code__]
    while todo:
        code = todo.pop()
        names.update(code.co_names)
        todo.extend(c for c in code.co_consts if isinstance(c, types.CodeType))
    glob = fn.__globals__
    return {n: glob[n] for n in sorted(names) if n in glob and not callable(glob[n])
            and not isinstance(glob[n], types.ModuleType)}


def _snap_mask(m: Mask, memo: dict) -> Mask:
    if m.op == "leaf":
        if m.rule is not None:  # a factory leaf owns what it captured
            return m
        mod = _snap(m.mod, memo)
        return m if mod is m.mod else dataclasses.replace(m, mod=mod)
    kids = tuple(_snap(c, memo) for c in m.children)
    if all(a is b for a, b in zip(kids, m.children)):
        return m
    return dataclasses.replace(m, mod=_combined_mod(m.op, tuple(k.mod for k in kids), m.name),
                               children=kids)
