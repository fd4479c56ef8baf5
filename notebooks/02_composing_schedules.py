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
# # 2 · Composing schedules
#
# A schedule is data: a layout (which tokens each rank holds) and a communication pattern,
# lowered to one program per rank. Here we build two of our own — a new layout on the ring
# pattern, and a program written by hand — draw them, check them on the virtual mesh
# against dense attention, and look at the backward fringe derives from each.

# %%
# %matplotlib inline
import torch

import fringe
from fringe import layout, masks, render, schedules
from fringe.ops import reference
from fringe.runtime import costmodel

S, P = 512, 4
g = torch.Generator().manual_seed(0)
lengths = torch.randint(16, 160, (16,), generator=g)
doc_ids = torch.repeat_interleave(torch.arange(16), lengths)[:S]
doc_ids = torch.cat([doc_ids, doc_ids.new_full((S - doc_ids.numel(),), 16)])
mask = masks.causal() & masks.document(doc_ids)
q, k, v = (torch.randn(1, 2, S, 16, dtype=torch.float64, generator=g).requires_grad_()
           for _ in range(3))
ref, _ = reference.attention(q, k, v, mask_mod=mask)
ref_grads = torch.autograd.grad(ref.sum(), (q, k, v))


def max_error(plan):
    """Largest |fringe - dense| over out, dq, dk, dv (float64)."""
    out = fringe.simulate.attention(q, k, v, plan=plan)
    grads = torch.autograd.grad(out.sum(), (q, k, v))
    return max([(out - ref).abs().max().item()] +
               [(a - b).abs().max().item() for a, b in zip(grads, ref_grads)])


# %% [markdown]
# ## A new layout on the ring pattern
#
# Stripes of 16 tokens dealt round-robin: the same ring of kv hops, a different tiling.

# %%
mine = schedules.Schedule(
    "ring-on-striped(16)",
    layout=lambda S, P, block_size: layout.striped(S, P, stripe=16, block_size=block_size),
    hops=schedules.ring_hops)
p_mine = fringe.plan(mine, mask, seq_len=S, world_size=P, block_size=16)
print(p_mine.stats())
render.tile_map_figure(p_mine)

# %%
err = max_error(p_mine)
print(f"ring-on-striped(16): max |fringe - dense| = {err:.1e}")
assert err < 1e-10

# %% [markdown]
# ## A program written by hand
#
# Two ranks, contiguous layout. Instead of a ring step, both ranks swap their kv at step 0
# and compute the exchanged tile at step 1 — written in the IR's text form. fringe prunes,
# checks and reverses it like any built-in schedule.

# %%
from fringe.schedules import Program  # noqa: E402

SWAP = ["r0:\n  t0: S kv0->r1 | R kv1<-r1 | C q0.kv0\n  t1: C q0.kv1",
        "r1:\n  t0: S kv1->r0 | R kv0<-r0 | C q1.kv1\n  t1: C q1.kv0"]
swap = schedules.Schedule("swap", layout=layout.contiguous,
                          programs_fn=lambda P: [Program.parse(text) for text in SWAP])
p_swap = fringe.plan(swap, None, seq_len=S, world_size=2, block_size=32)
print(render.table(p_swap))

# %%
ref_full, _ = reference.attention(q, k, v)
out = fringe.simulate.attention(q, k, v, plan=p_swap)
err = (out - ref_full).abs().max().item()
print(f"swap, full attention: max |fringe - dense| = {err:.1e}")
assert err < 1e-10

# %% [markdown]
# ## The derived backward
#
# Steps in reverse order; each tile becomes its VJP (`G`), each receive of `kv` a send of
# `dkv` back where it came from. Nobody wrote this program:

# %%
print(render.table(p_swap, backward=True))
grads = torch.autograd.grad(out.sum(), (q, k, v))
full_grads = torch.autograd.grad(ref_full.sum(), (q, k, v))
gerr = max((a - b).abs().max().item() for a, b in zip(grads, full_grads))
print(f"dq, dk, dv: max |fringe - dense| = {gerr:.1e}")
assert gerr < 1e-10

# %% [markdown]
# ## A collective schedule written by hand: a two-level all-gather
#
# kv is all-gathered within groups of 2 ranks, then across groups: each rank forwards the
# chunks the first gather brought, one gather per position in the group, so the second
# collective depends on the first. It is written without the mask, with op objects. fringe
# thins each gather to what the document mask needs (a contribution stays when its
# receiver, or a rank it forwards the chunk to, computes with it) and derives the backward
# under the default `kv="resend"`: reduce-scatters in reverse order, and the gathers
# re-issued in a prologue, one step apart, so the outer one has what the inner one brought.

# %%
from fringe.schedules import Buffer, Collective, Compute, Step  # noqa: E402


def two_level_allgather(P, g=2):
    """kv gathered within groups of g ranks, then across groups (a chain of collectives)."""
    kv = lambda c: Buffer.of("kv", c)  # noqa: E731
    progs = []
    for r in range(P):
        j = r // g
        inner = tuple(range(j * g, j * g + g))       # my group
        outer = tuple(range(r % g, P, g))            # the same position in every group
        step0 = [Compute(r, r), Collective("AG", inner, [kv(r)] * g, [kv(m) for m in inner])]
        step1 = [Compute(r, c) for c in inner if c != r]
        for m in range(g):                           # forward chunk j*g+m, brought at step 0
            step1.append(Collective("AG", outer, [kv(j * g + m)] * len(outer),
                                    [kv(o - r % g + m) for o in outer]))
        step2 = [Compute(r, c) for c in range(P) if c // g != j]
        progs.append(Program(r, (Step(0, tuple(step0)), Step(1, tuple(step1)),
                                 Step(2, tuple(step2)))))
    return progs


two_level = schedules.Schedule("two-level all-gather", layout=layout.contiguous,
                               programs_fn=two_level_allgather)
p_two = fringe.plan(two_level, masks.causal(), seq_len=S, world_size=P,
                    block_size=16)                                        # kv="resend"
print(render.table(p_two, backward=True))

# %%
out = fringe.simulate.attention(q, k, v, plan=p_two)
ref_causal, _ = reference.attention(q, k, v, mask_mod=masks.causal())
grads = torch.autograd.grad(out.sum(), (q, k, v))
want = torch.autograd.grad(ref_causal.sum(), (q, k, v))
err = max([(out - ref_causal).abs().max().item()] +
          [(a - b).abs().max().item() for a, b in zip(grads, want)])
print(f"two-level all-gather, causal, derived backward: max |fringe - dense| = {err:.1e}")
assert err < 1e-10 and p_two.kv == "resend"

# On the document mask no document crosses a group boundary here, so the thinning drops
# the outer gathers altogether; the same hand-written programs still match dense attention.

# %%
p_two_docs = fringe.plan(two_level, mask, seq_len=S, world_size=P, block_size=16)
n_gathers = sum(type(op) is Collective for prog in p_two_docs.forward for _, op in prog.ops())
print(f"document mask: {n_gathers} gathers left of {4 * P // 2 + P}; "
      f"max |fringe - dense| = {max_error(p_two_docs):.1e}")
assert max_error(p_two_docs) < 1e-10

# %% [markdown]
# ## Where the time goes: a measured (virtual) run and the cost model
#
# The virtual mesh records per-step compute and waiting just as the distributed runtime
# does; the cost model predicts the same records without running anything. Both draw with
# `render.timeline_figure`.

# %%
zz = fringe.plan(schedules.zigzag(), mask, seq_len=S, world_size=P, block_size=16)
states = fringe.simulate.forward_states(q, k, v, plan=zz)
records = [rec for st in states.values() for rec in st.records]
render.timeline_figure(records, title="zigzag forward, virtual mesh (all ranks share one core)")

# %%
pred = costmodel.simulate(zz, "h100-nvlink",
                          costmodel.Shape(heads=2, kv_heads=2, head_dim=16, dtype="float64"))
assert len(pred.records("forward")) == len(records)
render.timeline_figure(pred)
