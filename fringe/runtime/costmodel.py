"""The cost model's public names in one namespace (a facade over :mod:`fringe.cost`).

The cost model lives in :mod:`fringe.cost`, in layers: hardware presets and shapes
(:mod:`fringe.cost.hardware`), the tile work model (:mod:`fringe.cost.work`), the program
reader and the event simulator (:mod:`fringe.cost.programs`, :mod:`fringe.cost.simulate`),
and the tools: calibration, validation and the command line (:mod:`fringe.cost.calibrate`,
:mod:`fringe.cost.validate`, :mod:`fringe.cost.cli`). This module only re-exports their
public names for users and notebooks; no fringe module imports it (each imports the layer it
needs). ``get_hardware`` here is the tools layer's: ``"this"`` calibrates now.

>>> import fringe
>>> from fringe import masks, schedules
>>> from fringe.runtime import costmodel
>>> p = fringe.plan(schedules.zigzag(), masks.causal(), seq_len=4096, world_size=4)
>>> pred = costmodel.simulate(p, hardware="h100-nvlink")
>>> pred.forward_s < pred.backward_s, round(pred.balance, 2)
(True, 1.0)
"""
from __future__ import annotations

from ..cost.calibrate import calibrate as calibrate, get_hardware as get_hardware
from ..cost.cli import (BYTES_PER_TILE as BYTES_PER_TILE,
                        KEPT_BYTES_PER_TOKEN as KEPT_BYTES_PER_TOKEN,
                        MEMORY_FRACTION as MEMORY_FRACTION,
                        PLAN_BYTES_PER_TOKEN as PLAN_BYTES_PER_TOKEN,
                        available_memory as available_memory, check_memory as check_memory,
                        check_plan_memory as check_plan_memory, cli as cli,
                        mask_from_spec as mask_from_spec, memory_budget as memory_budget)
from ..cost.hardware import (BWD_FLOPS_PER_PAIR as BWD_FLOPS_PER_PAIR,
                             FWD_FLOPS_PER_PAIR as FWD_FLOPS_PER_PAIR, HARDWARE as HARDWARE,
                             Hardware as Hardware, Shape as Shape)
from ..cost.simulate import Prediction as Prediction, simulate as simulate
from ..cost.validate import validate as validate
from ..cost.work import (TILE_WORK_BYTES_PER_RUN as TILE_WORK_BYTES_PER_RUN,
                         TILE_WORK_BYTES_PER_TILE as TILE_WORK_BYTES_PER_TILE,
                         distinct_partial_maps as distinct_partial_maps,
                         tile_costs as tile_costs, tile_work as tile_work,
                         tile_work_bytes as tile_work_bytes)

__all__ = ["HARDWARE", "Hardware", "Prediction", "Shape", "available_memory", "calibrate",
           "check_memory", "check_plan_memory", "distinct_partial_maps", "get_hardware",
           "mask_from_spec", "memory_budget", "simulate", "tile_costs", "tile_work",
           "tile_work_bytes", "validate"]
