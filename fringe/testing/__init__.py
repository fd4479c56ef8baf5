"""Shared test helpers: the one tolerance table, a seeded qkv factory, hypothesis strategies.

Legend: B batch · H query heads · G kv heads (H % G == 0) · S sequence · D head dim.
"""
from __future__ import annotations

import torch

__all__ = ["make_qkv", "seeds", "tolerances"]


def tolerances(dtype: torch.dtype) -> dict[str, float]:
    """``assert_close`` tolerances for comparing a kernel in ``dtype`` against the reference.

    This is the ONE place low-precision tolerances live.
    """
    if dtype == torch.float64:
        # Exactness checks: tiling / merging only reorders sums, error ~ 1e-15 * S.
        return dict(atol=1e-10, rtol=1e-10)
    if dtype == torch.float32:
        # fp32 accumulation in a different order (fused kernel vs einsum): ~1e-6 relative.
        return dict(atol=2e-5, rtol=2e-5)
    if dtype == torch.float16:
        # Inputs / outputs rounded to 10-bit mantissa (eps ~ 1e-3); accumulation is fp32.
        return dict(atol=5e-3, rtol=5e-3)
    if dtype == torch.bfloat16:
        # 7-bit mantissa (eps ~ 8e-3) on inputs and outputs; accumulation is fp32.
        return dict(atol=3e-2, rtol=3e-2)
    raise ValueError(f"no tolerances for {dtype}; use float64/float32/float16/bfloat16")


def make_qkv(*, B: int, H: int, G: int, S: int, D: int, dtype: torch.dtype = torch.float64,
             seed: int, requires_grad: bool = False, device: str | torch.device = "cpu",
             Lk: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random q ``[B, H, S, D]``, k/v ``[B, G, Lk or S, D]`` from a local ``torch.Generator``."""
    if H % G:
        raise ValueError(f"H={H} query heads is not a multiple of G={G} kv heads")
    g = torch.Generator().manual_seed(seed)
    Lk = S if Lk is None else Lk
    q = torch.randn(B, H, S, D, generator=g, dtype=torch.float64)
    k = torch.randn(B, G, Lk, D, generator=g, dtype=torch.float64)
    v = torch.randn(B, G, Lk, D, generator=g, dtype=torch.float64)
    return tuple(t.to(device=device, dtype=dtype).requires_grad_(requires_grad) for t in (q, k, v))


def seeds():
    """Hypothesis strategy for a seed (for a local ``torch.Generator``)."""
    from hypothesis import strategies as st

    return st.integers(min_value=0, max_value=2**31 - 1)
