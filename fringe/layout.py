"""Layouts: which global tokens each rank holds.

A :class:`Layout` is a permutation of the ``S`` global positions into ``P`` equal shards
of ``L = S / P`` tokens. Rank ``r`` holds global positions ``positions(r)`` in that order;
``shard`` / ``unshard`` move tensors between the global and the per-rank view, and
``positions`` is also what RoPE needs.

Kinds (chunk = a contiguous run of global positions):

* ``contiguous``: rank r holds ``[r*L, (r+1)*L)``.
* ``zigzag``: the sequence is cut into 2P chunks; rank r holds chunks r and 2P-1-r,
  which balances causal work.
* ``striped``: round robin in stripes of ``stripe`` tokens: stripe i goes to rank i % P.
* ``balanced``: mask-aware: blocks are dealt to ranks so that the attention work of every
  rank's queries is as equal as possible (:func:`balanced`).

>>> zigzag(8, 2, block_size=2).positions(0).tolist()
[0, 1, 6, 7]
>>> zigzag(8, 2, block_size=2).positions(1).tolist()
[2, 3, 4, 5]
"""
from __future__ import annotations

import dataclasses
import hashlib

import torch

#: Default mask-block size (tokens per side of a classification block). A parameter
#: everywhere; this is only its default.
DEFAULT_BLOCK_SIZE = 64


@dataclasses.dataclass(frozen=True, eq=False)
class Layout:
    """A permutation of ``S`` global positions into ``P`` equal shards.

    Args:
        kind: display name (``"contiguous"``, ``"zigzag"``, ``"striped"``, or yours).
        order: int64 ``[S]``; ``order[r*L:(r+1)*L]`` are the global positions of rank r.
        world_size: P.
    """

    kind: str
    order: torch.Tensor
    world_size: int

    def __post_init__(self) -> None:
        S, P = self.order.numel(), self.world_size
        if P < 1:
            raise ValueError(f"world_size must be >= 1, got {P}")
        if self.order.dim() != 1:
            raise ValueError(f"layout order must be 1-D [S], got shape {tuple(self.order.shape)}")
        if S % P:
            raise ValueError(f"S={S} tokens cannot be split into P={P} equal shards")
        check = torch.zeros(S, dtype=torch.bool)
        check[self.order] = True
        if not bool(check.all()):
            raise ValueError(f"layout order must be a permutation of range({S})")
        object.__setattr__(self, "order", self.order.to(torch.int64).contiguous())

    # ---- sizes -------------------------------------------------------------------
    @property
    def seq_len(self) -> int:
        """S, the global sequence length."""
        return self.order.numel()

    @property
    def local_len(self) -> int:
        """L = S / P, tokens per rank."""
        return self.seq_len // self.world_size

    # ---- maps --------------------------------------------------------------------
    def positions(self, rank: int) -> torch.Tensor:
        """Global positions held by ``rank`` (int64 ``[L]``), in local order."""
        self._check_rank(rank)
        L = self.local_len
        return self.order[rank * L:(rank + 1) * L]

    def owner(self) -> torch.Tensor:
        """int64 ``[S]``: the rank that holds each global position."""
        own = torch.empty(self.seq_len, dtype=torch.int64)
        own[self.order] = torch.arange(self.seq_len) // self.local_len
        return own

    def shard(self, x: torch.Tensor, rank: int, *, dim: int = -2) -> torch.Tensor:
        """Rank ``rank``'s tokens of a global tensor (sequence along ``dim``)."""
        self._check_len(x, dim)
        return x.index_select(dim, self.positions(rank).to(x.device))

    def unshard(self, shards: list[torch.Tensor] | tuple[torch.Tensor, ...], *,
                dim: int = -2) -> torch.Tensor:
        """Inverse of :meth:`shard`: the global tensor from all P shards in rank order."""
        if len(shards) != self.world_size:
            raise ValueError(f"unshard needs {self.world_size} shards (one per rank), "
                             f"got {len(shards)}")
        cat = torch.cat(list(shards), dim=dim)
        self._check_len(cat, dim)
        inverse = torch.empty_like(self.order)
        inverse[self.order] = torch.arange(self.seq_len)
        return cat.index_select(dim, inverse.to(cat.device))

    def fingerprint(self) -> str:
        """A short hash of the permutation, equal on every rank that built the same layout."""
        digest = hashlib.sha1(self.order.numpy().tobytes()).hexdigest()[:12]
        return f"{self.kind}/P{self.world_size}/S{self.seq_len}/{digest}"

    def __repr__(self) -> str:
        return f"Layout({self.kind}, S={self.seq_len}, P={self.world_size})"

    # ---- checks ------------------------------------------------------------------
    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank must be in [0, {self.world_size}), got {rank}")

    def _check_len(self, x: torch.Tensor, dim: int) -> None:
        if x.shape[dim] != self.seq_len:
            raise ValueError(f"tensor has {x.shape[dim]} tokens along dim {dim}, but the layout "
                             f"is for S={self.seq_len}; shape {tuple(x.shape)}")


def _granularity_error(S: int, unit: int, what: str) -> ValueError:
    pad = -(-S // unit) * unit if S > 0 else unit
    return ValueError(f"S={S} is not divisible by {what}={unit}; pad the sequence to {pad} "
                      f"tokens (or choose a smaller block size)")


def _check(S: int, P: int) -> None:
    if P < 1:
        raise ValueError(f"world_size must be >= 1, got {P}")
    if S < 1:
        raise ValueError(f"seq_len must be >= 1, got {S}")


def contiguous(seq_len: int, world_size: int, *, block_size: int = DEFAULT_BLOCK_SIZE) -> Layout:
    """Rank r holds ``[r*L, (r+1)*L)``. Needs ``S % (P*block_size) == 0``."""
    _check(seq_len, world_size)
    if seq_len % (world_size * block_size):
        raise _granularity_error(seq_len, world_size * block_size, f"P*block={world_size}*{block_size}")
    return Layout("contiguous", torch.arange(seq_len), world_size)


def zigzag(seq_len: int, world_size: int, *, block_size: int = DEFAULT_BLOCK_SIZE) -> Layout:
    """2P chunks; rank r holds chunks r and 2P-1-r. Needs ``S % (2*P*block_size) == 0``."""
    _check(seq_len, world_size)
    unit = 2 * world_size * block_size
    if seq_len % unit:
        raise _granularity_error(seq_len, unit, f"2*P*block=2*{world_size}*{block_size}")
    chunk = seq_len // (2 * world_size)
    chunks = torch.arange(seq_len).view(2 * world_size, chunk)
    order = torch.cat([torch.cat([chunks[r], chunks[2 * world_size - 1 - r]])
                       for r in range(world_size)])
    return Layout("zigzag", order, world_size)


def striped(seq_len: int, world_size: int, *, stripe: int = 1,
            block_size: int = DEFAULT_BLOCK_SIZE) -> Layout:
    """Stripe i (``stripe`` tokens) goes to rank ``i % P``.

    Needs ``S % (stripe*P) == 0`` and the local length to be a multiple of ``block_size``.
    """
    _check(seq_len, world_size)
    if stripe < 1:
        raise ValueError(f"stripe must be >= 1 token, got {stripe}")
    unit = stripe * world_size
    if seq_len % unit:
        raise _granularity_error(seq_len, unit, f"stripe*P={stripe}*{world_size}")
    if (seq_len // world_size) % block_size:
        raise _granularity_error(seq_len, world_size * block_size, f"P*block={world_size}*{block_size}")
    stripes = torch.arange(seq_len).view(seq_len // unit, world_size, stripe)
    order = stripes.transpose(0, 1).reshape(-1)
    return Layout(f"striped({stripe})" if stripe != 1 else "striped", order, world_size)


def from_order(order: torch.Tensor, world_size: int, *, kind: str = "custom",
               block_size: int = DEFAULT_BLOCK_SIZE) -> Layout:
    """A user-defined layout from an explicit permutation (``order[r*L:(r+1)*L]`` → rank r)."""
    order = torch.as_tensor(order, dtype=torch.int64)
    _check(order.numel(), world_size)
    if order.numel() % (world_size * block_size):
        raise _granularity_error(order.numel(), world_size * block_size,
                                 f"P*block={world_size}*{block_size}")
    return Layout(kind, order, world_size)


def balanced(seq_len: int, world_size: int, *, block_size: int = DEFAULT_BLOCK_SIZE,
             block_work: torch.Tensor) -> Layout:
    """Deal blocks to ranks so the work of each rank's queries is as equal as possible.

    A rank computes every non-empty (q-block, kv-block) pair of its own q blocks, wherever the
    kv lives, so its work is the sum of its q blocks' work, and balancing is a partition of
    the blocks into P groups of equal size with equal sums. Greedy: heaviest block first, to
    the least loaded rank that still has room (LPT); each rank keeps its blocks in sequence
    order.

    Args:
        seq_len: S.
        world_size: P.
        block_size: tokens per block; ``S`` must be a multiple of ``P * block_size``.
        block_work: float/int ``[S / block_size]``: the work of each q block (e.g. its number
            of non-empty kv blocks, from :func:`fringe.masks.classify`).
    """
    _check(seq_len, world_size)
    if seq_len % (world_size * block_size):
        raise _granularity_error(seq_len, world_size * block_size,
                                 f"P*block={world_size}*{block_size}")
    nb = seq_len // block_size
    work = torch.as_tensor(block_work, dtype=torch.float64).flatten()
    if work.numel() != nb:
        raise ValueError(f"block_work has {work.numel()} entries; expected S/block_size={nb}")
    cap = nb // world_size
    load = [0.0] * world_size
    members: list[list[int]] = [[] for _ in range(world_size)]
    for b in torch.argsort(work, descending=True, stable=True).tolist():
        r = min((r for r in range(world_size) if len(members[r]) < cap), key=lambda r: load[r])
        members[r].append(b)
        load[r] += float(work[b])
    blocks = torch.tensor([b for m in members for b in sorted(m)], dtype=torch.int64)
    order = (blocks[:, None] * block_size + torch.arange(block_size)).reshape(-1)
    return Layout("balanced", order, world_size)
