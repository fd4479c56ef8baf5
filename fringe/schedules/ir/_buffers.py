"""Buffers: their families, typed interned ids, names, and the family codes of a table."""
from __future__ import annotations

import enum
import re


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
#: Family codes: a table's family columns index ``_FAMILIES``.
_FAMILIES = tuple(Family)
_FAMILY_CODE = {f: n for n, f in enumerate(_FAMILIES)}


def buffer_name(kind: str, chunk: int) -> Buffer:
    """``buffer_name("kv", 5) == "kv5"`` (a :class:`Buffer`, which is a ``str``)."""
    return Buffer.of(kind, chunk)


def split_name(name: str) -> tuple[str, int]:
    """``split_name("dkv5") == ("dkv", 5)``; raises on names outside the IR (head slices drop)."""
    b = Buffer(name)
    return b.family.value, b.chunk
