"""The cost model: predict per-rank timelines of a plan from its IR, with no tensors.

A package in layers; each module imports only the layers below it, and this ``__init__``
imports none of them (so that :mod:`fringe.layout` can read the bottom layer without
loading the tools):

- bottom (imports nothing of fringe above ``ops`` and ``masks``):
  :mod:`~fringe.cost.hardware` (presets, :class:`~fringe.cost.hardware.Hardware`,
  :class:`~fringe.cost.hardware.Shape`, the head-split rule) and :mod:`~fringe.cost.work`
  (the tile work model, on the one call planner of :mod:`fringe.ops.calls`);
- middle (above ``schedules``, reads only the IR): :mod:`~fringe.cost.programs` (programs as
  columns) and :mod:`~fringe.cost.simulate` (the event simulator, :class:`Prediction`);
- tools (may import ``launch``, ``bench``, ``plan``, ``render``):
  :mod:`~fringe.cost.calibrate`, :mod:`~fringe.cost.validate` and :mod:`~fringe.cost.cli`.

:mod:`fringe.runtime.costmodel` re-exports the public names for users; no fringe module
imports it.
"""
