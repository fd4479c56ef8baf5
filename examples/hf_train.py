"""Train a Hugging Face Llama under fringe CP on gloo ranks, checked against one process.

    python examples/hf_train.py --world-size 2            # P=2 CP ranks (dp=1)
    python examples/hf_train.py --world-size 4 --cp 2     # a 2 x 2 (dp, cp) mesh, FSDP2
    #   --parallel ddp: DDP instead of FSDP2; --model qwen2 adds a window layer; --threads N

A tiny Llama-architecture model (random weights from a config, no downloads) trains for a
few steps on packed synthetic documents whose boundaries change every batch (and differ
between the rows of a batch, and between the data-parallel replicas). Twice, from the same
weights and data:

* CP: ``attn_implementation="fringe"`` on ``--world-size`` spawned gloo ranks, a (dp, cp)
  ``DeviceMesh`` (dp = world size / cp). The model is wrapped by FSDP2's ``fully_shard``
  (or DDP) over the dp x cp ranks, and :class:`fringe.train.GradSync` makes the gradient
  reduction a sum of the ranks' token-weighted shares (each rank: sum over its targets /
  the global target count over every replica). Each replica gets its own batch; each CP
  rank its shard from :func:`fringe.packing.shard_batch` (labels shifted on the global
  sequence before sharding, global RoPE positions restarting per document). A
  ``--seq-len`` that does not fit the layout (e.g. 250 at block 32) is padded by fringe:
  pad tokens attend to nothing and their labels are ignored, so the loss is the unpadded one.
* one process: transformers' own ``sdpa`` attention on every replica's rows as one batch,
  packed documents given as ``position_ids`` that restart per document (transformers then
  builds the document mask itself; ``use_cache=False``, since its packed-sequence detection
  turns off when a KV cache exists). Every step checks the mask its attention layers
  receive equals causal & same-document (& window).

Prints the losses side by side, each parameter's step-1 gradient error and the parameter
difference after training, and exits non-zero if a loss differs by more than
:data:`TOLERANCE` or a step-1 gradient by more than :data:`GRAD_TOLERANCE`.
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
import time

import torch

#: Largest |loss(CP) - loss(one process)| accepted at any step (float32). Both runs do the
#: same float32 math up to the order of the attention sums (tiles merged by lse vs one
#: fused kernel): ~1e-7 per step, amplified slowly by training. Measured max: see README.
TOLERANCE = 1e-4
#: Largest step-1 gradient error accepted, per parameter, relative to the tensor's largest
#: entry: a gradient summed or averaged over the wrong ranks is off by a factor (0.5 at cp=2)
#: while the loss still matches.
GRAD_TOLERANCE = 1e-4
IGNORE = -100


@dataclasses.dataclass(frozen=True)
class Config:
    world_size: int = 2
    cp: int | None = None           # CP ranks per replica (None: world_size); dp = world_size / cp
    parallel: str = "fsdp"          # "fsdp" (fully_shard) or "ddp", over the dp x cp ranks
    threads: int | None = None      # torch intra-op threads per process (None: torch's default
    #                                 here, cores / world_size on the ranks)
    seq_len: int = 256
    batch_size: int = 2
    steps: int = 4
    block_size: int = 32
    model: str = "llama"            # "llama", "qwen2" / "gpt_oss" (layer 0 uses a sliding window;
    #                                 gpt-oss has attention sinks, passed as s_aux)
    window: int = 48
    schedule: str = "zigzag"
    boundaries: str = "cu_seqlens"  # how the CP side gets them: "cu_seqlens" or "position_ids"
    checkpointing: bool = False     # activation checkpointing on the CP side (layers recompute
    #                                 attention in the backward: the plans must reach it again)
    vocab: int = 64
    lr: float = 3e-3
    seed: int = 0

    @property
    def cp_size(self) -> int:
        return self.world_size if self.cp is None else self.cp

    @property
    def dp_size(self) -> int:
        return self.world_size // self.cp_size

    def __post_init__(self) -> None:
        if self.cp_size < 1 or self.world_size % self.cp_size:
            raise ValueError(f"--cp {self.cp} must divide --world-size {self.world_size} "
                             f"(dp = world size / cp)")
        if self.parallel not in ("fsdp", "ddp"):
            raise ValueError(f"--parallel {self.parallel!r}: use fsdp or ddp")


def model_config(cfg: Config, attn: str):
    kw = dict(vocab_size=cfg.vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=cfg.seq_len,
              attention_dropout=0.0, use_cache=False, tie_word_embeddings=False)
    if cfg.model == "llama":
        from transformers import LlamaConfig
        c = LlamaConfig(**kw)
    elif cfg.model == "qwen2":
        from transformers import Qwen2Config
        c = Qwen2Config(**kw, use_sliding_window=True, sliding_window=cfg.window,
                        layer_types=["sliding_attention", "full_attention"])
    elif cfg.model == "gpt_oss":
        from transformers import GptOssConfig
        c = GptOssConfig(**kw, head_dim=16, num_local_experts=4, num_experts_per_tok=2,
                         rope_parameters=dict(rope_type="default", rope_theta=10_000.0),
                         sliding_window=cfg.window, layer_types=["sliding_attention", "full_attention"])
    elif cfg.model == "deepseek_v3":       # MLA: q/k head dim 8+16=24, v head dim 12; MoE layer 1
        from transformers import DeepseekV3Config
        c = DeepseekV3Config(**{**kw, "num_key_value_heads": 4}, q_lora_rank=16, kv_lora_rank=16,
                             qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=12,
                             moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2,
                             n_shared_experts=1, n_group=1, topk_group=1, first_k_dense_replace=1)
    else:
        raise ValueError(f"--model {cfg.model!r}: use llama, qwen2, gpt_oss or deepseek_v3")
    c._attn_implementation = attn
    return c


def build_model(cfg: Config, attn: str):
    from transformers import AutoModelForCausalLM
    torch.manual_seed(cfg.seed)
    return AutoModelForCausalLM.from_config(model_config(cfg, attn), dtype=torch.float32)


def make_batch(step: int, cfg: Config, replica: int = 0) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Packed rows of motif-repeating documents; new, per-row boundaries every step and
    for every data-parallel replica.

    Returns:
        input_ids int64 ``[B, S]`` and one ``cu_seqlens`` per row.
    """
    g = torch.Generator().manual_seed(cfg.seed * 1_000_003 + step + 1 + 7919 * replica)
    S = cfg.seq_len
    ids, cus = torch.empty(cfg.batch_size, S, dtype=torch.int64), []
    for b in range(cfg.batch_size):
        lengths = []
        while sum(lengths) < S:
            lengths.append(int(torch.randint(max(2, S // 16), S // 3 + 1, (), generator=g)))
        lengths[-1] -= sum(lengths) - S
        start = 0
        for n in lengths:
            motif = torch.randint(cfg.vocab, (int(torch.randint(2, 7, (), generator=g)),), generator=g)
            ids[b, start:start + n] = motif.repeat(n // motif.numel() + 1)[:n]
            start += n
        cus.append(torch.cumsum(torch.tensor([0] + lengths), 0))
    return ids, cus


# ---------------------------------------------------------------------------------------------
# CP ranks

_STATE: dict = {}


def _schedule(name: str):
    from fringe import schedules
    return schedules.get(name)


def cp_setup(rank: int, world_size: int, cfg: Config, weights: dict) -> int:
    from torch.distributed.device_mesh import init_device_mesh

    import fringe.hf
    import fringe.train
    fringe.hf.register()
    torch.manual_seed(cfg.seed)
    model = build_model(cfg, fringe.hf.NAME)
    model.load_state_dict(weights)
    model.train()
    if cfg.checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=dict(use_reentrant=False))
    # the (dp, cp) mesh; the wrapper reduces gradients over all its dp x cp ranks
    mesh = init_device_mesh("cpu", (cfg.dp_size, cfg.cp_size), mesh_dim_names=("dp", "cp"))
    dp_cp = fringe.train.dp_cp_mesh(mesh)
    inner = model
    if cfg.parallel == "fsdp":
        from torch.distributed.fsdp import fully_shard
        for layer in model.model.layers:
            fully_shard(layer, mesh=dp_cp)
        fully_shard(model, mesh=dp_cp)
    else:
        from torch.nn.parallel import DistributedDataParallel
        model = DistributedDataParallel(model, process_group=dp_cp.get_group())
        inner = model.module
    sync = fringe.train.GradSync(model, mesh)      # sum of the shares, by construction
    _STATE.update(cfg=cfg, model=model, inner=inner, mesh=mesh, sync=sync,
                  opt=torch.optim.AdamW(model.parameters(), lr=cfg.lr))
    return rank


def _full(t: torch.Tensor) -> torch.Tensor:
    """A DTensor (FSDP2's sharded parameter or gradient) gathered; a tensor as is."""
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()


def cp_params(rank: int, world_size: int) -> dict:
    out = {k: _full(v) for k, v in _STATE["inner"].state_dict().items()}    # collective (FSDP)
    return out if rank == 0 else {}


def cp_step(rank: int, world_size: int, step: int) -> dict:
    import torch.distributed as dist

    import fringe
    import fringe.hf
    from fringe import packing
    cfg, model, opt, mesh, sync = (_STATE[k] for k in ("cfg", "model", "opt", "mesh", "sync"))
    cp_mesh = mesh["cp"]
    input_ids, cus = make_batch(step, cfg, replica=mesh.get_coordinate()[0])   # this replica's
    dist.barrier()
    t0 = time.perf_counter()
    doc_ids = packing.doc_ids_from_cu_seqlens(cus)                       # [B, S]
    mask = packing.document_mask(doc_ids)
    plans = fringe.hf.plans(_STATE["inner"], _schedule(cfg.schedule), mask, seq_len=cfg.seq_len,
                            world_size=cfg.cp_size, group=cp_mesh, block_size=cfg.block_size,
                            batch_size=cfg.batch_size if doc_ids.dim() == 2 else None)
    if cfg.boundaries == "cu_seqlens":
        bounds = dict(cu_seqlens=cus)
    else:
        bounds = dict(position_ids=packing.positions_in_document(doc_ids))
    shard = packing.shard_batch(input_ids, input_ids, plan=plans.plans, group=cp_mesh, **bounds)
    # N = targets over every replica (one all-reduce); the plans must run on mesh["cp"]
    acc = sync.step(num_items=shard.num_items, plans=plans)
    with fringe.recording() as rec:                     # counts fringe.attention calls
        out = model(**fringe.hf.model_inputs(shard, plans), use_cache=False)
        acc.backward(out.loss, num_items=shard.num_items)   # HF's loss: this rank's sum / num_items
    grads = None
    if step == 0:                                       # the reduced gradients (collective)
        grads = {n: _full(p.grad) for n, p in _STATE["inner"].named_parameters()}
    opt.step()
    opt.zero_grad()
    return dict(loss=acc.loss(), seconds=time.perf_counter() - t0, attention_calls=len(rec.runtimes),
                padded_len=plans.layout.seq_len, grads=grads if rank == 0 else None)


# ---------------------------------------------------------------------------------------------
# one process, transformers' sdpa


def expected_mask(doc_ids: torch.Tensor, window: int | None) -> torch.Tensor:
    """bool ``[B, 1, S, S]``: causal & same document (& ``q - kv < window``)."""
    S = doc_ids.shape[-1]
    q, kv = torch.arange(S)[:, None], torch.arange(S)[None, :]
    m = (doc_ids[:, :, None] == doc_ids[:, None, :]) & (q >= kv)
    if window is not None:
        m &= (q - kv) < window
    return m[:, None]


def check_masks(model, doc_ids: torch.Tensor):
    """Forward pre-hooks asserting every attention layer receives the document mask."""
    handles, seen = [], []
    for mod in model.modules():
        if hasattr(mod, "scaling") and hasattr(mod, "layer_idx"):
            want = expected_mask(doc_ids, getattr(mod, "sliding_window", None))

            def hook(m, args, kwargs, want=want):
                got = kwargs.get("attention_mask")
                if got is not None and got.is_floating_point():     # eager: additive 0 / -inf
                    got = got == 0
                if got is None or got.dtype != torch.bool or not torch.equal(got.expand_as(want), want):
                    raise AssertionError(f"layer {m.layer_idx}: sdpa did not receive the document mask "
                                         f"(got {None if got is None else (got.dtype, tuple(got.shape))})")
                seen.append(m.layer_idx)
            handles.append(mod.register_forward_pre_hook(hook, with_kwargs=True))
    return handles, seen


def reference_attention(cfg: Config) -> str:
    """transformers' own attention for the one-process run (gpt-oss has no sdpa: eager)."""
    return "eager" if cfg.model == "gpt_oss" else "sdpa"


def single_run(cfg: Config, weights: dict) -> tuple[list[dict], dict]:
    from fringe import packing
    model = build_model(cfg, reference_attention(cfg))
    model.load_state_dict(weights)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    out = []
    grads = None
    for step in range(cfg.steps):
        parts = [make_batch(step, cfg, replica=d) for d in range(cfg.dp_size)]
        input_ids = torch.cat([ids for ids, _ in parts])               # every replica's rows
        cus = [cu for _, c in parts for cu in c]
        t0 = time.perf_counter()
        doc_ids = packing.doc_ids_from_cu_seqlens(cus)
        position_ids = packing.positions_in_document(doc_ids).expand(input_ids.shape[0], -1)
        targets = packing.shift_labels(input_ids, doc_ids)
        extra = {}
        if cfg.model == "gpt_oss":
            # transformers' gpt-oss builds its masks without position_ids, so it never detects
            # packed documents (the hooks below catch that): give it the masks explicitly
            extra["attention_mask"] = {
                kind: torch.where(expected_mask(doc_ids, w), 0.0, torch.finfo(torch.float32).min)
                for kind, w in (("full_attention", None), ("sliding_attention", cfg.window))}
        handles, seen = check_masks(model, doc_ids)
        try:
            res = model(input_ids=input_ids, position_ids=position_ids, labels=targets,
                        shift_labels=targets, use_cache=False, **extra)   # mean over targets
        finally:
            for h in handles:
                h.remove()
        if len(seen) != model.config.num_hidden_layers:
            raise AssertionError(f"the mask check saw layers {seen}")
        opt.zero_grad(set_to_none=False)
        res.loss.backward()
        if step == 0:
            grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
        opt.step()
        out.append(dict(loss=res.loss.item(), seconds=time.perf_counter() - t0))
    return out, {k: v.detach().clone() for k, v in model.state_dict().items()}, grads


# ---------------------------------------------------------------------------------------------


def run(cfg: Config, *, progress=print, timeout_s: float = 300.0, workers=None) -> dict:
    """Both runs; returns ``dict(cp=[...], single=[...], max_diff=float, ok=bool)``.

    ``workers``: a started :class:`fringe.launch.Workers` of ``cfg.world_size`` ranks to
    reuse (the tests run several models on one pool); default: a fresh one.
    """
    import contextlib

    from fringe.launch import Workers
    torch.manual_seed(cfg.seed)
    weights = {k: v.clone() for k, v in build_model(cfg, reference_attention(cfg)).state_dict().items()}
    single, final, single_grads = single_run(cfg, weights)
    cp = []
    pool = contextlib.nullcontext(workers) if workers is not None else \
        Workers(cfg.world_size, timeout_s=timeout_s, threads=cfg.threads)
    with pool as w:
        if w.world_size != cfg.world_size:
            raise ValueError(f"workers has {w.world_size} ranks, the config asks for {cfg.world_size}")
        w.run(cp_setup, cfg, weights)
        for step in range(cfg.steps):
            res = w.run(cp_step, step)
            if step == 0:
                cp_grads = res[0]["grads"]
            cp.append(dict(loss=res[0]["loss"], seconds=max(r["seconds"] for r in res),
                           attention_calls=res[0]["attention_calls"], padded_len=res[0]["padded_len"]))
        cp_final = w.run(cp_params)[0]
    param_diff = max(float((cp_final[k] - final[k]).abs().max()) for k in final)
    # each parameter's reduced step-1 gradient vs one process, relative to its largest entry
    grad_err = {n: float((cp_grads[n] - g).abs().max() / g.abs().max().clamp_min(1e-30))
                for n, g in single_grads.items()}
    worst = max(grad_err, key=grad_err.get)
    diffs = [abs(a["loss"] - b["loss"]) for a, b in zip(cp, single)]
    if cp and cp[0]["padded_len"] != cfg.seq_len:
        progress(f"S={cfg.seq_len} does not fit the layout: fringe padded it to {cp[0]['padded_len']} "
                 f"(pad tokens attend to nothing, their labels are ignored); the one-process run is "
                 f"unpadded")
    ref = f"loss ({reference_attention(cfg)})"
    progress(f"{'step':>4}  {'loss (CP)':>12}  {ref:>12}  {'|diff|':>8}  "
             f"{'CP step s':>9}  {'1-proc step s':>13}")
    for i, (a, b, d) in enumerate(zip(cp, single, diffs)):
        progress(f"{i + 1:>4}  {a['loss']:>12.6f}  {b['loss']:>12.6f}  {d:>8.1e}  "
                 f"{a['seconds']:>9.3f}  {b['seconds']:>13.3f}")
    max_diff = max(diffs)
    ok = all(d <= TOLERANCE for d in diffs) and all(torch.isfinite(torch.tensor(
        [a["loss"] for a in cp])).tolist()) and grad_err[worst] <= GRAD_TOLERANCE
    progress(f"max step-1 gradient error {grad_err[worst]:.2e} of the tensor's largest entry "
             f"({worst}; tolerance {GRAD_TOLERANCE:g})")
    progress(f"max |param diff| after training {param_diff:.2e}")
    progress(f"max |loss diff| {max_diff:.2e} (tolerance {TOLERANCE:g}, float32, {cfg.model}, "
             f"{cfg.parallel}, dp={cfg.dp_size} x cp={cfg.cp_size}, S={cfg.seq_len}, "
             f"B={cfg.batch_size} per replica): {'OK' if ok else 'FAILED'}")
    return dict(cp=cp, single=single, max_diff=max_diff, param_diff=param_diff,
                grad_err=grad_err[worst], ok=ok)


def main(argv: list[str] | None = None) -> int:
    d = Config()
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world-size", type=int, default=d.world_size)
    ap.add_argument("--cp", type=int, default=None,
                    help="CP ranks per data-parallel replica (default: the world size, dp=1)")
    ap.add_argument("--parallel", default=d.parallel, choices=["fsdp", "ddp"],
                    help="FSDP2 fully_shard or DDP over the dp x cp ranks")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch intra-op threads per process (default: torch's own here, "
                         "cores / world size on each rank)")
    ap.add_argument("--seq-len", type=int, default=d.seq_len)
    ap.add_argument("--batch-size", type=int, default=d.batch_size)
    ap.add_argument("--steps", type=int, default=d.steps)
    ap.add_argument("--block-size", type=int, default=d.block_size)
    ap.add_argument("--model", default=d.model, choices=["llama", "qwen2", "gpt_oss", "deepseek_v3"])
    ap.add_argument("--window", type=int, default=d.window)
    from fringe.schedules import names as schedule_names        # the registry's names
    ap.add_argument("--schedule", default=d.schedule, choices=schedule_names())
    ap.add_argument("--boundaries", default=d.boundaries, choices=["cu_seqlens", "position_ids"])
    ap.add_argument("--checkpointing", action="store_true", help="activation checkpointing on the CP side")
    a = ap.parse_args(argv)
    cfg = Config(world_size=a.world_size, cp=a.cp, parallel=a.parallel, threads=a.threads,
                 seq_len=a.seq_len, batch_size=a.batch_size, steps=a.steps,
                 block_size=a.block_size, model=a.model, window=a.window, schedule=a.schedule,
                 boundaries=a.boundaries, checkpointing=a.checkpointing)
    if a.threads is not None:
        torch.set_num_threads(a.threads)
    return 0 if run(cfg)["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
