"""The measured step time of ``schedules.auto()``'s pick against the fastest candidate it
considered, on the side-by-side cells, in long-lived gloo ranks.

``python -m benchmarks.auto_pick --worlds 2 --masks causal document window --seq-lens 4096
8192 --rounds 7`` — B=1, H=G=8, D=64, float32, forward + backward, one thread per rank, the
masks of :func:`benchmarks.compare.fringe_mask`, the plan's default block size (the shapes of
``benchmarks.compare`` and ``benchmarks.balanced_steps``, whose harness this reuses:
:func:`benchmarks.balanced_steps.interleaved`).

Per cell (mask, S, P) every rank plans ``schedules.auto()`` twice: with the hardware preset it
uses by default (``cpu``) and with ``hardware=`` a calibration of this machine shared by every
rank (:func:`fringe.cost.calibrate.shared`, measured once per run on rank 0 of the first pool,
or loaded from ``--calibration PATH``). Then it plans every candidate auto could run, as a fixed
schedule with the same arguments, plus a second, identical plan of the preset's pick (``PICK
(copy)``: own plan, own tensors) and times them all: a warm-up step each, then ``--rounds``
rounds of one step each, the order reversed every other round; the time of a step is the wall
seconds of the slowest rank (barrier, step, barrier). Printed per cell: each candidate's median
and its ratio to the fastest median, the model's predicted step time under both constants, auto's
picks, pick / fastest, and the identical-plan spread (median of the copy / median of the pick;
how far apart two identical plans land in the same run). The target (issue 23): on every P=2 cell
the pick's median is within 5% of the fastest, or within the identical-plan spread.

Writes the tables into ``BENCHMARKS.md`` (``--markdown``) between the ``auto:`` markers, inside
the hand-written reading block that ``benchmarks.compare`` keeps across its reruns, and the
numbers into ``benchmarks/results-auto.json`` (``--json``); ``--merge`` keeps the cells of the
earlier JSON that this run does not measure (each cell carries its own date, load and commit).
A benchmark, never a test. P > cores is oversubscribed: wall time then follows the sum of the
ranks' CPU seconds, and auto's constants (one thread per rank, a core each) do not model that.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile

from .balanced_steps import STATE, interleaved

#: Suffix of the second, identical plan of the preset's pick (the noise floor).
COPY = " (copy)"
#: pick / fastest at or below this meets the target outright.
TARGET = 1.05
#: The labels of the two constants auto is planned with.
PRESET, SHARED_CAL = "cpu preset", "shared calibration"
AUTO_START = "<!-- auto:start (written by python -m benchmarks.auto_pick) -->"
AUTO_END = "<!-- auto:end -->"


def _calibrate(rank: int, world: int, path: str) -> dict:
    """Every rank: :func:`fringe.cost.calibrate.shared` (rank 0 loads ``path`` or measures and
    saves it); the constants rank 0 broadcast."""
    import dataclasses

    from fringe.cost import calibrate
    return dataclasses.asdict(calibrate.shared(path=path))


def _setup(rank: int, world: int, kind: str, S: int, calibration: str | None) -> dict:
    """Plan auto (preset, and shared calibration if given), every candidate auto could run and
    a copy of the preset's pick; fill :data:`benchmarks.balanced_steps.STATE` with this rank's
    plans and shards; return what the plans say."""
    import fringe
    from fringe import schedules
    from fringe.cost import calibrate

    from .compare import _qkv, fringe_mask
    mask = fringe_mask(kind, S)
    STATE.clear()
    q, k, v = _qkv(S)

    def plan(schedule):
        return fringe.plan(schedule, mask, seq_len=S, world_size=world)

    hardware = {PRESET: "cpu"}
    if calibration is not None:
        hardware[SHARED_CAL] = calibrate.load(calibration)
    autos = {label: plan(schedules.auto(hardware=hw)) for label, hw in hardware.items()}
    choices = {label: p.choice for label, p in autos.items()}
    names = list(dict.fromkeys(c.name for ch in choices.values() for c in ch.candidates
                               if c.runs))
    pick = choices[PRESET].winner
    plans = {n: plan(schedules.get(n)) for n in names}
    plans[pick + COPY] = plan(schedules.get(pick))
    for n, p in plans.items():
        STATE[n] = (p, [p.layout.shard(t, rank).contiguous().requires_grad_() for t in (q, k, v)])
    fps = {n: p.fingerprint() for n, p in plans.items()}
    return dict(
        names=list(plans), fingerprints=fps,
        picks={label: ch.winner for label, ch in choices.items()},
        # auto's plan is the winner's plan: the same fingerprint as plan(<winner>)
        same_plan={label: autos[label].fingerprint() == fps[ch.winner]
                   for label, ch in choices.items()},
        predicted={label: {c.name: c.step_s for c in ch.candidates if c.runs}
                   for label, ch in choices.items()},
        excluded={label: {c.name: c.excluded for c in ch.candidates if not c.runs}
                  for label, ch in choices.items()},
        explain={label: p.explain() for label, p in autos.items()})


def summarize(info: dict, res: dict) -> dict:
    """The cell's numbers from :func:`_setup`'s answer and :func:`interleaved`'s rounds."""
    med = {n: statistics.median(x for x, _ in rs) for n, rs in res.items()}
    busiest = {n: statistics.median(max(c) for _, c in rs) for n, rs in res.items()}
    cands = [n for n in info["names"] if not n.endswith(COPY)]
    fastest = min(cands, key=lambda n: (med[n], n))
    pick = info["picks"][PRESET]
    copy = pick + COPY
    # copy / pick: how far apart two identical plans land in this run; the noise is that gap
    # whichever of the two landed faster (the slower over the faster, less one): |copy/pick - 1|
    # would count a copy 7% faster as 6.5%
    spread = med[copy] / med[pick]
    noise = max(spread, 1 / spread) - 1
    picks = {}
    for label, p in info["picks"].items():
        ratio = med[p] / med[fastest]
        pred = info["predicted"][label]
        picks[label] = dict(
            pick=p, ratio=ratio, ok=ratio <= TARGET or ratio - 1 <= noise,
            round_ratio=statistics.median(x / y for (x, _), (y, _) in zip(res[p], res[fastest])),
            predicted_pick_s=pred[p], predicted_fastest_s=pred.get(fastest))
    return dict(median_s=med, busiest_cpu_s=busiest, fastest=fastest, spread=spread,
                noise=noise, picks=picks)


def _fmt_cell(cell: dict) -> str:
    from tabulate import tabulate
    s, info = cell["summary"], cell["info"]
    med, fast = s["median_s"], s["fastest"]
    fp = info["fingerprints"]
    same = {n: sorted(m for m in fp if m != n and fp[m] == fp[n]) for n in fp}
    rows = []
    for n in sorted(med, key=lambda n: (med[n], n)):
        pred = [info["predicted"][lb].get(n.removesuffix(COPY)) for lb in info["picks"]]
        marks = [lb for lb, p in info["picks"].items() if p == n]
        rows.append([n, f"{med[n]:.3f}", f"{med[n] / med[fast]:.3f}",
                     f"{s['busiest_cpu_s'][n]:.3f}"]
                    + [f"{x * 1e3:.4g}" if x is not None else "" for x in pred]
                    + [", ".join(same[n]), ", ".join(f"auto ({m})" for m in marks)])
    lb0, lb1 = cell["load_before"], cell["load_after"]
    lines = [f"{cell['mask']} S={cell['S']} P={cell['P']} rounds={cell['rounds']} load (1/5/15 "
             f"min) {lb0[0]:.1f}/{lb0[1]:.1f}/{lb0[2]:.1f} -> {lb1[0]:.1f}/{lb1[1]:.1f}/"
             f"{lb1[2]:.1f}" + (" (oversubscribed)" if cell["P"] > cell["cores"] else "")]
    lines.append(tabulate(rows, headers=["candidate", "median s", "/fastest", "busiest CPU s"]
                          + [f"pred ms ({lb})" for lb in info["picks"]]
                          + ["same plan as", "picked by"], disable_numparse=True))
    for lb, p in s["picks"].items():
        verdict = "ok" if p["ok"] else "MISS"
        lines.append(f"  auto ({lb}) picks {p['pick']}: pick/fastest {p['ratio']:.3f} (median of "
                     f"per-round ratios {p['round_ratio']:.3f}), fastest {fast}; identical-plan "
                     f"spread {s['spread']:.3f}; target <= {TARGET} or within the spread: "
                     f"{verdict}" + ("" if info["same_plan"][lb] else
                                     "; auto's plan differs from plan(<pick>)!"))
        if not p["ok"] and p["predicted_fastest_s"] is not None:
            lines.append(f"    model ({lb}): {p['pick']} {p['predicted_pick_s'] * 1e3:.4g} ms vs "
                         f"{fast} {p['predicted_fastest_s'] * 1e3:.4g} ms predicted "
                         f"({p['predicted_pick_s'] / p['predicted_fastest_s']:.3f}); measured "
                         f"{p['ratio']:.3f}")
    return "\n".join(lines)


def markdown(result: dict) -> str:
    """The BENCHMARKS.md section (between :data:`AUTO_START` and :data:`AUTO_END`)."""
    from tabulate import tabulate
    cells = sorted(result["cells"], key=lambda c: c["P"])              # stable: run order
    labels = [PRESET] + ([SHARED_CAL] if any(SHARED_CAL in c["info"]["picks"] for c in cells)
                         else [])
    out = ["## auto: measured time of `schedules.auto()`'s pick / the fastest candidate", ""]
    for run in result["runs"]:
        cal = run.get("calibration")
        out.append(f"`{run['command']}` ({run['started']}, {run['minutes']:.1f} min, commit "
                   f"{run['commit']}, torch {run['torch']}, {run['cores']} cores; load average "
                   f"(1/5/15 min) before {'/'.join(f'{x:.2f}' for x in run['load_before'])}, "
                   f"after {'/'.join(f'{x:.2f}' for x in run['load_after'])})"
                   + (f"; shared calibration: {cal['source']}; " + ", ".join(
                       f"{k}={v:.4g}" for k, v in cal.items() if isinstance(v, float))
                      if cal else "") + ".")
        out.append("")
    out.append(
        f"B=1, H=G=8, D=64, float32, forward + backward, gloo ranks with one thread each, default "
        f"block size; seconds of the slowest rank, median of the rounds (after a warm-up step "
        f"each; rounds alternate the order of the candidates). Every candidate auto could run is "
        f"timed as a fixed schedule; *copy* is a second, identical plan of the preset's pick "
        f"(own plan, own tensors): **spread** = copy / pick, the noise floor of the run (the gap "
        f"counted from the faster of the two: max(spread, 1/spread) - 1). Target "
        f"(issue 23): on every P=2 cell pick / fastest ≤ {TARGET}, or within the spread "
        f"(ok / MISS beside the ratio; n/a where P exceeds the cores). *per round*: the median "
        f"over rounds of pick / fastest in the same round; *CPU*: the pick's median CPU "
        f"seconds of its busiest rank / the least of any candidate (what a shared machine "
        f"inflates least; wall seconds on a loaded box also count other processes' time "
        f"slices). "
        f"auto planned with the `cpu` preset (its default)"
        + (" and with `hardware=` a calibration of this machine shared by every rank "
           "(`fringe.cost.calibrate.shared`, measured once per run, its constants above)"
           if SHARED_CAL in labels else "")
        + ". P=4 runs 4 ranks on 2 cores: oversubscribed, reported, not judged.")
    out.append("")
    names = list(dict.fromkeys(n for c in cells for n in c["info"]["names"]
                               if not n.endswith(COPY)))
    rows = []
    for c in cells:
        s, med = c["summary"], c["summary"]["median_s"]
        cpu = {n: x for n, x in s["busiest_cpu_s"].items() if not n.endswith(COPY)}
        row = [c["mask"], c["S"], c["P"]] + [f"{med[n]:.3f}" if n in med else "" for n in names]
        row.append(f"{med[s['picks'][PRESET]['pick'] + COPY]:.3f}")
        judged = c["P"] <= c["cores"]
        for lb in labels:
            p = s["picks"].get(lb)
            verdict = ("ok" if p["ok"] else "MISS") if judged and p else "n/a"
            row += ([p["pick"], f"{p['ratio']:.3f} {verdict}", f"{p['round_ratio']:.3f}",
                     f"{cpu[p['pick']] / min(cpu.values()):.3f}"] if p else ["", "", "", ""])
        row += [s["fastest"], f"{s['spread']:.3f}",
                "{:.1f}→{:.1f}".format(c["load_before"][0], c["load_after"][0])]
        rows.append(row)
    heads = ["mask", "S", "P"] + names + ["copy"]
    for lb in labels:
        heads += [f"auto ({lb})", "pick/fastest", "per round", "CPU"]
    heads += ["fastest", "spread", "load"]
    out.append(tabulate(rows, headers=heads, tablefmt="github", disable_numparse=True))
    out.append("")
    out.append("Predicted step time (ms) of each candidate, by the constants auto read:")
    out.append("")
    rows = []
    for c in cells:
        for lb in labels:
            pred = c["info"]["predicted"].get(lb)
            if pred is None:
                continue
            rows.append([c["mask"], c["S"], c["P"], lb]
                        + [f"{pred[n] * 1e3:.4g}" if n in pred else "" for n in names])
    out.append(tabulate(rows, headers=["mask", "S", "P", "constants"] + names,
                        tablefmt="github", disable_numparse=True))
    out.append("")
    return "\n".join(out)


def write_section(path: str, section: str) -> None:
    """Put ``section`` between the auto markers of ``path``: replace an earlier one, else
    insert it at the end of the reading block (kept by ``benchmarks.compare``), else append."""
    from .compare import READING_END
    text = open(path).read() if os.path.exists(path) else ""
    block = f"{AUTO_START}\n{section}\n{AUTO_END}"
    i, j = text.find(AUTO_START), text.find(AUTO_END)
    if 0 <= i < j:
        text = text[:i] + block + text[j + len(AUTO_END):]
    elif READING_END in text:
        k = text.find(READING_END)
        text = text[:k] + block + "\n" + text[k:]
    else:
        text = text + ("\n" if text else "") + block + "\n"
    with open(path, "w") as f:
        f.write(text)


def main(argv=None) -> int:
    import torch

    from fringe.launch import Workers
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--worlds", nargs="+", type=int, default=[2])
    ap.add_argument("--masks", nargs="+", default=["causal", "document", "window"])
    ap.add_argument("--seq-lens", nargs="+", type=int, default=[4096, 8192])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--calibration", default=None,
                    help="a shared calibration file to load (or to save the one measured)")
    ap.add_argument("--no-calibration", action="store_true",
                    help="plan auto with the cpu preset only")
    ap.add_argument("--markdown", default=None, help="default: BENCHMARKS.md")
    ap.add_argument("--json", default=None, help="default: benchmarks/results-auto.json")
    ap.add_argument("--merge", action="store_true",
                    help="keep the earlier JSON's cells that this run does not measure")
    ap.add_argument("--render", action="store_true",
                    help="measure nothing: rewrite the markdown section from the JSON")
    a = ap.parse_args(argv)
    here = os.path.dirname(os.path.abspath(__file__))
    md = a.markdown or os.path.join(os.path.dirname(here), "BENCHMARKS.md")
    js = a.json or os.path.join(here, "results-auto.json")
    if a.render:
        with open(js) as f:
            write_section(md, markdown(json.load(f)))
        print(f"wrote the auto section of {md} from {js}")
        return 0
    old = []
    if a.merge and os.path.exists(js):
        with open(js) as f:
            prev = json.load(f)
        old, old_runs = prev["cells"], prev["runs"]
    else:
        old_runs = []
    tmp = tempfile.mkdtemp(prefix="auto_pick-")
    path = None if a.no_calibration else (a.calibration or os.path.join(tmp, "calibration.json"))
    started = datetime.datetime.now(datetime.timezone.utc)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True, cwd=here).stdout.strip()
    run = dict(command="python -m benchmarks.auto_pick " + " ".join(argv or sys.argv[1:]),
               started=started.isoformat(timespec="seconds"), commit=commit,
               torch=torch.__version__, cores=os.cpu_count(), load_before=os.getloadavg())
    cells: list = []

    def write():
        keys = {(c["mask"], c["S"], c["P"]) for c in cells}
        kept = [c for c in old if (c["mask"], c["S"], c["P"]) not in keys]
        run.update(load_after=os.getloadavg(),
                   minutes=(datetime.datetime.now(datetime.timezone.utc) - started)
                   .total_seconds() / 60)
        runs = [r for r in old_runs if r["started"] in {c["started"] for c in kept}]
        result = dict(runs=runs + [run], cells=kept + cells)          # runs with cells left
        with open(js, "w") as f:
            json.dump(result, f, indent=1)
        write_section(md, markdown(result))

    for P in a.worlds:
        with Workers(P, timeout_s=900, threads=1) as w:
            if path is not None and "calibration" not in run:     # once, in the first pool
                hw = w.run(_calibrate, path)
                if any(h != hw[0] for h in hw):
                    raise RuntimeError(f"ranks got different shared calibrations: {hw}")
                run["calibration"] = dict(hw[0], path=path)
                print(f"shared calibration ({hw[0]['source']}):\n  " + ", ".join(
                    f"{k}={v:.4g}" for k, v in hw[0].items() if isinstance(v, float)),
                    flush=True)
            for kind in a.masks:
                for S in a.seq_lens:
                    infos = w.run(_setup, kind, S, path)
                    info = infos[0]
                    for r, other in enumerate(infos):      # every rank planned the same
                        if other["fingerprints"] != info["fingerprints"] or \
                                other["picks"] != info["picks"]:
                            raise RuntimeError(f"rank {r} planned differently from rank 0: "
                                               f"{other['picks']} vs {info['picks']}")
                    load0 = os.getloadavg()
                    res = interleaved(w, info["names"], a.rounds)
                    cell = dict(mask=kind, S=S, P=P, rounds=a.rounds, cores=os.cpu_count(),
                                started=run["started"], commit=commit, load_before=load0,
                                load_after=os.getloadavg(), info=info,
                                summary=summarize(info, res),
                                rounds_s={n: [x for x, _ in rs] for n, rs in res.items()})
                    cells.append(cell)
                    print(_fmt_cell(cell), flush=True)
                    write()
    print(f"load {run['load_before'][0]:.2f} -> {os.getloadavg()[0]:.2f}; wrote {js} and the "
          f"auto section of {md}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
