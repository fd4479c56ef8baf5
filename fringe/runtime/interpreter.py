"""One interpreter for every schedule and every transport.

:func:`execute` runs the programs of the ranks this process drives (all P on the virtual
mesh, one under ``torch.distributed``) in lockstep over global step indices. For each step
it *issues* the step's communication, *computes* the step's tiles on buffers already
present (the transfers are in flight meanwhile), then *waits* for the communication and
files what arrived. A transport only moves tensors:

.. code-block:: python

    class Transport(Protocol):
        def issue(self, rank, step, sends, recvs, collectives=()) -> handle
        def wait(self, rank, step, handle) -> None

``sends``: ``[(peer, buf, tensor)]``; ``recvs``: ``[(peer, buf, out)]``; ``collectives``:
``[(op, send_tensors, recv_tensors)]`` with one entry per member of ``op.group`` (None for
an empty contribution and for the rank's own slot). What arrives is filed by the rules of
the buffer's family, never by a schedule: a gradient accumulates (in a fixed order: point
to point in canonical order, then collectives in program order and member order), a partial
``out`` merges by its lse, anything else is stored (into its parent's head slice when the
whole buffer is here).

Buffers come from a per-rank pool and go back to it after their last use in the program,
so a ring keeps about two kv buffers alive and reuses them step after step.
"""
from __future__ import annotations

import collections
import dataclasses
import time
from typing import Any, Callable, Protocol

import torch

from ..schedules.ir import Buffer, Collective, Compute, Family, GradCompute, Program, Send


class Transport(Protocol):
    def issue(self, rank: int, step: int, sends: list, recvs: list, collectives: list = ()) -> Any: ...

    def wait(self, rank: int, step: int, handle: Any) -> None: ...


@dataclasses.dataclass
class StepRecord:
    """What one rank spent on one step: computing tiles, and waiting for transfers.

    On CPU both times are wall-clock. On CUDA they are read from events on the compute stream
    (compute: from before the first tile to after the last; wait: from there until the
    stream may go on after the transfers), resolved on first access so that recording never
    synchronises the device.
    """

    rank: int
    step: int
    _compute_s: float | None
    _wait_s: float | None
    tiles: int
    sent_bytes: int
    recv_bytes: int
    events: tuple | None = None

    def _resolve(self) -> None:
        if self._compute_s is None and self.events is not None:
            e0, e1, e2 = self.events
            e2.synchronize()
            self._compute_s = e0.elapsed_time(e1) / 1e3
            self._wait_s = e1.elapsed_time(e2) / 1e3

    @property
    def compute_s(self) -> float:
        self._resolve()
        return self._compute_s

    @property
    def wait_s(self) -> float:
        self._resolve()
        return self._wait_s


class Pool:
    """Free tensors by (shape, dtype, device), reused across steps (double buffering)."""

    def __init__(self) -> None:
        self._free: dict[tuple, list[torch.Tensor]] = collections.defaultdict(list)
        self.allocated = 0

    def get(self, like: torch.Tensor) -> torch.Tensor:
        return self.get_shape(tuple(like.shape), like.dtype, like.device)

    def get_shape(self, shape: tuple, dtype: torch.dtype, device) -> torch.Tensor:
        key = (tuple(shape), dtype, torch.device(device))
        if self._free[key]:
            return self._free[key].pop()
        self.allocated += 1
        return torch.empty(shape, dtype=dtype, device=device)

    def put(self, t: torch.Tensor) -> None:
        self._free[(tuple(t.shape), t.dtype, t.device)].append(t)


#: Where a buffer family keeps its heads: query-side tensors are ``[B, H, L, ...]``, kv ones
#: ``[2, B, G, L, D]``.
_HEAD_DIM = {Family.Q: 1, Family.OUT: 1, Family.DQ: 1, Family.DOUT: 1, Family.KV: 2,
             Family.DKV: 2}


def head_range(buf: Buffer, num_heads: int, kv_heads: int) -> tuple[int, int, int]:
    """``(dim, start, stop)`` of the heads a sliced buffer holds in its parent tensor.

    Query-side buffers ``h<i>/<n>`` hold query heads ``[i*H/n, (i+1)*H/n)``; kv buffers the
    kv heads those read: ``G/n`` of them when ``G % n == 0``, else (``n % G == 0``) the one
    kv head they share, replicated on several ranks.

    Raises:
        ValueError: H not divisible by n, or neither G % n == 0 nor n % G == 0.
    """
    i, n = buf.heads
    fam = buf.family
    check_head_split(n, num_heads, kv_heads)
    if fam in (Family.KV, Family.DKV):
        if kv_heads % n == 0:
            w = kv_heads // n
            return 2, i * w, (i + 1) * w
        g = i * kv_heads // n
        return 2, g, g + 1
    w = num_heads // n
    return _HEAD_DIM[fam], i * w, (i + 1) * w


def check_head_split(n: int, num_heads: int, kv_heads: int, *, what: str = "") -> None:
    """Raise a ValueError naming the fix unless H % n == 0 and (G % n == 0 or n % G == 0)."""
    if num_heads % n == 0 and (kv_heads % n == 0 or n % kv_heads == 0):
        return
    who = what or f"a schedule that splits heads {n} ways"
    if num_heads % n:
        raise ValueError(f"{who} needs the number of query heads divisible by {n}, got H="
                         f"{num_heads}; use H a multiple of {n}, or split heads fewer ways "
                         f"(schedules.compose(ring-like outer, ulysses(), inner_size=k) with k "
                         f"dividing H)")
    raise ValueError(f"{who} needs the kv heads G={kv_heads} to split {n} ways (G % {n} == 0) "
                     f"or to be replicated across the {n} ranks ({n} % G == 0); G={kv_heads} is "
                     f"neither: use G dividing or divisible by {n}")


class RankState:
    """Buffers of one rank while its program runs.

    Args:
        rank: the rank.
        program: its program (buffers are released after their last use in it).
        like: ``like(buf) -> (shape, dtype)`` of a whole-heads buffer of that family.
        heads: ``(H, G)``, for head-sliced buffers.
        device: where buffers live.
        protect: names never released (the rank's own data, kept kv).
        merge_out: ``merge_out(dst, src)`` merges a partial ``out`` into another, in place.
    """

    def __init__(self, rank: int, program: Program, *, like: Callable, heads: tuple[int, int],
                 device, protect: set[str] = frozenset(), merge_out: Callable | None = None
                 ) -> None:
        self.rank = rank
        self.program = program
        self.bufs: dict[str, torch.Tensor] = {}
        self.pool = Pool()
        self.like = like
        self.heads = heads
        self.device = device
        self.protect = {Buffer(n) for n in protect} | {Buffer(n).parent for n in protect}
        self.merge_out = merge_out
        last = program.last_uses()
        for b, t in list(last.items()):        # a slice keeps its whole buffer alive
            if b.heads is not None:
                last[b.parent] = max(last.get(b.parent, -1), t)
        self.last = last
        self.records: list[StepRecord] = []

    def shape_of(self, name: str) -> tuple[tuple, torch.dtype]:
        b = Buffer(name)
        shape, dtype = self.like(b)
        if b.heads is not None:
            dim, lo, hi = head_range(b, *self.heads)
            shape = tuple(shape[:dim]) + (hi - lo,) + tuple(shape[dim + 1:])
        return tuple(shape), dtype

    def has(self, name: str) -> bool:
        b = Buffer(name)
        return b in self.bufs or (b.heads is not None and b.parent in self.bufs)

    def get(self, name: str) -> torch.Tensor:
        """The buffer, or the head slice of its whole buffer (a view)."""
        b = Buffer(name)
        hit = self.bufs.get(b)
        if hit is not None:
            return hit
        if b.heads is not None and b.parent in self.bufs:
            dim, lo, hi = head_range(b, *self.heads)
            return self.bufs[b.parent].narrow(dim, lo, hi - lo)
        raise RuntimeError(f"rank {self.rank}: buffer {b} is not here (the program is "
                           f"inconsistent; fringe.schedules.check finds such faults)")

    def outgoing(self, name: str) -> torch.Tensor:
        return self.get(name).contiguous()

    def incoming(self, name: str) -> torch.Tensor:
        shape, dtype = self.shape_of(name)
        return self.pool.get_shape(shape, dtype, self.device)

    def arrived(self, name: str, t: torch.Tensor) -> None:
        b = Buffer(name)
        if b.family.is_gradient and self.has(b):
            self.get(b).add_(t)
            self.pool.put(t)
        elif b.family is Family.OUT and self.has(b) and self.merge_out is not None:
            self.merge_out(self.get(b), t)
            self.pool.put(t)
        elif b.heads is not None and b.parent in self.bufs:
            self.get(b).copy_(t)
            self.pool.put(t)
        else:
            self.bufs[b] = t

    def accumulate(self, name: str, value: torch.Tensor) -> None:
        if self.has(name):
            self.get(name).add_(value)
        else:
            acc = self.pool.get(value)
            acc.copy_(value)
            self.bufs[Buffer(name)] = acc

    def release(self, step: int) -> None:
        for name in [n for n, t in self.last.items() if t == step]:
            if name in self.bufs and name not in self.protect and name.parent not in self.protect:
                self.pool.put(self.bufs.pop(name))


ComputeFn = Callable[[RankState, "Compute | GradCompute"], None]


def execute(programs: dict[int, Program], states: dict[int, RankState], transport: Transport,
            compute: ComputeFn) -> None:
    """Run the given ranks' programs in lockstep over their global step indices."""
    steps = {r: {s.index: s for s in programs[r].steps} for r in programs}
    indices = sorted({t for r in steps for t in steps[r]})
    for t in indices:
        pending = {}
        for r, st in states.items():
            step = steps[r].get(t)
            if step is None:
                continue
            sends, recvs, colls = [], [], []
            for op in step.comms:
                if isinstance(op, Send):
                    sends.append((op.peer, op.buf, st.outgoing(op.buf)))
                else:
                    recvs.append((op.peer, op.buf, st.incoming(op.buf)))
            for op in step.collectives:
                me = op.group.index(r)
                colls.append((op, [None if k == me or b is None else st.outgoing(b)
                                   for k, b in enumerate(op.sends)],
                              [None if k == me or b is None else st.incoming(b)
                               for k, b in enumerate(op.recvs)]))
            handle = (transport.issue(r, t, sends, recvs, colls) if colls else
                      transport.issue(r, t, sends, recvs))
            sent = sum(x.numel() * x.element_size() for _, _, x in sends) + sum(
                x.numel() * x.element_size() for _, xs, _ in colls for x in xs if x is not None)
            pending[r] = (step, recvs, colls, handle, sent)
        timings, events = {}, {}
        for r, (step, _, _, _, _) in pending.items():
            ev = _events(states[r])
            t0 = time.perf_counter()
            for op in step.computes:
                compute(states[r], op)
            timings[r] = time.perf_counter() - t0
            if ev is not None:
                ev[1].record()
            events[r] = ev
        for r, (step, recvs, colls, handle, sent) in pending.items():
            st = states[r]
            t0 = time.perf_counter()
            transport.wait(r, t, handle)
            wait_s = time.perf_counter() - t0
            ev = events[r]
            if ev is not None:
                ev[2].record()
            got = sum(x.numel() * x.element_size() for _, _, x in recvs)
            for _, name, buf in recvs:
                st.arrived(name, buf)
            for op, _, outs in colls:             # member order: a fixed order of summation
                for name, buf in zip(op.recvs, outs):
                    if buf is not None:
                        got += buf.numel() * buf.element_size()
                        st.arrived(name, buf)
            st.release(t)
            st.records.append(StepRecord(
                r, t, None if ev else timings[r], None if ev else wait_s, len(step.computes),
                sent, got, ev))


def _events(st: RankState):
    """Three timing events on CUDA (the first recorded now), else None."""
    if torch.device(st.device).type != "cuda":
        return None
    ev = tuple(torch.cuda.Event(enable_timing=True) for _ in range(3))
    ev[0].record()
    return ev
