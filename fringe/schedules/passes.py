"""Passes over programs: lowering a communication pattern, pruning by the mask, deriving
the backward by rule, and the structural checks every schedule must pass.

Each pass is written once, with numpy on the columns of the one
:class:`~fringe.schedules.ir.ProgramTable` (programs given as op objects, hand-written or
parsed, become their table first), so a hand-written schedule gets the same pruning, checks
and backward as the built-in ones. Which buffers an op touches, and its adjoint, come from the
one rule table :data:`~fringe.schedules.ir.RULES`. Two named shortcuts for the ring chain's
shape (``_parts_ok``, ``_reverse_parts``: whole-heads computes and transfers, dense planes)
read and write the same columns and are tested against the general code. Nothing falls back to
op objects: a pass handles every table or raises naming the rank and step (``<-- ERROR
HERE``) or the shape it does not support. :mod:`fringe.testing.oracle` states the same rules
op by op, the oracle of the differential tests; no production module imports it.
"""
from __future__ import annotations

import bisect
import collections
import contextlib
import dataclasses
import gc
import itertools
from typing import Iterator, Mapping, Sequence

import numpy as np
import torch

from .ir import (C_, COLL_KINDS as ir_kinds, COLLECTIVE_ADJOINT, G_, R_, S_, Buffer, Collective,
                 Compute, Family, GradCompute, Op, Program, ProgramTable, Recv, Send, _BUFS_OF,
                 ADJOINT_CODE, OWN_SLOT_IN_PLACE, RULES, ScheduleError, TILE_TOUCH_CODES, _FIELDS, _buf, marked,
                 buffer_of, program_from_ops, steps_of)


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
# every interned buffer of the input, gradient and output families (set operations on a
# collective's slots run in C)
_INPUT_BUFS, _GRADS, _OUTS = _BUFS_OF["input"], _BUFS_OF["gradient"], _BUFS_OF["out"]
_FAMILIES = tuple(Family)
_FAMILY_CODE = {f: n for n, f in enumerate(_FAMILIES)}
_F = len(_FAMILIES)
_TILES = frozenset({Compute, GradCompute})


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
_Q, _KV, _OUT, _DOUT = Family.Q, Family.KV, Family.OUT, Family.DOUT


@dataclasses.dataclass(frozen=True)
class Hop:
    """kv chunk ``chunk`` moves from rank ``src`` to rank ``dst`` during step ``step``."""

    step: int
    src: int
    dst: int


def _runs(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Values and start indices of the runs of equal values in a sorted array."""
    if len(x) == 0:
        return x, np.zeros(0, dtype=np.int64)
    starts = np.flatnonzero(np.concatenate(([True], x[1:] != x[:-1])))
    return x[starts], starts


def _spans(lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """The indices ``lo[0]..hi[0]-1, lo[1]..hi[1]-1, ...`` as one array."""
    n = hi - lo
    if not len(n):
        return np.zeros(0, np.int64)
    return np.repeat(lo - np.cumsum(n) + n, n) + np.arange(int(n.sum()))


def _uniq(x: np.ndarray) -> np.ndarray:
    """Sorted unique values (by sorting: numpy's hashing unique is slower on these keys)."""
    return _runs(np.sort(x))[0]


class HopTable(Mapping):
    """Hops of every kv chunk as parallel integer arrays: a compact ``{chunk: [Hop, ...]}``.

    It is a read-only mapping (``table[j]`` lists chunk j's hops as :class:`Hop` values), so
    it goes wherever a dict of hops does; :func:`lower` reads the arrays directly, which is
    what lets a full ring at P=1024 (a million hops) be lowered and pruned in well under a
    second.

    Args:
        chunk, step, src, dst: 1-D integer arrays of equal length, one entry per hop.
    """

    def __init__(self, chunk, step, src, dst) -> None:
        arrs = [np.asarray(a, dtype=np.int64).reshape(-1) for a in (chunk, step, src, dst)]
        if len({a.shape for a in arrs}) != 1:
            raise ValueError(f"HopTable arrays must have one length, got {[len(a) for a in arrs]}")
        self._arrays = arrs
        self._ring: int | None = None
        self._index: dict[int, np.ndarray] | None = None

    @classmethod
    def _of_ring(cls, world_size: int) -> HopTable:
        """The ring on P ranks (:func:`fringe.schedules.ring_hops`): chunk j moves j → j+1 →
        ... (mod P), one hop per step. :func:`lower` lowers it without the P(P-1) hop arrays,
        which are built only when read."""
        self = object.__new__(cls)
        self._arrays, self._ring, self._index = None, world_size, None
        return self

    def _cols(self) -> list[np.ndarray]:
        if self._arrays is None:
            P = self._ring
            j, s = np.divmod(np.arange(P * max(P - 1, 0), dtype=np.int64), max(P - 1, 1))
            self._arrays = [j, s, (j + s) % P, (j + s + 1) % P]
        return self._arrays

    chunk = property(lambda self: self._cols()[0])
    step = property(lambda self: self._cols()[1])
    src = property(lambda self: self._cols()[2])
    dst = property(lambda self: self._cols()[3])

    @classmethod
    def of(cls, hops: Mapping[int, Sequence[Hop]]) -> HopTable:
        """A table from ``{chunk: [Hop, ...]}`` (returned unchanged if already a table)."""
        if isinstance(hops, HopTable):
            return hops
        rows = [(j, h.step, h.src, h.dst) for j, hs in hops.items() for h in hs]
        arr = np.array(rows, dtype=np.int64).reshape(-1, 4)
        return cls(arr[:, 0], arr[:, 1], arr[:, 2], arr[:, 3])

    def _rows(self) -> dict[int, np.ndarray]:
        if self._index is None:
            order = np.argsort(self.chunk, kind="stable")
            chunks, starts = _runs(self.chunk[order])
            ends = list(starts[1:]) + [len(order)]
            self._index = {int(c): order[a:b] for c, a, b in zip(chunks, starts, ends)}
        return self._index

    def __getitem__(self, chunk: int) -> list[Hop]:
        rows = self._rows()[chunk]
        return [Hop(int(self.step[i]), int(self.src[i]), int(self.dst[i])) for i in rows]

    def __iter__(self) -> Iterator[int]:
        return iter(self._rows())

    def __len__(self) -> int:
        return len(self._rows())

    def __repr__(self) -> str:
        return f"HopTable({len(self.chunk)} hops, {len(self)} chunks)"


# ---------------------------------------------------------------------------------------
# lowering
# ---------------------------------------------------------------------------------------
def lower(world_size: int, hops: Mapping[int, Sequence[Hop]], *,
          need: torch.Tensor | None = None) -> list[Program]:
    """Programs that move each kv chunk along its hops and compute every tile on arrival.

    Args:
        world_size: P.
        hops: for each kv chunk j (owned by rank j), the hops it takes, forming a tree
            rooted at rank j (a dict of :class:`Hop` lists or a :class:`HopTable`).
        need: optional bool ``[P, P]`` tile map; when given, the result is
            ``prune(lower(P, hops), need)``, computed without building the unpruned programs.

    Returns:
        One program per rank: every (q_r, kv_j) tile that reaches rank r is computed at the
        first step kv_j is present there.

    Raises:
        ScheduleError: a hop names a rank outside ``[0, P)``, sends kv before it is there,
            or delivers it to a rank twice.
    """
    P = world_size
    tab = HopTable.of(hops)
    if need is None:
        use = np.ones((P, P), dtype=bool)
    else:
        use = _need_array(need, P).T.copy()              # use[j, r]: rank r computes with kv_j
    if tab._ring == P:          # the ring: chunk j goes as far as the farthest rank using it
        dist = (np.arange(P)[None, :] - np.arange(P)[:, None]) % P
        last = np.where(use, dist, 0).max(axis=1)
        j = np.repeat(np.arange(P), last)
        s = np.arange(len(j)) - np.repeat(np.cumsum(last) - last, last)
        src, dst = (j + s) % P, (j + s + 1) % P
        k = np.arange(len(j))
    else:
        sel = (tab.chunk >= 0) & (tab.chunk < P)
        j, s, src, dst = tab.chunk[sel], tab.step[sel], tab.src[sel], tab.dst[sel]
        dj, ds = np.diff(j), np.diff(s)
        if not ((dj > 0) | ((dj == 0) & (ds >= 0))).all():  # by chunk, then step, stable
            order = np.lexsort((np.arange(len(j)), s, j))
            j, s, src, dst = j[order], s[order], src[order], dst[order]
        _validate_hops(P, j, s, src, dst)
        keep = np.ones(len(j), dtype=bool) if need is None else _keep_hops(P, j, s, src, dst, use)
        k = np.nonzero(keep)[0]
    diag = np.nonzero(np.diagonal(use))[0]
    arrive = k[use[j[k], dst[k]]]
    # within a rank's step, ops go by emission key: the local tile (-1), then hop k's send,
    # receive and the tile computed on its arrival (key k); order = key + 1
    crank = np.concatenate([diag, dst[arrive]])
    comp = dict(rank=crank, step=np.concatenate([np.zeros(len(diag), np.int64), s[arrive] + 1]),
                kind=np.full(len(crank), C_, np.int64), q=crank,
                kv=np.concatenate([diag, j[arrive]]),
                order=np.concatenate([np.zeros(len(diag), np.int64), arrive + 1]))
    xfer = dict(step=s[k], src=src[k], dst=dst[k], fam=np.full(len(k), _FAMILY_CODE[Family.KV]),
                chunk=j[k], order=k + 1)
    return list(ProgramTable._of_parts(P, comp, xfer).programs())


def _validate_hops(P: int, j, s, src, dst) -> None:
    """Raise the first error the hops (sorted by chunk, then step) would hit, in that order."""
    n = len(j)
    out = (src < 0) | (src >= P) | (dst < 0) | (dst >= P)
    ok = ~out
    idx = np.arange(n)
    key = np.where(ok, j * P + dst, P * P)            # out-of-range hops: a spare cell
    first_at = np.full(P * P + 1, n, dtype=np.int64)  # [chunk * P + rank]: its first delivery
    _assign_min(first_at, key, idx)
    first = ok & (first_at[key] == idx)
    twice = ok & (~first | (dst == j))
    arrival = np.full(P * P, np.iinfo(np.int64).max, dtype=np.int64)    # [chunk * P + rank]
    arrival[np.arange(P) * (P + 1)] = 0
    fi = first & (dst != j)
    arrival[key[fi]] = s[fi] + 1
    early = ok & (arrival[np.where(ok, j * P + src, 0)] > s)
    bad = out | twice | early
    if not bad.any():
        return
    i = int(np.nonzero(bad)[0][0])
    hop, jj = Hop(int(s[i]), int(src[i]), int(dst[i])), int(j[i])
    if out[i]:
        rank = hop.src if not 0 <= hop.src < P else hop.dst
        raise ScheduleError(f"hop {hop} of kv{jj} names rank {rank}, outside [0, {P})")
    if early[i]:
        raise ScheduleError(f"kv{jj} is sent from rank {hop.src} at step {hop.step} before it is there")
    raise ScheduleError(f"kv{jj} reaches rank {hop.dst} twice (again at step {hop.step})")


def _by_step(s: np.ndarray, *, descending: bool = False) -> np.ndarray:
    """A stable argsort of step numbers (a radix sort when they fit 16 bits)."""
    if not len(s):
        return np.zeros(0, np.int64)
    lo, hi = int(s.min()), int(s.max())
    key = hi - s if descending else s - lo
    if hi - lo < 1 << 16:
        key = key.astype(np.uint16)
    return np.argsort(key, kind="stable")


def _keep_hops(P: int, j, s, src, dst, use, *, buffers: int | None = None) -> np.ndarray:
    """A hop is kept when its receiver, or anyone it forwards to later, computes with it.

    ``j``: the moved chunk (or, with ``buffers=n``, a buffer id in ``[0, n)``); ``use``: bool
    ``[chunk or buffer id, rank]``, the rank computes with it."""
    at_dst, at_src = j * P + dst, j * P + src
    return _keep_moves(at_dst, at_src, s, use.ravel()[at_dst], (P if buffers is None else buffers) * P)


def _keep_moves(at_dst, at_src, s, used, K: int) -> np.ndarray:
    """:func:`_keep_hops` on ``(buffer, rank)`` keys in ``[0, K)``: a move (at step ``s``, from
    key ``at_src`` to key ``at_dst``) is kept when its receiver computes with the buffer
    (``used``, per move) or has a kept move of it out, later."""
    keep = np.zeros(len(s), dtype=bool)
    live = np.zeros(K, dtype=bool)               # a kept move leaves the (buffer, rank) later
    by_step = _by_step(s, descending=True)
    _, starts = _runs(s[by_step])
    ends = list(starts[1:]) + [len(by_step)]
    for a, b in zip(starts.tolist(), ends):    # latest step first; one step at a time
        g = by_step[a:b]
        kg = used[g] | live[at_dst[g]]
        keep[g] = kg
        live[at_src[g[kg]]] = True
    return keep


def _need_array(need: torch.Tensor, P: int) -> np.ndarray:
    arr = (need.numpy() if isinstance(need, torch.Tensor) else np.asarray(need)).astype(bool)
    if arr.shape != (P, P):
        raise ValueError(f"need must be a bool [P, P] = [{P}, {P}] tile map, got shape "
                         f"{tuple(arr.shape)}")
    return arr


# ---------------------------------------------------------------------------------------
# pruning
# ---------------------------------------------------------------------------------------
@gc_paused()
def prune(programs: Sequence[Program], need: torch.Tensor) -> list[Program]:
    """Drop EMPTY tiles, and sends of a buffer past the last rank that needs it.

    Args:
        programs: forward programs, one per rank.
        need: bool ``[P, P]``; ``need[i, j]`` is True when tile (q_i, kv_j) is non-empty.

    Returns:
        Programs without computes of empty tiles, without transfers of an input buffer
        (q or kv) whose receiving subtree computes nothing with it, and without steps left
        with nothing to do. A collective's contributions are thinned by the same rule: one
        is kept when its receiver, or any rank the receiver forwards that buffer to (by a
        later collective or send), computes with it; a collective left moving nothing is
        dropped on every member. So a collective schedule may be written without the mask.
    """
    return _general_prune(_table(programs), _need_array(need, len(programs)))


# ---------------------------------------------------------------------------------------
# reverse: the backward program, derived by rule
# ---------------------------------------------------------------------------------------
KV_MODES = ("resend", "keep")


@gc_paused()
def reverse(programs: Sequence[Program], *, kv: str = "resend") -> list[Program]:
    """Derive the backward programs from forward ones.

    Rules (no schedule has a hand-written backward):

    * Steps run in reverse: forward step t becomes backward step ``T - t`` (T = number of
      forward rounds, plus as many prologue steps as re-materialising needs: a chain of
      collectives, each forwarding what the one before brought, re-issues them one step
      apart); the prologue steps only move inputs.
    * Every op is replaced by its ``adjoint()``: ``C qi·kvj`` becomes its VJP ``G qi·kvj``
      (dq_i accumulates locally, dkv_j into the gradient buffer that travels back with
      kv_j); a receive of ``kvj`` from p becomes a send of ``dkvj`` back to p (accumulated
      there), and a send becomes the matching receive. So gradients end on the rank that
      owns the data.
    * Forward inputs the adjoints read again and that a rank does not own are
      re-materialised. ``kv="resend"`` (default, O(L) memory): a buffer is re-sent along the
      reversed route to the ranks that need it again, one step before their first use (a
      forward hop at t is re-sent at backward step T-t-1); the last rank on the route (or
      one whose downstream cannot deliver in time) fetches it from the owner. ``kv="keep"``:
      ranks keep every buffer they computed with in the forward (more memory, no kv
      traffic in the backward).

    Raises:
        ScheduleError: the programs are not forward programs, or not valid (as
            :func:`check` names it), or an input (q, kv) arrives at a rank twice or at its
            owner (its gradient would go back twice), or a hop forwards a buffer before it
            arrives, or no number of prologue steps delivers the inputs in time.
        NotImplementedError: a rank computes with head slices of a buffer that arrived
            whole (its gradient would go back whole, though written in slices): the message
            says how to write it instead.
    """
    if kv not in KV_MODES:
        raise ValueError(f"kv must be one of {KV_MODES}, got {kv!r}")
    tab = _table(programs)
    fast = _reverse_parts(tab, kv) if tab.chain else None       # the ring chain's shortcut
    return fast if fast is not None else _general_reverse(tab, kv)


# ---------------------------------------------------------------------------------------
# checks
# ---------------------------------------------------------------------------------------
@gc_paused()
def check(programs: Sequence[Program], *, need: torch.Tensor | None = None,
          backward: bool = False, kv: str = "resend") -> None:
    """Structural checks, raising :class:`ScheduleError` with the rank and step.

    * programs are for ranks 0..P-1 in order; peers are valid and never the rank itself;
    * every send has its receive of the same buffer on the peer in the same step, and
      vice versa;
    * every member of a collective's group issues it, in the same step and order, of one
      kind, with its own slot alike on both sides; what one member sends another receives;
    * every buffer an op reads is present on that rank at the start of the step: owned
      (q, kv; and out, dout, dq, dkv in the backward), written or received at an earlier
      step, or, in the backward with ``kv="keep"``, kept from the forward;
    * with ``need``: every non-empty (q, kv) tile is computed exactly once across ranks
      and no empty tile is computed.

    It runs on the columns of the programs' one table and names the first fault: of the
    first rule broken, in the order above, the first in program order (lowest rank, then
    step, then op), with the message of the op-by-op rules
    (:func:`fringe.testing.oracle.check`). A message about a step ends with the rank's
    program and ``<-- ERROR HERE`` on that step. Columns no program can hold (a kind or
    family code out of range, a negative step, ...) are named by their table row.

    Raises:
        ScheduleError: the first fault, as above.
    """
    P = len(programs)
    for r, prog in enumerate(programs):
        if prog.rank != r:
            raise ScheduleError(f"program {r} is for rank {prog.rank}; pass programs in rank order")
    tab = _table(programs)
    arr = None if need is None else _need_array(need, P)
    flags = (backward, kv if backward else None)
    if flags in tab._passed:                     # its (read-only) columns passed these before:
        if arr is not None:                      # the tiles are what is new
            _table_tiles_ok(tab, arr)
        return
    fast = _parts_ok(tab, arr, backward, kv) if tab.chain else None   # the chain's shortcut
    if fast is not True:
        _general_ok(tab, arr, backward, kv)      # names the first fault
        if fast is False:
            raise RuntimeError("internal error: the ring chain's check rejected programs that "
                               "the general check accepts; please report it with the programs")
    tab._passed.add(flags)


def _table(programs: Sequence[Program]) -> ProgramTable:
    """The one table of ``programs`` (the table they were cut from, else built from their
    ops: :meth:`ProgramTable.of`, which names a transfer without its partner)."""
    return ProgramTable.of(programs)


#: Above this many (family, rank, chunk) cells the chain shortcuts leave a table to the
#: general passes (sorted keys instead of dense planes).
DENSE_CELLS = 1 << 26


def _assign_min(arr: np.ndarray, idx: np.ndarray, val: np.ndarray) -> None:
    """``arr[idx] = min(arr[idx], val)`` over repeated indices, by a plain assignment when
    that is already the minimum (checked), else by ``np.minimum.at``."""
    arr[idx] = np.minimum(arr[idx], val)
    if len(idx) and not (arr[idx] <= val).all():
        o = _by_step(val, descending=True)      # the smallest last: the last assignment wins
        arr[idx[o]] = np.minimum(arr[idx[o]], val[o])
        if not (arr[idx] <= val).all():
            np.minimum.at(arr, idx, val)


def _owned(backward: bool) -> list[int]:
    """Family codes of the buffers of its own chunk a rank holds from step 0: q and kv; in
    the backward also out, dout and the gradient accumulators dq, dkv."""
    fams = [Family.Q, Family.KV] + ([Family.OUT, Family.DOUT, Family.DQ, Family.DKV]
                                    if backward else [])
    return [_FAMILY_CODE[f] for f in fams]


def _parts_ok(tab: ProgramTable, need: np.ndarray | None, backward: bool, kv: str) -> bool | None:
    """The ring chain's shortcut of :func:`_general_ok` (a :attr:`~ProgramTable.chain`
    table: whole-heads computes and transfers, dense ``[rank, chunk]`` planes): True when
    every check passes, False when one fails (:func:`_general_ok` then names the fault),
    None when the table is too large for the dense arrays (the general check decides)."""
    P = tab.world_size
    comp, xfer = tab._parts[:2]
    if _F * P * P > DENSE_CELLS:
        return None
    cr, ct, ck, cq, ckv = comp["rank"], comp["step"], comp["kind"], comp["q"], comp["kv"]
    xt, xs, xd, xf, xc = xfer["step"], xfer["src"], xfer["dst"], xfer["fam"], xfer["chunk"]
    if not len(cr) and not len(xs):
        return need is None or not need.any()
    for lo, hi, col in ((0, P, cr), (0, P, cq), (0, P, ckv), (0, P, xs), (0, P, xd),
                        (0, P, xc), (0, _F, xf), (C_, G_ + 1, ck)):
        if len(col) and (int(col.min()) < lo or int(col.max()) >= hi):
            return False
    if (len(ct) and int(ct.min()) < 0) or (len(xt) and int(xt.min()) < 0) or (xs == xd).any():
        return False
    if comp["hi"].any() or xfer["hi"].any():     # whole heads are slice 0 of 0
        return False
    KV = _FAMILY_CODE[Family.KV]
    isg = ck == G_

    ranks = np.arange(P)
    writes = [(f, ranks, ranks, np.zeros(P, np.int64)) for f in _owned(backward)]
    side = (cq, ckv)
    writes += [(f, cr[m], side[sd][m], ct[m] + 1)
               for f, m, sd, _ in _tile_touches(ck, written=True)]
    if backward and kv == "keep":
        writes.append((KV, cr[isg], ckv[isg], np.zeros(int(isg.sum()), np.int64)))
    # one [rank, chunk] plane per family written (int32 steps), the others never present
    fams = sorted({f for f, r, _, _ in writes if len(r)}
                  | set(np.flatnonzero(np.bincount(xf, minlength=_F)).tolist()))
    plane = np.full(_F + 1, len(fams), dtype=np.int64)
    plane[fams] = np.arange(len(fams))
    if int(max(ct.max() if len(ct) else 0, xt.max() if len(xt) else 0)) + 1 >= 2 ** 31 - 1:
        return None
    never = np.iinfo(np.int32).max
    avail = np.full((len(fams) + 1) * P * P, never, dtype=np.int32)

    def cell(fam, r, chunk):
        return (plane[fam] * P + r) * P + chunk
    for f, r, chunk, t in writes:
        _assign_min(avail, cell(f, r, chunk), t)
    _assign_min(avail, cell(xf, xd, xc), xt + 1)
    avail[len(fams) * P * P:] = never            # the plane of families nothing writes
    reads = [(cell(f, cr[m], side[sd][m]), ct[m])
             for f, m, sd, _ in _tile_touches(ck, written=False)]
    reads.append((cell(xf, xs, xc), xt))
    for idx, t in reads:
        if not (avail[idx] <= t).all():
            return False
    if need is not None:
        count = np.bincount(cq * P + ckv, minlength=P * P).reshape(P, P)
        if not np.array_equal(count, need.astype(np.int64)):
            return False
    return True


def _reverse_parts(tab: ProgramTable, kv: str) -> list[Program] | None:
    """The ring chain's shortcut of :func:`_general_reverse` (a :attr:`~ProgramTable.chain`
    table of forward programs that move kv only, each rank computing its own queries, each
    kv chunk reaching a rank at most once and never its owner); None when the general
    reverse must decide (it also names what is wrong)."""
    P = tab.world_size
    comp, xfer = tab._parts[:2]
    KV = _FAMILY_CODE[Family.KV]
    cr, ct, ck, cq, ckv = comp["rank"], comp["step"], comp["kind"], comp["q"], comp["kv"]
    xt, xs, xd, xf, xc = xfer["step"], xfer["src"], xfer["dst"], xfer["fam"], xfer["chunk"]
    if P * P > DENSE_CELLS or (ck != C_).any() or (cq != cr).any() or (xf != KV).any():
        return None
    if not len(cr) and not len(xs):
        return list(ProgramTable._of_parts(P, comp, xfer).programs())
    if len(xs) and ((xc == xd).any() or np.bincount(xc * P + xd, minlength=P * P).max() > 1):
        return None                         # kv arriving twice: the general reverse names it
    T = max(int(ct.max()) if len(ct) else -1, int(xt.max()) if len(xt) else -1) + 1
    bcomp = dict(rank=cr, step=T - ct, kind=np.full(len(cr), ADJOINT_CODE[C_], np.int64), q=cq, kv=ckv,
                 order=comp["order"])
    bx = [dict(step=T - xt, src=xd, dst=xs, fam=np.full(len(xs), _FAMILY_CODE[Family.DKV]),
               chunk=xc, order=xfer["rorder"], rorder=xfer["order"])]
    if kv == "resend":
        after = 1 + max([int(x["order"].max()) for x in (comp, xfer) if len(x["order"])])
        try:
            extra = _resend_parts(P, T, cr, ct, ckv, xt, xs, xd, xc, xfer["order"], after)
        except (_Pad, _Late, _Unsent):
            return None                     # prologue steps, or what the general reverse names
        bx.append(dict(extra, rorder=extra["order"]))
    bxfer = {k: np.concatenate([x[k] for x in bx]) for k in bx[0]}
    return list(ProgramTable._of_parts(P, bcomp, bxfer).programs())


class _Pad(Exception):
    """The re-sends need ``by`` more prologue steps (a fetch would fall before step 0)."""

    def __init__(self, by: int) -> None:
        super().__init__(by)
        self.by = by


class _Unsent(Exception):
    """A rank reads a buffer it does not own and no hop brings."""


class _Late(Exception):
    """Hop ``hop`` sends a buffer on before hop ``arrival`` brings it to its sender."""

    def __init__(self, hop: int, arrival: int) -> None:
        super().__init__(hop, arrival)
        self.hop, self.arrival = hop, arrival


def _resend_parts(P, T, cr, ct, ckv, xt, xs, xd, xc, xorder, after, owner=None):
    """The backward's kv re-send on the hops themselves: the kv re-sends of the backward as
    transfers (orders from ``after`` on, in (chunk, rank) order: after every adjoint op).

    With ``owner`` (int array), ``ckv`` and ``xc`` are buffer ids ``[0, len(owner))`` instead
    of kv chunks, ``owner[id]`` the rank that owns the buffer's data; the rows' ``chunk`` is
    then the buffer id, and orders go by (id, rank).

    The caller has made sure that a rank receives a buffer at most once and never its own.
    Every rank that reads a buffer it does not own received it by that one hop, so the work
    is per hop (one entry each, in the forward's order), with ``[buffer, rank]`` arrays for
    lookups (dense, or over the keys that occur past :data:`PLANE_CELLS`); a route that is a
    chain in hop order (rings) settles who needs a buffer by a segmented prefix sum, any
    other tree by a pass in arrival order.

    Raises:
        _Pad: a fetch would fall before backward step 0 (so many more prologue steps).
        _Late: a hop sends a buffer on before the hop that brings it to its sender.
        _Unsent: a read of a buffer no hop brings (the caller names it).
    """
    NONE = np.int64(1) << 40
    own = np.arange(P) if owner is None else owner
    nb = len(own)
    rk0 = ckv * P + cr                              # (buffer, rank) of each read
    remote = own[ckv] != cr
    in0, out0 = xc * P + xd, xc * P + xs
    if nb * P <= PLANE_CELLS:
        K = nb * P

        def ix(k):
            return k
    else:                                           # the (buffer, rank) keys that occur
        space = _uniq(np.concatenate([in0, out0, rk0[remote]]))
        K = len(space) + 1                          # + a sink for keys that do not occur

        def ix(k):
            return _lookup(k, space, np.arange(len(space)), len(space))[0]
    in_key, out_key, rk = ix(in0), ix(out0), ix(rk0)
    n = len(xc)
    maxread = np.full(K, -1, np.int64)
    maxread[rk] = np.maximum(maxread[rk], ct)
    if len(rk) and not (maxread[rk] >= ct).all():
        np.maximum.at(maxread, rk, ct)
    hop_of = np.full(K, -1, np.int64)               # [buffer, rank]: the hop that brought it
    hop_of[in_key] = np.arange(n)
    if remote.any() and (hop_of[rk[remote]] < 0).any():
        raise _Unsent()
    if not n:
        return _no_xfer()
    # each (buffer, rank)'s latest hop onwards (first in program order among the latest)
    if n and np.bincount(out_key, minlength=K).max() > 1:
        o = np.lexsort((xorder, -xt, out_key))
        o = o[_runs(out_key[o])[1]]
    else:
        o = slice(None)
    sup_t = np.full(K, -1, np.int64)
    sup_d = np.full(K, -1, np.int64)
    sup_t[out_key[o]] = xt[o]
    sup_d[out_key[o]] = xd[o]
    reads = maxread[in_key]                         # per hop: the receiver's last read
    up = hop_of[out_key]                            # per hop: the hop that brought it to src
    # the receiver relays b up: its upstream's latest hop of b went to it, so it re-sends b
    relay_up = (up >= 0) & (sup_d[out_key] == xd)
    late = relay_up & (xt[np.maximum(up, 0)] >= xt)
    if late.any():
        i = int(np.flatnonzero(late)[0])
        raise _Late(i, int(up[i]))
    # a rank needs b when it reads it, or when it relays b up to a rank that needs it
    idx = np.arange(n)
    if (up[relay_up] == idx[relay_up] - 1).all():  # chains in hop order: segmented prefix OR
        seg = np.maximum.accumulate(np.where(relay_up, 0, idx))
        cs = np.cumsum(reads >= 0)
        defined = (cs - np.where(seg > 0, cs[seg - 1], 0)) > 0
    else:                                           # any tree: upstream ranks received b earlier
        defined = reads >= 0
        g = np.nonzero(relay_up)[0]
        g = g[_by_step(xt[g])]
        _, starts = _runs(xt[g])
        gu = up[g]
        for lo, hi in zip(starts.tolist(), starts[1:].tolist() + [len(g)]):
            defined[g[lo:hi]] |= defined[gu[lo:hi]]
    e = np.minimum(np.where(reads >= 0, T - reads, NONE),
                   np.where(relay_up & defined[np.maximum(up, 0)], T - xt - 1, NONE))
    emit = np.nonzero(e != NONE)[0]
    key, e = in_key[emit], e[emit]
    d = sup_d[key]
    c_ = xc[emit]
    dh = hop_of[ix(c_ * P + np.maximum(d, 0))]      # the hop that took b on from this rank
    relay = (d >= 0) & (T - sup_t[key] <= e) & (dh >= 0) & defined[np.maximum(dh, 0)]
    fetch = ~relay
    if (fetch & (e - 1 < 0)).any():
        raise _Pad(int((1 - e[fetch]).max()))
    frm = np.where(relay, d, own[c_])
    u = np.where(relay, T - sup_t[key] - 1, e - 1)
    return dict(step=u, src=frm, dst=xd[emit], fam=np.full(len(emit), _FAMILY_CODE[Family.KV]),
                chunk=c_, order=after + key)        # (buffer, rank) order, as the op rules emit


def _no_xfer():
    z = np.zeros(0, np.int64)
    return dict(step=z, src=z, dst=z, fam=z, chunk=z, order=z)


# ---------------------------------------------------------------------------------------
# the passes on a general table's parts (head slices and collectives: what the collective
# schedules build); None: the op-by-op rules decide
# ---------------------------------------------------------------------------------------
#: The largest dense (rank, buffer) plane the general passes allocate; past it presence,
#: re-sends and pruning work on sorted keys.
PLANE_CELLS = 1 << 27


_GENS: list = [None]     # inside shared_columns(): {(id(table), lenient): (table, fields)}


@contextlib.contextmanager
def shared_columns():
    """Inside, the passes derive a table's general columns (:class:`_Gen`) once and share
    them: a plan's check, prune and reverse read the same tables, some twice. A table's
    columns are read-only, so what is derived from them stays true; it is dropped on exit
    (the int64 copies are larger than the table). Nests."""
    if _GENS[0] is not None:
        yield
        return
    _GENS[0] = {}
    try:
        yield
    finally:
        _GENS[0] = None


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
        if cache is not None and key in cache:          # shared_columns()
            self.__dict__.update(cache[key][1])
            return
        P = self.P = tab.world_size
        comp, xfer, coll = tab._parts
        i64 = lambda d, ks: [np.asarray(d[k], dtype=np.int64) for k in ks]  # noqa: E731
        (self.cr, self.ct, self.ck, self.cq, self.ckv, self.co,
         self.chi, self.chn) = i64(comp, ("rank", "step", "kind", "q", "kv", "order", "hi", "hn"))
        (self.xt, self.xs, self.xd, self.xf, self.xc, self.xo, self.xro,
         self.xhi, self.xhn) = i64(xfer, ("step", "src", "dst", "fam", "chunk", "order", "rorder",
                                          "hi", "hn"))
        (self.kr, self.kt, self.ko, self.kk, self.kg) = i64(coll, ("rank", "step", "order",
                                                                   "kind", "group"))
        (self.ss, self.sdir, self.sidx, self.sf, self.sc, self.shi,
         self.shn) = i64(coll, ("slot_side", "slot_dir", "slot_idx", "slot_fam", "slot_chunk",
                                "slot_hi", "slot_hn"))
        self.groups = coll["groups"]
        self.glen = np.array([len(g) for g in self.groups] or [0], dtype=np.int64)
        self._valid(tab, lenient)
        self.ok = True                       # an invalid table raised in _valid
        self.chs, self.xhs, self.shs = (self.hs(h, n) if n.any() else np.zeros(len(n), np.int64)
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
        return np.where(hn == 0, 0, hn * (hn - 1) // 2 + hi + 1)

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
        return (fam * self.C + chunk) * self.HS + hs

    def rkey(self, rank, fam, chunk, hs):
        """A (rank, buffer) pair as one int."""
        return ((rank * _F + fam) * self.C + chunk) * self.HS + hs


def _unique(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Sorted distinct values of int array ``x`` and each entry's index among them: by
    marking the values that occur when they span at most a few times ``len(x)`` (no sort),
    else by a sort (numpy's hashed ``unique`` measured 1 s on a million keys)."""
    lo, hi = (int(x.min()), int(x.max())) if len(x) else (0, 0)
    if hi - lo <= 4 * len(x):
        used = np.zeros(hi - lo + 1, dtype=bool)
        at = x - lo
        used[at] = True
        return np.flatnonzero(used) + lo, (np.cumsum(used) - 1)[at]
    o = np.argsort(x, kind="stable")
    xs = x[o]
    new = np.ones(len(xs), dtype=bool)
    new[1:] = xs[1:] != xs[:-1]
    inv = np.empty(len(x), dtype=np.int64)
    inv[o] = np.cumsum(new) - 1
    return xs[new], inv


def _member(x: np.ndarray, sorted_keys: np.ndarray) -> np.ndarray:
    """``np.isin(x, sorted_keys)`` by binary search (``isin`` hashes: slow on int64)."""
    return _lookup(x, sorted_keys, sorted_keys, 0)[1]


def _min_by_key(keys: np.ndarray, vals: np.ndarray, reduce=np.minimum):
    """Sorted distinct keys and the ``reduce`` (min) of their values."""
    if not len(keys):
        return keys, vals
    o = np.argsort(keys, kind="stable")
    k, v = keys[o], vals[o]
    uk, starts = _runs(k)
    return uk, reduce.reduceat(v, starts)


def _lookup(keys: np.ndarray, table_keys: np.ndarray, values: np.ndarray, default: int):
    """``values`` at ``keys`` in sorted ``table_keys`` (``default`` where absent), hit mask."""
    if not len(table_keys):
        return np.full(len(keys), default, dtype=np.int64), np.zeros(len(keys), dtype=bool)
    lo, span = int(table_keys[0]), int(table_keys[-1]) - int(table_keys[0]) + 1
    if span <= len(keys) // 4:              # a dense table over the keys' span: no search
        where = np.full(span, -1, dtype=np.int64)
        where[table_keys - lo] = np.arange(len(table_keys))
        at = keys - lo
        at = where[np.where((at >= 0) & (at < span), at, 0)]
        hit = (at >= 0) & (table_keys[at] == keys)
        return np.where(hit, values[at], default), hit
    at = np.minimum(np.searchsorted(table_keys, keys), len(table_keys) - 1)
    hit = table_keys[at] == keys
    return np.where(hit, values[at], default), hit


def _outside(col: np.ndarray, lo: int, hi: int) -> np.ndarray | None:
    """Bool mask of the entries of ``col`` outside ``[lo, hi)``; None when there are none
    (decided by the column's min and max: no mask on the accept path)."""
    if not len(col) or (int(col.min()) >= lo and int(col.max()) < hi):
        return None
    return (col < lo) | (col >= hi)


def _row_keys(*cols: np.ndarray) -> np.ndarray:
    """One int64 key per row of the equal-length int columns ``cols``, equal for equal rows
    and increasing with the rows in lexicographic order: mixed radix where the spans fit in
    int64, else compact ids column by column (a sort each)."""
    n = len(cols[0])
    if not n:
        return np.zeros(0, np.int64)
    lo = [int(c.min()) for c in cols]
    span = [int(c.max()) - m + 1 for c, m in zip(cols, lo)]
    if np.prod([float(w) for w in span]) < 2.0 ** 62:
        key = cols[0] - lo[0]
        for c, m, w in zip(cols[1:], lo[1:], span[1:]):
            key = key * w + (c - m)
        return key
    key = _unique(cols[0])[1]
    for c in cols[1:]:
        cid = _unique(c)[1]
        key = _unique(key * (int(cid.max()) + 1) + cid)[1]
    return key


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


# ---- locating a fault: program order over the parts, and the op a row is in its view ----
def _where_cols(tab: ProgramTable, tie: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(rank, step, order) of the ops of one part: ``tie`` 0 computes, 1 sends (a transfer
    on its source), 2 receives (on its destination), 3 collective sides; within a rank's step
    ops go by (order, tie, row), as the program views list them."""
    comp, xfer, coll = tab._parts
    part, names = {0: (comp, ("rank", "step", "order")), 1: (xfer, ("src", "step", "order")),
                   2: (xfer, ("dst", "step", "rorder")),
                   3: (coll, ("rank", "step", "order"))}[tie]
    return tuple(np.asarray(part[k], dtype=np.int64) for k in names)


def _first_in_order(tab: ProgramTable, cands: list) -> tuple[int, int]:
    """The first in program order of candidate ops ``[(tie, rows, sub), ...]`` (``sub``:
    None, or each entry's place within its op, an int or an array): ``(k, j)``, entry j of
    ``cands[k]``."""
    keys = []
    for k, (tie, rows, sub) in enumerate(cands):
        rows = np.asarray(rows, dtype=np.int64)
        n = len(rows)
        r, t, o = (c[rows] for c in _where_cols(tab, tie))
        keys.append(np.stack([r, t, o, np.full(n, tie), rows,
                              np.broadcast_to(np.asarray(0 if sub is None else sub, np.int64), (n,)),
                              np.full(n, k), np.arange(n)]))
    a = np.concatenate(keys, axis=1)
    w = int(np.lexsort(a[5::-1])[0])         # by rank, step, order, tie, row, sub
    return int(a[6, w]), int(a[7, w])


def _located(tab: ProgramTable, tie: int, row: int) -> tuple[int, int, Op]:
    """``(rank, step, op)`` of row ``row`` of part ``tie`` (:func:`_where_cols`): the op
    object in its rank's program view (:meth:`ProgramTable.programs`)."""
    r, t, o = (int(c[row]) for c in _where_cols(tab, tie))
    before = 0
    for k, (order, bounds) in enumerate(tab._general_index()[0]):
        rows = order[bounds[r]:bounds[r + 1]]
        _, st, oo = (c[rows] for c in _where_cols(tab, k))
        here = st == t
        rows, oo = rows[here], oo[here]
        before += int(((oo < o) | ((oo == o) & ((k < tie) | ((k == tie) & (rows < row))))).sum())
    step = next(s for s in tab.programs()[r].steps if s.index == t)
    return r, t, step.ops[before]


def _fail(tab: ProgramTable, rank: int, step: int, what: str):
    raise ScheduleError(f"rank {rank}, step {step}: {what}\n{marked(tab.programs()[rank], step)}")


def _slot_buffer(tab: ProgramTable, side: int, direction: int, idx: int) -> Buffer | None:
    """The buffer of a collective side's slot (None: empty)."""
    coll = tab._parts[2]
    lo, hi = np.searchsorted(coll["slot_side"], [side, side + 1])
    for s in range(int(lo), int(hi)):
        if int(coll["slot_dir"][s]) == direction and int(coll["slot_idx"][s]) == idx:
            return buffer_of(*(int(coll[k][s]) for k in ("slot_fam", "slot_chunk", "slot_hi",
                                                          "slot_hn")))
    return None


def _general_ok(tab: ProgramTable, need: np.ndarray | None, backward: bool, kv: str) -> bool:
    """The structural checks of :func:`check` on a table's columns: True when every check
    passes, else a :class:`ScheduleError` naming the first fault as the op rules do."""
    g = _Gen(tab, lenient=True)          # the columns themselves, and transfer peers
    if len(g.kr):
        _collectives_ok(tab, g)
    _presence_ok(tab, g, backward, kv)
    if need is not None:
        _table_tiles_ok(tab, need)
    return True


def _collectives_ok(tab: ProgramTable, g: _Gen) -> None:
    """Every member issues each collective over its group once per (step, ordinal), of one
    kind, with its own slot alike on both sides, and what one member sends another receives.

    The first fault, as the op rules find it: the first side in program order that is not a
    member of its group, names a rank past ``P - 1`` or holds its own slot differently on the
    two sides; else of the (step, group) pairs in order of first issue, the first with a
    fault: unequal counts, else by ordinal a kind unlike the first member's, then a
    contribution without its receive (the lowest (sender, receiver) member pair).
    """
    P = g.P
    n_side = len(g.kr)
    b = g.bkey(g.sf, g.sc, g.shs)
    sme, sinst = g.me[g.ss], g.inst[g.ss]
    own = g.sidx == sme
    mine = [np.full(n_side, -1, np.int64) for _ in range(2)]
    for d in (0, 1):
        sel = own & (g.sdir == d)
        mine[d][g.ss[sel]] = b[sel]
    bad = (g.me < 0) | (g.gmax[g.kg] >= P) | (mine[0] != mine[1])
    if bad.any():
        rows = np.flatnonzero(bad)
        side = int(rows[_first_in_order(tab, [(3, rows, None)])[1]])
        r, t, op = _located(tab, 3, side)
        if g.me[side] < 0:
            _fail(tab, r, t, f"'{op}': rank {r} is not a member of its group")
        if g.gmax[g.kg[side]] >= P:
            _fail(tab, r, t, f"'{op}' names a rank outside [0, {P})")
        _fail(tab, r, t, f"'{op}': the slot of rank {r} itself must hold the same buffer on "
                         f"both sides (or '-')")
    n_inst = len(g.inst_keys)
    count = np.bincount(g.inst, minlength=n_inst)
    first = np.full(n_inst, -1, dtype=np.int64)
    first[g.inst[::-1]] = np.arange(n_side)[::-1]
    inst_g = g.kg[first]
    bad_count = count != g.glen[inst_g]
    kmin = np.full(n_inst, len(ir_kinds), np.int64)
    kmax = np.full(n_inst, -1, np.int64)
    np.minimum.at(kmin, g.inst, g.kk)
    np.maximum.at(kmax, g.inst, g.kk)
    bad_kind = kmin != kmax
    # contributions: (instance, sender, receiver, buffer) as sent and as received, own slots
    # aside (they move nothing)
    sent = ~own & (g.sdir == 0)
    got = ~own & (g.sdir == 1)
    if not (bad_count.any() or bad_kind.any()) and _slots_matched(
            g, inst_g, sent, got, b, sme, sinst):
        return                              # else the sorted keys below name the fault
    ns = int(sent.sum())
    keys = _row_keys(np.concatenate([sinst[sent], sinst[got]]),
                     np.concatenate([sme[sent], g.sidx[got]]),
                     np.concatenate([g.sidx[sent], sme[got]]),
                     np.concatenate([b[sent], b[got]]))
    k1, k2 = keys[:ns], keys[ns:]
    s1, s2 = np.sort(k1), np.sort(k2)
    bad_xfer = np.zeros(n_inst, dtype=bool)
    if not np.array_equal(s1, s2):
        bad_xfer[sinst[sent][~_member(k1, s2)]] = True
        bad_xfer[sinst[got][~_member(k2, s1)]] = True
    bad_inst = bad_count | bad_kind | bad_xfer
    if not bad_inst.any():
        return
    # the (step, group) pair first issued (program order of its first side) with a fault
    pos = np.empty(n_side, np.int64)
    pos[np.lexsort((np.arange(n_side), g.ko, g.kt, g.kr))] = np.arange(n_side)
    pair = _unique(_row_keys(g.kt[first], inst_g))[1]
    never = np.iinfo(np.int64).max
    pair_first = np.full(int(pair.max()) + 1, never, np.int64)
    np.minimum.at(pair_first, pair[g.inst], pos)
    pair_bad = np.zeros(len(pair_first), dtype=bool)
    pair_bad[pair[bad_inst]] = True
    p = int(np.argmin(np.where(pair_bad, pair_first, never)))
    insts = np.flatnonzero(pair == p)        # by ordinal (instance ids sort by it)
    t = int(g.kt[first[insts[0]]])
    group = g.groups[int(inst_g[insts[0]])]
    if bad_count[insts].any():
        cnt = np.bincount(g.me[pair[g.inst] == p], minlength=len(group))
        few, many = int(np.argmin(cnt)), int(np.argmax(cnt))
        _fail(tab, group[few], t, f"rank {group[few]} issues {cnt[few]} collective(s) over "
                                  f"group {list(group)} in this step but rank {group[many]} "
                                  f"issues {cnt[many]}; every member issues the same "
                                  f"collectives in the same order")
    i = int(insts[np.flatnonzero(bad_kind[insts] | bad_xfer[insts])[0]])    # by ordinal
    sides = np.flatnonzero(g.inst == i)
    by_me = sides[np.argsort(g.me[sides])]              # one side per member, in group order
    if bad_kind[i]:
        m = int(np.flatnonzero(g.kk[by_me] != g.kk[by_me[0]])[0])
        op0 = _located(tab, 3, int(by_me[0]))[2]
        r, _, op = _located(tab, 3, int(by_me[m]))
        _fail(tab, r, t, f"'{op}' is collective #{int(g.ordinal[by_me[0]])} over group "
                         f"{list(group)} here, but rank {group[0]} issues '{op0}'")
    a1, a2 = sent & (sinst == i), got & (sinst == i)   # the lowest (sender, receiver) unmatched
    pairs = np.concatenate([np.stack([sme[a1], g.sidx[a1]])[:, ~_member(k1[a1[sent]], s2)],
                            np.stack([g.sidx[a2], sme[a2]])[:, ~_member(k2[a2[got]], s1)]],
                           axis=1)
    a_i, b_i = (int(x) for x in pairs[:, np.lexsort(pairs[::-1])[0]])
    side_a, side_b = int(by_me[a_i]), int(by_me[b_i])
    given = _slot_buffer(tab, side_a, 0, b_i)
    taken = _slot_buffer(tab, side_b, 1, a_i)
    op_a = _located(tab, 3, side_a)[2]
    op_b = _located(tab, 3, side_b)[2]
    a, bb = group[a_i], group[b_i]
    _fail(tab, a, t, f"'{op_a}' sends {given or 'nothing'} to rank {bb}, but rank {bb}'s side "
                     f"'{op_b}' receives {taken or 'nothing'} from rank {a}")


#: The largest dense (collective side, member) table :func:`_slots_matched` allocates.
MATCH_CELLS = 1 << 24


def _slots_matched(g: _Gen, inst_g, sent, got, b, sme, sinst) -> bool:
    """Whether every contribution a collective side sends (slots ``sent``: not its own) is
    received by the member it names, as the same buffer ``b``, and nothing else is received
    (``got``), without sorting: each send looks up the one receive slot that must match it
    in a dense ``[side, member index]`` table (``inst_g``: each instance's group). Needs
    what :func:`_collectives_ok` established first: every member issues each instance once,
    and slots increase by (side, direction, index). False past :data:`MATCH_CELLS` cells
    too: the caller then compares sorted keys (which also name a fault)."""
    n_side, n_idx = len(g.kr), int(g.glen.max())
    if n_side * n_idx > MATCH_CELLS or int(sent.sum()) != int(got.sum()):
        return False
    off = np.concatenate([[0], np.cumsum(g.glen[inst_g])])       # instance -> its sides
    side_at = np.empty(n_side, dtype=np.int64)                    # (instance, member) -> side
    side_at[off[g.inst] + g.me] = np.arange(n_side)
    recv = np.full(n_side * n_idx, -1, dtype=np.int64)            # [side, sender] -> buffer
    recv[g.ss[got] * n_idx + g.sidx[got]] = b[got]
    peer = side_at[off[sinst[sent]] + g.sidx[sent]]
    return bool((recv[peer * n_idx + sme[sent]] == b[sent]).all())


def _presence_ok(tab: ProgramTable, g: _Gen, backward: bool, kv: str) -> None:
    """Every read finds its buffer (or the buffer's whole-heads parent) on its rank at the
    start of its step: owned (:func:`_owned`), kept (the backward's kv with ``kv="keep"``),
    or written or received at an earlier step. Raises the op rules' message for the first
    read in program order (the op's reads in the rule's order) that does not."""
    P = g.P
    KV = _FAMILY_CODE[Family.KV]
    isg = g.ck == G_
    ranks = np.arange(P)
    zero = np.zeros(P, np.int64)
    writes = [(ranks, f, ranks, zero, zero) for f in _owned(backward)]  # (rank, fam, chunk, hs, t)
    cr, ct, chs = g.cr, g.ct, g.chs
    side = (g.cq, g.ckv)
    writes += [(cr[m], f, side[sd][m], chs[m], ct[m] + 1)
               for f, m, sd, _ in _tile_touches(g.ck, written=True)]
    writes.append((g.xd, g.xf, g.xc, g.xhs, g.xt + 1))
    if backward and kv == "keep":
        writes.append((cr[isg], KV, g.ckv[isg], chs[isg], np.zeros(int(isg.sum()), np.int64)))
    srank, sstep = g.kr[g.ss], g.kt[g.ss]
    rs = g.sdir == 1
    writes.append((srank[rs], g.sf[rs], g.sc[rs], g.shs[rs], sstep[rs] + 1))
    # reads, each with where it is: (tie, rows of its part, place among its op's reads)
    reads, where = [], []
    for f, m, sd, n in _tile_touches(g.ck, written=False):
        reads.append((cr[m], f, side[sd][m], chs[m], ct[m]))
        where.append((0, m, n, sd))
    reads.append((g.xs, g.xf, g.xc, g.xhs, g.xt))
    where.append((1, slice(None), 0, None))
    if len(g.ss):
        # a side's send slots, but an own slot that stays in place (RULES), unless another
        # send slot of the side holds the same buffer
        sends = g.sdir == 0
        own = sends & (g.sidx == g.me[g.ss]) & np.array(OWN_SLOT_IN_PLACE)[g.kk[g.ss]]
        if own.any():
            b = g.bkey(g.sf, g.sc, g.shs)
            own_b = np.full(len(g.kr), -1, np.int64)
            own_b[g.ss[own]] = b[own]
            shared = np.zeros(len(g.kr), dtype=bool)
            shared[g.ss[sends & ~own & (b == own_b[g.ss])]] = True
            own &= ~shared[g.ss]
        sel = np.flatnonzero(sends & ~own)
        reads.append((srank[sel], g.sf[sel], g.sc[sel], g.shs[sel], sstep[sel]))
        where.append((3, sel, g.sidx[sel], None))
    late = _late_reads(P, g.C, g.HS, writes, reads)
    if late is None:
        return
    cands, entries = [], []
    for k, lm in enumerate(late):
        if lm is None:
            continue
        tie, m, sub, sd = where[k]
        j = np.flatnonzero(lm)
        if tie == 0:
            rows = (np.flatnonzero(m) if isinstance(m, np.ndarray) else np.arange(len(g.cr)))[j]
        elif tie == 1:
            rows = j
        else:
            rows = g.ss[m[j]]
            sub = sub[j]
        cands.append((tie, rows, sub))
        entries.append((k, j))
    c, e = _first_in_order(tab, cands)
    tie, row = cands[c][0], int(cands[c][1][e])
    k, j = entries[c]
    r, t, op = _located(tab, tie, row)
    comp, xfer, coll = tab._parts
    if tie == 0:
        f, sd = reads[k][1], where[k][3]
        buf = buffer_of(f, int(comp[("q", "kv")[sd]][row]), int(comp["hi"][row]),
                        int(comp["hn"][row]))
    elif tie == 1:
        buf = buffer_of(*(int(xfer[x][row]) for x in ("fam", "chunk", "hi", "hn")))
    else:
        s = int(where[k][1][j[e]])
        buf = buffer_of(*(int(coll[x][s]) for x in ("slot_fam", "slot_chunk", "slot_hi",
                                                     "slot_hn")))
    verb = "sends" if tie == 1 else "needs"
    _fail(tab, r, t, f"'{op}' {verb} {buf}, which is not on rank {r} yet")


def _by_family(entries) -> dict:
    """``(rank, fam, chunk, hs, t)`` column tuples (``fam`` an int or a column) split by
    family: ``{fam: [(k, sel, rank, chunk, hs, t), ...]}``, ``k`` the entry's index and
    ``sel`` the rows of that family (None: all)."""
    out = collections.defaultdict(list)
    for k, (r, f, ch, hs, t) in enumerate(entries):
        if not len(r):
            continue
        if isinstance(f, (int, np.integer)):
            out[int(f)].append((k, None, r, ch, hs, t))
            continue
        fvs = np.flatnonzero(np.bincount(f, minlength=_F)).tolist()
        if len(fvs) == 1:                   # one family: the columns as they are
            out[fvs[0]].append((k, None, r, ch, hs, t))
            continue
        for fv in fvs:
            sel = np.flatnonzero(f == fv)
            out[fv].append((k, sel, r[sel], ch[sel], hs[sel], t[sel]))
    return out


def _late_reads(P: int, C: int, HS: int, writes: list, reads: list) -> list | None:
    """Which reads ``(rank, fam, chunk, hs, t)`` find neither their buffer nor its
    whole-heads parent (``hs`` 0) written at a step <= t on that rank: None when every read
    does, else per entry of ``reads`` a bool mask of its late reads (None: none)."""
    w_by, r_by = _by_family(writes), _by_family(reads)
    out = None
    for fam, rs in r_by.items():
        at = _write_steps(P, C, HS, [w[2:] for w in w_by.get(fam, [])], [x[2:] for x in rs])
        for k, sel, r, ch, hs, t in rs:
            late = at(r, ch, hs) > t
            if not late.any():
                continue
            li = np.flatnonzero(late)
            li = li[at(r[li], ch[li], np.zeros(len(li), np.int64)) > t[li]]
            if not len(li):
                continue
            if out is None:
                out = [None] * len(reads)
            if out[k] is None:
                out[k] = np.zeros(len(reads[k][0]), dtype=bool)
            out[k][li if sel is None else sel[li]] = True
    return out


def _write_steps(P: int, C: int, HS: int, ws: list, rs: list):
    """``at(rank, chunk, hs)``: the earliest step buffers of one family are written on a
    rank (int64 max: never), from writes ``ws`` ``[(rank, chunk, hs, t), ...]``; ``rs``, the
    reads' ``(rank, chunk, hs, t)``, say which buffers are asked for. A dense ``[rank,
    buffer]`` plane over the buffers that occur (no sort of the millions of compute reads),
    or sorted keys past :data:`PLANE_CELLS`."""
    never = np.iinfo(np.int64).max
    if C * HS <= PLANE_CELLS:
        used = np.zeros(C * HS, dtype=bool)          # (chunk, hs) buffers of this family
        for _, ch, hs, _ in itertools.chain(ws, rs):
            used[ch * HS + hs] = True
        for _, ch, _, _ in rs:                       # the parents of what is read
            used[ch * HS] = True
        ids = np.cumsum(used) - 1
        n = int(ids[-1]) + 1 if len(ids) else 0
        if P * n <= PLANE_CELLS:
            avail = np.full(P * n, never, dtype=np.int64)
            for r, ch, hs, t in ws:
                _assign_min(avail, r * n + ids[ch * HS + hs], t)
            return lambda r, ch, hs: avail[r * n + ids[ch * HS + hs]]
    codes = ([ch * HS + hs for _, ch, hs, _ in itertools.chain(ws, rs)]
             + [ch * HS for _, ch, _, _ in rs])
    ub = _uniq(np.concatenate(codes)) if codes else np.zeros(0, np.int64)

    def key(r, ch, hs):
        return r * len(ub) + np.searchsorted(ub, ch * HS + hs)
    if not ws:
        return lambda r, ch, hs: np.full(len(r), never, dtype=np.int64)
    wk, wv = _min_by_key(np.concatenate([key(r, ch, hs) for r, ch, hs, _ in ws]),
                         np.concatenate([t for *_, t in ws]))
    return lambda r, ch, hs: _lookup(key(r, ch, hs), wk, wv, never)[0]


def _table_tiles_ok(tab: ProgramTable, need: np.ndarray) -> bool:
    """Every non-empty tile of ``need`` computed exactly once (whole heads once, or each
    head slice of one split once) and no empty tile computed, from the table's computes;
    else the op rules' :class:`ScheduleError` for the first bad tile (row-major), listing
    its computes in program order."""
    comp = tab._parts[0]
    cq, ckv, chi, chn = (np.asarray(comp[k], dtype=np.int64) for k in ("q", "kv", "hi", "hn"))
    P = len(need)
    if len(cq) and (min(int(cq.min()), int(ckv.min())) < 0
                    or max(int(cq.max()), int(ckv.max())) >= P):
        raise ScheduleError(f"a compute names a chunk outside [0, {P})")
    bad = _tile_counts(P, cq, ckv, chi, chn) != need.astype(np.int64).ravel()
    if not bad.any():
        return True
    i, j = divmod(int(np.flatnonzero(bad)[0]), P)
    rows = np.flatnonzero((cq == i) & (ckv == j))
    r, t, o = (c[rows] for c in _where_cols(tab, 0))
    rows = rows[np.lexsort((rows, o, t, r))]
    where = [f"rank {int(comp['rank'][x])} step {int(comp['step'][x])}"
             + ("" if not chn[x] else f" (h{int(chi[x])}/{int(chn[x])})") for x in rows.tolist()]
    n = len(where)
    what = ("is never computed" if n == 0 and need[i, j] else
            f"is computed {n} times ({', '.join(where)})" if need[i, j] else
            f"is empty but computed at {', '.join(where)}")
    raise ScheduleError(f"tile q{i}·kv{j} {what}; every non-empty tile must be computed "
                        f"exactly once (all heads at once, or each head slice of one split once)")


def _tile_counts(P: int, cq: np.ndarray, ckv: np.ndarray, chi: np.ndarray,
                 chn: np.ndarray) -> np.ndarray:
    """Per tile (row-major ``[P * P]``): 1 when it is computed exactly once (whole heads
    once, or each head slice of one split once), 0 when never, else another count."""
    whole = chn == 0
    count = np.bincount(cq[whole] * P + ckv[whole], minlength=P * P)
    sl = ~whole
    if sl.any():
        key, hi, hn = cq[sl] * P + ckv[sl], chi[sl], chn[sl]
        span = int(hi.max()) + 1
        o = np.argsort(key * span + hi)
        key, hi, hn = key[o], hi[o], hn[o]
        uk, starts = _runs(key)
        n = np.diff(np.append(starts, len(key)))
        pos = np.arange(len(key)) - np.repeat(starts, n)
        good = (hi == pos) & (hn == np.repeat(hn[starts], n))
        cover = np.logical_and.reduceat(good, starts) & (n == hn[starts])
        count[uk] += np.where(cover, 1, 2)
    return count


def _gen(tab: ProgramTable) -> _Gen:
    """The :class:`_Gen` of a table that reverse and prune can take: an invalid table (a
    column out of range, a collective side whose rank is not in its group) raises the
    :class:`ScheduleError` that :func:`check` names it with."""
    g = _Gen(tab)
    if not g.ok or (len(g.kr) and (g.me < 0).any()):
        check(list(tab.programs()))         # names the first bad op
        raise ScheduleError("invalid programs, though fringe.schedules.check names no fault in "
                            "them: please report it with the programs")
    return g


def _step_of(prog: Program, t: int):
    return next(s for s in prog.steps if s.index == t)


def _not_forward(tab: ProgramTable, g: _Gen, grads: list) -> None:
    """Raise for the first op (rank, then step, then op order) that is not a forward op: a
    gradient compute, a moved gradient, a collective that touches gradients."""
    cand = [(g.cr[g.ck != C_], g.ct[g.ck != C_])]
    gx = np.isin(g.xf, grads)
    cand += [(g.xs[gx], g.xt[gx]), (g.xd[gx], g.xt[gx])]
    gs = g.ss[np.isin(g.sf, grads)]
    cand.append((g.kr[gs], g.kt[gs]))
    r, t = min((int(r), int(t)) for rs, ts in cand if len(rs)
               for r, t in [min(zip(rs.tolist(), ts.tolist()))])
    prog = tab.programs()[r]

    def gradient(op) -> bool:
        if isinstance(op, (Send, Recv)):
            return op.buf.family.is_gradient
        if isinstance(op, Collective):
            return any(b.family.is_gradient for b in (*op.reads(), *op.writes()))
        return isinstance(op, GradCompute)
    op = next(op for op in _step_of(prog, t).ops if gradient(op))
    raise ScheduleError(f"rank {r}, step {t}: reverse takes forward programs; found {op}\n"
                        f"{marked(prog, t)}")


def _arrive_once(tab: ProgramTable, g: _Gen, brought: np.ndarray) -> None:
    """Every input buffer (q, kv) arrives at a rank at most once, and never at its owner,
    whether by a hop or a collective (``brought``: the slots that bring one). The backward
    returns a buffer's gradient along every route it came by, so a second arrival would
    return it twice; :func:`lower` refuses such hops too. Raises naming the first such
    arrival (by rank, then step)."""
    P = g.P
    inputs = [_FAMILY_CODE[f] for f in _INPUTS]
    h = np.isin(g.xf, inputs)
    ss = g.ss[brought]
    r = np.concatenate([g.xd[h], g.kr[ss]])
    if not len(r):
        return
    f = np.concatenate([g.xf[h], g.sf[brought]])
    c = np.concatenate([g.xc[h], g.sc[brought]])
    hs = np.concatenate([g.xhs[h], g.shs[brought]])
    t = np.concatenate([g.xt[h], g.kt[ss]])
    b = g.bkey(f, c, hs)
    used = np.zeros(_F * P * g.HS, dtype=bool)
    used[b] = True
    ids = np.cumsum(used) - 1
    n = int(ids[-1]) + 1
    key = r * n + ids[b]
    again = c == r                          # at its owner
    if P * n <= PLANE_CELLS:                # distinct cells fewer than arrivals
        seen = np.zeros(P * n, dtype=bool)
        seen[key] = True
        twice = int(np.count_nonzero(seen)) < len(key)
    else:
        ks = np.sort(key)
        twice = bool((ks[1:] == ks[:-1]).any())
    if twice:                               # the later arrivals of each (rank, buffer)
        o = np.lexsort((t, key))
        dup = np.zeros(len(key), dtype=bool)
        dup[o[1:]] = key[o[1:]] == key[o[:-1]]
        again |= dup
    if not again.any():
        return
    i = min(np.flatnonzero(again).tolist(), key=lambda i: (int(r[i]), int(t[i])))
    hi = np.concatenate([g.xhi[h], g.shi[brought]])[i]
    hn = np.concatenate([g.xhn[h], g.shn[brought]])[i]
    buf = Buffer.of(_FAMILIES[int(f[i])], int(c[i]), None if hn == 0 else (int(hi), int(hn)))
    rank, step = int(r[i]), int(t[i])
    if c[i] == r[i]:
        what = f"{buf} arrives at rank {rank}, which owns it"
    else:
        first = int(t[(key == key[i]) & ~again].min(initial=step))
        what = f"{buf} arrives at rank {rank} again (it arrived at step {first})"
    raise ScheduleError(
        f"rank {rank}, step {step}: {what}; a rank receives each input at most once (reverse "
        f"returns the gradient along every route a buffer came by, so it would return it "
        f"twice): drop the second arrival\n{marked(tab.programs()[rank], step)}")


def _late(tab: ProgramTable, hop: int, arrival: int) -> None:
    """Raise for transfer row ``hop``, which sends a buffer on before transfer row
    ``arrival`` brings it to its sender."""
    x = tab._parts[1]
    src, dst, t = (int(x[k][hop]) for k in ("src", "dst", "step"))
    hn, hi = int(x["hn"][hop]), int(x["hi"][hop])
    buf = Buffer.of(_FAMILIES[int(x["fam"][hop])], int(x["chunk"][hop]),
                    None if hn == 0 else (hi, hn))
    raise ScheduleError(
        f"rank {src}, step {t}: sends {buf} on to rank {dst}, but {buf} arrives at rank {src} "
        f"only at step {int(x['step'][arrival])} (from rank {int(x['src'][arrival])}); a route "
        f"forwards a buffer after it arrives\n{marked(tab.programs()[src], t)}")


def _more(pad: int, by: int, T0: int) -> int:
    """``pad + by`` prologue steps beyond the first, within the op rules' bound."""
    if pad + by > 2 * T0 + 2:
        raise ScheduleError(f"reverse: re-materialising the inputs would need {pad + by + 1} "
                            f"prologue steps before a {T0}-step backward; no number of prologue "
                            f"steps delivers them")
    return pad + by


def _general_reverse(tab: ProgramTable, kv: str, pad: int = 0) -> list[Program]:
    """:func:`reverse` on a table's parts (the rules of :mod:`fringe.testing.oracle`, the
    same programs). ``pad``: prologue steps beyond the first (a chain of re-issued
    collectives, or a fetch that would fall before step 0, needs them)."""
    g = _gen(tab)
    P = g.P
    grads = [_FAMILY_CODE[f] for f in _FAMILIES if f.is_gradient]
    if (g.ck != C_).any() or np.isin(g.xf, grads).any() or np.isin(g.sf, grads).any():
        _not_forward(tab, g, grads)
    Q, KV, OUT = (_FAMILY_CODE[f] for f in (_Q, _KV, _OUT))
    T0 = 1 + max([int(x.max()) for x in (g.ct, g.xt, g.kt) if len(x)] or [-1])
    T = T0 + pad
    cot = np.array([_FAMILY_CODE[f.cotangent] if f is not Family.ACC else -1 for f in _FAMILIES])
    # adjoints, at twice the forward order (+1: an op that goes with its adjoint)
    bcomp = dict(rank=g.cr, step=T - g.ct, kind=np.full(len(g.cr), ADJOINT_CODE[C_]), q=g.cq, kv=g.ckv,
                 order=2 * g.co, hi=g.chi, hn=g.chn)
    xs = [dict(step=T - g.xt, src=g.xd, dst=g.xs, fam=cot[g.xf], chunk=g.xc, order=2 * g.xro,
               rorder=2 * g.xo, hi=g.xhi, hn=g.xhn)]
    o_ = g.xf == OUT                        # the merged (out, lse) goes with its cotangent
    if o_.any():
        xs.append(dict(step=T - g.xt[o_], src=g.xd[o_], dst=g.xs[o_], fam=g.xf[o_],
                       chunk=g.xc[o_], order=2 * g.xro[o_] + 1, rorder=2 * g.xo[o_] + 1,
                       hi=g.xhi[o_], hn=g.xhn[o_]))
    adj = np.array([ir_kinds.index(COLLECTIVE_ADJOINT[k]) for k in ir_kinds])
    n_side = len(g.kr)
    sides = [dict(rank=g.kr, step=T - g.kt, order=2 * g.ko, kind=adj[g.kk], group=g.kg)]
    slots = [dict(slot_side=g.ss, slot_dir=1 - g.sdir, slot_idx=g.sidx, slot_fam=cot[g.sf],
                  slot_chunk=g.sc, slot_hi=g.shi, slot_hn=g.shn)]
    touch_out = np.zeros(n_side, dtype=bool)
    touch_out[g.ss[g.sf == OUT]] = True
    if touch_out.any():                     # outputs move back with their cotangents
        tsides = np.flatnonzero(touch_out)
        new_id = np.full(n_side, -1, np.int64)
        new_id[tsides] = n_side + np.arange(len(tsides))
        sel = touch_out[g.ss]
        sides.append(dict(rank=g.kr[tsides], step=T - g.kt[tsides], order=2 * g.ko[tsides] + 1,
                          kind=adj[g.kk[tsides]], group=g.kg[tsides]))
        slots.append(dict(slot_side=new_id[g.ss[sel]], slot_dir=1 - g.sdir[sel],
                          slot_idx=g.sidx[sel], slot_fam=g.sf[sel], slot_chunk=g.sc[sel],
                          slot_hi=g.shi[sel], slot_hn=g.shn[sel]))
    n_next = n_side + int(touch_out.sum())
    # reads_at: the last forward step each rank's computes read each input buffer
    c_reads = [(f, sd) for f, sd, w in TILE_TOUCH_CODES[C_] if not w]   # (only C rows here)
    rd_k = np.concatenate([g.rkey(g.cr, f, (g.cq, g.ckv)[sd], g.chs) for f, sd in c_reads])
    rd_t = np.concatenate([g.ct] * len(c_reads))
    ra_k, ra_t = _min_by_key(rd_k, rd_t, np.maximum)
    # what each collective brought: input buffers received from other members
    srank = g.kr[g.ss]
    inp = np.isin(g.sf, [f for f, _ in c_reads])
    own = (g.sidx == g.me[g.ss]) & np.array(OWN_SLOT_IN_PLACE)[g.kk[g.ss]]
    recv = g.sdir == 1
    # (an own slot whose buffer another slot of the side also receives is received through
    # that slot: the same buffers either way)
    brought_sel = recv & inp & ~own
    bk = g.rkey(srank[brought_sel], g.sf[brought_sel], g.sc[brought_sel], g.shs[brought_sel])
    b_inst = g.inst[g.ss[brought_sel]]
    _arrive_once(tab, g, brought_sel)
    ob = np.argsort(bk, kind="stable")
    brought_k, brought_i = bk[ob], b_inst[ob]
    n_inst = len(g.inst_keys)
    last, hit = _lookup(bk, ra_k, ra_t, -1)
    latest = np.full(n_inst, -1, np.int64)
    np.maximum.at(latest, b_inst, np.where(hit, last, -1))
    has_q = np.zeros(n_inst, dtype=bool)
    has_q[b_inst[g.sf[brought_sel] == Q]] = True
    when = {}
    for i in np.flatnonzero(latest >= 0).tolist():
        if not (kv == "keep" and not has_q[i]):
            when[i] = T - int(latest[i]) - 1
    inst_t = np.zeros(n_inst, np.int64)
    inst_g = np.zeros(n_inst, np.int64)
    inst_ord = np.zeros(n_inst, np.int64)
    inst_t[g.inst], inst_g[g.inst], inst_ord[g.inst] = g.kt, g.kg, g.ordinal
    if when:
        sends = g.sdir == 0
        s_inst = g.inst[g.ss[sends]]
        s_key = g.rkey(srank[sends], g.sf[sends], g.sc[sends], g.shs[sends])
        so = np.argsort(s_inst, kind="stable")
        s_inst, s_key = s_inst[so], s_key[so]
        bounds = np.searchsorted(s_inst, np.arange(n_inst + 1))
        for i in sorted(range(n_inst), key=lambda i: -inst_t[i]):      # latest first
            if i not in when:
                continue
            keys = s_key[bounds[i]:bounds[i + 1]]
            dep, dh = _lookup(keys, brought_k, brought_i, -1)
            for d in np.unique(dep[dh]).tolist():
                when[d] = min(when.get(d, when[i] - 1), when[i] - 1)
    if when and min(when.values()) < 0:      # a chain: as many more prologue steps
        return _general_reverse(tab, kv, _more(pad, -min(when.values()), T0))
    base = 2 * (1 + max([int(x.max()) for x in (g.co, g.xo, g.xro, g.ko) if len(x)] or [0]))
    side_bounds = np.searchsorted(g.ss, np.arange(n_side + 1))
    by_inst = np.argsort(g.inst, kind="stable")
    inst_bounds = np.searchsorted(g.inst[by_inst], np.arange(n_inst + 1))
    emitted = sorted(when, key=lambda i: (int(inst_t[i]), g.groups[int(inst_g[i])], int(inst_ord[i])))
    if emitted:                             # each emitted instance's sides, then their slots
        em = np.array(emitted, dtype=np.int64)
        u_of = np.array([when[i] for i in emitted], dtype=np.int64)
        n_of = np.repeat(np.arange(len(em)), inst_bounds[em + 1] - inst_bounds[em])
        side = by_inst[_spans(inst_bounds[em], inst_bounds[em + 1])]
        sides.append(dict(rank=g.kr[side], step=u_of[n_of], order=base + n_of, kind=g.kk[side],
                          group=g.kg[side]))
        at = _spans(side_bounds[side], side_bounds[side + 1])
        new = np.repeat(n_next + np.arange(len(side)), side_bounds[side + 1] - side_bounds[side])
        slots.append(dict(slot_side=new, slot_dir=g.sdir[at], slot_idx=g.sidx[at],
                          slot_fam=g.sf[at], slot_chunk=g.sc[at], slot_hi=g.shi[at],
                          slot_hn=g.shn[at]))
    # re-sends of inputs the backward reads again, along the reversed routes
    fams = [Q, KV] if kv == "resend" else [Q]
    reads = _remote_reads(g, brought_k)
    _reads_arrive(tab, g, reads)
    try:
        extra = _general_resend(g, T, fams, reads, base + len(emitted))
    except _Pad as e:                       # a fetch before step 0: as many more prologue steps
        return _general_reverse(tab, kv, _more(pad, e.by, T0))
    except _Late as e:
        _late(tab, e.hop, e.arrival)
    xs.append(extra)
    bxfer = {k: np.concatenate([x[k] for x in xs]) for k in xs[0]}
    bcoll = {k: np.concatenate([x[k] for x in sides]) for k in sides[0]}
    sl = {k: np.concatenate([x[k] for x in slots]) for k in slots[0]}
    n_idx = int(g.glen.max()) + 1
    o = np.argsort((sl["slot_side"] * 2 + sl["slot_dir"]) * n_idx + sl["slot_idx"])
    bcoll.update({k: v[o] for k, v in sl.items()})
    bcoll["groups"] = g.groups
    return list(ProgramTable._of_parts(P, bcomp, bxfer, bcoll).programs())


def _remote_reads(g: _Gen, skip: np.ndarray) -> tuple[np.ndarray, ...]:
    """Reads of input buffers (q, kv) by computes on ranks that do not own them, less what a
    re-issued collective delivers (``skip``: sorted (rank, buffer) keys): ``(rank, step,
    buffer code, position in program order: rank, step, order, q before kv)``."""
    P = g.P
    NBC = _F * P * g.HS                       # buffer codes (family, chunk, head slice)
    big = np.int64(1) << 20
    pos = ((g.cr * big + g.ct) * big + g.co) * 2
    side = (g.cq, g.ckv)
    c_reads = [(fam, side[sd]) for fam, sd, w in TILE_TOUCH_CODES[C_] if not w]
    reads = [(g.cr[m], g.ct[m], g.bkey(fam, ch[m], g.chs[m]), pos[m] + part)
             for part, (fam, ch) in enumerate(c_reads) for m in [ch != g.cr]]
    rr, rt, rb, rp = ([np.concatenate(c) for c in zip(*reads)] if reads else
                      [np.zeros(0, np.int64)] * 4)
    if len(skip) and len(rr):               # reads of what a re-issued collective delivers
        skip_r, skip_b = skip // NBC, skip % NBC
        used = np.zeros(NBC, dtype=bool)    # compact ids over the buffers involved
        used[rb] = True
        used[skip_b] = True
        id_of = np.cumsum(used) - 1
        n = int(id_of[-1]) + 1
        if P * n <= PLANE_CELLS:            # a (rank, id) plane
            by_coll = np.zeros(P * n, dtype=bool)
            by_coll[skip_r * n + id_of[skip_b]] = True
            keep = ~by_coll[rr * n + id_of[rb]]
        else:                               # sorted keys
            keep = ~_member(rr * NBC + rb, skip)
        rr, rt, rb, rp = rr[keep], rt[keep], rb[keep], rp[keep]
    return rr, rt, rb, rp


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


def _reads_arrive(tab: ProgramTable, g: _Gen, reads: tuple) -> None:
    """Every remote read (:func:`_remote_reads`) is of a buffer a hop brought to that rank as
    such. Else, in program order, the first other: an invalid forward (check names it), or a
    head slice read where its whole buffer arrived, which the rules cannot reverse (the
    gradient goes back the way the buffer came, whole, and is written in slices)."""
    P = g.P
    rr, rt, rb, rp = reads
    if not len(rr):
        return
    NBC = _F * P * g.HS
    h = np.isin(g.xf, [_FAMILY_CODE[f] for f in _INPUTS])
    xb, xd = g.bkey(g.xf[h], g.xc[h], g.xhs[h]), g.xd[h]
    used = np.zeros(NBC, dtype=bool)
    used[rb] = True
    used[xb] = True
    ids = np.cumsum(used) - 1
    n = int(ids[-1]) + 1
    if P * n <= PLANE_CELLS:
        plane = np.zeros(P * n, dtype=bool)
        plane[xd * n + ids[xb]] = True
        bad = ~plane[rr * n + ids[rb]]
    else:
        bad = ~_member(rr * NBC + rb, _uniq(xd * NBC + xb))
    if not bad.any():
        return
    i = np.flatnonzero(bad)[int(np.argmin(rp[bad]))]
    r, t, code = int(rr[i]), int(rt[i]), int(rb[i])
    hi, hn = (int(x[0]) for x in _slices(np.array([code % g.HS])))
    buf = Buffer.of(_FAMILIES[code // g.HS // P], code // g.HS % P, (hi, hn) if hn else None)
    check(list(tab.programs()))             # an invalid forward: check names the read
    prog = tab.programs()[r]
    op = next(op for op in _step_of(prog, t).ops if buf in op.reads())
    if buf.heads is None:
        raise ScheduleError(f"rank {r}, step {t}: '{op}' reads {buf}, which no hop or collective "
                            f"brings to rank {r}\n{marked(prog, t)}")
    raise NotImplementedError(
        f"rank {r}, step {t}: '{op}' reads {buf}, a head slice of {buf.parent}, which arrived "
        f"whole: reverse returns a buffer's gradient the way the buffer came (whole), and this "
        f"one is written in slices. Compute with all heads where a buffer arrives whole, or "
        f"move its head slices (S/R of {buf} and its siblings)\n{marked(prog, t)}")


def _general_resend(g: _Gen, T: int, fams: list, reads: tuple, after: int) -> dict:
    """The re-sends of input buffers (families ``fams``) that ranks read again in the
    backward and received by point-to-point hops (``reads``: :func:`_remote_reads`, each
    brought by a hop, :func:`_reads_arrive`), as transfer rows ordered after ``after``, in
    the order of the op rules: buffers by (family name, chunk, first appearance), then by
    rank.

    Raises:
        _Pad, _Late: as :func:`_resend_parts` (hops numbered as the table's transfers).
    """
    P = g.P
    isin = np.isin(g.xf, fams)
    xt, xs, xd, xf, xc, xhs = (x[isin] for x in (g.xt, g.xs, g.xd, g.xf, g.xc, g.xhs))
    xo = g.xro[isin]
    NBC = _F * P * g.HS                       # buffer codes (family, chunk, head slice)
    big = np.int64(1) << 20
    rr, rt, rb, rp = reads
    if len(fams) < len(_INPUTS):
        keep = np.isin(rb // (P * g.HS), fams)
        rr, rt, rb, rp = rr[keep], rt[keep], rb[keep], rp[keep]
    xb = g.bkey(xf, xc, xhs)
    if not len(xt) and not len(rr):
        return _no_xfer_general()
    # what is left was brought by hops: ids over those buffers
    used = np.zeros(NBC, dtype=bool)
    used[xb] = True
    id_of = np.cumsum(used) - 1
    n = int(id_of[-1]) + 1
    # buffer ids in emission order: (family name, chunk, first appearance: reads, then hops)
    first = np.full(n, np.iinfo(np.int64).max)
    _assign_min(first, id_of[rb], rp)
    _assign_min(first, id_of[xb], (np.int64(1) << 61) + (xd * big + xt) * big + xo)
    ub = np.flatnonzero(used)                 # buffer code of each compact id
    fam_rank = np.argsort(np.argsort([f.value for f in _FAMILIES]))
    ufam, uchunk = ub // g.HS // P, ub // g.HS % P
    emit_order = np.lexsort((first, uchunk, fam_rank[ufam]))
    bid = np.empty(n, np.int64)
    bid[emit_order] = np.arange(n)
    r_bid, x_bid = bid[id_of[rb]], bid[id_of[xb]]
    owner = np.empty(n, np.int64)
    owner[bid] = uchunk
    try:
        rows = _resend_parts(P, T, rr, rt, r_bid, xt, xs, xd, x_bid, g.xo[isin], after,
                             owner=owner)
    except _Late as e:                      # hops numbered as the table's transfers
        row = np.flatnonzero(isin)
        raise _Late(int(row[e.hop]), int(row[e.arrival])) from None
    b = ub[emit_order][rows["chunk"]]         # the buffer code of each row's id
    hi, hn = _slices(b % g.HS)
    return dict(step=rows["step"], src=rows["src"], dst=rows["dst"], fam=b // g.HS // P,
                chunk=b // g.HS % P, order=rows["order"], rorder=rows["order"], hi=hi, hn=hn)


def _no_xfer_general():
    z = np.zeros(0, np.int64)
    return dict(step=z, src=z, dst=z, fam=z, chunk=z, order=z, rorder=z, hi=z, hn=z)


def _general_prune(tab: ProgramTable, ok: np.ndarray) -> list[Program]:
    """:func:`prune` on a table: computes of empty tiles dropped, and transfers of q / kv
    (point to point, or a collective's contributions, own slots included) whose receiver,
    and every rank it forwards them to later, computes nothing with them; a collective left
    moving nothing is dropped on every member (the programs themselves when nothing is
    dropped). The rules of :func:`fringe.testing.oracle.prune`."""
    g = _gen(tab)
    P = g.P
    keep_c = ok[g.cq, g.ckv]
    c_reads = [(f, sd) for f, sd, w in TILE_TOUCH_CODES[C_] if not w]
    fams = [f for f, _ in c_reads]
    moved = np.zeros(_F, dtype=bool)       # a table of family codes (np.isin sorts or hashes)
    moved[fams] = True
    hop, slot = moved[g.xf], moved[g.sf]
    nh, ns = int(hop.sum()), int(slot.sum())
    hop, slot = (slice(None) if m.all() else m for m in (hop, slot))     # views: no copies
    keep_x = np.ones(len(g.xf), dtype=bool)
    keep_s = np.ones(len(g.sf), dtype=bool)
    if nh or ns:
        side = g.ss[slot]                    # a slot moves its buffer between its side's rank
        at_idx = g.pos_rank(g.kg[g.ss], g.sidx)         # and the member of its index
        peer = at_idx[slot]
        mine = g.kr[side]
        sends = g.sdir[slot] == 0
        hb = np.concatenate([g.bkey(g.xf[hop], g.xc[hop], g.xhs[hop]),
                             g.bkey(g.sf[slot], g.sc[slot], g.shs[slot])])
        ub, inv = _unique(hb)
        u_key = []                          # (buffer, rank) a kept compute reads
        for fam, ch in ((f, (g.cq, g.ckv)[sd]) for f, sd in c_reads):
            i, hit = _lookup(g.bkey(fam, ch, g.chs), ub, np.arange(len(ub)), 0)
            hit &= keep_c
            u_key.append(i[hit] * P + g.cr[hit])
        u_key = np.concatenate(u_key)
        m_t = np.concatenate([g.xt[hop], g.kt[side]])
        at_src = inv * P + np.concatenate([g.xs[hop], np.where(sends, mine, peer)])
        at_dst = inv * P + np.concatenate([g.xd[hop], np.where(sends, peer, mine)])
        if len(ub) * P <= PLANE_CELLS:      # a dense [buffer, rank] plane
            use = np.zeros(len(ub) * P, dtype=bool)
            use[u_key] = True
            kept = _keep_moves(at_dst, at_src, m_t, use[at_dst], len(ub) * P)
        else:                               # past it: the (buffer, rank) keys that occur
            space, cid = _unique(np.concatenate([at_dst, at_src]))
            n_m = len(at_dst)
            kept = _keep_moves(cid[:n_m], cid[n_m:], m_t, _member(at_dst, _uniq(u_key)),
                               len(space))
        keep_x[hop] = kept[:nh]
        keep_s[slot] = kept[nh:]
    keep_k = np.ones(len(g.kr), dtype=bool)
    if not keep_s.all():                    # instances left moving nothing go on every member
        moving = keep_s & (at_idx != g.kr[g.ss])
        alive = np.zeros(len(g.inst_keys), dtype=bool)
        alive[g.inst[g.ss[moving]]] = True
        keep_k = alive[g.inst]
        keep_s &= keep_k[g.ss]
    if keep_c.all() and keep_x.all() and keep_s.all():
        return list(tab.programs())          # nothing to drop: the same values
    comp, xfer, coll = tab._parts            # the same rows less the dropped (orders kept)
    if not keep_s.all():
        new_side = np.cumsum(keep_k) - 1
        groups = coll["groups"]
        coll = {k: (v[keep_k] if k in ("rank", "step", "order", "kind", "group") else
                    new_side[np.asarray(v, dtype=np.int64)[keep_s]] if k == "slot_side" else
                    v[keep_s]) for k, v in coll.items() if k != "groups"}
        coll["groups"] = groups
    return list(ProgramTable._of_parts(P, {k: v[keep_c] for k, v in comp.items()},
                                       {k: v[keep_x] for k, v in xfer.items()},
                                       coll).programs())
