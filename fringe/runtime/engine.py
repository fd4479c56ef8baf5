"""Forward and backward of a plan for the ranks one process drives, on any transport.

Tensors are stacked over the driven ranks: ``q [R, B, H, L, D]``, ``k, v [R, B, G, L, D]``
(R = P on the virtual mesh, R = 1 under torch.distributed), and ``ranks`` names them.
"""
from __future__ import annotations

from typing import Sequence

import torch

from ..schedules.ir import Compute, GradCompute, buffer_name
from .interpreter import RankState, Transport, execute


def check_inputs(q, k, v, *, plan, local: bool) -> None:
    """Shape/dtype checks shared by the virtual and distributed entry points.

    Raises:
        TypeError: ``plan`` is not a :class:`fringe.Plan`, or q/k/v are not tensors.
        ValueError: shapes that do not fit the plan, with the fix.
    """
    from ..ops import check_qkv
    from ..plan import Plan
    if not isinstance(plan, Plan):
        raise TypeError(f"plan must be a fringe.Plan from fringe.plan(schedule, mask_mod, ...), "
                        f"got {type(plan).__name__}")
    check_qkv(q, k, v)
    want = plan.local_len if local else plan.seq_len
    where = "local (per-rank) " if local else "global "
    if q.shape[-2] != want or k.shape[-2] != want:
        raise ValueError(f"q has {q.shape[-2]} and k/v {k.shape[-2]} tokens, but the plan expects "
                         f"{where}length {want} (S={plan.seq_len}, P={plan.world_size}); "
                         f"re-plan with seq_len={q.shape[-2] * (plan.world_size if local else 1)}"
                         f" or pass tensors of the planned length")
    for name, val, size in (("batch_size", plan.batch_size, q.shape[0]),
                            ("num_heads", plan.num_heads, q.shape[1])):
        if val is not None and val != size:
            raise ValueError(f"the plan's mask was classified for {name}={val}, but q has {size}")
    for t in plan.score_params:
        if t.device != q.device:
            raise ValueError(f"a score_mod parameter is on {t.device} but q is on {q.device}")


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Accumulation dtype for out/lse/gradients: float64 stays, everything else float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def kept_names(plan, rank: int) -> list[str]:
    """kv buffers rank keeps from forward to backward when ``plan.kv == "keep"``."""
    if plan.kv != "keep":
        return []
    return sorted({buffer_name("kv", op.kv) for _, op in plan.forward[rank].ops()
                   if isinstance(op, Compute) and op.kv != rank})


def _rank_state(program, rank: int, k: torch.Tensor, v: torch.Tensor, *,
                grad_dtype: torch.dtype | None, protect: set[str]) -> RankState:
    """A rank's interpreter state holding its own kv (k and v packed as ``[2, B, G, L, D]``)."""
    own = torch.stack([k, v])
    grad_like = (None if grad_dtype is None else
                 torch.empty(own.shape, dtype=grad_dtype, device=own.device))
    st = RankState(rank, program, kv_like=own, grad_like=grad_like,
                   protect={buffer_name("kv", rank)} | protect)
    st.bufs[buffer_name("kv", rank)] = own
    return st


def _tile_args(plan, i: int, j: int, device: torch.device) -> dict:
    return dict(q_pos=plan.positions(i, device), kv_pos=plan.positions(j, device),
                mask_mod=plan.mask_mod, score_mod=plan.score_mod, scale=plan.scale,
                kind=plan.tile_kind(i, j), blocks=plan.tile_blocks(i, j),
                block_size=plan.block_size, kernel=plan.kernel)


def forward(plan, ranks: Sequence[int], q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
            transport: Transport):
    """Run the forward programs of ``ranks``.

    Returns:
        ``(out [R, B, H, L, D], lse [R, B, H, L], kept, states)`` where ``kept`` is a list of
        per-rank lists of kv buffers to save (empty unless ``plan.kv == "keep"``).
    """
    from ..ops import merge, tile_forward

    acc = acc_dtype(q.dtype)
    states, outs, lses = {}, {}, {}
    for n, r in enumerate(ranks):
        states[r] = _rank_state(plan.forward[r], r, k[n], v[n], grad_dtype=None,
                                protect=set(kept_names(plan, r)))
    index = {r: n for n, r in enumerate(ranks)}

    def compute(st: RankState, op) -> None:
        if not isinstance(op, Compute):
            raise RuntimeError(f"rank {st.rank}: forward program contains {op}")
        n = index[st.rank]
        kv = st.bufs[buffer_name("kv", op.kv)]
        o, l = tile_forward(q[n], kv[0], kv[1], **_tile_args(plan, op.q, op.kv, q.device))
        o, l = o.to(acc), l.to(acc)
        if st.rank in outs:
            outs[st.rank], lses[st.rank] = merge(outs[st.rank], lses[st.rank], o, l)
        else:
            outs[st.rank], lses[st.rank] = o, l

    execute({r: plan.forward[r] for r in ranks}, states, transport, compute)
    out, lse = [], []
    for n, r in enumerate(ranks):
        if r in outs:
            out.append(outs[r].to(q.dtype))
            lse.append(lses[r])
        else:                       # every tile of this rank's queries is empty
            out.append(torch.zeros_like(q[n]))
            lse.append(torch.full(q[n].shape[:-1], float("-inf"), dtype=acc, device=q.device))
    kept = [[states[r].bufs[name] for name in kept_names(plan, r)] for r in ranks]
    return torch.stack(out), torch.stack(lse), kept, states


def backward(plan, ranks: Sequence[int], q, k, v, out, lse, dout, dlse, kept,
             transport: Transport):
    """Run the backward programs of ``ranks``.

    ``dlse`` (``[R, B, H, L]`` or None) is the cotangent of the merged lse.

    Returns:
        ``(dq, dk, dv, dparams, states)``: gradients stacked over ``ranks``, and the
        gradients of ``plan.score_params`` summed over the tiles these ranks computed
        (this process's share; under torch.distributed each rank returns its own part).
    """
    from ..ops import tile_backward

    acc = acc_dtype(q.dtype)
    states, dqs = {}, {}
    params = tuple(plan.score_params)
    dparams = [torch.zeros(p.shape, dtype=acc, device=p.device) for p in params]
    index = {r: n for n, r in enumerate(ranks)}
    for n, r in enumerate(ranks):
        st = _rank_state(plan.backward[r], r, k[n], v[n], grad_dtype=acc,
                         protect={buffer_name("dkv", r)})
        for name, buf in zip(kept_names(plan, r), kept[n] if kept else []):
            st.bufs[name] = buf
        states[r] = st
        dqs[r] = torch.zeros(q[n].shape, dtype=acc, device=q.device)

    def compute(st: RankState, op) -> None:
        if not isinstance(op, GradCompute):
            raise RuntimeError(f"rank {st.rank}: backward program contains {op}")
        n = index[st.rank]
        kv = st.bufs[buffer_name("kv", op.kv)]
        res = tile_backward(q[n], kv[0], kv[1], out[n], lse[n], dout[n],
                            dlse=None if dlse is None else dlse[n], score_params=params,
                            **_tile_args(plan, op.q, op.kv, q.device))
        dq, dk, dv = res[:3]
        dqs[st.rank].add_(dq.to(acc))
        st.accumulate(buffer_name("dkv", op.kv), torch.stack([dk, dv]).to(acc))
        if params:
            for acc_p, g in zip(dparams, res[3]):
                acc_p.add_(g.to(acc))

    execute({r: plan.backward[r] for r in ranks}, states, transport, compute)
    dq, dk, dv = [], [], []
    for n, r in enumerate(ranks):
        dq.append(dqs[r].to(q.dtype))
        g = states[r].bufs.get(buffer_name("dkv", r))
        if g is None:
            dk.append(torch.zeros_like(k[n]))
            dv.append(torch.zeros_like(v[n]))
        else:
            dk.append(g[0].to(k.dtype))
            dv.append(g[1].to(v.dtype))
    dparams = tuple(g.to(p.dtype) for g, p in zip(dparams, params))
    return torch.stack(dq), torch.stack(dk), torch.stack(dv), dparams, states


class Runtime:
    """Runs plans for the ranks this process drives over transports from ``make_transport``.

    The virtual mesh (all P ranks, an in-memory transport) and torch.distributed (this
    process's rank, p2p over a process group) are both this class; only the ranks and the
    transport factory differ. ``last_states`` holds each direction's per-rank interpreter
    states (step records, pools) of the last run.
    """

    def __init__(self, ranks: Sequence[int], make_transport) -> None:
        self.ranks = list(ranks)
        self.make_transport = make_transport
        self.last_states: dict = {}

    def forward(self, plan, q, k, v):
        out, lse, kept, states = forward(plan, self.ranks, q, k, v, self.make_transport(q.device))
        self.last_states["forward"] = states
        return out, lse, kept

    def backward(self, plan, q, k, v, out, lse, dout, dlse, kept):
        dq, dk, dv, dparams, states = backward(plan, self.ranks, q, k, v, out, lse, dout, dlse,
                                               kept, self.make_transport(q.device))
        self.last_states["backward"] = states
        return dq, dk, dv, dparams
