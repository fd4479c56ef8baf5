"""Step time of the collective schedules against zigzag, interleaved in long-lived gloo ranks.

``python -m benchmarks.step_times`` — S = 4096, causal & document (16 docs), H = G = 8,
D = 64, float32, forward + backward, one thread per rank (``fringe.bench``'s attention case);
two rounds, each schedule after the other in the same ranks, median per schedule. P = 4 on 2
cores is oversubscribed: read its ratios, not its seconds.
"""
from __future__ import annotations

import statistics

from fringe import bench
from fringe.launch import Workers

NAMES = ("zigzag", "allgather", "ulysses", "compose:zigzag+ulysses:2", "compose:zigzag+zigzag:2")


def main(world_sizes=(2, 4), rounds: int = 2) -> None:
    res: dict = {}
    for P in world_sizes:
        with Workers(P, timeout_s=600, threads=1) as w:
            for _ in range(rounds):
                for name in NAMES:
                    if name.startswith("compose") and P % 2:
                        continue
                    case = bench.AttnCase(schedule=name, seq_len=4096, iters=3)
                    r = w.run(bench._worker, case)
                    res.setdefault((P, name), []).append(max(x["seconds"] for x in r))
    for (P, name), v in res.items():
        z = statistics.median(res[(P, "zigzag")])
        t = statistics.median(v)
        print(f"P={P} {name:28s} {t:.3f} s   / zigzag {t / z:.2f}")


if __name__ == "__main__":
    main()
