"""The interpreter and its transports (virtual mesh, torch.distributed)."""
from __future__ import annotations

from .interpreter import Pool as Pool, RankState as RankState, StepRecord as StepRecord, execute as execute
from .engine import Runtime as Runtime
from .distributed import (CommTimeout as CommTimeout, DistRuntime as DistRuntime,
                          DistTransport as DistTransport, RankMismatch as RankMismatch)
from .virtual import VirtualMesh as VirtualMesh, VirtualRuntime as VirtualRuntime

__all__ = ["CommTimeout", "DistRuntime", "DistTransport", "Pool", "RankMismatch", "RankState", "Runtime",
           "StepRecord", "VirtualMesh", "VirtualRuntime", "execute"]
