"""The interpreter and its transports (virtual mesh, torch.distributed)."""
from __future__ import annotations

from .interpreter import Pool as Pool, RankState as RankState, StepRecord as StepRecord, execute as execute
from .virtual import VirtualMesh as VirtualMesh, VirtualRuntime as VirtualRuntime

__all__ = ["Pool", "RankState", "StepRecord", "VirtualMesh", "VirtualRuntime", "execute"]
