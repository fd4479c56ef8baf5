"""What the passes share: the family codes, which buffers a tile touches (from the rule
table), the one table of some programs, and a general table's parts as int64 columns
(:class:`_Gen`, derived once per table inside :func:`shared_columns`), with the size limits
of the dense arrays the passes allocate (:data:`DENSE_CELLS`, :data:`PLANE_CELLS`,
:data:`MEMBER_CELLS`; other modules read them here, at call time, so one assignment reaches
every pass)."""
from __future__ import annotations

import contextlib
import gc
import itertools
from typing import Sequence

import numpy as np
import torch

from ..ir import (C_, COLL_KINDS as ir_kinds, G_, RANGED_FAMILIES, RULES, TILE_TOUCH_CODES,
                  Family, Program, ProgramTable, ScheduleError)
from ._keys import _lookup, _outside, _row_keys, _uniq, _unique
from ._locate import _fail, _first_in_order, _located


@contextlib.contextmanager
def gc_paused():
    """Pause CPython's cyclic garbage collector for a pass (restored on exit; nests).

    The op-by-op passes build tens of thousands of small immutable values that all live on;
    each full collection this triggers walks every object of the process (torch's included),
    which measured 0.2-0.4 s of a P=1024 all-gather plan. The passes make no reference
    cycles, so the collector has nothing to find in what they build. Also a decorator.
    """
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


_INPUTS = frozenset(f for f, _ in RULES["C"].reads)   # what computes read; pruning may drop their moves
_FAMILIES = tuple(Family)
_FAMILY_CODE = {f: n for n, f in enumerate(_FAMILIES)}
_F = len(_FAMILIES)
_Q, _KV, _OUT, _DOUT = Family.Q, Family.KV, Family.OUT, Family.DOUT


def _tile_touches(kind: np.ndarray, *, written: bool):
    """``(family code, rows, side, n)`` for each touch of the tile rows of ``kind`` (a table's
    kind column) that ``written`` selects, read from :data:`TILE_TOUCH_CODES` (the one rule
    table): ``rows`` picks the rows (a mask, or all of them), ``side`` is
    :data:`~fringe.schedules.ir.Q_SIDE` or ``KV_SIDE`` (which chunk column the buffer is of),
    ``n`` the touch's place among the rule's reads (or writes): the order an op reads in."""
    for code, touches in TILE_TOUCH_CODES.items():
        rows = kind == code
        n = int(rows.sum())
        if not n:
            continue
        if n == len(kind):
            rows = slice(None)
        for k, (fam, side) in enumerate((f, s) for f, s, w in touches if w is written):
            yield fam, rows, side, k


def _need_array(need: torch.Tensor, P: int) -> np.ndarray:
    arr = (need.numpy() if isinstance(need, torch.Tensor) else np.asarray(need)).astype(bool)
    if arr.shape != (P, P):
        raise ValueError(f"need must be a bool [P, P] = [{P}, {P}] tile map, got shape "
                         f"{tuple(arr.shape)}")
    return arr


def _table(programs: Sequence[Program]) -> ProgramTable:
    """The one table of ``programs`` (the table they were cut from, else built from their
    ops: :meth:`ProgramTable.of`, which names a transfer without its partner)."""
    return ProgramTable.of(programs)


#: Above this many (family, rank, chunk) cells the chain shortcuts leave a table to the
#: general passes (sorted keys instead of dense planes).
DENSE_CELLS = 1 << 26
#: The largest dense (rank, buffer) plane the general passes allocate; past it presence,
#: re-sends and pruning work on sorted keys.
PLANE_CELLS = 1 << 27
_GENS: list = [None]     # inside shared_columns(): {(id(table), lenient): (table, fields)}


@contextlib.contextmanager
def shared_columns():
    """Inside, the passes derive a table's general columns (:class:`_Gen`) once and share
    them: a plan's check, prune and reverse read the same tables, some twice. A table's
    columns are read-only, so what is derived from them stays true. Only the newest table's
    are kept: the passes of a plan read one table after another (prune, narrow, check and
    reverse the forward, check the backward), each while it is the newest, and keeping older
    ones kept dead tables and their int64 copies alive (1.3 GB of a 3.4 GB peak at P=1024 for
    compose(zigzag, ulysses, 8)). They are dropped on exit. Nests."""
    if _GENS[0] is not None:
        yield
        return
    _GENS[0] = {}
    try:
        yield
    finally:
        _GENS[0] = None


def _int64(x: np.ndarray) -> np.ndarray:
    """``x`` as int64; an all-zero column (whole heads: the table keeps those as zeroed pages,
    ``ProgramTable._of_parts``) as fresh zeroed pages too, off the resident memory until
    written (16.8M transfer rows at P=4,096: 134 MB each)."""
    if len(x) and x.dtype != np.int64 and not x.any():
        return np.zeros(len(x), dtype=np.int64)
    return np.asarray(x, dtype=np.int64)


class _Gen:
    """A general table's parts as int64 columns, with the derived codes the passes share:
    ``hs`` a head slice code (0: all heads, else ``hn*(hn-1)/2 + hi + 1``), ``HS`` one more
    than the largest, member index ``me`` of each collective side (-1: not a member), and
    the instance (``inst``: step, group and ordinal among that rank's collectives over the
    group in the step) each side belongs to; ``kg`` is one index per distinct group.

    Columns no program can hold raise :class:`ScheduleError` naming their row, an invalid
    transfer peer the op rules' message. Chunks and group members past ``P - 1`` raise too,
    unless ``lenient`` (what :func:`check` reads, which names them where the op rules do:
    chunks past ``P - 1`` are renumbered ``P, P + 1, ...`` in order, ``C`` chunk ids in all).
    """

    def __init__(self, tab: ProgramTable, *, lenient: bool = False) -> None:
        cache, key = _GENS[0], (id(tab), lenient)
        if cache is not None:                           # shared_columns()
            other = cache.get((id(tab), not lenient))
            if key not in cache and other is not None and other[1]["C"] == tab.world_size \
                    and int(other[1]["gmax"].max()) < tab.world_size:
                cache[key] = other      # no chunk or member past P - 1: both forms are one
            if key in cache:
                self.__dict__.update(cache[key][1])
                return
            for k in [k for k in cache if k[0] != key[0]]:   # other tables', before this
                del cache[k]                                    # one's are derived
        P = self.P = tab.world_size
        comp, xfer, coll = tab._parts
        i64 = lambda d, ks: [_int64(d[k]) for k in ks]  # noqa: E731
        (self.cr, self.ct, self.ck, self.cq, self.ckv, self.co,
         self.chi, self.chn) = i64(comp, ("rank", "step", "kind", "q", "kv", "order", "hi", "hn"))
        # The transfer columns are the table's own (read-only, int32 where they fit), not
        # int64 copies: a plan has millions of transfers (16.8M a direction for zigzag at
        # P=4,096 on documents), and nine int64 copies held while a table's columns are
        # shared cost 1.2 GB. Arithmetic that could pass 2**31 casts first: keys through
        # bkey / rkey / hs (int64 from the first operand), and the passes' own products
        # (tests/test_general_passes.py checks that int32 columns give the int64 answer).
        (self.xt, self.xs, self.xd, self.xf, self.xc, self.xo, self.xro, self.xhi, self.xhn,
         self.xrng) = (xfer[k] for k in ("step", "src", "dst", "fam", "chunk", "order",
                                          "rorder", "hi", "hn", "rng"))
        self.ranges = xfer["ranges"]                     # the block-range sets rng indexes
        (self.kr, self.kt, self.ko, self.kk, self.kg) = i64(coll, ("rank", "step", "order",
                                                                   "kind", "group"))
        (self.ss, self.sdir, self.sidx, self.sf, self.sc, self.shi,
         self.shn) = i64(coll, ("slot_side", "slot_dir", "slot_idx", "slot_fam", "slot_chunk",
                                "slot_hi", "slot_hn"))
        self.groups = coll["groups"]
        self.srng = np.asarray(coll["slot_rng"], dtype=np.int64)
        self.sranges = coll["ranges"]                   # the block-range sets srng indexes
        self.glen = np.array([len(g) for g in self.groups] or [0], dtype=np.int64)
        self._valid(tab, lenient)
        self.ok = True                       # an invalid table raised in _valid
        # no head slices: a read-only zero-stride column (no 134 MB of zeros for 16.8M hops)
        self.chs, self.xhs, self.shs = (self.hs(h, n) if n.any() else
                                        np.broadcast_to(np.zeros(1, np.int64), (len(n),))
                                        for h, n in ((self.chi, self.chn), (self.xhi, self.xhn),
                                                     (self.shi, self.shn)))
        self.HS = 1 + max([int(x.max()) for x in (self.chs, self.xhs, self.shs) if len(x)] or [0])
        canon: dict = {}                     # one index per distinct group
        ids = [canon.setdefault(g, n) for n, g in enumerate(self.groups)]
        if len(canon) != len(ids):
            self.kg = np.array(ids, dtype=np.int64)[self.kg]
        self.me = _member_pos(self.groups, self.glen, self.gmax, self.kg, self.kr)
        # instances: (step, group, ordinal), ordinal counted per (rank, step, group) by order
        n = len(self.kr)
        o = np.lexsort((self.ko, self.kg, self.kt, self.kr))
        run = np.ones(n, dtype=bool)
        if n:
            a = np.stack([self.kr[o], self.kt[o], self.kg[o]])
            run[1:] = (a[:, 1:] != a[:, :-1]).any(axis=0)
        start = np.maximum.accumulate(np.where(run, np.arange(n), 0))
        ordinal = np.empty(n, dtype=np.int64)
        ordinal[o] = np.arange(n) - start
        self.ordinal = ordinal
        self.inst_keys, self.inst = _unique(_row_keys(self.kt, self.kg, ordinal))
        if cache is not None:
            for x in self.__dict__.values():
                if isinstance(x, np.ndarray):
                    x.setflags(write=False)     # shared: no pass may write them
            cache[key] = (tab, dict(self.__dict__))

    @staticmethod
    def hs(hi: np.ndarray, hn: np.ndarray) -> np.ndarray:
        hn = np.asarray(hn, dtype=np.int64)         # hn * (hn - 1) passes 2**31 at 46,341
        return np.where(hn == 0, 0, hn * (hn - 1) // 2 + hi + 1)

    @staticmethod
    def _ranged_families(part: str, fam: np.ndarray, rng: np.ndarray) -> None:
        """Raise for the first row of ``part`` that moves block ranges of a family that may
        not (:data:`~fringe.schedules.ir.RANGED_FAMILIES`)."""
        ranged = rng >= 0
        if not ranged.any():
            return
        ok = np.zeros(_F, dtype=bool)
        ok[[_FAMILY_CODE[f] for f in RANGED_FAMILIES]] = True
        bad = ranged & ~ok[np.clip(fam, 0, _F - 1)]
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            raise ScheduleError(
                f"ProgramTable {part} row {i}: a {_FAMILIES[int(fam[i])].value} buffer moves "
                f"block ranges; only {', '.join(f.value for f in RANGED_FAMILIES)} may (a "
                f"partial output merges whole): move it whole")

    def _valid(self, tab: ProgramTable, lenient: bool) -> None:
        """Raise the first fault of the columns themselves (by part, then row), then the
        first transfer (in program order) naming an invalid peer; unless ``lenient``, the
        first op naming a chunk or rank past ``P - 1``. Sets ``gmax`` (each group's largest
        member) and ``C``."""
        P, ng, n_side = self.P, len(self.groups), len(self.kr)
        steps = (0, 1 << 40)
        heads = "a head slice h{}/{} (needs 0 <= i < n < 65536, or i = n = 0: all heads)"
        for part, col, (lo, hi), what in (
                ("compute", self.cr, (0, P), "rank {}"), ("compute", self.ct, steps, "step {}"),
                ("compute", self.ck, (C_, G_ + 1), "kind code {} (0: C, 1: G)"),
                ("compute", self.cq, (0, 1 << 31), "q chunk {}"),
                ("compute", self.ckv, (0, 1 << 31), "kv chunk {}"),
                ("transfer", self.xt, steps, "step {}"),
                ("transfer", self.xf, (0, _F), "family code {}"),
                ("transfer", self.xc, (0, 1 << 31), "chunk {}"),
                ("collective side", self.kr, (0, P), "rank {}"),
                ("collective side", self.kt, steps, "step {}"),
                ("collective side", self.kk, (0, len(ir_kinds)), f"kind code {{}} ({ir_kinds})"),
                ("collective side", self.kg, (0, max(ng, 1)), "group index {}"),
                ("collective slot", self.ss, (0, max(n_side, 1)), "side {}"),
                ("collective slot", self.sdir, (0, 2), "direction {} (0: send, 1: receive)"),
                ("collective slot", self.sf, (0, _F), "family code {}"),
                ("collective slot", self.sc, (0, 1 << 31), "chunk {}")):
            bad = _outside(col, lo, hi)
            if bad is not None:
                i = int(np.flatnonzero(bad)[0])
                bound = {1 << 40: "2**40", 1 << 31: "2**31"}.get(hi, hi)
                raise ScheduleError(f"ProgramTable {part} row {i}: {what.format(int(col[i]))} "
                                    f"is outside [{lo}, {bound})")
        bad = _outside(self.xrng, -1, len(self.ranges))
        if bad is not None:
            i = int(np.flatnonzero(bad)[0])
            raise ScheduleError(f"ProgramTable transfer row {i}: range set {int(self.xrng[i])} "
                                f"is outside [-1, {len(self.ranges)}) (-1: the whole chunk)")
        bad = _outside(self.srng, -1, len(self.sranges))
        if bad is not None:
            i = int(np.flatnonzero(bad)[0])
            raise ScheduleError(f"ProgramTable collective slot row {i}: range set "
                                f"{int(self.srng[i])} is outside [-1, {len(self.sranges)}) "
                                f"(-1: the whole chunk)")
        for part, fam, rng in (("transfer", self.xf, self.xrng),
                               ("collective slot", self.sf, self.srng)):
            self._ranged_families(part, fam, rng)
        for part, hi, hn in (("compute", self.chi, self.chn), ("transfer", self.xhi, self.xhn),
                             ("collective slot", self.shi, self.shn)):
            if len(hn) and (int(hn.max()) != 0 or int(hi.min()) != 0 or int(hi.max()) != 0):
                bad = (hn < 0) | (hn >= 1 << 16) | np.where(hn == 0, hi != 0, (hi < 0) | (hi >= hn))
                if bad.any():
                    i = int(np.flatnonzero(bad)[0])
                    raise ScheduleError(f"ProgramTable {part} row {i}: "
                                        f"{heads.format(int(hi[i]), int(hn[i]))}")
        gmax = []
        for n, grp in enumerate(self.groups):
            if not grp or len(set(grp)) != len(grp) or min(grp) < 0 or max(grp) >= 1 << 31:
                raise ScheduleError(f"ProgramTable group {n} {list(grp)}: a group is one or "
                                    f"more distinct ranks >= 0")
            gmax.append(max(grp))
        self.gmax = np.array(gmax or [0], dtype=np.int64)
        if len(self.ss):
            width = self.glen[self.kg[self.ss]]
            bad = (self.sidx < 0) | (self.sidx >= width)
            if bad.any():
                i = int(np.flatnonzero(bad)[0])
                raise ScheduleError(f"ProgramTable collective slot row {i}: member index "
                                    f"{int(self.sidx[i])} is outside [0, {int(width[i])}) "
                                    f"(its group's size)")
            n_idx = int(self.glen.max()) + 1
            step = np.diff((self.ss * 2 + self.sdir) * n_idx + self.sidx)
            if len(step) and int(step.min()) <= 0:
                i = int(np.flatnonzero(step <= 0)[0]) + 1
                raise ScheduleError(f"ProgramTable collective slot row {i}: slots must be "
                                    f"sorted by (side, direction, member index), each once")
        # transfers naming an invalid peer, as the op rules name them (a send or a receive
        # whose rank is in range; both out of range: no program holds it)
        so, do = _outside(self.xs, 0, P), _outside(self.xd, 0, P)
        same = self.xs == self.xd
        if so is not None or do is not None or same.any():
            so = np.zeros(len(same), bool) if so is None else so
            do = np.zeros(len(same), bool) if do is None else do
            both = so & do
            if both.any():
                i = int(np.flatnonzero(both)[0])
                raise ScheduleError(f"ProgramTable transfer row {i}: ranks {int(self.xs[i])} -> "
                                    f"{int(self.xd[i])} are outside [0, {P})")
            cands = [(1, np.flatnonzero(~so & (do | same)), None),
                     (2, np.flatnonzero(~do & (so | same)), None)]
            k, j = _first_in_order(tab, cands)
            r, t, op = _located(tab, cands[k][0], int(cands[k][1][j]))
            _fail(tab, r, t, f"{op} names an invalid peer (world size {P})")
        cols = (self.cq, self.ckv, self.xc, self.sc)
        top = max([int(c.max()) for c in cols if len(c)] or [-1])
        self.C = P
        if not lenient and (top >= P or int(self.gmax.max()) >= P):
            past = [(0, np.flatnonzero((self.cq >= P) | (self.ckv >= P))),
                    (1, np.flatnonzero(self.xc >= P)), (2, np.flatnonzero(self.xc >= P)),
                    (3, _uniq(np.concatenate([self.ss[self.sc >= P],
                                              np.flatnonzero(self.gmax[self.kg] >= P)])))]
            k, j = _first_in_order(tab, [(tie, rows, None) for tie, rows in past])
            tie, row = past[k][0], int(past[k][1][j])
            r, t, op = _located(tab, tie, row)
            if tie == 3 and self.gmax[self.kg[row]] >= P:
                _fail(tab, r, t, f"'{op}' names a rank outside [0, {P})")
            chunk = (max(int(self.cq[row]), int(self.ckv[row])) if tie == 0 else
                     int(self.sc[self.ss == row].max()) if tie == 3 else int(self.xc[row]))
            _fail(tab, r, t, f"'{op}' names chunk {chunk}, outside [0, {P})")
        if top >= P:                         # lenient: renumber the chunks past P - 1
            big = _uniq(np.concatenate([c[c >= P] for c in cols]))
            self.cq, self.ckv, self.xc, self.sc = (
                np.where(c >= P, P + np.searchsorted(big, c), c) for c in cols)
            self.C = P + len(big)

    def pos_rank(self, group, idx):
        """The rank at member index ``idx`` of group ``group`` (index arrays)."""
        if not hasattr(self, "_members"):
            width = max([len(x) for x in self.groups] or [1])
            m = np.full((max(len(self.groups), 1), width), -1, dtype=np.int64)
            for n, grp in enumerate(self.groups):
                m[n, :len(grp)] = grp
            self._members = m
        return self._members[group, idx]

    def bkey(self, fam, chunk, hs):
        """A buffer as one int: (family, chunk, head slice code)."""
        return (np.asarray(fam, dtype=np.int64) * self.C + chunk) * self.HS + hs

    def rkey(self, rank, fam, chunk, hs):
        """A (rank, buffer) pair as one int."""
        return ((np.asarray(rank, dtype=np.int64) * _F + fam) * self.C + chunk) * self.HS + hs


#: The largest dense ``[group, rank]`` member table :func:`_member_pos` allocates.
MEMBER_CELLS = 1 << 24


def _member_pos(groups, glen: np.ndarray, gmax: np.ndarray, kg: np.ndarray,
                kr: np.ndarray) -> np.ndarray:
    """Each collective side's member index in its group (-1: its rank is not a member): a
    dense ``[group, rank]`` table where it is small, else a sorted lookup."""
    if not len(kr):
        return np.zeros(0, np.int64)
    width = max(int(gmax.max()), int(kr.max())) + 1
    if len(groups) * width <= MEMBER_CELLS:
        pos = np.full((len(groups), width), -1, dtype=np.int64)
        for g, grp in enumerate(groups):
            pos[g, list(grp)] = np.arange(len(grp))
        return pos[kg, kr]
    flat = np.fromiter(itertools.chain.from_iterable(groups), np.int64, int(glen.sum()))
    starts = np.cumsum(glen) - glen
    idx = np.arange(len(flat)) - np.repeat(starts, glen)
    keys = np.repeat(np.arange(len(groups)), glen) * width + flat
    o = np.argsort(keys, kind="stable")
    return _lookup(kg * width + kr, keys[o], idx[o], -1)[0]


def _slices(hs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(hi, hn)`` of head slice codes (:meth:`_Gen.hs`; 0: all heads, ``(0, 0)``)."""
    hn = np.zeros(len(hs), np.int64)
    hi = np.zeros(len(hs), np.int64)
    if (hs > 0).any():
        n_ = np.floor((1 + np.sqrt(8 * np.maximum(hs - 1, 0) + 1)) / 2).astype(np.int64)
        n_ = np.where(n_ * (n_ - 1) // 2 > hs - 1, n_ - 1, n_)
        n_ = np.where((n_ + 1) * n_ // 2 <= hs - 1, n_ + 1, n_)
        hn = np.where(hs > 0, n_, 0)
        hi = np.where(hs > 0, hs - 1 - n_ * (n_ - 1) // 2, 0)
    return hi, hn
