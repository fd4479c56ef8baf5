"""``prune``: drop EMPTY tiles, and moves of a buffer (hops and a collective's
contributions) past the last rank that computes with it; :func:`_keep_hops` is the same rule
on hops (what :func:`~fringe.schedules.passes.lower` and the collective schedules ask)."""
from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from ..ir import C_, TILE_TOUCH_CODES, Program, ProgramTable
from . import _columns
from ._check import _gen
from ._columns import _F, _need_array, _table, gc_paused
from ._keys import _by_step, _lookup, _member, _runs, _uniq, _unique


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
        # a head slice is read from the slice or from its whole-heads parent (hs 0)
        slices = (g.chs, np.zeros_like(g.chs)) if g.chs.any() else (g.chs,)
        for fam, ch, hs in ((f, (g.cq, g.ckv)[sd], hs) for f, sd in c_reads for hs in slices):
            i, hit = _lookup(g.bkey(fam, ch, hs), ub, np.arange(len(ub)), 0)
            hit &= keep_c
            u_key.append(i[hit] * P + g.cr[hit])
        u_key = np.concatenate(u_key)
        m_t = np.concatenate([g.xt[hop], g.kt[side]])
        at_src = inv * P + np.concatenate([g.xs[hop], np.where(sends, mine, peer)])
        at_dst = inv * P + np.concatenate([g.xd[hop], np.where(sends, peer, mine)])
        if len(ub) * P <= _columns.PLANE_CELLS:      # a dense [buffer, rank] plane
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
        groups, c_ranges = coll["groups"], coll["ranges"]
        coll = {k: (v[keep_k] if k in ("rank", "step", "order", "kind", "group") else
                    new_side[np.asarray(v, dtype=np.int64)[keep_s]] if k == "slot_side" else
                    v[keep_s]) for k, v in coll.items() if k not in ("groups", "ranges")}
        coll["groups"], coll["ranges"] = groups, c_ranges
    return list(ProgramTable._of_parts(P, {k: v[keep_c] for k, v in comp.items()},
                                       _take_rows(xfer, keep_x),
                                       coll).programs())


def _take_rows(xfer: dict, keep: np.ndarray) -> dict:
    """The transfer part's rows ``keep`` (its range sets stay: ``rng`` indexes them)."""
    return {k: (v if k == "ranges" else v[keep]) for k, v in xfer.items()}
