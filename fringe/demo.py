"""Train a tiny language model under context parallelism and check it against one process.

``python -m fringe demo`` runs two trainings of the same model from the same init on the same
batches and prints their losses side by side:

* **CP**: P CPU ranks in a gloo group (:mod:`fringe.launch`). Each rank holds its layout
  shard of every batch (``plan.layout.shard``), feeds the shard's **global** positions to
  RoPE, and attends with :func:`fringe.attention`. The mask is ``causal & document`` over
  packed documents whose boundaries change every batch, so every step makes a new plan.
  Each rank's loss is its share of the global mean (sum of its token losses / all tokens);
  gradients are all-reduced with SUM and every rank steps an identical AdamW.
* **single**: one process, the whole sequence, dense :func:`fringe.ops.reference.attention`.

Only the attention differs, so the losses agree to rounding (see :data:`TOLERANCE`).

>>> r = run_demo(DemoConfig(world_size=2, seq_len=256, block_size=32, steps=2))  # doctest: +SKIP
>>> r.ok, r.max_diff < r.tolerance                                              # doctest: +SKIP
(True, True)

Shapes: B batch · H query heads · G kv heads · S global sequence · L = S / P tokens per
rank · D head dim · V vocabulary · C model width.
"""
from __future__ import annotations

import dataclasses
import math
import os
import resource
import time
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from . import masks, schedules
from .api import attention as cp_attention, last_run
from .launch import Workers
from .layout import DEFAULT_BLOCK_SIZE
from .ops import reference
from .plan import plan as make_plan
from .schedules import registry

__all__ = ["DemoConfig", "DemoResult", "StepResult", "TinyLM", "TOLERANCE", "make_batch",
           "make_mask", "run_demo"]

MASKS = ("document", "causal", "sliding_window")
DTYPES = {"float32": torch.float32, "float64": torch.float64}
IGNORE = -100
DEFAULT_WINDOW = 128   # tokens a query may look back in the sliding_window demo mask
#: AdamW moves each weight by about lr per step: past 1 this model diverges (to inf/NaN past
#: ~1e30, and float32 cannot hold an lr past 3.4e38 at all).
MAX_LR = 1.0
#: Transformer blocks: a bound that keeps a typo (1e9 layers) from building for ever.
MAX_LAYERS = 1024

#: Largest |loss(CP) - loss(single)| accepted at any step, per dtype. Both runs do the same
#: math except the attention, where CP sums the softmax over kv tiles in another order
#: (merging partial results by their log-sum-exp), so the two differ by rounding, which AdamW
#: then carries forward and slowly amplifies. Measured on this 2-core CPU (P=4, S=1024, losses
#: 1.3-4): float32, 16 steps, every schedule x mask: <= 8e-7; 60 steps: 2.4e-6; B=2, 30 steps,
#: seed 3: 6.9e-6. float64, 16 steps: 4.4e-16. The tolerances leave >= 15x margin over the
#: worst of those while staying far below what a wrong mask or a lost gradient does (a whole
#: document's tokens attending across a boundary moves the loss by >= 1e-2 within 2 steps).
TOLERANCE = {torch.float32: 1e-4, torch.float64: 1e-10}


@dataclasses.dataclass(frozen=True)
class DemoConfig:
    """What to train and how to split it.

    Args:
        world_size: P, CP ranks (CPU processes, gloo).
        schedule: a registered schedule name (``fringe.schedules.names()``), with its
            argument or in the 2D form: ``"zigzag"``, ``"allgather:4"``,
            ``"compose:zigzag+ulysses:2"`` (see :mod:`fringe.schedules.registry`).
        mask: ``"document"`` (causal & document), ``"causal"``, or ``"sliding_window"``
            (causal window of ``window`` tokens, within documents).
        seq_len: S tokens per sequence (zigzag needs a multiple of 2·P·block_size).
        block_size: mask block in tokens.
        steps: optimizer steps.
        batch_size: B sequences per step (they share the document boundaries).
        dtype: ``"float32"`` or ``"float64"``.
        seed: seeds the init and the data.
        vocab, width, layers, heads, kv_heads, window, lr: the model and optimizer.
    """

    world_size: int = 4
    schedule: str = "zigzag"
    mask: str = "document"
    seq_len: int = 1024
    block_size: int = DEFAULT_BLOCK_SIZE
    steps: int = 16
    batch_size: int = 1
    dtype: str = "float32"
    seed: int = 0
    vocab: int = 32
    width: int = 64
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    window: int = DEFAULT_WINDOW
    lr: float = 1e-2

    def __post_init__(self) -> None:
        for name, choices in (("mask", MASKS), ("dtype", tuple(DTYPES))):
            if getattr(self, name) not in choices:
                raise ValueError(f"{name} must be one of {choices}, got {getattr(self, name)!r}")
        for name in ("world_size", "seq_len", "block_size", "steps", "batch_size", "vocab",
                     "width", "layers", "heads", "kv_heads", "window"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.width % self.heads or (self.width // self.heads) % 2:
            raise ValueError(f"width={self.width} must split into heads={self.heads} heads of an "
                             f"even head dim (RoPE rotates pairs)")
        if not (math.isfinite(self.lr) and 0 < self.lr <= MAX_LR):
            raise ValueError(f"lr={self.lr} must be positive and at most {MAX_LR:g} (AdamW moves "
                             f"each weight by about lr per step; the default is 1e-2)")
        if self.layers > MAX_LAYERS:
            raise ValueError(f"layers={self.layers} must be at most {MAX_LAYERS}")
        if self.heads % self.kv_heads:
            raise ValueError(f"heads={self.heads} must be a multiple of kv_heads={self.kv_heads}")
        where = dict(world_size=self.world_size, heads=self.heads, kv_heads=self.kv_heads)
        reason = registry.why_not(self.schedule, **where)     # an unknown name raises here
        if reason:
            raise ValueError(f"schedule {self.schedule!r} cannot run this model: {reason}; "
                             f"these can: {registry.names(**where)}")

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def tolerance(self) -> float:
        return TOLERANCE[self.torch_dtype]


# ---------------------------------------------------------------------------------------------
# data: packed documents, new boundaries every batch


def make_batch(step: int, *, seq_len: int, batch_size: int = 1, vocab: int = 32,
               seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One batch of packed documents, different boundaries for every ``step``.

    Each document repeats a short motif (2-6 tokens). Motifs mostly follow a fixed
    successor table, so a bigram model learns something in a few steps; the rest of a motif
    is only predictable by looking back within the document (which the mask allows).

    Returns:
        tokens int64 ``[B, S]``; targets int64 ``[B, S]``, the next token within the same
        document or ``-100`` (ignored) at a document's last token; doc_ids int64 ``[S]``.
    """
    succ = torch.randperm(vocab, generator=torch.Generator().manual_seed(seed))
    g = torch.Generator().manual_seed((seed * 1_000_003 + step + 1) % 2 ** 63)  # any int64 seed
    lo, hi = max(2, seq_len // 32), max(3, seq_len // 4)
    lengths = []
    while sum(lengths) < seq_len:
        lengths.append(int(torch.randint(lo, hi + 1, (), generator=g)))
    lengths[-1] -= sum(lengths) - seq_len
    doc_ids = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    tokens = torch.empty(batch_size, seq_len, dtype=torch.int64)
    for b in range(batch_size):
        start = 0
        for n in lengths:
            m = int(torch.randint(2, 7, (), generator=g))
            motif = [int(torch.randint(vocab, (), generator=g))]
            for _ in range(m - 1):
                follow = bool(torch.rand((), generator=g) < 0.75)
                motif.append(int(succ[motif[-1]]) if follow
                             else int(torch.randint(vocab, (), generator=g)))
            tokens[b, start:start + n] = torch.tensor(motif).repeat(n // m + 1)[:n]
            start += n
    targets = torch.full_like(tokens, IGNORE)
    same_doc = doc_ids[1:] == doc_ids[:-1]                        # [S-1]
    targets[:, :-1] = torch.where(same_doc, tokens[:, 1:], IGNORE)
    return tokens, targets, doc_ids


def make_mask(kind: str, doc_ids: torch.Tensor, *, window: int = DEFAULT_WINDOW):
    """The demo's mask for one batch: ``"document"`` = causal & document(doc_ids)."""
    if kind == "document":
        return masks.causal() & masks.document(doc_ids)
    if kind == "causal":
        return masks.causal()
    if kind == "sliding_window":
        return masks.sliding_window(window) & masks.document(doc_ids)
    raise ValueError(f"mask must be one of {MASKS}, got {kind!r}")


def make_schedule(name: str) -> schedules.Schedule:
    """The schedule a name from the registry spells (``fringe.schedules.get``)."""
    return schedules.get(name)


# ---------------------------------------------------------------------------------------------
# the model: attention is a callable, positions are global


Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def rope(x: torch.Tensor, positions: torch.Tensor, *, base: float = 10_000.0) -> torch.Tensor:
    """Rotary embedding of ``x [B, H, L, D]`` at global ``positions [L]`` (half-split pairs)."""
    half = x.shape[-1] // 2
    inv = base ** (-torch.arange(half, dtype=torch.float64) / half)
    angle = positions.to(torch.float64)[:, None] * inv                  # [L, D/2]
    cos, sin = angle.cos().to(x.dtype), angle.sin().to(x.dtype)
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


class Block(nn.Module):
    """Pre-norm block: RoPE attention (GQA: G kv heads for H query heads) + MLP."""

    def __init__(self, width: int, heads: int, kv_heads: int) -> None:
        super().__init__()
        self.H, self.G, self.D = heads, kv_heads, width // heads
        self.norm1 = nn.RMSNorm(width)
        self.wq = nn.Linear(width, heads * self.D, bias=False)
        self.wkv = nn.Linear(width, 2 * kv_heads * self.D, bias=False)
        self.wo = nn.Linear(heads * self.D, width, bias=False)
        self.norm2 = nn.RMSNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(),
                                 nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor, positions: torch.Tensor, attend: Attend) -> torch.Tensor:
        B, L, _ = x.shape                                                 # x: [B, L, C]
        h = self.norm1(x)
        q = self.wq(h).view(B, L, self.H, self.D).transpose(1, 2)         # [B, H, L, D]
        k, v = self.wkv(h).view(B, L, 2, self.G, self.D).transpose(1, 3).unbind(1)  # [B, G, L, D]
        o = attend(rope(q, positions), rope(k, positions), v.contiguous())  # [B, H, L, D]
        x = x + self.wo(o.transpose(1, 2).reshape(B, L, self.H * self.D))
        return x + self.mlp(self.norm2(x))


class TinyLM(nn.Module):
    """Decoder-only LM over the tokens one process holds.

    ``forward(tokens [B, L], positions [L], attend) -> logits [B, L, V]``: ``positions`` are
    the tokens' global positions (RoPE), in any order; ``attend(q, k, v)`` does the attention,
    CP or dense, with q ``[B, H, L, D]`` and k, v ``[B, G, L, D]``.
    """

    def __init__(self, *, vocab: int, width: int, layers: int, heads: int, kv_heads: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(Block(width, heads, kv_heads) for _ in range(layers))
        self.norm = nn.RMSNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor,
                attend: Attend) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x, positions, attend)
        return self.head(self.norm(x))


def build_model(cfg: DemoConfig) -> TinyLM:
    torch.manual_seed(cfg.seed)
    return TinyLM(vocab=cfg.vocab, width=cfg.width, layers=cfg.layers, heads=cfg.heads,
                  kv_heads=cfg.kv_heads).to(cfg.torch_dtype)


def _optimizer(model: nn.Module, cfg: DemoConfig) -> torch.optim.Optimizer:
    # foreach=False: the same per-parameter kernels in every process, whatever the sizes.
    return torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.01, foreach=False)


def _loss_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1),
                           ignore_index=IGNORE, reduction="sum")


def _peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024     # Linux: KiB


# ---------------------------------------------------------------------------------------------
# the CP run: state lives in each worker process between calls


@dataclasses.dataclass
class _CommMeter:
    """Sums compute and wait time of every fringe.attention call (forward and backward)."""

    compute: dict = dataclasses.field(default_factory=lambda: {"forward": 0.0, "backward": 0.0})
    wait: dict = dataclasses.field(default_factory=lambda: {"forward": 0.0, "backward": 0.0})

    def add(self, which: str) -> None:
        recs = getattr(last_run(), which)
        self.compute[which] += sum(r.compute_s for r in recs)
        self.wait[which] += sum(r.wait_s for r in recs)

    def exposed(self, which: str) -> float:
        busy = self.compute[which] + self.wait[which]
        return self.wait[which] / busy if busy else 0.0


_TRAINER: dict = {}


def _cp_setup(rank: int, world_size: int, cfg: DemoConfig, state: dict) -> int:
    model = build_model(cfg)
    model.load_state_dict(state)
    _TRAINER.clear()
    _TRAINER.update(cfg=cfg, model=model, opt=_optimizer(model, cfg))
    return rank


def _cp_step(rank: int, world_size: int, step: int) -> dict:
    import torch.distributed as dist
    cfg, model, opt = _TRAINER["cfg"], _TRAINER["model"], _TRAINER["opt"]
    tokens, targets, doc_ids = make_batch(step, seq_len=cfg.seq_len, batch_size=cfg.batch_size,
                                          vocab=cfg.vocab, seed=cfg.seed)
    dist.barrier()
    t0 = time.perf_counter()
    plan = make_plan(make_schedule(cfg.schedule), make_mask(cfg.mask, doc_ids, window=cfg.window),
                     seq_len=cfg.seq_len, world_size=world_size, block_size=cfg.block_size)
    lay = plan.layout
    tok, tgt = lay.shard(tokens, rank, dim=1), lay.shard(targets, rank, dim=1)   # [B, L]
    pos = lay.positions(rank)                                # global positions, for RoPE
    meter = _CommMeter()

    def attend(q, k, v):
        out = cp_attention(q, k, v, plan=plan)
        meter.add("forward")
        if q.requires_grad:     # fires once dq exists, i.e. right after this call's backward
            q.register_hook(lambda g: meter.add("backward"))
        return out

    n_tokens = (tgt != IGNORE).sum().to(torch.float64)
    dist.all_reduce(n_tokens)                                # tokens in the global batch
    loss = _loss_sum(model(tok, pos, attend), tgt) / n_tokens.item()   # this rank's share
    opt.zero_grad(set_to_none=False)
    loss.backward()
    grads = [p.grad for p in model.parameters()]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat)                                    # SUM: shares add up to the mean
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()
    opt.step()
    total = loss.detach().to(torch.float64)
    dist.all_reduce(total)
    seconds = time.perf_counter() - t0
    return dict(loss=total.item(), seconds=seconds, peak_mib=_peak_mib(),
                exposed_forward=meter.exposed("forward"),
                exposed_backward=meter.exposed("backward"))


def _cp_params(rank: int, world_size: int) -> dict:
    return {k: v.detach().clone() for k, v in _TRAINER["model"].state_dict().items()}


# ---------------------------------------------------------------------------------------------
# results


@dataclasses.dataclass(frozen=True)
class StepResult:
    """One step of both runs; times are the slowest rank's, memory is per rank (MiB RSS)."""

    step: int
    loss_cp: float
    loss_single: float
    cp_s: float
    single_s: float
    tokens: int
    peak_mib: tuple[float, ...]
    exposed_forward: float
    exposed_backward: float

    @property
    def diff(self) -> float:
        return abs(self.loss_cp - self.loss_single)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.cp_s if self.cp_s else math.inf

    def line(self, steps: int) -> str:
        return (f"step {self.step + 1}/{steps}  loss cp {self.loss_cp:.6f}  single "
                f"{self.loss_single:.6f}  |diff| {self.diff:.1e}  cp {self.cp_s:.2f}s  "
                f"single {self.single_s:.2f}s")


@dataclasses.dataclass(frozen=True)
class DemoResult:
    """Both runs side by side; ``ok`` if every step's |difference| is within ``tolerance``."""

    config: DemoConfig
    steps: tuple[StepResult, ...]
    max_param_diff: float
    setup_s: float
    wall_s: float

    @property
    def tolerance(self) -> float:
        return self.config.tolerance

    @property
    def max_diff(self) -> float:
        return max(s.diff for s in self.steps)

    @property
    def ok(self) -> bool:
        return all(math.isfinite(s.loss_cp) and math.isfinite(s.loss_single)
                   and s.diff <= self.tolerance for s in self.steps)

    def table(self) -> str:
        from tabulate import tabulate
        rows = [[s.step + 1, f"{s.loss_cp:.6f}", f"{s.loss_single:.6f}", f"{s.diff:.1e}",
                 f"{s.cp_s:.3f}", f"{s.single_s:.3f}", f"{s.tokens_per_s:,.0f}",
                 " ".join(f"{m:.0f}" for m in s.peak_mib),
                 f"{s.exposed_forward:.2f} / {s.exposed_backward:.2f}"] for s in self.steps]
        headers = ["step", "loss (CP)", "loss (single)", "|diff|", "CP step s", "single step s",
                   "CP tokens/s", "peak RSS MiB per rank", "exposed comm fwd/bwd"]
        return tabulate(rows, headers=headers, disable_numparse=True)

    def report(self) -> str:
        c = self.config
        verdict = "OK" if self.ok else "FAIL"
        cores = os.cpu_count() or 1
        return "\n".join([
            self.table(),
            f"max |loss diff| {self.max_diff:.2e}, max |param diff| after training "
            f"{self.max_param_diff:.2e}, tolerance {self.tolerance:.0e} ({c.dtype}): {verdict}",
            f"wall {self.wall_s:.1f}s (of which spawning {c.world_size} ranks "
            f"{self.setup_s:.1f}s); "
            f"exposed comm = wait / (compute + wait) over all fringe.attention calls of a step"
            + (f" ({c.world_size} ranks share {cores} CPU cores, so waits include time a rank "
               f"is not scheduled)" if cores < c.world_size else ""),
        ])


# ---------------------------------------------------------------------------------------------
# the driver


def _describe(cfg: DemoConfig) -> str:
    model = build_model(cfg)
    n = sum(p.numel() for p in model.parameters())
    tokens, _, doc_ids = make_batch(0, seq_len=cfg.seq_len, batch_size=cfg.batch_size,
                                    vocab=cfg.vocab, seed=cfg.seed)
    mask = make_mask(cfg.mask, doc_ids, window=cfg.window)
    p = make_plan(make_schedule(cfg.schedule), mask, seq_len=cfg.seq_len,
                  world_size=cfg.world_size, block_size=cfg.block_size)   # validates S early
    return (f"fringe demo: {cfg.layers}-layer LM ({n:,} params, {cfg.heads} heads / "
            f"{cfg.kv_heads} kv heads, width {cfg.width}), {cfg.dtype}, {cfg.steps} steps of "
            f"B={cfg.batch_size} x S={cfg.seq_len} tokens\n"
            f"CP: {cfg.schedule} over P={cfg.world_size} gloo ranks (L={p.local_len} each), "
            f"mask {cfg.mask} (step 0: {getattr(p.mask_mod, '__name__', 'mask')}), "
            f"new plan every step")


def run_demo(cfg: DemoConfig | None = None, *, progress: Callable[[str], None] | None = print,
             timeout_s: float = 300.0) -> DemoResult:
    """Train with CP on ``cfg.world_size`` spawned CPU ranks and in one process; compare.

    Args:
        cfg: the configuration (default :class:`DemoConfig`).
        progress: called with one line per step (None: silent).
        timeout_s: per call to the ranks, before :class:`fringe.launch.LaunchError`.

    Returns:
        A :class:`DemoResult`; check ``.ok``.
    """
    cfg = cfg or DemoConfig()
    say = progress or (lambda _line: None)
    say(_describe(cfg))
    t_start = time.perf_counter()
    model = build_model(cfg)
    opt = _optimizer(model, cfg)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    results = []
    with Workers(cfg.world_size, timeout_s=timeout_s, threads=1) as w:
        w.run(_cp_setup, cfg, state)
        setup_s = time.perf_counter() - t_start
        say(f"spawned {cfg.world_size} ranks in {setup_s:.1f}s")
        for step in range(cfg.steps):
            cp = w.run(_cp_step, step)
            tokens, targets, doc_ids = make_batch(step, seq_len=cfg.seq_len,
                                                  batch_size=cfg.batch_size, vocab=cfg.vocab,
                                                  seed=cfg.seed)
            t0 = time.perf_counter()
            mask = make_mask(cfg.mask, doc_ids, window=cfg.window)
            def attend(q, k, v):
                return reference.attention(q, k, v, mask_mod=mask)[0]

            loss = _loss_sum(model(tokens, torch.arange(cfg.seq_len), attend), targets)
            loss = loss / (targets != IGNORE).sum().item()
            opt.zero_grad(set_to_none=False)
            loss.backward()
            opt.step()
            single_s = time.perf_counter() - t0
            r = StepResult(step=step, loss_cp=cp[0]["loss"], loss_single=loss.item(),
                           cp_s=max(c["seconds"] for c in cp), single_s=single_s,
                           tokens=cfg.batch_size * cfg.seq_len,
                           peak_mib=tuple(c["peak_mib"] for c in cp),
                           exposed_forward=max(c["exposed_forward"] for c in cp),
                           exposed_backward=max(c["exposed_backward"] for c in cp))
            results.append(r)
            say(r.line(cfg.steps))
        params = w.run(_cp_params)
    single = model.state_dict()
    max_param_diff = max(float((p[k] - single[k]).abs().max()) for p in params for k in single)
    return DemoResult(cfg, tuple(results), max_param_diff, setup_s, time.perf_counter() - t_start)
