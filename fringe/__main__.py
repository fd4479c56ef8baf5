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
import sys

from .layout import DEFAULT_BLOCK_SIZE


def _common(p: argparse.ArgumentParser, *, seq_len: int) -> None:
    from .demo import DEFAULT_WINDOW, MASKS, SCHEDULES
    p.add_argument("--world-size", type=int, default=4, help="P, context-parallel ranks")
    p.add_argument("--schedule", choices=SCHEDULES, default="zigzag")
    p.add_argument("--mask", choices=MASKS, default="document",
                   help="document = causal & document over packed docs (boundaries change "
                        "every batch); sliding_window is also within documents")
    p.add_argument("--seq-len", type=int, default=seq_len, help="S, global tokens")
    p.add_argument("--block-size", type=int, default=DEFAULT_BLOCK_SIZE)
    p.add_argument("--window", type=int, default=DEFAULT_WINDOW, help="sliding_window width in tokens")
    p.add_argument("--seed", type=int, default=0)


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m fringe",
                                 description="Context-parallel attention for any mask_mod.")
    sub = ap.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="train a tiny LM under CP (CPU ranks, gloo) and check "
                                       "it against one process")
    _common(demo, seq_len=1024)
    demo.add_argument("--steps", type=int, default=16)
    demo.add_argument("--batch-size", type=int, default=1)
    demo.add_argument("--dtype", choices=("float32", "float64"), default="float32")
    demo.add_argument("--layers", type=int, default=2)
    demo.add_argument("--lr", type=float, default=1e-2)
    demo.add_argument("--timeout", type=float, default=300.0,
                      help="seconds a step may take on the ranks before giving up")

    bench = sub.add_parser("bench", help="measure planning, attention speed and exposed "
                                         "communication; prints targets beside the figures")
    bench.add_argument("--seq-len", type=int, default=8192)
    bench.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    bench.add_argument("--schedule", choices=("ring", "zigzag", "striped", "balanced"),
                       default="zigzag")
    bench.add_argument("--iters", type=int, default=3)
    bench.add_argument("--plan-size", type=int, default=1 << 20,
                       help="tokens for the planning benchmark")

    show = sub.add_parser("show", help="print a plan's step x rank grid and per-rank stats")
    _common(show, seq_len=1024)
    show.add_argument("--backward", action="store_true", help="show the backward programs too")
    show.add_argument("--png", metavar="FILE", help="also write the tile map to FILE and the "
                                                    "cost model's timeline to FILE's stem + "
                                                    "'.timeline.png' (matplotlib)")

    sim = sub.add_parser("simulate", help="predict step time, balance, exposed communication, "
                                          "bytes and memory per rank with the cost model")
    sim.add_argument("--world-size", type=int, default=1024, help="P, context-parallel ranks")
    sim.add_argument("--seq-len", type=int, default=1 << 20, help="S, global tokens")
    sim.add_argument("--mask", default="document:1000",
                     help="causal, full, document:N (causal within N packed documents) or "
                          "window:W (causal sliding window of W tokens)")
    sim.add_argument("--schedules", nargs="+", default=["ring", "zigzag", "striped", "balanced"])
    sim.add_argument("--hardware", default="h100-ib",
                     help="a preset (h100-nvlink, h100-ib, cpu) or 'this' (calibrate here)")
    sim.add_argument("--block-size", type=int, default=DEFAULT_BLOCK_SIZE)
    sim.add_argument("--heads", type=int, default=32, help="H, query heads")
    sim.add_argument("--kv-heads", type=int, default=8, help="G, kv heads")
    sim.add_argument("--head-dim", type=int, default=128, help="D")
    sim.add_argument("--dtype", choices=("bfloat16", "float16", "float32", "float64"),
                     default="bfloat16")
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
    print(run(world_sizes=tuple(args.world_sizes), plan_size=args.plan_size,
              case=AttnCase(schedule=args.schedule, seq_len=args.seq_len, iters=args.iters)))
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
    args = parser().parse_args(argv)
    try:
        return {"demo": _demo, "show": _show, "bench": _bench,
                "simulate": _simulate}[args.command](args)
    except ValueError as e:             # bad sizes or names: the message says how to fix them
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
