"""Pure tile math: dense reference, tile forward/backward, lse merge, and the kernel registry.

Legend: B batch · H query heads · G kv heads (H % G == 0) · L tokens · D head dim.

A *kernel* computes one dense sub-problem (q rows x one contiguous kv range, an optional bool
mask ``[B or 1, H or 1, Lq, Lk]``, an optional score_mod on global positions)::

    kernel.forward(q, k, v, *, q_pos, kv_pos, mask, score_mod, scale) -> (out, lse)
    kernel.backward(q, k, v, out, lse, dout, *, q_pos, kv_pos, mask, score_mod, scale,
                    dlse=None, score_params=())
        -> (dq, dk, dv)            # out, lse: the GLOBAL merged ones; dlse: lse's cotangent
        -> (dq, dk, dv, dparams)   # when score_params (tensors score_mod closes over) is given
    kernel.available(device) -> (ok, reason)

A kernel that sets ``fused_calls = True`` also takes ``causal=True`` (with ``mask=None``) on
square sub-problems whose mask is exactly lower-triangular; :mod:`fringe.ops.tile` then splits
tiles into is_causal squares, unmasked FULL pieces and masked pieces (see ``tile._plan``).

Kernels: ``reference`` (einsum, any dtype / mask / score_mod) and ``sdpa`` (the fused CPU op,
falls back to ``reference`` with a reason where it cannot run; see ``fringe/ops/_fast.py``).

Semantics every kernel keeps (tested in ``tests/test_ops_semantics.py``):

- ``score_mod`` is FlexAttention's: defined per scalar (b, h, q_idx, kv_idx) and applied with
  vmap; broadcasting is the fast path only where a probe shows it agrees for that mod.
- ``dlse`` is the cotangent of the GLOBAL lse: ``ds = p * (dp - (delta - dlse))``.
- ``score_params`` are tensors the score_mod closes over; their gradients come back per call.
- A masked pair never contributes, NaN included: a NaN key stays in the rows that attend to it,
  in the forward and the backward. A masked NaN *value* inside a computed sub-problem gives NaN
  as in the dense reference (``0 * NaN``); EMPTY blocks are never read.
"""
from __future__ import annotations

from typing import Protocol

import torch

from ._fast import SDPA, SdpaKernel
from .reference import REFERENCE, ReferenceKernel, attention, check_qkv


class Kernel(Protocol):
    """One dense sub-problem's forward and backward (see the module docstring)."""

    name: str

    def available(self, device: torch.device | str | None = None) -> tuple[bool, str]: ...

    def forward(self, q, k, v, *, q_pos, kv_pos, mask=None, score_mod=None, scale): ...

    def backward(self, q, k, v, out, lse, dout, *, q_pos, kv_pos, mask=None, score_mod=None,
                 scale, dlse=None, score_params=()): ...


KERNELS: dict[str, Kernel] = {"reference": REFERENCE, "sdpa": SDPA}


def get_kernel(name: str | Kernel | None = None, *, score_mod=None,
               device: torch.device | str | None = None) -> Kernel:
    """Look up a kernel by name, or choose one when ``name`` is None.

    The automatic choice is ``sdpa`` when it is available on ``device`` and there is no
    score_mod, else ``reference``. A kernel object is returned as is.

    Raises:
        KeyError: for an unknown name, listing the known ones.
    """
    if name is None:
        if score_mod is None and SDPA.available(device)[0]:
            return SDPA
        return REFERENCE
    if not isinstance(name, str):
        return name
    try:
        return KERNELS[name]
    except KeyError:
        raise KeyError(f"unknown kernel {name!r}; choose one of {sorted(KERNELS)}") from None


from .tile import merge, tile_backward, tile_forward  # noqa: E402  (tile looks up get_kernel)

__all__ = ["KERNELS", "Kernel", "ReferenceKernel", "SdpaKernel", "attention", "check_qkv",
           "get_kernel", "merge", "tile_backward", "tile_forward"]
