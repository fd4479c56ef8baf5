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


def _per_slice(plan) -> bool:
    """Fold vmap into the batch only when that cannot change the numbers.

    A mask or score_mod that reads ``b`` would see ``n*B + b`` after folding, and the
    gradients of score_mod parameters must stay per slice; then each slice runs alone.
    """
    return bool(plan.reads_batch or plan.score_params)


def _slices(x: torch.Tensor, bdim: int | None, n: int) -> list:
    return [x] * n if bdim is None else list(x.movedim(bdim, 0).unbind(0))


class Attention(torch.autograd.Function):
    """``(q, k, v, *params) -> (out, lse, *kept)`` over the driven ranks.

    ``params`` are the plan's ``score_params`` (read by the score_mod through its closure;
    passed here so autograd routes their gradients). lse is differentiable (its cotangent
    enters every tile's backward); the kept kv buffers are not.
    """

    @staticmethod
    def forward(q, k, v, plan, runtime, *params):
        out, lse, kept = runtime.forward(plan, q, k, v)
        flat = [t for per_rank in kept for t in per_rank]
        return (out, lse, *flat)

    @staticmethod
    def setup_context(ctx, inputs, output):
        q, k, v, plan, runtime, *params = inputs
        out, lse, *flat = output
        ctx.plan, ctx.runtime = plan, runtime
        ctx.save_for_backward(q, k, v, out, lse, *flat)
        ctx.mark_non_differentiable(*flat)

    @staticmethod
    def backward(ctx, dout, dlse, *_dkept):
        q, k, v, out, lse, *flat = ctx.saved_tensors
        if dout is None:
            dout = torch.zeros_like(out)
        if dlse is None:
            dlse = torch.zeros_like(lse)
        dq, dk, dv, *dparams = AttentionBackward.apply(q, k, v, out, lse, dout, dlse, ctx.plan,
                                                       ctx.runtime, *flat)
        return (dq, dk, dv, None, None, *dparams)

    @staticmethod
    def vmap(info, in_dims, q, k, v, plan, runtime, *params):
        n = info.batch_size
        if any(d is not None for d in in_dims[5:]):
            raise NotImplementedError("fringe attention cannot vmap over score_mod parameters")
        if _per_slice(plan):
            res = [Attention.apply(*xs, plan, runtime, *params) for xs in
                   zip(*(_slices(x, d, n) for x, d in zip((q, k, v), in_dims[:3])))]
            outs = tuple(torch.stack(parts) for parts in zip(*res))
            return outs, tuple(0 for _ in outs)
        qd, kd, vd = in_dims[:3]
        res = Attention.apply(_fold(q, qd, n), _fold(k, kd, n), _fold(v, vd, n), plan, runtime,
                              *params)
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
    """The backward program as a Function of its own, so it can be vmapped.

    Returns ``(dq, dk, dv, *dparams)``, one gradient per ``plan.score_params``.
    """

    @staticmethod
    def forward(q, k, v, out, lse, dout, dlse, plan, runtime, *flat):
        kept = _split_kept(plan, runtime, flat)
        dq, dk, dv, dparams = runtime.backward(plan, q, k, v, out, lse, dout, dlse, kept)
        return (dq, dk, dv, *dparams)

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, *grads):
        raise NotImplementedError("fringe attention does not support double backward "
                                  "(gradients of gradients); take one derivative of attention")

    @staticmethod
    def vmap(info, in_dims, q, k, v, out, lse, dout, dlse, plan, runtime, *flat):
        n = info.batch_size
        d = in_dims
        tensors = (q, k, v, out, lse, dout, dlse)
        if _per_slice(plan):
            cols = [_slices(x, bd, n) for x, bd in zip(tensors, d[:7])]
            kcols = [_slices(x, bd, n) for x, bd in zip(flat, d[9:])]
            res = [AttentionBackward.apply(*(c[i] for c in cols), plan, runtime,
                                           *(c[i] for c in kcols)) for i in range(n)]
            outs = tuple(torch.stack(parts) for parts in zip(*res))
            return outs, tuple(0 for _ in outs)
        args = [_fold(x, bd, n) for x, bd in zip(tensors, d[:7])]
        kept = [_fold(x, bd, n) for x, bd in zip(flat, d[9:])]
        dq, dk, dv, *dparams = AttentionBackward.apply(*args, plan, runtime, *kept)
        return (_unfold(dq, n), _unfold(dk, n), _unfold(dv, n)), (0, 0, 0)


def attention_stacked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, plan, runtime):
    """Differentiable attention over rank-stacked tensors; returns ``(out, lse)``.

    Both are differentiable: a loss may use lse (merging with another attention, a z-loss,
    attention sinks), and its cotangent enters the backward exactly.
    """
    out, lse, *_ = Attention.apply(q, k, v, plan, runtime, *plan.score_params)
    return out, lse


def apply_sinks(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor, *, head_dim: int = 1):
    """Add per-head sink logits to each row's softmax denominator, once, after the merge.

    gpt-oss style: ``exp(sink_h)`` joins the denominator of every row of head h, so
    ``out' = out * sigmoid(lse - sink_h)`` and ``lse' = logaddexp(lse, sink_h)``; a row
    with nothing to attend to (lse = -inf) gets out 0 and lse = sink_h. Differentiable in
    out, lse and sinks (the lse cotangent flows into the attention backward).

    Args:
        out: ``[..., H, L, D]``; lse: ``[..., H, L]``; sinks: ``[H]``.
        head_dim: where H sits in ``lse`` counting from the right, minus one (1 for
            ``[..., H, L]``).
    """
    shape = [1] * lse.dim()
    shape[lse.dim() - 1 - head_dim] = sinks.shape[0]
    s = sinks.to(lse.dtype).view(shape)
    w = torch.sigmoid(lse - s)
    out = (out.to(lse.dtype) * w.unsqueeze(-1)).to(out.dtype)
    return out, torch.logaddexp(lse, s)
