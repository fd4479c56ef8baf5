"""The op objects (tiles, transfers, collectives), their text forms and :func:`parse_op`."""
from __future__ import annotations

import bisect
import dataclasses
import itertools
import operator
import re
from typing import Sequence, Union

from ._buffers import Buffer, _buf
from ._rules import COLLECTIVE_ADJOINT, RULES


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
            try:                        # (0.5, 2) is refused, not truncated to h0/2
                heads = (operator.index(self.heads[0]), operator.index(self.heads[1]))
            except TypeError:
                raise ValueError(f"{type(self).__name__}: heads (i, n) must be integers, got "
                                 f"{self.heads!r}") from None
            object.__setattr__(self, "heads", heads)

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


def _check_blocks(op, blocks):
    """``blocks`` as the canonical tuple of half-open block ranges: sorted, disjoint,
    adjacent ones merged (None: the whole chunk)."""
    if blocks is None:
        return None
    try:                                # operator.index: 1.5 or "1" is refused, not truncated
        pairs = sorted((operator.index(lo), operator.index(hi)) for lo, hi in blocks)
    except (TypeError, ValueError):
        raise ValueError(f"{type(op).__name__}: blocks must be None (the whole chunk) or "
                         f"(lo, hi) block ranges of integers, got {blocks!r}") from None
    out: list = []
    for lo, hi in pairs:
        if not 0 <= lo < hi:
            raise ValueError(f"{type(op).__name__}: a block range (lo, hi) needs 0 <= lo < hi, "
                             f"got {(lo, hi)} in {blocks!r}")
        if out and lo <= out[-1][1]:
            if lo < out[-1][1]:
                raise ValueError(f"{type(op).__name__}: block ranges {blocks!r} overlap; "
                                 f"give each block once")
            out[-1] = (out[-1][0], hi)
        else:
            out.append((lo, hi))
    if not out:
        raise ValueError(f"{type(op).__name__}: a transfer of no block moves nothing; drop "
                         f"the transfer instead of giving blocks=()")
    return tuple(out)


def blocks_text(blocks) -> str:
    """``[0:5]``, ``[0:2,4:6]``: the text of a transfer's block ranges ('' for the whole
    chunk)."""
    return "" if blocks is None else "[" + ",".join(f"{lo}:{hi}" for lo, hi in blocks) + "]"


def _parse_blocks(text: str):
    """``"kv3[0:2,4:6]" -> ("kv3", ((0, 2), (4, 6)))``; no brackets: the whole chunk."""
    name, sep, rest = text.partition("[")
    if not sep:
        return text, None
    if not rest.endswith("]"):
        raise ValueError(f"cannot parse buffer {text!r}; block ranges are written "
                         f"'kv3[0:5]' or 'kv3[0:2,4:6]'")
    try:
        pairs = [tuple(int(x) for x in part.split(":")) for part in rest[:-1].split(",")]
    except ValueError:
        pairs = [()]
    if any(len(p) != 2 for p in pairs):
        raise ValueError(f"cannot parse buffer {text!r}; block ranges are written "
                         f"'kv3[0:5]' or 'kv3[0:2,4:6]' (lo:hi, half-open, in blocks)")
    return name, pairs


class _Transfer(_Op):
    """What ``Send`` and ``Recv`` share: the buffer, the peer and the optional block ranges.

    ``blocks``: None moves the whole chunk; else a tuple of half-open ``(lo, hi)`` ranges of
    the chunk's blocks (``plan.block_size`` tokens each, local to the chunk), the only part
    that moves: the receiver holds the rest as zeros, which no tile it computes reads (the
    narrowing pass gives a transfer the blocks its receiver, and every rank it forwards the
    buffer to, attend). The adjoint carries the same ranges (the gradient of those blocks).
    """

    __slots__ = ()

    def __post_init__(self) -> None:
        if type(self.buf) is not Buffer:
            object.__setattr__(self, "buf", Buffer(self.buf))
        if self.blocks is not None:
            object.__setattr__(self, "blocks", _check_blocks(self, self.blocks))

    def _adjoint(self, letter: str):
        return _TRANSFER_OF[letter](self.buf.cotangent, self.peer, self.blocks)


@dataclasses.dataclass(frozen=True, slots=True)
class Send(_Transfer):
    """Send buffer ``buf`` to rank ``peer`` (only its block ranges ``blocks``, if given)."""

    buf: Buffer
    peer: int
    blocks: tuple[tuple[int, int], ...] | None = None

    def reads(self) -> tuple[Buffer, ...]:
        return (self.buf,) if _S_READS else ()

    def writes(self) -> tuple[Buffer, ...]:
        return (self.buf,) if _S_WRITES else ()

    def adjoint(self) -> Recv:
        """The cotangent comes back: ``S kv5→r2`` becomes ``R dkv5←r2`` (accumulating)."""
        return self._adjoint(_S_ADJ)

    def __str__(self) -> str:
        return f"S {self.buf}{blocks_text(self.blocks)}→r{self.peer}"

    def ascii(self) -> str:
        return f"S {self.buf}{blocks_text(self.blocks)}->r{self.peer}"


@dataclasses.dataclass(frozen=True, slots=True)
class Recv(_Transfer):
    """Receive buffer ``buf`` from rank ``peer`` (gradient buffers accumulate); only its
    block ranges ``blocks``, if given."""

    buf: Buffer
    peer: int
    blocks: tuple[tuple[int, int], ...] | None = None

    def reads(self) -> tuple[Buffer, ...]:
        return (self.buf,) if _R_READS else ()

    def writes(self) -> tuple[Buffer, ...]:
        return (self.buf,) if _R_WRITES else ()

    def adjoint(self) -> Send:
        """The cotangent goes back: ``R kv5←r0`` becomes ``S dkv5→r0``."""
        return self._adjoint(_R_ADJ)

    def __str__(self) -> str:
        return f"R {self.buf}{blocks_text(self.blocks)}←r{self.peer}"

    def ascii(self) -> str:
        return f"R {self.buf}{blocks_text(self.blocks)}<-r{self.peer}"


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

    A slot may move block ranges of its buffer (as :class:`Send` ``blocks``): ``send_blocks``
    / ``recv_blocks`` give each occupied slot's ranges (None: the whole chunk), in the order
    of ``sparse_sends`` / ``sparse_recvs``; the adjoint swaps them with the slots.

    Text form: ``AG[0,1,2] kv0,kv0,- > kv0,kv1,-`` (ASCII) or ``AG[0,1,2] kv0,kv0,- ⇄ kv0,kv1,-``;
    a ranged slot is written ``kv0[0:3]``.
    """

    __slots__ = ("kind", "group", "_si", "_sb", "_ri", "_rb", "_io", "_sk", "_rk")

    def __init__(self, kind: str, group: Sequence[int], sends: Sequence[Buffer | None],
                 recvs: Sequence[Buffer | None], send_blocks: Sequence | None = None,
                 recv_blocks: Sequence | None = None) -> None:
        kind, group = _collective_head(kind, group)
        sends, recvs = _slots(sends), _slots(recvs)
        if len(sends) != len(group) or len(recvs) != len(group):
            raise ValueError(f"{kind}{list(group)}: one send and one receive slot per member "
                             f"({len(group)}), got {len(sends)} and {len(recvs)}")
        si, sb = _occupied(sends)
        ri, rb = _occupied(recvs)
        blocks = []
        for dense, idx, side in ((send_blocks, si, "send"), (recv_blocks, ri, "receive")):
            if dense is None:
                blocks.append(None)
                continue
            dense = tuple(dense)
            if len(dense) != len(group):
                raise ValueError(f"{kind}{list(group)}: one {side} block entry per member "
                                 f"({len(group)}), got {len(dense)}")
            blocks.append(tuple(dense[i] for i in idx))
        self._set(kind, group, si, sb, ri, rb, *blocks)

    @classmethod
    def sparse(cls, kind: str, group: Sequence[int], sends: tuple[Sequence[int], Sequence[Buffer]],
               recvs: tuple[Sequence[int], Sequence[Buffer]],
               blocks: tuple[Sequence | None, Sequence | None] = (None, None)) -> Collective:
        """The collective whose occupied slots are ``sends = (member indices, buffers)`` (and
        likewise ``recvs``); every other slot is empty. Indices increase strictly.
        ``blocks``: the occupied send and receive slots' block ranges (None: whole chunks).

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
        for side, ks, (idx, _) in (("send", blocks[0], sends), ("receive", blocks[1], recvs)):
            if ks is not None and len(tuple(ks)) != len(tuple(idx)):
                raise ValueError(f"{kind}{list(group)}: one {side} block entry per occupied "
                                 f"slot ({len(tuple(idx))}), got {len(tuple(ks))}")
        self._set(kind, group, *parts, *blocks)
        return self

    def _set(self, kind, group, si, sb, ri, rb, sk=None, rk=None) -> None:
        sk, rk = (None if ks is None or all(k is None for k in ks) else
                  tuple(None if k is None else _check_blocks(self, k) for k in ks)
                  for ks in (sk, rk))
        for name, value in (("kind", kind), ("group", group), ("_si", si), ("_sb", sb),
                            ("_ri", ri), ("_rb", rb), ("_io", None), ("_sk", sk), ("_rk", rk)):
            object.__setattr__(self, name, value)

    @classmethod
    def _checked(cls, kind: str, group: tuple[int, ...], si, sb, ri, rb, sk=None,
                 rk=None) -> Collective:
        """A collective from parts already checked (an op's own group and slots)."""
        self = object.__new__(cls)
        for name, value in (("kind", kind), ("group", group), ("_si", si), ("_sb", sb),
                            ("_ri", ri), ("_rb", rb), ("_io", None), ("_sk", sk), ("_rk", rk)):
            object.__setattr__(self, name, value)
        return self

    @property
    def send_blocks(self) -> tuple:
        """Block ranges of each occupied send slot (``sparse_sends`` order; None: whole)."""
        return self._sk if self._sk is not None else (None,) * len(self._si)

    @property
    def recv_blocks(self) -> tuple:
        """Block ranges of each occupied receive slot (``sparse_recvs`` order; None: whole)."""
        return self._rk if self._rk is not None else (None,) * len(self._ri)

    @property
    def ranged(self) -> bool:
        """Whether some slot moves block ranges."""
        return self._sk is not None or self._rk is not None

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
                and (self.group is other.group or self.group == other.group)
                and self._sk == other._sk and self._rk == other._rk)

    def __hash__(self) -> int:
        return hash((self.kind, self.group, self._si, self._sb, self._ri, self._rb, self._sk,
                     self._rk))

    def __repr__(self) -> str:
        return (f"Collective(kind={self.kind!r}, group={self.group!r}, sends={self.sends!r}, "
                f"recvs={self.recvs!r})")

    def __reduce__(self):
        return (_collective, (self.kind, self.group, self._si, self._sb, self._ri, self._rb,
                              self._sk, self._rk))

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
                                   tuple(map(cot, self._rb)), self._si, tuple(map(cot, self._sb)),
                                   self._rk, self._sk)

    def transposed(self) -> Collective:
        """The same buffers moving the other way (re-sending merged outputs in a backward)."""
        return Collective._checked("A2A" if self.kind == "A2A" else COLLECTIVE_ADJOINT[self.kind],
                                   self.group, self._ri, self._rb, self._si, self._sb, self._rk,
                                   self._sk)

    def _text(self, arrow: str) -> str:
        def fmt(idx, bufs, ks):
            out = ["-"] * len(self.group)
            for i, b, k in zip(idx, bufs, ks):
                out[i] = f"{b}{blocks_text(k)}"
            return ",".join(out)
        return (f"{self.kind}[{','.join(str(r) for r in self.group)}] "
                f"{fmt(self._si, self._sb, self.send_blocks)} {arrow} "
                f"{fmt(self._ri, self._rb, self.recv_blocks)}")

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


def _collective(kind, group, si, sb, ri, rb, sk=None, rk=None) -> Collective:
    """Unpickle a :class:`Collective` (its sparse parts)."""
    return Collective.sparse(kind, group, (si, sb), (ri, rb), (sk, rk))


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
_SLOT = re.compile(r"[^,\[]+(?:\[[^\]]*\])?")
_ARROW = {"→": "S", "->": "S", "←": "R", "<-": "R"}


def parse_op(text: str) -> Op:
    """Parse the pretty or ASCII form of one op: ``parse_op("S kv5->r2") == Send("kv5", 2)``."""
    c = _COLL.match(text)
    if c:
        group = tuple(int(x) for x in c.group(2).split(",") if x.strip())

        def slots(xs):                   # "kv0[0:2,4:5],-" -> buffers and block ranges
            toks = _SLOT.findall(xs)
            if ",".join(toks) != xs:
                raise ValueError(f"cannot parse collective slots {xs!r} in {text!r}")
            got = [(None, None) if x == "-" else _parse_blocks(x) for x in toks]
            return (tuple(None if b is None else Buffer(b) for b, _ in got),
                    tuple(k for _, k in got))
        (sb, sk), (rb, rk) = slots(c.group(3)), slots(c.group(4))
        return Collective(c.group(1), group, sb, rb, sk, rk)
    m = _OP.match(text)
    if not m:
        raise ValueError(f"cannot parse op {text!r}; expected e.g. 'C q3.kv5', 'C q3.kv5 h1/4', "
                         f"'G q3.kv5', 'S kv5->r2', 'S kv5[0:3]->r2', 'R kv5<-r0', 'AG[0,1] kv0,- > -,kv1' (or the "
                         f"pretty forms with ·, →, ←, ⇄)")
    if m.group(1):
        cls = Compute if m.group(1) == "C" else GradCompute
        heads = None if m.group(4) is None else (int(m.group(4)), int(m.group(5)))
        return cls(int(m.group(2)), int(m.group(3)), heads)
    kind, buf, arrow, peer = m.group(6), m.group(7), m.group(8), int(m.group(9))
    if _ARROW[arrow] != kind:
        raise ValueError(f"op {text!r}: a send uses '->' (or '→'), a receive '<-' (or '←')")
    buf, blocks = _parse_blocks(buf)
    return (Send if kind == "S" else Recv)(buf, peer, blocks)
