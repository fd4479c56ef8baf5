# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#   kernelspec:
#     display_name: Python 3 (ipykernel)
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 1 · Masks and tiles
#
# A fringe mask is a FlexAttention `mask_mod(b, h, q_idx, kv_idx)` whose indices are
# **global** token positions, whatever layout shuffles them across ranks. This notebook
# writes a few, looks at the tiles they leave under each layout, and property-tests a mask
# of our own against dense attention before anyone trains with it.
#
# Everything runs in this process (the virtual mesh); figures are `matplotlib.figure.Figure`
# objects, shown inline.

# %%
# %matplotlib inline
import torch

import fringe
from fringe import masks, render, schedules
from fringe.testing import check_mask

S, P, BLOCK = 2048, 4, 64

# %% [markdown]
# ## Built-in masks compose with `&` and `|`, and know their names

# %%
g = torch.Generator().manual_seed(0)
lengths = torch.tensor([700, 90, 500, 300, 180, 278])
doc_ids = torch.repeat_interleave(torch.arange(len(lengths)), lengths)
assert doc_ids.numel() == S
packed = masks.causal() & masks.document(doc_ids)
window = masks.sliding_window(256)
prefix = masks.causal() | masks.prefix_lm(128)
for m in (packed, window, prefix):
    print(m)

# %% [markdown]
# ## Block classification: EMPTY (.), PARTIAL (p), FULL (F)
#
# Structured masks are classified from their parameters (no S² evaluation). The plan skips
# EMPTY tiles and runs PARTIAL ones block-sparse. Rows and columns are in the layout's order
# (rank 0's blocks first), shown here for the first 32 blocks.

# %%
p = fringe.plan(schedules.zigzag(), packed, seq_len=S, world_size=P, block_size=BLOCK)
print(render.block_map(p, max_size=32))
print(p.stats())

# %% [markdown]
# ## The tile map: who computes each block, and when
#
# The S×S grid of blocks in sequence order, coloured by the rank that computes each block
# (left) and the forward step (right). White is EMPTY (never computed), hatching marks
# PARTIAL blocks (the mask is applied inside them). Ring keeps documents whole on one rank;
# zigzag folds the sequence; striped deals it round-robin; balanced deals blocks by work.

# %%
layouts = ("ring", "zigzag", "striped", "balanced")
plans = {name: fringe.plan(getattr(schedules, name)(), packed, seq_len=S, world_size=P,
                           block_size=BLOCK) for name in layouts}
render.tile_map_figure(plans["ring"])

# %%
render.tile_map_figure(plans["zigzag"])

# %%
render.tile_map_figure(plans["balanced"])

# %% [markdown]
# The balance (max / mean blocks per rank) says what the pictures show:

# %%
balance = {name: round(pl.stats().balance, 3) for name, pl in plans.items()}
print(balance)
assert balance["balanced"] <= min(balance["ring"], balance["zigzag"]) + 1e-9

# %% [markdown]
# ## Your own mask_mod: any elementwise tensor expression of the indices
#
# Python `if` / `and` on tensors is rejected with a message that says to use `&`, `|` or
# `torch.where`.

# %%
def every_third_token_sees_the_past(b, h, q_idx, kv_idx):
    return (kv_idx <= q_idx) & ((q_idx % 3 == 0) | (q_idx - kv_idx < 4))


try:
    masks.evaluate(lambda b, h, q, kv: q >= kv if True and q > 0 else q < kv,
                   torch.arange(4), torch.arange(4))
except masks.MaskError as e:
    print("rejected:", str(e).splitlines()[0])

mine = fringe.plan(schedules.striped(), every_third_token_sees_the_past, seq_len=256,
                   world_size=P, block_size=16)
render.tile_map_figure(mine)

# %% [markdown]
# ## Property-test it against dense attention before training with it
#
# `check_mask` plans it on every registered schedule (those that run at each world size:
# Ulysses needs the heads to split), world size and block size, checks the block
# classification against the dense mask, and runs forward and backward on the virtual mesh
# against the dense reference in float64.

# %%
from fringe.schedules import registry
from fringe.testing import CHECK_MASK_HEADS, CHECK_MASK_SCHEDULES

n = check_mask(every_third_token_sees_the_past, world_sizes=(2, 4), block_sizes=(4,))
print(f"{n} (schedule, P, block) combinations match dense attention")
runs = {P: [s for s in [*registry.names(), *CHECK_MASK_SCHEDULES]
            if registry.why_not(s, world_size=P, heads=CHECK_MASK_HEADS, kv_heads=1) is None] for P in (2, 4)}
print({P: names for P, names in runs.items()})
assert n == sum(len(names) for names in runs.values())
