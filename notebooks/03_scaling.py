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
# # 3 · Scaling: predict before you rent the cluster
#
# The cost model (`fringe.runtime.costmodel`) runs a plan's forward and backward programs
# symbolically: every tile costs what the kernel's work model says (calls and (q, kv) pairs,
# counted with the same grouping the tile kernel uses), every transfer latency + bytes /
# bandwidth, and overlap follows the interpreter's issue → compute → wait order. No tensor
# is made, so hundreds of ranks fit in a notebook.
#
# Hardware presets are data, with their sources:

# %%
# %matplotlib inline
import time

from matplotlib.figure import Figure
from tabulate import tabulate

import fringe
from fringe import masks, render, schedules
from fringe.testing import packed_docs
from fringe.runtime import costmodel

for hw in costmodel.HARDWARE.values():
    print(f"{hw.name:12} {hw.source}")

# %% [markdown]
# ## One layer, 8 to 1,024 ranks
#
# S = 65,536 tokens (block 32), one Llama-3-8B-like attention layer (H=32, G=8, D=128, bf16),
# on H100 nodes over InfiniBand; a causal mask, and 128 packed documents (causal within
# each). The four rings and all-gather (Llama-3 style); Ulysses inside `compose` is in
# notebook 4 with the crossover. Each point is one plan and one simulation, 1,024 ranks
# included: plans are numpy columns (a causal ring at P = 1,024 is about four million ops a
# direction), so the whole sweep takes well under a minute here.

# %%
S, BLOCK = 1 << 16, 32
WORLD_SIZES = (8, 32, 128, 1024)
NAMES = ("ring", "zigzag", "striped", "balanced", "allgather")
MASKS = {"causal": masks.causal(),
         "document": masks.causal() & masks.document(packed_docs(S, 128, 0))}
shape = costmodel.Shape()
results, t0 = {}, time.process_time()
for mname, m in MASKS.items():
    for name in NAMES:
        for P in WORLD_SIZES:
            plan = fringe.plan(schedules.get(name), m, seq_len=S, world_size=P, block_size=BLOCK)
            results[mname, name, P] = costmodel.simulate(plan, "h100-ib", shape, name=name)
            del plan
print(f"{len(results)} plans simulated in {time.process_time() - t0:.1f} s of CPU")

# %%
rows = [[m, n, P, f"{r.step_s * 1e3:.3g}", f"{r.balance:.2f}", f"{r.exposed():.2f}",
         f"{r.bytes_per_rank() / 1e6:.3g}", f"{r.memory.max() / 1e6:.3g}"]
        for (m, n, P), r in results.items()]
print(tabulate(rows, headers=["mask", "schedule", "P", "step ms", "balance", "exposed",
                              "sent MB/rank", "memory MB/rank"]))

# %% [markdown]
# Step time (forward + backward of the layer) against P. With a causal mask, zigzag and
# balanced split the work evenly; plain ring leaves the last rank with twice the mean. With
# packed documents, contiguous layouts keep each document on few ranks and most tiles are
# empty; zigzag and striped scatter every document, so every kv chunk must travel further.

# %%
fig = Figure(figsize=(11, 4), layout="constrained")
for ax, mname in zip(fig.subplots(1, 2), MASKS):
    for name in NAMES:
        pts = [(P, results[mname, name, P].step_s * 1e3) for P in WORLD_SIZES
               if (mname, name, P) in results]
        ax.plot(*zip(*pts), marker="o", label=name)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("ranks P")
    ax.set_ylabel("predicted step ms (fwd + bwd)")
    ax.set_title(f"{mname} · S={S:,} · h100-ib")
    ax.legend()
fig

# %%
causal = {n: results["causal", n, 128] for n in NAMES}
assert causal["zigzag"].balance < 1.05 < causal["ring"].balance
assert causal["zigzag"].step_s < causal["ring"].step_s
for r in results.values():
    assert r.step_s > 0 and 0 <= r.exposed() < 1 and r.balance >= 1 - 1e-9
assert {(m, n, 1024) for m in MASKS for n in NAMES} <= set(results)     # every schedule at 1,024

# %% [markdown]
# ## Where the time goes at 1,024 ranks
#
# The timeline pools ranks into rows and time into columns (compute blue, exposed
# communication red, idle grey) instead of drawing a bar per rank and step. With packed
# documents on a contiguous layout, the ranks holding long documents do the work.

# %%
big = results["document", "ring", 1024]
render.timeline_figure(big, max_ranks=32)

# %% [markdown]
# ## The same plan on three machines
#
# 32 ranks: all on one NVLink fabric, or 4 nodes of 8 over InfiniBand, or this CPU (the `cpu`
# preset, measured here with `costmodel.calibrate()`: fused CPU attention on one thread, gloo
# between processes).

# %%
plan = fringe.plan(schedules.zigzag(), MASKS["document"], seq_len=S, world_size=32,
                   block_size=BLOCK)
hw_rows = []
for hw in ("h100-nvlink", "h100-ib", "cpu"):
    r = costmodel.simulate(plan, hw, shape)
    hw_rows.append([hw, f"{r.step_s * 1e3:.4g}", f"{r.exposed():.2f}"])
print(tabulate(hw_rows, headers=["hardware", "step ms", "exposed"]))
assert float(hw_rows[0][1]) < float(hw_rows[1][1]) < float(hw_rows[2][1])

# %% [markdown]
# Where ring, all-gather and Ulysses cross over on each preset is the next notebook
# (`04_crossover.ipynb`). On this machine the cost model was checked against measured gloo
# runs at P = 2 (`costmodel.validate()`; the README gives the error).
