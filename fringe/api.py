"""The public entry point on one rank's shard: ``fringe.attention(q, k, v, plan=plan)``."""
from __future__ import annotations

import dataclasses

import torch

from .autograd import attention_stacked
from .runtime.distributed import DistRuntime
from .simulate import check_inputs

_RUNTIMES: dict = {}


def _runtime(group, timeout_s: float | None) -> DistRuntime:
    key = (id(group), timeout_s)
    rt = _RUNTIMES.get(key)
    if rt is None or rt.group is not group:
        rt = _RUNTIMES[key] = DistRuntime(group, timeout_s=timeout_s)
    return rt


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, plan, group=None,
              timeout_s: float | None = None, return_lse: bool = False):
    """Context-parallel attention on this rank's shard; differentiable.

    Args:
        q: ``[B, H, L, D]`` this rank's queries, tokens in ``plan.layout.positions(rank)``
            order (``plan.layout.shard(q_global, rank)``); k, v: ``[B, G, L, D]``.
        plan: from :func:`fringe.plan`, identical on every rank.
        group: the context-parallel process group (default: the default group).
        timeout_s: how long to wait for a peer before :class:`~fringe.runtime.distributed.CommTimeout`
            (default ``FRINGE_TIMEOUT`` or 300 s).
        return_lse: also return the log-sum-exp ``[B, H, L]``.

    Returns:
        out ``[B, H, L, D]`` for this rank's queries (and lse).

    Raises:
        ValueError: shapes that do not fit the plan, before any communication.
        RankMismatch: ranks disagree on shapes, dtype, device or plan.
        CommTimeout: a peer stopped answering.
    """
    rt = _runtime(group, timeout_s)
    rt.agree(plan, q, k)              # first, so that a bad rank fails on every rank
    check_inputs(q, k, v, plan=plan, local=True)
    out, lse = attention_stacked(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), plan=plan,
                                 runtime=rt)
    return (out[0], lse[0]) if return_lse else out[0]


@dataclasses.dataclass(frozen=True)
class RunStats:
    """Per-step records of the last forward and backward on this rank."""

    forward: tuple
    backward: tuple

    @staticmethod
    def _sum(records, field):
        return sum(getattr(r, field) for r in records)

    def exposed_comm_fraction(self, which: str = "forward") -> float:
        """Time waiting for transfers after compute / (compute + wait)."""
        recs = self.forward if which == "forward" else self.backward
        busy = self._sum(recs, "compute_s") + self._sum(recs, "wait_s")
        return self._sum(recs, "wait_s") / busy if busy else 0.0

    def summary(self) -> dict:
        out = {}
        for which in ("forward", "backward"):
            recs = getattr(self, which)
            out[which] = dict(steps=len(recs), compute_s=self._sum(recs, "compute_s"),
                              wait_s=self._sum(recs, "wait_s"),
                              exposed=self.exposed_comm_fraction(which),
                              sent_bytes=self._sum(recs, "sent_bytes"))
        return out


def last_run(group=None, timeout_s: float | None = None) -> RunStats:
    """Compute and exposed-communication time per step of this rank's last call."""
    rt = _runtime(group, timeout_s)
    recs = {}
    for which in ("forward", "backward"):
        states = rt.last_states.get(which, {})
        recs[which] = tuple(r for st in states.values() for r in st.records)
    return RunStats(recs["forward"], recs["backward"])
