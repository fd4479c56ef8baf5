"""Differentiable fringe attention: an autograd.Function around fringe's custom ops.

:func:`attention` is what :func:`fringe.attention` and :func:`fringe.simulate.attention` run,
compiled or not. Its :class:`Attention` Function calls the op ``fringe::attention``
(:mod:`fringe._attention_op`: planner data, interpreter, agreement and communication inside,
unseen by ``torch.compile``); its backward calls ``fringe::attention_backward`` (the plan's
derived backward programs) through :class:`AttentionBackward`. Attention sinks are applied
after the merge with plain torch math. The plan reaches the ops as its handle
(``plan.handle``), so the compiler guards on tensor metadata only: a model compiles once, with
``fullgraph=True``, and a new plan of the same shapes (next batch's documents) reuses it.

Written in the ``setup_context`` style so ``torch.func.grad`` / ``vjp`` work (a custom op's
own ``register_autograd`` does not, in torch 2.13). Both Functions have an explicit ``vmap``
rule that folds the vmapped dimension into the batch (B): a generated vmap rule cannot see
through the collectives, and the backward re-enters a Function so that ``vmap(grad(f))``
works too. When the mask or score_mod reads ``b``, or there are score_mod parameters (their
gradients stay per slice), each slice runs alone. Saved state is the local q, k, v, out and
lse (plus the kept kv buffers, packed flat, when the plan asks for ``kv="keep"``): O(L) per
rank.
"""
from __future__ import annotations

import torch

from . import _attention_op as _op
from .runtime.contract import PlanLike


def _fold(x: torch.Tensor, bdim: int | None, n: int) -> torch.Tensor:
    """``[B, ...]`` per example -> ``[N*B, ...]`` (the vmapped dim N folded into the batch)."""
    x = x.unsqueeze(0).expand(n, *x.shape) if bdim is None else x.movedim(bdim, 0)
    return x.reshape(n * x.shape[1], *x.shape[2:])


def _unfold(x: torch.Tensor, n: int) -> torch.Tensor:
    """Inverse of :func:`_fold`: ``[N*B, ...] -> [N, B, ...]`` (vmapped dim 0)."""
    return x.reshape(n, x.shape[0] // n, *x.shape[1:])


def _slices(x, bdim: int | None, n: int) -> list:
    return [x] * n if x is None or bdim is None else list(x.movedim(bdim, 0).unbind(0))


def records(args) -> bool:
    """Whether ``Attention.apply(*args)`` is recorded by autograd here, so its backward will run
    when the loss is differentiated: grad mode on and some tensor argument requires grad, the
    rule ``autograd.Function.apply`` itself applies (torch's ``is_executable``; the same rule
    decides under ``torch.func.grad`` / ``vjp``, whose tensors require grad at their level).

    One level's answer: under ``torch.func.vmap`` the tensors are batched and say False, and
    the vmap rule's inner call answers for the levels below (``Attention.vmap`` ORs the two).
    The answer joins the agreement between ranks, so ranks that differ raise before any
    communication instead of leaving the training ranks' backward waiting for peers that
    never send.
    """
    return torch.is_grad_enabled() and any(isinstance(a, torch.Tensor) and a.requires_grad
                                           for a in args)


class Attention(torch.autograd.Function):
    """``(q, k, v, sinks, batch, handle, where, timeout_s, keep, reads_batch, backward, *params)
    -> (out, lse, kept)``.

    ``params`` are the plan's ``score_params`` (read by the score_mod through its closure;
    passed so autograd routes their gradients). ``sinks`` only reach the op's checks and
    agreement (the caller applies them); ``batch`` (a 0-d int64 digest of the global batch the
    shard was cut from, or None) only its agreement, and so does ``backward``: :func:`records`
    of the other arguments, where the call began (it joins the agreement: ranks must agree on
    whether a backward follows). lse is differentiable (its cotangent enters every tile's
    backward); ``kept`` (the kept kv buffers, flat) is not.
    """

    @staticmethod
    def forward(q, k, v, sinks, batch, handle, where, timeout_s, keep, reads_batch, backward,
                *params):
        return _op.attention_op(q, k, v, list(params), sinks, batch, handle, where, timeout_s,
                                keep, reads_batch, backward)

    @staticmethod
    def setup_context(ctx, inputs, output):
        q, k, v, sinks, batch, handle, where, timeout_s, keep, reads_batch, _, *params = inputs
        out, lse, kept = output
        ctx.save_for_backward(q, k, v, out, lse, kept, handle, *params)
        ctx.consts = (where, timeout_s, reads_batch)
        ctx.mark_non_differentiable(kept)

    @staticmethod
    def backward(ctx, dout, dlse, _dkept):
        q, k, v, out, lse, kept, handle, *params = ctx.saved_tensors
        if dout is None:
            dout = torch.zeros_like(out)
        if dlse is None:
            dlse = torch.zeros_like(lse)
        if torch.compiler.is_compiling():     # the op itself: nothing to vmap in a graph
            dq, dk, dv, dparams = _op.attention_backward_op(q, k, v, out, lse, dout, dlse, kept,
                                                            params, handle, *ctx.consts)
        else:
            dq, dk, dv, *dparams = AttentionBackward.apply(q, k, v, out, lse, dout, dlse, kept,
                                                           handle, *ctx.consts, *params)
        return (dq, dk, dv, None, None, None, None, None, None, None, None, *dparams)

    @staticmethod
    def vmap(info, in_dims, q, k, v, sinks, batch, handle, where, timeout_s, keep, reads_batch,
             backward, *params):
        n = info.batch_size
        qd, kd, vd, sd, bd, hd = in_dims[:6]
        if hd is not None or any(d is not None for d in in_dims[11:]):
            raise NotImplementedError("fringe attention cannot vmap over score_mod parameters")
        sinks = sinks if sinks is None or sd is None else sinks.select(sd, 0)   # checks only
        batch = batch if batch is None or bd is None else batch.select(bd, 0)   # agreement only
        consts = (where, timeout_s, keep, reads_batch)

        def apply(q, k, v):     # a backward follows if a level above or one below records
            args = (q, k, v, sinks, batch, handle, *consts)
            return Attention.apply(*args, backward or records((*args, *params)), *params)
        if reads_batch or params:
            res = [apply(qi, ki, vi)
                   for qi, ki, vi in zip(_slices(q, qd, n), _slices(k, kd, n), _slices(v, vd, n))]
            return tuple(torch.stack(parts) for parts in zip(*res)), (0, 0, 0)
        out, lse, kept = apply(_fold(q, qd, n), _fold(k, kd, n), _fold(v, vd, n))
        # kept belongs to the folded batch: the backward rule takes it unbatched, as it came
        return (_unfold(out, n), _unfold(lse, n), kept), (0, 0, None)


class AttentionBackward(torch.autograd.Function):
    """The backward op as a Function of its own, so it can be vmapped.

    Returns ``(dq, dk, dv, *dparams)``, one gradient per ``plan.score_params``.
    """

    @staticmethod
    def forward(q, k, v, out, lse, dout, dlse, kept, handle, where, timeout_s, reads_batch,
                *params):
        dq, dk, dv, dparams = _op.attention_backward_op(q, k, v, out, lse, dout, dlse, kept,
                                                        list(params), handle, where, timeout_s,
                                                        reads_batch)
        return (dq, dk, dv, *dparams)

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, *grads):
        raise NotImplementedError("fringe attention does not support double backward "
                                  "(gradients of gradients); take one derivative of attention")

    @staticmethod
    def vmap(info, in_dims, q, k, v, out, lse, dout, dlse, kept, handle, where, timeout_s,
             reads_batch, *params):
        n = info.batch_size
        d = in_dims
        if d[8] is not None or any(e is not None for e in d[12:]):
            raise NotImplementedError("fringe attention cannot vmap over score_mod parameters")
        tensors = (q, k, v, out, lse, dout, dlse)
        consts = (handle, where, timeout_s, reads_batch)
        # out and lse unbatched: the forward ran once, unvmapped (jacrev, vmap over a vjp's
        # cotangents), so its kept kv buffers hold its batch B, not the folded N*B: per slice
        unfolded_kept = kept.numel() > 0 and d[3] is None and d[4] is None
        if reads_batch or params or unfolded_kept:
            cols = [_slices(x, bd, n) for x, bd in zip(tensors, d[:7])]
            kcol = _slices(kept, d[7], n)
            res = [AttentionBackward.apply(*(c[i] for c in cols), kcol[i], *consts, *params)
                   for i in range(n)]
            outs = tuple(torch.stack(parts) for parts in zip(*res))
            return outs, tuple(0 for _ in outs)
        if d[7] is not None:
            raise NotImplementedError("fringe attention: the kept kv buffers of a folded vmap "
                                      "come back unbatched; got them batched")
        args = [_fold(x, bd, n) for x, bd in zip(tensors, d[:7])]
        dq, dk, dv = AttentionBackward.apply(*args, kept, *consts)
        return (_unfold(dq, n), _unfold(dk, n), _unfold(dv, n)), (0, 0, 0)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, plan: PlanLike, where: str,
              timeout_s: float | None = None, sinks: torch.Tensor | None = None,
              batch: torch.Tensor | None = None):
    """``(out, lse)`` of ``plan`` through the custom op; both differentiable.

    Args:
        q, k, v: global tensors (``where="virtual"``) or this rank's shard.
        plan: a :class:`fringe.Plan`.
        where: ``"virtual"`` or what :func:`fringe._attention_op.register_group` returned.
        timeout_s: for torch.distributed.
        sinks: optional ``[H]`` sink logits (checked inside the op, applied here).
        batch: optional 0-d int64 CPU tensor, the digest of the global batch this rank's
            shard was cut from (``packing.Shard.batch_digest``); joins the agreement.

    Raises:
        TypeError: plan is not a Plan, or q / k / v / sinks are not tensors
            (``where="virtual"``, or while compiling; everything else is checked inside the
            op, before any communication).
        ValueError: they mix the meta device with another (the op would run its shape-only
            kernel); over torch.distributed, any of these: this rank's reason travels through
            the agreement exchange the op uses, so every rank raises it at once.
    """
    problem = _entry_problem(q, k, v, plan, sinks, batch)
    if where != _op.VIRTUAL and problem is None:
        problem = _op.timeout_problem(timeout_s)
    if problem is not None:
        if where == _op.VIRTUAL or torch.compiler.is_compiling():
            raise problem
        _op.fail_everywhere(where, timeout_s, q, k, v, sinks, f"{type(problem).__name__}: {problem}")
    args = (q, k, v, sinks, batch, plan.handle, where, timeout_s, plan.kv == "keep",
            plan.reads_batch)
    backward = records((*args, *plan.score_params))
    args = (*args, backward, *plan.score_params)
    if torch.compiler.is_compiling() and not backward:
        # nothing to differentiate: the op itself. dynamo (torch 2.13) inlines a Function's
        # forward then, and passes its ctx as the first argument when forward takes *params
        out, lse, _ = Attention.forward(*args)
    else:
        out, lse, _ = Attention.apply(*args)
    if sinks is not None:
        out, lse = apply_sinks(out, lse, sinks)
    return out, lse


def _entry_problem(q, k, v, plan: PlanLike, sinks, batch=None) -> Exception | None:
    """What keeps these inputs out of the op (it takes tensors and a plan handle), or None."""
    if not isinstance(plan, PlanLike):
        return TypeError(f"plan must be a fringe.Plan from fringe.plan(schedule, mask_mod, ...), "
                         f"got {type(plan).__name__}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            return TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if sinks is not None and not isinstance(sinks, torch.Tensor):
        return TypeError(f"sinks must be a tensor of per-head sink logits [H], got "
                         f"{type(sinks).__name__}")
    if batch is not None and not (isinstance(batch, torch.Tensor) and batch.dim() == 0
                                  and batch.dtype == torch.int64 and not batch.is_cuda):
        return TypeError(f"batch_digest must be a 0-d int64 CPU tensor (packing.Shard.batch_digest "
                         f"as fringe.hf.model_inputs carries it), got "
                         f"{getattr(batch, 'shape', type(batch).__name__)}")
    if plan.score_params and torch.is_grad_enabled() and not torch.compiler.is_compiling():
        problem = _stray_params(plan)
        if problem is not None:
            return problem
    # one meta tensor among real ones would send the call to the op's fake (shape-only) kernel:
    # empty outputs, no agreement, no error
    given = [(n, t) for n, t in (("q", q), ("k", k), ("v", v), ("sinks", sinks),
                                 *(("a score_mod parameter", p) for p in plan.score_params))
             if t is not None]
    if any(t.is_meta for _, t in given) and not all(t.is_meta for _, t in given):
        devs = ", ".join(f"{n} on {t.device}" for n, t in given)
        return ValueError(f"q, k, v, sinks and the plan's score_mod parameters must be on one "
                          f"device, got {devs}; move them")
    return None


def _stray_params(plan: PlanLike) -> Exception | None:
    """A tensor that requires grad which the score_mod reads now but the plan does not route
    (``torch.func.functional_call`` or a stateless reparametrization swapped the parameter
    after :func:`fringe.plan` captured it): its gradient would come back zero, silently."""
    from .plan import captured_params       # the plan layer: imported at call time only
    known = {id(t) for t in plan.score_params}
    stray = [t for t in captured_params(plan.score_mod, seq_len=plan.seq_len)
             if id(t) not in known]
    if not stray:
        return None
    return ValueError(
        f"the score_mod reads {len(stray)} tensor(s) that require grad but are not the plan's "
        f"score_params (shapes {[tuple(t.shape) for t in stray]}): a parameter was swapped after "
        f"fringe.plan captured it (torch.func.functional_call, a stateless reparametrization, "
        f"or requires_grad_() set later), so its gradient would silently be zero. Build the plan "
        f"where the score_mod reads the tensors to differentiate, pass score_params= to "
        f"fringe.plan, or differentiate the module's own parameters with torch.autograd")


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
