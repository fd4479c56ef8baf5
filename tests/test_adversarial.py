"""Issue "Nothing silently wrong": each way a user could get a wrong number with no error,
tried on the virtual mesh and on gloo ranks. Each test asserts the error (type and the
cause it names) or the exact result against the dense reference in float64.
"""
from __future__ import annotations

import math
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from torch.testing import assert_close

import fringe
from fringe import masks, schedules
from fringe.launch import Workers
from fringe.ops import reference
from fringe.runtime.distributed import RankMismatch
from fringe.testing import make_qkv, tolerances

TOL = tolerances(torch.float64)
BLOCK = 2


@pytest.fixture(scope="module")
def pool2():
    with Workers(2, timeout_s=300, threads=1) as w:
        yield w


def _docs(S: int, cut: int) -> torch.Tensor:
    return (torch.arange(S) >= cut).long()


def _local(plan, rank, *ts):
    return [plan.layout.shard(t, rank) for t in ts]


# -------------------------------------------------------------------------------------
# 1. agreement runs on every call, not once per (plan, shapes)
# -------------------------------------------------------------------------------------
def worker_two_plans(rank: int, world_size: int):
    S = 2 * world_size * BLOCK * 2
    pa = fringe.plan(schedules.zigzag(), masks.causal(), seq_len=S, world_size=world_size,
                     block_size=BLOCK)
    pb = fringe.plan(schedules.zigzag(), masks.causal() & masks.sliding_window(3), seq_len=S,
                     world_size=world_size, block_size=BLOCK)
    q, k, v = make_qkv(B=1, H=2, G=1, S=S, D=4, seed=1)
    for p in (pa, pb):                     # both plans agree once, on every rank
        fringe.attention(*_local(p, rank, q, k, v), plan=p, timeout_s=120)
    mine = pa if rank == 0 else pb         # then ranks run different plans in one call
    try:
        fringe.attention(*_local(mine, rank, q, k, v), plan=mine, timeout_s=120)
    except RankMismatch as e:
        return str(e)
    return "no error"


def test_agreement_is_checked_on_every_call(pool2):
    for msg in pool2.run(worker_two_plans):
        assert "rank 1 disagrees with rank 0 on plan" in msg, msg


# -------------------------------------------------------------------------------------
# 2. the agreement covers what decides the numbers, one component per field
# -------------------------------------------------------------------------------------
class _Softcap:                            # a score_mod's constant held by an object
    def __init__(self, cap: float):
        self.cap = cap

    def score(self, s, b, h, q, kv):
        return self.cap * torch.tanh(s / self.cap)


def worker_content(rank: int, world_size: int, what: str):
    S = 2 * world_size * BLOCK * 4
    cut = S // 2 + 1 + (1 if (what == "doc_ids" and rank == 1) else 0)   # one token apart
    mask = masks.causal() & masks.document(_docs(S, cut))
    score_mod = None
    if what == "score_mod" and rank == 1:
        def score_mod(s, b, h, q, kv):
            return s + 0.5
    if what == "bound_softcap":             # self.cap 30 vs 50: was digested by type only
        score_mod = _Softcap(30.0 if rank == 0 else 50.0).score
    if what == "lambda":                    # a plain callable, different constant per rank
        c = 3 if rank == 0 else 4
        mask = masks.as_mask(lambda b, h, q, kv: (kv <= q) & ((q - kv) % c != 1))
    scale = 0.3 if (what == "scale" and rank == 1) else None
    p = fringe.plan(schedules.zigzag(), mask, seq_len=S, world_size=world_size,
                    block_size=4, score_mod=score_mod, scale=scale)   # both cuts inside block 4
    q, k, v = make_qkv(B=1, H=2, G=1, S=S, D=4, seed=2)
    try:
        fringe.attention(*_local(p, rank, q, k, v), plan=p, timeout_s=120)
    except RankMismatch as e:
        return str(e)
    return "no error"


@pytest.mark.parametrize("what,field", [("doc_ids", "plan mask"), ("score_mod", "plan score_mod"),
                                        ("bound_softcap", "plan score_mod"),
                                        ("lambda", "plan"), ("scale", "plan options")])
def test_agreement_names_the_component_that_differs(pool2, what, field):
    for msg in pool2.run(worker_content, what):
        assert f"rank 1 disagrees with rank 0 on {field}" in msg, msg
        if field == "plan score_mod":           # says what the digest covers
            assert "attributes of the objects it is bound to" in msg, msg


def test_doc_ids_one_token_apart_keep_the_block_map_but_change_the_digest():
    S, P = 32, 2
    a = fringe.plan(schedules.zigzag(), masks.document(_docs(S, 17)), seq_len=S, world_size=P,
                    block_size=4)
    b = fringe.plan(schedules.zigzag(), masks.document(_docs(S, 18)), seq_len=S, world_size=P,
                    block_size=4)
    c = fringe.plan(schedules.zigzag(), masks.document(_docs(S, 17)), seq_len=S, world_size=P,
                    block_size=4)
    for same in ("layout", "blocks", "programs"):
        assert a.digests()[same] == b.digests()[same]
    assert a.digests()["mask"] != b.digests()["mask"]
    assert a.fingerprint() == c.fingerprint()      # equal content, built separately: equal


# -------------------------------------------------------------------------------------
# 3. a plan does not alias the caller's tensors
# -------------------------------------------------------------------------------------
def test_refilling_doc_ids_after_planning_does_not_change_the_plan():
    S, P = 32, 2
    ids = _docs(S, 12)
    plan = fringe.plan(schedules.zigzag(), masks.causal() & masks.document(ids), seq_len=S,
                       world_size=P, block_size=2)
    want_mask = masks.causal() & masks.document(ids.clone())
    ids.copy_(_docs(S, 20))                          # the next batch's boundaries, in place
    q, k, v = make_qkv(B=1, H=2, G=1, S=S, D=4, seed=3)
    ref, _ = reference.attention(q, k, v, mask_mod=want_mask)
    assert_close(fringe.simulate.attention(q, k, v, plan=plan), ref, **TOL)


def test_refilling_a_tensor_a_lambda_captures_does_not_change_the_plan():
    S, P = 32, 2
    allowed = torch.ones(S, dtype=torch.bool)
    allowed[5] = False
    plan = fringe.plan(schedules.ring(), lambda b, h, q, kv: (kv <= q) & allowed[kv], seq_len=S,
                       world_size=P, block_size=2)
    frozen = allowed.clone()
    allowed.fill_(False)
    q, k, v = make_qkv(B=1, H=1, G=1, S=S, D=4, seed=4)
    ref, _ = reference.attention(q, k, v, mask_mod=lambda b, h, q, kv: (kv <= q) & frozen[kv])
    assert_close(fringe.simulate.attention(q, k, v, plan=plan), ref, **TOL)


# -------------------------------------------------------------------------------------
# 5. tensors a score_mod reads get gradients
# -------------------------------------------------------------------------------------
def _rel_bias(S: int, H: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    bias = torch.nn.Parameter(torch.randn(H, 2 * S, generator=g, dtype=torch.float64))

    def score_mod(s, b, h, q, kv):
        return s + bias[h, q - kv + S]
    return bias, score_mod


@pytest.mark.parametrize("name", ["ring", "zigzag", "balanced"])
def test_score_mod_parameters_get_the_dense_gradient(name):
    S, P, H = 32, 4, 2
    bias, score_mod = _rel_bias(S, H, seed=5)
    mask = masks.causal() & masks.document(_docs(S, 11))
    plan = getattr(schedules, name)()
    p = fringe.plan(plan, mask, seq_len=S, world_size=P, block_size=2, score_mod=score_mod)
    assert len(p.score_params) == 1 and p.score_params[0] is bias
    q, k, v = make_qkv(B=2, H=H, G=1, S=S, D=4, seed=6, requires_grad=True)
    dout = torch.randn(2, H, S, 4, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    ref, _ = reference.attention(q, k, v, mask_mod=mask, score_mod=score_mod)
    want = torch.autograd.grad(ref, (q, k, v, bias), dout)
    out = fringe.simulate.attention(q, k, v, plan=p)
    got = torch.autograd.grad(out, (q, k, v, bias), dout)
    for what, a, b in zip(("dq", "dk", "dv", "dbias"), got, want):
        assert_close(a, b, **TOL, msg=lambda m: f"{what}: {m}")


def worker_score_grad(rank: int, world_size: int):
    S, H = 16, 2
    bias, score_mod = _rel_bias(S, H, seed=8)
    p = fringe.plan(schedules.zigzag(), masks.causal(), seq_len=S, world_size=world_size,
                    block_size=BLOCK, score_mod=score_mod)
    q, k, v = make_qkv(B=1, H=H, G=1, S=S, D=4, seed=9)
    ql, kl, vl = (t.requires_grad_() for t in _local(p, rank, q, k, v))
    out = fringe.attention(ql, kl, vl, plan=p, timeout_s=120)
    (out * p.layout.shard(torch.linspace(-1, 1, S).view(1, 1, S, 1), rank)).sum().backward()
    return bias.grad


def test_score_mod_parameter_gradients_sum_across_gloo_ranks_to_dense(pool2):
    S, H = 16, 2
    bias, score_mod = _rel_bias(S, H, seed=8)
    q, k, v = make_qkv(B=1, H=H, G=1, S=S, D=4, seed=9)
    ref, _ = reference.attention(q, k, v, mask_mod=masks.causal(), score_mod=score_mod)
    (ref * torch.linspace(-1, 1, S).view(1, 1, S, 1)).sum().backward()
    parts = pool2.run(worker_score_grad)
    assert all(g is not None for g in parts)
    assert_close(sum(parts), bias.grad, **TOL)     # each rank's share; DDP would all-reduce


# -------------------------------------------------------------------------------------
# 6. NaN in one document's keys stays in that document
# -------------------------------------------------------------------------------------
@pytest.mark.parametrize("kernel", ["sdpa", "reference"])
def test_nan_in_one_documents_keys_does_not_reach_other_documents(kernel):
    S, P = 64, 2
    ids = _docs(S, 24)
    mask = masks.causal() & masks.document(ids)
    p = fringe.plan(schedules.ring(), mask, seq_len=S, world_size=P, block_size=4, kernel=kernel)
    q, k, v = make_qkv(B=1, H=2, G=1, S=S, D=8, seed=10)
    k[:, :, 3] = float("nan")                       # a key of document 0
    out = fringe.simulate.attention(q, k, v, plan=p)
    ref, _ = reference.attention(q, k, v, mask_mod=mask)
    other = ids == 1
    assert bool(torch.isfinite(out[:, :, other]).all())
    assert_close(out[:, :, other], ref[:, :, other], **TOL)


# -------------------------------------------------------------------------------------
# 7. the lse output is differentiable
# -------------------------------------------------------------------------------------
def _lse_loss(out, lse, S):
    w = torch.linspace(-1, 1, S, dtype=torch.float64)
    return (out.sum(-1) * w).sum() + (lse * w.flip(0)).sum() + 0.1 * (lse ** 2).sum()


@pytest.mark.parametrize("kernel", ["sdpa", "reference"])
def test_a_loss_using_lse_gets_the_dense_gradient(kernel):
    S, P = 32, 4
    mask = masks.causal() & masks.document(_docs(S, 13))
    p = fringe.plan(schedules.zigzag(), mask, seq_len=S, world_size=P, block_size=2,
                    kernel=kernel)
    q, k, v = make_qkv(B=1, H=2, G=1, S=S, D=4, seed=11, requires_grad=True)
    ref, ref_lse = reference.attention(q, k, v, mask_mod=mask)
    want = torch.autograd.grad(_lse_loss(ref, ref_lse, S), (q, k, v))
    out, lse = fringe.simulate.attention(q, k, v, plan=p, return_lse=True)
    got = torch.autograd.grad(_lse_loss(out, lse, S), (q, k, v))
    for what, a, b in zip(("dq", "dk", "dv"), got, want):
        assert_close(a, b, **TOL, msg=lambda m: f"{what}: {m}")


def worker_lse_grad(rank: int, world_size: int):
    S = 16
    p = fringe.plan(schedules.zigzag(), masks.causal(), seq_len=S, world_size=world_size,
                    block_size=BLOCK)
    q, k, v = make_qkv(B=1, H=2, G=1, S=S, D=4, seed=12)
    ql, kl, vl = (t.requires_grad_() for t in _local(p, rank, q, k, v))
    out, lse = fringe.attention(ql, kl, vl, plan=p, return_lse=True, timeout_s=120)
    ((lse ** 2).sum() + 0.5 * out.sum()).backward()
    return ql.grad, kl.grad, vl.grad


def test_lse_gradient_on_gloo_ranks_matches_dense(pool2):
    S = 16
    p = fringe.plan(schedules.zigzag(), masks.causal(), seq_len=S, world_size=2, block_size=BLOCK)
    q, k, v = make_qkv(B=1, H=2, G=1, S=S, D=4, seed=12, requires_grad=True)
    out, lse = reference.attention(q, k, v, mask_mod=masks.causal())
    want = torch.autograd.grad((lse ** 2).sum() + 0.5 * out.sum(), (q, k, v))
    res = pool2.run(worker_lse_grad)
    for i, what in enumerate(("dq", "dk", "dv")):
        got = p.layout.unshard([res[r][i] for r in range(2)])
        assert_close(got, want[i], **TOL, msg=lambda m: f"{what}: {m}")


# -------------------------------------------------------------------------------------
# 8. vmap: masks that read b see each slice's own batch index
# -------------------------------------------------------------------------------------
def test_vmap_over_a_mask_that_reads_b_matches_each_slice_alone():
    S, P, B, N = 16, 2, 2, 3
    mask = masks.as_mask(lambda b, h, q, kv: (kv <= q) & ((kv + b) % 3 != 0), bh_invariant=False)
    p = fringe.plan(schedules.zigzag(), mask, seq_len=S, world_size=P, block_size=2,
                    batch_size=B)
    assert p.reads_batch
    qs, ks, vs = (torch.stack(t) for t in zip(*(make_qkv(B=B, H=2, G=1, S=S, D=4, seed=20 + i)
                                                 for i in range(N))))

    def f(q, k, v):
        return fringe.simulate.attention(q, k, v, plan=p)
    got = torch.func.vmap(f)(qs, ks, vs)
    for i in range(N):
        want, _ = reference.attention(qs[i], ks[i], vs[i], mask_mod=mask)
        assert_close(got[i], want, **TOL)
    # and gradients under vmap(grad)
    g = torch.func.vmap(torch.func.grad(lambda q, k, v: f(q, k, v).square().sum()))(qs, ks, vs)
    for i in range(N):
        qi = qs[i].clone().requires_grad_()
        want, _ = reference.attention(qi, ks[i], vs[i], mask_mod=mask)
        (dq,) = torch.autograd.grad(want.square().sum(), qi)
        assert_close(g[i], dq, **TOL)


# -------------------------------------------------------------------------------------
# 9. one rank's bad input fails every rank at once, naming that rank
# -------------------------------------------------------------------------------------
def worker_bad_input(rank: int, world_size: int, what: str):
    S = 2 * world_size * BLOCK * 2
    p = fringe.plan(schedules.zigzag(), masks.causal(), seq_len=S, world_size=world_size,
                    block_size=BLOCK)
    q, k, v = _local(p, rank, *make_qkv(B=1, H=2, G=1, S=S, D=4, seed=0))
    if rank == 1 and what == "kv dtype":
        k, v = k.float(), v.float()
    if rank == 1 and what == "k shape":
        k, v = k[..., :2], v[..., :2]
    try:
        fringe.attention(q, k, v, plan=p, timeout_s=120)
    except (ValueError, RankMismatch) as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


@pytest.mark.parametrize("what,cause", [("kv dtype", "dtype mismatch"), ("k shape", "head dim")])
def test_one_ranks_bad_input_fails_every_rank_with_its_reason(pool2, what, cause):
    for msg in pool2.run(worker_bad_input, what):
        assert msg.startswith("ValueError: rank 1 of 2 got invalid input"), msg
        assert cause in msg, msg


# -------------------------------------------------------------------------------------
# attention sinks: once per row, after the merge
# -------------------------------------------------------------------------------------
def _dense_with_sinks(q, k, v, mask, sinks):
    S, D = q.shape[-2], q.shape[-1]
    s = q @ k.transpose(-1, -2) / math.sqrt(D)
    allowed = masks.evaluate(mask, torch.arange(S), torch.arange(S))
    s = s.masked_fill(~allowed, -math.inf)
    col = sinks.view(1, -1, 1, 1).expand(*s.shape[:-1], 1)
    p = torch.softmax(torch.cat([s, col], dim=-1), dim=-1)[..., :-1]
    return p @ v


@pytest.mark.parametrize("name", ["ring", "zigzag", "striped", "balanced"])
def test_sinks_match_dense_softmax_with_a_sink_column(name):
    S, P, H = 32, 4, 2
    mask = masks.causal() & masks.document(_docs(S, 9))
    p = fringe.plan(getattr(schedules, name)(), mask, seq_len=S, world_size=P, block_size=2)
    q, k, v = make_qkv(B=1, H=H, G=H, S=S, D=4, seed=30, requires_grad=True)
    sinks = torch.tensor([0.5, -1.0], dtype=torch.float64, requires_grad=True)
    dout = torch.randn(1, H, S, 4, generator=torch.Generator().manual_seed(31), dtype=torch.float64)
    ref = _dense_with_sinks(q, k, v, mask, sinks)
    want = torch.autograd.grad(ref, (q, k, v, sinks), dout)
    out = fringe.simulate.attention(q, k, v, plan=p, sinks=sinks)
    assert_close(out, ref, **TOL)
    got = torch.autograd.grad(out, (q, k, v, sinks), dout)
    for what, a, b in zip(("dq", "dk", "dv", "dsinks"), got, want):
        assert_close(a, b, **TOL, msg=lambda m: f"{what}: {m}")


# -------------------------------------------------------------------------------------
# 11. timeouts and arguments get one clear message
# -------------------------------------------------------------------------------------
@pytest.mark.parametrize("bad", [0, -1, float("inf"), float("nan"), "5", True, 1e15, 1e10])
def test_bad_timeouts_are_rejected(bad):
    from fringe.runtime.distributed import resolve_timeout
    with pytest.raises(ValueError, match="timeout_s must be a"):
        resolve_timeout(bad)


def test_bad_fringe_timeout_env_does_not_break_import_and_is_named_at_use():
    code = ("import fringe, pytest\n"
            "from fringe.runtime.distributed import resolve_timeout\n"
            "try:\n    resolve_timeout(None)\nexcept ValueError as e:\n    print('ERR', e)\n")
    env = dict(os.environ, FRINGE_TIMEOUT="abc")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert "ERR the FRINGE_TIMEOUT environment variable must be a number" in out.stdout


def test_plan_arguments_are_validated_with_the_fix():
    z = schedules.zigzag()
    p = fringe.plan(z, masks.causal(), seq_len=np.int64(32), world_size=np.int32(2),
                    block_size=np.int64(4))
    assert p.seq_len == 32 and isinstance(p.seq_len, int)
    with pytest.raises(TypeError, match="score_mod must be callable"):
        fringe.plan(z, masks.causal(), seq_len=32, world_size=2, score_mod=3)
    with pytest.raises(ValueError, match="doc_ids has 31 entries but seq_len=32"):
        fringe.plan(z, masks.document(torch.zeros(31, dtype=torch.long)), seq_len=32,
                    world_size=2, block_size=4)
    with pytest.raises(ValueError, match="doc_ids has 33 entries but seq_len=32"):
        fringe.plan(z, masks.document(torch.zeros(33, dtype=torch.long)), seq_len=32,
                    world_size=2, block_size=4)
    with pytest.raises(ValueError, match="scale must be a finite number"):
        fringe.plan(z, masks.causal(), seq_len=32, world_size=2, block_size=4, scale=float("nan"))
    with pytest.raises(ValueError, match="seq_len must be an int"):
        fringe.plan(z, masks.causal(), seq_len=32.0, world_size=2)
    with pytest.raises(KeyError, match="unknown kernel"):
        fringe.plan(z, masks.causal(), seq_len=32, world_size=2, block_size=4, kernel="fast")
    q, k, v = make_qkv(B=1, H=1, G=1, S=32, D=4, seed=0)
    with pytest.raises(TypeError, match="plan must be a fringe.Plan"):
        fringe.simulate.attention(q, k, v, plan=None)


def test_plans_for_several_masks_share_one_layout():
    S, P = 64, 4
    full = fringe.plan(schedules.balanced(), masks.causal() & masks.document(_docs(S, 40)),
                       seq_len=S, world_size=P, block_size=2)
    window = fringe.plan(schedules.balanced(), masks.sliding_window(5), seq_len=S,
                         world_size=P, block_size=2, layout=full.layout)
    assert window.layout is full.layout
    q, k, v = make_qkv(B=1, H=2, G=1, S=S, D=4, seed=40)
    ref, _ = reference.attention(q, k, v, mask_mod=masks.sliding_window(5))
    assert_close(fringe.simulate.attention(q, k, v, plan=window), ref, **TOL)
    with pytest.raises(ValueError, match="the given layout is for S=64, P=4; expected S=64, P=2"):
        fringe.plan(schedules.ring(), masks.causal(), seq_len=S, world_size=2, block_size=2,
                    layout=full.layout)


def test_tp_size_divisibility_names_both_degrees_and_the_padded_length():
    assert fringe.padded_len(1000, 4, block_size=64, tp_size=3) == 1536
    assert fringe.padded_len(1024, 4, block_size=64) == 1024
    with pytest.raises(ValueError, match=r"not divisible by tp_size=3 .*pad the sequence to 1536 "
                                         r".* for CP=4 x TP=3"):
        fringe.plan(schedules.zigzag(), masks.causal(), seq_len=1024, world_size=4, block_size=64,
                    tp_size=3)
    p = fringe.plan(schedules.zigzag(), masks.causal(), seq_len=1536, world_size=4,
                    block_size=64, tp_size=3)
    assert p.local_len % 3 == 0
