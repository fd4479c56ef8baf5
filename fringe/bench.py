"""``python -m fringe bench``: measured figures, printed beside their targets.

Speed and memory live here, never in the tests. Three measurements:

1. **plan**: planning cost for a large packed-document batch (masks change every batch,
   so a plan must be cheap): S = 1,048,576 tokens, 1,000 documents, P = 8 and 1,024,
   block 128 and 64, every registered schedule that runs at that P with H=32, G=8
   (:data:`PLAN_HEADS`; ``fringe.schedules.names``): seconds (the target's figure), CPU
   seconds of the process (what a shared machine does not inflate), and peak memory above
   the process's resident memory before the plan (Linux: the peak is reset through
   ``/proc/self/clear_refs`` after the C heap's free pages are given back, so plans made
   one after another each count their own memory).
2. **attention**: forward + backward of one attention call on P gloo CPU ranks for a
   ``causal & document`` mask, against the same work on one process (fringe with P = 1, and
   torch's dense ``scaled_dot_product_attention`` with a bool mask).
3. **exposed communication**: time ranks wait for transfers after their compute, as a
   fraction of (compute + wait), recorded by the interpreter on every step.

Targets are what we hold ourselves to on a 2-core CPU box; a figure that misses its target is
marked ``MISS`` (the command still exits 0: it measures, it does not test).
"""
from __future__ import annotations

import dataclasses
import gc
import os
import statistics
import time

import torch

from . import masks, schedules, simulate
from ._data import packed_docs as packed_docs  # moved to a leaf every layer may read
from .api import attention, last_run
from .launch import Workers
from .plan import plan as make_plan
from .runtime.distributed import DistRuntime
from .schedules import registry

PLAN_TARGET_S = {128: 1.0, 64: 2.0}   # 1M-token plan, one core, by block size
PLAN_TARGET_MB = 300.0       # peak memory of one plan above the resident memory before it
EXPOSED_TARGET = 0.25        # forward wait / (compute + wait) while P <= cores
SPEEDUP_TARGET = 1.25        # P-rank CP step vs one process doing all the work, P <= cores
PLAN_HEADS = (32, 8)         # H, G the planning benchmark assumes (Llama-3-8B): where ulysses runs
# The backward has T+1 steps for T forward steps: its first step fetches the kv the last
# ranks need (kv="resend") and nothing local is left to compute in its last step while the
# final dkv comes home, so about 1/(T+1) of it is exposed by construction; it is printed
# without a target.


def _status_mb(key: str) -> float | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def _release_free_memory() -> None:
    """Give the C heap's free pages back to the system (glibc ``malloc_trim``; elsewhere a
    no-op), so that memory an earlier plan freed but the allocator kept is not counted as
    resident before the next one (which would reuse it unseen: a later plan's peak read
    tens of MB low)."""
    try:
        import ctypes
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError, TypeError):
        pass


def peak_mb(fn):
    """``(fn(), peak MB above the resident memory before the call)``; the peak is None where
    the kernel's peak counter cannot be reset (not Linux)."""
    gc.collect()
    _release_free_memory()
    try:
        with open("/proc/self/clear_refs", "w") as f:     # VmHWM := VmRSS
            f.write("5")
        base = _status_mb("VmRSS")
    except OSError:
        base = None
    out = fn()
    peak = _status_mb("VmHWM")
    return out, (None if base is None or peak is None else max(0.0, peak - base))


def bench_plan(*, S: int = 1 << 20, n_docs: int = 1000, P: int = 8, block_size: int = 128,
               schedule_names=None):
    """Plan each schedule for a ``causal & document`` mask; one row (seconds, CPU seconds of
    this process, peak MB, share of empty blocks, work max/mean from :meth:`Plan.stats`, which
    reads the programs' columns and costs little at P = 1024) per schedule.
    ``schedule_names``: registry names; default every registered schedule that runs on P
    ranks with :data:`PLAN_HEADS` heads."""
    if schedule_names is None:
        schedule_names = registry.names(world_size=P, heads=PLAN_HEADS[0], kv_heads=PLAN_HEADS[1])
    ids = packed_docs(S, n_docs, 0)
    mask = masks.causal() & masks.document(ids)
    rows = []
    threads = torch.get_num_threads()
    torch.set_num_threads(1)                 # the targets are for one core; restored below
    try:
        for name in schedule_names:
            def timed():            # the plan alone (not peak_mb's collection and trim)
                t0, c0 = time.perf_counter(), time.process_time()
                p = make_plan(schedules.get(name), mask, seq_len=S, world_size=P,
                              block_size=block_size)
                return p, time.perf_counter() - t0, time.process_time() - c0
            (p, dt, cpu), peak = peak_mb(timed)
            empty = p.block_map.count(masks.BlockKind.EMPTY) / (S // block_size) ** 2
            rows.append(dict(schedule=name, P=P, block=block_size, seconds=dt, cpu_s=cpu,
                             peak_mb=peak, empty_blocks=empty, balance=p.stats().balance))
            del p
    finally:
        torch.set_num_threads(threads)
    return rows


@dataclasses.dataclass(frozen=True)
class AttnCase:
    """The attention benchmark's sizes; ``schedule`` is a registry name
    (``fringe.schedules.get``: ``"zigzag"``, ``"allgather:4"``, ``"compose:zigzag+ulysses:2"``)."""

    schedule: str = "zigzag"
    seq_len: int = 8192
    heads: int = 8
    kv_heads: int = 8
    head_dim: int = 64
    n_docs: int = 16
    block_size: int = 128
    iters: int = 3


def _qkv(case: AttnCase):
    g = torch.Generator().manual_seed(0)
    S, H, G, D = case.seq_len, case.heads, case.kv_heads, case.head_dim
    return (torch.randn(1, H, S, D, generator=g), torch.randn(1, G, S, D, generator=g),
            torch.randn(1, G, S, D, generator=g))


def _time(fn, iters: int) -> float:
    fn()                                            # warm up (plans, caches, allocator)
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _worker(rank: int, world_size: int, case: AttnCase):
    mask = masks.causal() & masks.document(packed_docs(case.seq_len, case.n_docs, 1))
    p = make_plan(schedules.get(case.schedule), mask, seq_len=case.seq_len,
                  world_size=world_size, block_size=case.block_size)
    q, k, v = (p.layout.shard(t, rank).requires_grad_() for t in _qkv(case))

    def step():
        out = attention(q, k, v, plan=p)
        out.sum().backward()
    dt = _time(step, case.iters)
    s = last_run().summary()
    rt = DistRuntime(None)
    agree_s = _time(lambda: [rt.agree(p, q, k, v) for _ in range(AGREE_CALLS)], 1) / AGREE_CALLS
    return dict(seconds=dt, exposed_fwd=s["forward"]["exposed"],
                exposed_bwd=s["backward"]["exposed"], agree_s=agree_s)


def _single(case: AttnCase):
    """One process: fringe with P=1 (block-sparse) and torch's dense SDPA with a bool mask."""
    mask = masks.causal() & masks.document(packed_docs(case.seq_len, case.n_docs, 1))
    p1 = make_plan(schedules.ring(), mask, seq_len=case.seq_len, world_size=1,
                   block_size=case.block_size)
    q, k, v = (t.requires_grad_() for t in _qkv(case))

    def fringe_step():
        simulate.attention(q, k, v, plan=p1).sum().backward()
    dense_mask = masks.evaluate(mask, torch.arange(case.seq_len), torch.arange(case.seq_len))

    def dense_step():
        torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=dense_mask).sum().backward()
    return _time(fringe_step, case.iters), _time(dense_step, case.iters)


AGREE_CALLS = 20             # agreement exchanges timed per rank (fringe.attention runs one per call)
PLAN_WORLD_SIZES = (8, 1024)  # the planning benchmark's world sizes and blocks
PLAN_BLOCKS = (128, 64)
PLAN_DOCS = 1000


def _multiple(S: int, unit: int) -> int:
    return -(-S // unit) * unit


def check_sizes(*, world_sizes, case: AttnCase, plan_size: int,
                plan_world_sizes=PLAN_WORLD_SIZES) -> None:
    """Fail before any work (and before spawning ranks) on sizes the benchmark cannot use.

    Every schedule must fit, so S must split into 2·P chunks of whole blocks (zigzag's rule).

    Raises:
        ValueError: naming the size, the rule and the nearest size that fits.
    """
    plan_world_sizes = tuple(plan_world_sizes)
    for P in plan_world_sizes:
        if isinstance(P, bool) or not hasattr(P, "__index__") or P < 1:
            raise ValueError(f"plan world sizes must be positive integers, got {P!r}")
    P, bs = max(plan_world_sizes, default=1), max(PLAN_BLOCKS)
    unit = 2 * P * bs
    if plan_size < 1 or plan_size % unit:
        raise ValueError(f"plan_size={plan_size} is not a positive multiple of 2*P*block="
                         f"2*{P}*{bs}={unit} (the planning benchmark's largest P and "
                         f"block); use {_multiple(max(plan_size, 1), unit)}")
    if not world_sizes:
        raise ValueError("world_sizes is empty; give at least one P, e.g. (2, 4)")
    for P in world_sizes:
        if isinstance(P, bool) or not hasattr(P, "__index__") or P < 1:
            raise ValueError(f"world sizes must be positive integers, got {P!r}")
    for name in ("seq_len", "heads", "kv_heads", "head_dim", "n_docs", "block_size", "iters"):
        value = getattr(case, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"AttnCase.{name} must be a positive integer, got {value!r}")
    if case.heads % case.kv_heads:
        raise ValueError(f"AttnCase.heads={case.heads} must be a multiple of "
                         f"kv_heads={case.kv_heads} (GQA)")
    for P in world_sizes:                   # an unknown name raises here, listing the valid ones
        where = dict(world_size=P, heads=case.heads, kv_heads=case.kv_heads)
        reason = registry.why_not(case.schedule, **where)
        if reason:
            raise ValueError(f"AttnCase.schedule={case.schedule!r} cannot run on P={P} with "
                             f"H={case.heads}, G={case.kv_heads}: {reason}; these can: "
                             f"{registry.names(**where)}")
    if case.n_docs > case.seq_len:
        raise ValueError(f"AttnCase.n_docs={case.n_docs} documents do not fit in "
                         f"seq_len={case.seq_len} tokens")
    for P in (1, *world_sizes):
        unit = 2 * P * case.block_size
        if case.seq_len % unit:
            raise ValueError(f"seq_len={case.seq_len} is not divisible by 2*P*block="
                             f"2*{P}*{case.block_size}={unit}; use "
                             f"{_multiple(case.seq_len, unit)} (or other world sizes)")


def run(*, world_sizes=(2, 4), case: AttnCase = AttnCase(), plan_size: int = 1 << 20,
        plan_world_sizes=PLAN_WORLD_SIZES) -> str:
    """Run the benchmark and return the report text.

    Raises:
        ValueError: sizes the benchmark cannot use (see :func:`check_sizes`), before any work.
        fringe.launch.LaunchError: a rank failed.
    """
    from tabulate import tabulate

    world_sizes = tuple(world_sizes)
    check_sizes(world_sizes=world_sizes, case=case, plan_size=plan_size,
                plan_world_sizes=plan_world_sizes)
    out = []
    rows = [r for P in plan_world_sizes for bs in PLAN_BLOCKS
            for r in bench_plan(S=plan_size, n_docs=min(PLAN_DOCS, plan_size), P=P,
                                block_size=bs)]
    targets = ", ".join(f"< {PLAN_TARGET_S[bs]:g} s at block {bs}" for bs in PLAN_BLOCKS)
    out.append(f"plan: S={plan_size:,} tokens, {min(PLAN_DOCS, plan_size):,} packed documents, "
               f"causal & document (targets: {targets}, peak < {PLAN_TARGET_MB:g} MB above "
               f"the resident memory before planning)")
    table = []
    for r in rows:
        ok = r["seconds"] < PLAN_TARGET_S[r["block"]] and \
            (r["peak_mb"] is None or r["peak_mb"] < PLAN_TARGET_MB)
        table.append([r["schedule"], r["P"], r["block"], f"{r['seconds']:.2f}",
                      f"{r['cpu_s']:.2f}", "n/a" if r["peak_mb"] is None else f"{r['peak_mb']:.0f}",
                      f"{r['empty_blocks']:.1%}", f"{r['balance']:.3f}", "ok" if ok else "MISS"])
    out.append(tabulate(table, headers=["schedule", "P", "block", "seconds", "cpu s", "peak MB",
                                        "empty blocks", "work max/mean", "target"]))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)                 # like one rank; restored below
    try:
        single_fringe, single_dense = _single(case)
    finally:
        torch.set_num_threads(threads)
    out.append("")
    out.append(f"attention fwd+bwd: S={case.seq_len:,}, H={case.heads}, G={case.kv_heads}, "
               f"D={case.head_dim}, float32, causal & document ({case.n_docs} docs), "
               f"{case.schedule}, 1 thread per rank, median of {case.iters}")
    table = [["1 process, dense SDPA + bool mask", 1, f"{single_dense:.3f}", "", "", ""],
             ["1 process, fringe (block-sparse)", 1, f"{single_fringe:.3f}", "", "", ""]]
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    agree = []
    for P in world_sizes:
        with Workers(P, timeout_s=300, threads=1) as w:
            res = w.run(_worker, case)
        slowest = max(r["seconds"] for r in res)
        agree.append((P, max(r["agree_s"] for r in res)))
        fwd = max(r["exposed_fwd"] for r in res)
        bwd = max(r["exposed_bwd"] for r in res)
        speedup = single_fringe / slowest
        if P <= cores:
            target = (f"speedup >= {SPEEDUP_TARGET:g}: "
                      f"{'ok' if speedup >= SPEEDUP_TARGET else 'MISS'}; fwd exposed <= "
                      f"{EXPOSED_TARGET:g}: {'ok' if fwd <= EXPOSED_TARGET else 'MISS'}")
        else:
            target = f"none: P={P} > {cores} cores, waits include waiting for a core"
        table.append([f"{P} gloo ranks, fringe", P, f"{slowest:.3f}", f"{speedup:.2f}x",
                      f"{fwd:.2f} / {bwd:.2f}", target])
    out.append(tabulate(table, headers=["run", "P", "seconds", "vs 1-process fringe",
                                        "exposed comm fwd / bwd", "target"]))
    out.append("")
    out.append("agreement exchange (runs on every fringe.attention call; slowest rank, mean of "
               f"{AGREE_CALLS}): " + ", ".join(f"P={P} {1e3 * a:.2f} ms" for P, a in agree))
    return "\n".join(out)
