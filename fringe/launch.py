"""Spawn CPU ranks with gloo and run library functions on them.

``run(fn, world_size=4)`` starts P processes, joins them in a gloo process group through a
``file://`` store in a fresh temporary directory (no fixed ports), calls
``fn(rank, world_size, *args)`` on each and returns the per-rank results, or raises
:class:`LaunchError` with the failing rank and its traceback.

:class:`Workers` keeps the processes (and the process group) alive across calls, which is
how the tests avoid paying the spawn cost per case:

>>> with Workers(2) as w:                                  # doctest: +SKIP
...     w.run(my_fn, 1.0)
...     w.run(other_fn)

``fn`` must be importable (a module-level function), as with any spawned process.
Notebooks should use the in-process virtual mesh (:mod:`fringe.simulate`) instead.

Nothing outlives its launcher:

* **Workers die with their parent.** Each worker runs a watchdog thread that blocks on a
  pipe whose write end only the parent holds; when the parent exits for any reason (SIGKILL
  included) the pipe reaches EOF and the worker exits at once with :data:`ORPHANED_EXIT_CODE`.
  This is portable and, unlike Linux's parent-death signal, does not fire when the thread
  that spawned the workers exits.
* **Temporary directories go on every path that runs cleanup code**: ``close()``, an
  exception in ``start()``, garbage collection, interpreter exit (atexit), and SIGTERM /
  SIGHUP (a handler, installed only where the signal's action is still the default, stops
  the workers, removes the directories and then dies of the same signal, so the exit status
  is the conventional one). Nothing runs after SIGKILL, so directories are named
  ``fringe-launch-<owner pid>-*`` and every launch first removes those whose owner is dead
  (:func:`sweep_stale_dirs`).
* **A broken pool says so.** After a rank dies, a call times out, a rank raises a
  communication failure (``CommTimeout``, ``TimeoutError``, ``torch.distributed.DistError``)
  or a call is interrupted, the process group can no longer be trusted: the pool stops its
  workers and every later ``run`` raises :class:`LaunchError` naming the cause. ``close()``
  and ``start()`` (or a new :class:`Workers`) give a fresh pool.
"""
from __future__ import annotations

import atexit
import datetime
import math
import numbers
import operator
import os
import pickle
import queue as _queue
import re
import shutil
import signal
import tempfile
import threading
import time
import traceback
import weakref
from typing import Any, Callable

import torch.multiprocessing as mp

#: Exit status of a worker whose parent is gone (its lifeline pipe reached EOF).
ORPHANED_EXIT_CODE = 75

DIR_PREFIX = "fringe-launch-"
_DIR_PATTERN = re.compile(re.escape(DIR_PREFIX) + r"(\d+)-")
#: Exceptions (matched by class name anywhere in the MRO) after which the process group
#: cannot be trusted: a peer may be half-way through a transfer.
_BREAKING = frozenset({"CommTimeout", "TimeoutError", "DistError"})
_COLLECT_SLACK_S = 30.0     # the parent waits timeout_s + this before declaring a call lost
_DEAD_GRACE_S = 2.0         # a dead rank's last message may still be in the queue


class LaunchError(RuntimeError):
    """A rank failed (or the launch timed out); ``rank`` and ``remote_traceback`` say where.

    Attributes:
        rank: the rank the message leads with (a rank's own exception is preferred over
            a dead process, and both over a peer's timeout that followed them).
        remote_traceback: that rank's traceback.
        kind: its exception type name, ``"ProcessDied"``, ``"timeout"`` (a call the ranks did
            not answer in time) or ``"broken"`` (a call on a pool that broke earlier).
        errors: rank -> (exception type name, traceback) for every rank that failed.
    """

    def __init__(self, message: str, *, rank: int | None = None, remote_traceback: str = "",
                 kind: str = "", errors: dict | None = None) -> None:
        super().__init__(message)
        self.errors = dict(errors or {})
        self.rank = rank
        self.remote_traceback = remote_traceback
        self.kind = kind


# ---------------------------------------------------------------------------------------------
# the worker side


def _watch_parent(lifeline) -> None:
    """Exit this process as soon as the parent is gone (its end of ``lifeline`` closed)."""
    def wait() -> None:
        try:
            lifeline.recv_bytes()       # the parent never sends: this returns only at EOF
        except (EOFError, OSError):
            pass
        os._exit(ORPHANED_EXIT_CODE)
    threading.Thread(target=wait, name="fringe-lifeline", daemon=True).start()


def _breaks_pool(e: BaseException) -> bool:
    return any(c.__name__ in _BREAKING for c in type(e).__mro__)


def _worker(rank: int, world_size: int, store: str, backend: str, timeout_s: float,
            tasks, results, threads: int, lifeline) -> None:
    _watch_parent(lifeline)
    # Ctrl-C reaches the whole process group: the parent handles it (and stops us)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    import torch
    import torch.distributed as dist
    torch.set_num_threads(threads)
    try:
        dist.init_process_group(backend, init_method=f"file://{store}", rank=rank,
                                world_size=world_size,
                                timeout=datetime.timedelta(seconds=timeout_s))
    except Exception as e:          # noqa: BLE001 — reported to the parent
        results.put((rank, -1, "error", type(e).__name__, traceback.format_exc(), True))
        return
    results.put((rank, -1, "ok", None, "", False))
    while True:
        task = tasks.get()
        if task is None:
            break
        call_id, fn, args, kwargs = task
        try:
            value = fn(rank, world_size, *args, **kwargs)
            results.put((rank, call_id, "ok", value, "", False))
        except BaseException as e:  # noqa: BLE001
            results.put((rank, call_id, "error", type(e).__name__, traceback.format_exc(),
                         _breaks_pool(e)))
    try:
        dist.destroy_process_group()
    except Exception:               # noqa: BLE001
        pass


# ---------------------------------------------------------------------------------------------
# what a started pool owns, and the process-wide cleanup hooks


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:         # someone else's live process
        return True
    except OverflowError:
        return False
    return True


def sweep_stale_dirs(root: str | None = None) -> list[str]:
    """Remove launch directories left behind by launchers that died without cleanup.

    Only directories named ``fringe-launch-<pid>-*``, owned by this user, whose ``<pid>`` is
    no longer a live process, are removed; a live launcher's directory is never touched.
    Every :meth:`Workers.start` calls this first.

    Args:
        root: where to look (default: :func:`tempfile.gettempdir`, where launches put them).

    Returns:
        The paths removed.
    """
    root = root or tempfile.gettempdir()
    removed = []
    try:
        entries = list(os.scandir(root))
    except OSError:
        return removed
    uid = os.getuid() if hasattr(os, "getuid") else None
    for entry in entries:
        m = _DIR_PATTERN.match(entry.name)
        if not m:
            continue
        try:
            if not entry.is_dir(follow_symlinks=False):
                continue
            if uid is not None and entry.stat(follow_symlinks=False).st_uid != uid:
                continue
        except OSError:
            continue
        if not _pid_alive(int(m.group(1))):
            shutil.rmtree(entry.path, ignore_errors=True)
            if not os.path.exists(entry.path):
                removed.append(entry.path)
    return removed


class _Resources:
    """What one started pool holds: its processes, its temp dir, the lifeline's write end."""

    def __init__(self, directory: str) -> None:
        self.owner = os.getpid()        # a forked child must not clean up its parent's pool
        self.directory = directory
        self.procs: list = []
        self.lifeline = None
        self.queues: list = []
        self.released = False

    def release(self, grace_s: float = 0.0, *, force: bool = False) -> None:
        """Stop the processes (after up to ``grace_s`` for them to exit on their own), close
        the lifeline and remove the directory. Idempotent; ``force`` (the signal handler) runs
        it again even if a release it interrupted had begun."""
        if (self.released and not force) or os.getpid() != self.owner:
            return
        self.released = True
        deadline = time.monotonic() + grace_s
        for p in self.procs:
            p.join(timeout=max(0.0, deadline - time.monotonic()))
        for p in self.procs:
            if p.exitcode is None:
                p.terminate()
        for p in self.procs:
            p.join(timeout=5)
            if p.exitcode is None:
                p.kill()
                p.join(timeout=5)
        if self.lifeline is not None:
            self.lifeline.close()       # any worker still alive exits on EOF
        for q in self.queues:
            try:
                q.close()
                q.cancel_join_thread()  # a dead reader must not block our exit
            except Exception:           # noqa: BLE001
                pass
        shutil.rmtree(self.directory, ignore_errors=True)
        _LIVE.discard(self)


_LIVE: set[_Resources] = set()
_HOOKS_INSTALLED = False
_CLEANUP_SIGNALS = tuple(getattr(signal, n) for n in ("SIGTERM", "SIGHUP") if hasattr(signal, n))


def _release_all(force: bool = False) -> None:
    for res in list(_LIVE):
        try:
            res.release(force=force)
        except Exception:               # noqa: BLE001 — best effort on the way out
            pass


def _on_signal(signum: int, frame) -> None:
    """Stop every pool, remove its directory, then die of the same signal (exit status 128+n)."""
    _release_all(force=True)
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)
    os._exit(128 + signum)              # not reached where the default action is to terminate


def _install_cleanup_hooks() -> None:
    """atexit always; SIGTERM/SIGHUP handlers from the main thread, and only where the
    signal's action is still the default (a program's own handler decides for itself)."""
    global _HOOKS_INSTALLED
    if _HOOKS_INSTALLED:
        return
    if threading.current_thread() is not threading.main_thread():
        return                          # signal handlers can only be set from the main thread
    _HOOKS_INSTALLED = True
    atexit.register(_release_all)
    for sig in _CLEANUP_SIGNALS:
        if signal.getsignal(sig) is signal.SIG_DFL:
            signal.signal(sig, _on_signal)


# ---------------------------------------------------------------------------------------------
# the pool


def _last_line(tb: str) -> str:
    lines = [line for line in tb.strip().splitlines() if line.strip()]
    return lines[-1].strip() if lines else ""


class Workers:
    """A pool of P CPU ranks in one gloo process group, reused across calls.

    Args:
        world_size: P.
        timeout_s: how long a call may take before :class:`LaunchError` (and the process
            group's own timeout); a positive, finite number of seconds.
        backend: ``"gloo"`` here; ``"nccl"`` only makes sense with one GPU per rank.
        threads: torch intra-op threads per rank (default: cores / P, at least 1).

    Raises:
        ValueError / TypeError: for arguments that do not fit, saying what was expected.
    """

    def __init__(self, world_size: int, *, timeout_s: float = 120.0, backend: str = "gloo",
                 threads: int | None = None) -> None:
        self.world_size = _positive_int("world_size", world_size)
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, numbers.Real) \
                or not math.isfinite(timeout_s) or timeout_s <= 0:
            raise ValueError(f"timeout_s must be a positive, finite number of seconds, "
                             f"got {timeout_s!r}")
        if not isinstance(backend, str) or not backend:
            raise TypeError(f"backend must be a torch.distributed backend name such as 'gloo', "
                            f"got {backend!r}")
        self.timeout_s = float(timeout_s)
        self.backend = backend
        self.threads = (max(1, (os.cpu_count() or 1) // self.world_size) if threads is None
                        else _positive_int("threads", threads))
        self._res: _Resources | None = None
        self._broken: str | None = None
        self._calls = 0
        self._finalizer = None

    def __enter__(self) -> Workers:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def pids(self) -> list[int]:
        """The worker processes' ids, by rank (empty when not started)."""
        return [p.pid for p in self._res.procs] if self._res is not None else []

    @property
    def directory(self) -> str | None:
        """This pool's temporary directory (the ``file://`` store), or None."""
        return self._res.directory if self._res is not None else None

    @property
    def broken(self) -> str | None:
        """Why this pool can no longer run calls, or None while it is healthy."""
        return self._broken

    def start(self) -> None:
        """Spawn the ranks and join them in a process group.

        Removes stale launch directories first (:func:`sweep_stale_dirs`). On any failure the
        processes started so far are stopped and the directory is removed before the error
        propagates. A pool can be started again after :meth:`close`.

        Raises:
            RuntimeError: if this pool is already running.
            LaunchError: if a rank could not join the process group.
        """
        if self._res is not None:
            raise RuntimeError("this Workers pool is already started; close() it before "
                               "start() again")
        self._broken = None
        sweep_stale_dirs()
        _install_cleanup_hooks()
        res = _Resources(tempfile.mkdtemp(prefix=f"{DIR_PREFIX}{os.getpid()}-"))
        _LIVE.add(res)
        try:
            ctx = mp.get_context("spawn")
            reader, res.lifeline = ctx.Pipe(duplex=False)
            store = os.path.join(res.directory, "store")
            self._results = ctx.Queue()
            self._tasks = [ctx.Queue() for _ in range(self.world_size)]
            res.queues = [self._results, *self._tasks]
            for r in range(self.world_size):
                p = ctx.Process(target=_worker, daemon=True, name=f"fringe-rank-{r}",
                                args=(r, self.world_size, store, self.backend, self.timeout_s,
                                      self._tasks[r], self._results, self.threads, reader))
                p.start()
                res.procs.append(p)
            reader.close()              # only the workers hold the read end now
            self._res = res
            self._finalizer = weakref.finalize(self, _Resources.release, res)
            self._collect(-1, what="joining the process group")
        except BaseException:
            self._res = None
            self._broken = None
            res.release()
            raise

    def run(self, fn: Callable, *args: Any, **kwargs: Any) -> list:
        """Call ``fn(rank, world_size, *args, **kwargs)`` on every rank; results by rank.

        Raises:
            LaunchError: a rank failed (``kind`` is its exception type), died, or the call
                timed out; or this pool broke earlier (``kind == "broken"``).
            TypeError: ``fn`` cannot be sent to the workers (not a module-level function).
            RuntimeError: the pool is not started.
        """
        if self._broken is not None:
            raise LaunchError(f"this Workers pool is broken since {self._broken}; call close() "
                              f"and start a new Workers (or start() this one again)",
                              kind="broken")
        if self._res is None:
            raise RuntimeError("this Workers pool is not started; use 'with Workers(P) as w:' "
                               "or call start()")
        try:
            pickle.dumps(fn)
        except Exception as e:          # noqa: BLE001
            raise TypeError(f"fn must be importable by the workers (a module-level function), "
                            f"got {fn!r}, which cannot be pickled: {e}") from None
        self._calls += 1
        try:
            for q in self._tasks:
                q.put((self._calls, fn, args, kwargs))
            return self._collect(self._calls, what=f"call {self._calls} ({_name(fn)})")
        except LaunchError:
            raise
        except BaseException as e:      # interrupted half-way: the ranks' state is unknown
            self._break(f"call {self._calls} ({_name(fn)}) was interrupted by "
                        f"{type(e).__name__}")
            raise

    def _break(self, cause: str) -> None:
        self._broken = cause
        res, self._res = self._res, None
        if res is not None:
            res.release()

    def _collect(self, call_id: int, *, what: str) -> list:
        out: dict[int, Any] = {}
        errors: dict[int, tuple[str, str]] = {}
        breaking: dict[int, bool] = {}
        deadline = time.monotonic() + self.timeout_s + _COLLECT_SLACK_S
        dead_since: dict[int, float] = {}
        procs = self._res.procs
        while len(out) + len(errors) < self.world_size:
            try:
                rank, cid, status, value, tb, breaks = self._results.get(timeout=0.5)
            except _queue.Empty:
                now = time.monotonic()
                for r, p in enumerate(procs):
                    if r not in out and r not in errors and not p.is_alive():
                        # give its last message a moment to arrive, then call it dead
                        if now - dead_since.setdefault(r, now) > _DEAD_GRACE_S:
                            errors[r] = ("ProcessDied", f"rank {r} exited with code "
                                                        f"{p.exitcode} without answering")
                if now > deadline:
                    missing = sorted(set(range(self.world_size)) - set(out) - set(errors))
                    cause = (f"{what}, when ranks {missing} did not answer within "
                             f"{self.timeout_s + _COLLECT_SLACK_S:g}s")
                    self._break(cause)
                    raise LaunchError(f"ranks {missing} did not answer {what} within "
                                      f"{self.timeout_s + _COLLECT_SLACK_S:g}s", kind="timeout",
                                      errors=errors) from None
                continue
            if cid != call_id:
                continue
            if status == "ok":
                out[rank] = value
            else:
                errors[rank] = (value, tb)
                breaking[rank] = bool(breaks)
        if errors:
            # lead with a rank's own exception, then a dead process, then the timeouts of its
            # peers that usually follow from either
            def order(r: int) -> tuple:
                return (breaking.get(r, False), errors[r][0] == "ProcessDied", r)
            rank = min(errors, key=order)
            kind, tb = errors[rank]
            others = ", ".join(f"rank {r}: {errors[r][0]}" for r in sorted(errors) if r != rank)
            died = sorted(r for r in errors if errors[r][0] == "ProcessDied")
            if died:
                self._break(f"{what}, when {errors[died[0]][1]}")
            elif any(breaking.values()):
                r = min(r for r in breaking if breaking[r])
                self._break(f"{what}, when rank {r} raised "
                            f"{_last_line(errors[r][1]) or errors[r][0]}")
            raise LaunchError(f"rank {rank} failed with {kind} during {what}"
                              + (f" (also failed: {others})" if others else "") + f":\n{tb}",
                              rank=rank, remote_traceback=tb, kind=kind, errors=errors)
        return [out[r] for r in range(self.world_size)]

    def close(self) -> None:
        """Stop the ranks (they finish the current call first, up to 10 s) and remove the
        directory. Idempotent; afterwards :meth:`start` gives a fresh pool."""
        res, self._res = self._res, None
        self._broken = None
        if self._finalizer is not None:
            self._finalizer.detach()
            self._finalizer = None
        if res is None:
            return
        for q in self._tasks:
            try:
                q.put(None)
            except Exception:           # noqa: BLE001
                pass
        res.release(grace_s=10.0)


def _name(fn: Callable) -> str:
    return getattr(fn, "__qualname__", None) or type(fn).__name__


def _positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool):
        raise TypeError(f"{name} must be a positive integer, got {value!r}")
    try:
        n = operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be a positive integer, got {value!r}") from None
    if n < 1:
        raise ValueError(f"{name} must be a positive integer (>= 1), got {n}")
    return n


def run(fn: Callable, *args: Any, world_size: int = 4, timeout_s: float = 120.0,
        backend: str = "gloo", **kwargs: Any) -> list:
    """Spawn ``world_size`` CPU ranks, call ``fn(rank, world_size, *args, **kwargs)`` on each,
    and return the results by rank (raises :class:`LaunchError` on a failure). The ranks and
    their temporary directory are gone when it returns or raises, and if this process is
    terminated (see the module docstring)."""
    with Workers(world_size, timeout_s=timeout_s, backend=backend) as w:
        return w.run(fn, *args, **kwargs)
