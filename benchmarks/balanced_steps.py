"""Step times of balanced against ring and zigzag (and balanced's other candidate layouts),
interleaved in long-lived gloo ranks, with CPU seconds per rank beside the wall time.

``python -m benchmarks.balanced_steps --world-size 2 --masks document window --seq-lens 4096
8192 --layouts ring zigzag balanced --rounds 7`` — B=1, H=G=8, D=64, float32, forward +
backward, one thread per rank, the masks of :func:`benchmarks.compare.fringe_mask`, the plan's
default block size. ``ring-copy`` (or ``<name>-copy``, listed after ``<name>``) is a second,
identical plan with its own tensors: its ratio to ring is the noise floor of the run. A
layout name other than ring / zigzag / balanced is one of
:func:`fringe.layout.candidates` (``segments``, ``chain``, ``laps``, ...), run by the ring
schedule. Rounds alternate the order of the layouts; printed per layout: median wall seconds
(slowest rank), the median over rounds of wall / ring's wall in the same round, the median
CPU seconds of the busiest rank (what a shared machine inflates least) and of all ranks, and
the layout's fingerprint (equal fingerprints: the same plan). A benchmark, never a test.
P > cores is oversubscribed: wall time then follows the sum of the ranks' CPU seconds.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

#: Per worker process: name -> (plan, [q, k, v] shards of this rank); filled by a setup call
#: (:func:`_setup` here, ``benchmarks.auto_pick`` too) and read by :func:`step`.
STATE: dict = {}


def _setup(rank: int, world: int, kind: str, S: int, names: list[str]) -> dict:
    import fringe
    from fringe import layout, masks, schedules

    from .compare import _qkv, fringe_mask
    mask = fringe_mask(kind, S)
    STATE.clear()
    q, k, v = _qkv(S)
    cands = None
    for name in names:
        base, copy = name.removesuffix("-copy"), name.endswith("-copy")
        if base in ("ring", "zigzag", "balanced"):      # "-copy": an identical second plan
            p = fringe.plan(schedules.get(base), mask, seq_len=S, world_size=world)
            assert not copy or p.fingerprint() == STATE[base][0].fingerprint(), name
        else:
            bs = layout.DEFAULT_BLOCK_SIZE
            if cands is None:
                nat = masks.classify(mask, torch.arange(S), torch.arange(S), block_size=bs,
                                     sparse=True)
                cands = dict(layout.candidates(nat, world))
            if name not in cands:
                raise ValueError(f"layout {name!r} is not a candidate here; choose one of "
                                 f"{['ring', 'zigzag', 'balanced'] + sorted(cands)}")
            b = cands[name]
            lay = layout.from_order((b[:, None] * bs + torch.arange(bs)).reshape(-1), world,
                                    kind=name, block_size=bs)
            p = fringe.plan(schedules.ring(), mask, seq_len=S, world_size=world, layout=lay)
        ts = [p.layout.shard(t, rank).contiguous().requires_grad_() for t in (q, k, v)]
        STATE[name] = (p, ts)
    return {n: STATE[n][0].layout.fingerprint() for n in names}


def step(rank: int, world: int, name: str) -> dict:
    """One forward + backward of ``STATE[name]`` between barriers: wall and CPU seconds."""
    import torch.distributed as dist

    import fringe
    p, (q, k, v) = STATE[name]
    for t in (q, k, v):
        t.grad = None
    dist.barrier()
    c0, t0 = time.process_time(), time.perf_counter()
    fringe.attention(q, k, v, plan=p).sum().backward()
    cpu = time.process_time() - c0
    dist.barrier()
    return dict(wall=time.perf_counter() - t0, cpu=cpu)


def interleaved(w, names: list[str], rounds: int) -> dict:
    """One warm-up step per name, then ``rounds`` rounds of one :func:`step` per name on the
    pool ``w``, the order reversed every other round: ``{name: [(wall of the slowest rank,
    [CPU seconds per rank]), ...]}`` by round."""
    for n in names:
        w.run(step, n)                                               # warm-up
    res: dict = {n: [] for n in names}
    for r in range(rounds):
        for n in (names if r % 2 == 0 else names[::-1]):
            rr = w.run(step, n)
            res[n].append((max(x["wall"] for x in rr), [x["cpu"] for x in rr]))
    return res


def main(argv=None) -> None:
    from fringe.launch import Workers
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--masks", nargs="+", default=["document", "window"])
    ap.add_argument("--seq-lens", nargs="+", type=int, default=[4096, 8192])
    ap.add_argument("--layouts", nargs="+", default=["ring", "zigzag", "balanced"])
    ap.add_argument("--rounds", type=int, default=7)
    a = ap.parse_args(argv)
    names = list(dict.fromkeys(["ring"] + a.layouts))
    with Workers(a.world_size, timeout_s=900, threads=1) as w:
        for kind in a.masks:
            for S in a.seq_lens:
                fp = w.run(_setup, kind, S, names)[0]
                load0 = os.getloadavg()[0]
                res = interleaved(w, names, a.rounds)
                print(f"{kind} S={S} P={a.world_size} rounds={a.rounds} "
                      f"load {load0:.1f}->{os.getloadavg()[0]:.1f}")
                ring_cpu = statistics.median(max(c) for _, c in res["ring"])
                for n in names:
                    wall = statistics.median(x for x, _ in res[n])
                    ratio = statistics.median(x / y for (x, _), (y, _) in zip(res[n], res["ring"]))
                    busiest = statistics.median(max(c) for _, c in res[n])
                    total = statistics.median(sum(c) for _, c in res[n])
                    print(f"  {n:10s} wall {wall:.3f} s  /ring {ratio:.3f}  busiest rank CPU "
                          f"{busiest:.3f} s (/ring {busiest / ring_cpu:.3f})  all ranks CPU "
                          f"{total:.3f} s  {fp[n]}", flush=True)


if __name__ == "__main__":
    main()
