"""torch's built-in context parallel on CPU ranks, with the workarounds it needs there.

Everything here is benchmark code: fringe itself never imports torch's private ring functions.
torch 2.13's ``torch.distributed.tensor.experimental`` context parallel targets CUDA; on CPU
three things stand in the way, and each has one marked workaround (the tables print its tag):

- **W1 (SDPA path, causal)**: ``context_parallel`` routes SDPA to its ring through DTensor
  handlers registered only for the CUDA ops (``_scaled_dot_product_flash_attention``,
  ``_efficient_``, ``_cudnn_``). On CPU, ``F.scaled_dot_product_attention`` lowers to
  ``aten._scaled_dot_product_flash_attention_for_cpu`` (and ``_backward``), which has no CP
  handler. We register one for the two CPU ops that calls torch's own
  ``_templated_ring_attention`` / ``_templated_ring_attention_backward`` with the CPU op: the
  same ring, head-tail load balancer, lse merger and all-gather rotater as on CUDA, entered
  through the public ``context_parallel`` context manager.
- **W2 (flex path, fwd+bwd)**: ``flex_attention`` refuses ``requires_grad`` inputs on CPU
  (``_validate_device``: "FlexAttention does not support backward on CPU"). We bypass that
  guard; eager flex then runs its dense math reference (``sdpa_dense``: full
  ``[B, H, L, S]`` scores, no block sparsity) forward and backward. Inputs go through torch's
  ``_ContextParallel(FLEX)`` module hooks (k/v all-gathered, gradients reduce-scattered) and
  ``_context_parallel_shard`` (block mask rewritten per rank, load-balanced).
- **W3 (flex path, forward only)**: ``torch.compile(flex_attention)`` on CPU (inductor's C++
  flex template): block-sparse, inference only (no lse, no backward on CPU).
"""
from __future__ import annotations

import functools

import torch
import torch.nn as nn

aten = torch.ops.aten


# ---- W1: CPU SDPA ops routed into torch's ring ---------------------------------------------------

@functools.cache
def install_cpu_sdpa_handlers() -> None:
    """Register DTensor CP handlers for the CPU flash-attention ops (workaround W1)."""
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
    from torch.distributed.tensor._utils import compute_global_tensor_info
    from torch.distributed.tensor.experimental._context_parallel import _attention as cpa

    fwd_op = aten._scaled_dot_product_flash_attention_for_cpu.default
    bwd_op = aten._scaled_dot_product_flash_attention_for_cpu_backward.default

    def ring_fwd(mesh, query, key, value, dropout_p=0.0, is_causal=False, *, attn_mask=None,
                 scale=None):
        if attn_mask is not None:
            raise NotImplementedError("torch CP on CPU (W1): no attn_mask on the ring")
        return cpa._templated_ring_attention(mesh.get_group(), 2, fwd_op, query, key, value,
                                             is_causal=is_causal, dropout_p=dropout_p,
                                             scale=scale)

    def ring_bwd(mesh, grad_out, query, key, value, out, logsumexp, dropout_p, is_causal, *,
                 attn_mask=None, scale=None):
        if attn_mask is not None:
            raise NotImplementedError("torch CP on CPU (W1): no attn_mask on the ring")
        return cpa._templated_ring_attention_backward(
            mesh.get_group(), 2, bwd_op, grad_out, "grad_out", query, key, value, out,
            logsumexp, is_causal=is_causal, dropout_p=dropout_p, scale=scale)

    def handler(op_call, args, kwargs):
        info = DTensor._op_dispatcher.unwrap_to_op_info(op_call, args, kwargs)
        mesh = info.compute_mesh
        fn = ring_fwd if op_call is fwd_op else ring_bwd
        local = fn(mesh, *info.local_args, **info.local_kwargs)
        placements = (Shard(2),)
        out = []
        for t in local:
            shape, stride = compute_global_tensor_info(t, mesh, placements)
            spec = DTensorSpec(mesh, placements,
                               tensor_meta=TensorMeta(torch.Size(shape), tuple(stride), t.dtype))
            out.append(DTensor(t, spec, requires_grad=False))
        return tuple(out)

    cpa.custom_ops[fwd_op] = handler
    cpa.custom_ops[bwd_op] = handler


class TorchCPSdpa:
    """torch CP's SDPA path (``context_parallel``) for a causal mask on this rank."""

    tag = "W1"

    def __init__(self, mesh, q, k, v):
        """Shard global ``q, k, v`` ``[B, H, S, D]`` as ``context_parallel`` does (head-tail)."""
        from torch.distributed.tensor.experimental import context_parallel
        install_cpu_sdpa_handlers()
        self.mesh = mesh
        self.S = q.shape[2]
        q, k, v = (t.detach().clone() for t in (q, k, v))
        with context_parallel(mesh, buffers=[q, k, v], buffer_seq_dims=[2, 2, 2],
                              no_restore_buffers={q, k, v}):
            pass
        self.q, self.k, self.v = (t.requires_grad_() for t in (q, k, v))
        self.positions = self._positions()

    def _positions(self) -> torch.Tensor:
        """Global positions of this rank's tokens (head-tail: chunks r and 2P-1-r)."""
        from torch.distributed.tensor.experimental import context_parallel
        pos = torch.arange(self.S)
        with context_parallel(self.mesh, buffers=[pos], buffer_seq_dims=[0],
                              no_restore_buffers={pos}):
            pass
        return pos

    def step(self, *, backward: bool = True):
        from torch.distributed.tensor.experimental import context_parallel
        dummy = torch.empty(self.S)
        for t in (self.q, self.k, self.v):
            t.grad = None
        with context_parallel(self.mesh, buffers=[dummy], buffer_seq_dims=[0],
                              no_restore_buffers={dummy}):
            out = nn.functional.scaled_dot_product_attention(self.q, self.k, self.v,
                                                             is_causal=True)
            if backward:
                out.sum().backward()
        return out


# ---- W2 / W3: the flex path ---------------------------------------------------------------------

@functools.cache
def bypass_flex_cpu_backward_guard() -> None:
    """Let eager flex_attention take requires_grad inputs on CPU (workaround W2)."""
    from torch.nn.attention import flex_attention as fa
    fa._validate_device = lambda query, key, value: None


class _FlexModule(nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, q, k, v, *, block_mask):
        return self.fn(q, k, v, block_mask=block_mask)


class TorchCPFlex:
    """torch CP's flex path (``_ContextParallel(FLEX)``) for any mask_mod on this rank.

    ``step`` trains through eager flex (W2); ``step_compiled`` runs the forward through
    ``torch.compile(flex_attention)`` (W3, inference only), built on first use.

    Args:
        mesh: 1-D DeviceMesh over the CP ranks (gloo).
        q, k, v: global ``[B, H, S, D]``.
        mask_mod: FlexAttention mask_mod on global positions.
        doc_lens: document lengths: torch's per-document head-tail balancer where every
            length is divisible by 2P, else (and for None) the head-tail balancer.
    """

    tag = "W2"

    def __init__(self, mesh, q, k, v, mask_mod, *, doc_lens=None):
        from torch.distributed.tensor.experimental._context_parallel import (
            _context_parallel_shard, _HeadTailLoadBalancer, _PerDocumentHeadTailLoadBalancer)
        from torch.nn.attention.flex_attention import create_block_mask
        bypass_flex_cpu_backward_guard()
        self.mesh = mesh
        S = q.shape[2]
        P = mesh.size()
        # torch's per-document balancer needs every document length divisible by 2P;
        # randomly packed documents are not, so they get the head-tail balancer.
        if doc_lens is not None and all(n % (2 * P) == 0 for n in doc_lens):
            lb = _PerDocumentHeadTailLoadBalancer([list(doc_lens)], P, "cpu")
            self.balancer = "per-document head-tail"
        else:
            lb = _HeadTailLoadBalancer(S, P, "cpu")
            self.balancer = "head-tail"
        bm = create_block_mask(mask_mod, None, None, S, S, device="cpu")
        q_l, k_l, v_l, bm_l = _context_parallel_shard(
            mesh, [q.detach(), k.detach(), v.detach(), bm], [2, 2, 2, 2], load_balancer=lb)
        self.block_mask = bm_l
        self.q, self.k, self.v = (t.contiguous().requires_grad_() for t in (q_l, k_l, v_l))
        idx = lb._generate_indices(restore=False)[0]
        L = S // P
        r = mesh.get_local_rank()
        self.positions = idx[r * L:(r + 1) * L]
        self._eager = self._module(compiled=False)
        self._compiled = None

    def _module(self, *, compiled: bool) -> nn.Module:
        from torch.distributed.tensor.experimental._context_parallel import _ContextParallel
        from torch.distributed.tensor.parallel import parallelize_module
        from torch.nn.attention.flex_attention import flex_attention
        fn = torch.compile(flex_attention, dynamic=False) if compiled else flex_attention
        return parallelize_module(
            _FlexModule(fn), self.mesh,
            _ContextParallel(seq_dim=2, attention_type=_ContextParallel.AttentionType.FLEX))

    def step(self, *, backward: bool = True):
        """Eager flex (W2): forward, and backward through the bypassed CPU guard."""
        for t in (self.q, self.k, self.v):
            t.grad = None
        if not backward:
            with torch.no_grad():
                return self._eager(self.q, self.k, self.v, block_mask=self.block_mask)
        out = self._eager(self.q, self.k, self.v, block_mask=self.block_mask)
        out.sum().backward()
        return out

    def step_compiled(self):
        """Compiled flex (W3), forward only (CPU flex has no compiled backward)."""
        if self._compiled is None:
            self._compiled = self._module(compiled=True)
        with torch.no_grad():
            return self._compiled(self.q, self.k, self.v, block_mask=self.block_mask)
