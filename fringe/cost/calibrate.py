"""Measure this machine for the cost model: the fused CPU attention kernel and gloo.

The tools layer of the cost model (it spawns gloo ranks through :mod:`fringe.launch`).
:func:`get_hardware` is :func:`fringe.cost.hardware.get_hardware` with ``"this"``: calibrate
now.
"""
from __future__ import annotations

import math
import time

import torch

from ..launch import run
from ..masks import BlockKind, causal
from ..ops import merge, tile_backward, tile_forward
from . import hardware as _hardware
from .hardware import _CPU, BWD_FLOPS_PER_PAIR, FWD_FLOPS_PER_PAIR, Hardware
from .work import _maps_work

__all__ = ["calibrate", "get_hardware"]

_FULL, _PARTIAL, _EMPTY = int(BlockKind.FULL), int(BlockKind.PARTIAL), int(BlockKind.EMPTY)


def get_hardware(hardware: str | Hardware) -> Hardware:
    """A preset by name, ``"this"`` (:func:`calibrate` now), or a :class:`Hardware` as is.

    Raises:
        ValueError: for an unknown name, listing the presets.
    """
    if isinstance(hardware, str) and hardware == "this":
        return calibrate()
    return _hardware.get_hardware(hardware)


def _best(fn, repeats: int, clock=time.perf_counter) -> float:
    """Fastest of ``repeats`` calls after a warm-up, on ``clock``."""
    fn()
    best = math.inf
    for _ in range(repeats):
        t0 = clock()
        fn()
        best = min(best, clock() - t0)
    return best


def calibrate(*, heads: int = 8, head_dim: int = 64, dtype: torch.dtype = torch.float32,
              threads: int = 1, comm: bool = True, repeats: int = 2) -> Hardware:
    """Measure this machine: the fused CPU attention kernel (via fringe's tile ops) and gloo.

    Times FULL and masked sub-problems of two sizes, forward and backward, with ``threads``
    torch threads (ranks on a CPU run with one each; with one thread the CPU time of this
    thread is used, so that other processes on a shared machine do not inflate it), and,
    with ``comm``, round trips of a tiny and a 4 MB tensor between two spawned gloo ranks
    (a few seconds: process start-up).

    The result is this process's measurement: :func:`fringe.schedules.auto` refuses it, since
    ranks that measure for themselves can choose different schedules. :func:`shared` measures
    once and gives every rank the same constants.

    Returns:
        A :class:`Hardware` named ``"this"`` whose source says what was measured.
    """
    fields = _kernels(heads=heads, head_dim=head_dim, dtype=dtype, threads=threads,
                      repeats=repeats)
    lat, bw = _CPU["latency_s"], _CPU["bandwidth"]
    if comm:
        res = run(_gloo_probe, world_size=2, timeout_s=60)
        lat, bw = max(r[0] for r in res), min(r[1] for r in res)
    src = _source(heads=heads, head_dim=head_dim, dtype=dtype, threads=threads,
                  comm="gloo round trips between 2 spawned ranks" if comm
                  else "gloo from the cpu preset")
    return Hardware("this", src, latency_s=lat, bandwidth=bw, memory_bytes=None, **fields)


def _source(*, heads, head_dim, dtype, threads, comm: str) -> str:
    return (f"calibrated here: fused CPU SDPA through fringe.ops, {threads} thread(s), "
            f"{str(dtype).replace('torch.', '')}, H={heads} D={head_dim}; {comm}")


def _kernels(*, heads: int, head_dim: int, dtype: torch.dtype, threads: int,
             repeats: int) -> dict:
    """The kernel fields of :class:`Hardware`, measured here (see :func:`calibrate`)."""
    # one thread: this thread's CPU time is the kernel's time even on a machine other
    # processes share (wall-clock would count their time slices too)
    cpu = time.thread_time if threads == 1 else time.perf_counter
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        g = torch.Generator().manual_seed(0)
        H, D = heads, head_dim

        def timed(L: int, kw: dict):
            q, k, v, do = (torch.randn(1, H, L, D, generator=g, dtype=dtype) for _ in range(4))
            pos = torch.arange(L)
            kw = dict(q_pos=pos, kv_pos=pos, **kw)
            out, lse = tile_forward(q, k, v, **kw)
            fwd = _best(lambda: tile_forward(q, k, v, **kw), repeats, cpu)
            bwd = _best(lambda: tile_backward(q, k, v, out, lse, do, **kw), repeats, cpu)
            return fwd, bwd

        small, big, bs = 64, 2048, 128   # a call's fixed cost from a tiny tile, pairs from a big one
        (f0, b0) = timed(small, dict(kind=BlockKind.FULL))
        (f1, b1) = timed(big, dict(kind=BlockKind.FULL))
        pairs0, pairs1 = small * small, big * big
        f_unit = max((f1 - f0) / (pairs1 - pairs0), 1e-15)
        b_unit = max((b1 - b0) / (pairs1 - pairs0), 1e-15)
        f_call = max(f0 - f_unit * pairs0, 0.0)
        b_call = max(b0 - b_unit * pairs0, 0.0)
        # a causal diagonal tile run the way plans run it (block map, the sdpa grouping: one
        # is_causal call) gives the causal factor; a tile of PARTIAL blocks that are not
        # lower-triangular (one call with a float mask over all of it) the masked factor
        nb = big // bs
        codes = torch.full((nb, nb), _EMPTY, dtype=torch.int8)
        codes[torch.tril(torch.ones(nb, nb, dtype=torch.bool), -1)] = _FULL
        codes[torch.arange(nb), torch.arange(nb)] = _PARTIAL

        def checker(b, h, q_idx, kv_idx):
            return (q_idx + kv_idx) % 2 == 0
        factors = []
        for kw in (dict(blocks=codes, mask_mod=causal()),
                   dict(blocks=torch.full((nb, nb), _PARTIAL, dtype=torch.int8),
                        mask_mod=checker)):
            fm, bm = timed(big, dict(kind=BlockKind.PARTIAL, block_size=bs, **kw))
            calls, full, mpairs, cpairs = _maps_work(kw["blocks"][None], L=big, block_size=bs,
                                                     masked_ok=True)[0]
            pairs = max(mpairs + cpairs, 1.0)
            factors.append((max((fm - calls * f_call - full * f_unit) / (pairs * f_unit), 0.05),
                            max((bm - calls * b_call - full * b_unit) / (pairs * b_unit), 0.05)))
        (f_causal, b_causal), (f_masked, b_masked) = factors
        o = torch.randn(1, H, big, D, generator=g)
        lse_ = torch.randn(1, H, big, generator=g)
        row = _best(lambda: merge(o, lse_, o, lse_), repeats, cpu) / (H * big * D)
        per = H * D
        fields = dict(fwd_flops=FWD_FLOPS_PER_PAIR * per / f_unit,
                      bwd_flops=BWD_FLOPS_PER_PAIR * per / b_unit, call_s=f_call,
                      bwd_call_s=b_call, masked=float(f_masked), bwd_masked=float(b_masked),
                      causal=float(f_causal), bwd_causal=float(b_causal), row_s=row)
    finally:
        torch.set_num_threads(old)
    return fields


def _gloo_probe(rank: int, world_size: int, size: int = 1 << 20, reps: int = 5):
    """(latency s, bandwidth B/s) of gloo between ranks 0 and 1 (halved round trips)."""
    import torch.distributed as dist
    torch.set_num_threads(1)
    peer = 1 - rank

    def round_trip(x):
        if rank == 0:
            dist.send(x, peer)
            dist.recv(x, peer)
        else:
            dist.recv(x, peer)
            dist.send(x, peer)
    tiny, big = torch.zeros(1), torch.zeros(size)
    lat = _best(lambda: round_trip(tiny), reps) / 2
    t = _best(lambda: round_trip(big), reps) / 2
    return lat, big.numel() * 4 / max(t - lat, 1e-9)
