"""Collectives and moving queries in the IR: allgather, ulysses, compose, their derived backwards.

Virtual-mesh properties (float64, out/lse/dq/dk/dv vs the dense reference), the adjoint
dot-product test on every collective, the all-to-all round trip, structural checks and text
forms, and gloo ranks at P=4 bit-equal to the virtual mesh.
"""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st
from torch.testing import assert_close

import fringe
from fringe import masks, render, schedules
from fringe.launch import Workers
from fringe.ops import reference
from fringe.runtime import RankState, VirtualMesh, execute
from fringe.schedules import Collective, Program, ScheduleError, Step, check, parse_op, reverse
from fringe.schedules.ir import Buffer, Family, format_programs, parse_programs
from fringe.testing import mask_family, make_qkv, oracle, tolerances

BLOCK = 2


def _schedule(name: str):
    if name == "allgather":
        return schedules.allgather(), None
    if name == "allgather3":
        return schedules.allgather(pieces=3), None
    if name == "ulysses":
        return schedules.ulysses(), None
    outer, k = {"compose2x2": ("zigzag", 2), "compose2x3": ("ring", 2),
                "compose3x2": ("zigzag", 3), "compose_ag": ("allgather", 2)}[name]
    return schedules.compose(getattr(schedules, outer)(), schedules.ulysses(), inner_size=k), k


def _mask(kind: str, S: int):
    return mask_family(kind if kind in ("causal", "document", "window", "lambda") else "per_head", S)


def _alibi(score, b, h, q, kv):
    return score - 0.25 * (h + 1) * (q - kv).abs()


def _run(plan, q, k, v, dout, dlse):
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    out, lse = fringe.simulate.attention(qg, kg, vg, plan=plan, return_lse=True)
    grads = torch.autograd.grad((out, lse), (qg, kg, vg), (dout, dlse))
    return out.detach(), lse.detach(), grads


def _dense(mask, score_mod, q, k, v, dout, dlse):
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    out, lse = reference.attention(qg, kg, vg, mask_mod=mask, score_mod=score_mod)
    grads = torch.autograd.grad((out, lse), (qg, kg, vg), (dout, dlse))
    return out.detach(), lse.detach(), grads


SCHED = ["allgather", "allgather3", "ulysses", "compose2x2", "compose2x3", "compose3x2",
         "compose_ag"]
MASKS = ["causal", "document", "window", "lambda", "per_head"]


@settings(deadline=None, max_examples=14)
@given(st.sampled_from(SCHED), st.sampled_from(MASKS), st.integers(0, 10_000))
def test_collective_schedules_match_dense_attention_in_float64(name, mask_kind, seed):
    sched, k = _schedule(name)
    g = torch.Generator().manual_seed(seed)
    if k is None:
        P = int(torch.randint(1, 5, (), generator=g))
    else:
        P = k * (2 if name != "compose2x3" else 3)
    H = 4 if P in (1, 2, 4) else 6 if P in (3, 6) else 4
    if name.startswith("compose"):
        H = 2 * k
    if name == "ulysses" and H % P:
        H = P
    G = [H, max(1, H // 2), 1][seed % 3]                  # GQA, incl. kv heads replicated
    if name.startswith("ulysses") or name.startswith("compose"):
        n = P if name == "ulysses" else k
        if not (G % n == 0 or n % G == 0):
            G = H
    S = 2 * P * BLOCK * (2 + seed % 2)
    mask = _mask(mask_kind, S)
    score_mod = _alibi if seed % 4 == 0 else None
    plan = fringe.plan(sched, mask, seq_len=S, world_size=P, block_size=BLOCK,
                       num_heads=H if mask_kind == "per_head" else None, score_mod=score_mod,
                       kv="keep" if seed % 5 == 0 else "resend")
    q, kk, v = make_qkv(B=2, H=H, G=G, S=S, D=4, seed=seed)
    dout = torch.randn(q.shape, generator=g, dtype=torch.float64)
    dlse = torch.randn(q.shape[:-1], generator=g, dtype=torch.float64)
    got = _run(plan, q, kk, v, dout, dlse)
    want = _dense(mask, score_mod, q, kk, v, dout, dlse)
    tol = tolerances(torch.float64)
    assert_close(got[0], want[0], **tol)
    finite = torch.isfinite(want[1])
    assert torch.equal(torch.isfinite(got[1]), finite)
    assert_close(got[1][finite], want[1][finite], **tol)
    for what, a, b in zip(("dq", "dk", "dv"), got[2], want[2]):
        assert_close(a, b, **tol, msg=lambda s: f"{name} {mask_kind} P={P} H={H} G={G} {what}: {s}")


# ---- the collectives themselves: adjoints -------------------------------------------------
def _mesh_run(programs, init, *, shape, heads):
    """Run ``programs`` (no computes) on the virtual mesh from ``init[r] = {name: tensor}``."""
    P = len(programs)
    states = {}
    for r in range(P):
        keep = set(init[r]) | set(programs[r].last_uses())      # keep everything to look at
        st_ = RankState(r, programs[r], like=lambda b: (shape(b), torch.float64), heads=heads,
                        device="cpu", protect=keep)
        for name, t in init[r].items():
            st_.bufs[Buffer(name)] = t.clone()
        states[r] = st_
    execute({r: programs[r] for r in range(P)}, states, VirtualMesh(P), lambda *_: None)
    return states


def _one_step(ops_by_rank):
    return [Program(r, (Step(0, tuple(ops)),)) for r, ops in enumerate(ops_by_rank)]


def _ulysses_a2a(P: int, fam: Family) -> list[Collective]:
    g = tuple(range(P))
    return [Collective("A2A", g, tuple(Buffer.of(fam, r, (s, P)) for s in g),
                       tuple(Buffer.of(fam, s, (r, P)) for s in g)) for r in g]


def _allgather(P: int, keep) -> list[Collective]:
    g = tuple(range(P))
    return [Collective("AG", g, tuple(Buffer.of(Family.KV, r) if keep(k, r) and k != r else None
                                      for k in g),
                       tuple(Buffer.of(Family.KV, k) if keep(r, k) and k != r else None for k in g))
            for r in g]


CASES = {  # name -> (world size, forward collective per rank, H, G)
    "allgather": (4, lambda: _allgather(4, lambda i, j: True), 2, 2),
    "allgather_pruned": (4, lambda: _allgather(4, lambda i, j: j < i or (i + j) % 3 == 0), 2, 2),
    "a2a_q_heads": (4, lambda: _ulysses_a2a(4, Family.Q), 8, 4),
    "a2a_kv_heads": (2, lambda: _ulysses_a2a(2, Family.KV), 4, 2),
    "a2a_kv_replicated": (4, lambda: _ulysses_a2a(4, Family.KV), 4, 2),     # P % G == 0
    "a2a_kv_single_head": (4, lambda: _ulysses_a2a(4, Family.KV), 4, 1),
}


def _shapes(H, G):
    def shape(b):
        fam = b.family
        if fam in (Family.KV, Family.DKV):
            full = [2, 1, G, 3, 2]
        else:
            full = [1, H, 3, 2]
        if b.heads is not None:
            from fringe.runtime.interpreter import head_range
            dim, lo, hi = head_range(b, H, G)
            full[dim] = hi - lo
        return tuple(full)
    return shape


@pytest.mark.parametrize("case", sorted(CASES))
def test_every_collective_is_adjoint_to_its_backward(case):
    """<A x, y> == <x, A^T y>, with A^T the op's adjoint() run by the real interpreter."""
    P, make, H, G = CASES[case]
    fwd = make()
    bwd = [op.adjoint() for op in fwd]
    assert all(op.adjoint().adjoint() == op for op in fwd)
    assert {op.kind for op in bwd} == {"RS" if fwd[0].kind == "AG" else "A2A"}
    shape = _shapes(H, G)
    g = torch.Generator().manual_seed(len(case))
    fam = next(b.family for op in fwd for b in op.reads())
    x = {r: torch.randn(shape(Buffer.of(fam, r)), generator=g, dtype=torch.float64)
         for r in range(P)}
    fstates = _mesh_run(_one_step([[op] for op in fwd]), [{Buffer.of(fam, r): x[r]} for r in range(P)],
                        shape=shape, heads=(H, G))
    ax_y, init = 0.0, []
    for r, op in enumerate(fwd):
        cot = {}
        for b in op.writes():                        # what arrived (and the rank's own slot)
            y = torch.randn(shape(b), generator=g, dtype=torch.float64)
            ax_y += float((fstates[r].get(b) * y).sum())
            cot[b.cotangent] = y
        own = Buffer.of(fam.cotangent, r)
        base = torch.zeros(shape(own), dtype=torch.float64)
        init.append({own: base, **{b: y for b, y in cot.items() if b.parent != own}})
        for b, y in cot.items():                     # the own slot stays in place: its view
            if b.parent == own and b != own:
                from fringe.runtime.interpreter import head_range
                dim, lo, hi = head_range(b, H, G)
                base.narrow(dim, lo, hi - lo).add_(y)
            elif b == own:
                base.add_(y)
    bstates = _mesh_run(_one_step([[op] for op in bwd]), init, shape=shape, heads=(H, G))
    x_aty = sum(float((x[r] * bstates[r].bufs[Buffer.of(fam.cotangent, r)]).sum())
                for r in range(P))
    assert ax_y == pytest.approx(x_aty, rel=1e-12, abs=1e-12)


@pytest.mark.parametrize("P,fam", [(4, Family.Q), (2, Family.KV), (3, Family.OUT)])
def test_all_to_all_then_its_adjoint_is_the_identity(P, fam):
    H, G = 12, 12
    shape = _shapes(H, G)
    fwd = _ulysses_a2a(P, fam)
    g = torch.Generator().manual_seed(P)
    x = {r: torch.randn(shape(Buffer.of(fam, r)), generator=g, dtype=torch.float64)
         for r in range(P)}
    fstates = _mesh_run(_one_step([[op] for op in fwd]), [{Buffer.of(fam, r): x[r]} for r in range(P)],
                        shape=shape, heads=(H, G))
    init = []
    for r, op in enumerate(fwd):    # feed what arrived back as cotangents of the same slots
        own = Buffer.of(fam.cotangent, r)
        d = {own: torch.zeros(shape(own), dtype=torch.float64)}
        for b in op.writes():
            if b.parent != Buffer.of(fam, r):
                d[b.cotangent] = fstates[r].get(b).clone()
            else:
                d[own].narrow(*_narrow(b, H, G)).copy_(fstates[r].get(b))
        init.append(d)
    bstates = _mesh_run(_one_step([[op.adjoint()] for op in fwd]), init, shape=shape, heads=(H, G))
    for r in range(P):
        assert torch.equal(bstates[r].bufs[Buffer.of(fam.cotangent, r)], x[r])


def _narrow(b, H, G):
    from fringe.runtime.interpreter import head_range
    dim, lo, hi = head_range(b, H, G)
    return dim, lo, hi - lo


# ---- structure, text, checks, errors ------------------------------------------------------
@pytest.mark.parametrize("name", ["allgather", "ulysses", "compose2x2", "compose_ag"])
def test_text_forms_round_trip_and_backward_is_derived(name):
    sched, _ = _schedule(name)
    p = fringe.plan(sched, masks.causal(), seq_len=48, world_size=4, block_size=BLOCK)
    for progs in (p.forward, p.backward):
        assert parse_programs(format_programs(progs)) == list(progs)
        assert parse_programs(format_programs(progs, ascii=False)) == list(progs)
        assert format_programs(progs).isascii()
        for prog in progs:
            for _, op in prog.ops():
                assert parse_op(op.ascii()) == op == parse_op(str(op))
    # every forward op's adjoint is in the backward at the mirrored step
    T = 1 + max(s.index for prog in p.forward for s in prog.steps)
    bwd = {(prog.rank, t, op) for prog in p.backward for t, op in prog.ops()}
    for prog in p.forward:
        for t, op in prog.ops():
            assert (prog.rank, T - t, op.adjoint()) in bwd
    text = render.table(p) + render.table(p, backward=True)
    if name != "compose2x2":
        assert ("AG[0-3]" in text) == name.startswith("allgather")
    assert ("RS[" in text) == ("AG[" in text)


def test_document_mask_gathers_only_what_a_rank_needs():
    S, P = 64, 4
    ids = torch.repeat_interleave(torch.arange(4), S // 4)       # one document per rank
    p = fringe.plan(schedules.allgather(), masks.causal() & masks.document(ids), seq_len=S,
                    world_size=P, block_size=BLOCK)
    moved = [b for prog in p.forward for _, op in prog.ops() if isinstance(op, Collective)
             for b in op.recvs if b is not None]
    full = fringe.plan(schedules.allgather(), masks.causal(), seq_len=S, world_size=P,
                       block_size=BLOCK)
    moved_full = [b for prog in full.forward for _, op in prog.ops() if isinstance(op, Collective)
                  for b in op.recvs if b is not None]
    assert len(moved) < len(moved_full)
    assert all(int(p.tiles[prog.rank, b.chunk]) != 0 for prog in p.forward
               for _, op in prog.ops() if isinstance(op, Collective) for b in op.recvs
               if b is not None)


def test_check_names_a_member_that_skips_a_collective():
    good = fringe.plan(schedules.ulysses(), masks.causal(), seq_len=16, world_size=2,
                       block_size=BLOCK).forward
    bad = [good[0], Program(1, tuple(s for s in good[1].steps if s.index != 0))]
    with pytest.raises(ScheduleError, match=r"rank 1 issues 0 collective\(s\) over group \[0, 1\]"
                                            r"(.|\n)*<-- ERROR HERE") as got:
        check(bad)
    with pytest.raises(ScheduleError) as want:          # the op-by-op rules say the same
        oracle.check(bad)
    assert str(got.value) == str(want.value)
    swapped = parse_op("A2A[0,1] q1h0/2,q1h1/2 > q0h1/2,q1h1/2")
    wrong = parse_op("A2A[0,1] q1h0/2,q1h1/2 > q0h0/2,q1h1/2")
    assert swapped != wrong
    assert good[1].steps[0].ops[0] == swapped
    p1 = Program(1, (Step(0, (wrong,) + good[1].steps[0].ops[1:]),) + good[1].steps[1:])
    with pytest.raises(ScheduleError, match="receives") as got:
        check([good[0], p1])
    with pytest.raises(ScheduleError) as want:
        oracle.check([good[0], p1])
    assert str(got.value) == str(want.value)


def test_reverse_of_a_collective_program_rematerialises_inputs_once():
    p = fringe.plan(schedules.ulysses(), masks.causal(), seq_len=16, world_size=2, block_size=BLOCK)
    again = reverse(p.forward)
    assert again == list(p.backward)
    from fringe.testing import oracle
    assert again == oracle.reverse(p.forward)                   # the rules, op by op
    kept = fringe.plan(schedules.ulysses(), masks.causal(), seq_len=16, world_size=2,
                       block_size=BLOCK, kv="keep")
    fams = {b.family for prog in kept.backward for _, op in prog.ops() if isinstance(op, Collective)
            for b in op.recvs if b is not None}
    assert Family.KV not in fams and Family.Q in fams          # kv kept, q re-gathered


@pytest.mark.parametrize("H,G,match", [(6, 6, "query heads divisible by 4"),
                                       (12, 6, "kv heads G=6 to split 4 ways")])
def test_ulysses_rejects_heads_it_cannot_split_before_any_communication(H, G, match):
    S, P = 16, 4
    p = fringe.plan(schedules.ulysses(), masks.causal(), seq_len=S, world_size=P, block_size=BLOCK)
    q, k, v = make_qkv(B=1, H=H, G=G, S=S, D=2, seed=0)
    with pytest.raises(ValueError, match=match):
        fringe.simulate.attention(q, k, v, plan=p)


def test_compose_rejects_what_it_cannot_do():
    with pytest.raises(ValueError, match="inner schedule must be schedules.ulysses"):
        schedules.compose(schedules.ulysses(), schedules.zigzag(), inner_size=2)
    with pytest.raises(ValueError, match="world_size divisible by 3"):
        fringe.plan(schedules.compose(schedules.ring(), schedules.ulysses(), inner_size=3),
                    masks.causal(), seq_len=32, world_size=4, block_size=BLOCK)


# ---- gloo ranks --------------------------------------------------------------------------
GLOO = ["allgather", "ulysses", "compose2x2"]


def _gloo_case(name: str, P: int, seed: int):
    S = 2 * P * BLOCK * 2
    mask = masks.causal() & masks.sliding_window(S // 2)
    plan = fringe.plan(_schedule(name)[0], mask, seq_len=S, world_size=P, block_size=BLOCK)
    q, k, v = make_qkv(B=2, H=4, G=2, S=S, D=4, seed=seed)
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(seed + 1),
                       dtype=torch.float64)
    return plan, mask, q, k, v, dout


def worker_collectives(rank: int, world_size: int, names, seed: int):
    res = {}
    for name in names:
        plan, mask, q, k, v, dout = _gloo_case(name, world_size, seed)
        lay = plan.layout
        ql, kl, vl = (lay.shard(t, rank).requires_grad_() for t in (q, k, v))
        out = fringe.attention(ql, kl, vl, plan=plan, timeout_s=60)
        grads = torch.autograd.grad(out, (ql, kl, vl), lay.shard(dout, rank))
        res[name] = [out.detach(), *grads]
        if rank == 0:
            qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
            sim = fringe.simulate.attention(qg, kg, vg, plan=plan)
            res[name + "/sim"] = [sim.detach(), *torch.autograd.grad(sim, (qg, kg, vg), dout)]
    return res


def test_gloo_collectives_match_dense_and_the_virtual_mesh_bit_for_bit():
    P, seed = 4, 11
    with Workers(P, timeout_s=120) as w:
        res = w.run(worker_collectives, GLOO, seed)
    for name in GLOO:
        plan, mask, q, k, v, dout = _gloo_case(name, P, seed)
        qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
        ref, _ = reference.attention(qg, kg, vg, mask_mod=mask)
        grads = torch.autograd.grad(ref, (qg, kg, vg), dout)
        lay = plan.layout
        for i, (what, want) in enumerate(zip(("out", "dq", "dk", "dv"), (ref.detach(), *grads))):
            got = lay.unshard([res[r][name][i] for r in range(P)])
            assert_close(got, want, **tolerances(torch.float64),
                         msg=lambda s: f"{name} {what}: {s}")
            assert torch.equal(got, res[0][name + "/sim"][i]), f"{name} {what}: gloo != virtual"


def test_collective_schedule_docstrings_show_their_grid():
    import doctest
    import fringe.schedules.collectives as mod
    result = doctest.testmod(mod, optionflags=doctest.NORMALIZE_WHITESPACE,
                             extraglobs=dict(fringe=fringe, masks=masks, render=render,
                                             schedules=schedules))
    assert result.attempted >= 6 and result.failed == 0


def worker_collective_timeout(rank: int, world_size: int):
    from fringe.runtime.distributed import CommTimeout, DistTransport
    op = parse_op("A2A[0,1] q0h0/2,q0h1/2 > q0h0/2,q1h0/2") if rank == 0 else None
    if rank == 1:                       # never joins the collective
        return "absent"
    tr = DistTransport(None, timeout_s=2, device=torch.device("cpu"))
    h = tr.issue(0, 3, [], [], [(op, [None, torch.zeros(4)], [None, torch.empty(4)])])
    try:
        tr.wait(0, 3, h)
    except CommTimeout as e:
        return str(e)
    return "no error"


def test_a_member_that_never_joins_a_collective_ends_in_a_timeout_naming_it():
    with Workers(2, timeout_s=60) as w:
        msgs = w.run(worker_collective_timeout)
    assert msgs[1] == "absent"
    assert msgs[0].startswith("rank 0, step 3: collective 'A2A[0,1] q0h0/2,q0h1/2 > q0h0/2,q1h0/2' "
                              "over group [0, 1] did not complete within 2s"), msgs[0]
