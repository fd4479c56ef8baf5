"""2D context parallelism with a sequence schedule inside the groups (a double ring).

``schedules.compose(outer, inner, inner_size=k)`` with inner ring / zigzag / striped /
balanced / allgather: float64 out/lse/dq/dk/dv against the dense reference on the virtual
mesh (grids 2x2, 2x3, 4x2 x mask families x GQA), the layout rule, the adjoint dot-product
test on probe tiles, the structure (cross-group traffic only along slot planes, pruning
by the mask), errors naming what works, and gloo ranks on a 2D DeviceMesh.
"""
from __future__ import annotations

import collections

import pytest
import torch
from hypothesis import given, settings, strategies as st
from torch.testing import assert_close

import fringe
from fringe import layout, masks, render, schedules
from fringe.launch import Workers
from fringe.ops import reference
from fringe.schedules import Collective, Send, check, parse_op, reverse
from fringe.schedules.ir import format_programs, parse_programs, steps_of
from fringe.testing import make_qkv, mask_family, probe_adjoint, tolerances

BLOCK = 2
MASKS = ["causal", "document", "window", "lambda", "per_head"]


def _sched(outer: str, inner: str, k: int):
    return schedules.compose(getattr(schedules, outer)(), getattr(schedules, inner)(),
                             inner_size=k)


def _plan(outer, inner, m, k, mask, *, S=None, H=None, kv="resend", score_mod=None):
    """A plan of compose(outer, inner, inner_size=k) on m groups (H: num_heads for per_head)."""
    P = m * k
    S = S or 2 * P * BLOCK * 2
    return fringe.plan(_sched(outer, inner, k), mask, seq_len=S, world_size=P, block_size=BLOCK,
                       num_heads=H, score_mod=score_mod, kv=kv)


def _alibi(score, b, h, q, kv):
    return score - 0.25 * (h + 1) * (q - kv).abs()


def _grads(fn, q, k, v, dout, dlse):
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    out, lse = fn(qg, kg, vg)
    live = torch.isfinite(lse)
    grads = torch.autograd.grad((out, torch.where(live, lse, 0.0)), (qg, kg, vg), (dout, dlse))
    return [out.detach(), lse.detach(), *grads]


def _assert_matches_dense(plan, mask, *, H, G, seed, score_mod=None, what=""):
    q, k, v = make_qkv(B=1, H=H, G=G, S=plan.seq_len, D=4, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    dout = torch.randn(q.shape, generator=g, dtype=torch.float64)
    dlse = torch.randn(q.shape[:-1], generator=g, dtype=torch.float64)
    got = _grads(lambda a, b, c: fringe.simulate.attention(a, b, c, plan=plan, return_lse=True),
                 q, k, v, dout, dlse)
    want = _grads(lambda a, b, c: reference.attention(a, b, c, mask_mod=mask, score_mod=score_mod),
                  q, k, v, dout, dlse)
    tol = tolerances(torch.float64)
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), got, want):
        live = torch.isfinite(b)
        assert torch.equal(torch.isfinite(a), live), f"{what} {name}: -inf rows differ"
        assert_close(a[live], b[live], **tol, msg=lambda s: f"{what} {name}: {s}")


# every inner x grid once; outer, mask family and G rotate
CASES = [(outer, inner, m, k, MASKS[n % 5], [4, 2, 1][n % 3])
         for n, ((inner, outer), (m, k)) in enumerate(
             [(io, grid) for io in [("ring", "zigzag"), ("zigzag", "zigzag"), ("allgather", "ring")]
              for grid in [(2, 2), (2, 3), (4, 2)]])]


@pytest.mark.parametrize("outer,inner,m,k,mask_kind,G", CASES)
def test_double_ring_matches_dense_attention_in_float64(outer, inner, m, k, mask_kind, G):
    S = 2 * m * k * BLOCK * 2
    mask = mask_family(mask_kind, S)
    plan = _plan(outer, inner, m, k, mask, S=S, H=4 if mask_kind == "per_head" else None)
    _assert_matches_dense(plan, mask, H=4, G=G, seed=m * 10 + k,
                          what=f"{plan.schedule.name} {mask_kind} G={G}")


OUTERS = ["ring", "zigzag", "striped", "balanced", "allgather"]
INNERS = ["ring", "zigzag", "striped", "balanced", "allgather"]


@settings(deadline=None, max_examples=6)
@given(st.sampled_from(OUTERS), st.sampled_from(INNERS), st.sampled_from([(2, 2), (2, 3), (4, 2)]),
       st.sampled_from(MASKS), st.integers(0, 10_000))
def test_every_outer_and_inner_sequence_schedule_matches_dense(outer, inner, grid, mask_kind, seed):
    m, k = grid
    S = 2 * m * k * BLOCK * (2 + seed % 2)
    mask = mask_family(mask_kind, S)
    score_mod = _alibi if seed % 4 == 0 else None
    plan = _plan(outer, inner, m, k, mask, S=S, score_mod=score_mod,
                 H=4 if mask_kind == "per_head" else None, kv="keep" if seed % 3 == 0 else "resend")
    _assert_matches_dense(plan, mask, H=4, G=[4, 2, 1][seed % 3], seed=seed, score_mod=score_mod,
                          what=f"{plan.schedule.name} {mask_kind} kv={plan.kv}")


# ---- layout --------------------------------------------------------------------------------
def test_the_layout_is_the_outer_one_over_groups_split_by_the_inner_one():
    S, P = 64, 8
    for k in (2, 4):
        zz = _sched("zigzag", "zigzag", k).make_layout(S, P, block_size=BLOCK)
        assert torch.equal(zz.order, layout.zigzag(S, P, block_size=BLOCK).order)   # chunks r, 2P-1-r
        rr = _sched("ring", "ring", k).make_layout(S, P, block_size=BLOCK)
        assert torch.equal(rr.order, torch.arange(S))
    # zigzag over 2 groups, each group's 32 tokens striped over its 4 ranks
    lay = _sched("zigzag", "striped", 4).make_layout(S, P, block_size=BLOCK)
    group0 = layout.zigzag(S, 2, block_size=BLOCK).positions(0)
    inner = layout.striped(32, 4, stripe=BLOCK, block_size=BLOCK)
    for p in range(4):
        assert torch.equal(lay.positions(p), group0[inner.positions(p)])
    # the ulysses layout is unchanged: the outer one, each group's tokens split evenly
    uly = schedules.compose(schedules.zigzag(), schedules.ulysses(), inner_size=4)
    assert torch.equal(uly.make_layout(S, P, block_size=BLOCK).order,
                       layout.zigzag(S, 2, block_size=BLOCK).order)


# ---- structure -----------------------------------------------------------------------------
def _moves(progs):
    for prog in progs:
        for t, op in prog.ops():
            if isinstance(op, Send):
                yield t, prog.rank, op.peer, op.buf
            elif isinstance(op, Collective):
                me = op.group.index(prog.rank)
                for peer, b in zip(op.group, op.sends):
                    if b is not None and peer != prog.rank:
                        yield t, prog.rank, peer, b
                assert op.sends[me] is None


@pytest.mark.parametrize("outer,inner", [("ring", "ring"), ("zigzag", "zigzag"),
                                         ("allgather", "allgather"), ("ring", "allgather")])
def test_forward_traffic_crosses_groups_only_between_equal_slots(outer, inner):
    m, k = 3, 2
    p = _plan(outer, inner, m, k, masks.causal())
    assert _inner_uses(p, k)
    cross = [(s, d) for _, s, d, _ in _moves(p.forward) if s // k != d // k]
    assert cross and all(s % k == d % k for s, d in cross)
    # the backward is derived: every forward op's adjoint at the mirrored step
    T = steps_of(p.forward)
    bwd = collections.Counter((prog.rank, t, op) for prog in p.backward for t, op in prog.ops())
    fwd = collections.Counter((prog.rank, T - t, op.adjoint()) for prog in p.forward
                              for t, op in prog.ops())
    assert not fwd - bwd
    assert reverse(p.forward) == list(p.backward)
    for progs in (p.forward, p.backward):
        assert parse_programs(format_programs(progs)) == list(progs)
        for prog in progs:
            for _, op in prog.ops():
                assert parse_op(op.ascii()) == op


def _inner_uses(p, k):
    """True when some forward transfer stays inside a group (the inner schedule moves kv)."""
    return any(s // k == d // k for _, s, d, _ in _moves(p.forward))


@pytest.mark.parametrize("outer,inner", [("ring", "ring"), ("allgather", "zigzag"),
                                         ("zigzag", "allgather")])
def test_a_group_that_needs_nothing_of_another_receives_nothing(outer, inner):
    m, k = 2, 2
    S = 2 * m * k * BLOCK * 2
    # one document per group (zigzag groups hold chunks g and 2m-1-g: documents follow them)
    grp = _sched(outer, inner, k).make_layout(S, m * k, block_size=BLOCK)
    ids = torch.empty(S, dtype=torch.int64)
    for g in range(m):
        for p_ in range(k):
            ids[grp.positions(g * k + p_)] = g
    p = _plan(outer, inner, m, k, masks.causal() & masks.document(ids), S=S)
    assert not [(s, d) for _, s, d, _ in _moves(p.forward) if s // k != d // k]
    assert not [(s, d) for _, s, d, _ in _moves(p.backward) if s // k != d // k]
    assert _inner_uses(p, k)
    # causal: group 0 needs nothing of group 1 and receives none of its kv
    c = _plan(outer, inner, m, k, masks.causal(), S=S)
    got = {(r, b.chunk) for _, _, r, b in _moves(c.forward)}
    assert got and all(bool(c.tiles[r // k * k:(r // k + 1) * k, j].ne(0).any()) for r, j in got)


@pytest.mark.parametrize("outer,inner,m,k,mask_kind,kv", [
    ("ring", "ring", 2, 2, "causal", "resend"), ("zigzag", "zigzag", 2, 3, "window", "keep"),
    ("allgather", "ring", 4, 2, "document", "resend"), ("ring", "allgather", 2, 3, "lambda", "resend"),
    ("striped", "allgather", 4, 2, "causal", "keep")])
def test_backward_communication_is_the_adjoint_and_gradients_return_home(outer, inner, m, k,
                                                                         mask_kind, kv):
    S = 2 * m * k * BLOCK * 2
    p = _plan(outer, inner, m, k, mask_family(mask_kind, S), S=S, kv=kv)
    ax_y, x_aty, seen_fwd, seen_bwd, x, leftovers = probe_adjoint(p, seed=m * k)
    assert ax_y == pytest.approx(x_aty, rel=1e-12, abs=1e-12)
    assert set(seen_fwd) == set(seen_bwd) == {tuple(ij) for ij in p.tiles.ne(0).nonzero().tolist()}
    for (i, j), val in list(seen_fwd.items()) + list(seen_bwd.items()):
        assert torch.equal(val, x[j])
    assert not leftovers
    check(p.backward, need=p.tiles != 0, backward=True, kv=kv)


# ---- errors ------------------------------------------------------------------------------
def test_compose_rejects_what_cannot_work_and_names_what_works():
    works = "outer one of ring, zigzag, striped, balanced, allgather"
    with pytest.raises(ValueError, match=f"outer schedule must move sequence chunks(.|\n)*{works}"):
        schedules.compose(schedules.ulysses(), schedules.ring(), inner_size=2)
    inner = schedules.compose(schedules.ring(), schedules.ring(), inner_size=2)
    with pytest.raises(ValueError, match=f"cannot itself be composed(.|\n)*{works}"):
        schedules.compose(schedules.ring(), inner, inner_size=2)
    with pytest.raises(ValueError, match="outer schedule must move sequence chunks"):
        schedules.compose(inner, schedules.ring(), inner_size=2)
    with pytest.raises(ValueError, match="inner schedule cannot be schedules.auto()"):
        schedules.get("compose:ring+auto:2")        # (it failed at plan time, as a layout)
    with pytest.raises(ValueError, match="inner_size must be an int >= 1"):
        schedules.compose(schedules.ring(), schedules.ring(), inner_size=0)
    with pytest.raises(TypeError, match="takes two schedules"):
        schedules.compose(schedules.ring(), "ring", inner_size=2)
    with pytest.raises(ValueError, match="world_size divisible by 3"):
        _sched("ring", "zigzag", 3).make_layout(48, 4, block_size=BLOCK)
    # each group's S/m tokens must split by the inner layout: S=24, 2 groups of 3 -> 12 tokens,
    # zigzag needs 2*k*block = 12: fine; block 4 needs 24 per group: says so and how to fix
    with pytest.raises(ValueError, match=r"m=2 groups holds S/m=12 tokens(.|\n)*zigzag layout"):
        fringe.plan(_sched("ring", "zigzag", 3), masks.causal(), seq_len=24, world_size=6,
                    block_size=4)
    assert schedules.collectives.inner_size_of(inner) == 2
    assert schedules.collectives.inner_size_of(schedules.ring()) is None


@pytest.mark.parametrize("spec,P,block,S,pad", [
    ("compose:zigzag+ulysses:5", 5, 2, 10, 20),     # outer over m=1 group alone says 12
    ("compose:allgather:3+ulysses:3", 3, 4, 36, 48),  # ... says 40 (40 % 12 != 0)
    ("compose:zigzag+zigzag:3", 6, 2, 16, 24),      # inner on S/m=8 tokens says 12 (for S/m)
    ("compose:zigzag+balanced:2", 4, 2, 20, 24)])
def test_compose_layout_errors_give_a_length_the_whole_2d_layout_accepts(spec, P, block, S, pad):
    """The outer layout sees m groups and the inner one S/m tokens: their own remedies are for
    that part, not for S on P ranks; the error names P and a length that plans."""
    sched = schedules.get(spec)
    with pytest.raises(ValueError) as e:
        fringe.plan(sched, masks.causal(), seq_len=S, world_size=P, block_size=block)
    msg = str(e.value)
    assert f"on P={P} ranks" in msg and msg.count("pad the sequence to") == 1, msg
    assert f"pad the sequence to {pad} tokens" in msg, msg
    fringe.plan(sched, masks.causal(), seq_len=pad, world_size=P, block_size=block)
    u = P * block                            # and the smallest: every rank holds whole blocks
    for n in range(-(-S // u) * u, pad, u):
        with pytest.raises(ValueError):
            fringe.plan(sched, masks.causal(), seq_len=n, world_size=P, block_size=block)


def test_compose_docstring_shows_the_double_ring_grid():
    p = _plan("zigzag", "zigzag", 2, 2, masks.causal(), S=32)
    text = render.table(p)
    assert "compose(zigzag, zigzag, inner_size=2)" in text
    assert text in schedules.compose.__doc__.replace("\n    ", "\n")


# ---- gloo ranks on a 2D DeviceMesh -------------------------------------------------------
def _gloo_case(seed: int):
    S, P = 2 * 4 * BLOCK * 2, 4
    mask = masks.causal() & masks.sliding_window(S // 2)
    q, k, v = make_qkv(B=2, H=4, G=2, S=S, D=4, seed=seed)
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(seed + 1),
                       dtype=torch.float64)
    plans = {name: fringe.plan(sched, mask, seq_len=S, world_size=P, block_size=BLOCK)
             for name, sched in [("allgather x zigzag", _sched("allgather", "zigzag", 2)),
                                 ("zigzag x ulysses", schedules.compose(
                                     schedules.zigzag(), schedules.ulysses(), inner_size=2)),
                                 ("ring x ring, k=4", _sched("ring", "ring", 4)),
                                 ("zigzag", schedules.zigzag())]}
    return plans, mask, q, k, v, dout


RUNS = [("mesh", "allgather x zigzag"), ("mesh", "zigzag x ulysses"),
        ("shuffled", "zigzag x ulysses")]


def worker_mesh(rank: int, world_size: int, seed: int):
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
    plans, mask, q, k, v, dout = _gloo_case(seed)
    meshes = {"mesh": init_device_mesh("cpu", (2, 2), mesh_dim_names=("outer", "inner")),
              # plan rank g*2+p is mesh[g, p]: here plan rank 0 is global rank 3
              "shuffled": DeviceMesh("cpu", torch.tensor([[3, 1], [0, 2]]),
                                     mesh_dim_names=("outer", "inner"))}
    res, created, new_group = {}, [], dist.new_group
    dist.new_group = lambda *a, **kw: created.append(a) or new_group(*a, **kw)
    try:
        for mname, name in RUNS:
            msh, plan = meshes[mname], plans[name]
            g, p = msh.get_coordinate()
            me = g * 2 + p                              # the plan rank of this process
            ql, kl, vl = (plan.layout.shard(t, me).requires_grad_() for t in (q, k, v))
            out = fringe.attention(ql, kl, vl, plan=plan, group=msh, timeout_s=60)
            grads = torch.autograd.grad(out, (ql, kl, vl), plan.layout.shard(dout, me))
            res[(mname, name)] = (me, [out.detach(), *grads])
        res["groups created"] = len(created)            # collectives ran on the mesh's groups
        errors = []
        for name in ("ring x ring, k=4", "zigzag"):
            plan = plans[name]
            ql, kl, vl = (plan.layout.shard(t, rank) for t in (q, k, v))
            try:
                fringe.attention(ql, kl, vl, plan=plan, group=meshes["mesh"], timeout_s=60)
            except ValueError as e:
                errors.append(str(e))
        res["errors"] = errors
    finally:
        dist.new_group = new_group
    return res


def test_gloo_on_a_2d_device_mesh_matches_dense_attention():
    seed = 5
    with Workers(4, timeout_s=120) as w:
        res = w.run(worker_mesh, seed)
    plans, mask, q, k, v, dout = _gloo_case(seed)
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    ref, _ = reference.attention(qg, kg, vg, mask_mod=mask)
    want = [ref.detach(), *torch.autograd.grad(ref, (qg, kg, vg), dout)]
    for key in RUNS:
        plan = plans[key[1]]
        by_rank = {res[r][key][0]: res[r][key][1] for r in range(4)}
        assert sorted(by_rank) == [0, 1, 2, 3]
        for i, what in enumerate(("out", "dq", "dk", "dv")):
            got = plan.layout.unshard([by_rank[r][i] for r in range(4)])
            assert_close(got, want[i], **tolerances(torch.float64), msg=lambda s: f"{key} {what}: {s}")
    assert res[3][("shuffled", "zigzag x ulysses")][0] == 0
    for r in range(4):
        assert res[r]["groups created"] == 0
        msgs = res[r]["errors"]
        assert len(msgs) == 2
        assert "DeviceMesh has shape (2, 2)" in msgs[0] and "m=1 groups of k=4" in msgs[0], msgs[0]
        assert "2D DeviceMesh (2, 2)" in msgs[1] and "'zigzag'" in msgs[1], msgs[1]
