"""Measure this machine for the cost model: the fused CPU attention kernel and gloo.

The tools layer of the cost model (it spawns gloo ranks through :mod:`fringe.launch`).
:func:`get_hardware` is :func:`fringe.cost.hardware.get_hardware` with ``"this"``: calibrate
now.

Two ways to measure:

* :func:`calibrate`: this process measures for itself (a :class:`Hardware` named ``"this"``).
  Ranks that each calibrate get different constants and can choose different schedules, so
  ``schedules.auto()`` refuses such a Hardware.
* :func:`shared`: measured once and the same on every rank (a :class:`Hardware` named
  :data:`SHARED`): under ``torch.distributed``, rank 0 of the group measures the kernels (and
  the transport between group ranks 0 and 1, ``byte_s`` included: the host seconds per byte a
  rank moves, from fringe's own ring step, see :func:`_moved`) or loads ``path``, and
  broadcasts the constants
  as text; every rank parses that one text, so every field is bit-identical. With ``path``,
  the constants are saved there (:func:`save`) and later runs load them (:func:`load`)
  instead of measuring again::

      hw = fringe.cost.calibrate.shared(path="calib.json")   # every rank, after init_process_group
      plan = fringe.plan(schedules.auto(hardware=hw), mask, seq_len=S, world_size=P)
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import platform
import time

import torch

from ..api import attention
from ..launch import run
from ..layout import DEFAULT_BLOCK_SIZE
from ..masks import BlockKind, causal, document
from ..ops import merge, tile_backward, tile_forward
from ..plan import plan as make_plan
from ..schedules import ring
from . import hardware as _hardware
from .hardware import (_CPU, BWD_FLOPS_PER_PAIR, FWD_FLOPS_PER_PAIR, PER_RANK, SHARED, Hardware,
                       Shape)
from .work import _maps_work

__all__ = ["FORMAT", "SHARED", "calibrate", "get_hardware", "load", "save", "shared"]

#: The ``format`` field of a calibration file (:func:`save`).
FORMAT = "fringe.cost.Hardware/1"

#: Tokens (S) of the ring step :func:`_moved` times to measure ``byte_s``: whole kv chunks move
#: ~S/2 tokens per hop, the ranged ones one block, so the larger, the larger the difference.
MOVED_LEN = 8192

_FULL, _PARTIAL, _EMPTY = int(BlockKind.FULL), int(BlockKind.PARTIAL), int(BlockKind.EMPTY)


def get_hardware(hardware: str | Hardware) -> Hardware:
    """A preset by name, ``"this"`` (:func:`calibrate` now), or a :class:`Hardware` as is.

    Raises:
        ValueError: for an unknown name, listing the presets.
    """
    if isinstance(hardware, str) and hardware == "this":
        return calibrate()
    return _hardware.get_hardware(hardware)


def _best(fn, repeats: int, clock=time.perf_counter) -> float:
    """Fastest of ``repeats`` calls after a warm-up, on ``clock``."""
    return _best_of_each([fn], repeats, clock)[0]


def _best_of_each(fns, repeats: int, clock=time.perf_counter) -> list[float]:
    """The fastest call of each of ``fns`` on ``clock``: a warm-up call each, then ``repeats``
    rounds of one call each, interleaved, so that a change of load hits all of them alike."""
    for fn in fns:
        fn()
    best = [math.inf] * len(fns)
    for _ in range(repeats):
        for i, fn in enumerate(fns):
            t0 = clock()
            fn()
            best[i] = min(best[i], clock() - t0)
    return best


def calibrate(*, heads: int = 8, head_dim: int = 64, dtype: torch.dtype = torch.float32,
              threads: int = 1, comm: bool = True, repeats: int = 2,
              moved_len: int = MOVED_LEN) -> Hardware:
    """Measure this machine: the fused CPU attention kernel (via fringe's tile ops) and gloo.

    Times FULL and masked sub-problems of two sizes, forward and backward, with ``threads``
    torch threads (ranks on a CPU run with one each; with one thread the CPU time of this
    thread is used, so that other processes on a shared machine do not inflate it), and,
    with ``comm``, on two spawned gloo ranks (a few seconds: process start-up): round trips
    of a tiny and a 4 MB tensor (latency, bandwidth), and ``byte_s``, the host seconds per
    byte a rank moves, through fringe itself (:func:`_moved`: the same ring step over
    ``moved_len`` tokens moving whole kv chunks and only the blocks the mask needs).

    The result is this process's measurement: :func:`fringe.schedules.auto` refuses it, since
    ranks that measure for themselves can choose different schedules. :func:`shared` measures
    once and gives every rank the same constants.

    Returns:
        A :class:`Hardware` named ``"this"`` whose source says what was measured.

    Raises:
        ValueError: ``moved_len`` is not a multiple of 2 x the block size, at least twice that.
    """
    _check_moved_len(moved_len)
    return _measure(name=PER_RANK, prefix="calibrated here", comm=comm, pair=None, heads=heads,
                    head_dim=head_dim, dtype=dtype, threads=threads, repeats=repeats,
                    moved_len=moved_len)


def _source(*, heads, head_dim, dtype, threads, comm: str) -> str:
    return (f"fused CPU SDPA through fringe.ops, {threads} thread(s), "
            f"{str(dtype).replace('torch.', '')}, H={heads} D={head_dim}; {comm}")


def _kernels(*, heads: int, head_dim: int, dtype: torch.dtype, threads: int,
             repeats: int) -> dict:
    """The kernel fields of :class:`Hardware`, measured here (see :func:`calibrate`)."""
    # one thread: this thread's CPU time is the kernel's time even on a machine other
    # processes share (wall-clock would count their time slices too)
    cpu = time.thread_time if threads == 1 else time.perf_counter
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        g = torch.Generator().manual_seed(0)
        H, D = heads, head_dim

        def timed(L: int, kw: dict):
            q, k, v, do = (torch.randn(1, H, L, D, generator=g, dtype=dtype) for _ in range(4))
            pos = torch.arange(L)
            kw = dict(q_pos=pos, kv_pos=pos, **kw)
            out, lse = tile_forward(q, k, v, **kw)
            fwd = _best(lambda: tile_forward(q, k, v, **kw), repeats, cpu)
            bwd = _best(lambda: tile_backward(q, k, v, out, lse, do, **kw), repeats, cpu)
            return fwd, bwd

        small, big, bs = 64, 2048, 128   # a call's fixed cost from a tiny tile, pairs from a big one
        (f0, b0) = timed(small, dict(kind=BlockKind.FULL))
        (f1, b1) = timed(big, dict(kind=BlockKind.FULL))
        pairs0, pairs1 = small * small, big * big
        f_unit = max((f1 - f0) / (pairs1 - pairs0), 1e-15)
        b_unit = max((b1 - b0) / (pairs1 - pairs0), 1e-15)
        f_call = max(f0 - f_unit * pairs0, 0.0)
        b_call = max(b0 - b_unit * pairs0, 0.0)
        # a causal diagonal tile run the way plans run it (block map, the sdpa grouping: one
        # is_causal call) gives the causal factor; a tile of PARTIAL blocks that are not
        # lower-triangular (one call with a float mask over all of it) the masked factor
        nb = big // bs
        codes = torch.full((nb, nb), _EMPTY, dtype=torch.int8)
        codes[torch.tril(torch.ones(nb, nb, dtype=torch.bool), -1)] = _FULL
        codes[torch.arange(nb), torch.arange(nb)] = _PARTIAL

        def checker(b, h, q_idx, kv_idx):
            return (q_idx + kv_idx) % 2 == 0
        factors = []
        for kw in (dict(blocks=codes, mask_mod=causal()),
                   dict(blocks=torch.full((nb, nb), _PARTIAL, dtype=torch.int8),
                        mask_mod=checker)):
            fm, bm = timed(big, dict(kind=BlockKind.PARTIAL, block_size=bs, **kw))
            calls, full, mpairs, cpairs = _maps_work(kw["blocks"][None], L=big, block_size=bs,
                                                     masked_ok=True)[0]
            pairs = max(mpairs + cpairs, 1.0)
            factors.append((max((fm - calls * f_call - full * f_unit) / (pairs * f_unit), 0.05),
                            max((bm - calls * b_call - full * b_unit) / (pairs * b_unit), 0.05)))
        (f_causal, b_causal), (f_masked, b_masked) = factors
        o = torch.randn(1, H, big, D, generator=g)
        lse_ = torch.randn(1, H, big, generator=g)
        row = _best(lambda: merge(o, lse_, o, lse_), repeats, cpu) / (H * big * D)
        per = H * D
        fields = dict(fwd_flops=FWD_FLOPS_PER_PAIR * per / f_unit,
                      bwd_flops=BWD_FLOPS_PER_PAIR * per / b_unit, call_s=f_call,
                      bwd_call_s=b_call, masked=float(f_masked), bwd_masked=float(b_masked),
                      causal=float(f_causal), bwd_causal=float(b_causal), row_s=row)
    finally:
        torch.set_num_threads(old)
    return fields


def _gloo_probe(rank: int, world_size: int, moved: dict, size: int = 1 << 20, reps: int = 5):
    """(latency s, bandwidth B/s, :func:`_moved`'s result) of gloo between ranks 0 and 1."""
    torch.set_num_threads(1)
    lat, bw = _round_trips(rank, 1 - rank, None, torch.device("cpu"), size=size, reps=reps)
    return lat, bw, _moved(None, torch.device("cpu"), **moved)


def _round_trips(rank: int, peer: int, group, device, *, size: int = 1 << 20, reps: int = 5):
    """(latency s, bandwidth B/s) between this rank (0 or 1 of ``group``) and global rank
    ``peer``: halved round trips of a tiny and a ``size``-float tensor."""
    import torch.distributed as dist

    def round_trip(x):
        if rank == 0:
            dist.send(x, peer, group=group)
            dist.recv(x, peer, group=group)
        else:
            dist.recv(x, peer, group=group)
            dist.send(x, peer, group=group)
    tiny, big = torch.zeros(1, device=device), torch.zeros(size, device=device)
    lat, t = (x / 2 for x in _best_of_each([lambda: round_trip(tiny), lambda: round_trip(big)],
                                           reps))
    nbytes = big.numel() * big.element_size()
    return lat, nbytes / max(t - lat, 1e-9)


def _check_moved_len(moved_len: int) -> None:
    """Raise unless :func:`_moved` can run on ``moved_len`` tokens (before any communication)."""
    unit = 2 * DEFAULT_BLOCK_SIZE
    if not (isinstance(moved_len, int) and moved_len >= 2 * unit and moved_len % unit == 0):
        raise ValueError(f"moved_len={moved_len!r}: byte_s is measured on a ring step over P=2 "
                         f"ranks whose whole kv chunks must be longer than one block; use a "
                         f"multiple of 2*block_size={unit}, at least {2 * unit} (default "
                         f"{MOVED_LEN})")


def _moved_mask(seq_len: int, block_size: int):
    """Causal documents one block long, but the one across the two ranks' boundary two blocks
    long: each rank's tiles are its diagonal blocks (cheap), and rank 1's first q block needs
    exactly one kv block of rank 0's chunk, which a ranged ring hop moves alone and a whole
    one moves with the rest of the chunk."""
    half = seq_len // 2
    ids = torch.arange(seq_len) // block_size
    ids[half:half + block_size] = (half - 1) // block_size
    return causal() & document(ids)


def _moved(group, device, *, seq_len: int, heads: int, head_dim: int, dtype: torch.dtype,
           repeats: int) -> tuple[float, float, float]:
    """This rank's host seconds per byte it moves, measured through fringe: ``(byte_s, extra
    CPU seconds, extra bytes)``.

    Both members of ``group`` (exactly 2 ranks) run forward + backward of ``schedules.ring()``
    at P=2 over ``seq_len`` tokens of :func:`_moved_mask` (B=1, H=G=``heads``, D=``head_dim``,
    ``dtype``) twice: planned with ``ranges=True`` (each hop moves the one kv block the mask
    needs, and its dkv back) and ``ranges=False`` (whole chunks). The tiles are the same; only
    the bytes differ (counted by :meth:`fringe.plan.Plan.stats`, sent + received, forward and
    backward). The steps alternate (:func:`_best_of_each`, ``repeats`` rounds); the least
    process CPU seconds (every thread: the interpreter's copies, zero-filled receive buffers,
    gradient accumulation, the transport's own threads) of each gives
    ``byte_s = (CPU whole - CPU ranged) / (bytes whole - bytes ranged)``, at least 0.
    """
    import torch.distributed as dist
    rank = dist.get_rank(group)
    mask = _moved_mask(seq_len, DEFAULT_BLOCK_SIZE)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, heads, seq_len, head_dim, generator=g, dtype=dtype)
               for _ in range(3))
    steps, moved = [], []
    for ranges in (True, False):
        p = make_plan(ring(), mask, seq_len=seq_len, world_size=2, ranges=ranges)
        row = p.stats(heads=heads, head_dim=head_dim, dtype=dtype).rows[rank]
        moved.append(row["fwd_sent"] + row["fwd_recv"] + row["bwd_sent"] + row["bwd_recv"])
        ql, kl, vl = (p.layout.shard(t, rank).to(device).requires_grad_() for t in (q, k, v))

        def step(p=p, ql=ql, kl=kl, vl=vl):
            attention(ql, kl, vl, plan=p, group=group).sum().backward()
        steps.append(step)
    best = _best_of_each(steps, repeats, time.process_time)
    cpu, nbytes = best[1] - best[0], moved[1] - moved[0]
    return max(cpu, 0.0) / nbytes, cpu, float(nbytes)


def _byte_s_text(res, *, seq_len: int) -> str:
    """What ``byte_s`` is and how it was measured, from the ranks' :func:`_moved` results."""
    worst = max(range(len(res)), key=lambda r: res[r][0])
    byte_s, cpu, nbytes = res[worst]
    clamp = f" (measured {cpu / nbytes:.3g}, clamped at 0)" if cpu < 0 else ""
    return (f"byte_s={byte_s:.3g} s/B{clamp}: the busier of the 2 ranks' extra process CPU "
            f"seconds ({cpu * 1e3:.3g} ms) over the extra bytes it moves "
            f"({nbytes / 1e6:.3g} MB) when ring at P=2, forward + backward, S={seq_len}, moves "
            f"whole kv chunks instead of the block ranges the mask needs (same tiles)")


# --------------------------------------------------------------------------------------------
# one calibration for every rank
# --------------------------------------------------------------------------------------------


def save(hw: Hardware, path: str | os.PathLike) -> None:
    """Write ``hw`` to ``path`` as JSON (every field; floats as their shortest repr, so
    :func:`load` gives back a bit-identical :class:`Hardware`). The file is replaced
    atomically: a rank reading it never sees half of it."""
    if not isinstance(hw, Hardware):
        raise TypeError(f"save() takes a fringe.cost.hardware.Hardware, got {type(hw).__name__}")
    text = _to_text(hw)
    path = os.fspath(path)
    # a fresh name beside it, created as open() creates files (0666 less the umask: other
    # users' ranks may read it; mkstemp's 0600 hid it from them)
    tmp = f"{os.path.abspath(path)}.{os.getpid()}.{os.urandom(4).hex()}.tmp"
    fd = os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def load(path: str | os.PathLike) -> Hardware:
    """The :class:`Hardware` :func:`save` wrote to ``path``.

    Raises:
        ValueError: the file is not a calibration file of this format, naming what is wrong
            and the fix (delete it and run :func:`shared` with ``path=`` again); ``path`` is a
            folder or cannot be read.
    """
    what = f"calibration file {os.fspath(path)!r}"
    fix = "give the path of a file fringe.cost.calibrate.save() or shared(path=...) wrote"
    if os.path.isdir(path):
        raise ValueError(f"{what} is a folder, not a file; {fix}")
    try:
        with open(os.fspath(path), "rb") as f:
            text = f.read().decode()
    except PermissionError as e:
        raise ValueError(f"{what} cannot be read ({e.strerror}); {fix}") from None
    except UnicodeDecodeError as e:
        raise ValueError(f"{what} is not text ({e}); {fix}") from None
    return _from_text(text, what=what)


def _to_text(hw: Hardware) -> str:
    return json.dumps({"format": FORMAT, "hardware": dataclasses.asdict(hw)}, indent=1,
                      sort_keys=True)


def _from_text(text: str, *, what: str) -> Hardware:
    fix = "delete it and run fringe.cost.calibrate.shared(path=...) to measure and save again"
    try:
        d = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{what} is not JSON ({e}); {fix}") from None
    if not isinstance(d, dict) or d.get("format") != FORMAT or not isinstance(
            d.get("hardware"), dict):
        got = d.get("format") if isinstance(d, dict) else type(d).__name__
        raise ValueError(f"{what} is not a calibration file of format {FORMAT!r} (got "
                         f"{got!r}); {fix}")
    fields = d["hardware"]
    names = [f.name for f in dataclasses.fields(Hardware)]
    missing, unknown = sorted(set(names) - set(fields)), sorted(set(fields) - set(names))
    if missing or unknown:
        raise ValueError(f"{what} does not hold the fields of a Hardware (missing {missing}, "
                         f"unknown {unknown}); {fix}")
    try:
        if isinstance(fields["shape"], dict):           # what dataclasses.asdict wrote
            fields = dict(fields, shape=Shape(**fields["shape"]))
        return Hardware(**fields)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{what}: {e}; {fix}") from None


def shared(*, group=None, path: str | os.PathLike | None = None, comm: bool = True,
           heads: int = 8, head_dim: int = 64, dtype: torch.dtype = torch.float32,
           threads: int = 1, repeats: int = 2, moved_len: int = MOVED_LEN) -> Hardware:
    """One calibration every rank shares: pass it to ``schedules.auto(hardware=...)``.

    Under ``torch.distributed`` (initialized), call it on every rank of ``group``: rank 0 of
    the group loads ``path`` if that file exists, else measures (the kernels as
    :func:`calibrate` does; with ``comm``, the transport between group ranks 0 and 1 by
    round trips over ``group`` itself, and ``byte_s`` through fringe on the same two ranks as
    :func:`calibrate` measures it) and saves to ``path`` if given; then it broadcasts the
    constants as text over ``group`` and every rank parses that text, so the result is
    bit-identical on every rank. Only rank 0 reads or writes the file. Without
    ``torch.distributed``, this process loads ``path`` or measures (and saves): run it once,
    then every rank's ``shared(path=...)`` or :func:`load` reads the same file. Processes on
    one machine that call it at once take turns on the file's folder (``flock``): the first
    measures and saves, the others load that file.

    Args:
        group: the process group (None: the default group, when initialized).
        path: a JSON calibration file to load if it exists, else to save to.
        comm: measure the transport (else take the ``cpu`` preset's latency, bandwidth and
            ``byte_s``).
        heads, head_dim, dtype, threads, repeats, moved_len: as :func:`calibrate`.

    Returns:
        A :class:`Hardware` named :data:`SHARED`, equal (field by field, bit for bit) on every
        rank, and to :func:`load` of ``path``.

    Raises:
        ValueError: ``group`` given without an initialized ``torch.distributed``; ``moved_len``
            as :func:`calibrate` refuses it; ranks given different settings (``comm``,
            ``heads``, ...: every rank raises, naming them); or rank 0 could not load or
            measure (every rank raises rank 0's reason).
    """
    import torch.distributed as dist
    _check_moved_len(moved_len)
    on = dist.is_available() and dist.is_initialized()
    if group is not None and not on:
        raise ValueError("shared(group=...) broadcasts over a process group, but "
                         "torch.distributed is not initialized: call "
                         "torch.distributed.init_process_group first, or leave group= out to "
                         "calibrate this process alone (then share the file it saves)")
    kw = dict(heads=heads, head_dim=head_dim, dtype=dtype, threads=threads, repeats=repeats,
              moved_len=moved_len)
    if not on:
        if path is not None and os.path.exists(path):
            return _load_shared(path)
        if _unwritable(path):
            raise ValueError(_unwritable(path))
        with _folder_lock(path):     # processes started together: one measures, the rest load
            if path is not None and os.path.exists(path):
                return _load_shared(path)
            hw = _measure(name=SHARED, prefix=_prefix(1), comm=comm, pair=None, **kw)
            if path is not None:
                save(hw, path)
        return hw
    rank, n = dist.get_rank(group), dist.get_world_size(group)
    root = dist.get_global_rank(group or dist.group.WORLD, 0)
    # ranks 0 and 1 measure together (comm) on tensors these settings size: if a rank was
    # given other settings, every rank says so now (rank 0 would wait on rank 1 in _pair)
    mine = dict(comm=bool(comm), **{k: (str(v) if k == "dtype" else v) for k, v in kw.items()})
    every = [None] * n
    dist.all_gather_object(every, mine, group=group)
    differ = [r for r in range(n) if every[r] != every[0]]
    if differ:
        keys = sorted(k for k in mine if any(every[r][k] != every[0][k] for r in differ))
        raise ValueError(f"fringe.cost.calibrate.shared(): the ranks of the group were given "
                         f"different settings ({', '.join(keys)}): rank 0 has "
                         f"{ {k: every[0][k] for k in keys} }, rank {differ[0]} "
                         f"{ {k: every[differ[0]][k] for k in keys} }; call it with the same "
                         f"arguments on every rank (only path= may differ: rank 0's is used)")
    # rank 0 decides (load or measure) and tells the others, who may not see its file
    decision = [path is not None and os.path.exists(path)] if rank == 0 else [None]
    if rank == 0 and not decision[0] and _unwritable(path):
        decision = [_unwritable(path)]          # before anything is measured or sent
    dist.broadcast_object_list(decision, src=root, group=group)
    if isinstance(decision[0], str):
        raise ValueError(f"fringe.cost.calibrate.shared(): rank 0 could not calibrate: "
                         f"{decision[0]}")
    pair = None
    if not decision[0] and comm and n >= 2 and rank < 2:
        pair = _pair(group, rank, **kw)
    msg = [None]
    if rank == 0:
        try:
            if decision[0]:
                hw = _load_shared(path)
            else:
                hw = _measure(name=SHARED, prefix=_prefix(n), comm=comm, pair=pair, **kw)
                if path is not None:
                    save(hw, path)
            msg = [("ok", _to_text(hw))]
        except Exception as e:            # every rank raises rank 0's reason, none waits
            msg = [("error", f"{type(e).__name__}: {e}")]
    dist.broadcast_object_list(msg, src=root, group=group)
    status, text = msg[0]
    if status != "ok":
        raise ValueError(f"fringe.cost.calibrate.shared(): rank 0 could not calibrate: {text}")
    return _from_text(text, what="the calibration rank 0 broadcast")


@contextlib.contextmanager
def _folder_lock(path):
    """Hold an exclusive ``flock`` on the folder of ``path`` (nothing when ``path`` is None or
    the platform has no ``fcntl``): processes on one machine that each call ``shared(path=)``
    before any process group exists (every rank of a launcher, say) take turns, so the first
    measures and saves and the others load its file instead of each measuring its own. The
    lock is the folder's own (no lock file to leave behind) and the kernel drops it when its
    holder exits, however it exits."""
    try:
        import fcntl
    except ImportError:                 # (not on Linux or macOS: no turns, each measures)
        fcntl = None
    if path is None or fcntl is None:
        yield
        return
    fd = os.open(os.path.dirname(os.path.abspath(os.fspath(path))), os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)                    # (closing drops the lock)


def _load_shared(path) -> Hardware:
    """:func:`load`, refusing a file that holds one process's own calibration
    (:func:`calibrate`, named ``"this"``): shared() returns constants named :data:`SHARED`,
    and ``schedules.auto()`` would refuse that one later, blaming calibrate()."""
    hw = load(path)
    if hw.name == PER_RANK:
        raise ValueError(f"calibration file {os.fspath(path)!r} holds a per-process "
                         f"calibration (fringe.cost.calibrate.calibrate(), named "
                         f"{PER_RANK!r}), not a shared one; delete it and run "
                         f"fringe.cost.calibrate.shared(path=...) to measure and save again")
    return hw


def _unwritable(path) -> str | None:
    """Why a calibration could not be saved to ``path`` (None: it can, or no path): said before
    anything is measured."""
    if path is None:
        return None
    if os.fspath(path).endswith((os.sep, "/")) or os.path.isdir(path):
        return (f"cannot save the calibration to {os.fspath(path)!r}: it names a folder; give "
                f"a file name (e.g. {os.path.join(os.fspath(path), 'calib.json')!r})")
    folder = os.path.dirname(os.path.abspath(os.fspath(path)))
    if not os.path.isdir(folder):
        return (f"cannot save the calibration to {os.fspath(path)!r}: the folder {folder!r} "
                f"does not exist; create it or give a path in an existing folder")
    if not os.access(folder, os.W_OK):
        return (f"cannot save the calibration to {os.fspath(path)!r}: the folder {folder!r} "
                f"is not writable; give a path in a folder you can write")
    return None


def _prefix(ranks: int) -> str:
    return (f"calibrated once on rank 0 of {ranks} ({platform.node() or 'unknown host'}) and "
            f"shared by fringe.cost.calibrate.shared()")


def _pair(group, rank: int, *, heads, head_dim, dtype, repeats, moved_len, **_):
    """(latency, bandwidth, [:func:`_moved` of both ranks]) between group ranks 0 and 1,
    measured over ``group`` (over a subgroup of the two when ``group`` has more); on rank 0 the
    worse of the two sides' latency and bandwidth (rank 1 sends its own), on rank 1 None."""
    import torch.distributed as dist
    nccl = dist.get_backend(group) == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
    peer = dist.get_global_rank(group or dist.group.WORLD, 1 - rank)
    lat, bw = _round_trips(rank, peer, group, device)
    two = group
    if dist.get_world_size(group) > 2:           # only these two call it: local synchronization
        two = dist.new_group(sorted([dist.get_rank(), peer]), use_local_synchronization=True)
    moved = _moved(two, device, seq_len=moved_len, heads=heads, head_dim=head_dim,
                   dtype=dtype, repeats=repeats)
    mine = torch.tensor([lat, bw, *moved], dtype=torch.float64, device=device)
    if rank == 1:
        dist.send(mine, peer, group=group)
        return None
    theirs = torch.empty_like(mine)
    dist.recv(theirs, peer, group=group)
    return (max(lat, float(theirs[0])), min(bw, float(theirs[1])),
            [moved, tuple(float(x) for x in theirs[2:])])


def _measure(*, name: str, prefix: str, comm: bool, pair, moved_len: int, **kw) -> Hardware:
    """A Hardware measured here: the kernels now; the transport from ``pair`` (measured over a
    process group), else between two spawned gloo ranks (``comm``), else the cpu preset's."""
    fields = _kernels(**kw)
    lat, bw, byte_s = _CPU["latency_s"], _CPU["bandwidth"], _CPU["byte_s"]
    what = "gloo and byte_s from the cpu preset"
    moved = dict(seq_len=moved_len, **{k: kw[k] for k in ("heads", "head_dim", "dtype",
                                                          "repeats")})
    if pair is not None:
        lat, bw, res = pair
        byte_s = max(r[0] for r in res)
        what = ("round trips between group ranks 0 and 1 over the process group; "
                + _byte_s_text(res, seq_len=moved_len))
    elif comm:
        out = run(_gloo_probe, moved, world_size=2, timeout_s=120)
        lat, bw = max(r[0] for r in out), min(r[1] for r in out)
        res = [r[2] for r in out]
        byte_s = max(r[0] for r in res)
        what = "gloo round trips between 2 spawned ranks; " + _byte_s_text(res, seq_len=moved_len)
    src = f"{prefix}: " + _source(comm=what, **{k: kw[k] for k in ("heads", "head_dim", "dtype",
                                                                   "threads")})
    shape = Shape(heads=kw["heads"], kv_heads=kw["heads"], head_dim=kw["head_dim"],
                  dtype=str(kw["dtype"]).removeprefix("torch."))    # what it timed
    return Hardware(name, src, latency_s=lat, bandwidth=bw, byte_s=byte_s, memory_bytes=None,
                    shape=shape, **fields)
