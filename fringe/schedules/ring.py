"""Ring, zigzag and striped: one ring pattern over three layouts.

Each rank keeps its queries; kv chunks travel around the ring one hop per step, and each
rank computes a tile the step a chunk arrives. Zigzag and striped only change which tokens
a rank holds, which balances causal work; pruning then drops empty tiles and stops a chunk
after the last rank that needs it.
"""
from __future__ import annotations

from .. import layout as _layout
from .base import Schedule, ring_hops


def ring() -> Schedule:
    """Ring attention on the contiguous layout (rank r holds ``[rL, (r+1)L)``)."""
    return Schedule("ring", layout=_layout.contiguous, hops=ring_hops)


def zigzag() -> Schedule:
    """Ring over the zigzag layout: 2P chunks, rank r holds chunks r and 2P-1-r."""
    return Schedule("zigzag", layout=_layout.zigzag, hops=ring_hops)


def striped(stripe: int | None = None) -> Schedule:
    """Ring over the striped layout; ``stripe`` tokens per stripe (default: the block size)."""
    def make(seq_len: int, world_size: int, *, block_size: int):
        return _layout.striped(seq_len, world_size, stripe=stripe or block_size,
                               block_size=block_size)
    return Schedule("striped" if stripe is None else f"striped({stripe})", layout=make,
                    hops=ring_hops)
