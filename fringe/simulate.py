"""Run a plan on the in-process virtual mesh: global tensors in, global tensors out.

``fringe.simulate.attention(q, k, v, plan=plan)`` shards q/k/v by the plan's layout, runs
every rank's program through the same interpreter the distributed runtime uses (a
:class:`~fringe.runtime.VirtualMesh` transport instead of torch.distributed), and
unshards the result. It is differentiable (``backward`` runs the derived backward
programs) and works under ``torch.func.grad`` / ``vjp`` / ``vmap``.
"""
from __future__ import annotations

import torch

from ._attention_op import VIRTUAL
from .autograd import attention as _attention
from .runtime.engine import check_inputs
from .runtime.virtual import VirtualRuntime


def _identity(plan) -> bool:
    """One rank holding every position in natural order: sharding is a view, not a copy."""
    order = plan.layout.order
    return plan.world_size == 1 and torch.equal(order, torch.arange(order.numel()))


def _stack(plan, x: torch.Tensor) -> torch.Tensor:
    """Global ``[..., S, D]`` -> rank-stacked ``[P, ..., L, D]`` in the plan's layout."""
    if _identity(plan):                        # no gather, no copy (nor in the backward)
        return x.unsqueeze(0)
    if plan.world_size == 1:                   # one rank: no stack copy
        return plan.layout.shard(x, 0).unsqueeze(0)
    return torch.stack([plan.layout.shard(x, r) for r in range(plan.world_size)])


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, plan,
              return_lse: bool = False, sinks: torch.Tensor | None = None):
    """Context-parallel attention of global tensors, simulated on one process.

    Args:
        q: ``[B, H, S, D]``; k: ``[B, G, S, D]``; v: ``[B, G, S, Dv]`` (global, natural token
            order; Dv may differ from D, as in MLA).
        plan: from :func:`fringe.plan`.
        return_lse: also return the log-sum-exp ``[B, H, S]`` (differentiable).
        sinks: optional ``[H]`` per-head sink logits, as in :func:`fringe.attention`.

    Returns:
        out ``[B, H, S, Dv]`` (and lse), equal to dense attention under the plan's mask.
    """
    out, lse = _attention(q, k, v, plan=plan, where=VIRTUAL, sinks=sinks)  # checks inside
    return (out, lse) if return_lse else out


def forward_states(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, plan) -> dict:
    """Run the forward on the virtual mesh and return each rank's interpreter state.

    Each :class:`~fringe.runtime.RankState` carries ``records`` (per-step compute and wait
    time, for :func:`fringe.render.timeline` / :func:`fringe.render.chrome_trace`) and
    ``pool`` (how many buffers the rank allocated).

    Returns:
        ``{rank: RankState}``.
    """
    check_inputs(q, k, v, plan=plan, local=False)
    rt = VirtualRuntime(plan.world_size)
    rt.forward(plan, *(_stack(plan, x.detach()) for x in (q, k, v)))
    return rt.last_states["forward"]
