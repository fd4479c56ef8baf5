"""Looking at plans: the step × rank grid as text, tile maps, timelines.

``table(plan)`` is the sketch of who computes which tile and what moves where at each step;
``tile_map(plan)`` shows the (q chunk, kv chunk) tiles and the step that computes each;
``timeline(records)`` draws measured or simulated per-rank compute / wait bars (matplotlib);
``chrome_trace(records)`` writes the same as a trace for chrome://tracing or Perfetto.

Figures: ``tile_map_figure(plan)`` colours the S×S block grid by the rank and the step that
computes each block (PARTIAL blocks hatched); ``timeline_figure(source)`` draws compute,
exposed communication and idle time per rank and step, from measured records or from a cost
model :class:`~fringe.runtime.costmodel.Prediction`, and aggregates rows and time when P is
large. Both return a ``matplotlib.figure.Figure`` (shown inline by Jupyter, saved with
``fig.savefig``) and never touch pyplot or the global backend.
"""
from __future__ import annotations

from typing import Sequence

from .masks import BlockKind
from .schedules.ir import Collective, Compute, GradCompute, Program, Recv, Send

_KIND = {0: ".", 1: "p", 2: "F"}


def _cell(ops) -> str:
    order = {Collective: 0, Recv: 0, Compute: 1, GradCompute: 1, Send: 2}
    return "\n".join(op.brief() if isinstance(op, Collective) else str(op)
                     for op in sorted(ops, key=lambda op: (order[type(op)], str(op))))


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
    b = plan.block_map.dense(rows=(0, max_size), cols=(0, max_size))
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
        The Axes (``ax.figure`` is the Figure; no pyplot state or backend is touched).
    """
    if ax is None:
        from matplotlib.figure import Figure
        ax = Figure(figsize=(8, 3), layout="constrained").add_subplot()
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


# ---- figures -----------------------------------------------------------------------------------

def _who(plan) -> tuple:
    """``[P, P]`` rank and forward step computing each tile (q of i, kv of j); -1 if none."""
    import numpy as np
    P = plan.world_size
    rank = np.full((P, P), -1)
    step = np.full((P, P), -1)
    for prog in plan.forward:
        for s in prog.steps:
            for op in s.computes:
                rank[op.q, op.kv] = prog.rank
                step[op.q, op.kv] = s.index
    return rank, step


def tile_map_figure(plan, *, max_blocks: int = 256, title: str | None = None):
    """The S×S block grid in sequence order, coloured by the rank and step computing each block.

    Left: the rank whose program computes the block; right: the forward step. EMPTY blocks
    are white; PARTIAL blocks are hatched. Grids wider than ``max_blocks`` are sampled every
    ``ceil(S/block / max_blocks)`` blocks (the title says so).

    Args:
        plan: from :func:`fringe.plan`.
        max_blocks: the most blocks drawn along each axis.
        title: figure title (default: schedule, mask, S, P, block).

    Returns:
        A ``matplotlib.figure.Figure``.
    """
    import numpy as np
    from matplotlib import colormaps
    from matplotlib.figure import Figure
    P, bs, L = plan.world_size, plan.block_size, plan.local_len
    n = L // bs
    nb = plan.seq_len // bs
    rank_t, step_t = _who(plan)
    owner = np.arange(nb) // n                              # layout-order block -> rank chunk
    starts = plan.layout.order.view(-1, bs)[:, 0].numpy()
    aligned = bool((starts % bs == 0).all()) and len(np.unique(starts // bs)) == nb
    perm = np.argsort(starts // bs) if aligned else np.arange(nb)   # sequence order of blocks
    stride = max(1, -(-nb // max_blocks))
    idx = perm[::stride]
    sub = plan.block_map.take(idx, idx).numpy()
    rank_img = rank_t[np.ix_(owner[idx], owner[idx])].astype(float)
    step_img = step_t[np.ix_(owner[idx], owner[idx])].astype(float)
    empty = sub == int(BlockKind.EMPTY)
    rank_img[empty] = np.nan
    step_img[empty] = np.nan
    fig = Figure(figsize=(11, 5), layout="constrained")
    axes = fig.subplots(1, 2)
    for ax, img, label, cmap in ((axes[0], rank_img, "rank computing the block", "tab20"),
                                 (axes[1], step_img, "forward step", "viridis")):
        discrete = cmap == "tab20" and P <= 20            # one colour per rank
        if cmap == "tab20":
            cmap = ("tab10" if P <= 10 else "tab20") if discrete else "turbo"
        cm = colormaps[cmap]
        cm = (cm.resampled(P) if discrete else cm).with_extremes(bad="white")
        extent = (0, len(idx) * stride, len(idx) * stride, 0)
        im = ax.imshow(np.ma.masked_invalid(img), cmap=cm, interpolation="nearest",
                       extent=extent, vmin=-0.5 if discrete else None,
                       vmax=(P - 0.5 if discrete else None))
        partial = (sub == int(BlockKind.PARTIAL)).astype(float)
        if partial.any() and len(idx) <= 512:
            xs = (np.arange(len(idx)) + 0.5) * stride
            ax.contourf(xs, xs, partial, levels=[0.5, 1.5], colors="none", hatches=["////"])
        ax.set_xlabel("kv block (sequence order)")
        ax.set_ylabel("q block (sequence order)")
        fig.colorbar(im, ax=ax, label=label, shrink=0.8,
                     ticks=range(P) if discrete else None)
    mask = getattr(plan.mask_mod, "__name__", "mask")
    note = f" · every {stride}th block" if stride > 1 else ""
    note += "" if aligned else " · layout order (blocks not aligned)"
    fig.suptitle(title or f"{plan.schedule.name} · {mask} · S={plan.seq_len:,} P={P} "
                 f"block={bs}{note} · hatched: PARTIAL")
    return fig


def _is_prediction(source) -> bool:
    """A cost model Prediction (read by its fields: render sits beside the cost model)."""
    return hasattr(source, "totals") and hasattr(source, "timelines")


def _arrays(source, which: str):
    """``(compute [P, T], wait [P, T], active [P, T])`` from a Prediction or StepRecords."""
    import numpy as np
    if _is_prediction(source):
        return source.compute[which], source.wait[which], source.active[which]
    recs = list(source)
    if not recs:
        raise ValueError("timeline_figure needs StepRecords or a costmodel.Prediction; got none")
    ranks = sorted({r.rank for r in recs})
    steps = sorted({r.step for r in recs})
    si = {s: i for i, s in enumerate(steps)}
    P, T = max(ranks) + 1, len(steps)
    comp, wait, act = np.zeros((P, T)), np.zeros((P, T)), np.zeros((P, T), dtype=bool)
    for r in recs:
        comp[r.rank, si[r.step]] = r.compute_s
        wait[r.rank, si[r.step]] = r.wait_s
        act[r.rank, si[r.step]] = True
    return comp, wait, act


def timeline_figure(source, *, which: str | Sequence[str] = ("forward", "backward"),
                    max_ranks: int = 32, bins: int = 400, title: str | None = None):
    """Per-rank compute (blue), exposed communication (red) and idle (grey) over time.

    Args:
        source: a :class:`~fringe.runtime.costmodel.Prediction`, or an iterable of
            ``StepRecord`` (e.g. ``fringe.last_run().forward`` gathered from every rank, or
            the records of :func:`fringe.simulate.forward_states`); records draw one panel.
        which: for a Prediction, ``"forward"``, ``"backward"`` or both (one panel each).
        max_ranks: up to this many ranks one bar row per rank and step; above it ranks are
            pooled into ``max_ranks`` rows and time into ``bins`` columns, each cell coloured
            by the share of compute, exposed communication and idle in it.
        bins: time columns of the pooled view.
        title: figure title.

    Returns:
        A ``matplotlib.figure.Figure``.
    """
    import numpy as np
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch
    is_pred = _is_prediction(source)
    if is_pred:
        whichs = (which,) if isinstance(which, str) else tuple(which)
        bad = [w for w in whichs if w not in ("forward", "backward")]
        if bad:
            raise ValueError(f"which must be 'forward' and/or 'backward', got {bad}")
        panels = [(w, *_arrays(source, w)) for w in whichs]
    else:
        panels = [("", *_arrays(source, "forward"))]
    fig = Figure(figsize=(10, 1.2 + 2.6 * len(panels)), layout="constrained")
    axes = fig.subplots(len(panels), 1, squeeze=False)[:, 0]
    colors = {"compute": (0.12, 0.47, 0.71), "wait": (0.84, 0.15, 0.16), "idle": (0.88, 0.88, 0.88)}
    for ax, (name, comp, wait, act) in zip(axes, panels):
        P, T = comp.shape
        ends = np.cumsum(np.stack([comp, wait], axis=2).reshape(P, 2 * T), axis=1)
        span = float(ends[:, -1].max()) if ends.size else 0.0
        if P <= max_ranks:
            for r in range(P):
                starts = np.concatenate([[0.0], ends[r, :-1]]).reshape(T, 2)
                durs = np.stack([comp[r], wait[r]], axis=1)
                for kind, col in ((0, "compute"), (1, "wait")):
                    segs = [(float(a), float(d)) for a, d, on in
                            zip(starts[:, kind], durs[:, kind], act[r]) if on and d > 0]
                    if segs:
                        ax.broken_barh(segs, (r - 0.4, 0.8), color=colors[col])
                if span > ends[r, -1]:
                    ax.broken_barh([(float(ends[r, -1]), span - float(ends[r, -1]))],
                                   (r - 0.4, 0.8), color=colors["idle"])
            ax.set_ylim(P - 0.5, -0.5)
            ax.set_ylabel("rank")
        else:
            edges = np.linspace(0.0, span, bins + 1)
            rows = np.array_split(np.arange(P), max_ranks)
            img = np.zeros((len(rows), bins, 3))
            for g, members in enumerate(rows):
                acc = np.zeros((2, bins))
                for r in members:
                    x = np.concatenate([[0.0], ends[r]])
                    cum_c = np.concatenate([[0.0], np.cumsum(np.stack([comp[r], np.zeros(T)], 1)
                                                             .reshape(-1))])
                    cum_w = np.concatenate([[0.0], np.cumsum(np.stack([np.zeros(T), wait[r]], 1)
                                                             .reshape(-1))])
                    acc[0] += np.diff(np.interp(edges, x, cum_c))
                    acc[1] += np.diff(np.interp(edges, x, cum_w))
                width = np.diff(edges) * len(members)
                fc = np.divide(acc[0], width, out=np.zeros(bins), where=width > 0)
                fw = np.divide(acc[1], width, out=np.zeros(bins), where=width > 0)
                fi = np.clip(1 - fc - fw, 0, 1)
                img[g] = (fc[:, None] * colors["compute"] + fw[:, None] * colors["wait"]
                          + fi[:, None] * np.array(colors["idle"]))
            ax.imshow(img, aspect="auto", interpolation="nearest",
                      extent=(0, span, P - 0.5, -0.5))
            ax.set_ylabel(f"rank ({len(rows)} rows of ~{P // len(rows)} ranks, averaged)")
        ax.set_xlim(0, span or 1.0)
        ax.set_xlabel("seconds")
        if name:
            ax.set_title(name, loc="left", fontsize=10)
    axes[0].legend(handles=[Patch(color=colors[k], label=lbl) for k, lbl in
                            (("compute", "compute"), ("wait", "exposed communication"),
                             ("idle", "idle (done, waiting for the slowest rank)"))],
                   loc="upper right", fontsize=8, ncols=3)
    if title or is_pred:
        fig.suptitle(title or f"{source.name} · P={source.world_size} · S={source.seq_len:,} · "
                     f"{source.hardware.name} · predicted {source.step_s * 1e3:.3g} ms")
    return fig


def save_png(fig, path: str, *, dpi: int = 120) -> None:
    """``fig.savefig(path)``, or a ``ValueError`` that says which file could not be written
    and why (a missing or read-only directory, a directory of that name, a full disk) instead
    of the ``OSError`` from deep inside matplotlib."""
    try:
        fig.savefig(path, dpi=dpi)
    except OSError as e:
        raise ValueError(f"could not write {path!r} ({e.strerror or e}); give --png a file in a "
                         f"directory that exists and can be written") from None
