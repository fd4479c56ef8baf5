"""fringe vs torch's built-in context parallel vs dense SDPA, side by side in one run.

``python -m benchmarks.compare`` (full, ~15 min on 2 cores) or ``--quick`` (< 3 min: S=2048,
P=2, the schedules the targets name, fewer rounds; it prints the cells it runs)
measures, on long-lived gloo CPU ranks (:class:`fringe.launch.Workers`, one pool per P, kept
for the whole run):

- **speed**: forward + backward of one attention call, B=1, H=G=8, D=64, float32, for every
  fringe schedule in the registry (``fringe.schedules.names()``), torch's CP
  (SDPA path for causal: workaround W1; flex path for document / window masks: eager dense
  math with the CPU-backward guard bypassed, W2; see ``benchmarks/torch_cp.py``) and one
  process doing all the work (dense SDPA with ``is_causal`` or a bool mask, and fringe with
  P=1). CP ranks run 1 intra-op thread each; the one-process runs get 2 threads (the same 2
  cores). Systems are interleaved round by round (the order rotates every round) so they see
  the same background load; the figure is the median of the rounds after one warm-up round
  of the slowest rank's step (barrier, step, barrier). Load averages are recorded.
- **forward only** against torch CP with ``torch.compile``d flex (W3: block-sparse, inference
  only on CPU), P=2.
- **memory**: per-rank peak of CPU-allocator bytes live during one forward + backward, above
  those live at its start (inputs excluded, gradients and communication buffers included),
  from torch.profiler's allocation records (``profile_memory=True``).
- **precision**: fringe on the in-process virtual mesh (``fringe.simulate.attention``),
  P = 1, 2, 4, 8, bf16 and fp32, causal & document mask: relative error (Frobenius) of out,
  dq, dk, dv against a float64 dense reference, divided by the same error of single-process
  SDPA in that dtype.
- **correctness**: in the warm-up round each system's output rows (every cell) and dq rows
  (S <= 4096) are compared with dense SDPA on that rank; a failure is printed in the table.

It writes ``BENCHMARKS.md`` (tables, each target beside its figure: ok / MISS) and a JSON
file. It is a benchmark, never a test: it exits 0 whatever it measures.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time

import torch

HEADS = 8
KV_HEADS = 8
HEAD_DIM = 64
N_DOCS = 16
WINDOW = 512
MASKS = ("causal", "document", "window")
MASK_TITLES = {"causal": "causal", "document": f"causal & document ({N_DOCS} docs)",
               "window": f"sliding window {WINDOW} (causal)"}
TOL_OUT = 2e-3          # fp32 CP vs dense: max |diff| relative to max |ref| (merge order differs)

# targets (issue 9)
T_CAUSAL_VS_TORCH = 1.00
T_P2_VS_DENSE = 1.05
T_1P_VS_DENSE = 1.05
T_SPARSE_VS_DENSE = {4096: 0.15, 8192: 0.12}
T_VS_FLEX_EAGER = 0.03
T_VS_FLEX_COMPILED = 1.00
T_BYTES_VS_ZIGZAG = 0.25
T_PRECISION = 1.2

# ---------------------------------------------------------------------------------------------
# inputs and masks (same seeds on every rank)


def _qkv(S: int, dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    return tuple(torch.randn(1, h, S, HEAD_DIM, generator=g).to(dtype)
                 for h in (HEADS, KV_HEADS, KV_HEADS))


def _doc_ids(S: int) -> torch.Tensor:
    from fringe.testing import packed_docs
    return packed_docs(S, N_DOCS, 1)


def fringe_mask(kind: str, S: int):
    from fringe import masks
    if kind == "causal":
        return masks.causal()
    if kind == "document":
        return masks.causal() & masks.document(_doc_ids(S))
    if kind == "window":
        return masks.sliding_window(WINDOW)
    raise ValueError(kind)


def flex_mask_mod(kind: str, S: int):
    """The same mask as a plain FlexAttention mask_mod (for torch's flex path)."""
    if kind == "document":
        ids = _doc_ids(S)

        def document_causal(b, h, q_idx, kv_idx):
            return (ids[q_idx] == ids[kv_idx]) & (q_idx >= kv_idx)
        return document_causal
    if kind == "window":
        def sliding_window(b, h, q_idx, kv_idx):
            d = q_idx - kv_idx
            return (d >= 0) & (d < WINDOW)
        return sliding_window
    raise ValueError(kind)


def dense_bool_mask(kind: str, S: int) -> torch.Tensor:
    from fringe import masks
    pos = torch.arange(S)
    return masks.evaluate(fringe_mask(kind, S), pos, pos)


def schedule_names() -> tuple[list[str], dict[str, str]]:
    """The registered schedules (``fringe.schedules.names()``) that run at this H and G, and the
    ones not run with why (the 2D ``compose:OUTER+INNER:K`` forms need arguments)."""
    from fringe import schedules
    names = schedules.names(heads=HEADS, kv_heads=KV_HEADS)
    skipped = {"compose": "a 2D form compose:OUTER+INNER:K; needs arguments"}
    skipped.update({n: schedules.registry.why_not(n, heads=HEADS, kv_heads=KV_HEADS)
                    for n in schedules.names() if n not in names})
    order = {"ring": 0, "zigzag": 1, "striped": 2, "balanced": 3}
    return sorted(names, key=lambda n: (order.get(n, 9), n)), skipped


# ---------------------------------------------------------------------------------------------
# systems (built and run inside the worker processes)


class _Fringe:
    def __init__(self, plan, rank: int, q, k, v):
        self.plan = plan
        self.world = plan.world_size
        if self.world == 1:
            self.q, self.k, self.v = (t.clone().requires_grad_() for t in (q, k, v))
            self.positions = torch.arange(plan.seq_len)
        else:
            self.q, self.k, self.v = (plan.layout.shard(t, rank).contiguous().requires_grad_()
                                      for t in (q, k, v))
            self.positions = plan.layout.positions(rank)
        self.sent_bytes = None

    def _call(self):
        import fringe
        if self.world == 1:
            return fringe.simulate.attention(self.q, self.k, self.v, plan=self.plan)
        return fringe.attention(self.q, self.k, self.v, plan=self.plan)

    def step(self, *, backward: bool = True):
        for t in (self.q, self.k, self.v):
            t.grad = None
        if not backward:
            with torch.no_grad():
                return self._call()
        out = self._call()
        out.sum().backward()
        if self.world > 1 and self.sent_bytes is None:
            import fringe
            s = fringe.last_run().summary()
            self.sent_bytes = s["forward"]["sent_bytes"] + s["backward"]["sent_bytes"]
        return out


class _Dense:
    def __init__(self, kind: str, q, k, v):
        self.causal = kind == "causal"
        self.mask = None if self.causal else dense_bool_mask(kind, q.shape[2])
        self.q, self.k, self.v = (t.clone().requires_grad_() for t in (q, k, v))
        self.positions = torch.arange(q.shape[2])
        self.sent_bytes = None

    def step(self, *, backward: bool = True):
        for t in (self.q, self.k, self.v):
            t.grad = None
        with torch.set_grad_enabled(backward):
            out = torch.nn.functional.scaled_dot_product_attention(
                self.q, self.k, self.v, attn_mask=self.mask, is_causal=self.causal)
        if backward:
            out.sum().backward()
        return out


class _TorchCompiled:
    """Forward-only handle on a TorchCPFlex's compiled module (W3)."""

    def __init__(self, flex):
        self.flex = flex
        self.positions = flex.positions
        self.q = flex.q
        self.sent_bytes = None

    def step(self, *, backward: bool = False):
        return self.flex.step_compiled()


_STATE: dict = {}
_MESH = None


def _w_setup(rank: int, world: int, cfg: dict) -> dict:
    """Build this cell's systems on this rank; returns {name: error or None}."""
    import fringe
    from fringe import schedules
    _STATE.clear()
    gc.collect()
    kind, S = cfg["mask"], cfg["S"]
    q, k, v = _qkv(S)
    systems, errors, notes = {}, {}, {}
    mask = fringe_mask(kind, S)
    exclude = set(cfg.get("exclude", ()))
    for name in cfg["schedules"]:
        if f"fringe {name}" in exclude:
            continue
        try:
            plan = fringe.plan(schedules.get(name), mask, seq_len=S, world_size=world)
            systems[f"fringe {name}"] = _Fringe(plan, rank, q, k, v)
        except Exception as e:          # noqa: BLE001 - reported in the table
            errors[f"fringe {name}"] = f"{type(e).__name__}: {e}"[:200]
    if world == 1:
        systems["dense SDPA"] = _Dense(kind, q, k, v)
    elif cfg.get("torch", True):
        from torch.distributed.device_mesh import init_device_mesh

        from . import torch_cp
        global _MESH
        if _MESH is None:
            _MESH = init_device_mesh("cpu", (world,))
        mesh = _MESH
        try:
            if kind == "causal":
                if "torch CP" not in exclude:
                    systems["torch CP"] = torch_cp.TorchCPSdpa(mesh, q, k, v)
            elif cfg.get("flex_eager", True) or cfg.get("compiled"):
                doc_lens = (torch.bincount(_doc_ids(S)).tolist() if kind == "document"
                            else None)
                flex = torch_cp.TorchCPFlex(mesh, q, k, v, flex_mask_mod(kind, S),
                                            doc_lens=doc_lens)
                notes["torch CP load balancer"] = flex.balancer
                if cfg.get("flex_eager", True) and "torch CP" not in exclude:
                    systems["torch CP"] = flex
                if cfg.get("compiled") and "torch CP compiled" not in exclude:
                    systems["torch CP compiled"] = _TorchCompiled(flex)
        except Exception as e:          # noqa: BLE001
            errors["torch CP"] = f"{type(e).__name__}: {e}"[:200]
    _STATE["systems"] = systems
    _STATE["cfg"] = cfg
    return dict(errors=errors, systems=sorted(systems), notes=notes)


def _barrier(world: int) -> None:
    if world > 1:
        import torch.distributed as dist
        dist.barrier()


def _w_step(rank: int, world: int, name: str, backward: bool, check: bool = False) -> dict:
    system = _STATE["systems"][name]
    _barrier(world)
    t0 = time.perf_counter()
    out = system.step(backward=backward)
    _barrier(world)
    dt = time.perf_counter() - t0
    res = dict(seconds=dt, sent_bytes=getattr(system, "sent_bytes", None))
    if check:
        res.update(_check(system, out, backward))
    return res


def _reference_rows(positions: torch.Tensor, backward: bool):
    """Dense SDPA out (and dq) for these query rows; dq needs only the rows' own attention."""
    cfg = _STATE["cfg"]
    kind, S = cfg["mask"], cfg["S"]
    key = ("ref", backward)
    if key not in _STATE:
        q, k, v = _qkv(S)
        q.requires_grad_(backward)
        with torch.set_grad_enabled(backward):
            if kind == "causal":
                out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
            else:
                out = torch.nn.functional.scaled_dot_product_attention(
                    q, k, v, attn_mask=dense_bool_mask(kind, S))
        dq = None
        if backward:
            out.sum().backward()
            dq = q.grad
        _STATE[key] = (out.detach(), dq)
    out, dq = _STATE[key]
    return out[:, :, positions], (dq[:, :, positions] if dq is not None else None)


def _check(system, out, backward: bool) -> dict:
    S = _STATE["cfg"]["S"]
    want_dq = backward and S <= 4096 and getattr(system, "q", None) is not None
    ref_out, ref_dq = _reference_rows(system.positions, want_dq)
    res = dict(out_err=float((out.detach() - ref_out).abs().max() / ref_out.abs().max()))
    if want_dq and system.q.grad is not None:
        res["dq_err"] = float((system.q.grad - ref_dq).abs().max() / ref_dq.abs().max())
    return res


def _w_memory(rank: int, world: int, name: str) -> float:
    """Peak CPU-allocator MiB live during one fwd+bwd, above what was live at its start."""
    from torch.profiler import ProfilerActivity, profile
    system = _STATE["systems"][name]
    _barrier(world)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        system.step(backward=True)
    _barrier(world)
    allocs = []

    def walk(nodes):
        for e in nodes:
            if type(e.extra_fields).__name__.endswith("Allocation"):
                allocs.append((e.start_time_ns, e.extra_fields.alloc_size))
            walk(e.children)
    walk(prof.profiler.kineto_results.experimental_event_tree())
    allocs.sort()
    cur = peak = 0
    for _, size in allocs:
        cur += size
        peak = max(peak, cur)
    return peak / 2 ** 20


def _w_profile(rank: int, world: int, name: str, rows: int = 12) -> str:
    """torch.profiler of one fwd+bwd on this rank: ops by self CPU time (text table)."""
    from torch.profiler import ProfilerActivity, profile
    system = _STATE["systems"][name]
    _barrier(world)
    t0 = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        system.step(backward=True)
    _barrier(world)
    wall = time.perf_counter() - t0
    if rank != 0:
        return {}
    avgs = prof.key_averages()
    split = dict.fromkeys(("fused attention kernel", "communication",
                           "fringe autograd.Function self time (Python: interpreter, planning glue)",
                           "other ops (copies, merges, masks, autograd engine)"), 0.0)
    for e in avgs:
        split[_category(e.key)] += e.self_cpu_time_total / 1e6
    table = avgs.table(sort_by="self_cpu_time_total", row_limit=rows, max_name_column_width=60)
    return dict(wall=wall, split=split, table=table)


def _category(name: str) -> str:
    if "scaled_dot_product" in name:
        return "fused attention kernel"
    if name.startswith("c10d::") or "gloo" in name or "all_gather" in name:
        return "communication"
    if name in ("Attention", "AttentionBackward"):
        return "fringe autograd.Function self time (Python: interpreter, planning glue)"
    return "other ops (copies, merges, masks, autograd engine)"


def _w_teardown(rank: int, world: int) -> None:
    systems = _STATE.get("systems", {})
    systems.clear()
    _STATE.clear()
    gc.collect()


# ---------------------------------------------------------------------------------------------
# precision (virtual mesh, in the driver process)


def precision(*, S: int, worlds=(1, 2, 4, 8), dtypes=(torch.bfloat16, torch.float32)) -> list:
    import fringe
    from fringe import schedules
    mask = fringe_mask("document", S)
    dense = dense_bool_mask("document", S)
    q64, k64, v64 = _qkv(S, torch.float64)
    g = torch.Generator().manual_seed(7)
    dout64 = torch.randn(q64.shape, generator=g, dtype=torch.float64)

    def run(fn, dtype):
        q, k, v = (t.detach().to(dtype).clone().requires_grad_() for t in (q64, k64, v64))
        out = fn(q, k, v)
        out.backward(dout64.to(dtype))
        return [t.detach().double() for t in (out, q.grad, k.grad, v.grad)]

    def sdpa(q, k, v):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=dense)
    ref = run(sdpa, torch.float64)

    def rel(xs):
        return [float((x - r).norm() / r.norm()) for x, r in zip(xs, ref)]

    rows = []
    for dtype in dtypes:
        base = rel(run(sdpa, dtype))
        for P in worlds:
            plan = fringe.plan(schedules.zigzag(), mask, seq_len=S, world_size=P)
            err = rel(run(lambda q, k, v: fringe.simulate.attention(q, k, v, plan=plan), dtype))
            rows.append(dict(dtype=str(dtype).removeprefix("torch."), P=P, S=S,
                             cp_err=dict(zip(("out", "dq", "dk", "dv"), err)),
                             sdpa_err=dict(zip(("out", "dq", "dk", "dv"), base)),
                             ratio=dict(zip(("out", "dq", "dk", "dv"),
                                            (e / b if b else math.inf
                                             for e, b in zip(err, base))))))
    return rows


# ---------------------------------------------------------------------------------------------
# the driver


@dataclasses.dataclass
class Config:
    seq_lens: tuple = (8192, 4096)        # the headline cells first (results are written per cell)
    worlds: tuple = (2, 4)
    masks: tuple = MASKS
    rounds: int = 5
    compiled_worlds: tuple = (2,)        # forward-only vs compiled flex
    flex_eager_worlds: tuple = (2,)      # P=4: oversubscribed and ~minutes per cell
    flex_eager_max_S: int = 4096         # S=8192 P=2: a rank was OOM-killed (dense [L, S] math)
    memory: bool = True
    memory_masks: tuple = MASKS           # --quick: causal only (the only memory target)
    flex_eager_rounds: int | None = None  # --quick: 1 (W2 is dense math, ~15x a fringe step)
    profile: bool = True
    precision_S: int = 2048
    precision_dtypes: tuple = ("bfloat16", "float32")   # --quick: bf16 (the only target)
    schedules: tuple | None = None       # None: every registered one; --quick: the targets'
    quick: bool = False
    prewarm: bool = False
    resume_cells: list | None = None     # cells taken over from an earlier run's JSON
    resume_precision: list | None = None


def _log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')} load {os.getloadavg()[0]:.1f}] {msg}", file=sys.stderr,
          flush=True)


def run(cfg: Config, checkpoint=None) -> dict:
    from fringe.launch import Workers
    names, skipped = schedule_names()
    if cfg.schedules is not None:
        skipped.update({n: "not in this run's --schedules" for n in names
                        if n not in cfg.schedules})
        names = [n for n in names if n in cfg.schedules]
    _log(f"cells: {', '.join(cfg.masks)} x S={list(cfg.seq_lens)}; P=1 (zigzag, dense SDPA) and "
         f"P={list(cfg.worlds)} ({', '.join(names)}, torch CP); {cfg.rounds} rounds + warm-up; "
         f"memory on {', '.join(cfg.memory_masks) if cfg.memory else 'none'}; precision S="
         f"{cfg.precision_S} {', '.join(cfg.precision_dtypes)}")
    done = {(c["mask"], c["S"]): c for c in (cfg.resume_cells or [])}
    result = dict(config=dataclasses.asdict(cfg), schedules=names, skipped_schedules=skipped,
                  started=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                  load_before=os.getloadavg(), cells=[], env=_env())
    t_start = time.perf_counter()
    if cfg.resume_precision:
        result["precision"] = cfg.resume_precision
    elif not cfg.prewarm:
        _log("precision (virtual mesh, 2 threads)")
        threads = torch.get_num_threads()
        torch.set_num_threads(2)
        try:
            result["precision"] = precision(
                S=cfg.precision_S, worlds=(1, 2, 4) if cfg.quick else (1, 2, 4, 8),
                dtypes=tuple(getattr(torch, d) for d in cfg.precision_dtypes))
        finally:
            torch.set_num_threads(threads)
    pools = {1: Workers(1, threads=2, timeout_s=3600)}
    for P in cfg.worlds:
        pools[P] = Workers(P, threads=1, timeout_s=3600)
    result["config"]["resume_cells"] = [f"{m} S={S}" for m, S in done]
    result["config"]["resume_precision"] = bool(cfg.resume_precision)
    grid = {(kind, S) for S in cfg.seq_lens for kind in cfg.masks}
    result["cells"] += [dict(c, resumed=True) for key, c in done.items() if key not in grid]
    try:
        for w in pools.values():
            w.start()
        for S in cfg.seq_lens:
            for kind in cfg.masks:
                if cfg.prewarm:
                    _prewarm(pools, cfg, names, kind, S)
                elif (kind, S) in done:
                    result["cells"].append(dict(done[(kind, S)], resumed=True))
                else:
                    result["cells"].append(_cell(pools, cfg, names, kind, S))
                    if checkpoint is not None:      # a run cut short still leaves its cells
                        result["load_after"] = os.getloadavg()
                        result["seconds"] = time.perf_counter() - t_start
                        result["partial"] = True
                        result["targets"] = targets(result)
                        checkpoint(result)
    finally:
        for w in pools.values():
            w.close()
    result["load_after"] = os.getloadavg()
    result["seconds"] = time.perf_counter() - t_start
    result["partial"] = False
    result["targets"] = targets(result)
    return result


def _prewarm(pools, cfg: Config, names, kind: str, S: int) -> None:
    """Fill inductor's on-disk caches (torch's compiled block masks and compiled flex)."""
    if kind == "causal":
        return
    for P, pool in pools.items():
        if P not in cfg.flex_eager_worlds + cfg.compiled_worlds:
            continue
        t0 = time.perf_counter()
        sub = dict(mask=kind, S=S, schedules=[], flex_eager=False,
                   compiled=P in cfg.compiled_worlds)
        info = pool.run(_w_setup, sub)[0]
        if "torch CP compiled" in info["systems"]:
            pool.run(_w_step, "torch CP compiled", False)
        pool.run(_w_teardown)
        _log(f"prewarm {kind} S={S} P={P}: {time.perf_counter() - t0:.0f} s {info['errors']}")


def _cell(pools, cfg: Config, names, kind: str, S: int) -> dict:
    cell = dict(mask=kind, S=S, load_before=os.getloadavg(), setup_errors={}, systems={})
    _log(f"cell {kind} S={S}: setup")
    jobs = []                                     # (P, system, backward)
    subs = {}
    for P, pool in pools.items():
        sub = subs[P] = dict(mask=kind, S=S, schedules=names if P > 1 else ["zigzag"],
                             flex_eager=P in cfg.flex_eager_worlds and S <= cfg.flex_eager_max_S,
                             compiled=kind != "causal" and P in cfg.compiled_worlds, exclude=[])
        t0 = time.perf_counter()
        info = pool.run(_w_setup, sub)[0]
        cell.setdefault("setup_seconds", {})[P] = time.perf_counter() - t0
        cell["setup_errors"].update({f"{n} P={P}": e for n, e in info["errors"].items()})
        cell.setdefault("notes", {}).update({f"{n} P={P}": e for n, e in info["notes"].items()})
        for name in info["systems"]:
            if name == "torch CP compiled":
                jobs.append((P, name, False))
                continue
            jobs.append((P, name, True))
            if name.startswith("fringe") and kind != "causal" and P in cfg.compiled_worlds:
                jobs.append((P, name, False))
    times = {j: [] for j in jobs}
    checks, bytes_, warmup = {}, {}, {}
    for r in range(cfg.rounds + 1):               # round 0 is the warm-up (and the check)
        k = r % len(jobs)
        order = jobs[k:] + jobs[:k]
        for P, name, bwd in order:
            if (P, name, bwd) not in jobs:
                continue
            if (name == "torch CP" and kind != "causal" and cfg.flex_eager_rounds is not None
                    and r > cfg.flex_eager_rounds):
                continue
            try:
                res = pools[P].run(_w_step, name, bwd, r == 0)
            except Exception as e:      # noqa: BLE001
                cell["setup_errors"][f"{name} P={P}"] = f"step failed: {str(e)[-300:]}"
                _log(f"  {name} P={P} failed: {str(e)[-300:]}")
                for j in [j for j in jobs if j[:2] == (P, name)]:
                    jobs.remove(j)
                if getattr(e, "kind", "") == "ProcessDied" or "broken" in str(e):
                    # a rank died (e.g. the OOM killer): a fresh pool, this cell set up again
                    subs[P]["exclude"].append(name)
                    pools[P].close()
                    pools[P].start()
                    pools[P].run(_w_setup, subs[P])
                    _log(f"  P={P} pool restarted without {name}")
                continue
            if r == 0:
                warmup[(P, name, bwd)] = max(x["seconds"] for x in res)
                checks[(P, name, bwd)] = {key: max(x.get(key, 0.0) for x in res)
                                          for key in ("out_err", "dq_err") if key in res[0]}
                if res[0].get("sent_bytes") is not None:
                    bytes_[(P, name)] = sum(x["sent_bytes"] for x in res)
            else:
                times[(P, name, bwd)].append(max(x["seconds"] for x in res))
        _log(f"  round {r} done")
    for (P, name, bwd) in jobs:
        key = f"{name} | P={P} | {'fwd+bwd' if bwd else 'fwd'}"
        ts = times[(P, name, bwd)]
        cell["systems"][key] = dict(system=name, P=P, backward=bwd, rounds=ts,
                                    median=statistics.median(ts) if ts else None,
                                    check=checks.get((P, name, bwd), {}),
                                    warmup_seconds=warmup.get((P, name, bwd)),
                                    sent_bytes=bytes_.get((P, name)) if bwd else None)
    if cfg.memory and kind in cfg.memory_masks:
        _log(f"cell {kind} S={S}: memory")
        for P, name, bwd in jobs:
            # torch's flex path trains through dense math ([L, S] scores): not a memory peer
            torch_ok = name == "torch CP" and kind == "causal"
            if bwd and (P == 1 or torch_ok or name in ("fringe zigzag", "fringe ring",
                                                       "fringe balanced")):
                try:
                    peak = max(pools[P].run(_w_memory, name))
                except Exception as e:  # noqa: BLE001
                    peak = None
                    _log(f"  memory {name} P={P} failed: {e}")
                cell["systems"][f"{name} | P={P} | fwd+bwd"]["peak_mib"] = peak
    if cfg.profile and S == max(cfg.seq_lens) and 2 in pools:
        cell["profiles"] = {}
        best = _best_fringe(cell, 2)
        for name in sorted({"fringe zigzag", best} - {None}):
            if f"{name} | P=2 | fwd+bwd" in cell["systems"]:
                _log(f"cell {kind} S={S}: profile {name}")
                cell["profiles"][name] = pools[2].run(_w_profile, name)[0]
    for pool in pools.values():
        pool.run(_w_teardown)
    cell["load_after"] = os.getloadavg()
    return cell


def _best_fringe(cell: dict, P: int, backward: bool = True) -> str | None:
    best = None
    for row in cell["systems"].values():
        if row["system"].startswith("fringe") and row["P"] == P and row["backward"] == backward \
                and row["median"] is not None:
            if best is None or row["median"] < best["median"]:
                best = row
    return best["system"] if best else None


def _env() -> dict:
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True, check=False).stdout.strip()
    except OSError:
        commit = ""
    return dict(torch=torch.__version__, python=platform.python_version(),
                cores=len(os.sched_getaffinity(0)), machine=platform.machine(), commit=commit)


# ---------------------------------------------------------------------------------------------
# targets


def _get(cell: dict, system: str, P: int, backward: bool = True):
    row = cell["systems"].get(f"{system} | P={P} | {'fwd+bwd' if backward else 'fwd'}")
    return row["median"] if row else None


def targets(result: dict) -> list[dict]:
    """One row per (target, cell): measured ratio, bound, verdict."""
    rows = []
    cores = result["env"]["cores"]

    def add(target, where, value, bound, P=None, note=""):
        if P is not None and P > cores:
            note = (note + "; " if note else "") + f"P={P} > {cores} cores: oversubscribed"
        verdict = "n/a" if value is None else ("ok" if value <= bound else "MISS")
        rows.append(dict(target=target, where=where, value=value, bound=bound, verdict=verdict,
                         note=note))

    for cell in result["cells"]:
        kind, S = cell["mask"], cell["S"]
        dense = _get(cell, "dense SDPA", 1)
        worlds = sorted({row["P"] for row in cell["systems"].values() if row["P"] > 1})
        if kind == "causal":
            for P in worlds:
                z, t = _get(cell, "fringe zigzag", P), _get(cell, "torch CP", P)
                add("causal fwd+bwd: fringe zigzag / torch CP", f"S={S} P={P}",
                    z / t if z and t else None, T_CAUSAL_VS_TORCH, P)
            z2 = _get(cell, "fringe zigzag", 2)
            add("causal: fringe zigzag P=2 / dense SDPA 1 process", f"S={S}",
                z2 / dense if z2 and dense else None, T_P2_VS_DENSE)
            f1 = _get(cell, "fringe zigzag", 1)
            add("causal: fringe 1 process / dense SDPA", f"S={S}",
                f1 / dense if f1 and dense else None, T_1P_VS_DENSE)
            continue
        for P in worlds:
            best = _best_fringe(cell, P)
            b = _get(cell, best, P) if best else None
            add(f"{kind}: best fringe / dense SDPA (same mask)", f"S={S} P={P} ({best})",
                b / dense if b and dense else None, T_SPARSE_VS_DENSE.get(S, 0.12), P)
            t = _get(cell, "torch CP", P)
            add(f"{kind}: best fringe fwd+bwd / torch CP flex eager (W2)", f"S={S} P={P}",
                b / t if b and t else None, T_VS_FLEX_EAGER, P)
            fwd_best = _best_fringe(cell, P, backward=False)
            fb = _get(cell, fwd_best, P, False) if fwd_best else None
            tc = _get(cell, "torch CP compiled", P, False)
            if fb or tc:
                add(f"{kind}: best fringe fwd / torch CP compiled flex fwd (W3)",
                    f"S={S} P={P} ({fwd_best})", fb / tc if fb and tc else None,
                    T_VS_FLEX_COMPILED, P)
            bal = _get(cell, "fringe balanced", P)
            add(f"{kind}: balanced / fastest fringe schedule", f"S={S} P={P} ({best})",
                bal / b if bal and b else None, 1.0, P)
            if kind == "document" and P == 4:
                rz = cell["systems"].get(f"fringe zigzag | P={P} | fwd+bwd", {})
                rb = cell["systems"].get(f"fringe balanced | P={P} | fwd+bwd", {})
                if rz.get("sent_bytes") and rb.get("sent_bytes") is not None:
                    add("document: balanced bytes / zigzag bytes (fwd+bwd, all ranks)",
                        f"S={S} P={P}", rb["sent_bytes"] / rz["sent_bytes"],
                        T_BYTES_VS_ZIGZAG, None, "bytes, so not affected by the core count")
    for cell in result["cells"]:
        for P in sorted({row["P"] for row in cell["systems"].values() if row["P"] > 1}):
            t = cell["systems"].get(f"torch CP | P={P} | fwd+bwd", {}).get("peak_mib")
            for name in ("fringe zigzag", "fringe ring", "fringe balanced"):
                f = cell["systems"].get(f"{name} | P={P} | fwd+bwd", {}).get("peak_mib")
                if f is not None and t:
                    add(f"peak memory per rank: {name} / torch CP",
                        f"{cell['mask']} S={cell['S']} P={P}", f / t, 1.0, P)
    for row in result.get("precision", []):
        if row["dtype"] == "bfloat16":
            worst = max(row["ratio"], key=row["ratio"].get)
            add("bf16 CP error / single-process SDPA error (worst of out, dq, dk, dv)",
                f"document S={row['S']} P={row['P']} ({worst})", row["ratio"][worst],
                T_PRECISION)
    return rows


# ---------------------------------------------------------------------------------------------
# report


def _fmt(x, nd=3):
    return "" if x is None else f"{x:.{nd}f}"


READING_START = "<!-- reading:start (hand-written, kept across runs) -->"
READING_END = "<!-- reading:end -->"


def kept_reading(path: str) -> str | None:
    """The hand-written reading between the markers of an existing report, if any."""
    if not os.path.exists(path):
        return None
    text = open(path).read()
    i, j = text.find(READING_START), text.find(READING_END)
    return text[i + len(READING_START):j] if 0 <= i < j else None


def report(result: dict, reading: str | None = None) -> str:
    from tabulate import tabulate
    env, cfg = result["env"], result["config"]
    names = [f"fringe {n}" for n in result["schedules"]]
    lb, la = result["load_before"], result["load_after"]
    out = ["# fringe vs torch context parallel vs dense SDPA — side by side, one run", ""]
    if result.get("partial"):
        out += [f"**Partial run: {len(result['cells'])} cells written so far (the file is "
                f"rewritten after every cell).**", ""]
    out.append(f"`python -m benchmarks.compare{' --quick' if cfg['quick'] else ''}` "
               f"({result['started']}, {result['seconds'] / 60:.1f} min, commit "
               f"{env['commit']}, torch {env['torch']}, {env['cores']} cores). "
               f"Load average (1/5/15 min) before {lb[0]:.2f}/{lb[1]:.2f}/{lb[2]:.2f}, after "
               f"{la[0]:.2f}/{la[1]:.2f}/{la[2]:.2f}: this machine is shared, so the "
               f"absolute seconds are noisy; the systems were interleaved round by round, so "
               f"the ratios are fair.")
    out.append("")
    out.append(f"B=1, H=G={HEADS}, D={HEAD_DIM}, float32, forward + backward of one attention "
               f"call; median of {cfg['rounds']} rounds after a warm-up round, seconds of the "
               f"slowest rank (barrier, step, barrier). CP ranks: gloo, 1 thread each; one "
               f"process: 2 threads. P=4 runs 4 ranks on {env['cores']} cores (oversubscribed: "
               f"reported, not judged for parallel speed). fringe uses its default block size "
               f"and kernel registry. torch CP workarounds (benchmark code only, "
               f"`benchmarks/torch_cp.py`): **W1** CPU SDPA op routed into torch's own ring "
               f"(causal); **W2** eager flex, CPU-backward guard bypassed: dense math, no "
               f"block sparsity; **W3** `torch.compile(flex_attention)`, forward only.")
    if cfg.get("resume_cells"):
        out.append("")
        out.append("Cells marked *(earlier run)* in the load column were measured by an earlier "
                   "run of the same command on the same commit range, taken over with `--resume` "
                   "after that run lost a rank to the OOM killer (see the notes).")
    if result.get("skipped_schedules"):
        out.append("")
        out.append("Schedules not run: " + "; ".join(
            f"`{k}` ({v})" for k, v in result["skipped_schedules"].items()) + ".")
    # targets
    out += ["", "## Targets", ""]
    out.append(tabulate([[t["target"], t["where"], _fmt(t["value"]), f"≤ {t['bound']:g}",
                          t["verdict"], t["note"]] for t in result["targets"]],
                        headers=["target", "where", "measured", "target", "", "note"],
                        tablefmt="github"))
    out += ["", READING_START, reading.strip() if reading else
            "## Reading\n\n(no hand-written reading yet: it goes between these markers and is "
            "kept when the benchmark rewrites this file)", READING_END]
    # speed
    out += ["", "## Speed, forward + backward (seconds)", ""]
    head = ["mask", "S", "P"] + [n.removeprefix("fringe ") for n in names] + \
        ["torch CP", "dense SDPA 1 proc", "check (max err)", "load"]
    rows = []
    for cell in result["cells"]:
        worlds = sorted({r["P"] for r in cell["systems"].values()})
        for P in worlds:
            row = [MASK_TITLES[cell["mask"]], cell["S"], P if P > 1 else "1 (2 threads)"]
            for n in names:
                row.append(_fmt(_get(cell, n, P)))
            t = _get(cell, "torch CP", P)
            tag = "W1" if cell["mask"] == "causal" else "W2"
            row.append(f"{_fmt(t)} {tag}" if t else "")
            row.append(_fmt(_get(cell, "dense SDPA", P)))
            errs = [v for r in cell["systems"].values() if r["P"] == P and r["backward"]
                    for v in r["check"].values()]
            row.append(f"{max(errs):.1e}" + (" FAIL" if max(errs) > TOL_OUT else "")
                       if errs else "")
            row.append(f"{cell['load_before'][0]:.1f}→{cell['load_after'][0]:.1f}"
                       + (" (earlier run)" if cell.get("resumed") else ""))
            rows.append(row)
    out.append(tabulate(rows, headers=head, tablefmt="github"))
    errors = {f"{c['mask']} S={c['S']}: {k}": v for c in result["cells"]
              for k, v in c["setup_errors"].items()}
    if errors:
        out += ["", "Not run / failed:", ""] + [f"- {k}: `{v}`" for k, v in errors.items()]
    notes = sorted({f"{k}: {v}" for c in result["cells"] for k, v in c.get("notes", {}).items()})
    if notes:
        out += ["", "Notes: " + "; ".join(notes) + " (torch's per-document balancer needs every "
                "document length divisible by 2P; the packed random documents are not)."]
    # forward only
    fwd_rows = []
    for cell in result["cells"]:
        for P in sorted({r["P"] for r in cell["systems"].values() if not r["backward"]}):
            row = [MASK_TITLES[cell["mask"]], cell["S"], P]
            row += [_fmt(_get(cell, n, P, False)) for n in names]
            tc = _get(cell, "torch CP compiled", P, False)
            row.append(f"{_fmt(tc)} W3" if tc else "not run")
            fwd_rows.append(row)
    if fwd_rows:
        out += ["", "## Forward only vs torch CP with compiled flex (seconds)", ""]
        out.append(tabulate(fwd_rows, headers=["mask", "S", "P"] + [
            n.removeprefix("fringe ") for n in names] + ["torch CP compiled flex"],
            tablefmt="github"))
    # bytes
    brows = []
    for cell in result["cells"]:
        for P in sorted({r["P"] for r in cell["systems"].values() if r["P"] > 1}):
            vals = [cell["systems"].get(f"{n} | P={P} | fwd+bwd", {}).get("sent_bytes")
                    for n in names]
            if any(v is not None for v in vals):
                brows.append([MASK_TITLES[cell["mask"]], cell["S"], P] +
                             ["" if v is None else f"{v / 2 ** 20:.0f}" for v in vals])
    if brows:
        out += ["", "## Bytes sent, forward + backward, all ranks (MiB, fringe's own records)",
                ""]
        out.append(tabulate(brows, headers=["mask", "S", "P"] +
                            [n.removeprefix("fringe ") for n in names], tablefmt="github"))
    # memory
    mrows = []
    for cell in result["cells"]:
        for r in cell["systems"].values():
            if r.get("peak_mib") is not None:
                mrows.append([MASK_TITLES[cell["mask"]], cell["S"], r["P"], r["system"]
                              + (" (W1)" if r["system"] == "torch CP" and cell["mask"] ==
                                 "causal" else " (W2)" if r["system"] == "torch CP" else ""),
                              f"{r['peak_mib']:.0f}"])
    if mrows:
        out += ["", "## Memory: per-rank peak during one forward + backward (MiB)", "",
                "Peak of CPU-allocator bytes live during the step above those live at its "
                "start (inputs and their shards excluded; outputs, gradients, saved tensors "
                "and communication buffers included), from torch.profiler allocation records "
                "(`profile_memory=True`); max over ranks. P=1 is one process.", ""]
        out.append(tabulate(mrows, headers=["mask", "S", "P", "system", "peak MiB"],
                            tablefmt="github"))
    # precision
    if result.get("precision"):
        out += ["", "## Precision: CP error / single-process SDPA error", "",
                "fringe zigzag on the virtual mesh (`fringe.simulate.attention`), causal & "
                f"document ({N_DOCS} docs) mask, S={result['precision'][0]['S']}: relative "
                "error ‖x − ref‖/‖ref‖ against a float64 dense reference, for fringe (CP) and "
                "for single-process SDPA with a bool mask in the same dtype; the ratio is "
                "CP / SDPA (random upstream gradient).", ""]
        prow = []
        for r in result["precision"]:
            prow.append([r["dtype"], r["P"]] + [
                f"{r['ratio'][k]:.2f} ({r['cp_err'][k]:.1e} / {r['sdpa_err'][k]:.1e})"
                for k in ("out", "dq", "dk", "dv")])
        out.append(tabulate(prow, headers=["dtype", "P", "out", "dq", "dk", "dv"],
                            tablefmt="github"))
    # profiles
    profs = [(c, n, p) for c in result["cells"] for n, p in c.get("profiles", {}).items() if p]
    if profs:
        out += ["", "## Profiles (one fringe rank, P=2)", ""]
        for cell, name, prof in profs:
            total = sum(prof["split"].values()) or 1.0
            split = ", ".join(f"{k} {v:.3f} s ({v / total:.0%})" for k, v in prof["split"].items())
            out += [f"### {name}, {MASK_TITLES[cell['mask']]}, S={cell['S']}, P=2", "",
                    f"Rank 0, one fwd+bwd under torch.profiler: {prof['wall']:.3f} s wall; self "
                    f"CPU time: {split}.", "", "```", prof["table"].rstrip(), "```", ""]
    return "\n".join(out) + "\n"


def target_lines(result: dict) -> list[str]:
    return [f"{t['verdict']:4s} {t['target']} [{t['where']}]: {_fmt(t['value'])} "
            f"(target ≤ {t['bound']:g}){' — ' + t['note'] if t['note'] else ''}"
            for t in result["targets"]]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true",
                    help="S=2048, P=2, 2 rounds (torch eager flex: 1), schedules zigzag, ring, "
                         "balanced (the ones the targets name), memory on causal only, no "
                         "compiled flex, no profiles, precision bf16 at S=1024 (< 3 min quiet)")
    ap.add_argument("--rounds", type=int, default=None)
    ap.add_argument("--schedules", nargs="+", default=None,
                    help="fringe schedules to run (default: every registered one)")
    ap.add_argument("--seq-lens", type=int, nargs="+", default=None)
    ap.add_argument("--worlds", type=int, nargs="+", default=None)
    ap.add_argument("--masks", nargs="+", default=None, choices=MASKS)
    ap.add_argument("--prewarm", action="store_true",
                    help="only compile (torch's block masks, compiled flex) into inductor's "
                         "on-disk cache, so a later run's warm-up round is short")
    ap.add_argument("--resume", default=None,
                    help="an earlier run's JSON: its complete cells and precision are kept, "
                         "the rest measured (the report marks resumed cells)")
    ap.add_argument("--no-compiled", action="store_true", help="skip torch compiled flex (W3)")
    ap.add_argument("--markdown", default=None, help="default: BENCHMARKS.md (full run only)")
    ap.add_argument("--json", default=None,
                    help="default: benchmarks/results.json (full) or results-quick.json")
    args = ap.parse_args(argv)
    if args.quick:
        cfg = Config(seq_lens=(2048,), worlds=(2,), rounds=2, compiled_worlds=(),
                     flex_eager_worlds=(2,), profile=False, precision_S=1024, quick=True,
                     memory_masks=("causal",), flex_eager_rounds=1,
                     schedules=("zigzag", "ring", "balanced"), precision_dtypes=("bfloat16",))
    else:
        cfg = Config()
    if args.rounds:
        cfg.rounds = args.rounds
    if args.seq_lens:
        cfg.seq_lens = tuple(args.seq_lens)
    if args.worlds:
        cfg.worlds = tuple(args.worlds)
    if args.masks:
        cfg.masks = tuple(args.masks)
    if args.schedules:
        cfg.schedules = tuple(args.schedules)
    if args.no_compiled:
        cfg.compiled_worlds = ()
    cfg.prewarm = args.prewarm
    if args.resume:
        with open(args.resume) as f:
            old = json.load(f)
        cfg.resume_cells = [c for c in old["cells"] if not c.get("setup_errors")]
        cfg.resume_precision = old.get("precision")
    here = os.path.dirname(os.path.abspath(__file__))
    js = args.json or os.path.join(here, "results-quick.json" if cfg.quick else "results.json")
    md = args.markdown or (None if cfg.quick else os.path.join(os.path.dirname(here),
                                                                "BENCHMARKS.md"))
    reading = kept_reading(md) if md else None

    def write(result):
        with open(js, "w") as f:
            json.dump(result, f, indent=1, default=str)
        if md:
            with open(md, "w") as f:
                f.write(report(result, reading))
    result = run(cfg, checkpoint=write)
    if cfg.prewarm:
        return 0
    write(result)
    if cfg.quick:
        print(f"quick: {', '.join(cfg.masks)} at S={list(cfg.seq_lens)}, P=1 and "
              f"P={list(cfg.worlds)}, schedules {', '.join(result['schedules'])}, "
              f"{cfg.rounds} rounds; not the full benchmark's cells")
    for line in target_lines(result):
        print(line)
    print(f"({result['seconds']:.0f} s; load {result['load_before'][0]:.2f} -> "
          f"{result['load_after'][0]:.2f}; wrote {js}{' and ' + md if md else ''})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
