# ---
# jupyter:
#   jupytext:
#     formats: py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
# ---

# %% [markdown]
# # A tour of fringe schedules
#
# Everything here runs in one process on the **virtual mesh**: the same interpreter the
# distributed runtime uses, with an in-memory transport. Open it with
# `jupytext --to notebook notebooks/schedules_tour.py`, or run it as a script.

# %%
import torch

import fringe
from fringe import masks, render, schedules
from fringe.ops import reference

S, P, BLOCK = 512, 4, 32

# %% [markdown]
# ## A mask that changes every batch: causal within packed documents

# %%
g = torch.Generator().manual_seed(0)
lengths = torch.randint(16, 160, (16,), generator=g)
doc_ids = torch.repeat_interleave(torch.arange(16), lengths)[:S]
doc_ids = torch.cat([doc_ids, doc_ids.new_full((S - doc_ids.numel(),), 16)])
mask = masks.causal() & masks.document(doc_ids)
print(mask)

# %% [markdown]
# ## Plan it on three schedules and compare the work per rank

# %%
plans = {name: fringe.plan(make(), mask, seq_len=S, world_size=P, block_size=BLOCK)
         for name, make in [("ring", schedules.ring), ("zigzag", schedules.zigzag),
                            ("striped", schedules.striped)]}
for name, p in plans.items():
    print(name, "balance max/mean:", round(p.stats().balance, 3))

# %% [markdown]
# ## Who computes what, when (forward), and the derived backward

# %%
p = plans["zigzag"]
print(render.table(p))
print(render.tile_map(p))
print(render.table(p, backward=True))

# %% [markdown]
# ## Run it and check it against the dense reference, forward and backward

# %%
q, k, v = (torch.randn(1, 4, S, 32, dtype=torch.float64, generator=g).requires_grad_()
           for _ in range(3))
out = fringe.simulate.attention(q, k, v, plan=p)
ref, _ = reference.attention(q, k, v, mask_mod=mask)
grads = torch.autograd.grad(out.sum(), (q, k, v))
ref_grads = torch.autograd.grad(ref.sum(), (q, k, v))
err = max([(out - ref).abs().max().item()] + [(a - b).abs().max().item()
                                             for a, b in zip(grads, ref_grads)])
print(f"max |fringe - dense| over out, dq, dk, dv: {err:.2e}")
assert err < 1e-10

# %% [markdown]
# ## Write your own schedule: the ring pattern over a layout of your choice

# %%
mine = schedules.Schedule(
    "ring-on-striped(16)",
    layout=lambda S, P, block_size: fringe.layout.striped(S, P, stripe=16, block_size=block_size),
    hops=schedules.ring_hops)
p2 = fringe.plan(mine, mask, seq_len=S, world_size=P, block_size=16)
print(p2.stats())
out2 = fringe.simulate.attention(q, k, v, plan=p2)
assert torch.allclose(out2, ref, atol=1e-10)

# %% [markdown]
# ## A timeline of the (virtual) run

# %%
states = fringe.simulate.forward_states(q, k, v, plan=p)
records = [rec for st in states.values() for rec in st.records]
ax = render.timeline(records, title="zigzag forward, virtual mesh")
