"""One interpreter for every schedule and every transport.

:func:`execute` runs the programs of the ranks this process drives (all P on the virtual
mesh, one under ``torch.distributed``) in lockstep over global step indices. For each step
it *issues* the step's communication, *computes* the step's tiles on buffers already
present (the transfers are in flight meanwhile), then *waits* for the communication and
files what arrived. A transport only moves tensors:

.. code-block:: python

    class Transport(Protocol):
        def issue(self, rank, step, sends, recvs) -> handle   # sends: [(peer, buf, tensor)]
        def wait(self, rank, step, handle) -> None            # recvs: [(peer, buf, out)]

Buffers come from a per-rank pool and go back to it after their last use in the program,
so a ring keeps about two kv buffers alive and reuses them step after step.

Forward state per rank: its own ``kv{r}`` (k and v packed as ``[2, B, G, L, D]``) and the
running (out, lse) of its queries, merged tile by tile. Backward state: ``dq`` and the
``dkv{j}`` accumulators that travel back to their owners.
"""
from __future__ import annotations

import collections
import dataclasses
import time
from typing import Any, Callable, Protocol

import torch

from ..schedules.ir import Compute, GradCompute, Program, Send, buffer_name, split_name


class Transport(Protocol):
    def issue(self, rank: int, step: int, sends: list, recvs: list) -> Any: ...

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
        key = (tuple(like.shape), like.dtype, like.device)
        if self._free[key]:
            return self._free[key].pop()
        self.allocated += 1
        return torch.empty_like(like, memory_format=torch.contiguous_format)

    def put(self, t: torch.Tensor) -> None:
        self._free[(tuple(t.shape), t.dtype, t.device)].append(t)


def last_uses(program: Program) -> dict[str, int]:
    """Last step index at which each buffer name is touched by the program."""
    last: dict[str, int] = {}
    for t, op in program.ops():
        if isinstance(op, (Compute, GradCompute)):
            last[buffer_name("kv", op.kv)] = t
            if isinstance(op, GradCompute):
                last[buffer_name("dkv", op.kv)] = t
        else:
            last[op.buf] = t
    return last


class RankState:
    """Buffers of one rank while its program runs."""

    def __init__(self, rank: int, program: Program, *, kv_like: torch.Tensor,
                 grad_like: torch.Tensor | None, protect: set[str]) -> None:
        self.rank = rank
        self.program = program
        self.bufs: dict[str, torch.Tensor] = {}
        self.pool = Pool()
        self.kv_like = kv_like
        self.grad_like = grad_like
        self.protect = set(protect)
        self.last = last_uses(program)
        self.records: list[StepRecord] = []

    def outgoing(self, name: str) -> torch.Tensor:
        if name not in self.bufs:
            raise RuntimeError(f"rank {self.rank}: buffer {name} is not here to send "
                               f"(the program is inconsistent)")
        return self.bufs[name]

    def incoming(self, name: str) -> torch.Tensor:
        kind, _ = split_name(name)
        like = self.grad_like if kind.startswith("d") else self.kv_like
        return self.pool.get(like)

    def arrived(self, name: str, t: torch.Tensor) -> None:
        kind, _ = split_name(name)
        if kind.startswith("d") and name in self.bufs:
            self.bufs[name].add_(t)
            self.pool.put(t)
        else:
            self.bufs[name] = t

    def accumulate(self, name: str, value: torch.Tensor) -> None:
        if name in self.bufs:
            self.bufs[name].add_(value)
        else:
            acc = self.pool.get(value)
            acc.copy_(value)
            self.bufs[name] = acc

    def release(self, step: int) -> None:
        for name in [n for n, t in self.last.items() if t == step]:
            if name in self.bufs and name not in self.protect:
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
            sends, recvs = [], []
            for op in step.comms:
                if isinstance(op, Send):
                    sends.append((op.peer, op.buf, st.outgoing(op.buf)))
                else:
                    recvs.append((op.peer, op.buf, st.incoming(op.buf)))
            pending[r] = (step, recvs, transport.issue(r, t, sends, recvs),
                          sum(x.numel() * x.element_size() for _, _, x in sends))
        timings, events = {}, {}
        for r, (step, _, _, _) in pending.items():
            ev = _events(states[r])
            t0 = time.perf_counter()
            for op in step.computes:
                compute(states[r], op)
            timings[r] = time.perf_counter() - t0
            if ev is not None:
                ev[1].record()
            events[r] = ev
        for r, (step, recvs, handle, sent) in pending.items():
            st = states[r]
            t0 = time.perf_counter()
            transport.wait(r, t, handle)
            wait_s = time.perf_counter() - t0
            ev = events[r]
            if ev is not None:
                ev[2].record()
            for _, name, buf in recvs:
                st.arrived(name, buf)
            st.release(t)
            st.records.append(StepRecord(
                r, t, None if ev else timings[r], None if ev else wait_s, len(step.computes),
                sent, sum(x.numel() * x.element_size() for _, _, x in recvs), ev))


def _events(st: RankState):
    """Three timing events on CUDA (the first recorded now), else None."""
    if not st.kv_like.is_cuda:
        return None
    ev = tuple(torch.cuda.Event(enable_timing=True) for _ in range(3))
    ev[0].record()
    return ev
