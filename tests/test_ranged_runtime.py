"""The runtime moves block ranges of a chunk (``S kv3[0:2,4:6]->r2``): only their tokens
travel, packed in one tensor; the receiver holds the rest as zeros (primal) or accumulates the
ranges (gradients); the step records count the real bytes.

Hand-written ranged programs on packed documents (a ring whose kv hops carry only the blocks
the rest of their route attends, with its head-sliced variant, an all-gather whose slots carry
what each member attends, and a program that moves q and gets dq back in ranges) and the
built-in schedules as fringe.plan ranges them (compose's head-sliced hops included): float64
against the dense reference, forward and backward (dkv, dq and kv re-sends ranged by
fringe.plan's reverse), both kv policies, GQA and MLA (Dv != D); every step record's bytes
equal its transfers' (ranges counted in tokens) and are fewer than whole chunks', and the
results are bit for bit those of whole chunks (``ranges=False``). The interpreter's rules one
rank at a time (packing from parts, zero fill of a reused pool buffer, accumulation); ranges
that do not fit are refused; gloo equals the virtual mesh bit for bit on a ranged plan.
"""
from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

import fringe
from fringe import layout as _layout
from fringe import masks
from fringe.launch import Workers
from fringe.ops import reference
from fringe.runtime import RankState
from fringe.runtime.interpreter import kv_shape
from fringe.runtime.virtual import VirtualRuntime
from fringe.schedules import Schedule, ScheduleError
from fringe.schedules.ir import Buffer, Collective, Compute, Family, Program, Recv, Send, Step
from fringe.testing import make_qkv, oracle, packed_docs, tolerances

TOL = tolerances(torch.float64)
BS = 4                                  # block size (tokens)


# ---- masks and what each tile needs ------------------------------------------------------------
def _docs(S: int, seed: int) -> torch.Tensor:
    """Document ids of a few random-length documents over S tokens."""
    g = torch.Generator().manual_seed(seed)
    cuts = torch.randperm(S - 1, generator=g)[:4].sort().values + 1
    return torch.bucketize(torch.arange(S), cuts, right=True)


def _mask(S: int, seed: int):
    return masks.causal() & masks.document(_docs(S, seed))


def _need(mask, S: int, P: int) -> tuple[dict, dict]:
    """``(cols, rows)``: for each tile (q chunk i, kv chunk j) the blocks of kv chunk j (cols)
    and of q chunk i (rows) that are non-empty in it, on the contiguous layout (read from a
    plan of the built-in ring, which has that layout)."""
    base = fringe.plan(fringe.schedules.get("ring"), mask, seq_len=S, world_size=P, block_size=BS)
    assert base.layout.order.equal(torch.arange(S))          # contiguous: what we hand-write for
    cols, rows = {}, {}
    for i in range(P):
        for j in range(P):
            t = base.tile_blocks(i, j) != 0
            cols[i, j] = set(torch.nonzero(t.any(0)).flatten().tolist())
            rows[i, j] = set(torch.nonzero(t.any(1)).flatten().tolist())
    return cols, rows


def _runs(blocks: set) -> tuple | None:
    """Canonical half-open ranges of a set of block indices (None for none)."""
    out: list = []
    for b in sorted(blocks):
        if out and out[-1][1] == b:
            out[-1][1] = b + 1
        else:
            out.append([b, b + 1])
    return tuple(tuple(x) for x in out) or None


def _route(cols: dict, P: int, j: int, b: int) -> set:
    """The blocks of kv chunk j that ranks b, b+1, ... (up to j's owner, exclusive) attend:
    what a ring hop of kv j into rank b carries (and dkv j out of b brings back)."""
    got, r = set(), b
    while r != j:
        got |= cols[r, j]
        r = (r + 1) % P
    return got


# ---- hand-written ranged programs -------------------------------------------------------------
HEADS = {"whole": (None,), "sliced": ((0, 2), (1, 2))}


def ranged_ring(cols: dict, P: int, *, heads: str = "whole", ranged: bool = True) -> Schedule:
    """The ring on the contiguous layout, each kv hop carrying only the blocks the rest of its
    route attends (``heads="sliced"``: every compute and hop split in two head slices;
    ``ranged=False``: the same hops, whole)."""
    hs = HEADS[heads]

    def programs(world_size: int) -> list[Program]:
        assert world_size == P
        progs = []
        for r in range(P):
            steps = []
            for s in range(P):
                j = (r - s) % P
                ops = [Compute(r, j, h) for h in hs] if s == 0 or cols[r, j] else []
                if s < P - 1:
                    out = _runs(_route(cols, P, j, (r + 1) % P))
                    if out:
                        out = out if ranged else None
                        ops += [Send(Buffer.of(Family.KV, j, h), (r + 1) % P, out) for h in hs]
                    jin = (r - s - 1) % P
                    got = _runs(_route(cols, P, jin, r))
                    if got:
                        got = got if ranged else None
                        ops += [Recv(Buffer.of(Family.KV, jin, h), (r - 1) % P, got) for h in hs]
                steps.append(Step(s, tuple(ops)))
            progs.append(Program(r, tuple(steps)))
        return progs
    return Schedule(f"ranged_ring({heads})", layout=_layout.contiguous, programs_fn=programs)


def ranged_allgather(cols: dict, P: int, *, ranged: bool = True) -> Schedule:
    """One all-gather of kv on the contiguous layout whose slots carry only the blocks the
    receiving member attends (an empty slot where it attends none); ``ranged=False``: the
    same slots, whole."""
    def programs(world_size: int) -> list[Program]:
        assert world_size == P
        group = tuple(range(P))
        progs = []
        for r in range(P):
            sends = [Buffer.of(Family.KV, r) if k != r and cols[k, r] else None for k in group]
            recvs = [Buffer.of(Family.KV, k) if k != r and cols[r, k] else None for k in group]
            sk = [_runs(cols[k, r]) if ranged and b else None for k, b in zip(group, sends)]
            rk = [_runs(cols[r, k]) if ranged and b else None for k, b in zip(group, recvs)]
            gather = Collective("AG", group, sends, recvs, sk, rk)
            later = tuple(Compute(r, k) for k in group if recvs[k] is not None)
            progs.append(Program(r, (Step(0, (Compute(r, r), gather)), Step(1, later))))
        return progs
    return Schedule("ranged_allgather", layout=_layout.contiguous, programs_fn=programs)


def q_visit(rows: dict, *, ranged: bool = True) -> Schedule:
    """P=2: rank 1 sends the blocks of q1 that attend kv0 to rank 0 (ranged), rank 0 computes
    that tile and sends the partial out1 back (whole: out never moves in ranges).
    ``ranged=False``: q1 moves whole."""
    qb = _runs(rows[1, 0])
    assert qb is not None
    qb = qb if ranged else None

    def programs(world_size: int) -> list[Program]:
        assert world_size == 2
        q1, out1 = Buffer.of(Family.Q, 1), Buffer.of(Family.OUT, 1)
        return [Program(0, (Step(0, (Compute(0, 0), Recv(q1, 1, qb))),
                            Step(1, (Compute(1, 0),)), Step(2, (Send(out1, 1),)))),
                Program(1, (Step(0, (Compute(1, 1), Send(q1, 0, qb))),
                            Step(2, (Recv(out1, 0),))))]
    return Schedule("q_visit", layout=_layout.contiguous, programs_fn=programs)


# ---- running and checking ---------------------------------------------------------------------
def _qkv(S: int, *, H: int, G: int, D: int, Dv: int, seed: int):
    q, k, _ = make_qkv(B=2, H=H, G=G, S=S, D=D, seed=seed)
    g = torch.Generator().manual_seed(seed + 7)
    v = torch.randn(2, G, S, Dv, generator=g, dtype=torch.float64)
    dout = torch.randn(2, H, S, Dv, generator=g, dtype=torch.float64)
    return q, k, v, dout


def _dense(mask, q, k, v, dout) -> list[torch.Tensor]:
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    out, _ = reference.attention(qg, kg, vg, mask_mod=mask)
    return [out.detach(), *torch.autograd.grad(out, (qg, kg, vg), dout)]


def _run(plan, q, k, v, dout):
    """Forward and backward on the virtual mesh through the runtime: ``([out, dq, dk, dv],
    {"forward": states, "backward": states})``."""
    lay, P = plan.layout, plan.world_size

    def stack(t):
        return torch.stack([lay.shard(t, r) for r in range(P)])
    rt = VirtualRuntime(P)
    qs, ks, vs = stack(q), stack(k), stack(v)
    out, lse, kept = rt.forward(plan, qs, ks, vs)
    dq, dk, dv, _ = rt.backward(plan, qs, ks, vs, out, lse, stack(dout), None, kept)
    return [lay.unshard(list(x)) for x in (out, dq, dk, dv)], rt.last_states


def _assert_dense(got, want, what: str) -> None:
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
        assert_close(a, b, **TOL, msg=lambda m, n=name: f"{what} {n}: {m}")


def _bytes_per_token(buf: Buffer, *, B, H, G, D, Dv) -> int:
    """Bytes one token of ``buf`` moves (float64 inputs: every family is 8 bytes an element)."""
    n = 1 if buf.heads is None else buf.heads[1]
    if buf.family in (Family.KV, Family.DKV):
        heads = G // n if G % n == 0 else 1
        return 8 * B * heads * (D + Dv)
    per = {Family.Q: D, Family.DQ: D, Family.OUT: Dv + 1, Family.DOUT: Dv + 1}[buf.family]
    return 8 * B * (H // n) * per


def _records(states) -> dict:
    """``{rank: {step: (sent_bytes, recv_bytes)}}`` of interpreter states' step records."""
    return {r: {rec.step: (rec.sent_bytes, rec.recv_bytes) for rec in st.records}
            for r, st in states.items()}


def _moves(prog, st, *, L, **dims) -> tuple[int, int]:
    """``(sent, received)`` bytes of a step's transfers: a ranged one its ranges' tokens, a
    whole one (and a collective slot for another member) the chunk's L."""
    def size(buf, blocks=None):
        tokens = L if blocks is None else sum(hi - lo for lo, hi in blocks) * BS
        return tokens * _bytes_per_token(buf, **dims)
    return oracle.moved_bytes((*st.comms, *st.collectives), prog.rank, size)


def _assert_bytes(programs, records: dict, **dims) -> int:
    """Each step record's sent and received bytes (``records`` as :func:`_records` gives them)
    are its transfers' (:func:`_moves`); returns the total received."""
    total = 0
    for prog in programs:
        if prog.rank not in records:
            continue
        for st in prog.steps:
            want = _moves(prog, st, **dims)
            assert records[prog.rank][st.index] == want, \
                (prog.rank, st.index, [str(o) for o in st.ops])
            total += want[1]
    return total


def _has_ranges(programs, families) -> bool:
    return any(op.blocks is not None and op.buf.family in families
               for prog in programs for st in prog.steps for op in st.comms)


def _check_run(plan, mask, q, k, v, dout, *, what: str) -> tuple[int, list]:
    """Forward and backward equal the dense reference, every step record's bytes are its
    transfers' (ranges counted in tokens); returns the forward's received bytes and
    ``[out, dq, dk, dv]``."""
    got, states = _run(plan, q, k, v, dout)
    _assert_dense(got, _dense(mask, q, k, v, dout), what)
    B, H, _, D = q.shape
    dims = dict(L=plan.local_len, B=B, H=H, G=k.shape[1], D=D, Dv=v.shape[-1])
    _assert_bytes(plan.backward, _records(states["backward"]), **dims)
    return _assert_bytes(plan.forward, _records(states["forward"]), **dims), got


# ---- hand-written ranged programs, end to end -------------------------------------------------
CASES = [  # (P, H, G, D, Dv, heads, kv, seed)
    (2, 2, 1, 4, 4, "whole", "resend", 0),
    (3, 4, 2, 4, 4, "whole", "keep", 1),        # GQA
    (4, 4, 1, 6, 3, "whole", "resend", 2),      # GQA + MLA (Dv < D)
    (3, 2, 2, 3, 5, "whole", "keep", 3),        # MLA (Dv > D)
    (4, 4, 2, 4, 4, "sliced", "resend", 1),     # head slices kv_j h i/2 in ranges
    (3, 4, 4, 3, 5, "sliced", "keep", 5),       # head slices + MLA
]


@pytest.mark.parametrize("P,H,G,D,Dv,heads,kv,seed", CASES)
def test_a_ranged_ring_matches_dense_and_moves_only_the_ranges(P, H, G, D, Dv, heads, kv, seed):
    S = P * BS * 4
    mask = _mask(S, seed)
    cols, _ = _need(mask, S, P)
    plan = fringe.plan(ranged_ring(cols, P, heads=heads), mask, seq_len=S, world_size=P,
                       block_size=BS, kv=kv)
    whole = fringe.plan(ranged_ring(cols, P, heads=heads, ranged=False), mask, seq_len=S,
                        world_size=P, block_size=BS, kv=kv, ranges=False)
    assert _has_ranges(plan.forward, (Family.KV,)) and _has_ranges(plan.backward, (Family.DKV,))
    assert _has_ranges(plan.backward, (Family.KV,)) == (kv == "resend")
    q, k, v, dout = _qkv(S, H=H, G=G, D=D, Dv=Dv, seed=seed)
    moved, _ = _check_run(plan, mask, q, k, v, dout, what="ranged")
    assert 0 < moved < _check_run(whole, mask, q, k, v, dout, what="whole")[0]


@pytest.mark.parametrize("kv", ["resend", "keep"])
def test_q_and_dq_move_in_ranges(kv):
    P, S, H, G, D, Dv = 2, 2 * BS * 4, 4, 2, 4, 3
    docs = torch.tensor([0] * 5 + [1] * 20 + [2] * 7)     # doc 1 spans both ranks (16 each)
    mask = masks.causal() & masks.document(docs)
    _, rows = _need(mask, S, P)
    plan = fringe.plan(q_visit(rows), mask, seq_len=S, world_size=P, block_size=BS, kv=kv)
    whole = fringe.plan(q_visit(rows, ranged=False), mask, seq_len=S, world_size=P,
                        block_size=BS, kv=kv, ranges=False)
    assert _has_ranges(plan.forward, (Family.Q,)) and _has_ranges(plan.backward, (Family.DQ,))
    q, k, v, dout = _qkv(S, H=H, G=G, D=D, Dv=Dv, seed=11)
    moved, _ = _check_run(plan, mask, q, k, v, dout, what="ranged")
    assert 0 < moved < _check_run(whole, mask, q, k, v, dout, what="whole")[0]


@pytest.mark.parametrize("P,G,Dv,kv", [(3, 2, 4, "resend"), (4, 1, 3, "keep")])
def test_a_ranged_allgather_and_its_reduce_scatter_match_dense(P, G, Dv, kv):
    S = P * BS * 4
    mask = _mask(S, P + 6)
    cols, _ = _need(mask, S, P)
    plan, whole = (fringe.plan(ranged_allgather(cols, P, ranged=r), mask, seq_len=S,
                               world_size=P, block_size=BS, kv=kv, ranges=r)
                   for r in (True, False))
    assert any(op.ranged for prog in plan.forward for st in prog.steps for op in st.collectives)
    ranged = [op for prog in plan.backward for st in prog.steps for op in st.collectives
              if op.ranged]
    assert any(op.kind == "RS" for op in ranged)
    assert any(op.kind == "AG" for op in ranged) == (kv == "resend")
    q, k, v, dout = _qkv(S, H=4, G=G, D=4, Dv=Dv, seed=P)
    moved, _ = _check_run(plan, mask, q, k, v, dout, what="ranged")
    assert 0 < moved < _check_run(whole, mask, q, k, v, dout, what="whole")[0]


# ---- the built-in schedules, ranged by fringe.plan --------------------------------------------
BUILTIN = [  # (schedule, mask, P, H, G, D, Dv, kv)
    ("ring", "documents", 4, 4, 2, 4, 4, "resend"),
    ("zigzag", "documents", 4, 4, 1, 6, 3, "keep"),          # GQA + MLA
    ("striped", "window", 3, 2, 2, 4, 4, "resend"),
    ("balanced", "documents", 4, 4, 2, 3, 5, "resend"),      # MLA (Dv > D)
    ("zigzag", "window", 2, 2, 1, 4, 4, "keep"),
    ("compose:zigzag+ulysses:2", "documents", 4, 4, 2, 4, 4, "resend"),  # head-sliced ranges
    ("compose:zigzag+ulysses:2", "window", 4, 4, 4, 4, 3, "keep"),
]


@pytest.mark.parametrize("name,mask_kind,P,H,G,D,Dv,kv", BUILTIN)
def test_builtin_schedules_with_ranges_match_dense_and_whole_chunks_bit_for_bit(
        name, mask_kind, P, H, G, D, Dv, kv):
    S = P * BS * 8
    mask = (masks.causal() & masks.document(packed_docs(S, 2 * P, seed=P))
            if mask_kind == "documents" else masks.causal() & masks.sliding_window(3 * BS))
    plan, whole = (fringe.plan(fringe.schedules.get(name), mask, seq_len=S, world_size=P,
                               block_size=BS, kv=kv, ranges=r) for r in (True, False))
    assert _has_ranges(plan.forward, (Family.KV,))
    assert not _has_ranges(whole.forward + whole.backward, tuple(Family))
    if name.startswith("compose"):
        assert any(op.blocks is not None and op.buf.heads is not None
                   for prog in plan.forward for st in prog.steps for op in st.comms)
    q, k, v, dout = _qkv(S, H=H, G=G, D=D, Dv=Dv, seed=P + H)
    moved, got = _check_run(plan, mask, q, k, v, dout, what=f"{name} ranged")
    most, want = _check_run(whole, mask, q, k, v, dout, what=f"{name} whole")
    assert 0 < moved < most
    # zeros outside the ranges are never read unmasked: the same bits as whole chunks
    for what, a, b in zip(("out", "dq", "dk", "dv"), got, want):
        assert torch.equal(a, b), what


# ---- the interpreter's rules, one rank at a time ----------------------------------------------
def _state(*, B=1, G=2, L=8, D=3, Dv=3, H=2, program=None) -> RankState:
    kv = kv_shape(B, G, L, D, Dv)
    table = {Family.Q: ((B, H, L, D), torch.float64), Family.KV: (kv, torch.float64),
             Family.DQ: ((B, H, L, D), torch.float64), Family.DKV: (kv, torch.float64)}
    return RankState(0, program or Program(0, ()), like=lambda b: table[b.family], heads=(H, G),
                     device="cpu", kv_split=None if D == Dv else D, block_size=2)


@pytest.mark.parametrize("D,Dv", [(3, 3), (3, 5)])
def test_a_ranged_send_packs_the_ranges_tokens_from_the_parts(D, Dv):
    st = _state(D=D, Dv=Dv)
    g = torch.Generator().manual_seed(0)
    k = torch.randn(1, 2, 8, D, generator=g, dtype=torch.float64)
    v = torch.randn(1, 2, 8, Dv, generator=g, dtype=torch.float64)
    st.set_parts("kv0", (k, v), borrowed=True)
    idx = torch.tensor([0, 1, 4, 5, 6, 7])                 # blocks [0:1] and [2:4] of 2 tokens
    out = st.outgoing("kv0", ((0, 1), (2, 4)))
    if D == Dv:
        want = torch.stack([k[:, :, idx], v[:, :, idx]])
    else:
        want = torch.cat([k[:, :, idx], v[:, :, idx]], dim=-1).unsqueeze(0)
    assert out.shape[3] == 6 and out.is_contiguous()
    assert torch.equal(out, want)
    half = st.outgoing("kv0h1/2", ((1, 2),))               # a head slice's range
    assert torch.equal(half, st.outgoing("kv0", ((1, 2),))[:, :, 1:2])
    assert st.parts and not st.bufs                         # sent from the parts, none packed


def test_a_ranged_arrival_is_zeros_outside_its_ranges_even_from_a_reused_pool_buffer():
    st = _state()
    shape = kv_shape(1, 2, 8, 3, 3)
    poisoned = torch.full(shape, float("nan"), dtype=torch.float64)
    st.pool.put(poisoned)                                   # a reused buffer: garbage in it
    got = torch.arange(2 * 2 * 2 * 3, dtype=torch.float64).reshape(2, 1, 2, 2, 3) + 1
    st.arrived("kv1", got.clone(), ((3, 4),))              # tokens 6, 7
    buf = st.get("kv1")
    assert buf.data_ptr() == poisoned.data_ptr()            # the pool's buffer, refilled
    assert torch.equal(buf[:, :, :, 6:], got)
    assert torch.equal(buf[:, :, :, :6], torch.zeros(2, 1, 2, 6, 3, dtype=torch.float64))
    # a second range of the same buffer fills in, the first stays
    st.arrived("kv1", got.clone() * 2, ((0, 1),))
    assert torch.equal(buf[:, :, :, :2], 2 * got) and torch.equal(buf[:, :, :, 6:], got)
    # a head slice whose whole buffer is absent: a zero buffer of the slice's shape
    st.arrived("kv2h0/2", got[:, :, :1].clone(), ((3, 4),))
    sl = st.get("kv2h0/2")
    assert sl.shape == (2, 1, 1, 8, 3) and torch.equal(sl[:, :, :, 6:], got[:, :, :1])
    assert not sl[:, :, :, :6].any()


def test_ranged_gradients_accumulate_into_the_buffer_here():
    st = _state()
    g = torch.Generator().manual_seed(1)
    a = torch.randn(kv_shape(1, 2, 4, 3, 3), generator=g, dtype=torch.float64)
    b = torch.randn(kv_shape(1, 2, 2, 3, 3), generator=g, dtype=torch.float64)
    st.arrived("dkv1", a.clone(), ((0, 2),))               # absent: zeros, then the ranges
    st.arrived("dkv1", b.clone(), ((1, 2),))               # present: added
    want = torch.zeros(kv_shape(1, 2, 8, 3, 3), dtype=torch.float64)
    want[:, :, :, :4] += a
    want[:, :, :, 2:4] += b
    assert torch.equal(st.get("dkv1"), want)
    # this rank's own gradient, a head slice in ranges: accumulated into the whole buffer
    st.arrived("dkv0h1/2", b[:, :, 1:].clone(), ((3, 4),))
    whole = st.get("dkv0")
    assert whole.shape == kv_shape(1, 2, 8, 3, 3)
    assert torch.equal(whole[:, :, 1:, 6:], b[:, :, 1:]) and not whole[:, :, :1].any()
    dq = torch.randn(1, 2, 2, 3, generator=g, dtype=torch.float64)
    st.arrived("dq1", dq.clone(), ((2, 3),))
    assert torch.equal(st.get("dq1")[:, :, 4:6], dq) and st.get("dq1").abs().sum() == dq.abs().sum()


def test_a_ranged_transfer_needs_the_block_size():
    st = _state()
    st.block_size = None
    st.set_parts("kv0", (torch.zeros(1, 2, 8, 3, dtype=torch.float64),) * 2, borrowed=True)
    with pytest.raises(RuntimeError, match="block_size"):
        st.outgoing("kv0", ((0, 1),))


# ---- ranges that do not fit never reach the runtime ---------------------------------------------
def _one_hop(buf: Buffer, blocks) -> Schedule:
    """P=2: kv0 (or q1, out1 coming back) moves once, with ``blocks``."""
    def programs(world_size: int) -> list[Program]:
        if buf.family is Family.KV:
            return [Program(0, (Step(0, (Compute(0, 0), Send(buf, 1, blocks))),)),
                    Program(1, (Step(0, (Compute(1, 1), Recv(buf, 0, blocks))),
                                Step(1, (Compute(1, 0),))))]
        q1 = Buffer.of(Family.Q, 1)
        return [Program(0, (Step(0, (Compute(0, 0), Recv(q1, 1))), Step(1, (Compute(1, 0),)),
                            Step(2, (Send(buf, 1, blocks),)))),
                Program(1, (Step(0, (Compute(1, 1), Send(q1, 0))),
                            Step(2, (Recv(buf, 0, blocks),))))]
    return Schedule(f"one_hop({buf})", layout=_layout.contiguous, programs_fn=programs)


@pytest.mark.parametrize("buf,blocks,match", [
    ("kv0", ((0, 2), (3, 5)), r"blocks up to 5 of a chunk of 4 blocks"),
    ("out1", ((0, 1),), r"out buffer moves block ranges; only q, kv, dq, dkv may")])
def test_ranges_that_do_not_fit_are_refused_by_plan_and_by_the_rank_state(buf, blocks, match):
    """fringe.plan refuses them (so no call ever communicates them); a RankState driven by
    hand refuses out in ranges too."""
    with pytest.raises(ScheduleError, match=match):
        fringe.plan(_one_hop(Buffer(buf), blocks), masks.causal(), seq_len=2 * BS * 4,
                    world_size=2, block_size=BS)
    st = _state()
    with pytest.raises(RuntimeError, match="only q/kv/dq/dkv buffers may"):
        st.incoming("out1", ((0, 1),))


# ---- gloo equals the virtual mesh bit for bit on ranged plans ----------------------------------
#: (schedule, kv policy): the hand-ranged ring (point to point) and the built-in all-gather,
#: whose slots fringe.plan ranges (collectives, and their reduce-scatter)
GLOO = [("ranged_ring", "resend"), ("ranged_ring", "keep"), ("allgather", "resend")]


def _gloo_case(P: int, name: str, kv: str):
    S = P * BS * 4
    mask = _mask(S, 9)
    cols, _ = _need(mask, S, P)
    sched = ranged_ring(cols, P) if name == "ranged_ring" else fringe.schedules.get(name)
    plan = fringe.plan(sched, mask, seq_len=S, world_size=P, block_size=BS, kv=kv)
    q, k, v, dout = _qkv(S, H=4, G=2, D=4, Dv=4, seed=9)
    return plan, mask, q, k, v, dout


def worker_ranged(rank: int, world_size: int, cases):
    res = {}
    for case in cases:
        plan, _, q, k, v, dout = _gloo_case(world_size, *case)
        lay = plan.layout
        ql, kl, vl = (lay.shard(t, rank).requires_grad_() for t in (q, k, v))
        out = fringe.attention(ql, kl, vl, plan=plan, timeout_s=60)
        grads = torch.autograd.grad(out, (ql, kl, vl), lay.shard(dout, rank))
        run = fringe.last_run()
        res[case] = dict(got=[out.detach(), *grads], records={
            which: {rec.step: (rec.sent_bytes, rec.recv_bytes) for rec in getattr(run, which)}
            for which in ("forward", "backward")})
        if rank == 0:   # the virtual mesh, in the same kind of process (same threads)
            qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
            sim = fringe.simulate.attention(qg, kg, vg, plan=plan)
            res[case]["sim"] = [sim.detach(), *torch.autograd.grad(sim, (qg, kg, vg), dout)]
    return res


def test_gloo_equals_the_virtual_mesh_bit_for_bit_on_ranged_plans():
    P = 3
    with Workers(P, timeout_s=120) as w:
        res = w.run(worker_ranged, GLOO)
    for case in GLOO:
        plan, mask, q, k, v, dout = _gloo_case(P, *case)
        if case[0] == "allgather":
            assert any(op.ranged for prog in plan.forward + plan.backward for st in prog.steps
                       for op in st.collectives)
        else:
            assert _has_ranges(plan.forward, (Family.KV,))
            assert _has_ranges(plan.backward, (Family.DKV,))
        sim = res[0][case]["sim"]
        for i, what in enumerate(("out", "dq", "dk", "dv")):
            got = plan.layout.unshard([res[r][case]["got"][i] for r in range(P)])
            assert torch.equal(got, sim[i]), f"{case} {what}: gloo differs from the virtual mesh"
        dims = dict(L=plan.local_len, B=2, H=4, G=2, D=4, Dv=4)
        for which, progs in (("forward", plan.forward), ("backward", plan.backward)):
            _assert_bytes(progs, {r: res[r][case]["records"][which] for r in range(P)}, **dims)
        _assert_dense(sim, _dense(mask, q, k, v, dout), f"gloo {case}")


@pytest.mark.parametrize("name", ["batch_size", "num_heads"])
def test_the_runtime_refuses_a_batch_or_heads_the_plan_was_not_classified_for(name):
    """A mask that reads b (or h) classified for one b: its ranges (and skipped tiles) are
    those of b = 0. ``Runtime.forward`` / ``backward`` ran it on B = 2 and returned wrong
    numbers (the entry points refused it; the runtime did not)."""
    i = 0 if name == "batch_size" else 1
    m = lambda b, h, q, k: (q >= k) & ((q - k < 10) | ((b, h)[i] == 1))     # noqa: E731
    plan = fringe.plan(fringe.schedules.get("ring"), m, seq_len=32, world_size=2,
                       block_size=BS, **{name: 1})
    assert _has_ranges(plan.forward, (Family.KV,))
    q, k, v, dout = _qkv(32, H=2, G=2, D=4, Dv=4, seed=0)          # B = 2, H = 2
    with pytest.raises(ValueError, match=f"classified for {name}=1 only"):
        _run(plan, q, k, v, dout)
    rt, lay = VirtualRuntime(2), plan.layout
    qs, ks, vs = (torch.stack([lay.shard(t, r) for r in range(2)]) for t in (q, k, v))
    with pytest.raises(ValueError, match=f"classified for {name}=1 only"):
        rt.backward(plan, qs, ks, vs, qs, qs[..., 0], qs, None, None)


@pytest.mark.parametrize("S,R", [(32, 2), (128, 2), (96, 3), (32, 1)])
def test_the_runtime_refuses_inputs_not_stacked_for_its_ranks(S, R):
    """``Runtime.forward`` took 3 ranks' slices on a 2-rank mesh (dropping one silently) and
    failed deep inside on other lengths: named instead."""
    plan = fringe.plan(fringe.schedules.get("ring"), _mask(64, 0), seq_len=64, world_size=2,
                       block_size=BS)
    q, k, v, _ = _qkv(S, H=2, G=2, D=4, Dv=4, seed=0)
    L = S // R
    qs, ks, vs = (torch.stack([t[..., r * L:(r + 1) * L, :] for r in range(R)]) for t in (q, k, v))
    with pytest.raises(ValueError, match="the runtime takes"):
        VirtualRuntime(2).forward(plan, qs, ks, vs)
    with pytest.raises(ValueError, match="the runtime takes"):
        VirtualRuntime(2).backward(plan, qs, ks, vs, qs, qs[..., 0], qs, None, None)
