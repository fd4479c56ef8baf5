"""The public entry point on one rank's shard: ``fringe.attention(q, k, v, plan=plan)``."""
from __future__ import annotations

import contextlib
import dataclasses

import torch
import torch.distributed as dist

from . import _attention_op as _op
from .autograd import attention as _attention
from .runtime.contract import PlanLike
from .runtime.distributed import is_device_mesh

_LAST = _op.LAST           # group key -> the runtime of this process's last call on that group
_RECORDERS = _op.RECORDERS  # open recording() blocks
_group_key = _op.group_key
# a DeviceMesh's name for the op, computed once at trace time
_where = torch.compiler.assume_constant_result(_op.register_group)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, plan: PlanLike, group=None,
              timeout_s: float | None = None, return_lse: bool = False,
              sinks: torch.Tensor | None = None, batch_digest: torch.Tensor | None = None):
    """Context-parallel attention on this rank's shard; differentiable.

    Args:
        q: ``[B, H, L, D]`` this rank's queries, tokens in ``plan.layout.positions(rank)``
            order (``plan.layout.shard(q_global, rank)``); k: ``[B, G, L, D]``; v:
            ``[B, G, L, Dv]`` (Dv may differ from D, as in MLA: out is ``[B, H, L, Dv]``).
        plan: from :func:`fringe.plan`, identical on every rank.
        group: the context-parallel process group (default: the default group), or a
            ``torch.distributed.device_mesh.DeviceMesh``: 1D (the CP ranks, in mesh order) or,
            for a plan of ``schedules.compose(outer, inner, inner_size=k)``, 2D with shape
            ``(P // k, k)`` and dims (outer, inner), e.g. ``init_device_mesh("cpu", (m, k),
            mesh_dim_names=("outer", "inner"))``. Plan rank ``g*k + p`` is ``mesh[g, p]``
            (shard with ``(g, p) = mesh.get_coordinate()``); collectives inside a group and
            across groups run on ``mesh.get_group(dim)``. A mesh of the wrong shape raises a
            ValueError on every rank.
        timeout_s: how long to wait for a peer before :class:`~fringe.runtime.distributed.CommTimeout`
            (default ``FRINGE_TIMEOUT`` or 300 s; a finite number > 0).
        return_lse: also return the log-sum-exp ``[B, H, L]`` (differentiable).
        sinks: optional ``[H]`` per-head sink logits (gpt-oss style: ``exp(sink_h)`` joins
            each row's softmax denominator once, after the merge); differentiable.
        batch_digest: optional 0-d int64 CPU tensor, the digest of the global batch this
            rank's shard was cut from (``packing.Shard.batch_digest``; ``fringe.hf`` and
            ``fringe.titan`` pass it): it joins the agreement, so CP ranks that sharded
            different batches all raise. None (default): no batch check.

    Returns:
        out ``[B, H, L, D]`` for this rank's queries (and lse).

    Compiles: it is one custom op (``fringe::attention``, backward ``fringe::attention_backward``)
    to ``torch.compile``, with ``fullgraph=True``; a new plan of the same shapes (a new batch's
    documents) reuses the compiled graph.

    Raises:
        ValueError: this or another rank got invalid input (every rank raises, naming the
            rank), before any attention data moves.
        RankMismatch: ranks disagree on shapes, dtype, device, plan content, sinks, the
            batch digest ("CP ranks sharded different batches") or on whether a backward
            follows (a rank under ``torch.no_grad()`` while others train: "what follows").
        CommTimeout: a peer stopped answering.
    """
    if group is None:
        where = _op.DIST
    elif not torch.compiler.is_compiling():
        where = _op.register_group(group)
    elif is_device_mesh(group):
        where = _where(group)
    else:
        where = _op.ranks_where(dist.get_process_group_ranks(group))
    # one custom op, compiled or not: the agreement (every call, with this rank's input
    # validation), the forward programs and all communication run inside it
    out, lse = _attention(q, k, v, plan=plan, where=where, timeout_s=timeout_s, sinks=sinks,
                          batch=batch_digest)
    return (out, lse) if return_lse else out


@dataclasses.dataclass(frozen=True)
class RunStats:
    """Per-step records of a forward and backward on this rank."""

    forward: tuple
    backward: tuple

    @classmethod
    def of(cls, runtimes) -> RunStats:
        recs = {}
        for which in ("forward", "backward"):
            recs[which] = tuple(r for rt in runtimes for st in rt.last_states.get(which, {}).values()
                                for r in st.records)
        return cls(recs["forward"], recs["backward"])

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


def last_run(group=None) -> RunStats:
    """Compute and exposed-communication time per step of this rank's last call on ``group``.

    Raises:
        RuntimeError: no call of :func:`attention` on this group yet.
    """
    rt = _LAST.get(_group_key(group))
    if rt is None:
        raise RuntimeError("fringe.last_run(): no fringe.attention call on this group in this "
                           "process yet (pass the same group= as the call)")
    return RunStats.of([rt])


class Recording:
    """What :func:`recording` collects: every call's runtime, in order."""

    def __init__(self) -> None:
        self.runtimes: list = []

    def stats(self) -> RunStats:
        """All recorded calls' step records (forward and backward) together."""
        return RunStats.of(self.runtimes)

    def calls(self) -> list[RunStats]:
        """One :class:`RunStats` per recorded call."""
        return [RunStats.of([rt]) for rt in self.runtimes]


@contextlib.contextmanager
def recording():
    """Collect the step records of every :func:`attention` call in the block.

    >>> with fringe.recording() as rec:              # doctest: +SKIP
    ...     loss = model(batch); loss.backward()
    >>> rec.stats().summary()["backward"]["exposed"]  # doctest: +SKIP
    """
    rec = Recording()
    _RECORDERS.append(rec)
    try:
        yield rec
    finally:
        _RECORDERS.remove(rec)
