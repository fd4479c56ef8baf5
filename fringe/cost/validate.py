"""Validate the cost model against measured runs on spawned gloo ranks.

The tools layer of the cost model (it spawns workers through :mod:`fringe.launch` and plans
with :func:`fringe.plan`).
"""
from __future__ import annotations

import statistics
import time
from typing import Sequence

import torch

from .. import masks as _masks
from .. import schedules as _schedules
from ..api import attention, last_run
from .._data import packed_docs
from ..launch import Workers
from ..plan import plan as make_plan
from .calibrate import get_hardware
from .hardware import Hardware, Shape
from .simulate import simulate

__all__ = ["validate"]


def _validation_plan(schedule: str, mask: str, seq_len: int, world_size: int, block_size: int,
                     n_docs: int):
    m = _masks.causal()
    if mask == "document":
        m = m & _masks.document(packed_docs(seq_len, n_docs, 1))
    elif mask != "causal":
        raise ValueError(f"validation mask must be 'causal' or 'document', got {mask!r}")
    return make_plan(_schedules.get(schedule), m, seq_len=seq_len, world_size=world_size,
                     block_size=block_size)


def _measure_worker(rank: int, world_size: int, cases: list, shape: Shape, iters: int):
    """Per case: the median over ``iters`` of this rank's (fwd, bwd) interpreter seconds."""
    torch.set_num_threads(1)
    out = []
    dt = getattr(torch, shape.dtype)
    for schedule, mask, S, block_size, n_docs in cases:
        p = _validation_plan(schedule, mask, S, world_size, block_size, n_docs)
        g = torch.Generator().manual_seed(0)
        q = torch.randn(shape.batch, shape.heads, S, shape.head_dim, generator=g, dtype=dt)
        k, v = (torch.randn(shape.batch, shape.kv_heads, S, d, generator=g, dtype=dt)
                for d in (shape.head_dim, shape.v_head_dim or shape.head_dim))
        q, k, v = (p.layout.shard(t, rank).requires_grad_() for t in (q, k, v))
        fwd, bwd, cpu = [], [], []
        for it in range(iters + 1):
            c0 = time.thread_time()                 # this rank's compute (gloo runs elsewhere)
            attention(q, k, v, plan=p).sum().backward()
            c1 = time.thread_time()
            s = last_run().summary()
            if it:                                              # the first call warms up
                fwd.append(s["forward"]["compute_s"] + s["forward"]["wait_s"])
                bwd.append(s["backward"]["compute_s"] + s["backward"]["wait_s"])
                cpu.append(c1 - c0)
        out.append((statistics.median(fwd), statistics.median(bwd), statistics.median(cpu)))
    return out


def validate(*, world_size: int = 2, seq_len: int = 8192, block_size: int = 128,
             schedules: Sequence[str] = ("ring", "zigzag", "striped", "balanced"),
             masks: Sequence[str] = ("causal", "document"), n_docs: int = 16,
             shape: Shape = Shape(heads=8, kv_heads=8, head_dim=64, dtype="float32"),
             hardware: str | Hardware = "cpu", iters: int = 3) -> list[dict]:
    """Predicted vs measured forward + backward on spawned gloo ranks (one thread each).

    Measured: each rank's interpreter time (compute + waits, from ``fringe.last_run()``),
    median over ``iters`` calls after a warm-up, slowest rank; and the CPU time of each rank's
    main thread over the call (its compute, which other processes on a shared machine do not
    inflate the way they inflate wall-clock). Predicted: the same spans, and the busiest
    rank's compute, from :func:`simulate`. Use ``world_size`` at most the number of free cores.

    Returns:
        One dict per (schedule, mask): predicted and measured seconds and the relative error.
    """
    hw = get_hardware(hardware)
    cases = [(s, m, seq_len, block_size, n_docs) for s in schedules for m in masks]
    with Workers(world_size, timeout_s=600, threads=1) as w:
        res = [w.run(_measure_worker, [case], shape, iters) for case in cases]  # a call a case
    rows = []
    for c, case in enumerate(cases):
        pred = simulate(_validation_plan(*case[:2], seq_len, world_size, block_size, n_docs), hw,
                        shape)
        mf = max(r[0][0] for r in res[c])
        mb = max(r[0][1] for r in res[c])
        mc = max(r[0][2] for r in res[c])
        pc = float((pred.totals["forward"]["compute"] + pred.totals["backward"]["compute"]).max())
        rows.append(dict(schedule=case[0], mask=case[1], predicted_s=pred.step_s,
                         measured_s=mf + mb, error=pred.step_s / (mf + mb) - 1,
                         predicted_fwd_s=pred.forward_s, measured_fwd_s=mf,
                         predicted_bwd_s=pred.backward_s, measured_bwd_s=mb,
                         predicted_compute_s=pc, measured_cpu_s=mc, compute_error=pc / mc - 1))
    return rows
