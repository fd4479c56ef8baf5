"""Block-level need: which blocks of each tile the mask reads (:class:`BlockNeed`), and
:func:`covered`, the rules a table whose transfers move block ranges must keep."""
from __future__ import annotations

from typing import Sequence

import numpy as np

from ..ir import C_, G_, KV_SIDE, Q_SIDE, TILE_TOUCH_CODES, Program, ProgramTable, ScheduleError, marked
from . import _columns
from ._columns import _F, _Gen, _table
from ._keys import _lookup, _unique


class BlockNeed:
    """Which blocks of each tile the mask reads, per side (the mask's block map, by tile).

    For tile (q chunk ``i``, kv chunk ``j``) of ``n`` blocks a side: side
    :data:`~fringe.schedules.ir.KV_SIDE` holds the blocks of chunk j that some query block of
    chunk i attends (a column of the tile with a non-empty block), side ``Q_SIDE`` the blocks
    of chunk i that attend some block of j (a row). Stored as merged block intervals per
    non-empty tile; :meth:`bits` paints packed bit rows for the tiles asked.

    Args:
        P: chunks (ranks).
        n: blocks per chunk (``L / block_size``).
        rects: int ``[N, 4]`` non-empty block rectangles ``[r0, r1) x [c0, c1)`` in layout
            order, none crossing a tile boundary (``plan.block_map.rects``).
    """

    def __init__(self, P: int, n: int, rects) -> None:
        r = np.asarray(rects, dtype=np.int64).reshape(-1, 4)
        self.P, self.n = int(P), int(n)
        self.nbytes = (self.n + 7) // 8
        ti, tj = r[:, 0] // n, r[:, 2] // n
        if len(r) and ((r[:, 1] - 1) // n != ti).any() or len(r) and ((r[:, 3] - 1) // n != tj).any():
            raise ValueError("BlockNeed: a rectangle crosses a tile boundary (cut the block map "
                             "at multiples of n blocks first)")
        key = ti * P + tj
        self.keys = np.unique(key)
        tile = np.searchsorted(self.keys, key)
        self._iv = {}
        for side, lo, hi in ((KV_SIDE, r[:, 2] - tj * n, r[:, 3] - tj * n),
                             (Q_SIDE, r[:, 0] - ti * n, r[:, 1] - ti * n)):
            self._iv[side] = _merged(tile, lo, hi, len(self.keys), n)
        self._ones = np.packbits(np.ones(self.n, dtype=bool))

    def whole(self) -> np.ndarray:
        """A packed row of every block."""
        return self._ones.copy()

    def bits(self, q, kv, side: int) -> np.ndarray:
        """uint8 ``[len(q), nbytes]``: packed bits (``np.packbits`` order) of the blocks of
        tiles ``(q[m], kv[m])`` read on ``side``; zeros for empty tiles."""
        q, kv = np.asarray(q, dtype=np.int64), np.asarray(kv, dtype=np.int64)
        out = np.zeros((len(q), self.nbytes), dtype=np.uint8)
        if not len(q) or not len(self.keys):
            return out
        t, hit = _lookup(q * self.P + kv, self.keys, np.arange(len(self.keys)), -1)
        start, stop, lo, hi, full = self._iv[side]
        rows = np.flatnonzero(hit & ~full[np.maximum(t, 0)])
        out[hit & full[np.maximum(t, 0)]] = self._ones
        if len(rows):
            tt = t[rows]
            cnt = stop[tt] - start[tt]
            which = np.repeat(np.arange(len(rows)), cnt)
            iv = np.repeat(start[tt], cnt) + (np.arange(int(cnt.sum())) -
                                              np.repeat(np.cumsum(cnt) - cnt, cnt))
            diff = np.zeros((len(rows), self.n + 1), dtype=np.int32)
            np.add.at(diff, (which, lo[iv]), 1)
            np.add.at(diff, (which, hi[iv]), -1)
            out[rows] = np.packbits(np.cumsum(diff[:, :self.n], axis=1) > 0, axis=1)
        return out


def _merged(tile, lo, hi, n_tiles: int, n: int):
    """Intervals ``[lo, hi)`` per tile merged into disjoint sorted ones: ``(start, stop)``
    (each tile's span in the arrays), ``lo, hi``, and whether a tile's cover every block."""
    o = np.lexsort((lo, tile))
    tile, lo, hi = tile[o], lo[o], hi[o]
    big = np.int64(n + 1)
    run_hi = np.maximum.accumulate(tile * big + hi) - tile * big     # within the tile: keys rise
    new = np.ones(len(tile), dtype=bool)
    new[1:] = (tile[1:] != tile[:-1]) | (lo[1:] > run_hi[:-1])
    first = np.flatnonzero(new)
    last = np.append(first[1:], len(tile)).astype(np.int64) - 1
    if not len(tile):                       # an empty mask: no tile reads a block
        z = np.zeros(0, dtype=np.int64)
        return np.zeros(n_tiles, np.int64), np.zeros(n_tiles, np.int64), z, z, \
            np.zeros(n_tiles, dtype=bool)
    m_tile, m_lo, m_hi = tile[first], lo[first], run_hi[last]
    start = np.searchsorted(m_tile, np.arange(n_tiles))
    stop = np.searchsorted(m_tile, np.arange(n_tiles), side="right")
    cover = np.zeros(n_tiles, dtype=np.int64)
    np.add.at(cover, m_tile, m_hi - m_lo)
    return start, stop, m_lo, m_hi, cover == n


def _inputs() -> np.ndarray:
    """Family codes of what computes read (q, kv)."""
    return np.array(sorted({f for f, _, w in TILE_TOUCH_CODES[C_] if not w}), dtype=np.int64)


def _words(bits: np.ndarray) -> np.ndarray:
    """Packed bit rows ``[n, w]`` (uint8) as one unsigned word per row where ``w <= 8``
    (zero-padded to 1, 2, 4 or 8 bytes): OR, AND, NOT and gathers of words are those of the
    rows, with 1-D indexing and a fast 1-D ``ufunc.at`` (narrow's step loop gathers 16.8M rows
    at P=4,096). Wider rows as they are."""
    n, w = bits.shape
    if w > 8:
        return bits
    W = 1 << (w - 1).bit_length() if w > 1 else 1
    if W != w:
        wide = np.zeros((n, W), dtype=np.uint8)
        wide[:, :w] = bits
        bits = wide
    return np.ascontiguousarray(bits).view(np.dtype(f"u{W}")).reshape(n)


def _unwords(words: np.ndarray, w: int) -> np.ndarray:
    """The packed bit rows ``[n, w]`` of :func:`_words`' words."""
    if words.ndim == 2:
        return words
    return words.view(np.uint8).reshape(len(words), -1)[:, :w]


def _bits_of(ranges, n: int) -> np.ndarray:
    """The packed bit rows of range sets (``None``: every block)."""
    out = np.zeros((len(ranges), n), dtype=bool)
    for i, rs in enumerate(ranges):
        for lo, hi in rs:
            out[i, lo:hi] = True
    return np.packbits(out, axis=1)


def covered(programs: Sequence[Program], need: BlockNeed, *, backward: bool = False) -> None:
    """The block-range rules of a table whose transfers move ranges (nothing to check else):

    * every range lies inside the chunk (``[0, n)`` blocks);
    * every compute on a rank that received the buffer it reads by ranged hops reads only
      blocks those hops brought (a block left out would be read as zeros: a wrong number);
    * a rank forwards only blocks it holds (it owns the buffer, or they arrived).

    In the backward the same holds for the input buffers the gradient computes read again;
    the gradients follow the forward's ranges by rule (:func:`reverse`), and a gradient a
    rank sends on for another rank's chunk carries every block it holds (its tiles wrote
    them, or they arrived): else those never reach the chunk's owner.

    Raises:
        ScheduleError: naming the rank and step of the first fault.
    """
    tab = _table(programs)
    if not tab.ranged:
        return
    g = _Gen(tab)
    P, n = g.P, need.n
    for ranges, rng, rank, step in ((g.ranges, g.xrng, g.xs, g.xt),
                                    (g.sranges, g.srng, g.kr[g.ss], g.kt[g.ss])):
        top = max((hi for rs in ranges for _, hi in rs), default=0)
        if top > n:
            i = int(np.flatnonzero([max(hi for _, hi in rs) > n for rs in ranges])[0])
            row = int(np.flatnonzero(rng == i)[0])
            _fault(tab, int(rank[row]), int(step[row]),
                   f"a transfer moves blocks up to {top} of a chunk of {n} blocks "
                   f"(L / block_size); block ranges lie in [0, {n})")
    is_hop = np.isin(g.xf, _inputs())
    hop = slice(None) if is_hop.all() else np.flatnonzero(is_hop)   # views where all are (rings)
    bits_x = np.concatenate([_bits_of(g.ranges, n), need.whole()[None]])    # -1: whole
    bits_s = np.concatenate([_bits_of(g.sranges, n), need.whole()[None]])
    own = g.sidx == g.me[g.ss]
    recv = np.flatnonzero((g.sdir == 1) & np.isin(g.sf, _inputs()) & ~own)
    sent = np.flatnonzero((g.sdir == 0) & np.isin(g.sf, _inputs()) & ~own)
    def cat(a, b):                    # (no copy of the hops' rows where no slot brings one)
        return a if not len(b) else np.concatenate([a, b])
    got_key = g.bkey(g.xf[hop], g.xc[hop], g.xhs[hop]) * P
    got_key += g.xd[hop]
    got_key = cat(got_key, g.bkey(g.sf[recv], g.sc[recv], g.shs[recv]) * P + g.kr[g.ss[recv]])
    space, ids = _unique(got_key)
    del got_key
    bits_x, bits_s = _words(bits_x), _words(bits_s)       # one word per row where it fits
    held = np.zeros((len(space),) + bits_x.shape[1:], dtype=bits_x.dtype)   # what arrived
    np.bitwise_or.at(held, ids, cat(bits_x[g.xrng[hop]], bits_s[g.srng[recv]]))
    del ids

    def missing(want, have):          # rows of blocks wanted but not held
        lost = want & ~have
        return lost != 0 if lost.ndim == 1 else lost.any(axis=1)
    tiles = np.isin(g.ck, [C_, G_]) if backward else g.ck == C_
    for fam, side, w in TILE_TOUCH_CODES[C_]:
        if w:
            continue
        chunk = (g.cq, g.ckv)[side]
        rows = np.flatnonzero(tiles & (chunk != g.cr))
        k, hit = _lookup(g.bkey(fam, chunk[rows], g.chs[rows]) * P + g.cr[rows], space,
                         np.arange(len(space)), -1)
        rows, k = rows[hit], k[hit]
        reads = _words(need.bits(g.cq[rows], g.ckv[rows], side))
        bad = missing(reads, held[k])
        if bad.any():
            i = rows[np.flatnonzero(bad)]
            j = int(i[np.lexsort((g.ct[i], g.cr[i]))[0]])
            _fault(tab, int(g.cr[j]), int(g.ct[j]),
                   f"'{_tile_text(g, j)}' reads blocks of its "
                   f"{'q' if side == Q_SIDE else 'kv'} buffer that the ranged transfers to "
                   f"rank {int(g.cr[j])} do not bring (they would be read as zeros)")
    # moved on by a rank that does not own the buffer: only blocks that arrived there
    # (a batch of rows at a time: a ring forwards 16.8M hops at P=4,096, and each row's key,
    # blocks and lookup took 1 GB at once)
    fwd = np.flatnonzero(is_hop & (g.xs != g.xc))
    s_fwd = sent[g.sc[sent] != g.kr[g.ss[sent]]]
    for rows, key_of, moved_of, rank_of, step_of, what in (
            (fwd, lambda r: g.bkey(g.xf[r], g.xc[r], g.xhs[r]) * P + g.xs[r],
             lambda r: bits_x[g.xrng[r]], lambda r: g.xs[r], lambda r: g.xt[r], "a transfer"),
            (s_fwd, lambda r: g.bkey(g.sf[r], g.sc[r], g.shs[r]) * P + g.kr[g.ss[r]],
             lambda r: bits_s[g.srng[r]], lambda r: g.kr[g.ss[r]], lambda r: g.kt[g.ss[r]],
             "a collective")):
        if not len(rows) or not len(space):
            continue
        faults = []
        for lo in range(0, len(rows), _BATCH):
            r = rows[lo:lo + _BATCH]
            key = key_of(r)
            at = np.minimum(np.searchsorted(space, key), len(space) - 1)
            bad = space[at] == key
            del key
            bad &= missing(moved_of(r), held[at])
            if bad.any():
                faults.append(r[bad])
        if faults:
            i = np.concatenate(faults)
            rank, step = rank_of(i), step_of(i)
            j = int(np.lexsort((step, rank))[0])
            _fault(tab, int(rank[j]), int(step[j]),
                   f"{what} forwards blocks of a buffer that did not arrive at this rank")
    if backward:
        _gradients_sent_whole(tab, g, need, bits_x, bits_s, own, missing)


_BATCH = 1 << 20      # transfer rows at a time: temporaries of MBs, not of 16.8M rows


def _grads() -> np.ndarray:
    """Family codes of what gradient computes write (dq, dkv)."""
    return np.array(sorted({f for f, _, w in TILE_TOUCH_CODES[G_] if w}), dtype=np.int64)


def _word_columns(rows: np.ndarray) -> list[np.ndarray]:
    """Packed bit rows ``[n, w]`` as 1-D word columns whose bitwise ops are the rows':
    one (:func:`_words`) where ``w <= 8``, else one uint64 column per 8 bytes."""
    n, w = rows.shape
    if w <= 8:
        return [_words(rows)]
    k = -(-w // 8)
    wide = np.zeros((n, 8 * k), dtype=np.uint8)
    wide[:, :w] = rows
    return [np.ascontiguousarray(col) for col in wide.view(np.uint64).T]


def _gradients_sent_whole(tab, g, need: BlockNeed, bits_x, bits_s, own, missing) -> None:
    """A gradient a rank sends on for another rank's chunk carries every block it holds:
    the blocks its tiles wrote and the blocks that arrived (else those never reach the
    owner). :func:`_gradients_sent_whole_named` has the rule in full and names the fault.

    On the columns as they are: what each (gradient family, chunk, head slice, rank) holds
    in a dense array of block words by the 1-D ``np.bitwise_or.at`` (chunk-major: a ring's
    hops of one step touch neighbouring cells), then each send's word against it; the
    transfers a batch at a time, no sort and no int64 copy of a column (16.8M dkv hops at
    P=4,096). Past :data:`~._columns.PLANE_CELLS` cells (or 4 bytes a cell of it), the sorted
    rule."""
    P, C, HS = g.P, g.C, g.HS
    is_grad = np.zeros(_F, dtype=bool)
    is_grad[_grads()] = True
    fams = [f for f in _grads().tolist() if (g.xf == f).any() or (g.sf == f).any()]
    if not len(fams):                 # no gradient moves
        return
    cells = len(fams) * C * HS * P
    words_x = _word_columns(_unwords(bits_x, need.nbytes))       # [range set] (-1: whole)
    words_s = _word_columns(_unwords(bits_s, need.nbytes))
    width = sum(w.itemsize for w in words_x)                     # bytes a cell
    if cells > min(_columns.PLANE_CELLS, 2 ** 31 - 1) or cells * width > 4 * _columns.PLANE_CELLS:
        return _gradients_sent_whole_named(tab, g, need, bits_x, bits_s, own, missing)
    ix = np.full(_F, -1, dtype=np.int32)
    ix[fams] = np.arange(len(fams))

    def at(fam, chunk, hs, rank) -> np.ndarray:
        """The cells of (family code, chunk, head slice code, rank) rows, int32 (cells <
        2**31); ``hs`` a function of the rows' selector (read where HS > 1)."""
        c = ix[fam] if np.ndim(fam) else np.full(len(chunk), ix[fam], dtype=np.int32)
        c *= C
        c += chunk
        if HS > 1:
            c *= HS
            c += hs()
        c *= P
        c += rank
        return c

    def batches(sends: bool):
        """``(cells, range set ids)`` of the gradient hops a batch at a time: where they
        arrive, or (``sends``) where a rank that does not own the chunk sends them on."""
        for a in range(0, len(g.xf), _BATCH):
            b = slice(a, a + _BATCH)
            f, c, rank = g.xf[b], g.xc[b], (g.xs if sends else g.xd)[b]
            m = ix[f] >= 0
            if sends:
                m &= rank != c
            if not m.any():
                continue
            sel = slice(None) if m.all() else np.flatnonzero(m)
            yield at(f[sel], c[sel], lambda: g.xhs[b][sel], rank[sel]), g.xrng[b][sel]

    held = [np.zeros(cells, dtype=w.dtype) for w in words_x]
    for c, r in batches(False):
        for h, w in zip(held, words_x):
            np.bitwise_or.at(h, c, w[r])
    srank = g.kr[g.ss]
    grad_slot = np.flatnonzero(is_grad[g.sf] & ~own)              # (slots: few, int64)
    s_in = grad_slot[g.sdir[grad_slot] == 1]
    s_out = grad_slot[(g.sdir[grad_slot] == 0) & (g.sc[grad_slot] != srank[grad_slot])]
    if len(s_in):
        c = at(g.sf[s_in], g.sc[s_in], lambda: g.shs[s_in], srank[s_in])
        for h, w in zip(held, words_s):
            np.bitwise_or.at(h, c, w[g.srng[s_in]])
    for fam, side, w in TILE_TOUCH_CODES[G_]:
        if not w or ix[fam] < 0:
            continue
        chunk = (g.cq, g.ckv)[side]
        rows = np.flatnonzero((g.ck == G_) & (chunk != g.cr))
        c = at(fam, chunk[rows], lambda: g.chs[rows], g.cr[rows])
        for h, wt in zip(held, _word_columns(need.bits(g.cq[rows], g.ckv[rows], side))):
            np.bitwise_or.at(h, c, wt)

    def lost(c, r, words) -> bool:    # a send leaving out blocks its rank holds
        return any(((h[c] & ~w[r]) != 0).any() for h, w in zip(held, words))
    bad = any(lost(c, r, words_x) for c, r in batches(True))
    if not bad and len(s_out):
        bad = lost(at(g.sf[s_out], g.sc[s_out], lambda: g.shs[s_out], srank[s_out]),
                   g.srng[s_out], words_s)
    del held
    if bad:
        _gradients_sent_whole_named(tab, g, need, bits_x, bits_s, own, missing)   # names it
        raise RuntimeError("internal error: covered found a gradient sent on without blocks "
                           "its rank holds but cannot name it; please report it with the "
                           "programs")


def _gradients_sent_whole_named(tab, g, need: BlockNeed, bits_x, bits_s, own,
                                missing) -> None:
    """:func:`_gradients_sent_whole`'s rule on sorted int64 keys, naming the first fault
    (lowest rank, then step): the slow path, taken once the fast one found a fault. Each
    gradient (dq, dkv; a head slice on its own) a rank sends on for another rank's chunk, by
    a hop or a collective slot, carries every block that rank holds of it: the blocks its
    gradient tiles wrote (:class:`BlockNeed`) and those that arrived by hops or slots."""
    P = g.P
    grads = _grads()
    gx = np.flatnonzero(np.isin(g.xf, grads))
    recv = np.flatnonzero((g.sdir == 1) & np.isin(g.sf, grads) & ~own)
    sent = np.flatnonzero((g.sdir == 0) & np.isin(g.sf, grads) & ~own)
    ox, os_ = gx[g.xs[gx] != g.xc[gx]], sent[g.sc[sent] != g.kr[g.ss[sent]]]
    if not len(ox) and not len(os_):
        return
    s_rank = np.concatenate([g.xs[ox], g.kr[g.ss[os_]]])
    s_step = np.concatenate([g.xt[ox], g.kt[g.ss[os_]]])
    key = np.concatenate([g.bkey(g.xf[ox], g.xc[ox], g.xhs[ox]),
                          g.bkey(g.sf[os_], g.sc[os_], g.shs[os_])]) * P + s_rank
    space, ids = _unique(key)
    moved = np.concatenate([bits_x[g.xrng[ox]], bits_s[g.srng[os_]]])     # each send's
    held = np.zeros((len(space),) + bits_x.shape[1:], dtype=bits_x.dtype)

    def hold(k, bits):
        k, hit = _lookup(k, space, np.arange(len(space)), -1)
        np.bitwise_or.at(held, k[hit], bits[hit])
    hold(np.concatenate([g.bkey(g.xf[gx], g.xc[gx], g.xhs[gx]) * P + g.xd[gx],
                         g.bkey(g.sf[recv], g.sc[recv], g.shs[recv]) * P + g.kr[g.ss[recv]]]),
         np.concatenate([bits_x[g.xrng[gx]], bits_s[g.srng[recv]]]))
    for fam, side, w in TILE_TOUCH_CODES[G_]:
        if not w:
            continue
        chunk = (g.cq, g.ckv)[side]
        rows = np.flatnonzero((g.ck == G_) & (chunk != g.cr))
        hold(g.bkey(fam, chunk[rows], g.chs[rows]) * P + g.cr[rows],
             _words(need.bits(g.cq[rows], g.ckv[rows], side)))
    bad = missing(held[ids], moved)
    if bad.any():
        i = np.flatnonzero(bad)
        j = int(i[np.lexsort((s_step[i], s_rank[i]))[0]])
        _fault(tab, int(s_rank[j]), int(s_step[j]),
               "a gradient sent on leaves out blocks this rank holds (its tiles wrote them or "
               "they arrived): they never reach the chunk's owner; send every block it holds")


def _tile_text(g, j: int) -> str:
    letter = "C" if g.ck[j] == C_ else "G"
    h = "" if not g.chn[j] else f" h{int(g.chi[j])}/{int(g.chn[j])}"
    return f"{letter} q{int(g.cq[j])}·kv{int(g.ckv[j])}{h}"


def _fault(tab: ProgramTable, rank: int, step: int, what: str):
    raise ScheduleError(f"rank {rank}, step {step}: {what}\n{marked(tab.programs()[rank], step)}")
