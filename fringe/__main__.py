"""Command line: ``python -m fringe {demo,show,bench,predict}``.

* ``demo``: trains a tiny LM with context parallelism on spawned CPU ranks (gloo) and in one
  process with dense attention, prints both losses per step, and exits 1 if they differ by
  more than the stated tolerance (see :mod:`fringe.demo`).
* ``show``: prints a plan's step × rank grid and its per-rank work and traffic.
* ``bench``: measures planning, attention speed and exposed communication (:mod:`fringe.bench`).
* ``predict``: predicts every schedule at scale with the **cost model**, computing nothing
  (:mod:`fringe.cost`); ``--png`` writes the timeline. ``simulate`` is the
  same command (the name the cost model's issue uses), and says so. It is not :mod:`fringe.simulate`, which *runs* the
  attention numerically on an in-process virtual mesh.

Every ``--schedule`` takes a name from :mod:`fringe.schedules.registry`: ``zigzag``,
``allgather:4``, ``compose:zigzag+ulysses:2``, ...
"""
from __future__ import annotations

import argparse
import math
import sys
from typing import Callable

from . import render
from .bench import AttnCase, run
from .demo import (DEFAULT_WINDOW, MASKS, MAX_LAYERS, MAX_LR, DemoConfig, make_batch, make_mask,
                   make_schedule, run_demo)
from .launch import LaunchError
from .layout import DEFAULT_BLOCK_SIZE
from .plan import plan as make_plan
from .schedules import registry


def _number(cast: type, expected: str, ok: Callable[[float], bool]) -> Callable[[str], float]:
    """An argparse ``type=``: ``cast(text)``, accepted when ``ok(value)``. Otherwise the error
    says what was expected and what was given: quoted when it is not a number at all
    (``got 'abc'``), as typed when it is one out of range (``got 0``)."""
    def parse(text: str):
        try:
            value = cast(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}") from None
        if not ok(value):
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text.strip()}")
        return value
    parse.__name__ = cast.__name__
    return parse


#: argparse types: sizes, counts and world sizes; seeds (64-bit); seconds and learning rates.
positive_int = _number(int, "a positive integer (1, 2, ...)", lambda v: v >= 1)
nonnegative_int = _number(int, "a non-negative integer below 2**63", lambda v: 0 <= v < 2 ** 63)
positive_float = _number(float, "a positive, finite number", lambda v: v > 0 and math.isfinite(v))
#: Heads and head dims: past this the cost model's int64 byte counts overflow (H*D*S*bytes).
MAX_HEADS = 4096
head_count = _number(int, f"a positive integer up to {MAX_HEADS}", lambda v: 1 <= v <= MAX_HEADS)
#: Seconds: gloo keeps a process group's timeout in milliseconds in a C int (2**31 ms: 24.8 days).
MAX_TIMEOUT_S = 10 ** 6
timeout_s = _number(float, f"a positive number of seconds up to {MAX_TIMEOUT_S:,} (11.6 days)",
                    lambda v: 0 < v <= MAX_TIMEOUT_S)


_UNITS = {"": 1, "k": 2 ** 10, "m": 2 ** 20, "g": 2 ** 30, "t": 2 ** 40}


def memory_size(text: str) -> int:
    """argparse type: a number of bytes, with an optional binary unit: ``4G`` (also ``4GB``,
    ``4GiB``; K, M, G, T are powers of 1024), ``512M``, ``1.5G`` or plain bytes."""
    t = text.strip().lower().removesuffix("ib").removesuffix("b")
    unit = t[-1:] if t[-1:] in _UNITS and t[-1:] else ""
    try:
        value = float(t[:len(t) - len(unit)]) * _UNITS[unit]
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value >= 1):
        raise argparse.ArgumentTypeError(f"expected a memory size such as 4G, 512M or "
                                         f"1.5GiB, got {text!r}")
    return int(value)


def png_path(text: str) -> str:
    """argparse type: a ``.png`` file name in a directory that exists and can be written."""
    import os
    if not text.lower().endswith(".png"):
        raise argparse.ArgumentTypeError(f"give a file name ending in .png, got {text!r}")
    folder = os.path.dirname(os.path.abspath(text))
    if os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"{text!r} is a directory; give a file name in it "
                                         f"(e.g. {os.path.join(text, 'plan.png')})")
    if not os.path.isdir(folder):
        raise argparse.ArgumentTypeError(f"the directory of {text!r} does not exist: create "
                                         f"it first (mkdir -p {os.path.dirname(text)})")
    if not os.access(folder, os.W_OK):
        raise argparse.ArgumentTypeError(f"the directory of {text!r} is not writable; choose "
                                         f"another place for the file")
    return text


def _max_memory(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-memory", type=memory_size, default=None, metavar="SIZE",
                   help="refuse (exit 2) when the estimated peak memory is above SIZE, e.g. "
                        "4G or 512M (default: 80%% of the memory available)")


def schedule_name(text: str) -> str:
    """argparse type: a schedule name from the registry, in its one spelling
    (``fringe.schedules.registry``: ``zigzag``, ``allgather:4``, ``compose:zigzag+ulysses:2``)."""
    try:
        return registry.canonical(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _schedule_help(default: str | None) -> str:
    tail = f" (default: {default})" if default else ""
    return f"a schedule: {registry.syntax()}; see the list below{tail}".replace("%", "%%")


def _schedule_epilog() -> str:
    return "schedules (fringe.schedules.names()):\n" + "\n".join(
        "  " + line for line in registry.describe().splitlines())


def _common(p: argparse.ArgumentParser, *, seq_len: int) -> None:
    p.add_argument("--world-size", type=positive_int, default=4, help="P, context-parallel ranks")
    p.add_argument("--schedule", type=schedule_name, default="zigzag", metavar="NAME",
                   help="which ranks compute which tiles when: " + _schedule_help("zigzag"))
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
    ap = argparse.ArgumentParser(
        prog="python -m fringe", description="Context-parallel attention for any mask_mod.",
        epilog="'predict' (also 'simulate') is the cost model: it predicts times and "
               "computes nothing. fringe.simulate, in Python, is something else: it runs the "
               "attention numerically on an in-process virtual mesh.")
    sub = ap.add_subparsers(dest="command", required=True)
    listed = dict(epilog=_schedule_epilog(), formatter_class=argparse.RawDescriptionHelpFormatter)

    demo = sub.add_parser("demo", help="train a tiny LM under CP (CPU ranks, gloo) and check "
                                       "it against one process", **listed)
    _common(demo, seq_len=1024)
    demo.add_argument("--steps", type=positive_int, default=16,
                      help="optimizer steps (default: %(default)s)")
    demo.add_argument("--batch-size", type=positive_int, default=1,
                      help="B, sequences per step (default: %(default)s)")
    demo.add_argument("--dtype", choices=("float32", "float64"), default="float32",
                      help="model and attention dtype (default: %(default)s)")
    demo.add_argument("--layers", type=_number(int, f"a positive integer up to {MAX_LAYERS}",
                                               lambda v: 1 <= v <= MAX_LAYERS), default=2,
                      help=f"transformer blocks, at most {MAX_LAYERS} (default: %(default)s)")
    demo.add_argument("--lr", type=_number(float, f"a positive number up to {MAX_LR:g}",
                                           lambda v: 0 < v <= MAX_LR), default=1e-2,
                      help=f"AdamW learning rate, at most {MAX_LR:g} (default: %(default)s)")
    demo.add_argument("--timeout", type=timeout_s, default=300.0,
                      help="seconds a step may take on the ranks before giving up "
                           "(default: %(default)s)")

    bench = sub.add_parser("bench", help="measure planning, attention speed and exposed "
                                         "communication; prints targets beside the figures",
                           **listed)
    bench.add_argument("--seq-len", type=positive_int, default=8192,
                       help="S, global tokens of the attention benchmark (a multiple of "
                            "2 * P * 128 for every P; default: %(default)s)")
    bench.add_argument("--world-sizes", type=positive_int, nargs="+", default=[2, 4],
                       metavar="P", help="P values to run the attention benchmark on "
                                         "(default: 2 4)")
    bench.add_argument("--schedule", type=schedule_name, default="zigzag", metavar="NAME",
                       help="schedule of the attention benchmark (the planning benchmark plans "
                            "every registered one): " + _schedule_help("zigzag"))
    bench.add_argument("--iters", type=positive_int, default=3,
                       help="timed repetitions after one warm-up; the median is reported "
                            "(default: %(default)s)")
    bench.add_argument("--plan-size", type=positive_int, default=1 << 20,
                       help="S, tokens for the planning benchmark (P=8 and 1024, block 128 "
                            "and 64: a multiple of 2*1024*128=262144; default: %(default)s)")
    _max_memory(bench)

    show = sub.add_parser("show", help="print a plan's step x rank grid and per-rank stats",
                          **listed)
    _common(show, seq_len=1024)
    show.add_argument("--backward", action="store_true", help="show the backward programs too")
    show.add_argument("--png", metavar="FILE", type=png_path,
                      help="also write the tile map to FILE and the cost model's timeline to "
                           "FILE's stem + '.timeline.png' (matplotlib)")
    _max_memory(show)

    sim = sub.add_parser(
        "predict", aliases=["simulate"],
        help="predict step time, balance, exposed communication, bytes and memory per rank "
             "with the cost model, computing nothing ('simulate' is the same command; "
             "not fringe.simulate, the numeric in-process run)",
        description="The cost model (fringe.cost): predicted times for P ranks on "
                    "a hardware preset; nothing is computed. (fringe.simulate in Python is the "
                    "numeric in-process run, a different thing.)", **listed)
    sim.add_argument("--world-size", type=positive_int, default=1024,
                     help="P, context-parallel ranks")
    sim.add_argument("--seq-len", type=positive_int, default=1 << 20, help="S, global tokens")
    sim.add_argument("--mask", default="document:1000",
                     help="causal, full, document:N (causal within N packed documents) or "
                          "window:W (causal sliding window of W tokens)")
    sim.add_argument("--schedules", nargs="+", type=schedule_name, default=None, metavar="NAME",
                     help="schedules to predict (default: every registered schedule that runs "
                          "at --world-size with --heads and --kv-heads); each "
                          + _schedule_help(None))
    sim.add_argument("--hardware", default="h100-ib",
                     help="a preset (h100-nvlink, h100-ib, cpu) or 'this' (calibrate this "
                          "machine once: fringe.cost.calibrate.shared, what auto accepts)")
    sim.add_argument("--calibration", metavar="FILE",
                     help="with --hardware this: load the calibration from FILE if it exists, "
                          "else measure and save it there (the file every rank's "
                          "fringe.cost.calibrate.shared(path=FILE) or load(FILE) reads)")
    sim.add_argument("--block-size", type=positive_int, default=DEFAULT_BLOCK_SIZE,
                     help="mask block in tokens (default: %(default)s)")
    sim.add_argument("--heads", type=head_count, default=32, help="H, query heads")
    sim.add_argument("--kv-heads", type=head_count, default=8, help="G, kv heads")
    sim.add_argument("--head-dim", type=head_count, default=128, help="D")
    sim.add_argument("--dtype", choices=("bfloat16", "float16", "float32", "float64"),
                     default="bfloat16", help="q/k/v dtype (default: %(default)s)")
    sim.add_argument("--png", metavar="FILE", type=png_path,
                     help="write the timeline to FILE (with several schedules, one "
                          "FILE-stem.<schedule>.png each)")
    _max_memory(sim)
    return ap


def _demo(args) -> int:
    cfg = DemoConfig(world_size=args.world_size, schedule=args.schedule, mask=args.mask,
                     seq_len=args.seq_len, block_size=args.block_size, steps=args.steps,
                     batch_size=args.batch_size, dtype=args.dtype, seed=args.seed,
                     window=min(args.window, args.seq_len),   # wider than S: the same mask
                     layers=args.layers, lr=args.lr)
    try:
        result = run_demo(cfg, timeout_s=args.timeout)
    except LaunchError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(result.report())
    return 0 if result.ok else 1


def _bench(args) -> int:
    from .cost import cli as cost_cli
    budget = cost_cli.memory_budget(args.max_memory)
    cost_cli.check_plan_memory(args.plan_size, budget, flag="--plan-size")
    cost_cli.check_plan_memory(args.seq_len, budget)
    try:
        print(run(world_sizes=tuple(args.world_sizes), plan_size=args.plan_size,
                  case=AttnCase(schedule=args.schedule, seq_len=args.seq_len, iters=args.iters)))
    except LaunchError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


def _show(args) -> int:
    from .cost import cli as cost_cli
    from .cost.hardware import Shape
    from .cost.simulate import simulate
    budget = cost_cli.memory_budget(args.max_memory)
    cost_cli.check_plan_memory(args.seq_len, budget)
    _, _, doc_ids = make_batch(0, seq_len=args.seq_len, seed=args.seed)
    p = make_plan(make_schedule(args.schedule), make_mask(args.mask, doc_ids,
                                                       window=min(args.window, args.seq_len)),
                  seq_len=args.seq_len, world_size=args.world_size, block_size=args.block_size)
    print(render.table(p))
    if p.choice is not None:                 # --schedule auto: what it compared and why
        print(p.explain())
    if args.backward:
        print(render.table(p, backward=True))
    print(p.stats().table())
    if args.png:
        cost_cli.check_memory(p, budget, what=f"--png (the cost model's timeline) at "
                                              f"S={args.seq_len:,}", timelines=True)
        stem = args.png[:-4]
        render.save_png(render.tile_map_figure(p), args.png)
        pred = simulate(p, "cpu", Shape(heads=8, kv_heads=8, head_dim=64, dtype="float32"),
                        timelines=True)
        render.save_png(render.timeline_figure(pred), f"{stem}.timeline.png")
        print(f"wrote {args.png} (tile map) and {stem}.timeline.png (timeline, cost model, cpu)")
    return 0


DEPRECATED_SIMULATE = ("note: 'python -m fringe simulate' is the cost model, also called "
                       "'python -m fringe predict'; it computes nothing. fringe.simulate in Python "
                       "is something else: the numeric in-process run.")


def _predict(args) -> int:
    from .cost import cli as cost_cli
    if args.command == "simulate":
        print(DEPRECATED_SIMULATE, file=sys.stderr)
    if args.schedules is None:
        args.schedules = registry.names(world_size=args.world_size, heads=args.heads,
                                        kv_heads=args.kv_heads)
    return cost_cli.cli(args)


def main(argv: list[str] | None = None) -> int:
    """Run the command line; returns the exit status (2 for a bad argument, with a message
    on stderr saying what was expected, never a traceback)."""
    try:
        args = parser().parse_args(argv)
    except SystemExit as e:             # --help (0) or a bad argument (2): argparse printed why
        return e.code if isinstance(e.code, int) else 2
    try:
        return {"demo": _demo, "show": _show, "bench": _bench, "predict": _predict,
                "simulate": _predict}[args.command](args)
    except ValueError as e:             # bad sizes or names: the message says how to fix them
        print(f"error: {_one_line(e)}", file=sys.stderr)
        return 2
    except MemoryError as e:            # an estimate over the budget (it names the fix), or
        said = _one_line(e) or "out of memory"        # an allocation the allocator refused
        if "--max-memory" not in said:
            said += f"; {_SMALLER.get(args.command, _SMALLER['show'])}"
        print(f"error: {said}", file=sys.stderr)
        return 2
    except OverflowError as e:          # a size past int64 / C int arithmetic
        print(f"error: a value is too large ({_one_line(e)}); "
              f"{_SMALLER.get(args.command, _SMALLER['show'])}", file=sys.stderr)
        return 2
    except RuntimeError as e:           # torch's allocator refuses with a RuntimeError
        if not _allocation_failed(e):
            raise
        print(f"error: out of memory: {_one_line(e)}; "
              f"{_SMALLER.get(args.command, _SMALLER['show'])}", file=sys.stderr)
        return 2


_SMALLER = {"bench": "use a smaller --seq-len or --plan-size",
            "demo": "use a smaller --seq-len, --batch-size or --layers",
            "show": "use a smaller --seq-len or a larger --block-size"}


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split())


def _allocation_failed(e: RuntimeError) -> bool:
    text = str(e).lower()
    return "can't allocate memory" in text or "out of memory" in text


if __name__ == "__main__":
    sys.exit(main())
