"""The autograd Function: forward runs the plan, backward runs ``reverse(plan)``.

Inputs are stacked over the ranks this process drives (``q [R, B, H, L, D]``); the
*runtime* (virtual mesh or torch.distributed) decides who those ranks are. Nothing here
knows about a particular schedule.

Written in the ``setup_context`` style so ``torch.func.grad`` / ``vjp`` work. Both the
forward and the backward Function have an explicit ``vmap`` rule that folds the vmapped
dimension into the batch (B): a generated vmap rule cannot see through the collectives,
and the backward re-enters a Function so that ``vmap(grad(f))`` works too. Saved state is
the local q, k, v, out and lse (plus the kept kv buffers when the plan asks for
``kv="keep"``): O(L) per rank.
"""
from __future__ import annotations

import torch


def _fold(x: torch.Tensor, bdim: int | None, n: int) -> torch.Tensor:
    """Fold the vmapped dim N into dim 1: ``[R, B, ...]`` per example -> ``[R, N*B, ...]``.

    Used for rank-stacked tensors (R ranks, B batch) and for kept kv buffers
    (``[2, B, G, L, D]``, where dim 1 is the batch too).
    """
    if bdim is None:
        x = x.unsqueeze(0).expand(n, *x.shape)
    else:
        x = x.movedim(bdim, 0)
    x = x.movedim(0, 1)                                   # [R, N, B, ...]
    return x.reshape(x.shape[0], n * x.shape[2], *x.shape[3:])


def _unfold(x: torch.Tensor, n: int) -> torch.Tensor:
    """Inverse of :func:`_fold`: ``[R, N*B, ...] -> [N, R, B, ...]`` (vmapped dim 0)."""
    x = x.reshape(x.shape[0], n, x.shape[1] // n, *x.shape[2:])
    return x.movedim(1, 0)


class Attention(torch.autograd.Function):
    """``(q, k, v) -> (out, lse, *kept)`` over the driven ranks; lse and kept carry no grad."""

    @staticmethod
    def forward(q, k, v, plan, runtime):
        out, lse, kept = runtime.forward(plan, q, k, v)
        flat = [t for per_rank in kept for t in per_rank]
        return (out, lse, *flat)

    @staticmethod
    def setup_context(ctx, inputs, output):
        q, k, v, plan, runtime = inputs
        out, lse, *flat = output
        ctx.plan, ctx.runtime = plan, runtime
        ctx.save_for_backward(q, k, v, out, lse, *flat)
        ctx.mark_non_differentiable(lse, *flat)

    @staticmethod
    def backward(ctx, dout, _dlse, *_dkept):
        q, k, v, out, lse, *flat = ctx.saved_tensors
        if dout is None:
            dout = torch.zeros_like(out)
        dq, dk, dv = AttentionBackward.apply(q, k, v, out, lse, dout, ctx.plan, ctx.runtime,
                                             *flat)
        return dq, dk, dv, None, None

    @staticmethod
    def vmap(info, in_dims, q, k, v, plan, runtime):
        n = info.batch_size
        qd, kd, vd = in_dims[:3]
        res = Attention.apply(_fold(q, qd, n), _fold(k, kd, n), _fold(v, vd, n), plan, runtime)
        out, lse, *flat = res
        outs = (_unfold(out, n), _unfold(lse, n), *(_unfold(t, n) for t in flat))
        return outs, tuple(0 for _ in outs)


def _split_kept(plan, runtime, flat):
    from .runtime.engine import kept_names
    kept, i = [], 0
    for r in runtime.ranks:
        m = len(kept_names(plan, r))
        kept.append(list(flat[i:i + m]))
        i += m
    return kept


class AttentionBackward(torch.autograd.Function):
    """The backward program as a Function of its own, so it can be vmapped."""

    @staticmethod
    def forward(q, k, v, out, lse, dout, plan, runtime, *flat):
        kept = _split_kept(plan, runtime, flat)
        dq, dk, dv = runtime.backward(plan, q, k, v, out, lse, dout, kept)
        return dq, dk, dv

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, *grads):
        raise NotImplementedError("fringe attention does not support double backward "
                                  "(gradients of gradients); take one derivative of attention")

    @staticmethod
    def vmap(info, in_dims, q, k, v, out, lse, dout, plan, runtime, *flat):
        n = info.batch_size
        d = in_dims
        args = [_fold(x, bd, n) for x, bd in zip((q, k, v, out, lse, dout), d[:6])]
        kept = [_fold(x, bd, n) for x, bd in zip(flat, d[8:])]
        dq, dk, dv = AttentionBackward.apply(*args, plan, runtime, *kept)
        return (_unfold(dq, n), _unfold(dk, n), _unfold(dv, n)), (0, 0, 0)


def attention_stacked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, plan, runtime):
    """Differentiable attention over rank-stacked tensors; returns ``(out, lse)``."""
    out, lse, *_ = Attention.apply(q, k, v, plan, runtime)
    return out, lse
