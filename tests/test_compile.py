"""torch.compile: fringe attention is one opaque custom op, so a model that calls it compiles
with ``fullgraph=True``, matches eager (bitwise in float64 with ``aot_eager``; <= 1e-5 in
float32 with inductor), and a new plan of the same shapes (a new batch's documents) reuses the
compiled graph. On the virtual mesh, on 2 gloo ranks and in a transformers model.

Legend: B batch · H query heads · G kv heads · S sequence (L on one rank) · D head dim · E model.
"""
from __future__ import annotations

import copy
import gc

import pytest
import torch
import torch._dynamo          # tests only: fringe/ itself imports no torch._dynamo
from torch._dynamo.testing import CompileCounterWithBackend
from torch.testing import assert_close

import fringe
from fringe import _handle, masks, schedules
from fringe.autograd import apply_sinks
from fringe.ops import reference
from fringe.testing import tiny_llama, tolerances

S, P, H, G, D, E, B, BLOCK = 64, 2, 4, 2, 8, 32, 2, 8


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    """Each test counts its own compiles: no cache entries from an earlier test."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


class Tiny(torch.nn.Module):
    """q/kv/o projections around fringe attention, with a learnable relative bias read by the
    score_mod (a captured parameter) and gpt-oss style sinks."""

    def __init__(self, dtype: torch.dtype, *, virtual: bool = True) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.q = torch.nn.Linear(E, H * D, dtype=dtype)
        self.kv = torch.nn.Linear(E, 2 * G * D, dtype=dtype)
        self.o = torch.nn.Linear(H * D, E, dtype=dtype)
        for lin in (self.q, self.kv, self.o):
            lin.weight.data = torch.randn(lin.weight.shape, generator=g, dtype=dtype) * 0.2
            lin.bias.data = torch.randn(lin.bias.shape, generator=g, dtype=dtype) * 0.1
        self.rel = torch.nn.Parameter(torch.randn(H, 2 * S, generator=g, dtype=dtype) * 0.3)
        self.sinks = torch.nn.Parameter(torch.randn(H, generator=g, dtype=dtype))
        self.virtual = virtual

    def score_mod(self, score, b, h, q_idx, kv_idx):
        return score + self.rel[h, q_idx - kv_idx + S]

    def forward(self, x: torch.Tensor, plan) -> torch.Tensor:
        n, L = x.shape[:2]
        q = self.q(x).view(n, L, H, D).transpose(1, 2)
        k, v = self.kv(x).view(n, L, 2, G, D).permute(2, 0, 3, 1, 4)
        attend = fringe.simulate.attention if self.virtual else fringe.attention
        o = attend(q, k, v, plan=plan, sinks=self.sinks)
        return self.o(o.transpose(1, 2).reshape(n, L, H * D))


def _docs(i: int) -> torch.Tensor:
    """Batch i's document ids: the boundaries move every batch (a new plan, same shapes)."""
    cut = 16 + 8 * i
    return torch.tensor([0] * cut + [1] * (S - cut))


def _plan(model: Tiny, i: int, *, world_size: int = P, kv: str = "resend"):
    return fringe.plan(schedules.zigzag(), masks.document(_docs(i)) & masks.causal(), seq_len=S,
                       world_size=world_size, block_size=BLOCK, score_mod=model.score_mod, kv=kv)


def _batch(i: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(B, S, E, generator=torch.Generator().manual_seed(100 + i), dtype=dtype)


def _step(run, model, x, plan):
    """Loss of ``run`` (the model or its compiled form) and every parameter's gradient."""
    loss = run(x, plan).square().mean()
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return loss.detach(), grads


def _compiled_vs_eager(model, backend: str, dtype, batches: int = 2, *, kv: str = "resend"):
    cnt = CompileCounterWithBackend(backend)
    compiled = torch.compile(model, backend=cnt, fullgraph=True)
    pairs = []
    for i in range(batches):
        plan, x = _plan(model, i, kv=kv), _batch(i, dtype)
        pairs.append((_step(compiled, model, x, plan), _step(model, model, x, plan), plan, x))
    return cnt, pairs


@pytest.mark.parametrize("kv", ["resend", "keep"])
def test_virtual_mesh_model_compiles_fullgraph_bitwise_and_once(kv):
    """aot_eager, float64: loss and every gradient (the score_mod's captured parameter and the
    sinks included) equal eager bitwise; the second batch's new plan does not recompile;
    ``kv="keep"`` (kept kv buffers packed flat, an unbacked size) too."""
    model = Tiny(torch.float64)
    cnt, pairs = _compiled_vs_eager(model, "aot_eager", torch.float64, kv=kv)
    assert cnt.frame_count == 1, f"{cnt.frame_count} compiles for 2 batches of the same shapes"
    for (loss, grads), (want_loss, want_grads), _, _ in pairs:
        assert torch.equal(loss, want_loss)
        assert grads.keys() == want_grads.keys() and {"rel", "sinks"} <= grads.keys()
        for name in grads:
            assert torch.equal(grads[name], want_grads[name]), name
            assert grads[name].abs().sum() > 0, name
    if kv == "resend":      # keep: the kept size is data-dependent; fullgraph (above) takes
        explain = torch._dynamo.explain(model)(pairs[0][3], pairs[0][2])    # it, explain not
        assert explain.graph_break_count == 0 and explain.graph_count == 1


def test_captured_parameter_and_sinks_get_the_dense_gradient_under_compile():
    """Against the dense reference (not only eager): attention with the score_mod's bias and
    sinks, compiled, gives float64-exact gradients for q, k, v, the bias and the sinks."""
    model = Tiny(torch.float64)
    plan = _plan(model, 1)
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(B, n, S, D, generator=g, dtype=torch.float64, requires_grad=True)
               for n in (H, G, G))
    dout = torch.randn(B, H, S, D, generator=g, dtype=torch.float64)

    def cp(q, k, v):
        return fringe.simulate.attention(q, k, v, plan=plan, sinks=model.sinks)

    def dense(q, k, v):
        out, lse = reference.attention(q, k, v, mask_mod=plan.mask_mod, score_mod=model.score_mod)
        return apply_sinks(out, lse, model.sinks)[0]

    wrt = (q, k, v, model.rel, model.sinks)
    got_out = torch.compile(cp, backend="aot_eager", fullgraph=True)(q, k, v)
    got = torch.autograd.grad(got_out, wrt, dout)
    want_out = dense(q, k, v)
    want = torch.autograd.grad(want_out, wrt, dout)
    exact = tolerances(torch.float64)
    assert_close(got_out, want_out, **exact)
    for name, a, b in zip(("dq", "dk", "dv", "d rel", "d sinks"), got, want):
        assert_close(a, b, **exact, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("params", [0, 2])
def test_compiles_without_gradients(params):
    """Inference (torch.no_grad, or inputs that need no gradient) compiles too: fullgraph, bitwise
    eager. (dynamo inlines the Function's forward then and used to pass its
    ctx as q: InternalTorchDynamoError for a forward taking *params with 0 or >= 2 of them.)"""
    ws = [torch.randn(H, dtype=torch.float64, requires_grad=True) for _ in range(params)]

    def score_mod(s, b, h, q_idx, kv_idx):
        for w in ws:
            s = s + w[h] * (q_idx - kv_idx)
        return s
    plan = fringe.plan(schedules.zigzag(), masks.causal(), seq_len=S, world_size=P,
                       block_size=BLOCK, score_mod=score_mod if params else None)
    assert len(plan.score_params) == params
    q, k, v = (torch.randn(B, h, S, D, generator=torch.Generator().manual_seed(n),
                           dtype=torch.float64) for n, h in enumerate((H, G, G)))
    cnt = CompileCounterWithBackend("aot_eager")
    f = torch.compile(lambda q, k, v: fringe.simulate.attention(q, k, v, plan=plan),
                      backend=cnt, fullgraph=True)
    with torch.no_grad():
        want = fringe.simulate.attention(q, k, v, plan=plan)
        assert torch.equal(f(q, k, v), want)
    assert torch.equal(f(q, k, v), want) and cnt.frame_count == 2     # one per grad mode


def test_a_parameter_swapped_by_functional_call_raises_instead_of_a_zero_gradient():
    """torch.func.grad of torch.func.functional_call(model, params, ...): the score_mod reads
    the swapped-in params, the op routed the gradient to the Parameter fringe.plan captured,
    and grad(...)["rel"] came back all zeros with no error. Now the call raises; the forward
    value (nothing to differentiate) and plain autograd stay as they were."""
    model = Tiny(torch.float64)
    x, plan = _batch(0, torch.float64), _plan(model, 0)
    params = {n: p.detach() for n, p in model.named_parameters()}
    with torch.no_grad():
        assert torch.equal(torch.func.functional_call(model, params, (x, plan)), model(x, plan))
    loss = lambda ps: torch.func.functional_call(model, ps, (x, plan)).square().sum()  # noqa: E731
    with pytest.raises(ValueError, match="not the plan's score_params"):
        torch.func.grad(loss)(params)
    with pytest.raises(ValueError, match="not the plan's score_params"):
        loss({n: p.clone().requires_grad_() for n, p in params.items()}).backward()
    model(x, plan).square().sum().backward()
    assert model.rel.grad.abs().sum() > 0


def test_inductor_float32_matches_eager():
    """The one inductor case: forward and backward of the model within 1e-5 of eager."""
    model = Tiny(torch.float32)
    cnt, pairs = _compiled_vs_eager(model, "inductor", torch.float32)
    assert cnt.frame_count == 1
    for (loss, grads), (want_loss, want_grads), _, _ in pairs:
        assert_close(loss, want_loss, atol=1e-5, rtol=1e-5)
        for name in grads:
            assert_close(grads[name], want_grads[name], atol=1e-5, rtol=1e-5,
                         msg=lambda m: f"{name}: {m}")


def test_plan_handles_leave_with_their_plans_and_copies_get_their_own():
    model = Tiny(torch.float64)
    gc.collect()
    before = _handle.live()
    plan = _plan(model, 0)
    assert _handle.live() == before + 1
    assert plan.handle.dtype == torch.int64 and plan.handle.dim() == 0
    assert _handle.resolve(plan.handle) is plan
    for other in (copy.copy(plan), copy.deepcopy(plan)):
        assert int(other.handle) != int(plan.handle)
        assert _handle.resolve(other.handle) is other
        del other
    key = plan.handle.clone()
    del plan
    gc.collect()
    assert _handle.live() == before
    with pytest.raises(RuntimeError, match="names no live plan"):
        _handle.resolve(key)


@pytest.mark.parametrize("compiled", [False, True])
def test_a_plan_dropped_after_the_forward_lives_until_the_backward(compiled):
    """``model(x, fringe.plan(...))``: nothing but the autograd graph holds the plan (through
    its saved handle) when the backward runs."""
    model = Tiny(torch.float64)
    run = torch.compile(model, backend="aot_eager", fullgraph=True) if compiled else model
    loss = run(_batch(0, torch.float64), _plan(model, 0)).square().mean()
    gc.collect()
    loss.backward()
    assert model.rel.grad is not None and model.rel.grad.abs().sum() > 0


def test_eager_errors_keep_their_types_through_the_op():
    model = Tiny(torch.float64)
    plan = _plan(model, 0)
    q = torch.zeros(B, H, S + 8, D, dtype=torch.float64)
    k = v = torch.zeros(B, G, S + 8, D, dtype=torch.float64)
    with pytest.raises(ValueError, match="the plan expects global length 64"):
        fringe.simulate.attention(q, k, v, plan=plan)
    with pytest.raises(TypeError, match="plan must be a fringe.Plan"):
        fringe.simulate.attention(q, k, v, plan="zigzag")


# ---- 2 gloo ranks -------------------------------------------------------------------------


def worker_compiled_step(rank: int, world_size: int):
    """Each rank: the model on its shard (fringe.attention over the default group), compiled
    with fullgraph vs eager, for two batches with different documents."""
    torch.set_num_threads(1)
    model = Tiny(torch.float64, virtual=False)
    cnt = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(model, backend=cnt, fullgraph=True)
    diffs, stats = [], None
    for i in range(2):
        plan = _plan(model, i, world_size=world_size)
        x = plan.layout.shard(_batch(i, torch.float64), rank, dim=1)
        (loss, grads), (want_loss, want_grads) = (_step(compiled, model, x, plan),
                                                  _step(model, model, x, plan))
        diffs.append(max([(loss - want_loss).abs().item()]
                         + [(grads[n] - want_grads[n]).abs().max().item() for n in grads]))
        if i == 0:
            _step(compiled, model, x, plan)
            stats = fringe.last_run().summary()
    breaks = torch._dynamo.explain(model)(x, plan).graph_break_count
    return dict(diffs=diffs, frames=cnt.frame_count, breaks=breaks, stats=stats)


def test_gloo_model_compiles_fullgraph_bitwise_and_once():
    from fringe.launch import Workers
    with Workers(2, timeout_s=240) as w:
        res = w.run(worker_compiled_step)
    for r in res:
        assert r["diffs"] == [0.0, 0.0], r
        assert r["frames"] == 1 and r["breaks"] == 0, r
        assert r["stats"]["forward"]["steps"] > 0 and r["stats"]["backward"]["steps"] > 0, r


def test_compiled_calls_on_a_process_group_and_a_device_mesh():
    """group= a ProcessGroup (named to the op by its ranks) or a DeviceMesh (named once at
    trace time): fullgraph, equal to eager, and last_run(group) sees the compiled call."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    plan = fringe.plan(schedules.zigzag(), masks.causal(), seq_len=32, world_size=1,
                       block_size=BLOCK)
    q, k, v = (torch.randn(1, 2, 32, 4, generator=torch.Generator().manual_seed(n),
                           dtype=torch.float64, requires_grad=True) for n in range(3))
    assert not dist.is_initialized()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        for group in (dist.new_group([0]), init_device_mesh("cpu", (1,))):
            torch._dynamo.reset()
            cnt = CompileCounterWithBackend("aot_eager")
            f = torch.compile(lambda q, k, v, p: fringe.attention(q, k, v, plan=p, group=group),
                              backend=cnt, fullgraph=True)
            got = f(q, k, v, plan)
            (dq,) = torch.autograd.grad(got.sum(), (q,))
            assert fringe.last_run(group).summary()["backward"]["steps"] > 0
            want = fringe.attention(q, k, v, plan=plan, group=group)
            assert torch.equal(got, want) and cnt.frame_count == 1
            assert torch.equal(dq, torch.autograd.grad(want.sum(), (q,))[0])
    finally:
        dist.destroy_process_group()


# ---- transformers -------------------------------------------------------------------------


def test_compiled_hf_llama_matches_eager_and_compiles_once():
    """A tiny Llama with attn_implementation="fringe" on one gloo rank (in this process):
    fullgraph with aot_eager, loss and gradients equal to eager, one compile for two batches
    with different documents."""
    pytest.importorskip("transformers")
    import torch.distributed as dist

    import fringe.hf
    from fringe import packing
    model = tiny_llama(S)
    cnt = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(model, backend=cnt, fullgraph=True)
    g = torch.Generator().manual_seed(1)
    assert not dist.is_initialized()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        for i in range(2):
            ids = torch.randint(0, 32, (B, S), generator=g)
            cus = [torch.tensor([0, 10 + 5 * i, S]), torch.tensor([0, 7, 40 - i, S])]
            doc = packing.doc_ids_from_cu_seqlens(cus)
            plans = fringe.hf.plans(model, schedules.zigzag(), packing.document_mask(doc),
                                    seq_len=S, world_size=1, block_size=BLOCK, batch_size=B)
            shard = packing.shard_batch(ids, ids, plan=plans.plans, rank=0, cu_seqlens=cus)
            inputs = fringe.hf.model_inputs(shard, plans)
            got = []
            for m in (compiled, model):
                out = m(**inputs, use_cache=False)
                out.loss.backward()
                got.append((out.loss.detach(), [p.grad.clone() for p in model.parameters()]))
                model.zero_grad(set_to_none=True)
            (loss, grads), (want_loss, want_grads) = got
            assert_close(loss, want_loss, atol=1e-5, rtol=1e-5)
            for a, b in zip(grads, want_grads):
                assert_close(a, b, atol=1e-5, rtol=1e-5)
    finally:
        dist.destroy_process_group()
    assert cnt.frame_count == 1


# ---- torch.func through the op ------------------------------------------------------------


@pytest.mark.parametrize("kv", ["resend", "keep"])
def test_vmap_of_grad_per_slice_with_kept_kv_matches_dense(kv):
    """A mask that reads b runs each vmapped slice alone; with kv="keep" each slice's kept kv
    buffers (packed flat) come back stacked and reach that slice's backward."""
    Sv, N = 16, 3
    mask = masks.as_mask(lambda b, h, q, k: (k <= q) & ((k + b) % 3 != 0), bh_invariant=False)
    plan = fringe.plan(schedules.zigzag(), mask, seq_len=Sv, world_size=2, block_size=2,
                       batch_size=2, kv=kv)
    g = torch.Generator().manual_seed(9)
    qs, ks, vs = (torch.randn(N, 2, n, Sv, 4, generator=g, dtype=torch.float64)
                  for n in (2, 1, 1))

    def loss(q, k, v):
        return fringe.simulate.attention(q, k, v, plan=plan).square().sum()
    got = torch.func.vmap(torch.func.grad(loss, argnums=(0, 1, 2)))(qs, ks, vs)
    for i in range(N):
        ins = [t[i].clone().requires_grad_() for t in (qs, ks, vs)]
        want = torch.autograd.grad(reference.attention(*ins, mask_mod=mask)[0].square().sum(), ins)
        for a, b in zip(got, want):
            assert_close(a[i], b, **tolerances(torch.float64))
