"""The virtual mesh: all P ranks in one process, exchanging buffers in memory.

Same interpreter as torch.distributed, no processes or threads: :func:`execute` runs the
ranks in lockstep, every rank issues a step's sends (copied into a mailbox) before any
rank waits, and waits copy the mailbox into the receive buffers. A collective is its
members' slots posted to the same mailbox, tagged by (kind, group, its order in the step).
"""
from __future__ import annotations

import torch

from .engine import Runtime


class VirtualMesh:
    """In-memory transport for P ranks driven by one process."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self._box: dict[tuple, torch.Tensor] = {}

    def issue(self, rank: int, step: int, sends: list, recvs: list, collectives: list = ()):
        for peer, name, tensor in sends:
            self._post((step, rank, peer, name), tensor, rank, step)
        seq: dict[tuple, int] = {}
        pending = list(recvs)
        for op, outs, ins in collectives:
            n = seq.get(op.group, 0)
            seq[op.group] = n + 1
            tag = (op.kind, op.group, n)
            for k, tensor in enumerate(outs):
                if tensor is not None:
                    self._post((step, rank, op.group[k], (tag, op.sends[k])), tensor, rank, step)
            for k, out in enumerate(ins):
                if out is not None:
                    pending.append((op.group[k], (tag, op.recvs[k]), out))
        return pending

    def _post(self, key, tensor, rank, step) -> None:
        if key in self._box:
            raise RuntimeError(f"rank {rank}, step {step}: {key[3]} sent twice to rank {key[2]}")
        self._box[key] = tensor.clone()

    def wait(self, rank: int, step: int, recvs) -> None:
        for peer, name, out in recvs:
            key = (step, peer, rank, name)
            what = name if isinstance(name, str) else f"{name[1]} (collective {name[0][0]}" \
                f"{list(name[0][1])} #{name[0][2]})"
            if key not in self._box:
                raise RuntimeError(f"rank {rank}, step {step}: waiting for {what} from rank "
                                   f"{peer}, which never sent it")
            src = self._box.pop(key)
            if src.shape != out.shape or src.dtype != out.dtype:
                raise RuntimeError(f"rank {rank}, step {step}: {what} from rank {peer} has shape "
                                   f"{tuple(src.shape)} {src.dtype}, expected "
                                   f"{tuple(out.shape)} {out.dtype}")
            out.copy_(src)


class VirtualRuntime(Runtime):
    """Drives every rank of a plan in this process over a :class:`VirtualMesh`."""

    def __init__(self, world_size: int) -> None:
        super().__init__(range(world_size), lambda device: VirtualMesh(world_size))
        self.world_size = world_size
