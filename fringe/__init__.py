"""fringe: context-parallel attention for any FlexAttention mask_mod.

Schedules are data, the backward is derived from the forward by rule, and one
interpreter runs them on the virtual mesh or over torch.distributed.
"""
from __future__ import annotations

from . import layout as layout, masks as masks, ops as ops, schedules as schedules
from . import simulate as simulate
from .layout import DEFAULT_BLOCK_SIZE as DEFAULT_BLOCK_SIZE, Layout as Layout
from .plan import Plan as Plan, PlanStats as PlanStats, plan as plan

__version__ = "0.1.0"

__all__ = ["DEFAULT_BLOCK_SIZE", "Layout", "Plan", "PlanStats", "layout", "masks", "ops",
           "plan", "schedules", "simulate"]
