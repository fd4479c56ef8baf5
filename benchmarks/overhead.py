"""What fringe does outside the attention kernel, against dense SDPA in one process.

``python -m benchmarks.overhead [--S 4096] [--mask causal] [--schedule zigzag] [--world 1]
[--rounds 5] [--threads 2]`` prints, for one forward + backward (B=1, H=8, D=64, fp32) on
``fringe.simulate`` (all ranks in this process):

- **bytes written by non-kernel ops** (a ``TorchDispatchMode`` over every aten op except the
  fused attention ops and views), in units of one ``[1, 8, S, 64]`` fp32 tensor: deterministic,
  so it is the figure to compare across commits on a loaded machine; the top ops by bytes, and
  the bytes by where the op was called from (the innermost ``fringe`` module on the Python
  stack: ``layout`` and ``simulate`` are the global <-> rank-stacked shuffles, ``runtime`` the
  interpreter, ``ops`` the tile code; ``autograd`` is the backward of those ops, run by
  autograd's engine with no Python frame);
- **interleaved timing** (fringe and dense SDPA alternating, median of ``--rounds``): wall and
  CPU-time ratios, with the load average. Dense SDPA uses ``is_causal`` (causal) or a bool mask;
- the tile call cache (``fringe.ops.tile._CallCache``): tiles held, mask bytes, hits / misses.

A benchmark, never a test: it exits 0 whatever it measures.
"""
from __future__ import annotations

import argparse
import collections
import os
import statistics
import sys
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_VIEWS = {"view", "_unsafe_view", "slice", "select", "unsqueeze", "squeeze", "expand", "t",
          "transpose", "permute", "as_strided", "alias", "detach", "narrow", "unbind", "split",
          "lift_fresh", "_reshape_alias", "reshape"}


class _Bytes(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.bytes: collections.Counter = collections.Counter()
        self.calls: collections.Counter = collections.Counter()
        self.where: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if name in _VIEWS:
            return out
        if "scaled_dot_product" in name:
            name = "[attention kernel]"
        outs = out if isinstance(out, (tuple, list)) else (out,)
        n = sum(o.numel() * o.element_size() for o in outs if isinstance(o, torch.Tensor))
        self.bytes[name] += n
        self.calls[name] += 1
        if name != "[attention kernel]":
            self.where[_caller()] += n
        return out


def _caller() -> str:
    """The innermost fringe module on the Python stack ("autograd" when there is none)."""
    f = sys._getframe(2)
    while f is not None:
        path = f.f_code.co_filename.replace(os.sep, "/")
        if "/fringe/" in path:
            rest = path.rsplit("/fringe/", 1)[1]
            return rest.split("/")[0].removesuffix(".py")
        f = f.f_back
    return "autograd"


def main(argv=None) -> int:
    import fringe
    from fringe import schedules

    from .compare import HEAD_DIM, HEADS, dense_bool_mask, fringe_mask
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--S", type=int, default=4096)
    ap.add_argument("--mask", default="causal", choices=("causal", "document", "window"))
    ap.add_argument("--schedule", default="zigzag")
    ap.add_argument("--world", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    S = a.S
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, HEADS, S, HEAD_DIM, generator=g).requires_grad_() for _ in range(3))
    plan = fringe.plan(schedules.get(a.schedule), fringe_mask(a.mask, S), seq_len=S,
                       world_size=a.world)
    dense_mask = None if a.mask == "causal" else dense_bool_mask(a.mask, S)

    def run_fringe():
        fringe.simulate.attention(q, k, v, plan=plan).sum().backward()

    def run_dense():
        torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=dense_mask, is_causal=dense_mask is None).sum().backward()

    unit = HEADS * S * HEAD_DIM * 4
    systems = {"fringe": run_fringe, "dense SDPA": run_dense}
    for name, fn in systems.items():
        fn()                                            # warm-up
        mode = _Bytes()
        with mode:
            fn()
        total = sum(b for n, b in mode.bytes.items() if n != "[attention kernel]")
        top = sorted(((b / unit, mode.calls[n], n) for n, b in mode.bytes.items()
                      if n != "[attention kernel]"), reverse=True)[:8]
        print(f"{name}: non-kernel bytes written per fwd+bwd {total / 2 ** 20:.0f} MiB = "
              f"{total / unit:.1f} x [1, {HEADS}, {S}, {HEAD_DIM}] fp32; kernel calls "
              f"{mode.calls['[attention kernel]']}; top: "
              + ", ".join(f"{n} {u:.1f} ({c})" for u, c, n in top))
        print("  by caller: " + ", ".join(f"{w} {b / unit:.1f}" for w, b in
                                           mode.where.most_common()))
    wall = {n: [] for n in systems}
    cpu = {n: [] for n in systems}
    load0 = os.getloadavg()[0]
    for r in range(a.rounds):
        order = list(systems.items())[r % 2:] + list(systems.items())[:r % 2]
        for name, fn in order:
            t, c = time.perf_counter(), time.process_time()
            fn()
            wall[name].append(time.perf_counter() - t)
            cpu[name].append(time.process_time() - c)
    w = {n: statistics.median(x) for n, x in wall.items()}
    c = {n: statistics.median(x) for n, x in cpu.items()}
    print(f"{a.mask} S={S} {a.schedule} P={a.world}, {a.threads} threads, median of {a.rounds} "
          f"interleaved rounds (load {load0:.1f} -> {os.getloadavg()[0]:.1f}): wall fringe "
          f"{w['fringe']:.3f} s / dense {w['dense SDPA']:.3f} s = "
          f"{w['fringe'] / w['dense SDPA']:.3f}; CPU time "
          f"{c['fringe'] / c['dense SDPA']:.3f} (target for P=1 causal: <= 1.05)")
    from fringe.ops import tile as _tile
    cache = _tile._CACHE
    print(f"tile call cache: {len(cache.entries)} tiles, {cache.bytes / 2 ** 20:.1f} MiB masks, "
          f"{cache.hits} hits / {cache.misses} misses (groups and masks built once per tile)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
