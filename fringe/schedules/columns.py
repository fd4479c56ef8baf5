"""Build programs as columns: a large schedule without a Python object per op.

:class:`ProgramBuilder` takes computes, point-to-point transfers and collectives as integer
arrays (numpy broadcasting applies) and builds the columnar :class:`ProgramTable` every pass
reads. Its :meth:`~ProgramBuilder.programs` are ordinary :class:`Program` values (built only
when looked at), so a ``programs_fn=`` or ``build=`` may return them.

>>> b = ProgramBuilder(2)
>>> b.computes(rank=[0, 1], step=0, q=[0, 1], kv=[0, 1])
>>> b.allgather(step=0, group=(0, 1), family="kv", chunk=[0, 1])
>>> b.computes(rank=[0, 1], step=1, q=[0, 1], kv=[1, 0])
>>> print(b.programs()[0].ascii())
r0:
  t0: C q0.kv0 | AG[0,1] kv0,kv0 > kv0,kv1
  t1: C q0.kv1
"""
from __future__ import annotations

import functools
from typing import Sequence

import numpy as np

from .ir import COLL_KINDS, C_, G_, Family, Program, ProgramTable

_FAMILY_CODE = {f: n for n, f in enumerate(Family)}


def _family(x) -> int:
    try:
        return _FAMILY_CODE[Family(x)]
    except ValueError:
        raise ValueError(f"family must be one of {[f.value for f in Family]}, got {x!r}") from None


def _ints(x) -> np.ndarray:
    """``x`` as int64, refusing what is not an integer (``step=1.5`` was truncated to 1)."""
    a = np.asarray(x)
    if a.dtype.kind not in "iub" or (a.dtype.kind == "u" and a.size and int(a.max()) >= 2 ** 63):
        raise ValueError(f"ProgramBuilder: ranks, steps, chunks and head slices must be "
                         f"integers (int64), got {x!r}")
    return a.astype(np.int64)


def _heads(heads, n: int) -> tuple[np.ndarray, np.ndarray]:
    if heads is None:
        return np.zeros(n, np.int64), np.zeros(n, np.int64)
    hi, hn = (np.broadcast_to(_ints(x), (n,)) for x in heads)
    if ((hn < 1) | (hi < 0) | (hi >= hn)).any():
        raise ValueError("heads=(hi, hn) must hold 0 <= hi < hn")
    return hi, hn


def _slot_order(si: np.ndarray, di: np.ndarray, n: int) -> tuple[np.ndarray, ...]:
    """A collective's slots in the table's (side, direction, index) order, from its
    contributions ``(si[k], di[k])`` (distinct, in (sender, receiver) order; n members):
    ``(who, dirs, side, idx)``, each slot's contribution, direction (0: on the sender's
    side, indexed by the receiver; 1: on the receiver's, indexed by the sender), side
    (member) and index."""
    m = len(si)
    r = np.argsort(di.astype(np.uint16) if n <= 1 << 16 else di, kind="stable")
    who = np.concatenate([np.arange(m), r])     # two runs, each in (side, index) order
    side = np.concatenate([si, di[r]])
    dirs = np.repeat(np.array([0, 1], np.int64), m)
    merge = np.argsort(side * 2 + dirs, kind="stable")
    who, side, dirs = who[merge], side[merge], dirs[merge]
    return who, dirs, side, np.where(dirs == 0, di[who], si[who])


@functools.lru_cache(maxsize=64)
def _all_pairs(n: int, own: bool) -> tuple[np.ndarray, ...]:
    """:func:`_slot_order` of an n-member all-gather from every member to every member
    (itself too if ``own``), and the sender of each slot (read-only: shared by calls)."""
    w = np.ones((n, n), dtype=bool)
    np.fill_diagonal(w, own)
    si, di = np.nonzero(w)
    who, dirs, side, idx = _slot_order(si, di, n)
    out = (dirs, side, idx, si[who])
    for x in out:
        x.setflags(write=False)
    return out


class ProgramBuilder:
    """Every rank's forward programs, added as columns.

    Within a rank's step, ops keep the order of the calls that added them (a compute before
    a send before a receive when added by one call each); every member sees the collectives
    over one group in one step in the order they were added.

    Args:
        world_size: P, the number of ranks.
    """

    def __init__(self, world_size: int) -> None:
        if not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
        self.world_size = world_size
        self._comp: list = []
        self._xfer: list = []
        self._sides: list = []          # (members, step, order, kind, group index) per call
        self._slots: list = []
        self._n_sides = 0
        self._groups: dict = {}
        self._calls = 0

    def _order(self) -> int:
        self._calls += 1
        return self._calls

    def _ranks(self, *cols, what: str) -> None:
        for c in cols:
            if len(c) and (int(c.min()) < 0 or int(c.max()) >= self.world_size):
                raise ValueError(f"{what}: ranks and chunks must lie in [0, {self.world_size})")

    def computes(self, *, rank, step, q, kv, heads=None, gradient: bool = False) -> None:
        """Tiles ``C q·kv`` (or ``G`` with ``gradient=True``) on ``rank`` at ``step``; arrays
        broadcast. ``heads=(hi, hn)``: head slice hi of hn (default: all heads)."""
        r, t, a, b = np.broadcast_arrays(*(_ints(x) for x in (rank, step, q, kv)))
        r, t, a, b = (x.ravel() for x in (r, t, a, b))
        self._ranks(r, a, b, what="computes")
        hi, hn = _heads(heads, len(r))
        self._comp.append((r, t, np.full(len(r), G_ if gradient else C_), a, b,
                           np.full(len(r), self._order()), hi, hn))

    def transfers(self, *, step, src, dst, family: str = "kv", chunk, heads=None) -> None:
        """Point-to-point moves of buffer ``family`` + ``chunk`` from ``src`` to ``dst`` at
        ``step`` (a send on src and its receive on dst); arrays broadcast."""
        t, s, d, c = np.broadcast_arrays(*(_ints(x) for x in (step, src, dst, chunk)))
        t, s, d, c = (x.ravel() for x in (t, s, d, c))
        self._ranks(s, d, c, what="transfers")
        if (s == d).any():
            raise ValueError("transfers: a rank does not send to itself")
        hi, hn = _heads(heads, len(t))
        o = np.full(len(t), self._order())
        self._xfer.append((t, s, d, np.full(len(t), _family(family)), c, o, hi, hn, o))

    def _group(self, group: Sequence[int]) -> tuple[int, ...]:
        group = tuple(map(int, _ints(tuple(group))))
        if len(set(group)) != len(group) or min(group) < 0 or max(group) >= self.world_size:
            raise ValueError(f"group must be distinct ranks in [0, {self.world_size}), got {group}")
        return group

    def collective(self, kind: str, *, step: int, group: Sequence[int], src, dst,
                   family: str = "kv", chunk, heads=None) -> None:
        """One collective over ``group`` at ``step``: member index ``src[i]`` contributes
        buffer ``family`` + ``chunk[i]`` to member index ``dst[i]`` (``src == dst``: the
        member's own slot, holding the buffer on both sides). Every member issues it; a
        member with no contribution has an empty side."""
        if kind not in COLL_KINDS:
            raise ValueError(f"kind must be one of {COLL_KINDS}, got {kind!r}")
        group = self._group(group)
        si, di, c = (_ints(x) for x in (src, dst, chunk))
        if not si.shape == di.shape == c.shape:
            si, di, c = np.broadcast_arrays(si, di, c)
        si, di, c = si.ravel(), di.ravel(), c.ravel()
        n = len(group)
        if len(si) and (min(int(si.min()), int(di.min())) < 0 or max(int(si.max()), int(di.max())) >= n):
            raise ValueError(f"collective: member indices must lie in [0, {n})")
        self._ranks(c, what="collective")
        hi, hn = _heads(heads, len(si))
        key = si * n + di                   # (sender, receiver) pairs in order, each once
        if len(key) > 1 and not (key[1:] > key[:-1]).all():
            o = np.argsort(key, kind="stable")
            if (key[o[1:]] == key[o[:-1]]).any():
                raise ValueError("collective: one contribution per (sender, receiver) pair")
            si, di, c, hi, hn = si[o], di[o], c[o], hi[o], hn[o]
        who, dirs, side, idx = _slot_order(si, di, n)
        self._add(kind, step, group, dirs, side, idx, _family(family), c[who], hi[who], hn[who])

    def _add(self, kind: str, step: int, group: tuple[int, ...], dirs, side, idx, fam: int,
             c, hi, hn) -> None:
        """A valid collective's sides, and its slots in (side, direction, index) order
        (:func:`_slot_order`; ``side``: the member)."""
        step = int(_ints(step))
        g = self._groups.setdefault(group, len(self._groups))
        first, self._n_sides = self._n_sides, self._n_sides + len(group)
        self._sides.append((np.array(group, np.int64), step, self._order(),
                            COLL_KINDS.index(kind), g))
        self._slots.append((side + first, dirs, idx, np.full(len(side), fam), c, hi, hn))

    def allgather(self, *, step: int, group: Sequence[int], family: str = "kv", chunk,
                  want=None, own: bool = True) -> None:
        """An all-gather: member i contributes ``family`` + ``chunk[i]`` to every member j
        with ``want[i, j]`` (default: all); ``own=False`` leaves own slots empty."""
        group = self._group(group)
        n = len(group)
        c = np.broadcast_to(_ints(chunk), (n,))
        self._ranks(c, what="collective")
        if want is None:
            dirs, side, idx, sender = _all_pairs(n, bool(own))
        else:
            w = np.asarray(want, dtype=bool)
            if w.shape != (n, n):
                raise ValueError(f"want must be bool [{n}, {n}], got shape {w.shape}")
            w = w.copy()
            np.fill_diagonal(w, own)
            si, di = np.nonzero(w)
            who, dirs, side, idx = _slot_order(si, di, n)
            sender = si[who]
        zero = np.zeros(len(side), np.int64)
        self._add("AG", step, group, dirs, side, idx, _family(family), c[sender], zero, zero)

    def table(self) -> ProgramTable:
        """The general :class:`ProgramTable` of everything added."""
        cat = lambda parts, k: (np.concatenate([p[k] for p in parts]) if parts  # noqa: E731
                                else np.zeros(0, np.int64))
        comp = {name: cat(self._comp, k) for k, name in
                enumerate(("rank", "step", "kind", "q", "kv", "order", "hi", "hn"))}
        xfer = {name: cat(self._xfer, k) for k, name in
                enumerate(("step", "src", "dst", "fam", "chunk", "order", "hi", "hn", "rorder"))}
        n = [len(x[0]) for x in self._sides]
        coll = {"rank": cat(self._sides, 0)}
        coll.update({name: np.repeat(np.array([x[k] for x in self._sides], np.int64), n)
                     for k, name in enumerate(("step", "order", "kind", "group"), 1)})
        coll.update({name: cat(self._slots, k) for k, name in      # each call's sides follow
                     enumerate(("slot_side", "slot_dir", "slot_idx", "slot_fam",   # the last's
                                "slot_chunk", "slot_hi", "slot_hn"))})
        coll["groups"] = tuple(self._groups)
        return ProgramTable._of_parts(self.world_size, comp, xfer, coll)

    def programs(self) -> list[Program]:
        """One program per rank (cut from :meth:`table` when looked at)."""
        return list(self.table().programs())
