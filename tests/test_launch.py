"""The launcher leaves nothing behind: workers die with their parent (SIGTERM, SIGKILL), temp
dirs go on every path that can run cleanup and stale ones are swept at the next launch, a
failed start leaks nothing, and a pool broken by a timeout or a dead rank says so and restarts.

No clocks are asserted: where a process must die we poll with a generous deadline. Process
spawns are few (each costs seconds of torch import): two parents of two workers each (one
in ``run``, one holding a ``Workers`` pool), run side by side, one failed single-rank start,
one pool started twice, and one pool shared by the failure tests at the end (started twice).
The launches from ``python -c`` and standard input spawn no worker: they fail before that.
"""
from __future__ import annotations

import json
import multiprocessing
import os
import select
import signal
import subprocess
import sys
import tempfile
import textwrap
import time

import pytest
import torch

from fringe import launch
from fringe.launch import LaunchError, Workers

DEADLINE_S = 120.0       # generous: the box is 2 shared cores and torch imports take seconds
STARTUP_DEADLINE_S = 300.0   # three torch imports per launcher, two launchers side by side

PARENT = textwrap.dedent("""
    import json, os, sys, time
    from fringe.launch import Workers, run

    def hold(rank, world_size, x=None):
        # one write per line (below PIPE_BUF, so atomic): the ranks share the parent's stdout
        env = {k: os.environ.get(k) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK",
                                              "LOCAL_WORLD_SIZE")}
        sys.stdout.write(json.dumps({"rank": rank, "pid": os.getpid(), "env": env}) + "\\n")
        sys.stdout.flush()
        time.sleep(600)

    if __name__ == "__main__":
        if sys.argv[1] == "run":
            # a tensor argument: sending it starts multiprocessing's fd sharer (its socket
            # in a pymp-* directory of TMPDIR, removed at exit)
            import torch
            run(hold, torch.zeros(2), world_size=2, timeout_s=600)  # blocked here
        else:
            w = Workers(2, timeout_s=600)
            w.start()
            print(json.dumps({"pids": w.pids, "dir": w.directory}), flush=True)
            w.run(hold)
""")


def _gone(pid: int) -> bool:
    """True once ``pid`` is no longer a running process (exited, or a zombie not yet reaped
    by whoever inherited it)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except (OSError, IndexError):
        return False


def _wait_gone(pids: list[int], deadline_s: float = DEADLINE_S) -> list[int]:
    """Poll until every pid is gone or the deadline passes; returns those still alive."""
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        alive = [p for p in pids if not _gone(p)]
        if not alive:
            return []
        time.sleep(0.2)
    return [p for p in pids if not _gone(p)]


def _read_lines(proc: subprocess.Popen, n: int) -> list[dict]:
    """The first ``n`` JSON lines the process prints, read from the raw pipe (a buffered
    readline could swallow several lines while select() then sees an empty pipe)."""
    fd, data = proc.stdout.fileno(), b""
    end = time.monotonic() + STARTUP_DEADLINE_S
    while data.count(b"\n") < n and time.monotonic() < end:
        ready, _, _ = select.select([fd], [], [], 0.5)
        chunk = os.read(fd, 65536) if ready else b""
        data += chunk
        if not chunk and proc.poll() is not None:
            break
    lines = [json.loads(line) for line in data.split(b"\n")[:n] if line.strip()]
    if len(lines) < n:
        code = proc.poll()
        proc.kill()
        proc.wait(timeout=30)
        raise AssertionError(f"the parent script (exit status {code}) reported {lines}, "
                             f"expected {n} lines; its stderr is in "
                             f"{os.path.join(os.path.dirname(proc.args[1]), proc.args[2])}.stderr")
    return lines


@pytest.fixture(scope="module")
def parents(tmp_path_factory):
    """Two launchers whose 2 workers are busy in a call: ``fringe.launch.run`` (to SIGTERM)
    and a :class:`Workers` pool (to SIGKILL), started side by side to pay the spawn cost
    once. Each reports its worker pids and temp dir."""
    root = tmp_path_factory.mktemp("launch")
    script = root / "parent.py"
    script.write_text(PARENT)
    procs, infos = {}, {}
    for name, mode in (("term", "run"), ("kill", "workers")):
        tmp = root / name
        tmp.mkdir()
        # a launcher that itself runs under torchrun: its rank variables are not the workers'
        env = dict(os.environ, TMPDIR=str(tmp), PYTHONUNBUFFERED="1", RANK="5", WORLD_SIZE="8",
                   LOCAL_RANK="5", LOCAL_WORLD_SIZE="8")
        with open(root / f"{mode}.stderr", "wb") as err:     # a file: it never fills up
            procs[name] = subprocess.Popen([sys.executable, str(script), mode],
                                           stdout=subprocess.PIPE, stderr=err, env=env, cwd=root)
    try:
        for name, proc in procs.items():
            tmp = root / name
            if name == "kill":
                pool, *held = _read_lines(proc, 3)          # the pool, then both ranks in hold
                assert sorted(h["pid"] for h in held) == sorted(pool["pids"])
                pids, directory = pool["pids"], pool["dir"]
            else:
                held = _read_lines(proc, 2)
                pids = [h["pid"] for h in held]
                dirs = list(tmp.glob(f"fringe-launch-{proc.pid}-*"))
                assert len(dirs) == 1, dirs
                directory = str(dirs[0])
            infos[name] = dict(pids=pids, dir=directory, proc=proc, tmp=tmp, held=held)
        yield infos
    finally:
        for name, proc in procs.items():         # only if a test failed half-way
            if proc.poll() is None:
                proc.kill()
            proc.wait(timeout=30)
            proc.stdout.close()
            for pid in infos.get(name, {}).get("pids", []):
                if not _gone(pid):
                    os.kill(pid, signal.SIGKILL)


def test_each_worker_environment_names_its_own_rank(parents):
    # code on a rank that reads RANK / LOCAL_RANK (torchtitan, HF, a data loader) must see
    # that rank, not the launcher's own torchrun variables
    for name in ("term", "kill"):
        for held in parents[name]["held"]:
            r = held["rank"]
            assert held["env"] == {"RANK": str(r), "WORLD_SIZE": "2", "LOCAL_RANK": str(r),
                                   "LOCAL_WORLD_SIZE": "2"}, (name, held)


def test_sigterm_to_a_run_launcher_stops_its_workers_and_removes_its_dir(parents):
    info = parents["term"]
    proc = info["proc"]
    assert os.path.isdir(info["dir"]) and os.path.basename(info["dir"]).startswith(
        f"fringe-launch-{proc.pid}-")
    assert not any(_gone(pid) for pid in info["pids"]), "workers should be running"
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=DEADLINE_S)          # (its workers still hold its stdout)
    assert proc.returncode == -signal.SIGTERM      # it still dies of the signal (shell: 143)
    assert not os.path.exists(info["dir"])         # the handler removed it before dying
    assert _wait_gone(info["pids"]) == []
    # ... and multiprocessing's directory too (dying of the signal skips its exit hook)
    assert os.listdir(info["tmp"]) == []


def test_sigkill_to_a_pool_launcher_stops_its_workers_and_the_next_launch_sweeps(parents):
    info = parents["kill"]
    proc = info["proc"]
    assert not any(_gone(pid) for pid in info["pids"]), "workers should be running"
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=DEADLINE_S)          # (its workers still hold its stdout)
    assert proc.returncode == -signal.SIGKILL
    # nothing ran in the parent: the workers saw their lifeline close and exited by themselves
    assert _wait_gone(info["pids"]) == []
    assert os.path.isdir(info["dir"])              # ... and the directory is still there
    live = info["tmp"] / f"fringe-launch-{os.getpid()}-live"      # a live owner's: kept
    live.mkdir()
    swept = launch.sweep_stale_dirs(str(info["tmp"]))
    assert [os.path.realpath(d) for d in swept] == [os.path.realpath(info["dir"])]
    assert not os.path.exists(info["dir"]) and live.is_dir()


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()                                   # reaped: its pid names no process now
    return child.pid


def test_a_failing_start_leaks_nothing_and_sweeps_stale_dirs_first(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    stale = tmp_path / f"fringe-launch-{_dead_pid()}-stale"
    stale.mkdir()
    (stale / "store").write_text("left by a launcher that was SIGKILLed")
    w = Workers(1, backend="not-a-backend", timeout_s=60)
    with pytest.raises(LaunchError) as info:
        w.start()
    assert info.value.rank == 0 and "not-a-backend" in info.value.remote_traceback
    assert "joining the process group" in str(info.value)
    assert os.listdir(tmp_path) == []              # its own dir removed, the stale one swept
    assert w.pids == [] and w.directory is None
    assert not [p for p in multiprocessing.active_children() if p.name.startswith("fringe-rank")]


def ranks_and_pids(rank: int, world_size: int):
    return rank, os.getpid()


def comm_timeout_on_rank_1(rank: int, world_size: int):
    if rank == 1:
        from fringe.runtime.distributed import CommTimeout
        raise CommTimeout("rank 1, step 0: recv of kv from rank 0 did not complete within 3s")
    return rank


def rank_1_dies(rank: int, world_size: int):
    if rank == 1:
        os._exit(3)
    return rank


def value_error_on_rank_1(rank: int, world_size: int):
    if rank == 1:
        raise ValueError("bad input on rank 1")
    return rank


def test_a_broken_pool_names_its_cause_and_restarts(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    w = Workers(2, timeout_s=60)
    with pytest.raises(RuntimeError, match="not started"):
        w.run(ranks_and_pids)
    w.start()
    try:
        with pytest.raises(RuntimeError, match="already started"):
            w.start()
        with pytest.raises(TypeError, match="module-level function"):
            w.run(lambda rank, world_size: rank)
        first = w.pids
        assert [r for r, _ in w.run(ranks_and_pids)] == [0, 1]
        # an ordinary exception on one rank leaves the pool usable
        with pytest.raises(LaunchError, match="rank 1 failed with ValueError"):
            w.run(value_error_on_rank_1)
        assert w.broken is None and [pid for _, pid in w.run(ranks_and_pids)] == first

        with pytest.raises(LaunchError) as info:
            w.run(comm_timeout_on_rank_1)
        assert info.value.kind == "CommTimeout" and info.value.rank == 1
        with pytest.raises(LaunchError, match="this Workers pool is broken since") as info:
            w.run(ranks_and_pids)
        msg = str(info.value)
        assert info.value.kind == "broken"
        assert "comm_timeout_on_rank_1" in msg and "CommTimeout: rank 1, step 0" in msg
        assert "call close()" in msg
        assert _wait_gone(first) == [] and os.listdir(tmp_path) == []

        w.close()
        w.start()                                  # restartable: a fresh group, new processes
        second = w.pids
        assert set(second).isdisjoint(first)
        assert w.run(ranks_and_pids) == [(0, second[0]), (1, second[1])]
        with pytest.raises(LaunchError) as info:
            w.run(rank_1_dies)
        assert info.value.kind == "ProcessDied" and info.value.rank == 1
        with pytest.raises(LaunchError, match="broken since") as info:
            w.run(ranks_and_pids)
        assert "rank_1_dies" in str(info.value) and "rank 1 exited with code 3" in str(info.value)
        assert _wait_gone(second) == [] and os.listdir(tmp_path) == []
    finally:
        w.close()
    assert w.broken is None and w.pids == [] and os.listdir(tmp_path) == []


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(world_size=0), ValueError, "world_size must be a positive integer"),
    (dict(world_size=1.5), TypeError, "world_size must be a positive integer"),
    (dict(world_size=True), TypeError, "world_size must be a positive integer"),
    (dict(world_size=2, timeout_s=0), ValueError, "timeout_s must be a positive, finite"),
    (dict(world_size=2, timeout_s=-1), ValueError, "timeout_s must be a positive, finite"),
    (dict(world_size=2, timeout_s=float("inf")), ValueError, "timeout_s must be a positive"),
    (dict(world_size=2, timeout_s=float("nan")), ValueError, "timeout_s must be a positive"),
    (dict(world_size=2, threads=0), ValueError, "threads must be a positive integer"),
    (dict(world_size=2, backend=""), TypeError, "backend must be"),
])
def test_workers_validate_their_arguments(kwargs, error, match):
    with pytest.raises(error, match=match):
        Workers(**kwargs)


def test_numpy_integer_world_size_is_accepted():
    import numpy as np
    assert Workers(np.int64(3)).world_size == 3


# ---------------------------------------------------------------------------------------------
# loud failures that say why: an unimportable __main__, a dying rank's stderr, a silent rank

MAIN_SCRIPT = textwrap.dedent("""
    import json, multiprocessing
    from fringe import launch

    def hello(rank, world_size):
        return rank

    try:
        launch.run(hello, world_size=2, timeout_s=60)
        out = {"error": None}
    except Exception as e:
        out = {"error": type(e).__name__, "message": str(e)}
    out["children"] = [p.name for p in multiprocessing.active_children()]
    print(json.dumps(out))
""")


@pytest.mark.parametrize("how", ["python -c", "stdin"])
def test_launch_from_an_unimportable_main_says_what_to_move_before_spawning(tmp_path, how):
    env = dict(os.environ, TMPDIR=str(tmp_path))
    cmd = [sys.executable, "-c", MAIN_SCRIPT] if how == "python -c" else [sys.executable, "-"]
    proc = subprocess.run(cmd, input=None if how == "python -c" else MAIN_SCRIPT, env=env,
                          cwd=tmp_path, capture_output=True, text=True, timeout=DEADLINE_S)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    if how == "python -c":      # workers would start, but cannot import __main__.hello
        assert out["error"] == "TypeError", out
        assert "hello" in out["message"] and "defined in __main__" in out["message"]
        assert "`python -c`" in out["message"] and "Move it into a module file" in out["message"]
    else:                       # spawn would re-run '<stdin>' as a file: nothing can start
        assert out["error"] == "LaunchError", out
        assert "'<stdin>'" in out["message"] and "Save it to a file" in out["message"]
    assert "without answering" not in out["message"]
    assert out["children"] == [] and os.listdir(tmp_path) == []      # nothing was spawned
    assert "Traceback" not in proc.stderr                             # no worker said a word


def test_workers_check_main_references_in_the_arguments_before_sending(monkeypatch):
    """A class defined in a file-less ``__main__`` cannot be sent: said in this process,
    without starting workers (``run`` encodes the call before it spawns)."""
    import types
    main = types.ModuleType("__main__")           # as in `python -c`: no __file__, no spec
    exec("class Point:\n    pass\n", main.__dict__)
    monkeypatch.setitem(sys.modules, "__main__", main)
    with pytest.raises(TypeError, match=r"Point \(passed to the workers as fn or in its "
                                        r"arguments\) is defined in __main__"):
        launch.run(echo_rank, main.Point(), world_size=2, timeout_s=60)
    assert not [p for p in multiprocessing.active_children() if p.name.startswith("fringe-rank")]


def echo_rank(rank: int, world_size: int, x=None):
    return rank


def every_rank_raises_value_error(rank: int, world_size: int):
    raise ValueError(f"bad input on rank {rank}")


def every_rank_raises_value_error_rank_0_late(rank: int, world_size: int):
    if rank == 0:
        time.sleep(1.0)     # well within the pool's peer_grace_s (3 s)
    raise ValueError(f"bad input on rank {rank}")


def every_rank_disagrees(rank: int, world_size: int):
    """A real RankMismatch: every rank raises it from the agreement before attention."""
    import fringe
    from fringe import masks, schedules
    from fringe.testing import make_qkv
    plan = fringe.plan(schedules.ring(), masks.causal(), seq_len=8, world_size=world_size,
                       block_size=2)
    q, k, v = make_qkv(B=1, H=1, G=1, S=8, D=4, seed=0,
                       dtype=torch.float64 if rank == 0 else torch.float32)
    return fringe.attention(*(plan.layout.shard(t, rank) for t in (q, k, v)), plan=plan,
                            timeout_s=60)


def rank_1_stops_mid_call(rank: int, world_size: int, comm_timeout_s: float):
    """Rank 1 stops (SIGSTOP) inside the call; rank 0 reaches the agreement exchange and
    raises CommTimeout after ``comm_timeout_s``; rank 1 never answers."""
    import fringe
    from fringe import masks, schedules
    from fringe.testing import make_qkv
    if rank == 1:
        os.kill(os.getpid(), signal.SIGSTOP)
    plan = fringe.plan(schedules.ring(), masks.causal(), seq_len=8, world_size=world_size,
                       block_size=2)
    q, k, v = make_qkv(B=1, H=1, G=1, S=8, D=4, seed=0)
    return fringe.attention(*(plan.layout.shard(t, rank) for t in (q, k, v)), plan=plan,
                            timeout_s=comm_timeout_s)


def rank_1_says_why_and_dies(rank: int, world_size: int):
    if rank == 1:
        sys.stderr.write("some warning nobody reads\n")
        os.write(2, b"RuntimeError: rank 1 could not map its shard (a stand-in for a C++ abort)\n")
        os._exit(7)
    return rank


PARENT_ONLY = "fringe_test_parent_only"     # a module that exists in this process only


@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    """One 2-rank pool for the failure tests below; ``healthy()`` restarts it if a test left
    it broken. Its temp dirs live under a private TMPDIR, checked empty after each failure."""
    root = tmp_path_factory.mktemp("pool")
    old = tempfile.tempdir
    tempfile.tempdir = str(root)
    w = Workers(2, timeout_s=60, peer_grace_s=3.0)

    def healthy() -> Workers:
        if w.broken is not None or not w.pids:
            w.close()
            w.start()
        return w
    try:
        yield healthy, root
    finally:
        w.close()
        tempfile.tempdir = old


def test_a_call_the_workers_cannot_unpickle_is_reported_by_every_rank_and_the_pool_lives(
        pool, monkeypatch):
    import types
    healthy, root = pool
    w = healthy()
    pids = w.pids
    mod = types.ModuleType(PARENT_ONLY)
    exec("class Token:\n    pass\n", mod.__dict__)
    mod.Token.__module__ = PARENT_ONLY
    monkeypatch.setitem(sys.modules, PARENT_ONLY, mod)
    with pytest.raises(LaunchError) as info:
        w.run(echo_rank, mod.Token())
    assert info.value.kind == "ModuleNotFoundError" and sorted(info.value.errors) == [0, 1]
    assert "could not unpickle the call" in str(info.value) and PARENT_ONLY in str(info.value)
    assert "must be importable by the workers" in str(info.value)
    assert w.broken is None and [pid for _, pid in w.run(ranks_and_pids)] == pids


def test_a_stopped_rank_is_named_and_reaped_after_a_peer_times_out(pool):
    healthy, root = pool
    w = healthy()
    pids = w.pids
    # errors every rank reports leave the pool alive, same processes
    with pytest.raises(LaunchError, match="rank 0 failed with ValueError"):
        w.run(every_rank_raises_value_error)
    # ... also when one reports later than the other, within peer_grace_s
    with pytest.raises(LaunchError, match="rank 0 failed with ValueError") as info:
        w.run(every_rank_raises_value_error_rank_0_late)
    assert sorted(info.value.errors) == [0, 1] and info.value.stopped == []
    with pytest.raises(LaunchError) as info:
        w.run(every_rank_disagrees)
    assert info.value.kind == "RankMismatch" and sorted(info.value.errors) == [0, 1]
    assert w.broken is None and [pid for _, pid in w.run(ranks_and_pids)] == pids

    start = time.monotonic()
    with pytest.raises(LaunchError) as info:
        w.run(rank_1_stops_mid_call, 2.0)
    waited = time.monotonic() - start
    err = info.value
    assert err.kind == "unresponsive" and err.rank == 1, str(err)
    assert str(err).startswith("rank 1 did not answer call")
    headline = str(err).splitlines()[0]
    assert "after rank 0 raised fringe.runtime.distributed.CommTimeout" in headline, headline
    assert err.errors[0][0] == "CommTimeout" and err.errors[1][0] == "unresponsive"
    # the call's own timeout is 60 s (and the launcher waits 60 + 30 before calling a call
    # lost): the peer's report, not the launcher's deadline, ended this call
    assert waited < w.timeout_s
    assert "rank 1 did not answer" in w.broken
    assert _wait_gone(pids) == [] and os.listdir(root) == []        # stopped rank included
    assert not [p for p in multiprocessing.active_children() if p.name.startswith("fringe-rank")]
    with pytest.raises(LaunchError, match="broken since"):
        w.run(ranks_and_pids)

    w = healthy()                                   # restarts as before
    assert set(w.pids).isdisjoint(pids)
    assert [r for r, _ in w.run(ranks_and_pids)] == [0, 1]


def echo_arg_slowly(rank: int, world_size: int, x):
    time.sleep(0.2)
    return rank, x


def test_calls_from_two_threads_each_get_their_own_results(pool):
    import threading
    healthy, root = pool
    w = healthy()
    results = {}

    def call(x):
        try:
            results[x] = w.run(echo_arg_slowly, x)
        except LaunchError as e:
            results[x] = e
    threads = [threading.Thread(target=call, args=(x,)) for x in ("a", "b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    # each caller its own answers (one took the other's, and the other timed out)
    assert results == {x: [(0, x), (1, x)] for x in ("a", "b")}, results
    assert w.broken is None


def test_a_rank_that_dies_carries_its_last_stderr_lines_into_the_error(pool):
    healthy, root = pool
    w = healthy()
    pids = w.pids
    with pytest.raises(LaunchError) as info:
        w.run(rank_1_says_why_and_dies)
    err = info.value
    assert err.kind == "ProcessDied" and err.rank == 1
    said = str(err).splitlines()[1]
    assert said.startswith("rank 1 exited with code 7 without answering (RuntimeError: rank 1 "
                           "could not map its shard (a stand-in for a C++ abort))"), str(err)
    assert "some warning nobody reads" in err.remote_traceback
    assert "rank 1 exited with code 7" in w.broken
    assert _wait_gone(pids) == [] and os.listdir(root) == []


def rank_1_raises_before_a_collective(rank: int, world_size: int, group_timeout_s: float = 1):
    """Rank 1 raises before an all-reduce that rank 0 waits in; rank 0 then fails with gloo's
    own timeout, a plain RuntimeError out of torch.distributed (a group with a 1 s timeout
    keeps it short), unless the pool's ``peer_grace_s`` runs out first."""
    import datetime

    import torch.distributed as dist
    group = dist.new_group(timeout=datetime.timedelta(seconds=group_timeout_s))
    if rank == 1:
        raise ValueError("bad input on rank 1, before the all-reduce")
    dist.all_reduce(torch.ones(1), group=group)
    return rank


def tensor_result(rank: int, world_size: int):
    return torch.full((2,), float(rank))


def test_a_gloo_failure_breaks_the_pool_and_the_rank_that_raised_leads(pool, monkeypatch):
    healthy, root = pool
    monkeypatch.setenv("TMPDIR", str(root))        # the workers' too (restarted here)
    w = healthy()
    pids = w.pids
    # a tensor result: each worker shares it through a socket in multiprocessing's pymp-*
    # directory, which must go with the pool when its workers are stopped
    assert [t.tolist() for t in w.run(tensor_result)] == [[0.0, 0.0], [1.0, 1.0]]
    with pytest.raises(LaunchError) as info:
        w.run(rank_1_raises_before_a_collective)
    err = info.value
    # the root cause leads, not the peer's timeout that followed it
    assert err.kind == "ValueError" and err.rank == 1, str(err)
    assert str(err).startswith("rank 1 failed with ValueError"), str(err)
    assert err.errors[0][0] == "RuntimeError" and "Timed out" in err.errors[0][1]
    # gloo closes the pair after a timeout: the pool says so instead of failing every later
    # call with "Application timeout caused pair closure"
    assert w.broken is not None and "rank_1_raises_before_a_collective" in w.broken
    with pytest.raises(LaunchError, match="broken since") as info:
        w.run(ranks_and_pids)
    assert info.value.kind == "broken"
    assert _wait_gone(pids) == [] and os.listdir(root) == []


def test_a_plain_error_on_one_rank_stops_the_peers_waiting_for_it(pool):
    """A user's bug on one rank (a ValueError before a collective) must not look like a hang:
    its peer, waiting in the all-reduce, is stopped ``peer_grace_s`` (3 s) after it, long
    before gloo's timeout (20 s here, 120 s by default), and the error leads with the bug."""
    healthy, root = pool
    w = healthy()
    pids = w.pids
    start = time.monotonic()
    with pytest.raises(LaunchError) as info:
        w.run(rank_1_raises_before_a_collective, 20.0)
    waited = time.monotonic() - start
    err = info.value
    msg = str(err)
    assert err.kind == "ValueError" and err.rank == 1, msg
    assert msg.splitlines()[0] == ("rank 1 failed with ValueError during call "
                                   f"{w._calls} (rank_1_raises_before_a_collective): ValueError: "
                                   "bad input on rank 1, before the all-reduce"), msg
    assert "rank 0 was still running 3s later" in msg and "was stopped" in msg, msg
    assert err.remote_traceback.rstrip().endswith("bad input on rank 1, before the all-reduce")
    assert "raise ValueError" in err.remote_traceback
    assert err.stopped == [0] and err.errors[0][0] == "stopped", err.errors
    assert waited < 20.0, waited                    # the grace ended it, not gloo's timeout
    assert "rank 0 was still running" in w.broken and "ValueError" in w.broken, w.broken
    with pytest.raises(LaunchError, match="broken since") as info:
        w.run(ranks_and_pids)
    assert info.value.kind == "broken" and "was stopped" in str(info.value)
    assert _wait_gone(pids) == [] and os.listdir(root) == []
