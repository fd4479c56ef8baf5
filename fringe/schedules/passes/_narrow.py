"""``narrow``: give every hop of an input buffer (q, kv) the block ranges that its receiver,
and every rank it forwards the buffer to later, read (:class:`~._blocks.BlockNeed`)."""
from __future__ import annotations

from typing import Sequence

import numpy as np

from ..ir import C_, TILE_TOUCH_CODES, Program, ProgramTable
from ._blocks import BlockNeed, _inputs, _unwords, _words
from ._check import _gen
from . import _columns
from ._columns import _F, _table, gc_paused
from ._keys import _by_step, _lookup, _row_keys, _runs, _unique


def _reads(g, need: BlockNeed):
    """Each compute's reads of input buffers as ``(buffer key, rank, packed bits)``."""
    c = g.ck == C_
    keys, ranks, bits = [], [], []
    hs = g.chs[c]                     # a head slice is read from it or its whole-heads parent
    slices = (hs, np.zeros_like(hs)) if hs.any() else (hs,)
    for fam, side, w in TILE_TOUCH_CODES[C_]:
        if w:
            continue
        chunk = (g.cq, g.ckv)[side]
        for h in slices:
            keys.append(g.bkey(fam, chunk[c], h))
            ranks.append(g.cr[c])
            bits.append(need.bits(g.cq[c], g.ckv[c], side))
    return np.concatenate(keys), np.concatenate(ranks), np.concatenate(bits)


def _slot_moves(g):
    """The contributions of collectives that move input buffers, as moves: ``(send slot,
    receive slot)`` rows of the table's slots, each a buffer going from the sending side's
    rank to the receiving side's (own slots stay in place: not moves)."""
    inp = np.isin(g.sf, _inputs())
    sme, sinst = g.me[g.ss], g.inst[g.ss]
    own = g.sidx == sme
    b = g.bkey(g.sf, g.sc, g.shs)
    sent = np.flatnonzero(inp & ~own & (g.sdir == 0))
    got = np.flatnonzero(inp & ~own & (g.sdir == 1))
    if not len(sent):
        return sent, sent
    ks = _row_keys(sinst[sent], sme[sent], g.sidx[sent], b[sent])
    kr = _row_keys(sinst[got], g.sidx[got], sme[got], b[got])
    o = np.argsort(kr)
    at, hit = _lookup(ks, kr[o], o, -1)
    return sent[hit], got[at[hit]]          # check has matched every contribution


@gc_paused()
def narrow(programs: Sequence[Program], need: BlockNeed) -> list[Program]:
    """Give every move of an input buffer (q, kv) the block ranges it must carry: a hop, and
    each contribution of a collective (its send slot and the matching receive slot). A move
    carries the blocks its receiver's computes read (:class:`BlockNeed`) and those of every
    rank the receiver moves the buffer on to later (a hop on a route carries what the rest of
    the route reads). A move that carries every block stays whole. Programs that already move
    ranges are returned as they are (their ranges are the writer's; :func:`check` with
    ``blocks=`` verifies them)."""
    tab = _table(programs)
    if tab.ranged:
        return list(tab.programs())
    g = _gen(tab)
    P = g.P
    is_hop = np.isin(g.xf, _inputs())
    # every transfer an input's hop (rings): views, no index of 16.8M rows at P=4,096
    hop = slice(None) if is_hop.all() else np.flatnonzero(is_hop)
    nh = len(g.xf) if isinstance(hop, slice) else len(hop)
    del is_hop
    s_send, s_recv = _slot_moves(g)
    if not nh and not len(s_send):
        return list(tab.programs())
    h = hop

    def cat(a, b):                    # (no copy of the hops' columns where no slot moves)
        return a if not len(b) else np.concatenate([a, b])
    mb = cat(g.bkey(g.xf[h], g.xc[h], g.xhs[h]), g.bkey(g.sf[s_send], g.sc[s_send],
                                                         g.shs[s_send]))
    src = cat(g.xs[h], g.kr[g.ss[s_send]])
    dst = cat(g.xd[h], g.kr[g.ss[s_recv]])
    step = cat(g.xt[h], g.kt[g.ss[s_send]])
    rk, rr, rbits = _reads(g, need)
    m = len(mb)
    rbits = _words(rbits)             # one word per row where it fits: 1-D gathers below
    NBC = _F * g.C * g.HS             # buffer codes
    dense = NBC <= _columns.PLANE_CELLS
    if dense:
        used = np.zeros(NBC, dtype=bool)
        used[mb] = True
        dense = int(np.count_nonzero(used)) * P <= _columns.PLANE_CELLS
    if dense:
        # dense (moved buffer, rank) cells in int32: no sort, no int64 keys of the moves
        id_of = (np.cumsum(used) - 1).astype(np.int32)
        K = (int(id_of[-1]) + 1) * P

        def cell(b, r):
            k = id_of[b]
            k *= np.int32(P)
            k += r
            return k
        at_dst, at_src = cell(mb, dst), cell(mb, src)
        del mb, src, dst
        use = np.zeros((K,) + rbits.shape[1:], dtype=rbits.dtype)
        hit = used[rk]                # reads of buffers no move carries: nothing to carry
        if hit.any():
            np.bitwise_or.at(use, cell(rk[hit], rr[hit]), rbits[hit])
        del used, id_of, hit, rk, rr, rbits
    else:                             # (buffer, rank) keys that occur, by a sort
        mb = mb * P
        space, ids = _unique(np.concatenate([mb + dst, mb + src]))
        del mb, src, dst              # (memory: m moves at P=4,096 are 16.8M)
        K = len(space)
        at_dst, at_src = ids[:m], ids[m:]
        use = np.zeros((K,) + rbits.shape[1:], dtype=rbits.dtype)
        u, hit = _lookup(rk * P + rr, space, np.arange(K), -1)
        if hit.any():
            np.bitwise_or.at(use, u[hit], rbits[hit])
        del space, u, hit, rk, rr, rbits, ids
    live = np.zeros_like(use)
    carry = np.zeros((m,) + use.shape[1:], dtype=use.dtype)
    by_step = _by_step(step, descending=True)
    _, starts = _runs(step[by_step])
    ends = list(starts[1:]) + [m]
    for a, b in zip(starts.tolist(), ends):        # latest step first
        s = by_step[a:b]
        d = at_dst[s]
        c = use[d] | live[d]
        carry[s] = c
        frm = at_src[s]
        if live.ndim == 1:            # words: ufunc.at is fast in 1-D (no sort for repeats)
            np.bitwise_or.at(live, frm, c)
            continue
        srt = np.sort(frm)
        if len(frm) < 2 or (srt[1:] != srt[:-1]).all():
            live[frm] |= c
        else:
            np.bitwise_or.at(live, frm, c)
    if m:
        del s, d, c, frm              # (s: a view that keeps by_step alive)
    del use, live, by_step, step, at_dst, at_src
    carry = _unwords(carry, need.nbytes)
    whole = (carry == need.whole()).all(axis=1)
    if whole.all():                   # every move needs its whole chunk: the same table
        return list(tab.programs())
    if not whole.any():               # every move carries ranges (documents): no index
        rows, rng = _distinct_rows(carry)
    else:
        rng = np.full(m, -1, np.int32)
        part = np.flatnonzero(~whole)
        rows, inv = _distinct_rows(carry[part])
        rng[part] = inv
        del part, inv
    del carry, whole
    ranges = tuple(_ranges_of(r, need.n) for r in rows)
    comp, xfer, coll = tab._parts
    x = dict(xfer)
    c = dict(coll)
    if (rng[:nh] >= 0).any():
        if isinstance(hop, slice) and nh == m:   # the hops' ranges are the column (fresh,
            x_rng = rng                          # int32: the table takes it as it is)
        else:
            x_rng = np.full(len(g.xf), -1, np.int32)
            x_rng[hop] = rng[:nh]
        x["rng"], x["ranges"] = x_rng, ranges
    if (rng[nh:] >= 0).any():
        s_rng = np.full(len(g.sf), -1, np.int64)
        s_rng[s_send] = rng[nh:]
        s_rng[s_recv] = rng[nh:]
        c["slot_rng"], c["ranges"] = s_rng, ranges
    return list(ProgramTable._of_parts(P, comp, x, c, base=tab, fresh=True).programs())


def _distinct_rows(bits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(distinct rows, index of each row among them)`` of packed bit rows: one int key per
    row where a row fits in 8 bytes (a 1-D unique), else a unique over rows."""
    m, w = bits.shape
    if w <= 2:                        # up to 16 blocks: mark the keys, no sort (P=4,096)
        key = bits[:, 0].astype(np.int32)
        if w == 2:
            key |= bits[:, 1].astype(np.int32) << 8
        seen = np.zeros(1 << (8 * w), dtype=bool)
        seen[key] = True
        keys = np.flatnonzero(seen)
        rows = np.stack([(keys >> (8 * i)) & 0xFF for i in range(w)], axis=1).astype(np.uint8)
        return rows, (np.cumsum(seen) - 1).astype(np.int32)[key]     # (int32: 16.8M moves)
    if w <= 8:
        wide = np.zeros((m, 8), dtype=np.uint8)
        wide[:, :w] = bits
        keys, inv = np.unique(wide.view(np.uint64).reshape(-1), return_inverse=True)
        return keys.view(np.uint8).reshape(-1, 8)[:, :w], inv.reshape(-1)
    rows, inv = np.unique(bits, axis=0, return_inverse=True)
    return rows, inv.reshape(-1)


def _ranges_of(row: np.ndarray, n: int) -> tuple[tuple[int, int], ...]:
    """The half-open block ranges of a packed bit row."""
    b = np.unpackbits(row)[:n].astype(np.int8)
    d = np.diff(np.concatenate([[0], b, [0]]))
    return tuple(zip(np.flatnonzero(d == 1).tolist(), np.flatnonzero(d == -1).tolist()))
