"""Test data every layer may read (benchmarks, the cost model's calibration, tests, notebooks).

A leaf: it imports torch only.
"""
from __future__ import annotations

import torch

__all__ = ["packed_docs"]


def packed_docs(S: int, n_docs: int, seed: int) -> torch.Tensor:
    """doc ids [S] for ``n_docs`` random-length packed documents.

    >>> packed_docs(10, 3, seed=0).tolist()
    [0, 1, 1, 1, 1, 1, 1, 1, 1, 2]
    """
    g = torch.Generator().manual_seed(seed)
    cuts = torch.randperm(S - 1, generator=g)[:n_docs - 1].sort().values + 1
    ids = torch.zeros(S, dtype=torch.int64)
    ids[cuts] = 1
    return ids.cumsum(0)
