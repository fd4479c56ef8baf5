"""``narrow``: give every hop of an input buffer (q, kv) the block ranges that its receiver,
and every rank it forwards the buffer to later, read (:class:`~._blocks.BlockNeed`)."""
from __future__ import annotations

from typing import Sequence

import numpy as np

from ..ir import C_, TILE_TOUCH_CODES, Program, ProgramTable
from ._blocks import BlockNeed, _inputs
from ._check import _gen
from ._columns import _table, gc_paused
from ._keys import _by_step, _lookup, _runs, _unique


def _reads(g, need: BlockNeed):
    """Each compute's reads of input buffers as ``(buffer key, rank, packed bits)``."""
    c = g.ck == C_
    keys, ranks, bits = [], [], []
    for fam, side, w in TILE_TOUCH_CODES[C_]:
        if w:
            continue
        chunk = (g.cq, g.ckv)[side]
        keys.append(g.bkey(fam, chunk[c], g.chs[c]))
        ranks.append(g.cr[c])
        bits.append(need.bits(g.cq[c], g.ckv[c], side))
    return np.concatenate(keys), np.concatenate(ranks), np.concatenate(bits)


@gc_paused()
def narrow(programs: Sequence[Program], need: BlockNeed) -> list[Program]:
    """Give every whole hop of an input buffer (q, kv) the block ranges it must carry: the
    blocks its receiver's computes read (:class:`BlockNeed`), and those of every rank it
    forwards the buffer to later (a hop on a route carries what the rest of the route
    reads). A hop that carries every block stays whole; a buffer a rank passes on by a
    collective is whole there. Programs that already move ranges are returned as they are
    (their ranges are the writer's; :func:`check` with ``blocks=`` verifies them)."""
    tab = _table(programs)
    if tab.ranged:
        return list(tab.programs())
    g = _gen(tab)
    P = g.P
    hop = np.flatnonzero(np.isin(g.xf, _inputs()))
    if not len(hop):
        return list(tab.programs())
    hb = g.bkey(g.xf[hop], g.xc[hop], g.xhs[hop])
    rk, rr, rbits = _reads(g, need)
    at_dst0, at_src0 = hb * P + g.xd[hop], hb * P + g.xs[hop]
    space, ids = _unique(np.concatenate([at_dst0, at_src0]))
    K, m = len(space), len(hop)
    at_dst, at_src = ids[:m], ids[m:]
    use = np.zeros((K, need.nbytes), dtype=np.uint8)
    u, hit = _lookup(rk * P + rr, space, np.arange(K), -1)
    if hit.any():
        np.bitwise_or.at(use, u[hit], rbits[hit])
    live = np.zeros_like(use)
    # a buffer a rank passes on by a collective stays whole there
    sends = (g.sdir == 0) & np.isin(g.sf, _inputs())
    if sends.any():
        sk = g.bkey(g.sf[sends], g.sc[sends], g.shs[sends]) * P + g.kr[g.ss[sends]]
        k, hit = _lookup(sk, space, np.arange(K), -1)
        live[k[hit]] = need.whole()
    carry = np.zeros((m, need.nbytes), dtype=np.uint8)
    by_step = _by_step(g.xt[hop], descending=True)
    _, starts = _runs(g.xt[hop][by_step])
    ends = list(starts[1:]) + [m]
    for a, b in zip(starts.tolist(), ends):        # latest step first
        s = by_step[a:b]
        carry[s] = use[at_dst[s]] | live[at_dst[s]]
        src = at_src[s]
        if len(np.unique(src)) == len(src):
            live[src] |= carry[s]
        else:
            np.bitwise_or.at(live, src, carry[s])
    whole = (carry == need.whole()).all(axis=1)
    rng = np.full(len(g.xf), -1, np.int64)
    part = np.flatnonzero(~whole)
    ranges: tuple = ()
    if len(part):
        rows, inv = np.unique(carry[part], axis=0, return_inverse=True)
        ranges = tuple(_ranges_of(r, need.n) for r in rows)
        rng[hop[part]] = inv.reshape(-1)
    comp, xfer, coll = tab._parts
    x = {k: v for k, v in xfer.items()}
    x["rng"], x["ranges"] = rng, ranges
    return list(ProgramTable._of_parts(P, comp, x, coll).programs())


def _ranges_of(row: np.ndarray, n: int) -> tuple[tuple[int, int], ...]:
    """The half-open block ranges of a packed bit row."""
    b = np.unpackbits(row)[:n].astype(np.int8)
    d = np.diff(np.concatenate([[0], b, [0]]))
    return tuple(zip(np.flatnonzero(d == 1).tolist(), np.flatnonzero(d == -1).tolist()))
