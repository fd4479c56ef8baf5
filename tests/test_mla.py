"""MLA: v's head dim Dv differs from q/k's D (DeepSeek-V3: D=192, Dv=128).

Every registered schedule on the virtual mesh, Dv larger and smaller than D, GQA, float64
against the dense reference (forward and dq, dk, dv), the sdpa and reference kernels; v
travels and is kept at Dv (the bytes a run moves and keeps are G·(D + Dv) per token, as
``plan.stats(v_head_dim=)`` prices them); one gloo test (two ranks, a ring and a head-split
schedule, and ranks that disagree on Dv). DeepSeek-V3 through ``fringe.hf`` runs in
tests/test_hf.py (``examples/hf_train.py --model deepseek_v3``).
"""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st
from torch.testing import assert_close

import fringe
import fringe.simulate
from fringe import _attention_op, masks, schedules
from fringe.ops import _fast, reference, tile_backward, tile_forward
from fringe.ops.kernels import REFERENCE, SDPA
from fringe.runtime.engine import kept_names
from fringe.runtime.virtual import VirtualRuntime
from fringe.schedules import registry
from fringe.testing import mask_family, seeds, tolerances

TOL = tolerances(torch.float64)
P, H = 4, 4
#: every registered schedule that runs on P=4 ranks with H=4 heads and G=2 kv heads, and one
#: compose (ulysses inside rings of 2)
NAMES = registry.names(world_size=P, heads=H, kv_heads=2) + ["compose:zigzag+ulysses:2"]


def _qkv(*, B, G, S, D, Dv, seed, grad=True):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, S, D, generator=g, dtype=torch.float64)
    k = torch.randn(B, G, S, D, generator=g, dtype=torch.float64)
    v = torch.randn(B, G, S, Dv, generator=g, dtype=torch.float64)
    dout = torch.randn(B, H, S, Dv, generator=g, dtype=torch.float64)
    return (*(t.requires_grad_(grad) for t in (q, k, v)), dout)


def test_the_registry_schedules_are_all_here():
    assert {"ring", "zigzag", "striped", "balanced", "allgather", "ulysses"} <= set(NAMES)


@pytest.mark.parametrize("kernel", ["reference", "sdpa"])
@pytest.mark.parametrize("wider", [True, False], ids=["Dv>D", "Dv<D"])
@pytest.mark.parametrize("name", NAMES)
@settings(max_examples=2)
@given(seed=seeds(), G=st.sampled_from([1, 2, 4]), mask=st.sampled_from(["causal", "document",
                                                                         "window"]),
       kv=st.sampled_from(["resend", "keep"]), dims=st.sampled_from([(8, 4), (12, 3), (6, 5)]))
def test_virtual_mesh_matches_dense_with_v_of_its_own_head_dim(name, wider, kernel, seed, G,
                                                               mask, kv, dims):
    D, Dv = dims if not wider else dims[::-1]
    S = 64
    m = mask_family(mask, S)
    plan = fringe.plan(schedules.get(name), m, seq_len=S, world_size=P, block_size=8,
                       kernel=kernel, kv=kv)
    q, k, v, dout = _qkv(B=2, G=G, S=S, D=D, Dv=Dv, seed=seed)
    out, lse = fringe.simulate.attention(q, k, v, plan=plan, return_lse=True)
    ro, rl = reference.attention(q, k, v, mask_mod=m)
    assert out.shape == (2, H, S, Dv)
    assert_close(out, ro, **TOL)
    assert_close(lse, rl, **TOL)
    dlse = torch.randn(rl.shape, generator=torch.Generator().manual_seed(seed + 1),
                       dtype=torch.float64)                     # the lse cotangent too
    got = torch.autograd.grad((out, lse), (q, k, v), (dout, dlse))
    want = torch.autograd.grad((ro, rl), (q, k, v), (dout, dlse))
    for what, a, b in zip(("dq", "dk", "dv"), got, want):
        assert a.shape == b.shape, what
        assert_close(a, b, **TOL, msg=lambda e, w=what: f"{w}: {e}")


@pytest.mark.parametrize("D,Dv", [(8, 13), (13, 8)])
def test_sdpa_pads_inside_the_fused_op_exactly_and_cuts(monkeypatch, D, Dv):
    """The fused CPU op needs one head size: the kernel pads with zero columns inside, calls
    the op (not the reference fallback), and cuts; equal to the reference to 1e-12,
    including the padded-column route of an lse cotangent on a row whose dout is 0."""
    assert SDPA.available("cpu")[0]
    calls = []
    real = _fast._equal_heads
    monkeypatch.setattr(_fast, "_equal_heads",
                        lambda *a: calls.append([t.shape[-1] for t in a]) or real(*a))
    g = torch.Generator().manual_seed(3)
    B, G, Lq, Lk = 2, 2, 24, 16
    q = torch.randn(B, H, Lq, D, generator=g, dtype=torch.float64)
    k = torch.randn(B, G, Lk, D, generator=g, dtype=torch.float64)
    v = torch.randn(B, G, Lk, Dv, generator=g, dtype=torch.float64)
    dout = torch.randn(B, H, Lq, Dv, generator=g, dtype=torch.float64)
    dout[:, :, 5] = 0.0                                   # dlse with no dout: the pad column
    dlse = torch.randn(B, H, Lq, generator=g, dtype=torch.float64)
    mask = torch.rand(1, 1, Lq, Lk, generator=g) > 0.3
    mask[..., 2, :] = False                               # a dead row
    kw = dict(q_pos=torch.arange(Lq), kv_pos=torch.arange(Lk), mask=mask, scale=0.37)
    o, l = SDPA.forward(q, k, v, **kw)
    ro, rl = REFERENCE.forward(q, k, v, **kw)
    assert o.shape == (B, H, Lq, Dv) and calls == [[D, D, Dv]]
    assert_close(o, ro, atol=1e-12, rtol=1e-12)
    assert_close(l, rl, atol=1e-12, rtol=1e-12)
    got = SDPA.backward(q, k, v, ro, rl, dout, dlse=dlse, **kw)
    want = REFERENCE.backward(q, k, v, ro, rl, dout, dlse=dlse, **kw)
    assert len(calls) == 2
    for a, b in zip(got, want):
        assert a.shape == b.shape
        assert_close(a, b, atol=1e-12, rtol=1e-12)


def test_a_tile_split_into_calls_merges_and_sums_at_dv():
    """A PARTIAL tile with a block map: several kernel calls, out merged and dv summed at Dv."""
    S, D, Dv, bs = 32, 6, 10, 4
    q, k, v, dout = _qkv(B=1, G=2, S=S, D=D, Dv=Dv, seed=5, grad=False)
    m = masks.sliding_window(9)
    plan = fringe.plan(schedules.ring(), m, seq_len=S, world_size=1, block_size=bs)
    pos = torch.arange(S)
    ro, rl = reference.attention(q, k, v, mask_mod=m)
    for kernel in ("reference", "sdpa"):
        kw = dict(q_pos=pos, kv_pos=pos, mask_mod=m, kind=plan.tile_kind(0, 0),
                  blocks=plan._tile_blocks(0, 0), block_size=bs, kernel=kernel)
        o, l = tile_forward(q, k, v, **kw)
        assert_close(o, ro, **TOL)
        dq, dk, dv = tile_backward(q, k, v, ro, rl, dout, **kw)
        assert dv.shape == v.shape and dk.shape == k.shape
        qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
        want = torch.autograd.grad(reference.attention(qg, kg, vg, mask_mod=m)[0], (qg, kg, vg),
                                   dout)
        for a, b in zip((dq, dk, dv), want):
            assert_close(a, b, **TOL)


@pytest.mark.parametrize("name", ["ring", "ulysses", "allgather"])
def test_v_travels_and_is_kept_at_dv(name):
    """Bytes each rank sends and receives are what plan.stats(v_head_dim=) prices (kv:
    G·(D + Dv) a token, not 2·G·max(D, Dv)); the kept kv buffers hold (D + Dv) a token."""
    S, B, G, D, Dv = 64, 1, 2, 12, 4
    plan = fringe.plan(schedules.get(name), masks.causal(), seq_len=S, world_size=P,
                       block_size=8, kv="keep")
    L = plan.local_len
    g = torch.Generator().manual_seed(0)
    q = torch.randn(P, B, H, L, D, generator=g, dtype=torch.float64)
    k = torch.randn(P, B, G, L, D, generator=g, dtype=torch.float64)
    v = torch.randn(P, B, G, L, Dv, generator=g, dtype=torch.float64)
    rt = VirtualRuntime(P)
    out, lse, kept = rt.forward(plan, q, k, v)
    rt.backward(plan, q, k, v, out, lse, torch.ones_like(out), None, kept)
    stats = plan.stats(batch=B, heads=H, kv_heads=G, head_dim=D, v_head_dim=Dv,
                       dtype=torch.float64)
    for which, pre in (("forward", "fwd"), ("backward", "bwd")):
        sent = [0] * P
        for st_ in rt.last_states[which].values():
            sent[st_.rank] += sum(rec.sent_bytes for rec in st_.records)
        assert sent == [row[f"{pre}_sent"] for row in stats.rows], which
    assert sum(stats.rows[0][c] for c in ("fwd_sent", "bwd_sent")) > 0
    if name == "ring":                          # whole kv buffers: G·L·(D + Dv) float64s each
        assert all(row["fwd_sent"] % (G * L * (D + Dv) * 8) == 0 for row in stats.rows)
    equal = plan.stats(batch=B, heads=H, kv_heads=G, head_dim=D, dtype=torch.float64)
    assert stats.rows[0]["fwd_sent"] < equal.rows[0]["fwd_sent"]   # Dv < D: less than k and k
    # kept for the backward, packed flat by the op: (D + Dv) a token, not padded
    assert sum(len(kept_names(plan, r)) for r in range(P)) > 0
    assert all(t.shape == (1, B, t.shape[2], L, D + Dv) for per in kept for t in per)
    flat = _attention_op._pack(kept, k)
    back = _attention_op._unpack(plan, range(P), flat, k[0], v[0], H)
    for mine, theirs in zip(back, kept):
        assert [t.shape for t in mine] == [t.shape for t in theirs]
        assert all(torch.equal(a, b) for a, b in zip(mine, theirs))


def test_stats_price_kv_at_d_plus_dv():
    plan = fringe.plan(schedules.ring(), masks.causal(), seq_len=64, world_size=P,
                       block_size=8)
    a = plan.stats(head_dim=192, v_head_dim=128, heads=4, kv_heads=4)
    b = plan.stats(head_dim=160, heads=4, kv_heads=4)      # (192 + 128) / 2: same kv bytes
    assert a.rows[0]["fwd_sent"] == b.rows[0]["fwd_sent"] > 0
    assert a.rows[0]["fwd_flops"] == b.rows[0]["fwd_flops"] > 0
    from fringe.runtime.costmodel import Shape
    sh = Shape(heads=4, kv_heads=2, head_dim=192, v_head_dim=128, dtype="float32")
    assert sh.buffer_bytes("kv", 10) == 2 * 10 * (192 + 128) * 4
    assert sh.buffer_bytes("out", 10) == 4 * 10 * (128 + 1) * 4
    assert sh.buffer_bytes("q", 10) == 4 * 10 * 192 * 4
    with pytest.raises(ValueError, match="v_head_dim"):
        Shape(v_head_dim=0)


def test_mismatches_other_than_dv_still_raise_with_the_fix():
    plan = fringe.plan(schedules.ring(), masks.causal(), seq_len=16, world_size=2, block_size=4)
    q, k, v, _ = _qkv(B=1, G=2, S=16, D=8, Dv=4, seed=0, grad=False)
    with pytest.raises(ValueError, match=r"k and v must agree in \[B, G, Lk\].*Dv may differ"):
        fringe.simulate.attention(q, k, v[:, :1], plan=plan)
    with pytest.raises(ValueError, match="q has D=8 but k has D=4"):
        fringe.simulate.attention(q, v, v, plan=plan)
    with pytest.raises(ValueError, match="v head dim Dv=0"):
        fringe.simulate.attention(q, k, v[..., :0], plan=plan)


# ---- gloo ---------------------------------------------------------------------------------


def _gloo_case(rank, world_size, name, Dv_on_rank1):
    import fringe as fr
    S, D, Dv = 32, 8, 5
    plan = fr.plan(schedules.get(name), masks.causal(), seq_len=S, world_size=world_size,
                   block_size=4, kernel="sdpa")
    q, k, v, dout = _qkv(B=1, G=2, S=S, D=D, Dv=Dv, seed=11, grad=False)
    lay = plan.layout
    ql, kl, vl = (lay.shard(t, rank).requires_grad_() for t in (q, k, v))
    if rank == 1 and Dv_on_rank1 != Dv:
        vl = torch.zeros(*vl.shape[:-1], Dv_on_rank1, dtype=vl.dtype, requires_grad=True)
    try:
        out = fr.attention(ql, kl, vl, plan=plan)
    except Exception as e:  # noqa: BLE001 - the message goes back to the test
        return f"{type(e).__name__}: {e}"
    grads = torch.autograd.grad(out, (ql, kl, vl), lay.shard(dout, rank))
    return [out.detach(), *grads]


def test_gloo_two_ranks_match_dense_and_refuse_a_dv_mismatch():
    from fringe.launch import Workers
    S, D, Dv = 32, 8, 5
    q, k, v, dout = _qkv(B=1, G=2, S=S, D=D, Dv=Dv, seed=11)
    m = masks.causal()
    ro, _ = reference.attention(q, k, v, mask_mod=m)
    want = [ro.detach(), *torch.autograd.grad(ro, (q, k, v), dout)]
    with Workers(2, timeout_s=120, threads=1) as w:
        for name in ("zigzag", "ulysses"):
            plan = fringe.plan(schedules.get(name), m, seq_len=S, world_size=2, block_size=4)
            res = w.run(_gloo_case, name, Dv)
            for r in range(2):
                assert isinstance(res[r], list), res[r]
                for what, a, b in zip(("out", "dq", "dk", "dv"), res[r], want):
                    assert_close(a, plan.layout.shard(b, r), **TOL,
                                 msg=lambda e, w_=what, n=name: f"{n} {w_}: {e}")
        bad = w.run(_gloo_case, "zigzag", Dv + 1)
    for r in range(2):
        assert "Dv (v head dim)" in bad[r] and "rank 0 has 5, rank 1 has 6" in bad[r], bad[r]


def test_compiled_fullgraph_with_kept_kv_at_dv():
    """The custom op's fake impl gives out ``[..., Dv]``; the kept kv (flat, unbacked size)
    and the backward op's dv compile with fullgraph (aot_eager: no C++ compiler needed)."""
    S, D, Dv = 32, 8, 5
    m = masks.causal()
    plan = fringe.plan(schedules.zigzag(), m, seq_len=S, world_size=2, block_size=4, kv="keep")
    q, k, v, dout = _qkv(B=1, G=2, S=S, D=D, Dv=Dv, seed=2)
    f = torch.compile(lambda q, k, v: fringe.simulate.attention(q, k, v, plan=plan),
                      fullgraph=True, backend="aot_eager")
    out = f(q, k, v)
    ro, _ = reference.attention(q, k, v, mask_mod=m)
    assert out.shape == (1, H, S, Dv)
    assert_close(out, ro, **TOL)
    for a, b in zip(torch.autograd.grad(out, (q, k, v), dout),
                    torch.autograd.grad(ro, (q, k, v), dout)):
        assert_close(a, b, **TOL)


def _flex_stand_in():
    """tests/test_flex.py's StandIn: the flex kernel with FlexAttention's tile forward replaced
    by the reference under the BlockMask's semantics (flex's backward needs a GPU)."""
    import importlib.util
    from pathlib import Path
    spec = importlib.util.spec_from_file_location("_mla_flex_helpers",
                                                  Path(__file__).with_name("test_flex.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.StandIn()


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_flex_takes_v_at_its_own_head_dim():
    """FlexAttention's real eager forward (CPU, float64) on a tile with Dv != D, and the flex
    kernel's backward composition (stand-in forward) through a plan on the virtual mesh."""
    from fringe.ops.flex import FlexKernel
    S, D, Dv = 32, 8, 5
    m = mask_family("document", S)
    q, k, v, dout = _qkv(B=1, G=2, S=S, D=D, Dv=Dv, seed=4)
    ro, rl = reference.attention(q, k, v, mask_mod=m)
    pos = torch.arange(S)
    o, l = tile_forward(q.detach(), k.detach(), v.detach(), q_pos=pos, kv_pos=pos, mask_mod=m,
                        kernel=FlexKernel(backend=None, devices=("cpu",)), block_size=8)
    assert o.shape == (1, H, S, Dv)
    assert_close(o, ro.detach(), **TOL)
    assert_close(l, rl.detach(), **TOL)
    plan = fringe.plan(schedules.zigzag(), m, seq_len=S, world_size=2, block_size=8,
                       kernel=_flex_stand_in())
    out = fringe.simulate.attention(q, k, v, plan=plan)
    assert_close(out, ro, **TOL)
    for a, b in zip(torch.autograd.grad(out, (q, k, v), dout),
                    torch.autograd.grad(ro, (q, k, v), dout)):
        assert_close(a, b, **TOL)


def test_the_cost_model_prices_mla_between_its_head_dims():
    """Tile compute at the mean of D and Dv (q·k at D, p·v at Dv), kv bytes at D + Dv."""
    from fringe.runtime import costmodel
    plan = fringe.plan(schedules.zigzag(), masks.causal(), seq_len=256, world_size=P,
                       block_size=16)
    mla = costmodel.Shape(heads=8, kv_heads=8, head_dim=192, v_head_dim=128)
    mean = costmodel.Shape(heads=8, kv_heads=8, head_dim=160)
    for bwd in (False, True):
        a = costmodel.tile_costs(plan, "cpu", mla, backward=bwd)
        b = costmodel.tile_costs(plan, "cpu", mean, backward=bwd)
        assert a.max() > 0
        assert_close(torch.from_numpy(a), torch.from_numpy(b), rtol=1e-12, atol=0)
    assert mla.buffer_bytes("kv", 7) == mean.buffer_bytes("kv", 7)


def test_vmap_of_grad_with_v_at_dv():
    S = 32
    m = masks.causal()
    plan = fringe.plan(schedules.ring(), m, seq_len=S, world_size=2, block_size=4)
    g = torch.Generator().manual_seed(6)
    q, k, v = (torch.randn(3, 1, n, S, d, generator=g, dtype=torch.float64)
               for n, d in ((H, 8), (2, 8), (2, 5)))

    def loss(attn):
        return lambda q, k, v: attn(q, k, v).square().sum()

    got = torch.func.vmap(torch.func.grad(loss(
        lambda q, k, v: fringe.simulate.attention(q, k, v, plan=plan)), argnums=(0, 1, 2)))(q, k, v)
    want = torch.func.vmap(torch.func.grad(loss(
        lambda q, k, v: reference.attention(q, k, v, mask_mod=m)[0]), argnums=(0, 1, 2)))(q, k, v)
    assert got[2].shape == v.shape
    for a, b in zip(got, want):
        assert_close(a, b, **TOL)
