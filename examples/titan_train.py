"""Train torchtitan's Llama 3 under fringe CP on gloo ranks, checked against one process.

    python examples/titan_train.py --world-size 2          # needs the extra: pip install 'fringe[titan]'

torchtitan's debug-size Llama 3 (``llama3_configs["debugmodel"]``: random weights from its
config, no downloads; ``--layers`` keeps the first few layers) trains for a few SGD steps on
packed synthetic documents laid out as torchtitan's loader lays them out (labels are
next-token targets shifted within each document, positions restart at 0 per document), with
new boundaries every batch and per row. Twice, from the same weights and data:

* CP: :func:`fringe.titan.apply` swaps every layer's inner attention for fringe's; on P
  spawned gloo ranks each rank gets its shard from :func:`fringe.titan.shard_batch` (RoPE at
  the layout's global positions), its loss is its token-weighted share (sum over its targets
  / global target count, as torchtitan's loss) and gradients are SUMMED over ranks.
* one process: the same model with torchtitan's own mask (the causal and packed-document
  mask_mods its ``get_attention_masks`` builds from ``positions``) evaluated densely and run
  by ``F.scaled_dot_product_attention``: torchtitan's FlexAttention has no backward on CPU.

Checks, in float32 with ``fringe.testing.tolerances``: the loss of every step, each
parameter's reduced gradient of every step (relative to the tensor's largest entry) and the
parameters after training. Prints them and exits non-zero if any is out of tolerance.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

import torch

IGNORE = -100          # torchtitan's IGNORE_INDEX


@dataclasses.dataclass(frozen=True)
class Config:
    world_size: int = 2
    seq_len: int = 256
    batch_size: int = 2
    steps: int = 3
    block_size: int = 32
    layers: int | None = None       # keep the first N layers of the flavor (None: all)
    kv_heads: int | None = None     # GQA: rebuild each layer's attention with this many kv heads
    head_dim: int | None = None     # ... and this head dim (then GQAttention.scaling = head_dim**-0.5)
    flavor: str = "debugmodel"
    schedule: str = "zigzag"
    checkpointing: bool = False     # torchtitan's FullAC on the CP side: each block recomputes its
    #                                 attention in the backward (the plans must reach it again)
    lr: float = 0.1                 # SGD: a gradient error shows in the parameters
    seed: int = 0
    threads: int = 1


def model_config(cfg: Config):
    """torchtitan's config for the flavor, RoPE cache cut to ``seq_len`` (as its trainer does);
    with ``kv_heads`` / ``head_dim``, each layer's attention rebuilt by torchtitan's own
    ``make_gqa_config`` (same inner attention, fused qkv)."""
    from torchtitan.models.llama3 import llama3_configs
    mc = llama3_configs[cfg.flavor](attn_backend="flex")
    if cfg.layers is not None:
        mc.layers = mc.layers[:cfg.layers]
    for layer in mc.layers:
        att = layer.attention
        rope = dataclasses.replace(att.rope, max_seq_len=cfg.seq_len)
        if cfg.kv_heads is not None or cfg.head_dim is not None:
            import functools

            from torchtitan.models.common.config_utils import make_gqa_config
            init = {"weight": functools.partial(torch.nn.init.trunc_normal_, std=0.02)}
            hd = cfg.head_dim or att.dim // att.n_heads
            att = make_gqa_config(dim=att.dim, n_heads=att.n_heads, n_kv_heads=cfg.kv_heads,
                                  head_dim=cfg.head_dim, wqkv_param_init=init, wo_param_init=init,
                                  inner_attention=att.inner_attention, fuse_qkv=True,
                                  rope=dataclasses.replace(rope, dim=hd))
            layer.attention = att
        else:
            att.rope = rope
    return mc


def build_model(cfg: Config):
    torch.manual_seed(cfg.seed)
    model = model_config(cfg).build()
    model.init_states()
    return model


def make_batch(step: int, cfg: Config, vocab: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Packed rows as torchtitan's text loader yields them; new, per-row boundaries every step.

    Each document of n+1 tokens gives inputs ``doc[:-1]``, labels ``doc[1:]`` and positions
    ``0..n-1`` (a row's last document is cut at S).

    Returns:
        inputs, labels, positions: int64 ``[B, S]``.
    """
    g = torch.Generator().manual_seed(cfg.seed * 1_000_003 + step + 1)
    S = cfg.seq_len
    inputs = torch.empty(cfg.batch_size, S, dtype=torch.int64)
    labels, positions = torch.empty_like(inputs), torch.empty_like(inputs)
    for b in range(cfg.batch_size):
        start = 0
        while start < S:
            n = min(int(torch.randint(max(2, S // 16), S // 3 + 1, (), generator=g)), S - start)
            motif = torch.randint(vocab, (int(torch.randint(2, 7, (), generator=g)),), generator=g)
            doc = motif.repeat((n + 1) // motif.numel() + 1)[:n + 1]
            inputs[b, start:start + n], labels[b, start:start + n] = doc[:-1], doc[1:]
            positions[b, start:start + n] = torch.arange(n)
            start += n
    return inputs, labels, positions


def loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), labels.flatten(0, 1),
                                             ignore_index=IGNORE, reduction="sum")


# ---------------------------------------------------------------------------------------------
# CP ranks

_STATE: dict = {}


def cp_setup(rank: int, world_size: int, cfg: Config, weights: dict) -> int:
    import fringe.titan
    torch.set_num_threads(cfg.threads)
    model = build_model(cfg)
    model.load_state_dict(weights)
    fringe.titan.apply(model)                                         # 1
    if cfg.checkpointing:
        from torchtitan.distributed.activation_checkpoint import FullAC
        FullAC(FullAC.Config()).apply(model)
    model.train()
    _STATE.update(cfg=cfg, model=model, opt=torch.optim.SGD(model.parameters(), lr=cfg.lr))
    return rank


def cp_params(rank: int, world_size: int) -> dict:
    return {k: v.detach().clone() for k, v in _STATE["model"].state_dict().items()}


def cp_step(rank: int, world_size: int, step: int) -> dict:
    import torch.distributed as dist

    import fringe.titan
    from fringe import packing, schedules
    cfg, model, opt = _STATE["cfg"], _STATE["model"], _STATE["opt"]
    inputs, labels, positions = make_batch(step, cfg, model.config.vocab_size)
    dist.barrier()
    t0 = time.perf_counter()
    plans = fringe.titan.plans(model, schedules.get(cfg.schedule), positions,              # 2
                               world_size=world_size, block_size=cfg.block_size)
    shard = fringe.titan.shard_batch(inputs, labels, plans, positions=positions, rank=rank)  # 3
    opt.zero_grad(set_to_none=False)
    with fringe.recording() as rec:                      # counts fringe.attention calls
        logits = model(**fringe.titan.model_inputs(shard, plans))                            # 4
        loss = packing.token_weighted_loss(logits, shard.shift_labels, num_items=shard.num_items)  # 5
        loss.backward()                                                                      # 6
    grads = [p.grad for p in model.parameters()]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat)                         # SUM, not mean: the shares add up             # 7
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()
    opt.step()
    total = loss.detach().to(torch.float64)
    dist.all_reduce(total)
    grads_out = None
    if rank == 0:                                 # names without the checkpoint wrapper's prefix
        grads_out = {n.replace("._checkpoint_wrapped_module", ""): p.grad.detach().clone()
                     for n, p in model.named_parameters()}
    return dict(loss=total.item(), seconds=time.perf_counter() - t0, grads=grads_out,
                attention_calls=len(rec.runtimes))


# ---------------------------------------------------------------------------------------------
# one process: torchtitan's own mask, dense


def torchtitan_mask(positions: torch.Tensor) -> torch.Tensor:
    """bool ``[B, 1, S, S]``: the causal and packed-document mask_mods torchtitan's
    ``get_attention_masks(positions)`` compiles into its BlockMask, evaluated densely."""
    from torch.nn.attention.flex_attention import and_masks, create_mask
    from torchtitan.models.common.attention import (
        get_causal_mask_mod, get_efficient_causal_mask_mod_for_packed_document)
    B, S = positions.shape
    mask_mod = and_masks(get_causal_mask_mod(), get_efficient_causal_mask_mod_for_packed_document(positions))
    return create_mask(mask_mod, B, 1, S, S, device=positions.device)


class DenseReference(torch.nn.Module):
    """torchtitan's inner-attention signature; ``attention_masks`` is the dense bool mask."""

    def forward(self, q, k, v, *, attention_masks, scale=None, enable_gqa=False, **kwargs):
        out = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=attention_masks,
            scale=scale, enable_gqa=enable_gqa)
        return out.transpose(1, 2)


def single_run(cfg: Config, weights: dict) -> tuple[list[dict], dict]:
    model = build_model(cfg)
    model.load_state_dict(weights)
    for m in model.modules():
        if hasattr(m, "inner_attention"):
            m.inner_attention = DenseReference()
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=cfg.lr)
    out = []
    for step in range(cfg.steps):
        inputs, labels, positions = make_batch(step, cfg, model.config.vocab_size)
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=False)
        logits = model(inputs, positions, torchtitan_mask(positions))
        loss = loss_sum(logits, labels) / int((labels != IGNORE).sum())
        loss.backward()
        grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
        opt.step()
        out.append(dict(loss=loss.item(), seconds=time.perf_counter() - t0, grads=grads))
    return out, {k: v.detach().clone() for k, v in model.state_dict().items()}


# ---------------------------------------------------------------------------------------------


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| relative to b's largest entry."""
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def run(cfg: Config, *, progress=print, timeout_s: float = 300.0, workers=None) -> dict:
    """Both runs; returns the measured differences and ``ok``.

    ``workers``: a started :class:`fringe.launch.Workers` of ``cfg.world_size`` ranks to
    reuse; default: a fresh one.
    """
    import contextlib

    from fringe.launch import Workers
    from fringe.testing import tolerances
    tol = tolerances(torch.float32)
    torch.set_num_threads(cfg.threads)
    weights = {k: v.clone() for k, v in build_model(cfg).state_dict().items()}
    single, final = single_run(cfg, weights)
    cp = []
    pool = contextlib.nullcontext(workers) if workers is not None else \
        Workers(cfg.world_size, timeout_s=timeout_s)
    with pool as w:
        if w.world_size != cfg.world_size:
            raise ValueError(f"workers has {w.world_size} ranks, the config asks for {cfg.world_size}")
        w.run(cp_setup, cfg, weights)
        for step in range(cfg.steps):
            res = w.run(cp_step, step)
            cp.append(dict(loss=res[0]["loss"], seconds=max(r["seconds"] for r in res),
                           grads=res[0]["grads"], attention_calls=res[0]["attention_calls"]))
        cp_final = w.run(cp_params)[0]
    loss_diffs = [abs(a["loss"] - b["loss"]) for a, b in zip(cp, single)]
    grad_rel = [max(_rel(a["grads"][n], b["grads"][n]) for n in b["grads"]) for a, b in zip(cp, single)]
    param_diff = max(float((cp_final[k] - final[k]).abs().max()) for k in final)
    param_ok = all(torch.allclose(cp_final[k], final[k], **tol) for k in final)
    loss_ok = all(abs(a["loss"] - b["loss"]) <= tol["atol"] + tol["rtol"] * abs(b["loss"])
                  for a, b in zip(cp, single))
    grad_ok = all(g <= tol["rtol"] for g in grad_rel)
    progress(f"{'step':>4}  {'loss (CP)':>12}  {'loss (1 proc)':>13}  {'|diff|':>8}  "
             f"{'grad rel':>8}  {'CP step s':>9}  {'1-proc step s':>13}  {'attention calls':>15}")
    for i, (a, b, d, g) in enumerate(zip(cp, single, loss_diffs, grad_rel)):
        progress(f"{i + 1:>4}  {a['loss']:>12.6f}  {b['loss']:>13.6f}  {d:>8.1e}  {g:>8.1e}  "
                 f"{a['seconds']:>9.3f}  {b['seconds']:>13.3f}  {a['attention_calls']:>15}")
    ok = loss_ok and grad_ok and param_ok and all(torch.isfinite(torch.tensor(
        [a["loss"] for a in cp])).tolist())
    progress(f"max |param diff| after {cfg.steps} SGD steps {param_diff:.2e}; max grad diff / "
             f"largest entry {max(grad_rel):.2e}; max |loss diff| {max(loss_diffs):.2e} "
             f"(float32 tolerances atol={tol['atol']:g} rtol={tol['rtol']:g}; torchtitan llama3 "
             f"{cfg.flavor}{'' if cfg.layers is None else f' first {cfg.layers} layers'}"
             f"{'' if cfg.kv_heads is None else f' kv_heads={cfg.kv_heads}'}"
             f"{'' if cfg.head_dim is None else f' head_dim={cfg.head_dim}'}"
             f"{' checkpointing' if cfg.checkpointing else ''}, "
             f"P={cfg.world_size}, S={cfg.seq_len}, B={cfg.batch_size}): {'OK' if ok else 'FAILED'}")
    return dict(cp=cp, single=single, loss_diffs=loss_diffs, grad_rel=grad_rel,
                param_diff=param_diff, ok=ok)


def main(argv: list[str] | None = None) -> int:
    d = Config()
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world-size", type=int, default=d.world_size)
    ap.add_argument("--seq-len", type=int, default=d.seq_len)
    ap.add_argument("--batch-size", type=int, default=d.batch_size)
    ap.add_argument("--steps", type=int, default=d.steps)
    ap.add_argument("--block-size", type=int, default=d.block_size)
    ap.add_argument("--layers", type=int, default=d.layers, help="keep the first N layers")
    ap.add_argument("--kv-heads", type=int, default=d.kv_heads, help="GQA: kv heads per layer")
    ap.add_argument("--head-dim", type=int, default=d.head_dim, help="head dim (sets the layers' scaling)")
    ap.add_argument("--flavor", default=d.flavor, help="a llama3_configs key (debugmodel is tiny)")
    from fringe.schedules import names as schedule_names
    ap.add_argument("--schedule", default=d.schedule, choices=schedule_names())
    ap.add_argument("--checkpointing", action="store_true",
                    help="torchtitan's full activation checkpointing on the CP side")
    ap.add_argument("--lr", type=float, default=d.lr)
    ap.add_argument("--threads", type=int, default=d.threads, help="torch threads per process")
    a = ap.parse_args(argv)
    cfg = Config(world_size=a.world_size, seq_len=a.seq_len, batch_size=a.batch_size, steps=a.steps,
                 block_size=a.block_size, layers=a.layers, kv_heads=a.kv_heads,
                 head_dim=a.head_dim, flavor=a.flavor, schedule=a.schedule,
                 checkpointing=a.checkpointing, lr=a.lr, threads=a.threads)
    try:
        import torchtitan  # noqa: F401
    except ImportError:
        print("examples/titan_train.py needs torchtitan: pip install 'fringe[titan]'", file=sys.stderr)
        return 2
    return 0 if run(cfg)["ok"] else 1


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
