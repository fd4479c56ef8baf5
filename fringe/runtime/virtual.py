"""The virtual mesh: all P ranks in one process, exchanging buffers in memory.

Same interpreter as torch.distributed, no processes or threads: :func:`execute` runs the
ranks in lockstep, every rank issues a step's sends (copied into a mailbox) before any
rank waits, and waits copy the mailbox into the receive buffers.
"""
from __future__ import annotations

import torch

from .engine import Runtime


class VirtualMesh:
    """In-memory transport for P ranks driven by one process."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self._box: dict[tuple[int, int, int, str], torch.Tensor] = {}

    def issue(self, rank: int, step: int, sends: list, recvs: list):
        for peer, name, tensor in sends:
            key = (step, rank, peer, name)
            if key in self._box:
                raise RuntimeError(f"rank {rank}, step {step}: {name} sent twice to rank {peer}")
            self._box[key] = tensor.clone()
        return recvs

    def wait(self, rank: int, step: int, recvs) -> None:
        for peer, name, out in recvs:
            key = (step, peer, rank, name)
            if key not in self._box:
                raise RuntimeError(f"rank {rank}, step {step}: waiting for {name} from rank "
                                   f"{peer}, which never sent it")
            src = self._box.pop(key)
            if src.shape != out.shape or src.dtype != out.dtype:
                raise RuntimeError(f"rank {rank}, step {step}: {name} from rank {peer} has shape "
                                   f"{tuple(src.shape)} {src.dtype}, expected "
                                   f"{tuple(out.shape)} {out.dtype}")
            out.copy_(src)


class VirtualRuntime(Runtime):
    """Drives every rank of a plan in this process over a :class:`VirtualMesh`."""

    def __init__(self, world_size: int) -> None:
        super().__init__(range(world_size), lambda device: VirtualMesh(world_size))
        self.world_size = world_size
