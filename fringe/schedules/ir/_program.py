"""Steps and programs (one rank's steps), their text forms, and program helpers."""
from __future__ import annotations

import dataclasses
import re
from typing import Iterable, Iterator, Protocol, Sequence

from ._buffers import Buffer, Family
from ._ops import Collective, Comm, Compute, GradCompute, Op, Recv, Send, parse_op


def _comm_key(op: Comm) -> tuple:
    return op.peer, str.__str__(op.buf), isinstance(op, Recv)


@dataclasses.dataclass(frozen=True)
class Step:
    """One round on one rank: the ops it issues at global step ``index``."""

    index: int
    ops: tuple[Op, ...]

    @property
    def comms(self) -> tuple[Comm, ...]:
        """Sends and receives, in a canonical order (peer, buffer) both sides agree on."""
        comms = [op for op in self.ops if isinstance(op, (Send, Recv))]
        return tuple(sorted(comms, key=_comm_key))

    @property
    def computes(self) -> tuple[Compute | GradCompute, ...]:
        return tuple(op for op in self.ops if isinstance(op, (Compute, GradCompute)))

    @property
    def collectives(self) -> tuple[Collective, ...]:
        """Collectives, in program order (every member issues them in this order)."""
        return tuple(op for op in self.ops if isinstance(op, Collective))

    def reads(self) -> set[Buffer]:
        """Buffers this step's ops read (they must be present at the start of the step)."""
        return {b for op in self.ops for b in op.reads()}

    def writes(self) -> set[Buffer]:
        """Buffers this step's ops write or receive (present from the next step)."""
        return {b for op in self.ops for b in op.writes()}

    def __str__(self) -> str:
        return f"t{self.index}: " + " | ".join(str(op) for op in self.ops)

    def ascii(self) -> str:
        """Plain-ASCII form: ``t0: S kv0->r1 | C q0.kv0``."""
        return f"t{self.index}: " + " | ".join(op.ascii() for op in self.ops)

    @classmethod
    def parse(cls, text: str) -> Step:
        """Inverse of ``str`` and ``ascii``: ``Step.parse("t0: S kv0->r1 | C q0.kv0")``."""
        head, sep, body = text.partition(":")
        head = head.strip()
        if not sep or not re.fullmatch(r"t\d+", head):
            raise ValueError(f"cannot parse step {text!r}; expected 't<index>: op | op ...'")
        ops = tuple(parse_op(part) for part in body.split("|") if part.strip())
        return cls(int(head[1:]), ops)


class _StepSource(Protocol):
    """What a :class:`Program` cut from a table asks of it: one rank's steps, built on first
    access (:class:`~fringe.schedules.ir.ProgramTable` is the one such source; it sits above
    this module and hands itself to :meth:`Program._from_table`)."""

    def _steps_of(self, rank: int) -> tuple[Step, ...]: ...


class Program:
    """One rank's list of steps (increasing, distinct indices); an immutable value.

    ``Program(rank, steps)``. Programs that come from a :class:`ProgramTable` (what the
    passes produce for the built-in schedules) build their steps on first access, so a plan
    at P=1024 holds arrays, and a rank materialises only the programs it looks at.
    """

    __slots__ = ("rank", "_steps", "_source", "__weakref__")

    def __init__(self, rank: int, steps: tuple[Step, ...]) -> None:
        object.__setattr__(self, "rank", rank)
        object.__setattr__(self, "_steps", tuple(steps))
        object.__setattr__(self, "_source", None)
        self._validate()

    @classmethod
    def _from_table(cls, table: _StepSource, rank: int) -> Program:
        self = object.__new__(cls)
        object.__setattr__(self, "rank", rank)
        object.__setattr__(self, "_steps", None)
        object.__setattr__(self, "_source", table)
        return self

    @property
    def steps(self) -> tuple[Step, ...]:
        if self._steps is None:
            object.__setattr__(self, "_steps", self._source._steps_of(self.rank))
        return self._steps

    @property
    def table(self) -> _StepSource | None:
        """The columnar table (a :class:`~fringe.schedules.ir.ProgramTable`) this program was
        cut from, if any (the passes' fast path)."""
        return self._source

    def _validate(self) -> None:
        prev = -1
        for s in self.steps:
            if s.index <= prev:
                raise ValueError(f"rank {self.rank}: step indices must increase strictly, got "
                                 f"{[s.index for s in self.steps]}")
            prev = s.index

    def __setattr__(self, name, value) -> None:
        raise dataclasses.FrozenInstanceError(f"cannot assign to field {name!r}")

    def __eq__(self, other) -> bool:
        if not isinstance(other, Program):
            return NotImplemented
        return self.rank == other.rank and self.steps == other.steps

    def __hash__(self) -> int:
        return hash((self.rank, self.steps))

    def __repr__(self) -> str:
        return f"Program(rank={self.rank!r}, steps={self.steps!r})"

    def __reduce__(self):
        return (Program, (self.rank, self.steps))

    def ops(self) -> Iterator[tuple[int, Op]]:
        """Yield ``(step_index, op)`` pairs in program order."""
        for step in self.steps:
            for op in step.ops:
                yield step.index, op

    def last_uses(self) -> dict[Buffer, int]:
        """Last step index at which each buffer is read, written or moved by the program."""
        last: dict[Buffer, int] = {}
        for step in self.steps:
            for op in step.ops:
                for b in op.reads():
                    last[b] = step.index
                for b in op.writes():
                    last[b] = step.index
        return last

    def remote_reads(self, family: Family | str = Family.KV) -> list[Buffer]:
        """Sorted buffers of ``family`` its computes read that another rank owns.

        With ``kv="keep"``, these are the kv buffers a rank keeps from forward to backward.
        """
        fam = Family(family)
        found = {b for step in self.steps for op in step.computes for b in op.reads()
                 if b.family is fam and b.chunk != self.rank}
        return sorted(found)

    def __str__(self) -> str:
        return f"r{self.rank}:\n" + "\n".join(f"  {s}" for s in self.steps)

    def ascii(self) -> str:
        """Plain-ASCII form, one step a line (``Program.parse`` reads it back)."""
        return f"r{self.rank}:\n" + "\n".join(f"  {s.ascii()}" for s in self.steps)

    @classmethod
    def parse(cls, text: str) -> Program:
        """Inverse of ``str`` and ``ascii``."""
        lines = [ln for ln in text.strip().splitlines() if ln.strip()]
        if not lines or not re.match(r"^r\d+:$", lines[0].strip()):
            raise ValueError(f"cannot parse program; first line must be 'r<rank>:', got {lines[:1]}")
        return cls(int(lines[0].strip()[1:-1]), tuple(Step.parse(ln) for ln in lines[1:]))


def format_programs(programs: Iterable[Program], *, ascii: bool = True) -> str:
    """All ranks' programs as text, one after the other (ASCII by default, for goldens)."""
    return "\n".join(p.ascii() if ascii else str(p) for p in programs) + "\n"


def parse_programs(text: str) -> list[Program]:
    """Inverse of :func:`format_programs`; lines starting with ``#`` are comments."""
    blocks: list[list[str]] = []
    for line in text.splitlines():
        s = line.strip()
        if not s or s.startswith("#"):
            continue
        if re.fullmatch(r"r\d+:", s):
            blocks.append([s])
        elif not blocks:
            raise ValueError(f"cannot parse programs: step line {s!r} before any 'r<rank>:' line")
        else:
            blocks[-1].append(s)
    return [Program.parse("\n".join(b)) for b in blocks]


def program_from_ops(rank: int, ops: dict[int, list[Op]]) -> Program:
    """Build a program from ``{step_index: [ops]}``, dropping empty steps."""
    return Program(rank, tuple(Step(t, tuple(ops[t])) for t in sorted(ops) if ops[t]))


def marked(program: Program, step_index: int, *, context: int = 3,
           marker: str = "<-- ERROR HERE") -> str:
    """The program's text with ``marker`` on the line of step ``step_index``.

    Long programs show ``context`` steps either side of it, the rest elided.
    """
    lines = [f"r{program.rank}:"]
    at = next((n for n, s in enumerate(program.steps) if s.index == step_index), None)
    lo, hi = (0, len(program.steps)) if at is None else (max(0, at - context), at + context + 1)
    if lo > 0:
        lines.append(f"  ... ({lo} steps)")
    for n, s in enumerate(program.steps[lo:hi], start=lo):
        lines.append(f"  {s}" + (f"    {marker}" if n == at else ""))
    if hi < len(program.steps):
        lines.append(f"  ... ({len(program.steps) - hi} steps)")
    if at is None:
        lines.append(f"  t{step_index}: (no such step)    {marker}")
    return "\n".join(lines)


def steps_of(programs: Sequence[Program]) -> int:
    """Number of global rounds: 1 + the largest step index (0 for empty programs)."""
    return 1 + max((p.steps[-1].index for p in programs if p.steps), default=-1)
