"""Plans: a schedule lowered for one mask, sequence length and world size.

>>> import fringe
>>> from fringe import masks, schedules
>>> p = fringe.plan(schedules.zigzag(), masks.causal(), seq_len=512, world_size=4, block_size=32)
>>> p.tiles.tolist()[0]     # rank 0's queries against each rank's kv: 1 PARTIAL, 2 FULL
[1, 2, 2, 2]
"""
from __future__ import annotations

import dataclasses
import hashlib
from typing import Callable

import torch

from . import masks as _masks
from .layout import DEFAULT_BLOCK_SIZE, Layout
from .schedules import KV_MODES, Program, Schedule, check, reverse
from .schedules.ir import Compute, Recv, Send, split_name

BlockKind = _masks.BlockKind


@dataclasses.dataclass(frozen=True, eq=False)
class Plan:
    """Everything the interpreter needs, computed once per mask.

    Attributes:
        schedule: the schedule it was built from.
        mask_mod: the mask (global positions).
        layout: which tokens each rank holds.
        block_size: mask-classification block, in tokens.
        blocks: int8 ``[S/block, S/block]`` BlockKind codes, rows and columns in layout
            order (rank 0's blocks first).
        tiles: int8 ``[P, P]``: the kind of tile (q of rank i, kv of rank j).
        forward / backward: one program per rank.
        kv: ``"resend"`` or ``"keep"`` (how the backward gets kv again).
        score_mod, scale, kernel: passed to the tile ops.
        batch_size, num_heads: the B and H the mask was classified for (None: the mask
            does not depend on b / h, as in FlexAttention's ``B=None, H=None``).
    """

    schedule: Schedule
    mask_mod: Callable
    layout: Layout
    block_size: int
    blocks: torch.Tensor
    tiles: torch.Tensor
    forward: tuple[Program, ...]
    backward: tuple[Program, ...]
    kv: str = "resend"
    score_mod: Callable | None = None
    scale: float | None = None
    kernel: str | None = None
    batch_size: int | None = None
    num_heads: int | None = None

    # ---- sizes ---------------------------------------------------------------------
    @property
    def world_size(self) -> int:
        return self.layout.world_size

    @property
    def seq_len(self) -> int:
        return self.layout.seq_len

    @property
    def local_len(self) -> int:
        return self.layout.local_len

    # ---- per tile ------------------------------------------------------------------
    def positions(self, rank: int, device: torch.device | str | None = None) -> torch.Tensor:
        """Global positions of ``rank``'s tokens (cached per device)."""
        cache = self.__dict__.setdefault("_pos_cache", {})
        key = (rank, str(device or "cpu"))
        if key not in cache:
            cache[key] = self.layout.positions(rank).to(device or "cpu")
        return cache[key]

    def tile_kind(self, i: int, j: int) -> BlockKind:
        return BlockKind(int(self.tiles[i, j]))

    def tile_blocks(self, i: int, j: int) -> torch.Tensor:
        """int8 ``[L/block, L/block]`` block map of tile (q of rank i, kv of rank j)."""
        n = self.local_len // self.block_size
        return self.blocks[i * n:(i + 1) * n, j * n:(j + 1) * n]

    def fingerprint(self) -> str:
        """A short hash that is equal on ranks that built the same plan."""
        cached = self.__dict__.get("_fingerprint")
        if cached:
            return cached
        h = hashlib.sha1()
        h.update(self.layout.fingerprint().encode())
        h.update(f"{self.block_size}/{self.kv}/{self.scale}/{self.kernel}".encode())
        h.update(self.blocks.numpy().tobytes())
        for prog in self.forward + self.backward:
            h.update(str(prog).encode())
        fp = f"{self.schedule.name}:{h.hexdigest()[:16]}"
        self.__dict__["_fingerprint"] = fp
        return fp

    # ---- reporting -----------------------------------------------------------------
    def stats(self, *, batch: int = 1, heads: int = 1, kv_heads: int | None = None,
              head_dim: int = 64, dtype: torch.dtype = torch.bfloat16) -> "PlanStats":
        """Per-rank work and communication; see :class:`PlanStats`."""
        return PlanStats.of(self, batch=batch, heads=heads, kv_heads=kv_heads or heads,
                            head_dim=head_dim, dtype=dtype)

    def __repr__(self) -> str:
        return (f"Plan({self.schedule.name}, mask={getattr(self.mask_mod, '__name__', 'mask')}, "
                f"S={self.seq_len}, P={self.world_size}, block={self.block_size})")


@dataclasses.dataclass(frozen=True)
class PlanStats:
    """Per-rank counts from a plan (no tensors are run).

    ``blocks`` counts non-empty (q-block, kv-block) pairs a rank computes (FULL and PARTIAL
    blocks alike); FLOPs are 4·block²·D·H·B per block for the forward and 2.5x that for
    the backward; bytes are what the programs send.
    """

    rows: tuple[dict, ...]
    balance: float

    @classmethod
    def of(cls, plan: Plan, *, batch, heads, kv_heads, head_dim, dtype) -> PlanStats:
        itemsize = torch.empty((), dtype=dtype).element_size()
        kv_bytes = 2 * batch * kv_heads * plan.local_len * head_dim * itemsize
        grad_bytes = 2 * batch * kv_heads * plan.local_len * head_dim * 4
        bs2 = plan.block_size ** 2
        rows = []
        for r in range(plan.world_size):
            full = partial = blocks = 0
            for _, op in plan.forward[r].ops():
                if isinstance(op, Compute):
                    kind = plan.tile_kind(op.q, op.kv)
                    full += kind == BlockKind.FULL
                    partial += kind == BlockKind.PARTIAL
                    blocks += int((plan.tile_blocks(op.q, op.kv) != BlockKind.EMPTY).sum())
            fwd_flops = 4 * blocks * bs2 * head_dim * heads * batch

            def volume(progs, kind_cls):
                total = 0
                for _, op in progs[r].ops():
                    if isinstance(op, kind_cls):
                        total += grad_bytes if split_name(op.buf)[0].startswith("d") else kv_bytes
                return total
            rows.append(dict(rank=r, full_tiles=full, partial_tiles=partial, blocks=blocks,
                             fwd_flops=fwd_flops, bwd_flops=int(2.5 * fwd_flops),
                             fwd_sent=volume(plan.forward, Send),
                             fwd_recv=volume(plan.forward, Recv),
                             bwd_sent=volume(plan.backward, Send),
                             bwd_recv=volume(plan.backward, Recv),
                             steps=len(plan.forward[r].steps)))
        work = [row["blocks"] for row in rows]
        mean = sum(work) / len(work)
        balance = max(work) / mean if mean else 1.0
        return cls(tuple(rows), balance)

    def table(self) -> str:
        """The rows as a text table (tabulate), with the balance max/mean underneath."""
        from tabulate import tabulate
        text = tabulate([list(r.values()) for r in self.rows], headers=list(self.rows[0]),
                        intfmt=",")
        return f"{text}\nwork balance (max/mean blocks): {self.balance:.3f}"

    def __str__(self) -> str:
        return self.table()


def _tile_kinds(blocks: torch.Tensor, P: int) -> torch.Tensor:
    n = blocks.shape[0] // P
    b = blocks.view(P, n, P, n)
    nonempty = (b != BlockKind.EMPTY).any(dim=3).any(dim=1)
    full = (b == BlockKind.FULL).all(dim=3).all(dim=1)
    tiles = torch.full((P, P), int(BlockKind.PARTIAL), dtype=torch.int8)
    tiles[~nonempty] = int(BlockKind.EMPTY)
    tiles[full] = int(BlockKind.FULL)
    return tiles


def plan(schedule: Schedule, mask_mod: Callable | None = None, *, seq_len: int,
         world_size: int, block_size: int = DEFAULT_BLOCK_SIZE,
         score_mod: Callable | None = None, scale: float | None = None, kv: str = "resend",
         kernel: str | None = None, batch_size: int | None = None,
         num_heads: int | None = None) -> Plan:
    """Lower ``schedule`` for ``mask_mod`` on ``seq_len`` tokens over ``world_size`` ranks.

    Args:
        schedule: e.g. ``schedules.zigzag()``.
        mask_mod: FlexAttention-style ``mask_mod(b, h, q_idx, kv_idx)`` on global
            positions; ``None`` means full attention.
        seq_len: S, the global sequence length.
        world_size: P, the context-parallel group size.
        block_size: mask block in tokens (classification and kernel granularity).
        score_mod: optional ``score_mod(score, b, h, q_idx, kv_idx)`` (global positions).
        scale: softmax scale (default ``1/sqrt(D)``).
        kv: ``"resend"`` (backward re-sends kv; O(L) memory) or ``"keep"``.
        kernel: tile kernel name (``None`` chooses; see :mod:`fringe.ops`).
        batch_size, num_heads: give them if the mask depends on b or h.

    Raises:
        ValueError: with the fix, for sizes that do not fit the layout.
    """
    for name, val, low in (("seq_len", seq_len, 1), ("world_size", world_size, 1),
                           ("block_size", block_size, 1)):
        if not isinstance(val, int) or isinstance(val, bool) or val < low:
            raise ValueError(f"{name} must be an int >= {low}, got {val!r}")
    if kv not in KV_MODES:
        raise ValueError(f"kv must be one of {KV_MODES}, got {kv!r}")
    if not isinstance(schedule, Schedule):
        raise TypeError(f"schedule must be a fringe.schedules.Schedule (e.g. schedules.zigzag()), "
                        f"got {type(schedule).__name__}")
    mask_mod = mask_mod if mask_mod is not None else _masks.full()
    reads_b, reads_h = _masks.reads_batch_head(mask_mod)
    name = getattr(mask_mod, "__name__", "mask_mod")
    for reads, given, arg, idx in ((reads_b, batch_size, "batch_size", "b"),
                                   (reads_h, num_heads, "num_heads", "h")):
        if reads and given is None:
            raise ValueError(f"{name} reads the {idx} index (its output varies with {idx}), so "
                             f"its empty/full blocks depend on {idx}; pass {arg}= to "
                             f"fringe.plan so every {idx} is classified")
        if reads and getattr(mask_mod, "bh_invariant", False):
            raise ValueError(f"{name} is declared bh_invariant but reads the {idx} index; "
                             f"wrap it with masks.as_mask(fn, bh_invariant=False)")
    natural = None
    if schedule.mask_aware:      # classify in sequence order once, deal blocks, permute
        natural = _masks.classify(mask_mod, torch.arange(seq_len), torch.arange(seq_len),
                                  block_size=block_size, B=batch_size, H=num_heads)
        work = (natural != BlockKind.EMPTY).sum(dim=1)
        lay = schedule.make_layout(seq_len, world_size, block_size=block_size, block_work=work)
    else:
        lay = schedule.make_layout(seq_len, world_size, block_size=block_size)
    if lay.seq_len != seq_len or lay.world_size != world_size:
        raise ValueError(f"schedule {schedule.name!r} built a layout for S={lay.seq_len}, "
                         f"P={lay.world_size}; expected S={seq_len}, P={world_size}")
    if lay.local_len % block_size:
        raise ValueError(f"L=S/P={lay.local_len} tokens per rank is not a multiple of "
                         f"block_size={block_size}")
    block_order = lay.order.view(-1, block_size)
    aligned = bool((block_order == block_order[:, :1] + torch.arange(block_size)).all()) and \
        bool((block_order[:, 0] % block_size == 0).all())
    if natural is not None and aligned:
        nb = block_order[:, 0] // block_size
        blocks = natural[nb][:, nb]
    else:
        blocks = _masks.classify(mask_mod, lay.order, lay.order, block_size=block_size,
                                 B=batch_size, H=num_heads)
    tiles = _tile_kinds(blocks, world_size)
    need = tiles != BlockKind.EMPTY
    fwd = schedule.programs(world_size, need)
    check(fwd, need=need)
    bwd = reverse(fwd, kv=kv)
    check(bwd, need=need, backward=True, kv=kv)
    return Plan(schedule=schedule, mask_mod=mask_mod, layout=lay, block_size=block_size,
                blocks=blocks, tiles=tiles, forward=tuple(fwd), backward=tuple(bwd), kv=kv,
                score_mod=score_mod, scale=scale, kernel=kernel, batch_size=batch_size,
                num_heads=num_heads)
