"""Passes over programs: lowering a communication pattern, pruning by the mask, deriving
the backward by rule, and the structural checks every schedule must pass.

Each pass is written once, with numpy on the columns of the one
:class:`~fringe.schedules.ir.ProgramTable` (programs given as op objects, hand-written or
parsed, become their table first), so a hand-written schedule gets the same pruning, checks
and backward as the built-in ones. Which buffers an op touches, and its adjoint, come from the
one rule table :data:`~fringe.schedules.ir.RULES`. Two named shortcuts for the ring chain's
shape (``_parts_ok``, ``_reverse_parts``: whole-heads computes and transfers, dense planes)
read and write the same columns and are tested against the general code. Nothing falls back to
op objects: a pass handles every table or raises naming the rank and step (``<-- ERROR
HERE``) or the shape it does not support. :mod:`fringe.testing.oracle` states the same rules
op by op, the oracle of the differential tests; no production module imports it.

Modules (private, each importing only those above it; this package re-exports the names):

* ``_keys`` — numpy helpers on integer keys (runs, distinct values, lookups, row keys);
* ``_locate`` — a fault's place in program order, and its message with ``<-- ERROR HERE``;
* ``_columns`` — family codes, tile touches, a table's general columns (``_Gen``,
  :func:`shared_columns`), :func:`gc_paused`, the dense-array limits ``DENSE_CELLS``,
  ``PLANE_CELLS``, ``MEMBER_CELLS``;
* ``_blocks`` — :class:`BlockNeed` (which blocks of each tile the mask reads) and
  :func:`covered` (the rules of transfers that move block ranges);
* ``_check`` — :func:`check` (and ``MATCH_CELLS``);
* ``_prune`` — :func:`prune` and the keep-a-move rule it shares with :func:`lower`;
* ``_lower`` — :class:`Hop`, :class:`HopTable`, :func:`lower`;
* ``_reverse`` — :func:`reverse` and :data:`KV_MODES`;
* ``_narrow`` — :func:`narrow`: the block ranges of each hop of q and kv.

The dense-array limits are settings: assigning one here (``passes.PLANE_CELLS = 0``, a
test's monkeypatch) assigns it in the module that owns it, which every pass reads at call
time.
"""
from __future__ import annotations

import sys
import types

from ..ir import ScheduleError as ScheduleError
from . import _check, _columns
from ._blocks import BlockNeed as BlockNeed, covered as covered
from ._check import MATCH_CELLS as MATCH_CELLS, _general_ok as _general_ok, check as check
from ._columns import (DENSE_CELLS as DENSE_CELLS, MEMBER_CELLS as MEMBER_CELLS,
                       PLANE_CELLS as PLANE_CELLS, _Gen as _Gen, _need_array as _need_array,
                       _table as _table, _tile_touches as _tile_touches, gc_paused as gc_paused,
                       shared_columns as shared_columns)
from ._keys import _lookup as _lookup, _row_keys as _row_keys, _unique as _unique
from ._lower import Hop as Hop, HopTable as HopTable, lower as lower
from ._prune import _general_prune as _general_prune, _keep_hops as _keep_hops, prune as prune
from ._reverse import (KV_MODES as KV_MODES, _general_reverse as _general_reverse,
                       _resend_parts as _resend_parts, _reverse_parts as _reverse_parts,
                       reverse as reverse)
from ._narrow import narrow as narrow

__all__ = ["BlockNeed", "Hop", "HopTable", "KV_MODES", "ScheduleError", "check", "covered",
           "gc_paused", "lower", "narrow", "prune", "reverse", "shared_columns"]


class _Package(types.ModuleType):
    """``fringe.schedules.passes`` itself: a setting assigned here (``passes.PLANE_CELLS = n``,
    a test's monkeypatch and its undo) reaches the module that owns it and that every pass
    reads at call time, as when the passes were one module (as :mod:`fringe.masks` does)."""

    def __setattr__(self, name: str, value) -> None:
        owner = _SETTINGS.get(name)
        if owner is not None:
            setattr(owner, name, value)
        super().__setattr__(name, value)


#: settings read at call time, by the module that owns them
_SETTINGS = {"DENSE_CELLS": _columns, "PLANE_CELLS": _columns, "MEMBER_CELLS": _columns,
             "MATCH_CELLS": _check}
sys.modules[__name__].__class__ = _Package
