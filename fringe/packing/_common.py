"""The ignored label and the integer check every part of :mod:`fringe.packing` applies to
its inputs."""
from __future__ import annotations

import torch

#: The label that cross-entropy ignores (torch's and transformers' default ``ignore_index``).
IGNORE_INDEX = -100


def _int_tensor(x, name: str) -> torch.Tensor:
    t = torch.as_tensor(x)
    if t.dtype.is_floating_point or t.dtype == torch.bool or t.is_complex():
        raise ValueError(f"{name} must hold integers, got dtype={t.dtype}")
    return t.to(torch.int64)
