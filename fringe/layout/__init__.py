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
* ``balanced``: mask-aware: the block order with the least predicted step time (kernel
  calls, pairs and bytes per rank), keeping packed documents whole where that balances
  (:func:`balanced`).

>>> zigzag(8, 2, block_size=2).positions(0).tolist()
[0, 1, 6, 7]
>>> zigzag(8, 2, block_size=2).positions(1).tolist()
[2, 3, 4, 5]
"""
from __future__ import annotations

from ..masks import DEFAULT_BLOCK_SIZE as DEFAULT_BLOCK_SIZE  # masks does not import layout
from ._balanced import (
    BALANCE_SHAPE as BALANCE_SHAPE,
    BALANCE_SLACK as BALANCE_SLACK,
    CHAIN_BALANCED as CHAIN_BALANCED,
    EXACT_BLOCKS as EXACT_BLOCKS,
    HOP_SLACK as HOP_SLACK,
    balanced as balanced,
    block_costs as block_costs,
    candidates as candidates,
    predict as predict,
    segments as segments,
)
from ._layout import (
    Layout as Layout,
    contiguous as contiguous,
    from_order as from_order,
    striped as striped,
    zigzag as zigzag,
)

__all__ = ["BALANCE_SHAPE", "BALANCE_SLACK", "CHAIN_BALANCED", "DEFAULT_BLOCK_SIZE", "EXACT_BLOCKS",
           "HOP_SLACK", "Layout", "balanced", "block_costs", "candidates", "contiguous", "from_order",
           "predict", "segments", "striped", "zigzag"]
