"""The cost model's program reader: one direction's programs as integer columns.

Reads the IR only, through its one form, :class:`~fringe.schedules.ir.ProgramTable`: op
programs become a table up front (``ProgramTable.of``), and its parts (computes, transfers,
collective sides and their slots) are read with numpy, never an op at a time (P=1024 rings
have millions of ops). Invalid input (programs that would not pass
:func:`fringe.schedules.check`) is refused with a ValueError saying what is wrong; nothing
falls back. The readable op-by-op reading is the oracle in the tests,
:func:`fringe.testing.oracle.cost_columns`.

The middle layer of the cost model: above :mod:`fringe.schedules`, below the simulator
(:mod:`fringe.cost.simulate`).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import numpy as np

from ..schedules import ir
from .hardware import Shape

__all__: list[str] = []

_SLICE_LOOKUP = 1 << 22   # head-slice keys looked up in a dense table up to this many
_WIDE = 1 << 31           # buffer ids at or past this: computed in int64 (table columns are int32)
_BYTES_PIECE = 1 << 22    # transfers whose bytes are computed at a time

#: Collective kinds in the columns: all-gather, reduce-scatter, all-to-all.
_COLL_KINDS = {"AG": 0, "RS": 1, "A2A": 2}


@dataclasses.dataclass
class _Cols:
    """One direction's programs as integer columns (one pass over the ops).

    ``comp``: ``(rank, step, grad, q, kv, split)`` per tile compute (``split`` k: one head
    slice of k; 1: all heads). ``send``: ``(rank, step, peer, bytes)`` per point-to-point
    send (``bytes``: a column, or a :class:`_Coded` one, indexed alike). ``touch``: groups of
    ``(rank, step, buffer id, start[, rows])``: ops on buffers
    another rank owns (``start``, an array or one bool for the group: it arrives or is first
    written there; ``rows``, a bool mask: the group is those rows of its columns; absent or
    None: all). ``coll``: ``(rank, step, group id,
    ordinal, kind, sent bytes, received bytes)`` per member side of a collective; ``ordinal``
    counts the collectives on the same group earlier in that step. ``groups``: the groups by
    id; ``buf_bytes``: bytes by buffer id; ``splits``: the head splits the programs use.
    """

    P: int
    comp: tuple
    send: tuple
    touch: tuple
    coll: tuple
    groups: list
    buf_bytes: np.ndarray
    splits: tuple
    #: the peak bytes of other ranks' buffers alive at once per rank, once computed (it does
    #: not depend on the hardware: a plan simulated on several presets computes it once)
    live_peak: np.ndarray | None = None
    #: ``(steps, active)`` once the simulator has derived them (also hardware-independent);
    #: the touches are dropped then (they are the columns' largest part)
    static: tuple | None = None


def _i64(x) -> np.ndarray:
    return np.asarray(x, dtype=np.int64)


def _ints(x) -> np.ndarray:
    """A table column as it is when it holds integers of at most 32 bits (int64 otherwise)."""
    a = np.asarray(x)
    return a if a.dtype in (np.int32, np.int64) else a.astype(np.int64)


#: Buffer families and their codes (a buffer id is ``family code * P + chunk``).
FAMILIES = list(ir.Family)
FAMILY_CODE = {f: c for c, f in enumerate(FAMILIES)}


def _fam_bytes(L: int, shape: Shape) -> np.ndarray:
    return _i64([shape.buffer_bytes(f.value, L) for f in FAMILIES])


def columns(programs: Sequence, L: int, shape: Shape, block_size: int | None = None) -> _Cols:
    """Programs (one per rank, in rank order) as :class:`_Cols`, from their
    :class:`~fringe.schedules.ir.ProgramTable`. A transfer that moves block ranges is priced
    at its blocks' bytes (``block_size`` tokens a block: needed for such programs).

    Raises:
        ValueError: for programs no valid schedule makes (see :func:`_general_columns`).
        ScheduleError: from ``ProgramTable.of`` (an invalid peer, a transfer without its
            partner).
    """
    t = ir.ProgramTable.of(list(programs))
    return _general_columns(t, len(programs), L, shape, block_size)


def step_count(programs: Sequence) -> int:
    """One more than the programs' largest step (at least the steps their timelines have),
    from their table's step columns."""
    t = ir.ProgramTable.of(list(programs))
    return 1 + max([int(p["step"].max()) for p in t._parts if len(p["step"])] or [-1])


def _compute_touches(P, rank, step, grad, q, kv):
    """Touch rows of tile computes on buffers other ranks own (all heads, ``bufid = family
    code * P + chunk``), by the rule table (``ir.TILE_TOUCHES``: ``grad`` holds the kind
    codes, 0 a forward compute, 1 its VJP). Written buffers start there."""
    out = []
    for g, fam_chunks in ir.TILE_TOUCHES.items():
        sel = grad == g
        if not sel.any():
            continue
        r, s, cq, ck = rank[sel], step[sel], q[sel], kv[sel]
        remote = (cq != r, ck != r)
        for fam, which, start in fam_chunks:
            m = remote[which]
            if m.any():
                ch = (cq, ck)[which][m]
                out.append((r[m], s[m], FAMILY_CODE[fam] * P + ch, bool(start)))
    return out


#: The parts of a general :class:`~fringe.schedules.ir.ProgramTable` that
#: :func:`_general_columns` reads: computes, transfers, collective sides and their slots.
_GENERAL_PARTS = (
    frozenset({"rank", "step", "kind", "q", "kv", "order", "hi", "hn"}),
    frozenset({"step", "src", "dst", "fam", "chunk", "order", "hi", "hn", "rorder", "rng",
               "ranges"}),
    frozenset({"rank", "step", "order", "kind", "group", "slot_side", "slot_dir", "slot_idx",
               "slot_fam", "slot_chunk", "slot_hi", "slot_hn", "slot_rng", "groups", "ranges"}))


def _ranged_bytes(whole: np.ndarray, rng: np.ndarray, ranges: tuple, L: int,
                  block_size: int | None) -> np.ndarray:
    """Bytes of each transfer (or collective slot): the whole buffer's, or, for one that
    moves block ranges (``rng``: an index into ``ranges``, -1 whole), its blocks' share (the
    families that move ranges hold L tokens, their bytes linear in L)."""
    if not len(ranges):
        return whole
    if block_size is None:
        raise ValueError("the programs move block ranges: give the block size "
                         "(plan.block_size) to price them")
    tokens = _i64([sum(hi - lo for lo, hi in rs) * block_size for rs in ranges] + [L])
    return whole // L * tokens[rng]               # -1: the whole chunk, L tokens


@dataclasses.dataclass(frozen=True)
class _Coded:
    """A column of few distinct values, as small codes into its values: ``col[i]`` is
    ``values[codes[i]]`` (``i`` an index array or a slice)."""

    codes: np.ndarray
    values: np.ndarray

    def __getitem__(self, i) -> np.ndarray:
        return self.values[self.codes[i]]

    def __len__(self) -> int:
        return len(self.codes)


def _narrowest(x: np.ndarray, bound: int) -> np.ndarray:
    """``x`` (values in ``[0, bound)``) as int16 or int32 where they fit: a column kept per
    plan (16.8M transfers at P=4,096: 34 MB in int16, 67 in int32)."""
    for t in (np.int16, np.int32):
        if bound <= np.iinfo(t).max:
            return x.astype(t, copy=False)
    return x


def _transfer_bytes(x_id: np.ndarray, rng: np.ndarray, ranges: tuple, buf_bytes: np.ndarray,
                    L: int, block_size: int | None) -> _Coded:
    """Each transfer's bytes (:func:`_ranged_bytes` of its buffer and its range set), as
    codes into the few distinct values: a buffer's bytes take a handful of values (one per
    family and head split), range sets a few more."""
    fb, fb_code = np.unique(buf_bytes, return_inverse=True)
    if not len(ranges):
        values, n_r = fb, 1
    else:
        n_r = len(ranges) + 1                    # -1 (the whole chunk), then each range set
        values = _ranged_bytes(np.repeat(fb, n_r), np.tile(np.arange(-1, n_r - 1), len(fb)),
                               ranges, L, block_size)
    codes = np.empty(len(x_id), dtype=np.int16 if len(values) <= 2 ** 15 - 1 else np.int32)
    fb_code = fb_code.reshape(-1).astype(codes.dtype) * codes.dtype.type(n_r)
    for i in range(0, len(x_id), _BYTES_PIECE):  # (a piece at a time: no int64 temporaries)
        j = i + _BYTES_PIECE
        c = fb_code[x_id[i:j]]
        if n_r > 1:
            c += (rng[i:j] + 1).astype(codes.dtype)
        codes[i:j] = c
    return _Coded(codes, values)


def _within(x: np.ndarray, lo: int, hi: int) -> bool:
    """Every value of ``x`` in ``[lo, hi)``."""
    return not len(x) or (int(x.min()) >= lo and int(x.max()) < hi)


def _cell_order(*keys: np.ndarray) -> np.ndarray | slice:
    """Rows in (keys[0], keys[1], ...) order, ties in row order (a slice when already so)."""
    if not len(keys[0]):
        return slice(None)
    lo = [int(k.min()) for k in keys]
    spans = [int(k.max()) - m + 1 for k, m in zip(keys, lo)]
    if math.prod(float(w) for w in spans) >= 2.0 ** 62:
        return np.lexsort(keys[::-1])
    key = keys[0].astype(np.int64) - lo[0]
    for k, m, w in zip(keys[1:], lo[1:], spans[1:]):
        key *= w
        key += k - m
    if (np.diff(key) >= 0).all():
        return slice(None)
    return np.argsort(key, kind="stable")


def _member_index(groups: list, gid: np.ndarray, rank: np.ndarray, P: int) -> np.ndarray:
    """The index of ``rank[i]`` in ``groups[gid[i]]`` (-1 where a rank is not in its group)."""
    if not len(gid):
        return _i64([])
    M = 1 + max(P, max(max(g) for g in groups))
    key = np.concatenate([i * M + _i64(g) for i, g in enumerate(groups)])
    idx = np.concatenate([np.arange(len(g), dtype=np.int64) for g in groups])
    o = np.argsort(key)
    key, idx = key[o], idx[o]
    want = gid * M + rank
    at = np.minimum(np.searchsorted(key, want), len(key) - 1)
    return np.where(key[at] == want, idx[at], -1)


def _in_range(what: str, x: np.ndarray, lo: int, hi: int) -> None:
    """Raise a ValueError naming the first value of ``x`` outside ``[lo, hi)``."""
    if not _within(x, lo, hi):
        i = int(np.flatnonzero((x < lo) | (x >= hi))[0])
        raise ValueError(f"the programs' table holds {what} {int(x[i])} (row {i}), outside "
                         f"[{lo}, {hi}); programs that pass fringe.schedules.check never do: "
                         f"check them (or build them with a ProgramBuilder) before predicting")


def _heads_in_range(what: str, hi: np.ndarray, hn: np.ndarray) -> None:
    """Raise a ValueError naming the first head slice ``(hi, hn)`` that is not ``i/n`` with
    ``0 <= i < n`` (``hn == 0``: all heads)."""
    _in_range(f"{what} head split", hn, 0, 1 << 16)
    bad = np.flatnonzero((hn != 0) & ((hi < 0) | (hi >= hn)))
    if len(bad):
        i = int(bad[0])
        raise ValueError(f"the programs' table holds {what} head slice h{int(hi[i])}/"
                         f"{int(hn[i])} (row {i}); a head slice is hi/n with 0 <= i < n")


def _general_columns(t, P: int, L: int, shape: Shape, block_size: int | None = None) -> _Cols:
    """Columns of a :class:`~fringe.schedules.ir.ProgramTable` (computes, head slices and
    collectives) from its parts, with numpy: what the op-by-op oracle
    (:func:`fringe.testing.oracle.cost_columns`) gives for its programs (buffers and groups
    may be numbered otherwise; nothing the simulation reads differs).

    Raises:
        NotImplementedError: the table has a part, column or collective kind this reader
            does not know (the IR grew: teach this reader to read it).
        ValueError: for what no valid program holds, naming it: a chunk, rank, family or
            step out of range, a bad head slice, an invalid group, a collective side whose
            rank is not in its group, slots out of order.
    """
    parts = t._parts
    if len(parts) != 3 or any(set(d) != k for d, k in zip(parts, _GENERAL_PARTS)):
        known = [sorted(k) for k in _GENERAL_PARTS]
        raise NotImplementedError(
            f"the cost model's program reader does not know the table's parts "
            f"{[sorted(d) for d in parts]}; it reads {known}: teach "
            f"fringe/cost/programs.py:_general_columns the new columns")
    # computes and transfers keep the table's integer columns (int32: no int64 copy of
    # millions of rows; what could pass int32 is computed in int64 below); collective sides
    # (few) are read as int64
    comp, xfer = ({k: (v if k == "ranges" else _ints(v)) for k, v in d.items()}
                  for d in parts[:2])
    coll = {k: (v if k in ("groups", "ranges") else _i64(v)) for k, v in parts[2].items()}
    nf = len(FAMILIES)
    unknown = [k for k in ir.COLL_KINDS if k not in _COLL_KINDS]
    if unknown:
        raise NotImplementedError(f"the cost model does not model the collective kinds "
                                  f"{unknown}; it models {sorted(_COLL_KINDS)}: add their cost "
                                  f"to fringe/cost (Hardware.collective_s and _instances)")
    kind_code = _i64([_COLL_KINDS[k] for k in ir.COLL_KINDS])
    raw_groups = coll["groups"]
    for g in raw_groups:                         # what Collective checks of a group
        if not g or len(set(g)) != len(g) or min(g) < 0:
            raise ValueError(f"the programs' table holds the collective group {list(g)}; a "
                             f"group is a non-empty list of distinct ranks >= 0")
    g_size = _i64([len(g) for g in raw_groups])
    ss = coll["slot_side"]
    n_sides = len(coll["rank"])
    for what, x, lo, hi in (
            ("a compute kind", comp["kind"], 0, 2), ("a compute rank", comp["rank"], 0, P),
            ("a compute q chunk", comp["q"], 0, P), ("a compute kv chunk", comp["kv"], 0, P),
            ("a transfer family code", xfer["fam"], 0, nf),
            ("a transfer source rank", xfer["src"], 0, P),
            ("a transfer destination rank", xfer["dst"], 0, P),
            ("a transfer chunk", xfer["chunk"], 0, P),
            ("a collective kind code", coll["kind"], 0, len(kind_code)),
            ("a collective rank", coll["rank"], 0, P),
            ("a collective group id", coll["group"], 0, len(raw_groups)),
            ("a collective slot's side", ss, 0, n_sides),
            ("a collective slot's direction", coll["slot_dir"], 0, 2),
            ("a collective slot's family code", coll["slot_fam"], 0, nf),
            ("a collective slot's chunk", coll["slot_chunk"], 0, P),
            ("a compute step", comp["step"], 0, 1 << 40),
            ("a transfer step", xfer["step"], 0, 1 << 40),
            ("a collective step", coll["step"], 0, 1 << 40)):
        _in_range(what, x, lo, hi)
    _heads_in_range("a compute's", comp["hi"], comp["hn"])
    _heads_in_range("a transfer's", xfer["hi"], xfer["hn"])
    _heads_in_range("a collective slot's", coll["slot_hi"], coll["slot_hn"])
    sx = coll["slot_idx"]
    if len(ss):
        _in_range("a collective slot index", sx, 0, 1 << 40)
        over = np.flatnonzero(sx >= g_size[coll["group"][ss]])
        if len(over):
            i = int(over[0])
            raise ValueError(f"the programs' table holds slot {int(sx[i])} of a collective on "
                             f"group {list(raw_groups[coll['group'][ss[i]]])}, past the group's "
                             f"{int(g_size[coll['group'][ss[i]]])} members")
    slot_key = (ss * 2 + coll["slot_dir"]) * (1 << 40) + sx
    if (np.diff(slot_key) <= 0).any():           # slots in (side, dir, idx) order, distinct
        raise ValueError("the programs' table holds collective slots out of (side, direction, "
                         "index) order or twice; build the table with ProgramTable.of")

    # buffer ids: whole heads family * P + chunk (as the oracle), head slices one id each after
    NH = 1 + max((int(d[k].max()) for d, k in ((comp, "hn"), (xfer, "hn"), (coll, "slot_hn"))
                  if len(d[k])), default=0)
    base = nf * P

    def slice_key(fam, chunk, hi, hn):
        return ((_i64(fam) * P + chunk) * NH + hi) * NH + hn

    o = _cell_order(comp["rank"], comp["step"], comp["order"])   # op order within a cell:
    cr, ct, cg, cq, ckv, chi, chn = (comp[k][o] for k in     # the sums of compute times
                                     ("rank", "step", "kind", "q", "kv", "hi", "hn"))
    sides = (ir.Q_SIDE, ir.KV_SIDE)             # the rule table's touches, by chunk side
    by_grad = tuple((g, tuple(tuple(f for f, sd, _ in t if sd == s) for s in sides),
                     tuple(tuple(w for _, sd, w in t if sd == s) for s in sides))
                    for g, t in ir.TILE_TOUCHES.items())
    whole = chn == 0
    sl = ~whole
    sliced_refs = []                             # computes on head slices other ranks own
    for g, fams_of, starts_of in by_grad:
        sel = sl & (cg == g)
        if not sel.any():
            continue
        for ch, fs, starts in zip((cq, ckv), fams_of, starts_of):
            m = sel & (ch != cr)
            if not m.any():
                continue
            r, s, k = cr[m], ct[m], slice_key(0, ch[m], chi[m], chn[m])
            for fam, start in zip(fs, starts):
                sliced_refs.append((r, s, k + FAMILY_CODE[fam] * (P * NH * NH), start))
    x_sl, k_sl = xfer["hn"] > 0, coll["slot_hn"] > 0
    x_key = slice_key(*(xfer[k][x_sl] for k in ("fam", "chunk", "hi", "hn")))
    k_key = slice_key(*(coll[k][k_sl] for k in ("slot_fam", "slot_chunk", "slot_hi", "slot_hn")))
    keys = [x_key, k_key] + [r[2] for r in sliced_refs]
    if nf * P * NH * NH <= _SLICE_LOOKUP:        # few possible slices: a dense lookup
        seen = np.zeros(nf * P * NH * NH, dtype=bool)
        for k in keys:
            seen[k] = True
        uniq, at = np.flatnonzero(seen), np.cumsum(seen) - 1
        slot_of = at.__getitem__
    else:
        uniq = np.unique(np.concatenate(keys))

        def slot_of(key):
            return np.searchsorted(uniq, key)
    u_hn = uniq % NH
    u_fam = uniq // (NH * NH * P)
    sliced_bytes = np.zeros(len(uniq), dtype=np.int64)
    for f, n in sorted(set(zip(u_fam.tolist(), u_hn.tolist()))):
        sliced_bytes[(u_fam == f) & (u_hn == n)] = shape.buffer_bytes(FAMILIES[f].value, L, split=n)
    fam_bytes = _fam_bytes(L, shape)
    buf_bytes = np.concatenate([np.repeat(fam_bytes, P), sliced_bytes])

    wide = base + len(uniq) >= _WIDE                 # buffer ids past int32

    def ids(sliced, key, fam, chunk):
        """Buffer ids of rows (``key``: the slice keys of the rows where ``sliced``)."""
        out = (_i64(fam) if wide else fam) * P + chunk
        if len(key):
            out[sliced] = base + slot_of(key)
        return out

    touch = _compute_touches(P, cr[whole], ct[whole], cg[whole], cq[whole], ckv[whole])
    touch += [(r, s, base + slot_of(key), start) for r, s, key, start in sliced_refs]

    xs, src, dst, xc = (xfer[k] for k in ("step", "src", "dst", "chunk"))
    x_id = _narrowest(ids(x_sl, x_key, xfer["fam"], xc), len(buf_bytes))
    x_bytes = _transfer_bytes(x_id, xfer["rng"], xfer["ranges"], buf_bytes, L, block_size)
    sends = (src, xs, dst, x_bytes)
    for rank, start in ((src, False), (dst, True)):     # a transfer touches a buffer another
        m = xc != rank                                  # rank owns: the columns and which
        touch.append((rank, xs, x_id, start, None if m.all() else m))   # rows (no copies of
                                                        # 16.8M rows a direction at P=4,096)

    # collectives: groups by value (as the oracle keys them), the member index of each side's
    # rank, and its ordinal (the collectives on its group earlier in the rank's step)
    gid_of: dict[tuple, int] = {}
    remap = _i64([gid_of.setdefault(g, len(gid_of)) for g in raw_groups])
    groups = list(gid_of)
    kr, kt = coll["rank"], coll["step"]
    kg = remap[coll["group"]]
    me = _member_index(groups, kg, kr, P)
    if (me < 0).any():
        i = int(np.flatnonzero(me < 0)[0])
        raise ValueError(f"rank {int(kr[i])}, step {int(kt[i])}: a collective on group "
                         f"{list(groups[kg[i]])} does not list rank {int(kr[i])} in its group; "
                         f"a rank takes part only in the collectives of groups it is in")
    seq = np.arange(n_sides, dtype=np.int64)[_cell_order(kr, kt, coll["order"])]   # op order
    seq = seq[_cell_order(kr[seq], kt[seq], kg[seq])]  # by (rank, step, group), op order kept
    pos = np.arange(n_sides, dtype=np.int64)
    head = np.r_[True, (np.diff(kr[seq]) != 0) | (np.diff(kt[seq]) != 0)
                 | (np.diff(kg[seq]) != 0)][:n_sides]
    ordinal = np.empty(n_sides, dtype=np.int64)
    ordinal[seq] = pos - np.maximum.accumulate(np.where(head, pos, 0))
    # bytes each side moves: its slots' buffers but its own slot (which stays in place,
    # by the rule table: ir.OWN_SLOT_IN_PLACE, by the table's kind code)
    s_id = ids(k_sl, k_key, coll["slot_fam"], coll["slot_chunk"])
    in_place = np.array(ir.OWN_SLOT_IN_PLACE)[coll["kind"][ss]] if len(ss) else None
    s_whole = _ranged_bytes(buf_bytes[s_id], coll["slot_rng"], coll["ranges"], L, block_size)
    s_bytes = np.where((sx == me[ss]) & in_place, 0, s_whole) if len(ss) else _i64([])
    moved = np.r_[0, np.cumsum(s_bytes)][np.searchsorted(
        ss * 2 + coll["slot_dir"], np.arange(2 * n_sides + 1))]
    moved = np.diff(moved)
    coll_cols = (kr, kt, kg, ordinal, kind_code[coll["kind"]], moved[0::2], moved[1::2])
    s_rank = kr[ss]
    far = coll["slot_chunk"] != s_rank
    touch.append((s_rank[far], kt[ss][far], s_id[far], coll["slot_dir"][far] == 1))
    splits = tuple(sorted({1} | set(u_hn.tolist())))
    return _Cols(P, (cr, ct, cg, cq, ckv, np.where(whole, 1, chn)), sends, touch, coll_cols,
                 groups, buf_bytes, splits)
