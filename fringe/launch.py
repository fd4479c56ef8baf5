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

``fn`` must be importable (a module-level function), as with any spawned process: spawned
workers re-import ``__main__`` from its file, so a program on standard input, ``python -c`` or
an interactive session cannot launch functions (or pass objects) defined in it. That is
checked in this process before anything is spawned or sent, and the error says what to move
where. Notebooks should use the in-process virtual mesh (:mod:`fringe.simulate`) instead.

Each worker's environment names its own rank (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``,
``LOCAL_WORLD_SIZE``, as torchrun sets them), whatever this process's say.

A worker that dies says why: each worker's stderr passes through this process (to our
stderr, as before) and its last lines travel in the :class:`LaunchError`.

Nothing outlives its launcher:

* **Workers die with their parent.** Each worker runs a watchdog thread that blocks on a
  pipe whose write end only the parent holds; when the parent exits for any reason (SIGKILL
  included) the pipe reaches EOF and the worker exits at once with :data:`ORPHANED_EXIT_CODE`.
  This is portable and, unlike Linux's parent-death signal, does not fire when the thread
  that spawned the workers exits.
* **Temporary directories go on every path that runs cleanup code**: ``close()``, an
  exception in ``start()``, garbage collection, interpreter exit (atexit), and SIGTERM /
  SIGHUP (a handler, installed only where the signal's action is still the default, stops
  the workers, removes the directories, multiprocessing's ``pymp-*`` one included, and then
  dies of the same signal, so the exit status is the conventional one). Nothing runs after
  SIGKILL, so directories are named ``fringe-launch-<owner pid>-*`` and every launch first
  removes those whose owner is dead (:func:`sweep_stale_dirs`).
* **A broken pool says so.** After a rank dies, a call times out, a rank raises a
  communication failure (``CommTimeout``, ``TimeoutError``, ``torch.distributed.DistError``,
  or gloo's timeouts and lost peers, plain RuntimeErrors raised inside torch.distributed)
  or a call is interrupted, the process group can no longer be trusted: the pool stops its
  workers and every later ``run`` raises :class:`LaunchError` naming the cause. ``close()``
  and ``start()`` (or a new :class:`Workers`) give a fresh pool.
* **One rank's failure is not a hang.** Once a rank has raised (any exception: a
  ``ValueError`` or an assertion in user code before a collective, or a communication
  failure) or died, the others have ``peer_grace_s`` (default :data:`PEER_GRACE_S`) to
  finish or raise themselves, as torchrun stops the other workers once one fails. Ranks
  still running then are stopped, with the whole pool (stopped processes included), and
  the :class:`LaunchError` names them (``stopped``). It leads with the first rank's own
  exception (type, message, remote traceback) where one raised: its peers were most likely
  waiting for it in a collective it never joined; where the only failures are a peer's
  timeout or a death, it leads with the silent ranks instead (``kind == "unresponsive"``:
  stopped by SIGSTOP, hung, deadlocked). Errors that every rank reports within the grace (a
  ``RankMismatch``, a ``ValueError`` every rank raises, fringe's invalid-input errors, which
  every rank raises on purpose) leave the pool alive, as does an error on one rank whose
  peers finish their call.
"""
from __future__ import annotations

import atexit
import datetime
import io
import math
import numbers
import operator
import os
import pickle
import queue as _queue
import re
import shutil
import signal
import sys
import tempfile
import textwrap
import threading
import time
import traceback
import weakref
from typing import Any, Callable

import torch.multiprocessing as mp
from multiprocessing import process as _mp_process, util as _mp_util
from multiprocessing.reduction import ForkingPickler

#: Exit status of a worker whose parent is gone (its lifeline pipe reached EOF).
ORPHANED_EXIT_CODE = 75

DIR_PREFIX = "fringe-launch-"
_DIR_PATTERN = re.compile(re.escape(DIR_PREFIX) + r"(\d+)-")
#: Exceptions (matched by class name anywhere in the MRO) after which the process group
#: cannot be trusted: a peer may be half-way through a transfer.
_BREAKING = frozenset({"CommTimeout", "TimeoutError", "DistError"})
#: gloo reports a timeout or a lost peer as a plain RuntimeError; where it is not raised inside
#: torch.distributed (``work.wait(timeout=...)`` in user code), its message says what it is.
_COMM_MESSAGE = re.compile(r"gloo|nccl|timed out|pair closure|connection (reset|closed)", re.I)
_TORCH_DISTRIBUTED = os.sep + os.path.join("torch", "distributed") + os.sep
_COLLECT_SLACK_S = 30.0     # the parent waits timeout_s + this before declaring a call lost
_DEAD_GRACE_S = 2.0         # a dead rank's last message may still be in the queue
#: Default ``peer_grace_s``: how long the other ranks have to answer once one rank raised or
#: died, before the pool is stopped and the ranks still running are named.
PEER_GRACE_S = 5.0
_STDERR_TAIL_BYTES = 8192   # what the parent keeps of each worker's stderr
_STDERR_TAIL_LINES = 12     # ... and how many of its last lines a LaunchError carries
_JOINING = "joining the process group"


class LaunchError(RuntimeError):
    """A rank failed (or the launch timed out); ``rank`` and ``remote_traceback`` say where.

    Attributes:
        rank: the rank the message leads with (a rank's own exception is preferred over
            a dead process, and both over a peer's timeout that followed them).
        remote_traceback: that rank's traceback.
        kind: its exception type name, ``"ProcessDied"``, ``"timeout"`` (a call the ranks did
            not answer in time), ``"unresponsive"`` (``rank`` stayed silent after a peer
            reported a communication failure or died, and no rank raised an exception of its
            own; the pool was stopped), ``"broken"``
            (a call on a pool that broke earlier) or ``"unimportable"`` (this program's
            ``__main__`` cannot be re-imported by spawned workers; nothing was started).
        errors: rank -> (exception type name, traceback) for every rank that failed;
            ``"stopped"`` / ``"unresponsive"`` for a rank the launcher stopped.
        stopped: the ranks still running ``peer_grace_s`` after a peer raised or died, which
            the launcher stopped (with the whole pool); empty when every rank answered.
    """

    def __init__(self, message: str, *, rank: int | None = None, remote_traceback: str = "",
                 kind: str = "", errors: dict | None = None,
                 stopped: list[int] | None = None) -> None:
        super().__init__(message)
        self.errors = dict(errors or {})
        self.stopped = sorted(stopped or [])
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
    """Whether ``e`` leaves the process group untrustworthy: a communication failure by class
    name (:data:`_BREAKING`), or a RuntimeError raised inside torch.distributed or worded as
    one (gloo's timeouts and lost peers: after a timeout gloo closes the pair, and a wait
    abandoned half-way leaves a collective that the next call would be matched with)."""
    if any(c.__name__ in _BREAKING for c in type(e).__mro__):
        return True
    if not isinstance(e, RuntimeError):
        return False
    frames = traceback.extract_tb(e.__traceback__)
    return (any(_TORCH_DISTRIBUTED in f.filename for f in frames)
            or bool(_COMM_MESSAGE.search(str(e))))


def _redirect_stderr(stderr) -> None:
    """Point this process's fd 2 at ``stderr`` (a pipe the parent reads and forwards), so the
    parent sees the last words of a worker that dies (a C++ abort, a fatal error, os._exit)."""
    try:
        sys.stderr.flush()
    except Exception:               # noqa: BLE001
        pass
    os.dup2(stderr.fileno(), 2)
    stderr.close()


def _mp_temp_dir_in(directory: str) -> None:
    """Make multiprocessing's temporary directory (``pymp-*``: the socket through which the
    tensors of a result are shared) a subdirectory of the pool's ``directory``, so that it goes
    with it where this worker cannot remove it itself (stopped by SIGTERM, ``os._exit``, its
    parent SIGKILLed). Left where it is when the socket's path would pass the 108-byte
    limit of a unix socket address."""
    if len(os.path.join(directory, "pymp-12345678", "listener-12345678")) >= 100:
        return
    saved = tempfile.tempdir
    tempfile.tempdir = directory
    try:
        _mp_util.get_temp_dir()         # made now, and kept for this process
    finally:
        tempfile.tempdir = saved


def _worker(rank: int, world_size: int, store: str, backend: str, timeout_s: float,
            tasks, answers, threads: int, lifeline, stderr=None) -> None:
    _watch_parent(lifeline)
    _mp_temp_dir_in(os.path.dirname(store))
    if stderr is not None:
        _redirect_stderr(stderr)
    # Ctrl-C reaches the whole process group: the parent handles it (and stops us)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # what torchrun sets, for this rank: code on a rank that reads the environment (a data
    # loader, torchtitan, HF) must not see the launcher's own variables (it may run under
    # torchrun itself) and take another rank's data
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size))
    import torch
    import torch.distributed as dist
    torch.set_num_threads(threads)

    def answer(call_id: int, value: Any = None, error: BaseException | None = None,
               tb: str = "", breaks: bool = False) -> None:
        # Sent from this thread on this rank's own pipe (no lock shared with other ranks, so a
        # rank that dies or stops cannot hold up its peers' answers). The value is pickled
        # here, so a result that cannot be pickled is reported as such.
        if error is None:
            try:
                answers.send((rank, call_id, "ok", bytes(ForkingPickler.dumps(value)), "", False))
                return
            except Exception as e:  # noqa: BLE001
                error, tb = e, (f"rank {rank}: the result of the call cannot be sent back "
                                f"(it must be picklable): {type(e).__name__}: {e}\n\n"
                                + traceback.format_exc())
        answers.send((rank, call_id, "error", type(error).__name__, tb, breaks))

    try:
        dist.init_process_group(backend, init_method=f"file://{store}", rank=rank,
                                world_size=world_size,
                                timeout=datetime.timedelta(seconds=timeout_s))
    except Exception as e:          # noqa: BLE001 — reported to the parent
        answer(-1, error=e, tb=traceback.format_exc(), breaks=True)
        return
    answer(-1)
    while True:
        task = tasks.get()
        if task is None:
            break
        call_id, payload = task
        try:
            fn, args, kwargs = pickle.loads(payload)
        except BaseException as e:  # noqa: BLE001 — e.g. a function this process cannot import
            answer(call_id, error=e, tb=(f"rank {rank} could not unpickle the call (fn and its "
                                         f"arguments): {type(e).__name__}: {e}\n{_UNPICKLE_FIX}"
                                         f"\n\n" + traceback.format_exc()))
            continue
        try:
            value = fn(rank, world_size, *args, **kwargs)
        except BaseException as e:  # noqa: BLE001
            answer(call_id, error=e, tb=traceback.format_exc(), breaks=_breaks_pool(e))
        else:
            answer(call_id, value)
        del fn, args, kwargs
        value = None
    try:
        dist.destroy_process_group()
    except Exception:               # noqa: BLE001
        pass


def _read_answers(conn, sink: _queue.Queue) -> None:
    """The parent's reader of one rank's answers: into ``sink`` until the rank is gone."""
    try:
        while True:
            sink.put(conn.recv())
    except (EOFError, OSError):
        pass
    finally:
        try:
            conn.close()
        except OSError:
            pass


_UNPICKLE_FIX = ("fn and everything passed to it must be importable by the workers: define "
                 "them at module level in a file the workers can import (not in `python -c`, "
                 "standard input or a notebook)")


# ---------------------------------------------------------------------------------------------
# what this process checks before it spawns or sends anything


def _main_problem() -> tuple[str, str] | None:
    """Why spawned workers cannot re-import this program's ``__main__``, or None.

    Returns ``("path", why)`` where the workers cannot even start (spawn re-runs a
    ``__main__.__file__`` that is not a file, e.g. ``<stdin>``), ``("nofile", why)`` where
    they start but cannot import anything defined in ``__main__`` (``python -c``, an
    interactive session, a package's ``__main__``). Mirrors what
    ``multiprocessing.spawn`` re-imports (``get_preparation_data`` and ``_fixup_main_*``).
    """
    main = sys.modules.get("__main__")
    if main is None:
        return None
    name = getattr(getattr(main, "__spec__", None), "name", None)
    if name == "__main__" or name and name.endswith(".__main__"):
        return ("nofile", f"this program's __main__ is the module {name!r}, which spawned "
                          f"workers do not re-import (a package's or a zip's __main__)")
    if name:
        return None                     # python -m module: the workers import it by name
    path = getattr(main, "__file__", None)
    if path is None:
        return ("nofile", "this program's __main__ has no file (it runs from `python -c`, "
                          "standard input or an interactive session)")
    if os.path.splitext(os.path.basename(path))[0] == "ipython":
        return ("nofile", "this program's __main__ is an IPython session, which spawned "
                          "workers do not re-import")
    if not os.path.isabs(path) and _mp_process.ORIGINAL_DIR is not None:
        path = os.path.join(_mp_process.ORIGINAL_DIR, path)
    if os.path.isfile(path):
        return None
    return ("path", f"this program's __main__ comes from {getattr(main, '__file__')!r}, which "
                    f"is not a file the workers can re-run (spawned workers re-import __main__ "
                    f"from its file; a program on standard input has none)")


def _check_main_can_spawn() -> None:
    problem = _main_problem()
    if problem is not None and problem[0] == "path":
        raise LaunchError(f"fringe.launch cannot start workers from this program: {problem[1]}. "
                          f"Save it to a file and run `python file.py` (with the launching code "
                          f"under `if __name__ == \"__main__\":`), or put the launching code in "
                          f"a module and run `python -m package.module`", kind="unimportable")


class _CallPickler(ForkingPickler):
    """ForkingPickler (torch's tensor sharing included) that notes the functions and classes
    it pickles by reference to ``__main__``."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.main_refs: list[str] = []

    def reducer_override(self, obj):
        if isinstance(obj, type) or callable(obj) and hasattr(obj, "__qualname__"):
            if getattr(obj, "__module__", None) == "__main__":
                name = getattr(obj, "__qualname__", None) or repr(obj)
                if name not in self.main_refs:
                    self.main_refs.append(name)
        return NotImplemented


def _encode_calls(fn: Callable, args: tuple, kwargs: dict, world_size: int) -> list[bytes]:
    """One pickled ``(fn, args, kwargs)`` per rank (torch shares a tensor's memory once per
    pickle, so each rank needs its own), checked here before anything is sent.

    Raises:
        LaunchError: ``__main__`` cannot be re-imported by spawned workers at all.
        TypeError: ``fn`` or an argument cannot be pickled, or refers to ``__main__`` where
            the workers cannot import it.
    """
    _check_main_can_spawn()
    problem = _main_problem()
    check_main = problem is not None and problem[0] == "nofile"
    payloads = []
    for r in range(world_size):
        buf = io.BytesIO()
        pickler = (_CallPickler if check_main else ForkingPickler)(buf)
        try:
            pickler.dump((fn, args, kwargs))
        except Exception as e:          # noqa: BLE001
            try:
                pickle.dumps(fn)
            except Exception:           # noqa: BLE001
                raise TypeError(f"fn must be importable by the workers (a module-level "
                                f"function), got {fn!r}, which cannot be pickled: {e}") from None
            raise TypeError(f"the arguments of {_name(fn)} cannot be sent to the workers: "
                            f"{type(e).__name__}: {e}") from None
        if check_main and pickler.main_refs:
            names = ", ".join(pickler.main_refs)
            raise TypeError(f"{names} (passed to the workers as fn or in its arguments) is "
                            f"defined in __main__, which the workers cannot import: "
                            f"{problem[1]}. Move it into a module file and import it from "
                            f"there, or save this program to a file and run `python file.py` "
                            f"(with the launching code under `if __name__ == \"__main__\":`)")
        payloads.append(buf.getvalue())
        check_main = False              # the same objects: one check is enough
    return payloads


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


class _StderrTail:
    """Forwards one worker's stderr (the read end of its pipe) to ours and keeps its last
    bytes, so a worker that dies can say why. Data written before a worker died stays in the
    pipe, so nothing is lost to a crash; the pump ends at EOF (every write end closed)."""

    def __init__(self, reader, rank: int) -> None:
        self._reader = reader
        self._buf = bytearray()
        self._lock = threading.Lock()
        self.done = threading.Event()
        threading.Thread(target=self._pump, name=f"fringe-stderr-{rank}", daemon=True).start()

    def _pump(self) -> None:
        fd = self._reader.fileno()
        try:
            while True:
                data = os.read(fd, 65536)
                if not data:
                    break
                with self._lock:
                    self._buf += data
                    del self._buf[:-_STDERR_TAIL_BYTES]
                view = memoryview(data)
                try:
                    while view:
                        view = view[os.write(2, view):]
                except OSError:             # no stderr here: the tail is still kept
                    pass
        except OSError:
            pass
        finally:
            try:
                self._reader.close()
            except OSError:
                pass
            self.done.set()

    def text(self, wait_s: float = 0.0) -> str:
        """The last lines the worker wrote (after up to ``wait_s`` for its pipe to drain)."""
        self.done.wait(wait_s)
        with self._lock:
            data = bytes(self._buf)
        lines = [ln.rstrip() for ln in data.decode(errors="replace").splitlines() if ln.strip()]
        return "\n".join(lines[-_STDERR_TAIL_LINES:])


# an exception line of a Python traceback (unindented ``Name: message``), or a fatal message
_ERROR_LINE = re.compile(r"^[A-Za-z_][\w.]*: |terminate called|what\(\):|Fatal Python error|"
                         r"Segmentation fault|Aborted|Killed")


def _error_line(text: str) -> str:
    """The line of a stderr tail that most likely names the error (the last one that looks
    like an exception or a fatal message, else the last line)."""
    lines = text.splitlines()
    for line in reversed(lines):
        if _ERROR_LINE.search(line):
            return line.strip()
    return lines[-1].strip() if lines else ""


def _exit_words(code: int | None) -> str:
    if code is not None and code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


class _Resources:
    """What one started pool holds: its processes, its temp dir, the lifeline's write end,
    the read ends of the workers' stderr pipes."""

    def __init__(self, directory: str) -> None:
        self.owner = os.getpid()        # a forked child must not clean up its parent's pool
        self.directory = directory
        self.procs: list = []
        self.lifeline = None
        self.queues: list = []
        self.tails: list[_StderrTail] = []
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
                _continue(p)            # a stopped (SIGSTOP) worker acts on SIGTERM only then
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


def _continue(p) -> None:
    if hasattr(signal, "SIGCONT") and p.pid is not None:
        try:
            os.kill(p.pid, signal.SIGCONT)
        except OSError:
            pass


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
    """Stop every pool, remove its directory, then die of the same signal (exit status 128+n).

    Dying of the signal skips interpreter exit, so multiprocessing's own temporary directory
    (``pymp-*``: the socket through which sent tensors' file descriptors are shared) is
    removed here too, as its exit hook would have."""
    _release_all(force=True)
    try:
        shutil.rmtree(_mp_util.get_temp_dir(), ignore_errors=True)
    except Exception:                   # noqa: BLE001 — best effort on the way out
        pass
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
        peer_grace_s: once a rank raised (any exception) or died, how long the other ranks
            have to finish or raise before they are stopped with the whole pool and
            :class:`LaunchError` names them (default :data:`PEER_GRACE_S`); a finite number of
            seconds >= 0. Set it above the longest a rank may go on working after a peer
            raised (a rank that does not talk to its peers for that long).

    Raises:
        ValueError / TypeError: for arguments that do not fit, saying what was expected.
    """

    def __init__(self, world_size: int, *, timeout_s: float = 120.0, backend: str = "gloo",
                 threads: int | None = None, peer_grace_s: float = PEER_GRACE_S) -> None:
        self.world_size = _positive_int("world_size", world_size)
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, numbers.Real) \
                or not math.isfinite(timeout_s) or timeout_s <= 0:
            raise ValueError(f"timeout_s must be a positive, finite number of seconds, "
                             f"got {timeout_s!r}")
        if isinstance(peer_grace_s, bool) or not isinstance(peer_grace_s, numbers.Real) \
                or not math.isfinite(peer_grace_s) or peer_grace_s < 0:
            raise ValueError(f"peer_grace_s must be a finite number of seconds >= 0, "
                             f"got {peer_grace_s!r}")
        self.peer_grace_s = float(peer_grace_s)
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
        self._call_lock = threading.Lock()     # one call at a time: answers carry its id
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
            LaunchError: if a rank could not join the process group, or (before anything
                is spawned) this program's ``__main__`` cannot be re-imported by spawned
                workers (``kind == "unimportable"``: a program on standard input).
        """
        if self._res is not None:
            raise RuntimeError("this Workers pool is already started; close() it before "
                               "start() again")
        _check_main_can_spawn()
        self._broken = None
        sweep_stale_dirs()
        _install_cleanup_hooks()
        res = _Resources(tempfile.mkdtemp(prefix=f"{DIR_PREFIX}{os.getpid()}-"))
        _LIVE.add(res)
        try:
            ctx = mp.get_context("spawn")
            reader, res.lifeline = ctx.Pipe(duplex=False)
            store = os.path.join(res.directory, "store")
            self._answers = _queue.Queue()     # every rank's answers, read by threads
            self._tasks = [ctx.Queue() for _ in range(self.world_size)]
            res.queues = list(self._tasks)
            for r in range(self.world_size):
                ans_r, ans_w = ctx.Pipe(duplex=False)
                err_r, err_w = ctx.Pipe(duplex=False)
                try:
                    p = ctx.Process(target=_worker, daemon=True, name=f"fringe-rank-{r}",
                                    args=(r, self.world_size, store, self.backend,
                                          self.timeout_s, self._tasks[r], ans_w,
                                          self.threads, reader, err_w))
                    p.start()
                except BaseException:
                    ans_r.close()
                    err_r.close()
                    raise
                finally:
                    ans_w.close()       # only the worker holds the write ends: EOF when it dies
                    err_w.close()
                res.procs.append(p)
                threading.Thread(target=_read_answers, args=(ans_r, self._answers), daemon=True,
                                 name=f"fringe-answers-{r}").start()
                res.tails.append(_StderrTail(err_r, r))
            reader.close()              # only the workers hold the read end now
            self._res = res
            self._finalizer = weakref.finalize(self, _Resources.release, res)
            self._collect(-1, what=_JOINING)
        except BaseException:
            self._res = None
            self._broken = None
            res.release()
            raise

    def run(self, fn: Callable, *args: Any, **kwargs: Any) -> list:
        """Call ``fn(rank, world_size, *args, **kwargs)`` on every rank; results by rank.
        Calls from several threads run one after another, each getting its own results.

        Raises:
            LaunchError: a rank failed (``kind`` is its exception type; ranks still running
                ``peer_grace_s`` later are stopped with the pool and named in ``stopped``),
                died, stayed silent after a peer's communication failure or death
                (``"unresponsive"``), or the call timed out; or this pool broke earlier
                (``kind == "broken"``).
            TypeError: ``fn`` or an argument cannot be sent to the workers (not picklable,
                or defined in a ``__main__`` the workers cannot import: ``python -c``, an
                interactive session); checked before anything is sent.
            RuntimeError: the pool is not started.
        """
        self._check_usable()
        return self._run_payloads(fn, _encode_calls(fn, args, kwargs, self.world_size))

    def _check_usable(self) -> None:
        if self._broken is not None:
            raise LaunchError(f"this Workers pool is broken since {self._broken}; call close() "
                              f"and start a new Workers (or start() this one again)",
                              kind="broken")
        if self._res is None:
            raise RuntimeError("this Workers pool is not started; use 'with Workers(P) as w:' "
                               "or call start()")

    def _run_payloads(self, fn: Callable, payloads: list[bytes]) -> list:
        with self._call_lock:           # calls from several threads run one after another
            self._check_usable()
            self._calls += 1
            call = self._calls
            try:
                for q, payload in zip(self._tasks, payloads):
                    q.put((call, payload))
                return self._collect(call, what=f"call {call} ({_name(fn)})")
            except LaunchError:
                raise
            except BaseException as e:  # interrupted half-way: the ranks' state is unknown
                self._break(f"call {call} ({_name(fn)}) was interrupted by "
                            f"{type(e).__name__}")
                raise

    def _break(self, cause: str) -> None:
        """Stop the pool (a stopped or hung worker included) and remember why."""
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
        raised: list[int] = []                # ranks whose fn raised, in the order they did
        silent_after: float | None = None     # set when a rank raised or died
        procs = self._res.procs
        while len(out) + len(errors) < self.world_size:
            try:
                msg = self._answers.get(timeout=0.5)
            except _queue.Empty:
                msg = None
            now = time.monotonic()
            if msg is not None:
                rank, cid, status, value, tb, breaks = msg
                if cid != call_id:
                    continue
                if status == "ok":
                    try:
                        out[rank] = pickle.loads(value)
                    except Exception as e:      # noqa: BLE001 — e.g. a class we cannot import
                        errors[rank] = (type(e).__name__, f"the result of rank {rank} cannot be "
                                        f"unpickled here: {type(e).__name__}: {e}")
                        breaking[rank] = False
                else:
                    errors[rank] = (value, tb)
                    breaking[rank] = bool(breaks)
                    raised.append(rank)
                    # its peers may be waiting for it in a collective it will never join:
                    # they have peer_grace_s to answer (an error every rank raises, such as a
                    # RankMismatch, arrives from all of them well within it)
                    if silent_after is None:
                        silent_after = now + self.peer_grace_s
                continue
            for r, p in enumerate(procs):
                if r not in out and r not in errors and not p.is_alive():
                    # give its last message a moment to arrive, then call it dead
                    if now - dead_since.setdefault(r, now) > _DEAD_GRACE_S:
                        errors[r] = ("ProcessDied", self._died(r, p, what))
                        if silent_after is None:
                            silent_after = now + self.peer_grace_s
            missing = sorted(set(range(self.world_size)) - set(out) - set(errors))
            if missing and silent_after is not None and now > silent_after:
                self._silent(missing, errors, breaking, raised, what)
            if now > deadline:
                cause = (f"{what}, when ranks {missing} did not answer within "
                         f"{self.timeout_s + _COLLECT_SLACK_S:g}s")
                self._break(cause)
                # a rank's own exception usually explains why its peers wait: name it
                failed = "; ".join(f"rank {r} raised {_last_line(errors[r][1]) or errors[r][0]}"
                                   for r in sorted(errors))
                raise LaunchError(f"ranks {missing} did not answer {what} within "
                                  f"{self.timeout_s + _COLLECT_SLACK_S:g}s"
                                  + (f" (before that: {failed})" if failed else ""),
                                  kind="timeout", errors=errors, stopped=missing) from None
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
                self._break(f"{what}, when {errors[died[0]][1].splitlines()[0]}")
            elif any(breaking.values()):
                r = min(r for r in breaking if breaking[r])
                self._break(f"{what}, when rank {r} raised "
                            f"{_last_line(errors[r][1]) or errors[r][0]}")
            raise LaunchError(f"rank {rank} failed with {kind} during {what}"
                              + (f" (also failed: {others})" if others else "") + f":\n{tb}",
                              rank=rank, remote_traceback=tb, kind=kind, errors=errors)
        return [out[r] for r in range(self.world_size)]

    def _died(self, r: int, p, what: str) -> str:
        """What a dead rank left: its exit status and the last lines of its stderr."""
        text = f"rank {r} {_exit_words(p.exitcode)} without answering"
        tail = self._res.tails[r].text(wait_s=1.0) if r < len(self._res.tails) else ""
        if tail:
            line = _error_line(tail)
            text += (f" ({line})" if line else "") + \
                f"; the last lines of its stderr:\n" + textwrap.indent(tail, "    ")
        elif what == _JOINING:
            text += ("; it wrote nothing once it started, so it most likely failed while "
                     "starting (re-importing this program's __main__: the launching code "
                     "must sit under `if __name__ == \"__main__\":`); its error is on stderr "
                     "above")
        return text

    def _silent(self, missing: list[int], errors: dict, breaking: dict, raised: list[int],
                what: str):
        """Ranks still running ``peer_grace_s`` after a peer raised or died: stop the pool (a
        stopped process included) and raise.

        Where a rank raised an exception of its own (not a communication failure), the error
        leads with it: the ranks still running were most likely waiting for it in a collective
        it never joined. Otherwise (a peer timed out or died) it leads with the silent ranks,
        which most likely caused that (stopped by SIGSTOP, hung, deadlocked)."""
        own = [r for r in raised if not breaking.get(r, False)]
        if own:
            self._stop_waiting(missing, errors, own[0], what)
        died = sorted(r for r in errors if errors[r][0] == "ProcessDied")
        cause_rank = died[0] if died else min(r for r in breaking if breaking[r])
        kind, tb = errors[cause_rank]
        cause = (errors[cause_rank][1].splitlines()[0] if died else
                 f"rank {cause_rank} raised {_last_line(tb) or kind}")
        ranks = (f"rank {missing[0]}" if len(missing) == 1 else f"ranks {missing}")
        silent = (f"{ranks} did not answer {what} within {self.peer_grace_s:g}s after {cause}")
        self._break(silent)
        for r in missing:
            errors[r] = ("unresponsive", f"rank {r} did not answer within "
                                          f"{self.peer_grace_s:g}s after {cause}")
        others = ", ".join(f"rank {r}: {errors[r][0]}" for r in sorted(errors)
                           if r not in missing)
        raise LaunchError(f"{silent}; the pool was stopped ({ranks} may be stopped (SIGSTOP), "
                          f"hung or deadlocked; peer_grace_s= sets the wait). Failed: {others}; "
                          f"rank {cause_rank}'s report:\n{tb}",
                          rank=missing[0], remote_traceback=tb, kind="unresponsive",
                          errors=errors, stopped=missing)

    def _stop_waiting(self, missing: list[int], errors: dict, cause_rank: int, what: str):
        """Rank ``cause_rank`` raised and ``missing`` are still running ``peer_grace_s`` later
        (most likely waiting for it in a collective): stop the pool and raise its exception,
        naming the ranks that were stopped (as torchrun stops the other workers once one
        fails)."""
        kind, tb = errors[cause_rank]
        last = _last_line(tb) or kind
        ranks, was = ((f"rank {missing[0]}", "was") if len(missing) == 1
                      else (f"ranks {missing}", "were"))
        self._break(f"{what}, when {ranks} {was} still running {self.peer_grace_s:g}s after "
                    f"rank {cause_rank} raised {last} and {was} stopped")
        for r in missing:
            errors[r] = ("stopped", f"rank {r} was still running {self.peer_grace_s:g}s after "
                                    f"rank {cause_rank} raised {last}, and was stopped")
        others = ", ".join(f"rank {r}: {errors[r][0]}" for r in sorted(errors)
                           if r != cause_rank and r not in missing)
        raise LaunchError(
            f"rank {cause_rank} failed with {kind} during {what}: {last}\n"
            f"{ranks} {was} still running {self.peer_grace_s:g}s later (most likely waiting for "
            f"rank {cause_rank} in a collective it never joined) and {was} stopped, with the "
            f"whole pool: the pool is broken (close() and start() it again, or use a new "
            f"Workers; peer_grace_s= sets the wait)."
            + (f" Also failed: {others}." if others else "")
            + f"\nrank {cause_rank}'s traceback:\n{tb}",
            rank=cause_rank, remote_traceback=tb, kind=kind, errors=errors, stopped=missing)

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
    w = Workers(world_size, timeout_s=timeout_s, backend=backend)
    payloads = _encode_calls(fn, args, kwargs, w.world_size)   # checked before any spawn
    with w:
        return w._run_payloads(fn, payloads)
