"""Command line: ``python -m fringe demo`` and ``python -m fringe show``.

* ``demo``: trains a tiny LM with context parallelism on spawned CPU ranks (gloo) and in one
  process with dense attention, prints both losses per step, and exits 1 if they differ by
  more than the stated tolerance (see :mod:`fringe.demo`).
* ``show``: prints a plan's step × rank grid and its per-rank work and traffic.
* ``bench``: measures planning, attention speed and exposed communication (:mod:`fringe.bench`).
* ``simulate``: predicts every schedule at scale with the cost model
  (:mod:`fringe.runtime.costmodel`); ``--png`` writes the timeline.
"""
from __future__ import annotations

import argparse
import math
import sys

from .layout import DEFAULT_BLOCK_SIZE


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1 (sizes, counts, world sizes)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer (1, 2, ...), "
                                         f"got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer (1, 2, ...), got {value}")
    return value


def nonnegative_int(text: str) -> int:
    """argparse type: an integer >= 0 that fits a 64-bit seed."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a non-negative integer (0, 1, ...), "
                                         f"got {text!r}") from None
    if not 0 <= value < 2 ** 63:
        raise argparse.ArgumentTypeError(f"expected a non-negative integer below 2**63, "
                                         f"got {value}")
    return value


def positive_float(text: str) -> float:
    """argparse type: a finite number > 0 (seconds, learning rates)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive, finite number, "
                                         f"got {text!r}") from None
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"expected a positive, finite number, got {text!r}")
    return value


def _common(p: argparse.ArgumentParser, *, seq_len: int) -> None:
    from .demo import DEFAULT_WINDOW, MASKS, SCHEDULES
    p.add_argument("--world-size", type=positive_int, default=4, help="P, context-parallel ranks")
    p.add_argument("--schedule", choices=SCHEDULES, default="zigzag",
                   help="which ranks compute which tiles when (default: %(default)s)")
    p.add_argument("--mask", choices=MASKS, default="document",
                   help="document = causal & document over packed docs (boundaries change "
                        "every batch); sliding_window is also within documents")
    p.add_argument("--seq-len", type=positive_int, default=seq_len,
                   help="S, global tokens (a multiple of 2 * P * block size for zigzag; "
                        "default: %(default)s)")
    p.add_argument("--block-size", type=positive_int, default=DEFAULT_BLOCK_SIZE,
                   help="mask block in tokens (default: %(default)s)")
    p.add_argument("--window", type=positive_int, default=DEFAULT_WINDOW,
                   help="sliding_window width in tokens (default: %(default)s)")
    p.add_argument("--seed", type=nonnegative_int, default=0,
                   help="seeds the documents (and the demo's init and data)")


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m fringe",
                                 description="Context-parallel attention for any mask_mod.")
    sub = ap.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="train a tiny LM under CP (CPU ranks, gloo) and check "
                                       "it against one process")
    _common(demo, seq_len=1024)
    demo.add_argument("--steps", type=positive_int, default=16,
                      help="optimizer steps (default: %(default)s)")
    demo.add_argument("--batch-size", type=positive_int, default=1,
                      help="B, sequences per step (default: %(default)s)")
    demo.add_argument("--dtype", choices=("float32", "float64"), default="float32",
                      help="model and attention dtype (default: %(default)s)")
    demo.add_argument("--layers", type=positive_int, default=2,
                      help="transformer blocks (default: %(default)s)")
    demo.add_argument("--lr", type=positive_float, default=1e-2,
                      help="AdamW learning rate (default: %(default)s)")
    demo.add_argument("--timeout", type=positive_float, default=300.0,
                      help="seconds a step may take on the ranks before giving up "
                           "(default: %(default)s)")

    bench = sub.add_parser("bench", help="measure planning, attention speed and exposed "
                                         "communication; prints targets beside the figures")
    bench.add_argument("--seq-len", type=positive_int, default=8192,
                       help="S, global tokens of the attention benchmark (a multiple of "
                            "2 * P * 128 for every P; default: %(default)s)")
    bench.add_argument("--world-sizes", type=positive_int, nargs="+", default=[2, 4],
                       metavar="P", help="P values to run the attention benchmark on "
                                         "(default: 2 4)")
    bench.add_argument("--schedule", choices=("ring", "zigzag", "striped", "balanced"),
                       default="zigzag", help="schedule of the attention benchmark "
                                              "(default: %(default)s)")
    bench.add_argument("--iters", type=positive_int, default=3,
                       help="timed repetitions after one warm-up; the median is reported "
                            "(default: %(default)s)")
    bench.add_argument("--plan-size", type=positive_int, default=1 << 20,
                       help="S, tokens for the planning benchmark (P=8 and 1024, block 128 "
                            "and 64: a multiple of 2*1024*128=262144; default: %(default)s)")

    show = sub.add_parser("show", help="print a plan's step x rank grid and per-rank stats")
    _common(show, seq_len=1024)
    show.add_argument("--backward", action="store_true", help="show the backward programs too")
    show.add_argument("--png", metavar="FILE", help="also write the tile map to FILE and the "
                                                    "cost model's timeline to FILE's stem + "
                                                    "'.timeline.png' (matplotlib)")

    sim = sub.add_parser("simulate", help="predict step time, balance, exposed communication, "
                                          "bytes and memory per rank with the cost model")
    sim.add_argument("--world-size", type=positive_int, default=1024,
                     help="P, context-parallel ranks")
    sim.add_argument("--seq-len", type=positive_int, default=1 << 20, help="S, global tokens")
    sim.add_argument("--mask", default="document:1000",
                     help="causal, full, document:N (causal within N packed documents) or "
                          "window:W (causal sliding window of W tokens)")
    sim.add_argument("--schedules", nargs="+", default=["ring", "zigzag", "striped", "balanced"],
                     help="schedules to predict (default: ring zigzag striped balanced)")
    sim.add_argument("--hardware", default="h100-ib",
                     help="a preset (h100-nvlink, h100-ib, cpu) or 'this' (calibrate here)")
    sim.add_argument("--block-size", type=positive_int, default=DEFAULT_BLOCK_SIZE,
                     help="mask block in tokens (default: %(default)s)")
    sim.add_argument("--heads", type=positive_int, default=32, help="H, query heads")
    sim.add_argument("--kv-heads", type=positive_int, default=8, help="G, kv heads")
    sim.add_argument("--head-dim", type=positive_int, default=128, help="D")
    sim.add_argument("--dtype", choices=("bfloat16", "float16", "float32", "float64"),
                     default="bfloat16", help="q/k/v dtype (default: %(default)s)")
    sim.add_argument("--png", metavar="FILE", help="write the timeline to FILE (with several "
                                                   "schedules, one FILE-stem.<schedule>.png each)")
    return ap


def _demo(args) -> int:
    from .demo import DemoConfig, run_demo
    from .launch import LaunchError
    cfg = DemoConfig(world_size=args.world_size, schedule=args.schedule, mask=args.mask,
                     seq_len=args.seq_len, block_size=args.block_size, steps=args.steps,
                     batch_size=args.batch_size, dtype=args.dtype, seed=args.seed,
                     window=args.window, layers=args.layers, lr=args.lr)
    try:
        result = run_demo(cfg, timeout_s=args.timeout)
    except LaunchError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(result.report())
    return 0 if result.ok else 1


def _bench(args) -> int:
    from .bench import AttnCase, run
    from .launch import LaunchError
    try:
        print(run(world_sizes=tuple(args.world_sizes), plan_size=args.plan_size,
                  case=AttnCase(schedule=args.schedule, seq_len=args.seq_len, iters=args.iters)))
    except LaunchError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


def _show(args) -> int:
    from . import render
    from .demo import make_batch, make_mask, make_schedule
    from .plan import plan as make_plan
    _, _, doc_ids = make_batch(0, seq_len=args.seq_len, seed=args.seed)
    p = make_plan(make_schedule(args.schedule), make_mask(args.mask, doc_ids, window=args.window),
                  seq_len=args.seq_len, world_size=args.world_size, block_size=args.block_size)
    print(render.table(p))
    if args.backward:
        print(render.table(p, backward=True))
    print(p.stats().table())
    if args.png:
        from .runtime import costmodel
        if not args.png.lower().endswith(".png"):
            raise ValueError(f"--png {args.png!r}: give a file name ending in .png")
        stem = args.png[:-4]
        render.tile_map_figure(p).savefig(args.png, dpi=120)
        pred = costmodel.simulate(p, "cpu", costmodel.Shape(heads=8, kv_heads=8, head_dim=64,
                                                            dtype="float32"))
        render.timeline_figure(pred).savefig(f"{stem}.timeline.png", dpi=120)
        print(f"wrote {args.png} (tile map) and {stem}.timeline.png (timeline, cost model, cpu)")
    return 0


def _simulate(args) -> int:
    from .runtime import costmodel
    return costmodel.cli(args)


def main(argv: list[str] | None = None) -> int:
    """Run the command line; returns the exit status (2 for a bad argument, with a message
    on stderr saying what was expected, never a traceback)."""
    try:
        args = parser().parse_args(argv)
    except SystemExit as e:             # --help (0) or a bad argument (2): argparse printed why
        return e.code if isinstance(e.code, int) else 2
    try:
        return {"demo": _demo, "show": _show, "bench": _bench,
                "simulate": _simulate}[args.command](args)
    except ValueError as e:             # bad sizes or names: the message says how to fix them
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
