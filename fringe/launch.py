"""Spawn CPU ranks with gloo and run library functions on them.

``run(fn, world_size=4)`` starts P processes, joins them in a gloo process group through a
``file://`` store in a fresh temporary directory (no fixed ports), calls
``fn(rank, world_size, *args)`` on each and returns the per-rank results, or raises
:class:`LaunchError` with the first failing rank and its traceback.

:class:`Workers` keeps the processes (and the process group) alive across calls, which is
how the tests avoid paying the spawn cost per case:

>>> with Workers(2) as w:                                  # doctest: +SKIP
...     w.run(my_fn, 1.0)
...     w.run(other_fn)

``fn`` must be importable (a module-level function), as with any spawned process.
Notebooks should use the in-process virtual mesh (:mod:`fringe.simulate`) instead.
"""
from __future__ import annotations

import datetime
import os
import queue as _queue
import shutil
import tempfile
import time
import traceback
from typing import Any, Callable

import torch.multiprocessing as mp


class LaunchError(RuntimeError):
    """A rank failed (or the launch timed out); ``rank`` and ``remote_traceback`` say where."""

    def __init__(self, message: str, *, rank: int | None = None, remote_traceback: str = "",
                 kind: str = "", errors: dict | None = None) -> None:
        super().__init__(message)
        self.errors = dict(errors or {})     # rank -> (exception type name, traceback)
        self.rank = rank
        self.remote_traceback = remote_traceback
        self.kind = kind


def _worker(rank: int, world_size: int, store: str, backend: str, timeout_s: float,
            tasks, results, threads: int) -> None:
    import torch
    import torch.distributed as dist
    torch.set_num_threads(threads)
    try:
        dist.init_process_group(backend, init_method=f"file://{store}", rank=rank,
                                world_size=world_size,
                                timeout=datetime.timedelta(seconds=timeout_s))
    except Exception as e:          # noqa: BLE001 — reported to the parent
        results.put((rank, -1, "error", type(e).__name__, traceback.format_exc()))
        return
    results.put((rank, -1, "ok", None, ""))
    while True:
        task = tasks.get()
        if task is None:
            break
        call_id, fn, args, kwargs = task
        try:
            value = fn(rank, world_size, *args, **kwargs)
            results.put((rank, call_id, "ok", value, ""))
        except BaseException as e:  # noqa: BLE001
            results.put((rank, call_id, "error", type(e).__name__, traceback.format_exc()))
    try:
        dist.destroy_process_group()
    except Exception:               # noqa: BLE001
        pass


class Workers:
    """A pool of P CPU ranks in one gloo process group, reused across calls.

    Args:
        world_size: P.
        timeout_s: how long a call may take before :class:`LaunchError` (and the process
            group's own timeout).
        backend: ``"gloo"`` here; ``"nccl"`` only makes sense with one GPU per rank.
        threads: torch intra-op threads per rank (default: cores / P, at least 1).
    """

    def __init__(self, world_size: int, *, timeout_s: float = 120.0, backend: str = "gloo",
                 threads: int | None = None) -> None:
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        self.world_size = world_size
        self.timeout_s = timeout_s
        self.backend = backend
        self.threads = threads or max(1, (os.cpu_count() or 1) // world_size)
        self._dir: str | None = None
        self._procs: list = []
        self._calls = 0

    def __enter__(self) -> Workers:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def start(self) -> None:
        ctx = mp.get_context("spawn")
        self._dir = tempfile.mkdtemp(prefix="fringe-launch-")
        store = os.path.join(self._dir, "store")
        self._results = ctx.Queue()
        self._tasks = [ctx.Queue() for _ in range(self.world_size)]
        self._procs = [ctx.Process(target=_worker, daemon=True,
                                   args=(r, self.world_size, store, self.backend, self.timeout_s,
                                         self._tasks[r], self._results, self.threads))
                       for r in range(self.world_size)]
        for p in self._procs:
            p.start()
        self._collect(-1)

    def run(self, fn: Callable, *args: Any, **kwargs: Any) -> list:
        """Call ``fn(rank, world_size, *args, **kwargs)`` on every rank; results by rank."""
        if not self._procs:
            raise RuntimeError("Workers not started; use 'with Workers(P) as w:'")
        self._calls += 1
        for q in self._tasks:
            q.put((self._calls, fn, args, kwargs))
        return self._collect(self._calls)

    def _collect(self, call_id: int) -> list:
        out: dict[int, Any] = {}
        errors: dict[int, tuple[str, str]] = {}
        deadline = time.monotonic() + self.timeout_s + 30
        dead_since: dict[int, float] = {}
        while len(out) + len(errors) < self.world_size:
            try:
                rank, cid, status, value, tb = self._results.get(timeout=0.5)
            except _queue.Empty:
                now = time.monotonic()
                for r, p in enumerate(self._procs):
                    if r not in out and r not in errors and not p.is_alive():
                        # give its last message a moment to arrive, then call it dead
                        if now - dead_since.setdefault(r, now) > 2.0:
                            errors[r] = ("ProcessDied", f"rank {r} exited with code "
                                                        f"{p.exitcode} without answering")
                if now > deadline:
                    missing = sorted(set(range(self.world_size)) - set(out) - set(errors))
                    self.close()
                    raise LaunchError(f"ranks {missing} did not answer within "
                                      f"{self.timeout_s + 30:g}s", kind="timeout",
                                      errors=errors) from None
                continue
            if cid != call_id:
                continue
            if status == "ok":
                out[rank] = value
            else:
                errors[rank] = (value, tb)
        if errors:
            rank = min(errors, key=lambda r: (errors[r][0] == "ProcessDied", r))
            kind, tb = errors[rank]
            if any(k == "ProcessDied" for k, _ in errors.values()):
                self.close()          # the process group is broken; the pool cannot be reused
            raise LaunchError(f"rank {rank} failed with {kind}:\n{tb}", rank=rank,
                              remote_traceback=tb, kind=kind, errors=errors)
        return [out[r] for r in range(self.world_size)]

    def close(self) -> None:
        for q in getattr(self, "_tasks", []):
            try:
                q.put(None)
            except Exception:       # noqa: BLE001
                pass
        for p in self._procs:
            p.join(timeout=10)
            if p.is_alive():
                p.terminate()
                p.join(timeout=5)
        self._procs = []
        if self._dir:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None


def run(fn: Callable, *args: Any, world_size: int = 4, timeout_s: float = 120.0,
        backend: str = "gloo", **kwargs: Any) -> list:
    """Spawn ``world_size`` CPU ranks, call ``fn(rank, world_size, *args, **kwargs)`` on each,
    and return the results by rank (raises :class:`LaunchError` on the first failure)."""
    with Workers(world_size, timeout_s=timeout_s, backend=backend) as w:
        return w.run(fn, *args, **kwargs)
