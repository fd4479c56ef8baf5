"""fringe: context-parallel attention for any FlexAttention mask_mod.

Schedules are data, the backward is derived from the forward by rule, and one
interpreter runs them on the virtual mesh or over torch.distributed.
"""
from __future__ import annotations

from . import layout as layout, masks as masks, ops as ops, schedules as schedules
from . import launch as launch, render as render, runtime as runtime, simulate as simulate
from .api import (RunStats as RunStats, attention as attention, last_run as last_run,
                  recording as recording)
from .layout import DEFAULT_BLOCK_SIZE as DEFAULT_BLOCK_SIZE, Layout as Layout
from .plan import Plan as Plan, PlanStats as PlanStats, padded_len as padded_len, plan as plan
from .runtime.distributed import CommTimeout as CommTimeout, RankMismatch as RankMismatch
from .schedules.kv import KVPolicy as KVPolicy

__version__ = "0.1.0"

__all__ = ["CommTimeout", "DEFAULT_BLOCK_SIZE", "KVPolicy", "Layout", "Plan", "PlanStats",
           "RankMismatch", "RunStats", "attention", "last_run", "launch", "layout", "masks", "ops",
           "padded_len", "plan", "recording", "render", "runtime", "schedules", "simulate"]
