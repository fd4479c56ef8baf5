"""Bytes the mask needs against bytes fringe moves (issue 20's table), no ranks started.

``python -m benchmarks.bytes`` (add ``--markdown`` for BENCHMARKS.md's table; ``--cells docs16
window`` for some): for each cell (packed documents of random lengths: 16 at S=8,192 P=4, 64
at S=16,384 P=8, 1,000 at S=1,048,576 P=64; a causal sliding window of 256 tokens at S=8,192
P=4; block 64) and schedule, the forward kv tokens every rank receives, summed over ranks:

* ``floor``: what the plan's own layout needs at token granularity — for each rank and each
  other rank's chunk, the kv tokens some query token of the rank attends (the mask evaluated
  token by token inside PARTIAL blocks, FULL blocks whole);
* ``fringe``: what the plan's programs move (block ranges: whole blocks);
* ``all-gather``: (P-1)·S, what torch CP's all-gather moves forward.

Ratios: fringe / floor (target <= 1.25), fringe / all-gather (targets <= 0.08 documents,
<= 0.12 window); the backward's dkv + re-sent kv against twice the floor (<= 1.25); work
balance (``plan.stats().balance``, target <= 1.05); planning seconds. Tokens, not bytes: every
kv token costs the same ``2·G·D·itemsize`` bytes, so the ratios are those of bytes. A
benchmark, never a test.
"""
from __future__ import annotations

import argparse
import time

import numpy as np
import torch

CELLS = {                    # name: (mask kind, documents or window, S, P)
    "docs16": ("documents", 16, 8192, 4),
    "docs64": ("documents", 64, 16384, 8),
    "docs1000": ("documents", 1000, 1 << 20, 64),
    "window": ("window", 256, 8192, 4),
}
SCHEDULES = ("balanced", "zigzag", "ring")
BLOCK = 64


def mask_of(kind: str, arg: int, S: int):
    from fringe import masks
    from fringe.testing import packed_docs
    if kind == "documents":
        return masks.causal() & masks.document(packed_docs(S, arg, seed=20))
    return masks.causal() & masks.sliding_window(arg)


def floor_tokens(plan) -> int:
    """Forward kv tokens the plan's layout needs at token granularity, summed over ranks."""
    from fringe.masks import BlockKind
    P, L, bs = plan.world_size, plan.local_len, plan.block_size
    n = L // bs
    order = plan.layout.order                 # layout index -> global position
    rects = plan.block_map.rects.numpy()
    codes = plan.block_map.codes.numpy()
    need = {}                                 # (rank, chunk) -> bool [L]
    zero = torch.zeros((), dtype=torch.int64)
    for (r0, r1, c0, c1), code in zip(rects.tolist(), codes.tolist()):
        r, c = r0 // n, c0 // n
        if r == c:
            continue
        mark = need.setdefault((r, c), np.zeros(L, dtype=bool))
        lo, hi = (c0 - c * n) * bs, (c1 - c * n) * bs
        if code == BlockKind.FULL:
            mark[lo:hi] = True
            continue
        kv_pos = order[c0 * bs:c1 * bs]
        for rb in range(r0, r1):               # a block row at a time
            q_pos = order[rb * bs:(rb + 1) * bs]
            m = plan.mask_mod(zero, zero, q_pos[:, None], kv_pos[None, :])
            mark[lo:hi] |= m.any(0).numpy()
    return int(sum(int(v.sum()) for v in need.values()))


def moved_tokens(plan, direction: str, family: str) -> int:
    """Tokens of ``family`` buffers received over ``direction``'s programs, summed over ranks."""
    from fringe.schedules.ir import Collective, Recv
    n, bs = plan.local_len // plan.block_size, plan.block_size
    total = 0
    for prog in getattr(plan, direction):
        for _, op in prog.ops():
            if isinstance(op, Recv) and op.buf.family.value == family:
                total += bs * (n if op.blocks is None else sum(h - lo for lo, h in op.blocks))
            elif isinstance(op, Collective):
                me = op.group.index(prog.rank)
                total += plan.local_len * sum(1 for k, b in enumerate(op.recvs)
                                              if b is not None and k != me
                                              and b.family.value == family)
    return total


def cell(name: str, schedule: str, *, ranges: bool = True, block: int = BLOCK) -> dict:
    import fringe
    from fringe import schedules
    kind, arg, S, P = CELLS[name]
    mask = mask_of(kind, arg, S)
    t0 = time.perf_counter()
    p = fringe.plan(schedules.get(schedule), mask, seq_len=S, world_size=P, block_size=block,
                    ranges=ranges)
    plan_s = time.perf_counter() - t0
    floor = floor_tokens(p)
    fwd = moved_tokens(p, "forward", "kv")
    bwd = moved_tokens(p, "backward", "dkv") + moved_tokens(p, "backward", "kv")
    ag = (P - 1) * S
    counts = p.tile_block_counts()
    stats = p.stats(batch=1, heads=1, kv_heads=1, head_dim=8, dtype=torch.float32)
    return dict(cell=name, schedule=schedule, S=S, P=P, floor=floor, fringe=fwd,
                over_floor=fwd / floor if floor else float("nan"), over_ag=fwd / ag,
                bwd_over=bwd / (2 * floor) if floor else float("nan"), allgather=ag,
                balance=stats.balance, plan_s=plan_s, nonempty=int(counts.sum()))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cells", nargs="*", default=list(CELLS))
    ap.add_argument("--schedules", nargs="*", default=list(SCHEDULES))
    ap.add_argument("--whole", action="store_true", help="also plan with ranges=False")
    ap.add_argument("--markdown", action="store_true")
    ap.add_argument("--block", type=int, default=BLOCK, help="block size (default 64)")
    a = ap.parse_args(argv)
    rows = []
    for c in a.cells:
        for s in a.schedules:
            for ranges in ((True, False) if a.whole else (True,)):
                r = cell(c, s, ranges=ranges, block=a.block)
                r["schedule"] += "" if ranges else " (whole)"
                rows.append(r)
                print(f"{r['cell']:9s} {r['schedule']:18s} floor {r['floor']:>12,} fringe "
                      f"{r['fringe']:>12,}  /floor {r['over_floor']:.3f} (<=1.25)  /AG "
                      f"{r['over_ag']:.4f}  bwd/(2 floor) {r['bwd_over']:.3f}  balance "
                      f"{r['balance']:.3f} (<=1.05)  plan {r['plan_s']:.2f}s", flush=True)
    if a.markdown:
        print(f"\nblock {a.block}\n")
        print("| cell | S | P | schedule | floor (kv tokens) | fringe | fringe / floor | "
              "fringe / all-gather | bwd / (2 floor) | balance | plan s |")
        print("|---|---|---|---|---|---|---|---|---|---|---|")
        for r in rows:
            print(f"| {r['cell']} | {r['S']:,} | {r['P']} | {r['schedule']} | {r['floor']:,} | "
                  f"{r['fringe']:,} | {r['over_floor']:.3f} | {r['over_ag']:.4f} | "
                  f"{r['bwd_over']:.3f} | {r['balance']:.3f} | {r['plan_s']:.2f} |")


if __name__ == "__main__":
    main()
