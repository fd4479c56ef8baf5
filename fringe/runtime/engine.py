"""Forward and backward of a plan for the ranks one process drives, on any transport.

Tensors are stacked over the driven ranks: ``q [R, B, H, L, D]``, ``k [R, B, G, L, D]``,
``v [R, B, G, L, Dv]`` (Dv may differ from D, as in MLA; out is ``[..., Dv]``) (R = P on the
virtual mesh, R = 1 under torch.distributed), and ``ranks`` names them.
"""
from __future__ import annotations

from typing import Sequence

import torch

from ..masks import reads_bh
from ..ops import check_qkv, merge, tile_backward, tile_forward
from ..schedules.ir import Buffer, Compute, Family, GradCompute
from .contract import PlanLike
from .interpreter import RankState, Transport, check_head_split, execute, head_range, kv_shape


def check_inputs(q, k, v, *, plan: PlanLike, local: bool) -> None:
    """Shape/dtype checks shared by the virtual and distributed entry points.

    Raises:
        TypeError: ``plan`` is not a :class:`fringe.Plan` (has not every member of
            :class:`~fringe.runtime.contract.PlanLike`), or q/k/v are not tensors.
        ValueError: shapes that do not fit the plan, with the fix.
    """
    if not isinstance(plan, PlanLike):
        raise TypeError(f"plan must be a fringe.Plan from fringe.plan(schedule, mask_mod, ...), "
                        f"got {type(plan).__name__}")
    plan.check_unchanged()      # every call: plan state edited in place since it was built
    check_qkv(q, k, v)
    want = plan.local_len if local else plan.seq_len
    where = "local (per-rank) " if local else "global "
    if q.shape[-2] != want or k.shape[-2] != want:
        raise ValueError(f"q has {q.shape[-2]} and k/v {k.shape[-2]} tokens, but the plan expects "
                         f"{where}length {want} (S={plan.seq_len}, P={plan.world_size}); "
                         f"re-plan with seq_len={q.shape[-2] * (plan.world_size if local else 1)}"
                         f" or pass tensors of the planned length")
    check_classified(plan, q.shape[0], q.shape[1])
    for t in plan.score_params:
        if t.device != q.device:
            raise ValueError(f"a score_mod parameter is on {t.device} but q is on {q.device}")
    check_heads(plan, q.shape[1], k.shape[1])


def check_classified(plan: PlanLike, B: int, H: int) -> None:
    """A plan accepts only the B / H its mask was classified for (a block empty for b = 0
    may be read for b = 1: its tile would be skipped or its blocks not sent)."""
    for name, val, size in (("batch_size", plan.batch_size, B), ("num_heads", plan.num_heads, H)):
        if val is not None and val != size:
            raise ValueError(f"the plan's mask was classified for {name}={val} only (the value "
                             f"fringe.plan was given, or 1 when it was not given for a mask that "
                             f"cannot be proven to ignore b and h), but q has {size}; re-plan "
                             f"with fringe.plan(..., {name}={size})")


def check_stacked(plan: PlanLike, ranks: Sequence[int], q, k, v) -> None:
    """What the runtime is handed directly (``Runtime.forward`` / ``backward``): one slice of
    q, k, v per driven rank, each of the plan's local length, and ranks of the plan."""
    L, P = plan.local_len, plan.world_size
    if any(not 0 <= r < P for r in ranks):
        raise ValueError(f"ranks {list(ranks)} are not all ranks of the plan (world size {P})")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 5 or t.shape[0] != len(ranks) or t.shape[-2] != L:
            raise ValueError(f"{name} has shape {tuple(t.shape)}; the runtime takes [R, B, heads, "
                             f"L, D] with R = {len(ranks)} (the ranks it drives) and L = {L} (the "
                             f"plan's local length, S={plan.seq_len} / P={P})")
    check_classified(plan, q.shape[1], q.shape[2])


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Accumulation dtype for out/lse/gradients: float64 stays, everything else float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def head_splits(plan: PlanLike) -> tuple[int, ...]:
    """The ways the plan's programs split heads (``n`` of every ``h<i>/<n>`` buffer), sorted
    (derived once per plan: ``plan.cache.head_splits``, written here only)."""
    hit = plan.cache.head_splits
    if hit is None:
        found, tables = set(), set()
        for progs in (plan.forward, plan.backward):
            for prog in progs:
                tab = prog.table
                if tab is not None:               # every program form: read its columns
                    if id(tab) not in tables:
                        tables.add(id(tab))
                        found.update(tab.head_splits())
                    continue
                for _, op in prog.ops():
                    for b in op.reads() + op.writes():
                        if b.heads is not None:
                            found.add(b.heads[1])
        hit = plan.cache.head_splits = tuple(sorted(found))
    return hit


def check_heads(plan: PlanLike, num_heads: int, kv_heads: int) -> None:
    """Raise before any communication if the plan splits heads in a way H and G do not allow."""
    for n in head_splits(plan):
        check_head_split(n, num_heads, kv_heads,
                         what=f"schedule {plan.schedule.name!r} (heads split {n} ways)")


def kept_names(plan: PlanLike, rank: int) -> list[Buffer]:
    """kv buffers rank keeps from forward to backward when ``plan.kv == "keep"``."""
    if plan.kv != "keep":
        return []
    return plan.forward[rank].remote_reads(Family.KV)


def _shapes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
    """``like(buf) -> (shape, dtype)`` of a rank's whole-heads buffers, by family.

    q ``[B, H, L, D]`` and kv ``[2, B, G, L, D]`` (``[1, B, G, L, D + Dv]`` when v's head dim
    Dv differs, see :func:`~fringe.runtime.interpreter.kv_shape`) in the input dtype; (out, lse)
    packed as ``[B, H, L, Dv+1]`` and (dout, dlse) likewise, and the gradients, in the
    accumulation dtype.
    """
    B, H, L, D = q.shape
    G, Dv = k.shape[1], v.shape[-1]
    acc = acc_dtype(q.dtype)
    kv = kv_shape(B, G, L, D, Dv)
    table = {Family.Q: ((B, H, L, D), q.dtype), Family.KV: (kv, k.dtype),
             Family.OUT: ((B, H, L, Dv + 1), acc), Family.DOUT: ((B, H, L, Dv + 1), acc),
             Family.DQ: ((B, H, L, D), acc), Family.DKV: (kv, acc)}
    return lambda b: table[b.family]


def _rank_state(program, rank: int, q, k, v, *, like, backward: bool,
                protect: set[str], block_size: int) -> RankState:
    """A rank's interpreter state holding its own q and kv (``block_size``: what the
    program's block ranges count in, ``plan.block_size``).

    k and v are held as the parts of the rank's kv buffer (packed ``[2, B, G, L, D]``, or
    ``[1, B, G, L, D + Dv]``, only if sent), borrowed: never written.
    """
    mine = {Family.Q, Family.KV, Family.OUT, Family.DOUT, Family.DQ, Family.DKV}
    protect = set(protect) | {Buffer.of(f, rank) for f in mine}
    st = RankState(rank, program, like=like, heads=(q.shape[1], k.shape[1]), device=q.device,
                   protect=protect, merge_out=None if backward else merge,
                   kv_split=None if k.shape[-1] == v.shape[-1] else k.shape[-1],
                   block_size=block_size)
    st.bufs[Buffer.of(Family.Q, rank)] = q
    st.set_parts(Buffer.of(Family.KV, rank), (k, v), borrowed=True)
    return st


def _own_pieces(st: RankState, family: Family) -> list[Buffer]:
    """The rank's own buffers of ``family`` (whole, then head slices in order)."""
    found = [b for b in (*st.bufs, *st.parts) if b.family is family and b.chunk == st.rank]
    return sorted(found, key=lambda b: (b.heads is not None, b.heads or (0, 0)))


def _shifted(plan: PlanLike, offset: int):
    """The plan's mask_mod and score_mod seeing global head ``h + offset`` (derived once per
    plan and offset: ``plan.cache.head_shift``, written here only)."""
    cache = plan.cache.head_shift
    if offset not in cache:
        mask, score = plan.mask_mod, plan.score_mod
        if offset and mask is not None and reads_bh(mask, seq_len=plan.seq_len).h:
            base_mask = mask

            def mask(b, h, q_idx, kv_idx):
                return base_mask(b, h + offset, q_idx, kv_idx)
        if offset and score is not None:
            base_score = score

            def score(s, b, h, q_idx, kv_idx):
                return base_score(s, b, h + offset, q_idx, kv_idx)
        cache[offset] = (mask, score)
    return cache[offset]


def _tile_args(plan: PlanLike, op, device: torch.device, num_heads: int) -> dict:
    i, j = op.q, op.kv
    offset = 0 if op.heads is None else op.heads[0] * (num_heads // op.heads[1])
    mask_mod, score_mod = _shifted(plan, offset)
    return dict(q_pos=plan._positions(i, device), kv_pos=plan._positions(j, device),
                mask_mod=mask_mod, score_mod=score_mod, scale=plan.scale,
                kind=plan.tile_kind(i, j), blocks=plan._tile_blocks(i, j),
                block_size=plan.block_size, kernel=plan.kernel,
                cache=True)   # the plan's mask_mod is a snapshot, its maps and positions cached


def forward(plan: PlanLike, ranks: Sequence[int], q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
            transport: Transport):
    """Run the forward programs of ``ranks``.

    Returns:
        ``(out [R, B, H, L, Dv], lse [R, B, H, L], kept, states)`` where ``kept`` is a list of
        per-rank lists of kv buffers to save (empty unless ``plan.kv == "keep"``).
    """
    acc = acc_dtype(q.dtype)
    H = q.shape[2]
    check_stacked(plan, ranks, q, k, v)         # the entry points check it too; Runtime not
    check_heads(plan, H, k.shape[2])
    like = _shapes(q[0], k[0], v[0])
    states = {}
    for n, r in enumerate(ranks):
        states[r] = _rank_state(plan.forward[r], r, q[n], k[n], v[n], like=like, backward=False,
                                protect=set(kept_names(plan, r)), block_size=plan.block_size)

    def compute(st: RankState, op) -> None:
        if not isinstance(op, Compute):
            raise RuntimeError(f"rank {st.rank}: forward program contains {op}")
        qb, kvb = op.reads()
        ob = op.writes()[0]
        k_, v_ = st.get_parts(kvb)
        o, l = tile_forward(st.get(qb), k_, v_, **_tile_args(plan, op, q.device, H))
        if st.has(ob):                  # lse-weighted merge into the partial output
            st.combine(ob, (o, l), merge)
        else:                           # the tile's own result, kept (packed only if sent)
            st.set_parts(ob, (o.to(acc), l.to(acc)), borrowed=False)

    execute({r: plan.forward[r] for r in ranks}, states, transport, compute)
    out, lse = [], []
    for n, r in enumerate(ranks):
        st = states[r]
        pieces = _own_pieces(st, Family.OUT)
        if len(pieces) == 1 and pieces[0].heads is None:     # one whole output: no copy
            o, l = st.get_parts(pieces[0])
            out.append(o.to(q.dtype))
            lse.append(l)
            continue
        o = torch.zeros((*q[n].shape[:-1], v.shape[-1]), dtype=acc,   # no tile: out 0, lse -inf
                        device=q.device)
        l = torch.full(q[n].shape[:-1], float("-inf"), dtype=acc, device=q.device)
        written = torch.zeros(H, dtype=torch.bool)
        for b in pieces:                        # partial outputs home: merge by lse
            lo, hi = (0, H) if b.heads is None else head_range(b, H, k.shape[2])[1:]
            po, pl = st.get_parts(b)
            if written[lo:hi].any():
                mo, ml = merge(o[:, lo:hi], l[:, lo:hi], po, pl)
            else:
                mo, ml = po, pl
            o[:, lo:hi].copy_(mo)
            l[:, lo:hi].copy_(ml)
            written[lo:hi] = True
        out.append(o.to(q.dtype))
        lse.append(l)
    kept = [[states[r].get(name) for name in kept_names(plan, r)] for r in ranks]
    for st in states.values():                  # the records stay; the tensors go
        st.drop_buffers()
    return _stack(out), _stack(lse), kept, states


def backward(plan: PlanLike, ranks: Sequence[int], q, k, v, out, lse, dout, dlse, kept,
             transport: Transport):
    """Run the backward programs of ``ranks``.

    ``dlse`` (``[R, B, H, L]`` or None) is the cotangent of the merged lse.

    Returns:
        ``(dq, dk, dv, dparams, states)``: gradients stacked over ``ranks``, and the
        gradients of ``plan.score_params`` summed over the tiles these ranks computed
        (this process's share; under torch.distributed each rank returns its own part).
    """
    acc = acc_dtype(q.dtype)
    H = q.shape[2]
    check_stacked(plan, ranks, q, k, v)         # the entry points check it too; Runtime not
    check_heads(plan, H, k.shape[2])
    states = {}
    params = tuple(plan.score_params)
    dparams = [torch.zeros(p.shape, dtype=acc, device=p.device) for p in params]
    like = _shapes(q[0], k[0], v[0])
    for n, r in enumerate(ranks):
        st = _rank_state(plan.backward[r], r, q[n], k[n], v[n], like=like, backward=True,
                         protect=set(), block_size=plan.block_size)
        for name, buf in zip(kept_names(plan, r), kept[n] if kept else []):
            st.bufs[name] = buf
            st.protect.add(name)
        st.set_parts(Buffer.of(Family.OUT, r), (out[n], lse[n]), borrowed=True)
        st.set_parts(Buffer.of(Family.DOUT, r),
                     (dout[n], torch.zeros_like(lse[n]) if dlse is None else dlse[n]),
                     borrowed=True)
        states[r] = st              # dq / dkv: the first tile's gradients, no zero fill

    def compute(st: RankState, op) -> None:
        if not isinstance(op, GradCompute):
            raise RuntimeError(f"rank {st.rank}: backward program contains {op}")
        qb, kvb, ob, dob = op.reads()
        dqb, dkvb = op.writes()
        (k_, v_), (o, l), (do, dl) = st.get_parts(kvb), st.get_parts(ob), st.get_parts(dob)
        res = tile_backward(st.get(qb), k_, v_, o.to(out.dtype), l, do.to(dout.dtype),
                            dlse=None if dlse is None else dl, score_params=params,
                            **_tile_args(plan, op, q.device, H))
        dq, dk, dv = res[:3]            # fresh tensors: handed to the state (no copy)
        st.accumulate_parts(dqb, (dq.to(acc),))
        st.accumulate_parts(dkvb, (dk.to(acc), dv.to(acc)))
        if params:
            for acc_p, g in zip(dparams, res[3]):
                acc_p.add_(g.to(acc))

    execute({r: plan.backward[r] for r in ranks}, states, transport, compute)
    dq, dk, dv = [], [], []
    for n, r in enumerate(ranks):
        st = states[r]
        b = Buffer.of(Family.DQ, r)
        dq.append(st.get_parts(b)[0].to(q.dtype) if st.has(b) else torch.zeros_like(q[n]))
        b = Buffer.of(Family.DKV, r)
        if st.has(b):
            gk, gv = st.get_parts(b)
            dk.append(gk.to(k.dtype))
            dv.append(gv.to(v.dtype))
        else:                                   # no tile read this rank's kv
            dk.append(torch.zeros_like(k[n]))
            dv.append(torch.zeros_like(v[n]))
        st.drop_buffers()
    dparams = tuple(g.to(p.dtype) for g, p in zip(dparams, params))
    return (_stack(dq, contiguous=False), _stack(dk, contiguous=False),
            _stack(dv, contiguous=False), dparams, states)


def _stack(ts: list, *, contiguous: bool = True) -> torch.Tensor:
    """``torch.stack`` of per-rank results (each freshly made here); for one rank (every real
    rank runs only itself) no copy, unless ``contiguous`` and the result is strided (out and
    lse: callers may ``.view`` them). Gradients keep the kernel's strides (the fused CPU
    kernel writes them ``[B, L, H, D]``-major): autograd copies them into the layout of the
    input's ``.grad`` where it must, as it does for dense SDPA."""
    if len(ts) == 1:
        return (ts[0].contiguous() if contiguous else ts[0]).unsqueeze(0)
    return torch.stack(ts)


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

    def forward(self, plan: PlanLike, q, k, v):
        out, lse, kept, states = forward(plan, self.ranks, q, k, v, self.make_transport(q.device))
        self.last_states["forward"] = states
        return out, lse, kept

    def backward(self, plan: PlanLike, q, k, v, out, lse, dout, dlse, kept):
        dq, dk, dv, dparams, states = backward(plan, self.ranks, q, k, v, out, lse, dout, dlse,
                                               kept, self.make_transport(q.device))
        self.last_states["backward"] = states
        return dq, dk, dv, dparams
