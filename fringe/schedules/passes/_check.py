"""``check``: the structural checks every schedule must pass, on the columns of its one
table (the ring chain's shortcut :func:`_parts_ok` first, the general checks naming the
first fault), and :func:`_gen`, the columns the other passes take (an invalid table raises
what ``check`` names)."""
from __future__ import annotations

import collections
import itertools
from typing import Sequence

import numpy as np
import torch

from ..ir import (C_, COLL_KINDS as ir_kinds, G_, OWN_SLOT_IN_PLACE, Buffer, Family, Program,
                  ProgramTable, ScheduleError, blocks_text, buffer_of)
from . import _columns
from ._blocks import BlockNeed, covered
from ._columns import (_F, _FAMILY_CODE, _Gen, _need_array, _slices, _table, _tile_touches,
                       gc_paused)
from ._keys import _assign_min, _lookup, _member, _min_by_key, _row_keys, _runs, _uniq, _unique
from ._locate import _fail, _first_in_order, _located, _where_cols


@gc_paused()
def check(programs: Sequence[Program], *, need: torch.Tensor | None = None,
          backward: bool = False, kv: str = "resend", blocks: BlockNeed | None = None) -> None:
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
      and no empty tile is computed;
    * every partial result a rank writes for another rank's chunk (out in the forward; dq and
      dkv in the backward) is sent on at a step after its last write, towards its owner, and
      only once (a head slice counts on its own);
    * with ``blocks`` (a :class:`BlockNeed`), for transfers that move block ranges: the
      ranges lie in the chunk, a compute reads only blocks the ranged transfers brought, a
      rank forwards only blocks it holds, and (backward) a gradient it sends on for another
      rank's chunk carries every block it holds (:func:`covered`). Programs that move ranges are
      checked only with ``blocks`` given in full: without it a block left out is not seen.

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
        if blocks is not None:                   # and the blocks
            covered(programs, blocks, backward=backward)
        return
    fast = _parts_ok(tab, arr, backward, kv) if tab.chain else None   # the chain's shortcut
    if fast is not True:
        _general_ok(tab, arr, backward, kv)      # names the first fault
        if fast is False:
            raise RuntimeError("internal error: the ring chain's check rejected programs that "
                               "the general check accepts; please report it with the programs")
    _results_home_ok(tab, backward)
    tab._passed.add(flags)
    if blocks is not None:
        covered(programs, blocks, backward=backward)


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
    if _F * P * P > _columns.DENSE_CELLS:
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
                  | set(_families(xf)))
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


def result_families(backward: bool) -> tuple[Family, ...]:
    """The families of partial results, which a rank writes for another rank's chunk and must
    send home: out in the forward; dq and dkv in the backward (where out is an input)."""
    return (Family.DQ, Family.DKV) if backward else (Family.OUT,)


def _results_home_ok(tab: ProgramTable, backward: bool) -> None:
    """Every partial result (:func:`result_families`) a rank writes for another rank's chunk
    is sent on at a step after its last write, and each such buffer (a head slice on its own)
    is sent once (:func:`_results_home_named` has the rules in full and names the fault).

    On the columns as they are: the last write and the last send of each (family, rank,
    chunk) in dense arrays by ``np.maximum.at``, repeats by a dense mark, no sort and no
    int64 copy of a column (16.8M backward hops at P=4,096); past :data:`PLANE_CELLS`
    cells, the sorted keys."""
    P = tab.world_size
    codes = [_FAMILY_CODE[f] for f in result_families(backward)]
    cells = len(codes) * P * P
    comp, xfer, coll = tab._parts
    steps = [c["step"] for c in (comp, xfer, coll) if len(c["step"])]
    T = 1 + max([int(x.max()) for x in steps] or [0])
    if cells > _columns.PLANE_CELLS or T >= 2 ** 31 - 1:
        return _results_home_named(tab, backward)
    ix = np.full(_F, -1, np.int64)
    ix[codes] = np.arange(len(codes))
    st = np.int16 if T < 2 ** 15 - 1 else np.int32      # steps: int16 where they fit (and
    last_w = np.full(cells, -1, st)                     # cast so: np.maximum.at's fast loop)
    last_s = np.full(cells, -1, st)

    def cells_of(rank, fam, chunk):
        """``(rows, cells)`` of the result buffers of another rank's chunk among the rows
        (``fam`` a code or a column), a family and a piece of :data:`LATE_PIECE` rows at a
        time: no copy of a column (16.8M backward hops at P=4,096)."""
        present = ([int(fam)] if not np.ndim(fam) else
                   _families(fam))
        several = np.ndim(fam) and len(present) > 1
        for fv in present:
            if ix[fv] < 0:
                continue
            for i in range(0, len(rank), LATE_PIECE):
                j = min(len(rank), i + LATE_PIECE)
                sel = chunk[i:j] != rank[i:j]
                if several:
                    sel &= fam[i:j] == fv
                r = slice(i, j) if sel.all() else np.flatnonzero(sel) + i
                c = rank[r].astype(np.int32)         # cells < PLANE_CELLS < 2**31
                c *= P
                c += chunk[r]
                c += int(ix[fv]) * P * P
                yield r, c

    def mark(arr, rank, fam, chunk, step):
        for rows, c in cells_of(rank, fam, chunk):
            if len(c):
                np.maximum.at(arr, c, step[rows].astype(st))
    # each buffer sent once: marked as sent (whole heads), or (cell, slice) pairs kept to sort
    sliced = bool(xfer["hn"].any()) or bool(len(coll["slot_side"]) and coll["slot_hn"].any())
    seen = None if sliced else np.zeros(cells, dtype=bool)
    sends, n_sent = [], 0
    cr, ct, ck = comp["rank"], comp["step"], comp["kind"]
    side = (comp["q"], comp["kv"])
    for f, m, sd, _ in _tile_touches(ck, written=True):
        if ix[f] >= 0:
            mark(last_w, cr[m], f, side[sd][m], ct[m])
    xs, xd, xt, xf, xc = (xfer[k] for k in ("src", "dst", "step", "fam", "chunk"))
    mark(last_w, xd, xf, xc, xt)
    for rows, c in cells_of(xs, xf, xc):
        if len(c):
            np.maximum.at(last_s, c, xt[rows].astype(st))
        if sliced:
            sends.append((c, None if not xfer["hn"].any() else
                          (xfer["hi"][rows], xfer["hn"][rows])))
        else:
            seen[c] = True
            n_sent += len(c)
    if len(coll["slot_side"]):
        ss = coll["slot_side"]
        srank, sstep = coll["rank"][ss], coll["step"][ss]
        groups = coll["groups"]
        members = np.full((len(groups), max(len(g) for g in groups)), -1, np.int64)
        for n, grp in enumerate(groups):
            members[n, :len(grp)] = grp
        peer = members[coll["group"][ss], coll["slot_idx"]]
        moves = peer != srank                    # an own slot moves nothing
        for d, arr in ((1, last_w), (0, last_s)):
            m = np.flatnonzero(moves & (coll["slot_dir"] == d))
            for rows, c in cells_of(srank[m], coll["slot_fam"][m], coll["slot_chunk"][m]):
                if len(c):
                    np.maximum.at(arr, c, sstep[m][rows].astype(st))
                if d != 0:
                    continue
                if sliced:
                    sends.append((c, None if not coll["slot_hn"].any() else
                                  (coll["slot_hi"][m][rows], coll["slot_hn"][m][rows])))
                else:
                    seen[c] = True
                    n_sent += len(c)
    lost = bool(((last_w >= 0) & (last_s <= last_w)).any())
    del last_w, last_s
    again = False
    if not lost and not sliced:
        again = int(np.count_nonzero(seen)) < n_sent
    elif not lost and sends:                     # head slices: (cell, slice) pairs, sorted
        c = np.concatenate([x for x, _ in sends])
        hs = np.concatenate([np.zeros(len(x), np.int64) if h is None else _Gen.hs(*h)
                             for x, h in sends])
        k = np.sort(c.astype(np.int64) * (int(hs.max()) + 1) + hs)     # (int32 cells)
        again = bool((k[1:] == k[:-1]).any())
    del seen, sends
    if lost or again:
        _results_home_named(tab, backward)       # names it
        raise RuntimeError("internal error: check found a partial result not sent home (or "
                           "sent twice) but cannot name it; please report it with the programs")


def _results_home_named(tab: ProgramTable, backward: bool) -> None:
    """:func:`_results_home_ok`'s rules on sorted int64 keys, naming the first fault (the
    slow path, taken once the fast one found a fault). Every partial result (:func:`result_families`) a rank writes for another rank's chunk
    (a tile it computes, a transfer or collective slot it receives) is sent on at a step after
    its last write: else it never reaches its owner, whose output or gradient silently lacks it.
    Checked per (rank, family, chunk), a head slice counting as its chunk's buffer. Then each
    such buffer (a head slice on its own) is sent once: what arrives is added, so a second
    send adds it twice. Raises the op rules' message for the lowest (rank, step of that last
    write or second send, family, chunk, head slice)."""
    P = tab.world_size
    comp, xfer, coll = tab._parts
    i64 = lambda a: np.asarray(a, dtype=np.int64)  # noqa: E731
    cr, ct, ck = i64(comp["rank"]), i64(comp["step"]), i64(comp["kind"])
    side = (i64(comp["q"]), i64(comp["kv"]))
    writes = [(cr[m], np.full(len(cr[m]), f, np.int64), side[sd][m], ct[m])
              for f, m, sd, _ in _tile_touches(ck, written=True)]
    xs, xd, xt = i64(xfer["src"]), i64(xfer["dst"]), i64(xfer["step"])
    xf, xc = i64(xfer["fam"]), i64(xfer["chunk"])
    hs = _Gen.hs                                 # the head slice code
    xhs = hs(i64(xfer["hi"]), i64(xfer["hn"]))
    writes.append((xd, xf, xc, xt))
    sends = [(xs, xf, xc, xt, xhs)]
    if len(coll["slot_side"]):
        ss = i64(coll["slot_side"])
        srank, sstep = i64(coll["rank"])[ss], i64(coll["step"])[ss]
        groups = coll["groups"]
        width = max(len(g) for g in groups)
        members = np.full((len(groups), width), -1, np.int64)
        for n, grp in enumerate(groups):
            members[n, :len(grp)] = grp
        peer = members[i64(coll["group"])[ss], i64(coll["slot_idx"])]
        moves = peer != srank                    # an own slot moves nothing
        sf, sc, sdir = i64(coll["slot_fam"]), i64(coll["slot_chunk"]), i64(coll["slot_dir"])
        shs = hs(i64(coll["slot_hi"]), i64(coll["slot_hn"]))
        m = moves & (sdir == 1)
        writes.append((srank[m], sf[m], sc[m], sstep[m]))
        m = moves & (sdir == 0)
        sends.append((srank[m], sf[m], sc[m], sstep[m], shs[m]))
    codes = np.array([_FAMILY_CODE[f] for f in result_families(backward)])

    def keyed(entries):
        r, f, c, t, *h = (np.concatenate(x) for x in zip(*entries))
        keep = np.isin(f, codes) & (c != r)
        r, f, c, t, *h = (x[keep] for x in (r, f, c, t, *h))
        return ((r * _F + f) * P + c, r, f, c, t, *h)   # (chunks < P: the checks above passed)
    wk, wr, wf, wc, wt = keyed(writes)
    if not len(wk):
        return
    sk, sr, sf_, sc_, st, sh = keyed(sends)
    o = np.lexsort((wt, wk))                     # each key's last write: its last row
    wk, wr, wf, wc, wt = wk[o], wr[o], wf[o], wc[o], wt[o]
    last = np.append(wk[1:] != wk[:-1], True)
    wk, wr, wf, wc, wt = wk[last], wr[last], wf[last], wc[last], wt[last]
    sent = np.full(len(wk), -1, np.int64)        # the key's last send step (-1: none)
    if len(sk):
        pos = np.searchsorted(wk, sk)
        hit = (pos < len(wk)) & (wk[np.minimum(pos, len(wk) - 1)] == sk)
        np.maximum.at(sent, pos[hit], st[hit])
    bad = np.flatnonzero(sent <= wt)
    if len(bad):
        b = bad[np.lexsort((wc[bad], wf[bad], wt[bad], wr[bad]))[0]]
        r, t, c = int(wr[b]), int(wt[b]), int(wc[b])
        _fail(tab, r, t, _lost_text(buffer_of(int(wf[b]), c, 0, 0), r, c, int(sent[b])))
    # each buffer sent once: its owner adds what arrives, so a second send adds it twice
    o = np.lexsort((st, sh, sk))
    sk, sr, sf_, sc_, st, sh = (x[o] for x in (sk, sr, sf_, sc_, st, sh))
    again = np.flatnonzero((sk[1:] == sk[:-1]) & (sh[1:] == sh[:-1])) + 1
    if len(again):
        b = again[np.lexsort((sh[again], sc_[again], sf_[again], st[again], sr[again]))[0]]
        hi, hn = (int(x[0]) for x in _slices(sh[b:b + 1]))
        _fail(tab, int(sr[b]), int(st[b]), _again_text(
            buffer_of(int(sf_[b]), int(sc_[b]), hi, hn), int(sr[b]), int(sc_[b]), int(st[b - 1])))


def _again_text(buf, rank: int, owner: int, first: int) -> str:
    """The message for a partial result a rank sends on a second time (first at ``first``)."""
    return (f"rank {rank} sends {buf} again (first at step {first}): it is a partial result "
            f"of rank {owner}'s chunk, which would be added twice on its way to rank {owner}; "
            f"send it on once, after its last write")


def _lost_text(buf, rank: int, owner: int, sent: int) -> str:
    """The message for a partial result written on ``rank`` and not sent on after (``sent``:
    the step of its last send, -1: never)."""
    when = "never sent on" if sent < 0 else f"not sent on after it (last sent at step {sent})"
    return (f"{buf} (a partial result of rank {owner}'s chunk) is written on rank {rank} here "
            f"and {when}: this part never reaches rank {owner}, whose output or gradient "
            f"would silently lack it; send it on towards rank {owner} at a later step")


def _slot_buffer(tab: ProgramTable, side: int, direction: int, idx: int) -> str | None:
    """A collective side's slot as text: its buffer and block ranges (None: empty)."""
    coll = tab._parts[2]
    lo, hi = np.searchsorted(coll["slot_side"], [side, side + 1])
    for s in range(int(lo), int(hi)):
        if int(coll["slot_dir"][s]) == direction and int(coll["slot_idx"][s]) == idx:
            g = int(coll["slot_rng"][s])
            return (f"{buffer_of(*(int(coll[k][s]) for k in ('slot_fam', 'slot_chunk', 'slot_hi', 'slot_hn')))}"
                    f"{blocks_text(None if g < 0 else coll['ranges'][g])}")
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
    if len(g.sranges):                      # a slot's block ranges are part of what moves
        b = b * (len(g.sranges) + 1) + (g.srng + 1)
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


def _plus_one(t: np.ndarray) -> np.ndarray:
    """``t + 1`` in ``t``'s dtype where it cannot wrap (int32 steps: 67 MB, not 134, for
    16.8M transfers), else in int64."""
    if len(t) and t.dtype != np.int64 and int(t.max()) >= np.iinfo(t.dtype).max:
        t = t.astype(np.int64)
    return t + t.dtype.type(1)


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
    writes.append((g.xd, g.xf, g.xc, g.xhs, _plus_one(g.xt)))
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


def _families(f: np.ndarray) -> list[int]:
    """The family codes in column ``f``, in order: one when its min is its max (a ring's
    hops), else counted a piece at a time (``np.bincount`` makes an int64 copy of what it
    counts: 134 MB for 16.8M rows)."""
    if not len(f):
        return []
    lo, hi = int(f.min()), int(f.max())
    if lo == hi:
        return [lo]
    seen = np.zeros(max(_F, hi + 1), dtype=bool)
    for i in range(0, len(f), LATE_PIECE):
        seen[np.bincount(f[i:i + LATE_PIECE], minlength=len(seen)) > 0] = True
    return np.flatnonzero(seen).tolist()


def _by_family(entries) -> dict:
    """``(rank, fam, chunk, hs, t)`` column tuples (``fam`` an int or a column) split by
    family: ``{fam: [(k, sel), ...]}``, ``k`` the entry's index and ``sel`` the rows of that
    family (None: all); :func:`_pieces` cuts them, one family at a time (a backward's kv
    re-sends and dkv hops: 16.8M rows each at P=4,096)."""
    out = collections.defaultdict(list)
    for k, (r, f, ch, hs, t) in enumerate(entries):
        if not len(r):
            continue
        if isinstance(f, (int, np.integer)):
            out[int(f)].append((k, None))
            continue
        fvs = _families(f)
        if len(fvs) == 1:                   # one family: the columns as they are
            out[fvs[0]].append((k, None))
            continue
        for fv in fvs:
            out[fv].append((k, fv))
    return out


#: Rows :func:`_late_reads` cuts, writes and looks up at a time (its temporaries: a few
#: bytes a row each, never a whole family's copy).
LATE_PIECE = 1 << 20


def _pieces(entries, k: int, fv):
    """A callable giving entry ``k``'s rows of family ``fv`` (None: all rows) a piece of
    :data:`LATE_PIECE` rows at a time, as ``(rows, rank, chunk, hs, t)``: ``rows`` the
    piece's row numbers in the entry (a slice where it takes them all: views, no copies)."""
    r, f, ch, hs, t = entries[k]

    def gen():
        for i in range(0, len(r), LATE_PIECE):
            j = min(len(r), i + LATE_PIECE)
            if fv is None:
                yield slice(i, j), r[i:j], ch[i:j], hs[i:j], t[i:j]
                continue
            sel = np.flatnonzero(f[i:j] == fv)
            if len(sel):
                sel += i
                yield sel, r[sel], ch[sel], hs[sel], t[sel]
    return gen


def _late_reads(P: int, C: int, HS: int, writes: list, reads: list) -> list | None:
    """Which reads ``(rank, fam, chunk, hs, t)`` find neither their buffer nor its
    whole-heads parent (``hs`` 0) written at a step <= t on that rank: None when every read
    does, else per entry of ``reads`` a bool mask of its late reads (None: none)."""
    w_by, r_by = _by_family(writes), _by_family(reads)
    out = None
    for fam, rs in r_by.items():            # one family's rows at a time, in pieces (memory)
        ws = [_pieces(writes, k, fv) for k, fv in w_by.get(fam, [])]
        rows = [(k, _pieces(reads, k, fv)) for k, fv in rs]
        at = _write_steps(P, C, HS, ws, [x[1] for x in rows])
        del ws
        for k, pieces in rows:
            for sel, r, ch, hs, t in pieces():
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
                out[k][li + sel.start if isinstance(sel, slice) else sel[li]] = True
        del rows, at
    return out


def _write_steps(P: int, C: int, HS: int, ws: list, rs: list):
    """``at(rank, chunk, hs)``: the earliest step buffers of one family are written on a
    rank (its dtype's max: never), from writes ``ws`` and for the reads ``rs`` (each a
    :func:`_pieces` callable of ``(rows, rank, chunk, hs, t)``), which say which buffers are
    asked for. A dense ``[rank, buffer]`` plane over the buffers that occur (no sort of the
    millions of compute reads), or sorted keys past :data:`PLANE_CELLS`."""
    never = np.iinfo(np.int64).max

    def each(groups):
        return itertools.chain.from_iterable(g() for g in groups)
    if C * HS <= _columns.PLANE_CELLS:
        def code(ch, hs):                            # (chunk, hs) buffer code; no head
            return ch if HS == 1 else ch * HS + hs   # slices (HS 1): the chunk, no copies
        used = np.zeros(C * HS, dtype=bool)          # (chunk, hs) buffers of this family
        wide = False
        for _, _, ch, hs, t in each(ws):
            used[code(ch, hs)] = True
            wide = wide or bool(len(t) and int(t.max()) >= 2 ** 31 - 1)
        for _, _, ch, hs, _ in each(rs):
            used[code(ch, hs)] = True
            if HS > 1:
                used[ch * HS] = True                 # the parents of what is read
        ids = (np.cumsum(used) - 1).astype(np.int32)     # (< C * HS <= PLANE_CELLS)
        n = int(ids[-1]) + 1 if len(ids) else 0
        if P * n <= _columns.PLANE_CELLS:             # int32 steps where they fit ("never":
            st = np.int64 if wide else np.int32      # its max)

            def cell(r, ch, hs):                     # int32: P * n <= PLANE_CELLS < 2**31
                k = r.astype(np.int32)
                k *= np.int32(n)
                k += ids[code(ch, hs)]
                return k
            avail = np.full(P * n, np.iinfo(st).max, dtype=st)
            for _, r, ch, hs, t in each(ws):
                _assign_min(avail, cell(r, ch, hs), t)
            return lambda r, ch, hs: avail[cell(r, ch, hs)]
    i64 = np.int64                                   # (chunk columns may be int32)
    codes = ([ch.astype(i64) * HS + hs for _, _, ch, hs, _ in each(ws)]
             + [ch.astype(i64) * HS + hs for _, _, ch, hs, _ in each(rs)]
             + [ch.astype(i64) * HS for _, _, ch, _, _ in each(rs)])
    ub = _uniq(np.concatenate(codes)) if codes else np.zeros(0, np.int64)

    def key(r, ch, hs):
        return r.astype(i64) * len(ub) + np.searchsorted(ub, ch.astype(i64) * HS + hs)
    w = list(each(ws))
    if not w:
        return lambda r, ch, hs: np.full(len(r), never, dtype=np.int64)
    wk, wv = _min_by_key(np.concatenate([key(r, ch, hs) for _, r, ch, hs, _ in w]),
                         np.concatenate([t for *_, t in w]).astype(np.int64, copy=False))
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
