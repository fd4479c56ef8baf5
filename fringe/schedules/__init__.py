"""Schedules as data: the IR, the built-in schedules, and the passes over programs."""
from __future__ import annotations

from .auto import auto as auto
from .base import Schedule as Schedule, ring_hops as ring_hops
from .collectives import allgather as allgather, compose as compose, ulysses as ulysses
from .columns import ProgramBuilder as ProgramBuilder
from .ir import (Buffer as Buffer, Collective as Collective, Compute as Compute, Family as Family,
                 GradCompute as GradCompute, Program as Program, Recv as Recv, Send as Send, Step as Step,
                 format_programs as format_programs, parse_op as parse_op,
                 parse_programs as parse_programs)
from .kv import KVPolicy as KVPolicy
from .passes import (Hop as Hop, HopTable as HopTable, KV_MODES as KV_MODES,
                     ScheduleError as ScheduleError, check as check, lower as lower, prune as prune,
                     reverse as reverse)
from .registry import get as get, names as names, register as register
from .rings import balanced as balanced, ring as ring, striped as striped, zigzag as zigzag

__all__ = ["allgather", "auto", "balanced", "Collective", "compose", "Compute", "get", "GradCompute", "Hop",
           "KV_MODES", "KVPolicy", "names", "Program", "ProgramBuilder", "Recv", "register", "Schedule",
           "ScheduleError", "Send", "Step", "check", "lower", "parse_op", "prune", "reverse",
           "ring", "ring_hops", "striped", "ulysses", "zigzag"]
