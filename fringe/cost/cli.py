"""``python -m fringe simulate`` / ``predict``: the cost model's command line, and the memory
checks the CLI runs before it plans or simulates.

The tools layer of the cost model (it plans with :func:`fringe.plan`, draws with
:mod:`fringe.render` and reads test data from :mod:`fringe.bench`); ``fringe.__main__`` imports
it lazily when the command runs.
"""
from __future__ import annotations

import gc
import os
import time

import torch
from tabulate import tabulate

from .. import masks, render
from .._data import packed_docs
from ..plan import plan as make_plan
from ..schedules import auto as auto_schedule, registry
from ..schedules.base import AUTO
from ..schedules.ir import ProgramTable
from . import calibrate
from .calibrate import get_hardware
from .hardware import Shape
from .simulate import simulate
from .work import tile_work_bytes

__all__ = ["available_memory", "check_memory", "check_plan_memory", "cli", "mask_from_spec",
           "memory_budget"]


def mask_from_spec(spec: str, seq_len: int):
    """``causal``, ``full``, ``document:N`` (causal within N packed documents, lengths drawn
    with seed 0 as in ``fringe.bench``) or ``window:W`` (causal sliding window of W tokens).

    Raises:
        ValueError: for anything else, saying what is accepted.
    """
    kind, _, arg = spec.partition(":")
    if kind in ("causal", "full") and not arg:
        return masks.causal() if kind == "causal" else None
    if kind in ("document", "window") and arg.isdigit() and int(arg) > 0:
        n = int(arg)
        if kind == "document":
            if n > seq_len:
                raise ValueError(f"--mask document:{n}: more documents than tokens (S={seq_len})")
            return masks.causal() & masks.document(packed_docs(seq_len, n, 0))
        return masks.sliding_window(min(n, seq_len))    # wider than S: the same mask as S
    raise ValueError(f"--mask {spec!r} is not understood; use causal, full, document:N "
                     f"(N packed documents, e.g. document:1000) or window:W (e.g. window:4096)")


def available_memory() -> int | None:
    """Bytes of memory available to this process now: ``MemAvailable`` of /proc/meminfo, else
    free pages from ``os.sysconf`` (None when neither says)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


#: The default memory budget: this fraction of :func:`available_memory`.
MEMORY_FRACTION = 0.8
#: Bytes per token while a plan is made for the CLI: the mask's document ids (8) and the
#: layout's block classification (measured 33-39 B/token at S = 16M, P = 8, block 4096).
PLAN_BYTES_PER_TOKEN = 48
#: Bytes per token a plan keeps after it is made (measured 9-10 B/token, same runs).
KEPT_BYTES_PER_TOKEN = 10
#: Bytes per non-EMPTY tile for the programs and their columns that :func:`simulate` builds
#: (measured 880-960 B/tile: zigzag, causal, P = 1024 and 2048, S = 128 P).
BYTES_PER_TILE = 1024
#: Bytes per (rank, step) cell and per transfer row (of the larger direction) the simulator
#: adds at its peak. A cell: the ``[P, T]`` timelines when kept (``BYTES_PER_CELL``: compute,
#: tiles, sent, received, waits and ``active`` of both directions, ~82), else the ``active``
#: masks (``BYTES_PER_STEP_CELL``). A transfer: its cached bytes column, the step order, the
#: buffers' live-peak tables and a block's working arrays. Measured: 0.6 GB over the plan's
#: own for zigzag at P = 4,096 on documents without timelines (16.8M cells, T = 4,097, and
#: 16.8M transfers a direction: ~36 bytes for each pair; memray's high-water mark and RSS).
BYTES_PER_CELL = 84
BYTES_PER_STEP_CELL = 4
BYTES_PER_TRANSFER = 64


def _return_freed_memory() -> None:
    """Free the last schedule's plan now. A plan's tables and their op views hold each
    other, and the plan and its handle too (:mod:`fringe._handle`), so a dropped plan waits
    for the cycle collector, which numpy's arrays hardly prompt and the passes pause: without
    this, the next schedule's plan starts on the last one's 1.2 GB (zigzag at P=4,096), and
    the command's peak is the two together."""
    gc.collect()


def memory_budget(max_memory: int | None) -> tuple[int | None, str]:
    """``(bytes, said)``: ``max_memory``, or 80% of :func:`available_memory` (None when that
    cannot be read: no check)."""
    if max_memory is not None:
        return int(max_memory), f"--max-memory {_gib(max_memory)}"
    avail = available_memory()
    if avail is None:
        return None, ""
    return int(MEMORY_FRACTION * avail), f"{MEMORY_FRACTION:.0%} of the {_gib(avail)} available"


def _gib(nbytes: float) -> str:
    for unit, size in (("TiB", 2 ** 40), ("GiB", 2 ** 30), ("MiB", 2 ** 20), ("KiB", 2 ** 10)):
        if nbytes >= size:
            return f"{nbytes / size:.3g} {unit}"
    return f"{int(nbytes)} B"


def _over(need: int, how: str, budget: tuple[int | None, str], what: str, fix: str) -> None:
    limit, said = budget
    if limit is not None and need > limit:
        suggest = -(-need * 5 // 4 // 2 ** 30)        # GiB, rounded up, a quarter to spare
        raise MemoryError(
            f"{what} would need about {_gib(need)} ({how}), over the memory budget of "
            f"{_gib(limit)} ({said}); {fix}, or allow it with --max-memory {suggest}G")


def check_plan_memory(seq_len: int, budget: tuple[int | None, str], *,
                      flag: str = "--seq-len") -> None:
    """Before planning: raise ``MemoryError`` (one line: the estimate and ``--max-memory``)
    when making the mask and plan for ``seq_len`` tokens (given as ``flag``) would pass
    ``budget`` (from :func:`memory_budget`)."""
    _over(PLAN_BYTES_PER_TOKEN * int(seq_len),
          f"{PLAN_BYTES_PER_TOKEN} bytes x {int(seq_len):,} tokens to plan", budget,
          f"{flag} {seq_len}", f"use a smaller {flag}")


def check_memory(plan, budget: tuple[int | None, str], *, what: str,
                 timelines: bool = False) -> None:
    """Before :func:`simulate`: raise ``MemoryError`` (one line: the estimate and
    ``--max-memory``) when the plan kept, its programs and the cost model's tile work
    (:func:`tile_work_bytes`: linear in the PARTIAL tiles' rectangles) would pass ``budget``;
    ``timelines``: the prediction will keep its ``[P, T]`` timelines (``simulate(...,
    timelines=True)``, to draw them). Costs one pass over the block map's rectangles and
    allocates nothing of the estimate's size."""
    limit = budget[0]
    if limit is None:
        return
    tiles = torch.as_tensor(plan.tiles)
    live = int((tiles != int(masks.BlockKind.EMPTY)).sum())
    base = KEPT_BYTES_PER_TOKEN * plan.seq_len + BYTES_PER_TILE * live
    work, how = tile_work_bytes(plan)
    cells, moves = _timeline_size(plan)
    per_cell = BYTES_PER_CELL if timelines else BYTES_PER_STEP_CELL
    extra = per_cell * cells + BYTES_PER_TRANSFER * moves
    _over(base + work + extra, f"the cost model's tile work, {how}; {KEPT_BYTES_PER_TOKEN} bytes "
          f"x {plan.seq_len:,} tokens of plan; {BYTES_PER_TILE} bytes x {live:,} tiles of "
          f"programs; {per_cell} bytes x {cells:,} (rank, step) cells and "
          f"{BYTES_PER_TRANSFER} bytes x {moves:,} transfers of the simulation",
          budget, what, "use a smaller --seq-len or a larger --block-size or --world-size")


def _timeline_size(plan) -> tuple[int, int]:
    """``(P * T, transfers)``: the simulator's ``[P, T]`` cells (T: the longer direction's
    steps) and the transfer rows of the larger direction (what it holds at once: a ring that
    forwards every chunk through every rank has millions, zigzag at P=4,096 on documents
    16.8M, where its tiles number 10,639)."""
    steps, moves = 0, 0
    for progs in (plan.forward, plan.backward):
        comp, xfer, coll = ProgramTable.of(progs)._parts
        top = [int(x.max()) for x in (comp["step"], xfer["step"], coll["step"]) if len(x)]
        steps = max(steps, 1 + max(top, default=-1))
        moves = max(moves, len(xfer["step"]))
    return plan.world_size * steps, moves


def cli(args) -> int:
    """``python -m fringe simulate``: one row per schedule, optionally the timeline as PNG."""
    for name, value in (("--world-size", args.world_size), ("--seq-len", args.seq_len),
                        ("--block-size", args.block_size), ("--heads", args.heads),
                        ("--kv-heads", args.kv_heads), ("--head-dim", args.head_dim)):
        if value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value}")
    made = {}
    for name in args.schedules:               # unknown names raise, listing the valid ones
        made[name] = registry.get(name)
        why = registry.why_not(name, world_size=args.world_size, heads=args.heads,
                               kv_heads=args.kv_heads)
        if why:
            ok = registry.names(world_size=args.world_size, heads=args.heads,
                                kv_heads=args.kv_heads)
            raise ValueError(f"--schedules {name}: {why}; choose from {ok} or "
                             f"compose:OUTER+ulysses:K with K dividing H={args.heads}")
    if args.png and not args.png.lower().endswith(".png"):
        raise ValueError(f"--png {args.png!r}: give a file name ending in .png")
    shape = Shape(heads=args.heads, kv_heads=args.kv_heads, head_dim=args.head_dim,
                  dtype=args.dtype)
    if getattr(args, "calibration", None) and args.hardware != "this":
        raise ValueError(f"--calibration {args.calibration} goes with --hardware this (the "
                         f"constants of this machine); --hardware {args.hardware} is a preset")
    if args.hardware == "this":    # measured once (or loaded): the constants auto accepts
        hw = calibrate.shared(path=getattr(args, "calibration", None))
    else:
        hw = get_hardware(args.hardware)
    auto = []
    for name, s in made.items():             # auto chooses on this command's machine and shape
        if s.kind == AUTO:
            made[name] = auto_schedule(hardware=hw, shape=shape)
            auto.append(name)
    budget = memory_budget(args.max_memory)
    check_plan_memory(args.seq_len, budget)
    mask = mask_from_spec(args.mask, args.seq_len)
    rows, preds, explained = [], [], []
    for name in args.schedules:
        t0 = time.process_time()
        p = make_plan(made[name], mask, seq_len=args.seq_len,
                      world_size=args.world_size, block_size=args.block_size)
        check_memory(p, budget, what=f"predicting {name} at S={args.seq_len:,}",
                     timelines=bool(args.png))
        if name in auto:
            explained.append(p.explain())
        t1 = time.process_time()
        pred = simulate(p, hw, shape, name=f"{name}={p.choice.winner}" if name in auto
                        else name, timelines=bool(args.png))
        t2 = time.process_time()
        del p                # its programs and cost columns go before the next plan is made
        if args.png:         # the [P, T] timelines are kept only to be drawn (timelines=)
            preds.append(pred)
        row = pred.row()
        del pred
        _return_freed_memory()
        row.update({"plan s": t1 - t0, "simulate s": t2 - t1})
        rows.append(row)
    print(f"cost model · {hw.name} ({hw.source}) · P={args.world_size:,} S={args.seq_len:,} "
          f"mask={args.mask} · B={shape.batch} H={shape.heads} G={shape.kv_heads} "
          f"D={shape.head_dim} {shape.dtype} · one attention layer, forward + backward")
    print(tabulate([list(r.values()) for r in rows], headers=list(rows[0]), floatfmt=".3g"))
    print("balance: max/mean compute per rank; exposed comm: waiting / (compute + waiting); "
          "memory: resident q, k, v, out, grads + received buffers alive at once; "
          "plan s / simulate s: CPU seconds of this process")
    for text in explained:                   # why auto chose what it chose
        print()
        print(text)
    if args.png:
        stem = args.png[:-4]
        for pred in preds:
            path = args.png if len(preds) == 1 else f"{stem}.{pred.name}.png"
            render.save_png(render.timeline_figure(pred), path)
            print(f"wrote {path}")
    return 0
