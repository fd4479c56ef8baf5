"""Pure tile math: dense reference, tile forward/backward, lse merge, and the kernel registry.

Legend: B batch · H query heads · G kv heads (H % G == 0) · L tokens · D head dim.

v may have its own head dim Dv (MLA, e.g. DeepSeek-V3: Dv = 2D/3): out and dout are
``[..., Dv]``, dv ``[B, G, Lk, Dv]``. Every kernel takes it; ``sdpa``, whose fused op needs one
head size, pads with zero columns inside the op call (exact: zeros add nothing to a score and
give output columns that are cut) and cuts the results, so v never travels or is kept padded.

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

A kernel that sets ``wants_blocks = True`` takes the whole tile with its block map and
mask_mod instead of a dense mask (``blocks``, ``block_size``, ``mask_mod`` replace ``mask``; see
``fringe/ops/flex.py``)::

    kernel.forward(q, k, v, *, q_pos, kv_pos, blocks, block_size, mask_mod, score_mod, scale)
    kernel.backward(q, k, v, out, lse, dout, *, q_pos, kv_pos, blocks, block_size, mask_mod,
                    score_mod, scale, dlse=None, score_params=())

Kernels: ``reference`` (einsum, any dtype / mask / score_mod), ``sdpa`` (the fused CPU op,
falls back to ``reference`` with a reason where it cannot run; see ``fringe/ops/_fast.py``) and
``flex`` (compiled FlexAttention on CUDA, block-sparse by fringe's block map, chosen by name
only; see ``fringe/ops/flex.py``).

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

from ._fast import SdpaKernel
from .kernels import KERNELS, Kernel, get_kernel
from .reference import ReferenceKernel, attention, check_qkv
from .tile import merge, tile_backward, tile_forward

__all__ = ["KERNELS", "Kernel", "ReferenceKernel", "SdpaKernel", "attention", "check_qkv",
           "get_kernel", "merge", "tile_backward", "tile_forward"]
