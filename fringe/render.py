"""Looking at plans: the step × rank grid as text, tile maps, timelines.

``table(plan)`` is the sketch of who computes which tile and what moves where at each step;
``tile_map(plan)`` shows the (q chunk, kv chunk) tiles and the step that computes each;
``timeline(records)`` draws measured or simulated per-rank compute / wait bars (matplotlib);
``chrome_trace(records)`` writes the same as a trace for chrome://tracing or Perfetto.
"""
from __future__ import annotations

from typing import Sequence

from .schedules.ir import Compute, GradCompute, Program, Recv, Send

_KIND = {0: ".", 1: "p", 2: "F"}


def _cell(ops) -> str:
    order = {Recv: 0, Compute: 1, GradCompute: 1, Send: 2}
    return "\n".join(str(op) for op in sorted(ops, key=lambda op: (order[type(op)], str(op))))


def grid(programs: Sequence[Program], *, fmt: str = "simple_grid") -> str:
    """The step × rank grid of a list of programs (one per rank)."""
    from tabulate import tabulate
    steps = sorted({s.index for p in programs for s in p.steps})
    by = [{s.index: s for s in p.steps} for p in programs]
    rows = [[f"t{t}"] + [_cell(by[r][t].ops) if t in by[r] else "" for r in range(len(programs))]
            for t in steps]
    return tabulate(rows, headers=["step"] + [f"rank {r}" for r in range(len(programs))],
                    tablefmt=fmt)


def table(plan, *, backward: bool = False, fmt: str = "simple_grid") -> str:
    """The plan's forward (or backward) programs as a step × rank grid."""
    head = (f"{plan.schedule.name} · {getattr(plan.mask_mod, '__name__', 'mask')} · "
            f"S={plan.seq_len} P={plan.world_size} block={plan.block_size} · "
            f"{'backward (kv=' + plan.kv + ')' if backward else 'forward'}")
    return head + "\n" + grid(plan.backward if backward else plan.forward, fmt=fmt)


def tile_map(plan) -> str:
    """P × P map: tile kind (F full, p partial, . empty) and the forward step computing it.

    Rows are q of rank i, columns kv of rank j.
    """
    P = plan.world_size
    when = {}
    for prog in plan.forward:
        for t, op in prog.ops():
            if isinstance(op, Compute):
                when[(op.q, op.kv)] = t
    lines = ["q\\kv " + " ".join(f"{j:>4}" for j in range(P))]
    for i in range(P):
        cells = []
        for j in range(P):
            kind = _KIND[int(plan.tiles[i, j])]
            cells.append(f"{kind}{when[(i, j)]:>3}" if (i, j) in when else f"{kind:>4}")
        lines.append(f"{i:>4} " + " ".join(cells))
    return "\n".join(lines)


def block_map(plan, *, max_size: int = 64) -> str:
    """The mask's block classification in layout order (first ``max_size`` blocks)."""
    b = plan.blocks[:max_size, :max_size]
    n = plan.local_len // plan.block_size
    out = []
    for i, row in enumerate(b.tolist()):
        if i and i % n == 0:
            out.append("")
        out.append(" ".join("".join(_KIND[c] for c in row[j:j + n]) for j in range(0, len(row), n)))
    return "\n".join(out)


def timeline(records, *, ax=None, title: str | None = None):
    """Draw per-rank compute (blue) and exposed wait (red) bars from ``StepRecord`` lists.

    Args:
        records: iterable of :class:`fringe.runtime.StepRecord` (from any rank).
        ax: a matplotlib Axes (created if None).

    Returns:
        The Axes.
    """
    import matplotlib
    if ax is None:
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        _, ax = plt.subplots(figsize=(8, 3))
    clock: dict[int, float] = {}
    for rec in sorted(records, key=lambda r: (r.rank, r.step)):
        t0 = clock.get(rec.rank, 0.0)
        ax.barh(rec.rank, rec.compute_s, left=t0, color="tab:blue")
        ax.barh(rec.rank, rec.wait_s, left=t0 + rec.compute_s, color="tab:red")
        clock[rec.rank] = t0 + rec.compute_s + rec.wait_s
    ax.set_xlabel("seconds")
    ax.set_ylabel("rank")
    ax.invert_yaxis()
    if title:
        ax.set_title(title)
    return ax


def chrome_trace(records, path=None) -> dict:
    """Per-rank compute and exposed-wait spans as a Chrome trace (``chrome://tracing``, Perfetto).

    Args:
        records: :class:`fringe.runtime.StepRecord` values from any ranks (e.g. gathered
            ``fringe.last_run()`` records).
        path: where to write the JSON; not written when None.

    Returns:
        The trace as a dict (``{"traceEvents": [...]}``); one process per rank, spans laid
        end to end in step order, in microseconds.
    """
    import json
    events, clock = [], {}
    for rec in sorted(records, key=lambda r: (r.rank, r.step)):
        t0 = clock.get(rec.rank, 0.0)
        for name, dur in ((f"compute t{rec.step} ({rec.tiles} tiles)", rec.compute_s),
                          (f"wait t{rec.step} ({rec.recv_bytes:,} B in)", rec.wait_s)):
            events.append(dict(name=name, ph="X", pid=rec.rank, tid=0, ts=t0 * 1e6,
                               dur=dur * 1e6, cat="wait" if name.startswith("wait") else "compute"))
            t0 += dur
        clock[rec.rank] = t0
    trace = {"traceEvents": events, "displayTimeUnit": "ms"}
    if path is not None:
        with open(path, "w") as f:
            json.dump(trace, f)
    return trace
