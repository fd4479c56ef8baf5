"""The schedule IR: small immutable ops grouped into steps, one program per rank.

Buffers are named by what they hold and the chunk (owning rank) they come from:
``q3`` (rank 3's queries), ``kv5`` (rank 5's keys and values, packed ``[2, B, G, L, D]``),
``dkv5`` (the gradient of ``kv5``, which travels back to rank 5).

Ops and their compact text forms (``parse(str(op)) == op``):

============================  ===============  ==========================================
op                            text             meaning
============================  ===============  ==========================================
``Compute(q=3, kv=5)``        ``C q3·kv5``     tile forward: out/lse of q3 against kv5
``GradCompute(q=3, kv=5)``    ``G q3·kv5``     its VJP: dq3 += ..., dkv5 += ...
``Send("kv5", peer=2)``       ``S kv5→r2``     send buffer kv5 to rank 2
``Recv("kv5", peer=0)``       ``R kv5←r0``     receive buffer kv5 from rank 0
============================  ===============  ==========================================

Semantics of one step on one rank: its communication is *issued* first, its tiles are
computed on buffers that were present at the start of the step (so compute overlaps the
transfers in flight), and the communication *completes* at the end of the step. A buffer
received in step t is usable from step t+1. A received gradient buffer (``dkv*``) is
accumulated into the local one. Every ``Send`` at step t on rank a has a matching ``Recv``
of the same buffer from a at step t on its peer (checked by :func:`fringe.schedules.check`).
Steps with nothing to do are absent; step indices are global rounds.
"""
from __future__ import annotations

import dataclasses
import re
from typing import Union

_NAME = re.compile(r"^(d?kv|d?q)(\d+)$")


def buffer_name(kind: str, chunk: int) -> str:
    """``buffer_name("kv", 5) == "kv5"``."""
    return f"{kind}{chunk}"


def split_name(name: str) -> tuple[str, int]:
    """``split_name("dkv5") == ("dkv", 5)``; raises on names outside the IR."""
    m = _NAME.match(name)
    if not m:
        raise ValueError(f"buffer name {name!r} is not one of q<i>, kv<j>, dq<i>, dkv<j>")
    return m.group(1), int(m.group(2))


@dataclasses.dataclass(frozen=True)
class Compute:
    """Tile forward of q chunk ``q`` against kv chunk ``kv``."""

    q: int
    kv: int

    def __str__(self) -> str:
        return f"C q{self.q}·kv{self.kv}"


@dataclasses.dataclass(frozen=True)
class GradCompute:
    """The VJP of ``Compute(q, kv)``: accumulates dq and the travelling dkv."""

    q: int
    kv: int

    def __str__(self) -> str:
        return f"G q{self.q}·kv{self.kv}"


@dataclasses.dataclass(frozen=True)
class Send:
    """Send buffer ``buf`` to rank ``peer``."""

    buf: str
    peer: int

    def __post_init__(self) -> None:
        split_name(self.buf)

    def __str__(self) -> str:
        return f"S {self.buf}→r{self.peer}"


@dataclasses.dataclass(frozen=True)
class Recv:
    """Receive buffer ``buf`` from rank ``peer`` (gradient buffers accumulate)."""

    buf: str
    peer: int

    def __post_init__(self) -> None:
        split_name(self.buf)

    def __str__(self) -> str:
        return f"R {self.buf}←r{self.peer}"


Op = Union[Compute, GradCompute, Send, Recv]
Comm = Union[Send, Recv]

_OP = re.compile(r"^\s*(?:([CG])\s+q(\d+)\s*·\s*kv(\d+)|([SR])\s+(\w+)\s*([→←])\s*r(\d+))\s*$")


def parse_op(text: str) -> Op:
    """Parse the text form of one op: ``parse_op("S kv5→r2") == Send("kv5", 2)``."""
    m = _OP.match(text)
    if not m:
        raise ValueError(f"cannot parse op {text!r}; expected e.g. 'C q3·kv5', 'G q3·kv5', "
                         f"'S kv5→r2' or 'R kv5←r0'")
    if m.group(1):
        cls = Compute if m.group(1) == "C" else GradCompute
        return cls(int(m.group(2)), int(m.group(3)))
    kind, buf, arrow, peer = m.group(4), m.group(5), m.group(6), int(m.group(7))
    if (kind, arrow) not in {("S", "→"), ("R", "←")}:
        raise ValueError(f"op {text!r}: a send uses '→', a receive '←'")
    return (Send if kind == "S" else Recv)(buf, peer)


@dataclasses.dataclass(frozen=True)
class Step:
    """One round on one rank: the ops it issues at global step ``index``."""

    index: int
    ops: tuple[Op, ...]

    @property
    def comms(self) -> tuple[Comm, ...]:
        """Sends and receives, in a canonical order (peer, buffer) both sides agree on."""
        comms = [op for op in self.ops if isinstance(op, (Send, Recv))]
        return tuple(sorted(comms, key=lambda op: (op.peer, op.buf, isinstance(op, Recv))))

    @property
    def computes(self) -> tuple[Compute | GradCompute, ...]:
        return tuple(op for op in self.ops if isinstance(op, (Compute, GradCompute)))

    def __str__(self) -> str:
        return f"t{self.index}: " + " | ".join(str(op) for op in self.ops)

    @classmethod
    def parse(cls, text: str) -> Step:
        """Inverse of ``str``: ``Step.parse("t0: S kv0→r1 | C q0·kv0")``."""
        head, sep, body = text.partition(":")
        if not sep or not head.strip().startswith("t"):
            raise ValueError(f"cannot parse step {text!r}; expected 't<index>: op | op ...'")
        ops = tuple(parse_op(part) for part in body.split("|") if part.strip())
        return cls(int(head.strip()[1:]), ops)


@dataclasses.dataclass(frozen=True)
class Program:
    """One rank's list of steps (increasing, distinct indices)."""

    rank: int
    steps: tuple[Step, ...]

    def __post_init__(self) -> None:
        idx = [s.index for s in self.steps]
        if idx != sorted(set(idx)):
            raise ValueError(f"rank {self.rank}: step indices must increase strictly, got {idx}")

    def ops(self):
        """Yield ``(step_index, op)`` pairs in program order."""
        for step in self.steps:
            for op in step.ops:
                yield step.index, op

    def __str__(self) -> str:
        return f"r{self.rank}:\n" + "\n".join(f"  {s}" for s in self.steps)

    @classmethod
    def parse(cls, text: str) -> Program:
        """Inverse of ``str``."""
        lines = [ln for ln in text.strip().splitlines() if ln.strip()]
        if not lines or not re.match(r"^r\d+:$", lines[0].strip()):
            raise ValueError(f"cannot parse program; first line must be 'r<rank>:', got {lines[:1]}")
        return cls(int(lines[0].strip()[1:-1]), tuple(Step.parse(ln) for ln in lines[1:]))


def program_from_ops(rank: int, ops: dict[int, list[Op]]) -> Program:
    """Build a program from ``{step_index: [ops]}``, dropping empty steps."""
    return Program(rank, tuple(Step(t, tuple(ops[t])) for t in sorted(ops) if ops[t]))
