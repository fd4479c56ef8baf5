"""fringe.train on a 2 x 2 (dp, cp) mesh of 4 gloo ranks, FSDP2 and DDP, against one process.

A tiny float64 model (embedding, one fringe attention layer with a per-row document &
causal mask whose boundaries change per batch and per replica, an optional MoE layer of
3 experts routed by token id, a head) trains for a few SGD steps on (dp, cp) = (2, 2). The
one process runs the same model on every replica's batches with dense reference attention
and the global token-weighted mean loss. Checked: each parameter's reduced gradient at step
1 (within 1e-4 of the tensor's largest entry), the logged global loss every step, the
parameters after SGD (where a 2x gradient error shows, and does in a negative control that
averages over CP as DDP would), gradient accumulation over 2 microbatches of different
token counts, an MoE expert no token of 3 of the 4 ranks is routed to, and the refusals.

One pool of 4 ranks serves every test (spawning is the slow part here).
"""
from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest
import torch

from fringe.launch import Workers

DP, CP = 2, 2
S, B, V, D, H, E = 32, 2, 12, 8, 2, 3
BLOCK = 4
STEPS, LR = 3, 0.5
GRAD_REL = 1e-4                    # the bar for a reduced gradient vs one process
PARAM_TOL = 1e-9                   # float64: CP vs one process differ by ~1e-15


class Tiny(torch.nn.Module):
    """Embedding -> attention (fringe on the CP ranks, dense reference in one process) ->
    [MoE: experts[id % E], a ModuleList, so an expert without a token has no gradient] ->
    head. Records which experts ran (``used``)."""

    def __init__(self, moe: bool) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(V, D)
        self.qkv = torch.nn.Linear(D, 3 * D)
        self.o = torch.nn.Linear(D, D)
        self.experts = torch.nn.ModuleList(torch.nn.Linear(D, D) for _ in range(E)) if moe else None
        self.head = torch.nn.Linear(D, V)
        self.used: set[int] = set()

    def forward(self, ids, *, attend):
        x = self.emb(ids)                                               # [B, L, D]
        b, n = ids.shape
        q, k, v = self.qkv(x).view(b, n, 3, H, D // H).permute(2, 0, 3, 1, 4)   # [B, H, L, D/H]
        a = attend(q, k, v).transpose(1, 2).reshape(b, n, D)
        x = x + self.o(a)
        if self.experts is not None:
            y = torch.zeros_like(x)
            for e, expert in enumerate(self.experts):
                sel = ids % E == e
                if bool(sel.any()):
                    self.used.add(e)
                    y = y.index_put((sel,), expert(x[sel]))
            x = x + y
        return self.head(x)


def batch(seed: int, step: int, replica: int, micro: int, *, moe: bool):
    """ids [B, S], cu_seqlens per row; new boundaries per (step, replica, microbatch). With
    ``moe``, tokens routed to expert 2 (id % 3 == 2) appear only in replica 0, microbatch 0,
    positions < 8: zigzag's first chunk, held by CP rank 0 - the other 3 ranks never run it."""
    g = torch.Generator().manual_seed(seed * 10_007 + step * 101 + replica * 11 + micro)
    ids = torch.randint(V, (B, S), generator=g)
    if moe:
        ids = torch.where(ids % E == 2, ids - 1, ids)
        if replica == 0 and micro == 0 and step == 0:
            ids[:, 3] = 2
    cus = []
    for _ in range(B):
        cuts = sorted(set(torch.randint(1, S, (3,), generator=g).tolist()))
        cus.append(torch.tensor([0, *cuts, S]))
    return ids, cus


def labels_of(ids: torch.Tensor, micro: int) -> torch.Tensor:
    lab = ids.clone()
    if micro == 1:
        lab[:, 5:17] = -100            # microbatches of different token counts
    return lab


def ce_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Summed token cross-entropy in the logits' dtype (float64 here; packing.loss_sum
    computes in float32, the right choice for training but not for an exactness test)."""
    return torch.nn.functional.cross_entropy(logits.reshape(-1, V), targets.reshape(-1),
                                             ignore_index=-100, reduction="sum")


def make_model(seed: int, moe: bool) -> Tiny:
    torch.manual_seed(seed)
    return Tiny(moe).double()


def mask_of(cus):
    from fringe import masks, packing
    return packing.document_mask(packing.doc_ids_from_cu_seqlens(cus)) & masks.causal()


# ---- the ranks ---------------------------------------------------------------------------


def worker_train(rank, world_size, *, wrap: str, seed: int, micro: int, moe: bool,
                 wrong_cp_mean: bool = False) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    import fringe
    import fringe.train
    from fringe import packing, schedules
    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", (DP, CP), mesh_dim_names=("dp", "cp"))
    cp_mesh, d = mesh["cp"], mesh.get_coordinate()[0]
    model = make_model(seed, moe)
    dp_cp = fringe.train.dp_cp_mesh(mesh)
    if wrap == "fsdp":
        from torch.distributed.fsdp import fully_shard
        fully_shard(model.qkv, mesh=dp_cp)
        fully_shard(model, mesh=dp_cp)
    else:
        from torch.nn.parallel import DistributedDataParallel as DDP
        model = DDP(model, process_group=dp_cp.get_group(), find_unused_parameters=moe)
    inner = model.module if wrap == "ddp" else model
    sync = fringe.train.GradSync(model, mesh)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    out = dict(losses=[], used=[])
    for t in range(STEPS):
        inner.used = set()
        shards, plans = [], []
        for m in range(micro):
            ids, cus = batch(seed, t, d, m, moe=moe)
            plan = fringe.plan(schedules.zigzag(), mask_of(cus), seq_len=S, world_size=CP,
                               block_size=BLOCK, batch_size=B)
            plans.append(plan)
            shards.append(packing.shard_batch(ids, labels_of(ids, m), plan=plan, group=cp_mesh,
                                              cu_seqlens=cus))
        step = sync.step(num_items=sum(s.num_items for s in shards), plans=plans)
        for plan, s in zip(plans, shards):
            logits = model(s.input_ids, attend=lambda q, k, v, plan=plan:
                           fringe.attention(q, k, v, plan=plan, group=cp_mesh))
            share = step.share(ce_sum(logits, s.shift_labels))
            if wrong_cp_mean:          # what averaging over the CP ranks gives
                share = share / CP
            share.backward()
        if t == 0:
            grads = {}
            for n, p in inner.named_parameters():
                g = p.grad if p.grad is not None else torch.zeros_like(p)
                grads[n] = (g.full_tensor() if hasattr(g, "full_tensor") else g).detach().clone()
            out["grads"] = grads
        opt.step()
        opt.zero_grad()
        out["losses"].append(step.loss())
        out["used"].append(sorted(inner.used))
    out["params"] = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
                     for n, p in inner.named_parameters()}
    return out


def worker_refusals(rank, world_size) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel as DDP

    import fringe
    import fringe.hf
    import fringe.train
    from fringe import masks, schedules
    mesh = init_device_mesh("cpu", (DP, CP), mesh_dim_names=("dp", "cp"))
    got = {}

    def attempt(key, fn):
        try:
            fn()
        except (ValueError, TypeError) as e:
            got[key] = f"{type(e).__name__}: {e}"
        else:
            got[key] = None

    m = make_model(0, False)
    fully_shard(m, mesh=mesh["dp"])             # data parallel only: the CP shares averaged
    attempt("fsdp_dp_only", lambda: fringe.train.GradSync(m, mesh))
    ddp = DDP(make_model(0, False), process_group=mesh["dp"].get_group())
    attempt("ddp_dp_only", lambda: fringe.train.GradSync(ddp, mesh))
    attempt("unwrapped", lambda: fringe.train.GradSync(make_model(0, False), mesh))
    attempt("1d_mesh", lambda: fringe.train.GradSync(ddp, mesh["cp"]))
    good = DDP(make_model(0, False), process_group=fringe.train.dp_cp_mesh(mesh).get_group())
    sync = fringe.train.GradSync(good, mesh)
    p4 = fringe.plan(schedules.ring(), masks.causal(), seq_len=S, world_size=4, block_size=BLOCK)
    attempt("plan_P4", lambda: sync.check_plans(p4))
    p2 = fringe.plan(schedules.ring(), masks.causal(), seq_len=S, world_size=2, block_size=BLOCK)
    attempt("plans_default_group", lambda: sync.check_plans(
        fringe.hf.Plans((fringe.hf.LayerPlan(p2),), group=None)))
    attempt("plans_dp_group", lambda: sync.check_plans(
        fringe.hf.Plans((fringe.hf.LayerPlan(p2),), group=mesh["dp"])))
    attempt("plans_ok", lambda: sync.check_plans(
        fringe.hf.Plans((fringe.hf.LayerPlan(p2),), group=mesh["cp"])))
    attempt("num_items", lambda: sync.step(num_items=-1))
    return got


# ---- one process -------------------------------------------------------------------------


def reference_run(*, seed: int, micro: int, moe: bool, grad_scale: float = 1.0) -> dict:
    from fringe import packing
    from fringe.ops import reference
    model = make_model(seed, moe)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    out = dict(losses=[])
    for t in range(STEPS):
        items = [(batch(seed, t, d, m, moe=moe), m) for d in range(DP) for m in range(micro)]
        targets = [packing.shift_labels(labels_of(ids, m), packing.doc_ids_from_cu_seqlens(cus))
                   for (ids, cus), m in items]
        n = sum(int((tg != -100).sum()) for tg in targets)
        total = 0.0
        for ((ids, cus), _), tg in zip(items, targets):
            mask = mask_of(cus)
            logits = model(ids, attend=lambda q, k, v, mask=mask:
                           reference.attention(q, k, v, mask_mod=mask)[0])
            loss = ce_sum(logits, tg) / n
            (loss * grad_scale).backward()
            total += loss.item()
        if t == 0:
            out["grads"] = {k: p.grad.detach().clone() for k, p in model.named_parameters()}
        opt.step()
        opt.zero_grad()
        out["losses"].append(total)
    out["params"] = {k: p.detach().clone() for k, p in model.named_parameters()}
    return out


# ---- tests -------------------------------------------------------------------------------


EXAMPLES = str(Path(__file__).resolve().parents[1] / "examples")


@pytest.fixture(scope="module")
def pool():
    """One pool of 4 ranks for every test. ``examples/`` is on the path while it starts, so
    the ranks can import ``hf_train`` (spawned workers take the parent's sys.path)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    sys.path.insert(0, EXAMPLES)
    try:
        with Workers(DP * CP, timeout_s=120, threads=1) as w:
            yield w
    finally:
        sys.path.remove(EXAMPLES)
        torch.set_num_threads(n)


def grad_errors(got: dict, want: dict) -> dict:
    """Per parameter: max |got - want| / max |want| (the step-1 reduced gradient check)."""
    return {k: float((got[k] - want[k]).abs().max() / want[k].abs().max().clamp_min(1e-30))
            for k in want}


def param_error(got: dict, want: dict) -> float:
    return max(float((got[k] - want[k]).abs().max()) for k in want)


CASES = [("fsdp", 1, False), ("fsdp", 2, True), ("ddp", 1, False), ("ddp", 2, True)]


@pytest.mark.parametrize("wrap,micro,moe", CASES, ids=[f"{w}-micro{m}{'-moe' if e else ''}"
                                                      for w, m, e in CASES])
def test_dp_cp_training_matches_one_process(pool, wrap, micro, moe):
    seed = 3 + micro + 2 * moe
    res = pool.run(worker_train, wrap=wrap, seed=seed, micro=micro, moe=moe)
    ref = reference_run(seed=seed, micro=micro, moe=moe)
    for r, got in enumerate(res):
        if wrap == "ddp" or r == 0:
            errs = grad_errors(got["grads"], ref["grads"])
            assert max(errs.values()) <= GRAD_REL, (r, errs)
        assert max(abs(a - b) for a, b in zip(got["losses"], ref["losses"])) <= 1e-12, \
            (got["losses"], ref["losses"])
        assert param_error(got["params"], ref["params"]) <= PARAM_TOL, r
    assert ref["losses"][0] != ref["losses"][-1]                       # it trains
    if moe:   # expert 2 ran on one rank of four at step 1, yet all reduced it (zero-filled)
        assert [2 in got["used"][0] for got in res] == [True, False, False, False]
        assert float(ref["grads"]["experts.2.weight"].abs().max()) > 0
    # a 2x gradient error shows in the parameters: the one-process run with halved gradients
    half = reference_run(seed=seed, micro=micro, moe=moe, grad_scale=0.5)
    assert param_error(half["params"], ref["params"]) > 1e3 * PARAM_TOL


def test_averaging_over_cp_fails_the_check(pool):
    """Negative control: DDP over dp x cp with the share not scaled for CP (averaged over CP,
    the documented mistake) gives the same loss but gradients / 2, and the check catches it."""
    res = pool.run(worker_train, wrap="ddp", seed=3, micro=1, moe=False, wrong_cp_mean=True)
    ref = reference_run(seed=3, micro=1, moe=False)
    errs = grad_errors(res[0]["grads"], ref["grads"])
    assert min(errs.values()) == pytest.approx(0.5, rel=1e-6)         # exactly half
    assert abs(res[0]["losses"][0] - ref["losses"][0]) <= 1e-12        # the loss cannot see it
    assert param_error(res[0]["params"], ref["params"]) > 1e3 * PARAM_TOL


def test_refusals_name_the_fix(pool):
    got = pool.run(worker_refusals)
    for r, g in enumerate(got):
        assert "does not span the CP dimension" in g["fsdp_dp_only"], (r, g)
        assert "FSDP" in g["fsdp_dp_only"] and "dp_cp_mesh" in g["fsdp_dp_only"]
        assert "does not span the CP dimension" in g["ddp_dp_only"] and "DDP" in g["ddp_dp_only"]
        assert g["unwrapped"].startswith("TypeError") and "fully_shard" in g["unwrapped"]
        assert "2-D" in g["1d_mesh"]
        assert "P=4" in g["plan_P4"] and "world_size=2" in g["plan_P4"]
        assert "default group" in g["plans_default_group"] and "group=mesh['cp']" in g["plans_default_group"]
        assert "group=mesh['cp']" in g["plans_dp_group"]
        assert g["plans_ok"] is None
        assert "num_items" in g["num_items"]


def test_hf_example_on_a_2x2_mesh(pool):
    """``examples/hf_train.py --world-size 4 --cp 2`` (FSDP2 over the dp x cp ranks): a tiny
    HF Llama on packed documents whose boundaries change per batch and per replica, vs
    transformers' sdpa in one process on every replica's rows."""
    pytest.importorskip("transformers")
    hf_train = importlib.import_module("hf_train")          # examples/ is on the path (pool)
    lines = []
    res = hf_train.run(hf_train.Config(world_size=4, cp=2, seq_len=128, batch_size=2, steps=3,
                                       block_size=16, threads=1),
                       progress=lines.append, workers=pool)
    assert res["ok"], lines
    assert res["grad_err"] <= hf_train.GRAD_TOLERANCE and res["param_diff"] < 1e-3, lines
    assert all(abs(a["loss"] - b["loss"]) <= hf_train.TOLERANCE for a, b in zip(res["cp"], res["single"]))
    assert res["single"][0]["loss"] != res["single"][-1]["loss"]
    assert "fsdp, dp=2 x cp=2" in lines[-1] and lines[-1].endswith("OK")
