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
# # 4 · Ring, all-gather or Ulysses: where the crossover falls
#
# The cost model of notebook 3 (`fringe.runtime.costmodel`), on three hardware presets: one
# NVLink fabric, H100 nodes of 8 over InfiniBand, and this CPU. Each plan is made once and
# simulated on every preset (what does not depend on the hardware is kept on the plan).

# %%
# %matplotlib inline
import time

from matplotlib.figure import Figure

import fringe
from fringe import masks, schedules
from fringe.testing import packed_docs
from fringe.runtime import costmodel

shape = costmodel.Shape()

# %% [markdown]
# All-gather (Llama-3 style, kv gathered in two ring collectives) and Ulysses inside
# `compose` (all-to-all of heads inside groups of 8 ranks, a zigzag ring across the groups)
# are programs of collectives; the cost model prices a ring all-gather or reduce-scatter as
# (n − 1)·latency + bytes / bandwidth of its busiest member, an all-to-all pairwise the same
# way, on NVLink when the group is inside one node of 8 and on the inter-node link otherwise,
# and a head-sliced tile at 1/k of the heads. S = 65,536 tokens (block 32: zigzag at P = 1,024
# holds one block per chunk), 128 packed documents; every schedule from 8 to 1,024 ranks (512
# is left out to keep the notebook within its minute: a causal compose plan at 1,024 ranks is
# about 4 million head-sliced tile computes a direction, ~12 s to plan and check here).

# %%
S2, BLOCK2 = 1 << 16, 32
CROSS_P = (8, 16, 32, 64, 128, 256, 1024)
CROSS = ("ring", "zigzag", "allgather", "compose:zigzag+ulysses:8")
PRESETS = ("h100-nvlink", "h100-ib", "cpu")
MASKS2 = {"causal": masks.causal(),
          "document": masks.causal() & masks.document(packed_docs(S2, 128, 0))}
cross, t0 = {}, time.process_time()
for mname, m in MASKS2.items():
    for spec in CROSS:
        for P in CROSS_P:
            plan = fringe.plan(schedules.get(spec), m, seq_len=S2, world_size=P, block_size=BLOCK2)
            for hw in PRESETS:
                cross[hw, mname, spec, P] = costmodel.simulate(plan, hw, shape).step_s
            del plan
print(f"{len(cross)} predictions in {time.process_time() - t0:.1f} s of CPU")

# %%
fig = Figure(figsize=(13, 7), layout="constrained")
axes = fig.subplots(len(MASKS2), len(PRESETS))
for row, mname in zip(axes, MASKS2):
    for ax, hw in zip(row, PRESETS):
        for spec in CROSS:
            pts = [(P, cross[hw, mname, spec, P] * 1e3) for P in CROSS_P
                   if (hw, mname, spec, P) in cross]
            ax.plot(*zip(*pts), marker="o", label=spec)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(f"{mname} · {hw}")
        ax.set_xlabel("ranks P")
        ax.set_ylabel("predicted step ms")
axes[0][0].legend(fontsize=8)
fig

# %% [markdown]
# Which schedule is fastest at each P, and where the lead
# changes, computed from the predictions above:

# %%
def crossovers(hw: str, mname: str) -> str:
    best = [min((s for s in CROSS if (hw, mname, s, P) in cross),
                key=lambda s: cross[hw, mname, s, P]) for P in CROSS_P]
    runs, start = [], 0
    for i in range(1, len(best) + 1):
        if i == len(best) or best[i] != best[start]:
            lo, hi = CROSS_P[start], CROSS_P[i - 1]
            runs.append(f"{best[start]} at P={lo}" if lo == hi else
                        f"{best[start]} for P={lo}-{hi}")
            start = i
    changes = [f"{CROSS_P[i - 1]}-{CROSS_P[i]}" for i in range(1, len(best))
               if best[i] != best[i - 1]]
    return (f"{hw}, {mname} mask: fastest is " + ", then ".join(runs)
            + (f" (the lead changes between P={', '.join(changes)})" if changes else
               " (no crossover)") + ".")


SENTENCES = [crossovers(hw, mname) for mname in MASKS2 for hw in PRESETS]
print("\n".join(SENTENCES))
assert all(v > 0 for v in cross.values()) and len(SENTENCES) == len(MASKS2) * len(PRESETS)
for mname in MASKS2:       # in one node (P=8) NVLink and InfiniBand presets agree
    for spec in CROSS:
        assert cross["h100-nvlink", mname, spec, 8] == cross["h100-ib", mname, spec, 8]
        assert all((hw, mname, spec, P) in cross for hw in PRESETS for P in CROSS_P)

