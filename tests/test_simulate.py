"""The heart: every schedule, every mask, forward and backward, against the dense reference.

All on the in-process virtual mesh in float64; the same interpreter runs over
torch.distributed in test_distributed.py.
"""
from __future__ import annotations

import zlib

import pytest
import torch
from hypothesis import given, settings, strategies as st
from torch.testing import assert_close

import fringe
from fringe import masks, schedules
from fringe.ops import reference
from fringe.testing import make_qkv, seeds, tolerances

SCHEDULES = {"ring": schedules.ring, "zigzag": schedules.zigzag, "striped": schedules.striped,
             "balanced": schedules.balanced}
MASKS = ["full", "causal", "sliding_window", "document", "document_padded", "prefix_lm",
         "combination", "lambda"]
EXACT = tolerances(torch.float64)


def make_mask(kind: str, S: int, g: torch.Generator):
    """A mask of the given family with random parameters (global positions)."""
    rnd = lambda lo, hi: int(torch.randint(lo, hi + 1, (), generator=g))   # noqa: E731
    if kind == "full":
        return masks.full()
    if kind == "causal":
        return masks.causal()
    if kind == "sliding_window":
        return masks.sliding_window(rnd(1, S), causal=bool(rnd(0, 1)))
    if kind in ("document", "document_padded"):
        # random document lengths, 1-token documents likely
        lengths = []
        while sum(lengths) < S:
            lengths.append(rnd(1, max(1, S // 3)) if rnd(0, 2) else 1)
        ids = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))[:S]
        if kind == "document":
            return masks.causal() & masks.document(ids)
        # padding at the end: padded tokens attend to nothing (fully masked rows)
        pad = rnd(0, S // 2)
        ids[S - pad:] = -1
        real = masks.as_mask(lambda b, h, q, kv: ids[q] >= 0, name="not_padding")
        return masks.causal() & masks.document(ids) & real
    if kind == "prefix_lm":
        return masks.prefix_lm(rnd(0, S))
    if kind == "combination":
        a = masks.sliding_window(rnd(1, S), causal=False) & masks.causal()
        b = masks.prefix_lm(rnd(0, S // 2))
        c = masks.document(torch.arange(S) // rnd(1, S))
        return (a | b) & c if rnd(0, 1) else a | (b & c)
    if kind == "lambda":
        m = rnd(2, 5)
        return lambda b, h, q, kv: ((q - kv) % m == 0) | (kv == 0)
    raise ValueError(kind)


cases = st.tuples(st.sampled_from(sorted(SCHEDULES)), st.sampled_from(MASKS),
                  st.integers(1, 8), st.sampled_from([1, 2, 4, 8]), st.integers(1, 3), seeds())


def run_case(name, mask_kind, P, bs, m, seed, *, kv="resend"):
    g = torch.Generator().manual_seed(seed)
    S = 2 * P * bs * m
    mask = make_mask(mask_kind, S, g)
    G = int(torch.randint(1, 3, (), generator=g))
    H = G * int(torch.randint(1, 3, (), generator=g))
    q, k, v = make_qkv(B=2, H=H, G=G, S=S, D=4, seed=seed, requires_grad=True)
    p = fringe.plan(SCHEDULES[name](), mask, seq_len=S, world_size=P, block_size=bs, kv=kv)
    out, lse = fringe.simulate.attention(q, k, v, plan=p, return_lse=True)
    ref, ref_lse = reference.attention(q, k, v, mask_mod=mask)
    assert_close(out, ref, **EXACT)
    assert_close(lse, ref_lse.to(lse.dtype), **EXACT)
    dout = torch.randn(out.shape, generator=g, dtype=out.dtype)
    got = torch.autograd.grad(out, (q, k, v), dout)
    want = torch.autograd.grad(ref, (q, k, v), dout)
    for a, b, what in zip(got, want, "qkv"):
        assert not torch.isnan(a).any(), f"NaN in d{what}"
        assert_close(a, b, **EXACT, msg=lambda s: f"d{what}: {s}")


@settings(deadline=None, max_examples=40)
@given(cases)
def test_every_schedule_every_mask_matches_dense(case):
    run_case(*case)


@settings(deadline=None, max_examples=15)
@given(cases)
def test_kept_kv_backward_matches_dense(case):
    run_case(*case, kv="keep")


@pytest.mark.parametrize("name", sorted(SCHEDULES))
@pytest.mark.parametrize("mask_kind", MASKS)
def test_each_schedule_and_mask_family_once(name, mask_kind):
    """A fixed sweep so every (schedule, mask family) pair runs on every CI run."""
    run_case(name, mask_kind, 4, 2, 2, seed=zlib.crc32(f"{name}/{mask_kind}".encode()) % 1000)


def test_score_mod_alibi_under_zigzag():
    S, P, H = 64, 4, 4
    slopes = torch.tensor([2.0 ** -(i + 1) for i in range(H)], dtype=torch.float64)
    alibi = lambda s, b, h, qi, ki: s + slopes[h] * (ki - qi)   # noqa: E731
    q, k, v = make_qkv(B=1, H=H, G=2, S=S, D=8, seed=3, requires_grad=True)
    p = fringe.plan(schedules.zigzag(), masks.causal(), seq_len=S, world_size=P, block_size=4,
                    score_mod=alibi)
    out = fringe.simulate.attention(q, k, v, plan=p)
    ref, _ = reference.attention(q, k, v, mask_mod=masks.causal(), score_mod=alibi)
    assert_close(out, ref, **EXACT)
    for a, b in zip(torch.autograd.grad(out.sum(), (q, k, v)),
                    torch.autograd.grad(ref.sum(), (q, k, v))):
        assert_close(a, b, **EXACT)


def _plan(S=32, P=4, name="zigzag", kv="resend"):
    return fringe.plan(SCHEDULES[name](), masks.causal(), seq_len=S, world_size=P, block_size=2,
                       kv=kv)


@pytest.mark.parametrize("kv", ["resend", "keep"])
def test_torch_func_grad_and_vjp(kv):
    p = _plan(kv=kv)
    q, k, v = make_qkv(B=1, H=2, G=1, S=32, D=4, seed=1)
    f = lambda q, k, v: fringe.simulate.attention(q, k, v, plan=p).square().sum()   # noqa: E731
    r = lambda q, k, v: reference.attention(q, k, v, mask_mod=masks.causal())[0].square().sum()  # noqa: E731
    got = torch.func.grad(f, argnums=(0, 1, 2))(q, k, v)
    want = torch.func.grad(r, argnums=(0, 1, 2))(q, k, v)
    for a, b in zip(got, want):
        assert_close(a, b, **EXACT)
    out, vjp = torch.func.vjp(lambda q, k, v: fringe.simulate.attention(q, k, v, plan=p), q, k, v)
    ref, ref_vjp = torch.func.vjp(
        lambda q, k, v: reference.attention(q, k, v, mask_mod=masks.causal())[0], q, k, v)
    ct = torch.randn_like(out)
    for a, b in zip(vjp(ct), ref_vjp(ct)):
        assert_close(a, b, **EXACT)


@pytest.mark.parametrize("kv", ["resend", "keep"])
def test_torch_func_vmap_over_an_extra_leading_dimension(kv):
    p = _plan(kv=kv)
    q, k, v = make_qkv(B=2, H=2, G=2, S=32, D=4, seed=2)
    qs, ks, vs = (torch.stack([t, t.flip(-1) * 0.5, -t]) for t in (q, k, v))   # [N, B, ...]
    got = torch.func.vmap(lambda q, k, v: fringe.simulate.attention(q, k, v, plan=p))(qs, ks, vs)
    want = torch.stack([reference.attention(a, b, c, mask_mod=masks.causal())[0]
                        for a, b, c in zip(qs, ks, vs)])
    assert_close(got, want, **EXACT)
    # vmap(grad(f)) re-enters the backward Function under vmap
    f = lambda q, k, v: fringe.simulate.attention(q, k, v, plan=p).sum()   # noqa: E731
    r = lambda q, k, v: reference.attention(q, k, v, mask_mod=masks.causal())[0].sum()  # noqa: E731
    assert_close(torch.func.vmap(torch.func.grad(f))(qs, ks, vs),
                 torch.func.vmap(torch.func.grad(r))(qs, ks, vs), **EXACT)
    # in_dims=None for k, v (broadcast)
    got = torch.func.vmap(lambda q: fringe.simulate.attention(q, k, v, plan=p))(qs)
    want = torch.stack([reference.attention(a, k, v, mask_mod=masks.causal())[0] for a in qs])
    assert_close(got, want, **EXACT)


@pytest.mark.parametrize("kv", ["resend", "keep"])
def test_vmap_over_cotangents_of_one_forward_matches_dense(kv):
    """jacrev / vmap(vjp): the forward runs once, unbatched, and only the backward is vmapped
    (its cotangents carry the vmapped dim). With kv="keep" the kept kv buffers belong to that
    unbatched forward, so they cannot be folded with the cotangents' batch (was a shape error
    in the view of the kept buffers)."""
    p = _plan(kv=kv)
    q, k, v = make_qkv(B=1, H=2, G=2, S=32, D=4, seed=3)
    out, vjp = torch.func.vjp(lambda q, k, v: fringe.simulate.attention(q, k, v, plan=p), q, k, v)
    _, ref_vjp = torch.func.vjp(
        lambda q, k, v: reference.attention(q, k, v, mask_mod=masks.causal())[0], q, k, v)
    cts = torch.randn((3, *out.shape), generator=torch.Generator().manual_seed(4),
                      dtype=out.dtype)
    for a, b in zip(torch.func.vmap(vjp)(cts), torch.func.vmap(ref_vjp)(cts)):
        assert_close(a, b, **EXACT)


def test_double_backward_says_it_is_unsupported():
    p = _plan()
    q, k, v = make_qkv(B=1, H=2, G=1, S=32, D=4, seed=1, requires_grad=True)
    out = fringe.simulate.attention(q, k, v, plan=p)
    (gq,) = torch.autograd.grad(out.sum(), q, create_graph=True)
    with pytest.raises(NotImplementedError, match="double backward"):
        gq.sum().backward()


def test_low_precision_uses_the_tolerance_helper():
    p = _plan()
    for dtype in (torch.float32, torch.bfloat16):
        q, k, v = make_qkv(B=1, H=2, G=2, S=32, D=8, seed=4, dtype=dtype)
        out = fringe.simulate.attention(q, k, v, plan=p)
        assert out.dtype == dtype
        ref, _ = reference.attention(q.double(), k.double(), v.double(), mask_mod=masks.causal())
        assert_close(out.double(), ref, **tolerances(dtype))


def test_sequence_length_mismatch_is_a_clear_error():
    p = _plan(S=32)
    q, k, v = make_qkv(B=1, H=2, G=1, S=64, D=4, seed=0)
    with pytest.raises(ValueError, match=r"plan expects global length 32 .* re-plan with "
                                         r"seq_len=64"):
        fringe.simulate.attention(q, k, v, plan=p)


def test_bad_head_counts_fail_before_running():
    p = _plan()
    q, k, v = make_qkv(B=1, H=6, G=6, S=32, D=4, seed=0)
    with pytest.raises(ValueError, match="H=6 query heads is not a multiple of G=4 kv heads"):
        fringe.simulate.attention(q, k[:, :4], v[:, :4], plan=p)


def test_interpreter_reuses_buffers():
    """A ring keeps a bounded number of kv buffers alive whatever P is (double buffering)."""
    P, S = 8, 128
    p = fringe.plan(schedules.ring(), masks.full(), seq_len=S, world_size=P, block_size=2)
    q, k, v = make_qkv(B=1, H=1, G=1, S=S, D=4, seed=0)
    states = fringe.simulate.forward_states(q, k, v, plan=p)
    assert max(st.pool.allocated for st in states.values()) <= 2


def random_tree_hops(P: int, seed: int):
    """Each kv chunk spreads over a random tree of ranks, hops at random (valid) steps."""
    g = torch.Generator().manual_seed(seed)
    hops = {}
    for j in range(P):
        arrival = {j: 0}
        order = [r for r in torch.randperm(P, generator=g).tolist() if r != j]
        chunk_hops = []
        for r in order:
            parents = sorted(arrival)
            parent = parents[int(torch.randint(0, len(parents), (), generator=g))]
            t = arrival[parent] + int(torch.randint(0, 3, (), generator=g))
            chunk_hops.append(schedules.Hop(t, parent, r))
            arrival[r] = t + 1
        hops[j] = chunk_hops
    return hops


@settings(deadline=None, max_examples=30)
@given(st.integers(1, 6), st.sampled_from(MASKS), seeds(), st.sampled_from(["resend", "keep"]))
def test_user_schedule_with_random_routes_gets_a_correct_backward(P, mask_kind, seed, kv):
    """A schedule written in user code (random broadcast trees, not a ring) gets pruning,
    checks and a derived backward for free, and matches dense attention."""
    bs = 2
    S = 2 * P * bs * 2
    g = torch.Generator().manual_seed(seed)
    mask = make_mask(mask_kind, S, g)
    mine = schedules.Schedule("random-trees", layout=fringe.layout.contiguous,
                              hops=lambda P: random_tree_hops(P, seed))
    p = fringe.plan(mine, mask, seq_len=S, world_size=P, block_size=bs, kv=kv)
    q, k, v = make_qkv(B=1, H=2, G=1, S=S, D=4, seed=seed, requires_grad=True)
    out = fringe.simulate.attention(q, k, v, plan=p)
    ref, _ = reference.attention(q, k, v, mask_mod=mask)
    assert_close(out, ref, **EXACT)
    for a, b in zip(torch.autograd.grad(out.square().sum(), (q, k, v)),
                    torch.autograd.grad(ref.square().sum(), (q, k, v))):
        assert_close(a, b, **EXACT)


@pytest.mark.parametrize("wrap", ["mask", "lambda"])
def test_head_dependent_mask_needs_num_heads_and_then_matches_dense(wrap):
    S, P, H = 64, 4, 4
    window = torch.tensor([4, 8, 16, 64])
    fn = lambda b, h, q, kv: (q >= kv) & (q - kv < window[h])   # noqa: E731
    mask = masks.as_mask(fn, name="per_head_window", bh_invariant=False) if wrap == "mask" else fn
    with pytest.raises(ValueError, match=r"reads the h index .* pass num_heads="):
        fringe.plan(schedules.zigzag(), mask, seq_len=S, world_size=P, block_size=4)
    p = fringe.plan(schedules.zigzag(), mask, seq_len=S, world_size=P, block_size=4, num_heads=H)
    q, k, v = make_qkv(B=1, H=H, G=2, S=S, D=8, seed=0, requires_grad=True)
    out = fringe.simulate.attention(q, k, v, plan=p)
    ref, _ = reference.attention(q, k, v, mask_mod=mask)
    assert_close(out, ref, **EXACT)
    for a, b in zip(torch.autograd.grad(out.sum(), (q, k, v)),
                    torch.autograd.grad(ref.sum(), (q, k, v))):
        assert_close(a, b, **EXACT)


def test_check_mask_passes_for_good_masks_and_names_what_breaks():
    from fringe.testing import check_mask
    n = check_mask(masks.prefix_lm(5) | masks.sliding_window(3, causal=False),
                   world_sizes=(1, 2, 3), block_sizes=(1, 2))
    # every registered schedule that runs at P (ulysses needs H % P == 0: heads=2, so P = 1, 2;
    # compose:zigzag+ulysses:2 needs P even) x P in (1, 2, 3) x two block sizes
    from fringe.schedules import registry
    from fringe.testing import CHECK_MASK_SCHEDULES
    want = sum(1 for P in (1, 2, 3) for name in [*registry.names(), *CHECK_MASK_SCHEDULES]
               if registry.why_not(name, world_size=P, heads=2, kv_heads=1) is None) * 2
    assert n == want == 36
    stripes = lambda b, h, q, kv: ((q // 3) % 2 == (kv // 3) % 2) & (kv <= q)   # noqa: E731
    assert check_mask(stripes, world_sizes=(2,), block_sizes=(2,)) == 7
    # a mask whose block rule disagrees with its mask_mod: check_mask must catch it
    import dataclasses
    liar = dataclasses.replace(masks.causal(), mod=lambda b, h, q, kv: q >= 0 * kv)
    with pytest.raises(AssertionError, match=r"schedule=ring P=1 block_size=1 .* block \(0, 1\) "
                                             r"classified EMPTY, dense says FULL"):
        check_mask(liar, world_sizes=(1,), block_sizes=(1,))


def test_check_mask_checks_the_gradient_through_lse(monkeypatch):
    """Defect found (fixed): check_mask compared lse but took gradients through out only, so
    a backward that drops the lse cotangent (a loss reading lse: z-loss, a merge with other
    attention) passed it, with dq, dk wrong by O(1). It now backpropagates a loss of out and
    the finite lse."""
    import sys
    from fringe.testing import check_mask
    engine = sys.modules["fringe.runtime.engine"]
    real = engine.backward

    def no_dlse(plan, ranks, q, k, v, out, lse, dout, dlse, kept, transport):
        return real(plan, ranks, q, k, v, out, lse, dout, None, kept, transport)
    mask = masks.as_mask(lambda b, h, q, kv: (q >= kv) & (q % 7 != 3), bh_invariant=True)
    assert check_mask(mask, world_sizes=(2,), block_sizes=(4,), schedules=["zigzag"]) == 1
    monkeypatch.setattr(engine, "backward", no_dlse)
    with pytest.raises(AssertionError, match=r"schedule=zigzag P=2 block_size=4 .* dq differs"):
        check_mask(mask, world_sizes=(2,), block_sizes=(4,), schedules=["zigzag"])
