# ---
# jupyter:
#   jupytext:
#     formats: py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
# ---

# %% [markdown]
# # Masks on global positions, and how to trust a new one
#
# A fringe mask is a FlexAttention `mask_mod(b, h, q_idx, kv_idx)` whose indices are
# **global** token positions, whatever layout shuffles them across ranks.

# %%
import torch

import fringe
from fringe import masks, render, schedules
from fringe.testing import check_mask

S, P = 256, 4

# %% [markdown]
# ## Built-in masks compose with `&` and `|`, and know their names

# %%
doc_ids = torch.repeat_interleave(torch.arange(4), torch.tensor([100, 20, 90, 46]))
mask = (masks.causal() & masks.document(doc_ids)) | masks.prefix_lm(8)
print(mask)

# %% [markdown]
# ## Block classification: EMPTY (.), PARTIAL (p), FULL (F), in the layout's order
#
# Structured masks are classified from their parameters (no S² evaluation); the plan then
# skips EMPTY tiles and runs PARTIAL ones block-sparse.

# %%
p = fringe.plan(schedules.zigzag(), mask, seq_len=S, world_size=P, block_size=16)
print(render.block_map(p))
print(p.stats())

# %% [markdown]
# ## Your own mask_mod: any tensor expression of the indices
#
# Python `if`/`and` on tensors is rejected with a message that says to use `&`, `|` or
# `torch.where`.

# %%
def every_third_token_sees_the_past(b, h, q_idx, kv_idx):
    return (kv_idx <= q_idx) & ((q_idx % 3 == 0) | (q_idx - kv_idx < 4))


try:
    masks.evaluate(lambda b, h, q, kv: q >= kv if True and q > 0 else q < kv,
                   torch.arange(4), torch.arange(4))
except masks.MaskError as e:
    print("rejected:", str(e).splitlines()[0])

# %% [markdown]
# ## Property-test it against dense attention before training with it
#
# `check_mask` plans it on every schedule, world size and block size, checks the block
# classification against the dense mask, and runs forward and backward on the virtual mesh
# against the dense reference in float64.

# %%
n = check_mask(every_third_token_sees_the_past, world_sizes=(1, 2, 4), block_sizes=(1, 4))
print(f"{n} (schedule, P, block) combinations match dense attention")
assert n == 4 * 3 * 2
