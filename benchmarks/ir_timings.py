"""Planning and simulation timings of the one-IR done-when cells (CPU seconds, one core).

``python -m benchmarks.ir_timings cells OLD_ROOT NEW_ROOT [ROUNDS]``: the README's P=1,024 cells
(S=1,048,576, 1,000 packed documents, causal & document), each planned, fingerprinted and
simulated 3 times in a fresh process per (cell, commit), the processes of two checkouts
alternating; prints the best of each with the ratio (the target: <= 1.10x or + 0.1 s).
Make the checkouts with ``git worktree add /tmp/old <commit>``.

``python -m benchmarks.ir_timings user``: a user-written two-level all-gather (groups of 8) at
P=256, S=262,144, block 128, on causal and 200 packed documents, written as op objects and with
the column builder, beside the built-in all-gather; fringe's share is the plan less the user's
own program function (targets: < 0.6 s in all, fringe's share <= 0.3 s, the column builder
within 2x the built-in).

Timings, not tests: nothing here asserts.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time

CELLS = [(n, b) for b in (128, 64) for n in ("ring", "zigzag", "striped", "balanced", "allgather")]
CELLS += [("compose:zigzag+ulysses:8", 64)]


def _docs(S: int, n: int):
    import torch
    g = torch.Generator().manual_seed(0)
    cuts = torch.randperm(S - 1, generator=g)[:n - 1].sort().values + 1
    return torch.bucketize(torch.arange(S), cuts, right=True)


def one_cell(name: str, block: int, repeats: int = 3) -> tuple[float, float]:
    """Best (plan, fingerprint + simulate) CPU seconds of ``repeats`` in this process."""
    import fringe
    from fringe import masks, schedules
    from fringe.runtime import costmodel
    S, P = 1_048_576, 1024
    docs = _docs(S, 1000)
    best_plan = best_sim = float("inf")
    for _ in range(repeats):
        mask = masks.causal() & masks.document(docs.clone())
        t0 = time.process_time()
        p = fringe.plan(schedules.get(name), mask, seq_len=S, world_size=P, block_size=block)
        t1 = time.process_time()
        p.fingerprint()
        costmodel.simulate(p, "h100-nvlink")
        t2 = time.process_time()
        best_plan, best_sim = min(best_plan, t1 - t0), min(best_sim, t2 - t1)
    return best_plan, best_sim


def cells(old: str, new: str, rounds: int = 2) -> None:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    res: dict = {}
    for _ in range(rounds):
        for n, b in CELLS:
            for who, root in (("old", old), ("new", new)):
                # this file run as a script: ``fringe`` comes from ``root`` (PYTHONPATH)
                out = subprocess.run([sys.executable, os.path.abspath(__file__), "one", n, str(b)],
                                     cwd=root, env=dict(env, PYTHONPATH=root),
                                     capture_output=True, text=True)
                if out.returncode:
                    print(who, n, b, out.stderr[-500:])
                    continue
                res.setdefault((n, b, who), []).append(tuple(map(float, out.stdout.split())))
    print("| schedule | block | plan old | plan new | ratio | sim old | sim new | ratio |")
    print("|---|---|---|---|---|---|---|---|")
    for n, b in CELLS:
        o, w = res.get((n, b, "old")), res.get((n, b, "new"))
        if o and w:
            po, pn = min(x[0] for x in o), min(x[0] for x in w)
            so, sn = min(x[1] for x in o), min(x[1] for x in w)
            print(f"| {n} | {b} | {po:.3f} | {pn:.3f} | {pn / po:.2f} | {so:.3f} | {sn:.3f} | "
                  f"{sn / so:.2f} |")


def user(repeats: int = 3) -> None:
    import fringe
    from fringe import layout, masks, schedules
    from fringe.testing.user_schedules import two_level_allgather, two_level_allgather_columns
    S, P, bs = 262_144, 256, 128
    mask_of = {"causal": masks.causal(), "docs": masks.causal() & masks.document(_docs(S, 200))}
    spent = [0.0]

    def timed(fn):
        def wrapped(*args):
            t = time.process_time()
            try:
                return fn(*args)
            finally:
                spent[0] += time.process_time() - t
        return wrapped

    def ops():
        return schedules.Schedule("two-level, op objects", layout=layout.contiguous,
                                  programs_fn=timed(two_level_allgather(8).programs_fn))

    def cols():
        s = two_level_allgather_columns(8, mask_aware=True)
        return schedules.Schedule("two-level, column builder", layout=s.layout,
                                  build=timed(s.build))
    made = {"allgather (built-in)": schedules.allgather, "two-level, op objects": ops,
            "two-level, column builder": cols}
    print("| mask | schedule | plan s | user's own s | fringe's share s |")
    print("|---|---|---|---|---|")
    for mname, m in mask_of.items():
        for sname, make in made.items():
            best = None
            for _ in range(repeats):
                s, spent[0] = make(), 0.0
                t = time.process_time()
                fringe.plan(s, m, seq_len=S, world_size=P, block_size=bs)
                dt = time.process_time() - t
                if best is None or dt < best[0]:
                    best = (dt, spent[0])
            print(f"| {mname} | {sname} | {best[0]:.3f} | {best[1]:.3f} | {best[0] - best[1]:.3f} |")


if __name__ == "__main__":
    if sys.argv[1:2] == ["one"]:
        print(*one_cell(sys.argv[2], int(sys.argv[3])))
    elif sys.argv[1:2] == ["cells"]:
        cells(sys.argv[2], sys.argv[3], int(sys.argv[4]) if len(sys.argv) > 4 else 2)
    elif sys.argv[1:2] == ["user"]:
        user()
    else:
        sys.exit(__doc__)
