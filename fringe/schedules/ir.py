"""The schedule IR: small immutable ops grouped into steps, one program per rank.

Buffers are typed ids (:class:`Buffer`): a *family* (what the buffer holds) and a *chunk*
(the rank that owns the data). They print as, and parse from, short names:

=========  ==========================================================================
name       family
=========  ==========================================================================
``q3``     ``Family.Q``: rank 3's queries ``[B, H, L, D]``
``kv5``    ``Family.KV``: rank 5's keys and values, packed ``[2, B, G, L, D]``
``out3``   ``Family.OUT``: the (out, lse) of q3's rows, partial or merged
``dq3``    ``Family.DQ``: the gradient of ``q3``
``dkv5``   ``Family.DKV``: the gradient of ``kv5``, which travels back to rank 5
``dout3``  ``Family.DOUT``: the cotangent of ``out3``
``acc0``   ``Family.ACC``: an accumulator for parameter gradients (e.g. a score_mod's)
=========  ==========================================================================

Ops, what they read and write, their adjoint, and their text forms (``parse_op(str(op)) ==
parse_op(op.ascii()) == op``; the pretty form is for display, the ASCII one for goldens):

==========================  ============  ==============  ===================  ==================
op                          pretty        ASCII           reads -> writes      adjoint
==========================  ============  ==============  ===================  ==================
``Compute(q=3, kv=5)``      ``C q3·kv5``  ``C q3.kv5``    q3, kv5 -> out3      ``G q3·kv5``
``GradCompute(q=3, kv=5)``  ``G q3·kv5``  ``G q3.kv5``    q3, kv5, out3,       ``C q3·kv5``
                                                          dout3 -> dq3, dkv5
``Send("kv5", peer=2)``     ``S kv5→r2``  ``S kv5->r2``   kv5 ->               ``R dkv5←r2``
``Recv("kv5", peer=0)``     ``R kv5←r0``  ``R kv5<-r0``   -> kv5               ``S dkv5→r0``
==========================  ============  ==============  ===================  ==================

Head slices: ``q3h1/4`` is head slice 1 of 4 of ``q3`` (query heads ``[H/4, 2H/4)``; for kv the
kv heads those read, replicated when ``4 % G == 0``); ``Compute(3, 5, heads=(1, 4))`` prints
``C q3·kv5 h1/4``, reads ``q3h1/4, kv5h1/4`` and merges into ``out3h1/4``. On the rank that
holds the whole buffer a slice is a view of it.

Collectives (:class:`Collective`) over a fixed group, one side per member, one slot per
member (``-``: an empty contribution): ``AG[0,1,2] kv0,kv0,- > -,kv1,kv2`` (ASCII; ``⇄``
pretty) reads what it sends and writes what it receives; its adjoint is ``RS[0,1,2]
-,dkv1,dkv2 > dkv0,dkv0,-`` (received gradients accumulate in member order), and an ``A2A``'s
adjoint is the inverse ``A2A`` of the cotangents. Queries and partial outputs may move:
``S q3h1/2->r1``, ``R out3<-r2`` (a received partial ``out`` merges by its lse; in the
backward the merged ``out`` travels with its cotangent ``dout``).

Semantics of one step on one rank: its communication is *issued* first, its tiles are
computed on buffers that were present at the start of the step (so compute overlaps the
transfers in flight), and the communication *completes* at the end of the step. A buffer
received in step t is usable from step t+1. A received gradient buffer (``dkv*``) is
accumulated into the local one. Every ``Send`` at step t on rank a has a matching ``Recv``
of the same buffer from a at step t on its peer (checked by :func:`fringe.schedules.check`).
Steps with nothing to do are absent; step indices are global rounds.

At scale the same programs live in a :class:`ProgramTable` (one row of integers per op);
the passes run on its columns, and a :class:`Program` cut from it builds its steps only when
they are looked at.

>>> p = Program.parse("r1:\\n  t0: R kv0<-r0 | C q1.kv1\\n  t1: C q1.kv0")
>>> print(p)
r1:
  t0: R kv0←r0 | C q1·kv1
  t1: C q1·kv0
>>> [str(b) for b in p.steps[0].ops[0].writes()], p.steps[0].ops[0].adjoint().ascii()
(['kv0'], 'S dkv0->r0')
"""
from __future__ import annotations

import bisect
import dataclasses
import enum
import itertools
import re
from typing import Iterable, Iterator, Sequence, Union


class Family(str, enum.Enum):
    """What a buffer holds; the prefix of its name."""

    Q = "q"
    KV = "kv"
    OUT = "out"
    DQ = "dq"
    DKV = "dkv"
    DOUT = "dout"
    ACC = "acc"

    @property
    def is_gradient(self) -> bool:
        """True for families that hold cotangents (they accumulate when received)."""
        return self in _GRADIENT

    @property
    def cotangent(self) -> Family:
        """The family of this one's adjoint (``kv`` <-> ``dkv``, ``q`` <-> ``dq``, ``out`` <-> ``dout``).

        Raises:
            ValueError: for ``acc``, whose primal (a parameter) is not a buffer of the IR.
        """
        if self not in _COTANGENT:
            raise ValueError(f"buffer family {self.value!r} has no adjoint in the IR; only "
                             f"{sorted(f.value for f in _COTANGENT)} move in a differentiated program")
        return _COTANGENT[self]


_GRADIENT = frozenset({Family.DQ, Family.DKV, Family.DOUT, Family.ACC})
_COTANGENT = {Family.Q: Family.DQ, Family.KV: Family.DKV, Family.OUT: Family.DOUT,
              Family.DQ: Family.Q, Family.DKV: Family.KV, Family.DOUT: Family.OUT}
_BY_PREFIX = {f.value: f for f in Family}
_NAME = re.compile(r"^(dout|dkv|dq|out|kv|q|acc)(\d+)(?:h(\d+)/(\d+))?$")
_INTERNED: dict[str, Buffer] = {}
#: Every interned buffer of the input (q, kv), output and gradient families, so that the
#: passes ask a collective's slots by set operations (in C) instead of slot by slot.
_BUFS_OF: dict[str, set] = {"input": set(), "out": set(), "gradient": set()}
_FIELDS: dict[str, tuple[Family, int, tuple[int, int] | None]] = {}
_COT_CACHE: dict[str, Buffer] = {}


class Buffer(str):
    """A typed buffer id: ``family`` and ``chunk``, equal to (and printed as) its name.

    It is a ``str`` so that names and ids are interchangeable (``Buffer.of("kv", 5) ==
    "kv5"``), which keeps the runtime's buffer tables keyed by name; the family is a field,
    never re-parsed from the name. Ids are interned, immutable values.

    >>> b = Buffer("dkv5"); (b.family, b.chunk, b.family.cotangent, b == "dkv5")
    (<Family.DKV: 'dkv'>, 5, <Family.KV: 'kv'>, True)
    """

    __slots__ = ()

    def __new__(cls, name: str) -> Buffer:
        if type(name) is cls:
            return name
        hit = _INTERNED.get(name)
        if hit is not None:
            return hit
        m = _NAME.match(name) if isinstance(name, str) else None
        if not m:
            raise ValueError(f"buffer name {name!r} is not one of "
                             f"{', '.join(f.value + '<chunk>' for f in Family)} (e.g. 'kv5'), "
                             f"optionally with a head slice 'h<i>/<n>' (e.g. 'q3h1/4')")
        heads = None
        if m.group(3) is not None:
            heads = (int(m.group(3)), int(m.group(4)))
            if not 0 <= heads[0] < heads[1]:
                raise ValueError(f"buffer {name!r}: head slice h{heads[0]}/{heads[1]} needs "
                                 f"0 <= i < n")
        self = str.__new__(cls, name)
        family = _BY_PREFIX[m.group(1)]
        _FIELDS[name] = (family, int(m.group(2)), heads)
        _INTERNED[name] = self
        if family in (Family.Q, Family.KV):
            _BUFS_OF["input"].add(self)
        elif family is Family.OUT:
            _BUFS_OF["out"].add(self)
        if family.is_gradient:
            _BUFS_OF["gradient"].add(self)
        return self

    @classmethod
    def of(cls, family: Family | str, chunk: int, heads: tuple[int, int] | None = None) -> Buffer:
        """``Buffer.of("kv", 5)`` is ``Buffer("kv5")``; ``Buffer.of("q", 3, (1, 4))`` is ``q3h1/4``."""
        fam = family if isinstance(family, Family) else _BY_PREFIX.get(family)
        if fam is None:
            raise ValueError(f"unknown buffer family {family!r}; expected one of "
                             f"{[f.value for f in Family]}")
        if not isinstance(chunk, int) or chunk < 0:
            raise ValueError(f"buffer chunk must be an int >= 0, got {chunk!r}")
        if heads is None:
            return cls(f"{fam.value}{chunk}")
        return cls(f"{fam.value}{chunk}h{heads[0]}/{heads[1]}")

    @property
    def family(self) -> Family:
        """What the buffer holds."""
        return _FIELDS[self][0]

    @property
    def chunk(self) -> int:
        """The rank that owns the data."""
        return _FIELDS[self][1]

    @property
    def heads(self) -> tuple[int, int] | None:
        """``(i, n)``: the buffer holds head slice i of n of its chunk (None: all heads).

        Query-side families (q, out, dq, dout) hold query heads ``[i*H/n, (i+1)*H/n)``; kv
        families hold the kv heads those query heads read (``G/n`` of them when
        ``G % n == 0``, else the one kv head they share: kv heads replicated when
        ``n % G == 0``).
        """
        return _FIELDS[self][2]

    @property
    def parent(self) -> Buffer:
        """The whole-heads buffer of the same family and chunk (itself when not sliced)."""
        fam, chunk, heads = _FIELDS[self]
        return self if heads is None else _buf(fam, chunk)

    @property
    def cotangent(self) -> Buffer:
        """The adjoint buffer of the same chunk: ``Buffer("kv5").cotangent == "dkv5"``."""
        hit = _COT_CACHE.get(self)
        if hit is None:
            family, chunk, heads = _FIELDS[self]
            hit = _COT_CACHE[self] = Buffer.of(family.cotangent, chunk, heads)
        return hit

    def __repr__(self) -> str:
        return f"Buffer({str.__repr__(self)})"

    def __reduce__(self):
        return (Buffer, (str(self),))


def _buf(family: Family, chunk: int) -> Buffer:
    """Interned ``Buffer`` for (family, chunk), fast path for the passes (a list per family,
    indexed by chunk)."""
    try:
        return _BY_CHUNK[family][chunk]
    except IndexError:
        row = _BY_CHUNK[family]
        if chunk < 0:
            raise ValueError(f"buffer chunk must be an int >= 0, got {chunk!r}") from None
        row.extend(Buffer(_PREFIX[family] + str(c)) for c in range(len(row), chunk + 1))
        return row[chunk]


_BY_CHUNK: dict[Family, list[Buffer]] = {f: [] for f in Family}


_PREFIX = {f: f.value for f in Family}
_Q, _KV, _OUT, _DQ, _DKV, _DOUT = (Family.Q, Family.KV, Family.OUT, Family.DQ, Family.DKV,
                                   Family.DOUT)

#: Sides of a tile op: the buffer of its q chunk or of its kv chunk.
Q_SIDE, KV_SIDE = 0, 1


@dataclasses.dataclass(frozen=True)
class OpRule:
    """What ops of one kind touch: the buffer-touch rule, written once (:data:`RULES`).

    ``reads`` and ``writes`` name what the op touches. A tile op (``C``, ``G``) touches
    ``(family, side)`` pairs: side :data:`Q_SIDE` is the buffer of the op's q chunk,
    :data:`KV_SIDE` of its kv chunk (a head slice carries over). A transfer touches its one
    buffer (``"buf"``); a collective its occupied send slots (``"sends"``) and receive slots
    (``"recvs"``). ``adjoint`` is the kind of the adjoint op (transfers and collectives move
    the cotangents of their buffers). ``own_slot_in_place`` (collectives): the slot of the
    rank itself stays in place, so its buffer is neither sent nor received by that slot (it
    is when another slot of the same side also holds it).

    The op views (:meth:`Compute.reads`, ...) and the column passes (through
    :meth:`touch_codes`) read this table; nothing else restates it.
    """

    kind: str
    reads: tuple
    writes: tuple
    adjoint: str
    own_slot_in_place: bool = False

    def touches(self) -> tuple[tuple[Family, int, bool], ...]:
        """A tile op's touches as ``(family, side, written)``: its reads, then its writes."""
        return (tuple((f, s, False) for f, s in self.reads)
                + tuple((f, s, True) for f, s in self.writes))

    def touch_codes(self) -> tuple[tuple[int, int, bool], ...]:
        """:meth:`touches` with family codes (indices into ``tuple(Family)``, as in a
        :class:`ProgramTable`)."""
        code = {f: n for n, f in enumerate(Family)}
        return tuple((code[f], s, w) for f, s, w in self.touches())


#: The rule of every op kind, by its text letter (collectives by their kind).
RULES: dict[str, OpRule] = {
    "C": OpRule("C", reads=((_Q, Q_SIDE), (_KV, KV_SIDE)), writes=((_OUT, Q_SIDE),),
                adjoint="G"),
    "G": OpRule("G", reads=((_Q, Q_SIDE), (_KV, KV_SIDE), (_OUT, Q_SIDE), (_DOUT, Q_SIDE)),
                writes=((_DQ, Q_SIDE), (_DKV, KV_SIDE)), adjoint="C"),
    "S": OpRule("S", reads=("buf",), writes=(), adjoint="R"),
    "R": OpRule("R", reads=(), writes=("buf",), adjoint="S"),
    "AG": OpRule("AG", reads=("sends",), writes=("recvs",), adjoint="RS", own_slot_in_place=True),
    "RS": OpRule("RS", reads=("sends",), writes=("recvs",), adjoint="AG", own_slot_in_place=True),
    "A2A": OpRule("A2A", reads=("sends",), writes=("recvs",), adjoint="A2A",
                  own_slot_in_place=True),
}


def _tile_view(pairs):
    """``(q, kv) -> buffers`` of a rule's ``(family, side)`` pairs on whole heads, built once
    from :data:`RULES` and unrolled for the short rules (the passes' hot path)."""
    fs, ss = tuple(f for f, _ in pairs), tuple(s for _, s in pairs)
    if len(pairs) == 1:
        (f0,), (s0,) = fs, ss
        return lambda qk: (_buf(f0, qk[s0]),)
    if len(pairs) == 2:
        (f0, f1), (s0, s1) = fs, ss
        return lambda qk: (_buf(f0, qk[s0]), _buf(f1, qk[s1]))
    if len(pairs) == 4:
        (f0, f1, f2, f3), (s0, s1, s2, s3) = fs, ss
        return lambda qk: (_buf(f0, qk[s0]), _buf(f1, qk[s1]), _buf(f2, qk[s2]), _buf(f3, qk[s3]))
    return lambda qk: tuple([_buf(f, qk[s]) for f, s in pairs])


_C_READS, _C_WRITES = RULES["C"].reads, RULES["C"].writes
_G_READS, _G_WRITES = RULES["G"].reads, RULES["G"].writes
_C_R, _C_W, _G_R, _G_W = map(_tile_view, (_C_READS, _C_WRITES, _G_READS, _G_WRITES))


def buffer_name(kind: str, chunk: int) -> Buffer:
    """``buffer_name("kv", 5) == "kv5"`` (a :class:`Buffer`, which is a ``str``)."""
    return Buffer.of(kind, chunk)


def split_name(name: str) -> tuple[str, int]:
    """``split_name("dkv5") == ("dkv", 5)``; raises on names outside the IR (head slices drop)."""
    b = Buffer(name)
    return b.family.value, b.chunk


class _Op:
    """What every op answers: the buffers it reads and writes, and its adjoint."""

    __slots__ = ()

    def reads(self) -> tuple[Buffer, ...]:
        raise NotImplementedError

    def writes(self) -> tuple[Buffer, ...]:
        raise NotImplementedError

    def adjoint(self) -> Op:
        raise NotImplementedError

    def ascii(self) -> str:
        """The plain-ASCII text form (``parse_op`` reads it back)."""
        raise NotImplementedError


def _heads_suffix(heads) -> str:
    return "" if heads is None else f" h{heads[0]}/{heads[1]}"


def _check_heads(op, heads) -> None:
    if heads is not None and (len(heads) != 2 or not 0 <= heads[0] < heads[1]):
        raise ValueError(f"{type(op).__name__}: heads must be None or (i, n) with 0 <= i < n, "
                         f"got {heads!r}")


class _Tile(_Op):
    """What ``Compute`` and ``GradCompute`` share: tile (q chunk ``q``, kv chunk ``kv``), an
    optional head slice, and the text form ``<letter> q3·kv5 [h1/4]``."""

    __slots__ = ()
    _LETTER = ""

    def __post_init__(self) -> None:
        if self.heads is not None:
            _check_heads(self, self.heads)
            object.__setattr__(self, "heads", (int(self.heads[0]), int(self.heads[1])))

    def _bufs(self, pairs) -> tuple[Buffer, ...]:
        """This head-sliced tile's buffers of the rule's ``(family, side)`` pairs."""
        qk = (self.q, self.kv)
        return tuple([Buffer.of(f, qk[s], self.heads) for f, s in pairs])

    def __str__(self) -> str:
        return f"{self._LETTER} q{self.q}·kv{self.kv}{_heads_suffix(self.heads)}"

    def ascii(self) -> str:
        return f"{self._LETTER} q{self.q}.kv{self.kv}{_heads_suffix(self.heads)}"


@dataclasses.dataclass(frozen=True, slots=True)
class Compute(_Tile):
    """Tile forward of q chunk ``q`` against kv chunk ``kv``: merges into ``out{q}``.

    With ``heads=(i, n)`` only head slice i of n is computed (reading ``q{q}h{i}/{n}`` and
    ``kv{kv}h{i}/{n}``, merging into ``out{q}h{i}/{n}``); the mask and score mods still see
    the global head index.
    """

    q: int
    kv: int
    heads: tuple[int, int] | None = None
    _LETTER = "C"

    def reads(self) -> tuple[Buffer, ...]:
        if self.heads is None:                  # the passes' hot path
            return _C_R((self.q, self.kv))
        return self._bufs(_C_READS)

    def writes(self) -> tuple[Buffer, ...]:
        if self.heads is None:
            return _C_W((self.q, self.kv))
        return self._bufs(_C_WRITES)

    def adjoint(self) -> GradCompute:
        return _TILE_OF[_C_ADJ](self.q, self.kv, self.heads)


@dataclasses.dataclass(frozen=True, slots=True)
class GradCompute(_Tile):
    """The VJP of ``Compute(q, kv)``: accumulates ``dq{q}`` and the travelling ``dkv{kv}``."""

    q: int
    kv: int
    heads: tuple[int, int] | None = None
    _LETTER = "G"

    def reads(self) -> tuple[Buffer, ...]:
        if self.heads is None:
            return _G_R((self.q, self.kv))
        return self._bufs(_G_READS)

    def writes(self) -> tuple[Buffer, ...]:
        if self.heads is None:
            return _G_W((self.q, self.kv))
        return self._bufs(_G_WRITES)

    def adjoint(self) -> Compute:
        return _TILE_OF[_G_ADJ](self.q, self.kv, self.heads)


@dataclasses.dataclass(frozen=True, slots=True)
class Send(_Op):
    """Send buffer ``buf`` to rank ``peer``."""

    buf: Buffer
    peer: int

    def __post_init__(self) -> None:
        if type(self.buf) is not Buffer:
            object.__setattr__(self, "buf", Buffer(self.buf))

    def reads(self) -> tuple[Buffer, ...]:
        return (self.buf,) if _S_READS else ()

    def writes(self) -> tuple[Buffer, ...]:
        return (self.buf,) if _S_WRITES else ()

    def adjoint(self) -> Recv:
        """The cotangent comes back: ``S kv5→r2`` becomes ``R dkv5←r2`` (accumulating)."""
        return _TRANSFER_OF[_S_ADJ](self.buf.cotangent, self.peer)

    def __str__(self) -> str:
        return f"S {self.buf}→r{self.peer}"

    def ascii(self) -> str:
        return f"S {self.buf}->r{self.peer}"


@dataclasses.dataclass(frozen=True, slots=True)
class Recv(_Op):
    """Receive buffer ``buf`` from rank ``peer`` (gradient buffers accumulate)."""

    buf: Buffer
    peer: int

    def __post_init__(self) -> None:
        if type(self.buf) is not Buffer:
            object.__setattr__(self, "buf", Buffer(self.buf))

    def reads(self) -> tuple[Buffer, ...]:
        return (self.buf,) if _R_READS else ()

    def writes(self) -> tuple[Buffer, ...]:
        return (self.buf,) if _R_WRITES else ()

    def adjoint(self) -> Send:
        """The cotangent goes back: ``R kv5←r0`` becomes ``S dkv5→r0``."""
        return _TRANSFER_OF[_R_ADJ](self.buf.cotangent, self.peer)

    def __str__(self) -> str:
        return f"R {self.buf}←r{self.peer}"

    def ascii(self) -> str:
        return f"R {self.buf}<-r{self.peer}"


#: Collective kinds and their adjoints: all-gather <-> reduce-scatter, all-to-all <-> itself
#: (read from :data:`RULES`).
COLLECTIVE_ADJOINT = {k: RULES[k].adjoint for k in ("AG", "RS", "A2A")}
#: The side of a collective each rule word names (its distinct occupied slots).
_SLOT_SIDE = {"sends": "_sb", "recvs": "_rb"}


class Collective(_Op):
    """A collective over the ranks ``group`` (a fixed subgroup of the mesh), as one rank sees it.

    ``sends[k]`` is the buffer this rank contributes to member ``group[k]`` and ``recvs[k]``
    the buffer it receives from that member; ``None`` is an empty contribution (a
    mask-pruned gather moves only what a rank needs, over the same fixed group). The slot
    of the rank itself holds the same buffer on both sides (it stays in place) or ``None``.
    Every member issues its side of the same collective in the same step, in the same order
    (:func:`fringe.schedules.check`). A received gradient accumulates, in member order, so a
    reduce-scatter is an all-to-all plus a local sum in a fixed order (bit-identical on every
    transport).

    ``kind`` names the pattern: ``AG`` (all-gather: each member sends one buffer to the
    members that want it), ``RS`` (reduce-scatter: its adjoint, gradients summed at the
    owner) and ``A2A`` (all-to-all). The adjoint swaps ``sends`` and ``recvs`` and takes
    cotangents: AG <-> RS, A2A <-> the inverse A2A.

    The slots are stored sparse (the members with a buffer, and their buffers), so an op over
    1024 members that moves a few chunks costs what it moves, not the group's size, in every
    pass (reads, writes, adjoint, checks); ``sends`` and ``recvs`` give the dense tuples.
    :meth:`sparse` builds one from the occupied slots directly.

    Text form: ``AG[0,1,2] kv0,kv0,- > kv0,kv1,-`` (ASCII) or ``AG[0,1,2] kv0,kv0,- ⇄ kv0,kv1,-``.
    """

    __slots__ = ("kind", "group", "_si", "_sb", "_ri", "_rb", "_io")

    def __init__(self, kind: str, group: Sequence[int], sends: Sequence[Buffer | None],
                 recvs: Sequence[Buffer | None]) -> None:
        kind, group = _collective_head(kind, group)
        sends, recvs = _slots(sends), _slots(recvs)
        if len(sends) != len(group) or len(recvs) != len(group):
            raise ValueError(f"{kind}{list(group)}: one send and one receive slot per member "
                             f"({len(group)}), got {len(sends)} and {len(recvs)}")
        self._set(kind, group, *_occupied(sends), *_occupied(recvs))

    @classmethod
    def sparse(cls, kind: str, group: Sequence[int], sends: tuple[Sequence[int], Sequence[Buffer]],
               recvs: tuple[Sequence[int], Sequence[Buffer]]) -> Collective:
        """The collective whose occupied slots are ``sends = (member indices, buffers)`` (and
        likewise ``recvs``); every other slot is empty. Indices increase strictly.

        ``Collective.sparse("AG", (0, 1, 2), ((0,), ("kv0",)), ((1,), ("kv1",)))`` equals
        ``Collective("AG", (0, 1, 2), ("kv0", None, None), (None, "kv1", None))``.
        """
        kind, group = _collective_head(kind, group)
        self = object.__new__(cls)
        parts = []
        for side, (idx, bufs) in (("send", sends), ("receive", recvs)):
            idx, bufs = tuple(map(int, idx)), tuple(bufs)
            if len(idx) != len(bufs) or (idx and (idx[0] < 0 or idx[-1] >= len(group) or any(
                    a >= b for a, b in zip(idx, idx[1:])))):
                raise ValueError(f"{kind}{list(group)}: {side} slots must be strictly increasing "
                                 f"member indices in [0, {len(group)}), one buffer each; got "
                                 f"{list(idx)} for {len(bufs)} buffers")
            if not set(map(type, bufs)) <= {Buffer}:
                bufs = tuple(Buffer(b) for b in bufs)
            parts += [idx, bufs]
        self._set(kind, group, *parts)
        return self

    def _set(self, kind, group, si, sb, ri, rb) -> None:
        for name, value in (("kind", kind), ("group", group), ("_si", si), ("_sb", sb),
                            ("_ri", ri), ("_rb", rb), ("_io", None)):
            object.__setattr__(self, name, value)

    @classmethod
    def _checked(cls, kind: str, group: tuple[int, ...], si, sb, ri, rb) -> Collective:
        """A collective from parts already checked (an op's own group and slots)."""
        self = object.__new__(cls)
        self._set(kind, group, si, sb, ri, rb)
        return self

    @property
    def sends(self) -> tuple[Buffer | None, ...]:
        """What this rank sends to each member (``None``: nothing), one slot per member."""
        return _dense(len(self.group), self._si, self._sb)

    @property
    def recvs(self) -> tuple[Buffer | None, ...]:
        """What this rank receives from each member (``None``: nothing), one slot per member."""
        return _dense(len(self.group), self._ri, self._rb)

    @property
    def sparse_sends(self) -> tuple[tuple[int, ...], tuple[Buffer, ...]]:
        """``(member indices, buffers)`` of the occupied send slots, in member order."""
        return self._si, self._sb

    @property
    def sparse_recvs(self) -> tuple[tuple[int, ...], tuple[Buffer, ...]]:
        """``(member indices, buffers)`` of the occupied receive slots, in member order."""
        return self._ri, self._rb

    def __setattr__(self, name, value) -> None:
        raise dataclasses.FrozenInstanceError(f"cannot assign to field {name!r}")

    def __delattr__(self, name) -> None:
        raise dataclasses.FrozenInstanceError(f"cannot delete field {name!r}")

    def __eq__(self, other) -> bool:
        if type(other) is not Collective:
            return NotImplemented
        return (self.kind == other.kind and self._si == other._si and self._ri == other._ri
                and self._sb == other._sb and self._rb == other._rb
                and (self.group is other.group or self.group == other.group))

    def __hash__(self) -> int:
        return hash((self.kind, self.group, self._si, self._sb, self._ri, self._rb))

    def __repr__(self) -> str:
        return (f"Collective(kind={self.kind!r}, group={self.group!r}, sends={self.sends!r}, "
                f"recvs={self.recvs!r})")

    def __reduce__(self):
        return (_collective, (self.kind, self.group, self._si, self._sb, self._ri, self._rb))

    def _touches(self) -> tuple[tuple[Buffer, ...], tuple[Buffer, ...]]:
        if self._io is None:
            rule = RULES[self.kind]
            object.__setattr__(self, "_io", tuple(
                _distinct(b for w in words for b in getattr(self, _SLOT_SIDE[w]))
                for words in (rule.reads, rule.writes)))
        return self._io

    def reads(self) -> tuple[Buffer, ...]:
        return self._touches()[0]

    def writes(self) -> tuple[Buffer, ...]:
        return self._touches()[1]

    def member_index(self, rank: int) -> int | None:
        """The slot of ``rank`` in the group (None when it is not a member)."""
        return _member_index(self.group).get(rank)

    def _in_place(self, rank: int, idx, bufs) -> Buffer | None:
        """The buffer of ``rank``'s own slot on one side when it stays in place (the rule's
        ``own_slot_in_place``, and no other slot of that side holds it); else None."""
        me = self.member_index(rank)
        if me is None or not RULES[self.kind].own_slot_in_place:
            return None
        at = bisect.bisect_left(idx, me)
        if at < len(idx) and idx[at] == me and bufs.count(bufs[at]) == 1:
            return bufs[at]
        return None

    def received(self, rank: int) -> set[Buffer]:
        """The buffers ``rank`` (a member) receives from the other members."""
        got = set(self.writes())
        got.discard(self._in_place(rank, self._ri, self._rb))
        return got

    def sent(self, rank: int) -> tuple[Buffer, ...]:
        """The buffers ``rank``'s side sends to other members: its reads but an own slot that
        stays in place (the runtime skips it, so a reduce-scatter's own slot need not be
        present)."""
        own = self._in_place(rank, self._si, self._sb)
        return self.reads() if own is None else tuple(b for b in self.reads() if b != own)

    def adjoint(self) -> Collective:
        """``AG`` becomes ``RS`` of the cotangents (and back); ``A2A`` its inverse."""
        cot = _COTANGENTS.__getitem__
        return Collective._checked(COLLECTIVE_ADJOINT[self.kind], self.group, self._ri,
                                   tuple(map(cot, self._rb)), self._si, tuple(map(cot, self._sb)))

    def transposed(self) -> Collective:
        """The same buffers moving the other way (re-sending merged outputs in a backward)."""
        return Collective._checked("A2A" if self.kind == "A2A" else COLLECTIVE_ADJOINT[self.kind],
                                   self.group, self._ri, self._rb, self._si, self._sb)

    def _text(self, arrow: str) -> str:
        fmt = lambda xs: ",".join("-" if x is None else str(x) for x in xs)  # noqa: E731
        return (f"{self.kind}[{','.join(str(r) for r in self.group)}] {fmt(self.sends)} {arrow} "
                f"{fmt(self.recvs)}")

    def __str__(self) -> str:
        return self._text("⇄")

    def ascii(self) -> str:
        return self._text(">")

    def brief(self) -> str:
        """A short display form for grids: ``AG[0-3] kv0 ⇄ kv{1,2}``, ``A2A[0,1] q0h*/2 ⇄ q{0,1}h0/2``.

        Not parsed back (``str`` and ``ascii`` are the round-tripping forms).
        """
        g = self.group
        span = (f"{g[0]}-{g[-1]}" if len(g) > 2 and g == tuple(range(g[0], g[-1] + 1))
                else ",".join(map(str, g)))
        return f"{self.kind}[{span}] {_brief(self._sb)} ⇄ {_brief(self._rb)}"


_TILE_OF = {"C": Compute, "G": GradCompute}
_TRANSFER_OF = {"S": Send, "R": Recv}
_C_ADJ, _G_ADJ, _S_ADJ, _R_ADJ = (RULES[k].adjoint for k in "CGSR")
_S_READS, _S_WRITES = "buf" in RULES["S"].reads, "buf" in RULES["S"].writes
_R_READS, _R_WRITES = "buf" in RULES["R"].reads, "buf" in RULES["R"].writes


def _collective(kind, group, si, sb, ri, rb) -> Collective:
    """Unpickle a :class:`Collective` (its sparse parts)."""
    return Collective.sparse(kind, group, (si, sb), (ri, rb))


def _collective_head(kind, group) -> tuple[str, tuple[int, ...]]:
    """The checked kind and the interned group of a collective."""
    if kind not in COLLECTIVE_ADJOINT:
        raise ValueError(f"collective kind must be one of {sorted(COLLECTIVE_ADJOINT)}, got "
                         f"{kind!r}")
    hit = _GROUPS.get(group) if type(group) is tuple else None
    if hit is None:                     # a group not seen before: check it once
        hit = tuple(map(int, group))
        if len(set(hit)) != len(hit) or not hit or min(hit) < 0:
            raise ValueError(f"collective group must be distinct ranks >= 0, got {group!r}")
        if len(_GROUPS) < _GROUPS_KEPT:
            hit = _GROUPS.setdefault(hit, hit)
    return kind, hit


_SLOT_TYPES = frozenset({Buffer, type(None)})
#: Collective groups already checked (one tuple shared by every op over the same group).
_GROUPS: dict[tuple, tuple[int, ...]] = {}
_GROUPS_KEPT = 4096
#: id(group) -> (group, {rank: member index}) for the interned groups.
_MEMBER_INDEX: dict[int, tuple[tuple[int, ...], dict[int, int]]] = {}


def _member_index(group: tuple[int, ...]) -> dict[int, int]:
    hit = _MEMBER_INDEX.get(id(group))
    if hit is None or hit[0] is not group:
        index = {m: i for i, m in enumerate(group)}
        if _GROUPS.get(group) is group:        # interned: lives as long as the module
            _MEMBER_INDEX[id(group)] = (group, index)
        return index
    return hit[1]


def _slots(xs) -> tuple[Buffer | None, ...]:
    """A collective's slots as a tuple of interned buffers and None (no per-slot work in
    Python when they are already)."""
    xs = tuple(xs)
    if set(map(type, xs)) <= _SLOT_TYPES:
        return xs
    return tuple(None if x is None else Buffer(x) for x in xs)


def _occupied(xs: tuple) -> tuple[tuple[int, ...], tuple[Buffer, ...]]:
    """``(indices, buffers)`` of the non-empty slots of a dense slot tuple."""
    idx = tuple(itertools.compress(range(len(xs)), map(_NOT_NONE, xs)))
    return idx, tuple(map(xs.__getitem__, idx))


def _NOT_NONE(x) -> bool:
    return x is not None


def _dense(n: int, idx: tuple[int, ...], bufs: tuple[Buffer, ...]) -> tuple[Buffer | None, ...]:
    out: list = [None] * n
    for i, b in zip(idx, bufs):
        out[i] = b
    return tuple(out)


def _distinct(xs) -> tuple[Buffer, ...]:
    d = dict.fromkeys(xs)
    d.pop(None, None)
    return tuple(d)


class _Cotangents(dict):
    """``buffer -> buffer.cotangent`` (None -> None), filled on first use."""

    def __missing__(self, b: Buffer) -> Buffer:
        c = self[b] = b.cotangent
        return c


_COTANGENTS = _Cotangents({None: None})


def _brief(slots) -> str:
    bs = list(dict.fromkeys(b for b in slots if b is not None))
    if not bs:
        return "-"
    if len(bs) == 1:
        return str(bs[0])
    fams = {b.family for b in bs}
    chunks = sorted({b.chunk for b in bs})
    heads = {b.heads for b in bs}
    if len(fams) == 1 and len(heads) == 1:
        h = next(iter(heads))
        return (f"{bs[0].family.value}{{{','.join(map(str, chunks))}}}"
                f"{'' if h is None else f'h{h[0]}/{h[1]}'}")
    if len(fams) == 1 and len(chunks) == 1 and None not in heads and len({h[1] for h in heads}) == 1:
        return f"{bs[0].family.value}{chunks[0]}h*/{bs[0].heads[1]}"
    return ",".join(map(str, bs))


Op = Union[Compute, GradCompute, Send, Recv, Collective]
Comm = Union[Send, Recv]

_OP = re.compile(r"^\s*(?:([CG])\s+q(\d+)\s*(?:·|\.)\s*kv(\d+)(?:\s+h(\d+)/(\d+))?"
                 r"|([SR])\s+(\S+)\s*(→|->|←|<-)\s*r(\d+))\s*$")
_COLL = re.compile(r"^\s*(AG|RS|A2A)\[([\d,\s]+)\]\s+(\S+)\s*(?:>|⇄)\s*(\S+)\s*$")
_ARROW = {"→": "S", "->": "S", "←": "R", "<-": "R"}


def parse_op(text: str) -> Op:
    """Parse the pretty or ASCII form of one op: ``parse_op("S kv5->r2") == Send("kv5", 2)``."""
    c = _COLL.match(text)
    if c:
        group = tuple(int(x) for x in c.group(2).split(",") if x.strip())
        slots = lambda xs: tuple(None if x == "-" else Buffer(x) for x in xs.split(","))  # noqa: E731
        return Collective(c.group(1), group, slots(c.group(3)), slots(c.group(4)))
    m = _OP.match(text)
    if not m:
        raise ValueError(f"cannot parse op {text!r}; expected e.g. 'C q3.kv5', 'C q3.kv5 h1/4', "
                         f"'G q3.kv5', 'S kv5->r2', 'R kv5<-r0', 'AG[0,1] kv0,- > -,kv1' (or the "
                         f"pretty forms with ·, →, ←, ⇄)")
    if m.group(1):
        cls = Compute if m.group(1) == "C" else GradCompute
        heads = None if m.group(4) is None else (int(m.group(4)), int(m.group(5)))
        return cls(int(m.group(2)), int(m.group(3)), heads)
    kind, buf, arrow, peer = m.group(6), m.group(7), m.group(8), int(m.group(9))
    if _ARROW[arrow] != kind:
        raise ValueError(f"op {text!r}: a send uses '->' (or '→'), a receive '<-' (or '←')")
    return (Send if kind == "S" else Recv)(buf, peer)


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
    def _from_table(cls, table: ProgramTable, rank: int) -> Program:
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
    def table(self) -> ProgramTable | None:
        """The columnar table this program was cut from, if any (the passes' fast path)."""
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


_KINDS = (Compute, GradCompute, Send, Recv)
_FAMILIES = tuple(Family)
_FAMILY_CODE = {f: n for n, f in enumerate(_FAMILIES)}
C_, G_, S_, R_ = 0, 1, 2, 3          # op kind codes of a ProgramTable
#: ``(family code, side, written)`` touches of each tile kind (:data:`RULES`) by its table
#: kind code: what the column passes index instead of restating the rule.
TILE_TOUCH_CODES = {C_: RULES["C"].touch_codes(), G_: RULES["G"].touch_codes()}
#: The same with :class:`Family` values (for passes with their own family codes).
TILE_TOUCHES = {C_: RULES["C"].touches(), G_: RULES["G"].touches()}
#: The adjoint's table kind code of each table kind code (``C_ -> G_``, ``S_ -> R_``, ...).
_KIND_CODE = {"C": C_, "G": G_, "S": S_, "R": R_}
ADJOINT_CODE = tuple(_KIND_CODE[RULES[k].adjoint] for k in sorted(_KIND_CODE, key=_KIND_CODE.get))


class ScheduleError(ValueError):
    """A program violates the IR's rules; the message names the rank and step."""


class ProgramTable:
    """Every rank's program as typed, read-only integer columns: *the* IR.

    One form, built by every schedule (the ring family's lowering, the collectives,
    ``compose``, :class:`~fringe.schedules.columns.ProgramBuilder`) and by :meth:`of` from
    op objects (hand-written, ``programs_fn=``, ``build=``, parsed text). Three parts
    (:meth:`_of_parts`), each a dict of equal-length int columns:

    * ``comp``: one row per compute: ``rank, step, kind`` (0 ``C``, 1 ``G``), ``q, kv``,
      ``hi, hn`` (head slice ``hi`` of ``hn``; ``hn == 0``: all heads) and ``order``;
    * ``xfer``: one row per point-to-point transfer, its send and its receive together:
      ``step, src, dst, fam, chunk, hi, hn`` (family codes index ``tuple(Family)``),
      ``order`` (the send's place on ``src``) and ``rorder`` (the receive's on ``dst``);
    * ``coll``: one row per member side of a collective (``rank, step, order, kind, group``:
      kind a code of :data:`COLL_KINDS`, group an index into ``coll["groups"]``, a tuple of
      rank tuples) and one row per occupied slot (``slot_side``: its side's row,
      ``slot_dir``: 0 send, 1 receive, ``slot_idx``: the member index, ``slot_fam,
      slot_chunk, slot_hi, slot_hn``: the buffer), slots sorted by (side, dir, idx).

    Within a rank's step ops go by ``order`` (computes first on ties, then sends, then
    receives, then collectives). The arrays are the table's own read-only memory, so a check
    that passed on a table stays true. :class:`Program` values cut from it (:meth:`programs`)
    are *views*: they build their op objects only when looked at. Rows (one per op: ``rank,
    step, kind, a, b, c``) are a view too, for tables of whole-heads computes and transfers
    (:attr:`chain`); ``ProgramTable(P, rank, step, kind, a, b, c)`` builds the table of such
    rows.

    Room for what comes next: a transfer row may grow a block-range reference (a ragged
    range table beside ``xfer``: only the blocks the receiver's tiles read) and a route row
    (one buffer forwarded along consecutive hops from step a to step b) without a new form:
    each is another column of ``xfer`` that the passes read where they read ``xfer``.
    """

    def __init__(self, world_size: int, rank, step, kind, a, b, c) -> None:
        import numpy as np
        cols = [np.array(x, dtype=np.int64, order="C", copy=True).reshape(-1)
                for x in (rank, step, kind, a, b, c)]
        if len({len(x) for x in cols}) != 1:
            raise ValueError(f"ProgramTable columns must have one length, got {[len(x) for x in cols]}")
        rank, step, kind, a, b, c = cols
        dr, ds = np.diff(rank), np.diff(step)
        if len(rank) and (rank.min() < 0 or rank.max() >= world_size
                          or (dr < 0).any() or ((dr == 0) & (ds < 0)).any()):
            raise ValueError(f"ProgramTable rows must be sorted by rank (each in [0, {world_size})), "
                             f"then by step")
        if len(kind) and (kind.min() < C_ or kind.max() > R_):
            raise ValueError(f"ProgramTable rows hold kinds 0-3 (C, G, S, R), got kind "
                             f"{int(kind[(kind < C_) | (kind > R_)][0])}")
        order = np.arange(len(rank))
        comp = kind <= G_
        is_s, is_r = kind == S_, kind == R_
        # a send is (step, src, dst, fam, chunk) on src; its receive the same on dst
        skey = np.stack([step[is_s], rank[is_s], c[is_s], a[is_s], b[is_s]])
        rkey = np.stack([step[is_r], c[is_r], rank[is_r], a[is_r], b[is_r]])
        so, ro = np.lexsort(skey[::-1]), np.lexsort(rkey[::-1])
        if skey.shape != rkey.shape or not np.array_equal(skey[:, so], rkey[:, ro]):
            raise ValueError("ProgramTable rows: a send without its receive in the same step "
                             "(or a receive without its send); ProgramTable.of(programs) names it")
        xs = np.flatnonzero(is_s)[so]
        xr = np.flatnonzero(is_r)[ro]
        P = world_size
        t = ProgramTable._of_parts(
            P, dict(rank=rank[comp], step=step[comp], kind=kind[comp], q=a[comp], kv=b[comp],
                    order=order[comp]),
            dict(step=step[xs], src=rank[xs], dst=c[xs], fam=a[xs], chunk=b[xs], order=xs,
                 rorder=xr))
        self.__dict__.update(t.__dict__)
        self._programs = tuple(Program._from_table(self, r) for r in range(P))

    def _init(self, world_size: int, parts) -> None:
        import numpy as np
        self.world_size = world_size
        self._parts = parts
        self._cols = None                # the row view, derived on first use (chain tables)
        self._gindex = None              # each rank's rows and sides' slots
        self._passed: set = set()        # check() flags whose structural checks passed
        comp, xfer, coll = parts
        #: Whether the table holds whole-heads computes and transfers only (no head slice, no
        #: collective): what the row view and the ring chain's shortcuts of the passes take.
        self.chain = bool(not len(coll["rank"]) and not comp["hn"].any() and not xfer["hn"].any())
        self._programs = tuple(Program._from_table(self, r) for r in range(world_size))

    @classmethod
    def _of_parts(cls, world_size: int, comp: dict, xfer: dict,
                  coll: dict | None = None) -> ProgramTable:
        """The table of parts ``comp``, ``xfer`` and ``coll`` (the class docstring's
        columns). ``hi, hn`` may be left out (all heads), ``rorder`` too (the send's order),
        and ``coll`` (no collectives)."""
        import numpy as np

        def small(x):                    # int32 where it fits: half the memory at P=1024
            x = np.asarray(x)
            fits = not len(x) or (int(x.min()) >= -2 ** 31 and int(x.max()) < 2 ** 31)
            x = np.array(x, dtype=np.int32 if fits else np.int64, order="C", copy=True)
            x.setflags(write=False)      # its own read-only memory: nothing can refill it, so
            return x                     # a check that passed on the table stays true
        self = object.__new__(cls)
        comp = {k: small(v) for k, v in comp.items()}
        same = "rorder" not in xfer or xfer["rorder"] is xfer["order"]
        xfer = {k: small(v) for k, v in xfer.items() if k != "rorder" or not same}
        for d in (comp, xfer):
            n = len(d["order"])
            for k in ("hi", "hn"):
                if k not in d:               # all heads: zeros, already small and read-only
                    d[k] = np.zeros(n, np.int32)
                    d[k].setflags(write=False)
        if "rorder" not in xfer:
            xfer["rorder"] = xfer["order"]
        coll = _no_coll() if coll is None else dict(coll)
        groups = tuple(tuple(int(m) for m in g) for g in coll.pop("groups"))
        coll = {k: small(v) for k, v in coll.items()}
        coll["groups"] = groups
        self._init(world_size, (comp, xfer, coll))
        return self

    # ---- the row view (chain tables) -----------------------------------------------------
    def _rows(self):
        if self._cols is None:
            if not self.chain:
                raise TypeError("rows (rank, step, kind, a, b, c) are a view of tables of "
                                "whole-heads computes and transfers; this one holds head "
                                "slices or collectives: read its parts or its programs")
            import numpy as np
            comp, xfer, _ = self._parts
            rank, step, kind, a, b, c, order = self._part_rows(comp, xfer)
            o = _lex_order([rank, step, order])
            self._cols = [np.ascontiguousarray(x[o], dtype=np.int64)
                          for x in (rank, step, kind, a, b, c)]
            for x in self._cols:
                x.setflags(write=False)
        return self._cols

    @staticmethod
    def _part_rows(comp, xfer):
        """Rows (rank, step, kind, a, b, c, order) of a chain table's computes, sends and
        receives."""
        import numpy as np
        cat = np.concatenate
        n_c, n_x = len(comp["rank"]), len(xfer["src"])
        return (cat([comp["rank"], xfer["src"], xfer["dst"]]),
                cat([comp["step"], xfer["step"], xfer["step"]]),
                cat([comp["kind"], np.full(n_x, S_), np.full(n_x, R_)]),
                cat([comp["q"], xfer["fam"], xfer["fam"]]),
                cat([comp["kv"], xfer["chunk"], xfer["chunk"]]),
                cat([np.full(n_c, -1), xfer["dst"], xfer["src"]]),
                cat([comp["order"], xfer["order"], xfer["rorder"]]))

    rank = property(lambda self: self._rows()[0])
    step = property(lambda self: self._rows()[1])
    kind = property(lambda self: self._rows()[2])
    a = property(lambda self: self._rows()[3])
    b = property(lambda self: self._rows()[4])
    c = property(lambda self: self._rows()[5])

    def __len__(self) -> int:
        comp, xfer, coll = self._parts
        return len(comp["rank"]) + 2 * len(xfer["src"]) + len(coll["rank"])

    def head_splits(self) -> set[int]:
        """The ways the table's buffers split heads (``n`` of every ``h<i>/<n>``)."""
        import numpy as np
        comp, xfer, coll = self._parts
        found = set()
        for x in (comp["hn"], xfer["hn"], coll["slot_hn"]):
            if len(x) and x.any():
                found.update(int(n) for n in np.unique(x) if n)
        return found

    def programs(self) -> tuple[Program, ...]:
        """One (lazily built) program per rank."""
        return self._programs

    def digest(self) -> str:
        """A hash of the programs: equal for equal programs however they were built (any
        builder's order keys, op objects turned into a table, pickled), without building
        any op.

        It hashes canonical columns: one row per op in program order (``rank, step, kind,
        a, b, c`` as the row view; a collective side is kind ``4 + its code`` with ``a`` its
        group's index in order of first use and ``b, c`` its send and receive slot counts),
        then head slices and collective slots only when there are any.
        ``ProgramTable.of(plan.forward).digest()`` is what a plan fingerprint hashes at
        P=1024 instead of the programs' text (millions of ops).
        """
        import hashlib
        import numpy as np
        h = hashlib.sha1(f"programs/{self.world_size}/".encode())
        comp, xfer, coll = self._parts
        i64 = lambda x: np.asarray(x, dtype=np.int64)     # noqa: E731
        nc, nx, nk = len(comp["rank"]), len(xfer["src"]), len(coll["rank"])
        cat = np.concatenate
        slot_side = i64(coll["slot_side"])
        n_send = np.bincount(slot_side[i64(coll["slot_dir"]) == 0], minlength=nk)[:nk]
        n_recv = np.bincount(slot_side[i64(coll["slot_dir"]) == 1], minlength=nk)[:nk]
        rank = cat([comp["rank"], xfer["src"], xfer["dst"], coll["rank"]])
        step = cat([comp["step"], xfer["step"], xfer["step"], coll["step"]])
        order = cat([comp["order"], xfer["order"], xfer["rorder"], coll["order"]])
        tie = np.repeat(np.arange(4, dtype=np.int8), [nc, nx, nx, nk])
        o = _lex_order([rank, step, order, tie])        # stable: the programs' op order
        kind = cat([i64(comp["kind"]), np.full(nx, S_), np.full(nx, R_), 4 + i64(coll["kind"])])
        a = cat([i64(comp["q"]), i64(xfer["fam"]), i64(xfer["fam"]), i64(coll["group"])])
        b = cat([i64(comp["kv"]), i64(xfer["chunk"]), i64(xfer["chunk"]), n_send])
        c = cat([np.full(nc, -1), i64(xfer["dst"]), i64(xfer["src"]), n_recv])
        if nk:                                           # groups by first use, not by index
            sides = o[o >= 2 * nx + nc] - (2 * nx + nc)  # collective sides in program order
            g = a[2 * nx + nc:]
            first = {}
            for x in g[sides].tolist():
                first.setdefault(x, len(first))
            a[2 * nx + nc:] = [first[x] for x in g.tolist()]
        for col in (rank, step, kind, a, b, c):
            h.update(np.ascontiguousarray(i64(col)[o]).tobytes())
        if comp["hn"].any() or xfer["hn"].any():
            hi = cat([i64(comp["hi"]), i64(xfer["hi"]), i64(xfer["hi"]), np.zeros(nk, np.int64)])
            hn = cat([i64(comp["hn"]), i64(xfer["hn"]), i64(xfer["hn"]), np.zeros(nk, np.int64)])
            h.update(b"heads")
            h.update(np.ascontiguousarray(hi[o]).tobytes())
            h.update(np.ascontiguousarray(hn[o]).tobytes())
        if nk:
            groups = coll["groups"]
            h.update(b"collectives")
            h.update(repr([groups[x] for x in sorted(first, key=first.get)]).encode())
            so = np.lexsort((i64(coll["slot_idx"]), i64(coll["slot_dir"]),
                             np.argsort(sides)[slot_side]))   # slots by side's program position
            for k in ("slot_dir", "slot_idx", "slot_fam", "slot_chunk", "slot_hi", "slot_hn"):
                h.update(np.ascontiguousarray(i64(coll[k])[so]).tobytes())
        return h.hexdigest()

    def _general_index(self):
        """Per part, the rows of each rank: (order, bounds) for computes, sends, receives,
        collective sides; and each side's slot bounds."""
        import numpy as np
        if self._gindex is None:
            comp, xfer, coll = self._parts
            ix = []
            for col in (comp["rank"], xfer["src"], xfer["dst"], coll["rank"]):
                o = np.argsort(col, kind="stable")
                ix.append((o, np.searchsorted(col[o], np.arange(self.world_size + 1))))
            sb = np.searchsorted(coll["slot_side"], np.arange(len(coll["rank"]) + 1))
            self._gindex = (ix, sb)
        return self._gindex

    def _steps_of(self, rank: int) -> tuple[Step, ...]:
        """Rank ``rank``'s steps as op objects (the view)."""
        import numpy as np
        comp, xfer, coll = self._parts
        ix, sb = self._general_index()
        ci, si, ri, ki = (o[b[rank]:b[rank + 1]] for o, b in ix)
        rows = []        # (step, order, tie, op)
        for t, o, k, q, kv, hi, hn in zip(*(comp[c][ci].tolist() for c in
                                            ("step", "order", "kind", "q", "kv", "hi", "hn"))):
            rows.append((t, o, 0, _KINDS[k](q, kv, (hi, hn) if hn else None)))
        for tie, sel, cls, peer, oc in ((1, si, Send, "dst", "order"), (2, ri, Recv, "src", "rorder")):
            for t, o, f, ch, hi, hn, p in zip(*(xfer[c][sel].tolist() for c in
                                                ("step", oc, "fam", "chunk", "hi", "hn", peer))):
                rows.append((t, o, tie, cls(buffer_of(f, ch, hi, hn), p)))
        groups = coll["groups"]
        sd, sx, sf, sc, sh, sn = (coll[c] for c in ("slot_dir", "slot_idx", "slot_fam",
                                                    "slot_chunk", "slot_hi", "slot_hn"))
        for side in ki.tolist():
            lo, hi_ = int(sb[side]), int(sb[side + 1])
            d = sd[lo:hi_].tolist()
            split = d.count(0)
            idx = sx[lo:hi_].tolist()
            bufs = [buffer_of(*x) for x in zip(sf[lo:hi_].tolist(), sc[lo:hi_].tolist(),
                                               sh[lo:hi_].tolist(), sn[lo:hi_].tolist())]
            op = Collective.sparse(COLL_KINDS[int(coll["kind"][side])],
                                   groups[int(coll["group"][side])],
                                   (idx[:split], bufs[:split]), (idx[split:], bufs[split:]))
            rows.append((int(coll["step"][side]), int(coll["order"][side]), 3, op))
        rows.sort(key=lambda x: x[:3])
        steps, i, n = [], 0, len(rows)
        while i < n:
            t = rows[i][0]
            j = i
            while j < n and rows[j][0] == t:
                j += 1
            steps.append(Step(t, tuple(x[3] for x in rows[i:j])))
            i = j
        return tuple(steps)

    @classmethod
    def of(cls, programs: Sequence[Program]) -> ProgramTable:
        """The table of any programs, one per rank in rank order (the table itself when they
        were cut from one): its :meth:`programs` equal them op for op.

        Raises :class:`ScheduleError` naming the rank and step (``<-- ERROR HERE``) when a
        transfer names an invalid peer, or a send and its receive are not in the same step.
        """
        import numpy as np
        src = programs[0].table if len(programs) else None
        if src is not None and src.world_size == len(programs) and all(
                p.table is src and p.rank == r for r, p in enumerate(programs)):
            return src
        P = len(programs)
        comp: list = []
        sends: dict = {}
        recvs: dict = {}
        sides: list = []
        slots: list = []
        groups: dict = {}
        for prog in programs:
            r = prog.rank
            for step in prog.steps:
                t = step.index
                for o, op in enumerate(step.ops):
                    tp = type(op)
                    if tp is Compute or tp is GradCompute:
                        hi, hn = op.heads or (0, 0)
                        comp.append((r, t, C_ if tp is Compute else G_, op.q, op.kv, o, hi, hn))
                    elif tp is Send or tp is Recv:
                        if not 0 <= op.peer < P or op.peer == r:
                            raise ScheduleError(f"rank {r}, step {t}: {op} names an invalid peer "
                                                f"(world size {P})\n{marked(prog, t)}")
                        src_, dst = (r, op.peer) if tp is Send else (op.peer, r)
                        key = (t, src_, dst, op.buf)
                        (sends if tp is Send else recvs).setdefault(key, []).append(o)
                    elif tp is Collective:
                        g = groups.setdefault(op.group, len(groups))
                        side = len(sides)
                        sides.append((r, t, o, COLL_KINDS.index(op.kind), g))
                        for d, (idx, bufs) in enumerate((op.sparse_sends, op.sparse_recvs)):
                            for i, b in zip(idx, bufs):
                                fam, ch, h = _FIELDS[b]
                                slots.append((side, d, i, _FAMILY_CODE[fam], ch, *(h or (0, 0))))
                    else:
                        raise TypeError(f"rank {r}, step {t}: {op!r} is not an op of the IR")
        if len(sends) != len(recvs) or any(len(v) != len(recvs.get(k, ())) for k, v in sends.items()):
            _unmatched(programs, sends, recvs)
        xfer = []
        for key, os_ in sends.items():
            fam, ch, h = _FIELDS[key[3]]
            for a, b in zip(os_, recvs[key]):
                xfer.append((key[0], key[1], key[2], _FAMILY_CODE[fam], ch, a, *(h or (0, 0)), b))

        def cols(rows, names):
            arr = np.array(rows, dtype=np.int64).reshape(-1, len(names))
            return {n: arr[:, i] for i, n in enumerate(names)}
        c = cols(comp, ("rank", "step", "kind", "q", "kv", "order", "hi", "hn"))
        x = cols(xfer, ("step", "src", "dst", "fam", "chunk", "order", "hi", "hn", "rorder"))
        k = cols(sides, ("rank", "step", "order", "kind", "group"))
        k.update(cols(slots, ("slot_side", "slot_dir", "slot_idx", "slot_fam", "slot_chunk",
                              "slot_hi", "slot_hn")))
        k["groups"] = tuple(groups)
        return cls._of_parts(P, c, x, k)


def _unmatched(programs, sends: dict, recvs: dict):
    """Raise the :class:`ScheduleError` of the first transfer (in program order) whose
    sends and receives differ in number."""
    for prog in programs:
        r = prog.rank
        for step in prog.steps:
            t = step.index
            for op in step.ops:
                if type(op) is Send:
                    key, mine, other, peer, missing = ((t, r, op.peer, op.buf), sends, recvs,
                                                       op.peer, "receive")
                elif type(op) is Recv:
                    key, mine, other, peer, missing = ((t, op.peer, r, op.buf), recvs, sends,
                                                       op.peer, "send")
                else:
                    continue
                if len(other.get(key, ())) != len(mine[key]):
                    raise ScheduleError(f"rank {r}, step {t}: '{op}' has no matching {missing} "
                                        f"on rank {peer} in the same step\n{marked(prog, t)}")
    raise AssertionError("unreachable: sends and receives differ but no op says so")


#: Collective kinds by their code in a general :class:`ProgramTable`.
COLL_KINDS = ("AG", "RS", "A2A")
#: Whether a collective's own slot stays in place (:data:`RULES`), by its kind code.
OWN_SLOT_IN_PLACE = tuple(RULES[k].own_slot_in_place for k in COLL_KINDS)


def _no_coll() -> dict:
    import numpy as np
    z = np.zeros(0, np.int64)
    return dict(rank=z, step=z, order=z, kind=z, group=z, slot_side=z, slot_dir=z, slot_idx=z,
                slot_fam=z, slot_chunk=z, slot_hi=z, slot_hn=z, groups=())


_BUFFER_OF: dict = {}


def buffer_of(fam: int, chunk: int, hi: int, hn: int) -> Buffer:
    """The interned buffer of a table's columns (family code, chunk, head slice hi of hn;
    ``hn == 0``: all heads)."""
    if not hn:
        return _buf(_FAMILIES[fam], chunk)
    key = (fam, chunk, hi, hn)
    b = _BUFFER_OF.get(key)
    if b is None:
        b = _BUFFER_OF[key] = Buffer.of(_FAMILIES[fam], chunk, (hi, hn))
    return b


def _lex_order(cols):
    """A stable sort of rows by the columns ``cols`` (most significant first): one argsort of
    a combined key where it fits in int64, else a lexsort."""
    import numpy as np
    n = len(cols[0])
    if not n:
        return np.zeros(0, np.int64)
    lo = [int(x.min()) for x in cols]
    span = [int(x.max()) - m + 1 for x, m in zip(cols, lo)]
    if np.prod([float(w) for w in span]) >= 2.0 ** 62:
        return np.lexsort([np.asarray(x) for x in cols[::-1]])
    key = np.asarray(cols[0], dtype=np.int64) - lo[0]
    for x, m, w in zip(cols[1:], lo[1:], span[1:]):
        key = key * w + (np.asarray(x, dtype=np.int64) - m)
    return np.argsort(key, kind="stable")


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
