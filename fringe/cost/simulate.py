"""The event simulator: run a plan's programs symbolically and predict where the time goes.

No tensors are made. Each tile costs what the work model says (:mod:`fringe.cost.work`),
each transfer latency plus bytes over bandwidth, and overlap follows the interpreter's real
order (see :mod:`fringe.runtime.interpreter`): at every step a rank *issues* its transfers
and collectives, *computes* its tiles, then *waits* for all of them; a step ends when both its
compute and its communication are done, a transfer cannot start before both ends have issued
it, and a collective not before every member has (a rank's collectives of one step run one
after the other).

Communication, per step (the alpha-beta model; :meth:`Hardware.collective_s` gives sources):

* point to point: ``latency + bytes / bandwidth``, where bytes is the busier end's traffic in
  that step (a rank's sends share its link);
* all-gather (AG) and reduce-scatter (RS), ring: ``(n - 1) * latency + bytes / bandwidth``
  with bytes the most one member receives (AG) or sends (RS), empty contributions (``-``)
  counting nothing: a full AG of b bytes each is the textbook ``(n - 1) * (latency + b /
  bandwidth)``;
* all-to-all (A2A), pairwise: ``(n - 1) * latency + max(bytes sent, bytes received) /
  bandwidth`` of the busiest member;
* the link: ``latency_s`` / ``bandwidth`` (NVLink on H100) when both ends, or every member of a
  collective, sit in one node of ``node_size`` consecutive ranks (8 on the H100 presets), else
  ``inter_latency_s`` / ``inter_bandwidth`` (InfiniBand on ``h100-ib``).

A head-sliced tile (``C q3·kv5 h1/4``, Ulysses) pays its kernel calls in full and 1/k of the
pairs and rows; a head-sliced buffer moves 1/k of the query heads (kv: the kv heads they read).

Moving bytes also costs the ranks at both ends their own time: ``Hardware.byte_s`` seconds per
byte a rank sends or receives in a step are added to its busy time in that step (the host-side
copies of a CPU transport run on the cores that compute; :func:`_busy`, 0 on the GPU presets).
A prediction's ``compute`` is that busy time.

The result carries the same :class:`~fringe.runtime.interpreter.StepRecord` values a measured
run leaves behind, so the reports and figures of :mod:`fringe.render` work for both.

The middle layer of the cost model: it reads the programs through
:mod:`fringe.cost.programs` (the IR only) and the tiles through :mod:`fringe.cost.work`.
What does not depend on the hardware (the program columns, the tile work) is derived once per
plan and kept in the plan's cache object (``plan.cache.simulate``, an entry this module alone
writes; never in the frozen plan's fields), so a plan simulated on several presets reads its
programs once.

>>> import fringe
>>> from fringe import masks, schedules
>>> from fringe.cost.simulate import simulate
>>> p = fringe.plan(schedules.zigzag(), masks.causal(), seq_len=4096, world_size=4)
>>> pred = simulate(p, hardware="h100-nvlink")
>>> pred.forward_s < pred.backward_s, round(pred.balance, 2)
(True, 1.0)

Legend: B batch · H query heads · G kv heads · S sequence · L tokens per rank · D head dim ·
P ranks.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import numpy as np

from ..runtime.interpreter import StepRecord
from .hardware import Hardware, Shape, check_head_split, get_hardware
from .programs import _Cols, _i64, columns, step_count
from .work import _costs, live_tile_work

__all__ = ["Prediction", "simulate"]

#: Products of int32 program columns (rank * steps, q * P) at or past this are made in int64.
_WIDE = 1 << 31

#: What the simulator derives from a plan that does not depend on the hardware, by plan:

@dataclasses.dataclass
class _Flat:
    """One direction's programs as flat arrays, ready to run."""

    steps: np.ndarray            # sorted distinct global step indices
    active: np.ndarray           # [P, T] bool: rank has a step at that index
    cells: np.ndarray            # per tile compute, step-major ``position * P + rank``, sorted
    work: np.ndarray             # seconds of those tiles, in the same order
    sends: tuple                 # (rank, step position, peer, bytes) arrays
    colls: tuple                 # collective sides: (rank, position, instance) + instances
    live_peak: np.ndarray        # [P] peak bytes of other ranks' buffers alive at once


def _flatten(cols: _Cols, keys: np.ndarray, fixed: np.ndarray, per_heads: np.ndarray,
             hw: Hardware) -> _Flat:
    """``fixed``, ``per_heads``: the seconds of the tiles ``keys`` (``q * P + kv``, sorted; a
    tile not among them costs nothing)."""
    P = cols.P
    c_rank, c_step, _, c_q, c_kv, c_split = cols.comp
    s_rank, s_step, s_peer, s_bytes = cols.send
    k_rank, k_step, k_gid, k_ord, k_kind, k_sent, k_recv = cols.coll
    if cols.static is None:
        every = (c_step, s_step, k_step, *(u[1] for u in cols.touch))
        present = np.zeros(1 + max((int(s.max()) for s in every if len(s)), default=-1),
                           dtype=bool)
        for s in every:
            present[s] = True
        steps = np.flatnonzero(present)
    else:
        steps, active = cols.static
    T = len(steps)
    if not T or int(steps[-1]) == T - 1:              # steps 0..T-1: positions are steps
        def at(step):
            return step
    else:
        lut = np.zeros(int(steps[-1]) + 1, dtype=np.int32 if T < _WIDE else np.int64)
        lut[steps] = np.arange(T)

        def at(step):
            return lut[step]
    if P * max(T, P) >= _WIDE:                       # int32 columns: rank * T would wrap
        c_rank, s_rank, s_peer, c_q = (x.astype(np.int64) for x in (c_rank, s_rank, s_peer, c_q))
    s_pos = at(s_step)
    if cols.static is None:        # what the touches give, once per plan; then drop them
        touch = [(r if P * T < _WIDE else r.astype(np.int64), at(st), b, start, *rows)
                 for r, st, b, start, *rows in cols.touch]
        active = np.zeros(P * T, dtype=bool)
        for t in ((c_rank, at(c_step), c_rank, False), (s_rank, s_pos, s_rank, False),
                  (k_rank, at(k_step), k_rank, False), *touch):
            for r, pos, _, _ in _pieces(t):
                active[r * T + pos] = True
        active = active.reshape(P, T)
        cols.live_peak = _live_peak(P, T, touch, cols.buf_bytes)
        cols.static, cols.touch = (steps, active), ()
        del touch
    flat_q = c_q * P + c_kv
    at_k = np.minimum(np.searchsorted(keys, flat_q), max(len(keys) - 1, 0))
    hit = keys[at_k] == flat_q if len(keys) else np.zeros(len(flat_q), dtype=bool)
    del flat_q
    if (c_split == 1).all():
        w = np.where(hit, (fixed + per_heads)[at_k] if len(keys) else 0.0, 0.0)
    else:
        w = np.where(hit, (fixed[at_k] + per_heads[at_k] / c_split) if len(keys) else 0.0, 0.0)
    # step-major cells, sorted (stable: a cell's tiles keep the columns' op order, so its
    # seconds sum in the order the interpreter runs them)
    cell = at(c_step).astype(np.int64) * P + c_rank
    order = np.argsort(cell, kind="stable")
    sends = (s_rank, s_pos, s_peer, s_bytes)
    colls = _instances(cols, at, hw)
    return _Flat(steps, active, cell[order], w[order], sends, colls, cols.live_peak)


def _instances(cols: _Cols, at, hw: Hardware) -> tuple:
    """Collective sides grouped into instances (one per step, group and ordinal).

    Returns ``(rank, pos, sent, recv, inst, waves, duration)``: the sides sorted by (step,
    ordinal, instance); ``waves`` maps a step position to its ``(side start, side stop,
    instance starts)`` runs, one per ordinal; ``duration`` per instance (see
    :meth:`Hardware.collective_s`).
    """
    k_rank, k_step, k_gid, k_ord, k_kind, k_sent, k_recv = cols.coll
    if not len(k_rank):
        return None
    pos = at(k_step)
    G = len(cols.groups)
    O = int(k_ord.max()) + 1
    key = (pos * O + k_ord) * G + k_gid
    order = np.argsort(key, kind="stable")
    key, rank, pos, gid = key[order], k_rank[order], pos[order], k_gid[order]
    kind, sent, recv, ordv = k_kind[order], k_sent[order], k_recv[order], k_ord[order]
    head = np.r_[True, key[1:] != key[:-1]]
    starts = np.flatnonzero(head)
    inst = np.cumsum(head) - 1
    sizes = _i64([len(g) for g in cols.groups])
    ns = hw.node_size
    intra = np.array([not ns or len({m // ns for m in g}) == 1 for g in cols.groups])
    ikind, igid = kind[starts], gid[starts]
    load = np.where(ikind == 0, np.maximum.reduceat(recv, starts),
                    np.where(ikind == 1, np.maximum.reduceat(sent, starts),
                             np.maximum(np.maximum.reduceat(recv, starts),
                                        np.maximum.reduceat(sent, starts))))
    dur = hw.collective_s(sizes[igid], load.astype(np.float64), intra[igid])
    waves: dict[int, list] = {}
    wkey = pos * O + ordv
    wstart = np.flatnonzero(np.r_[True, wkey[1:] != wkey[:-1]])
    wstop = np.r_[wstart[1:], len(wkey)]
    for a, b in zip(wstart.tolist(), wstop.tolist()):
        i0, i1 = int(inst[a]), int(inst[b - 1]) + 1
        waves.setdefault(int(pos[a]), []).append((a, b, i0, starts[i0:i1] - a))
    return rank, pos, sent, recv, inst, waves, dur


#: The most bytes of dense ``[rank, buffer]`` first / last step tables :func:`_live_peak`
#: allocates (int16 steps where they fit): zigzag at P=4,096 on documents needs 268 MB, where
#: compacting its 33.6M (rank, buffer) keys by a sort took 1.1 GB at once. Past it: the sort.
LIVE_DENSE_BYTES = 1 << 29
#: Live (rank, buffer) pairs :func:`_live_peak` turns into step bins at a time (and touch
#: rows it reads at a time).
LIVE_PIECE = 1 << 20
#: ``(step, rank)`` cells :func:`_run` simulates at a time (whole steps): its working arrays
#: are ``[steps, P]`` slabs of this many cells and the block's transfers.
STEP_CELLS = 1 << 20
#: ``P x T`` cells up to which :func:`simulate` keeps a direction's per-(rank, step)
#: timelines by default (ten ``[P, T]`` arrays: ~340 MB at this size; zigzag at P=4,096 has
#: 16.8M cells a direction, 1.3 GB for both, where its per-rank totals take 0.3 MB).
TIMELINE_CELLS = 1 << 22
#: The share of live ``[rank, buffer]`` cells past which :func:`_live_peak` bins every cell
#: of the dense table (a block of ranks at a time: zigzag's ring, half of them live) rather
#: than the live pairs (``np.add.at``: a ring on documents, a few thousand of 33.6M cells).
LIVE_DENSE_SHARE = 0.25
#: ``[rank, buffer]`` cells :func:`_live_peak` bins at a time (whole ranks; dense tables).
LIVE_SMALL = 1 << 20


def _pieces(t: tuple):
    """A touch group ``(rank, position, buffer id, start[, rows])`` as pieces of
    :data:`LIVE_PIECE` rows ``(rank, position, buffer id, start)``, its ``rows`` applied
    (start: an array, or one bool)."""
    r, pos, b, start, *rows = t
    rows = rows[0] if rows else None
    for i in range(0, len(r), LIVE_PIECE):
        j = i + LIVE_PIECE
        st = start[i:j] if isinstance(start, np.ndarray) else start
        if rows is None:
            yield r[i:j], pos[i:j], b[i:j], st
            continue
        m = rows[i:j]
        yield r[i:j][m], pos[i:j][m], b[i:j][m], (st[m] if isinstance(st, np.ndarray) else st)


def _live_peak(P: int, T: int, touch: list, size_of: np.ndarray) -> np.ndarray:
    """Peak bytes of other ranks' buffers alive at once on each rank: a buffer lives from the
    first step it arrives or is written there to the last step an op touches it. ``touch``:
    groups of ``(rank, position, buffer id, start[, rows])`` (see :func:`_pieces`)."""
    peak = np.zeros(P, dtype=np.int64)
    touch = [t for t in touch if len(t[0])]
    if not touch or not any(bool(np.any(t[3])) for t in touch):
        return peak
    used = np.zeros(len(size_of), dtype=bool)
    for t in touch:
        for _, _, b, _ in _pieces(t):
            used[b] = True
    ids = np.flatnonzero(used)                        # the buffers touched anywhere
    NB = len(ids)
    step_bytes = 2 if T < (1 << 15) - 1 else 8
    if P * NB * 2 * step_bytes > LIVE_DENSE_BYTES:    # compact the keys (large sliced plans)
        touch = [tuple(np.concatenate(x) if isinstance(x[0], np.ndarray) else x[0]
                       for x in zip(*_pieces(t))) for t in touch]      # the rows, copied
        remap = np.cumsum(used) - 1
        keys = [t[0].astype(np.int64) * NB + remap[t[2]] for t in touch]
        uniq, inv = np.unique(np.concatenate(keys), return_inverse=True)
        inv = inv.reshape(-1)
        bounds = np.cumsum([0] + [len(k) for k in keys])
        keys = [inv[a:b] for a, b in zip(bounds[:-1], bounds[1:])]
        nk, pt = len(uniq), np.int64
        keyed = list(zip(keys, ((pos, start) for _, pos, _, start in touch)))
    else:                                             # int32 keys, int16 steps where they fit
        uniq, nk = None, P * NB
        kt = np.int32 if nk < 1 << 31 else np.int64
        pt = np.int16 if T < (1 << 15) - 1 else np.int64
        remap = (np.cumsum(used) - 1).astype(kt)

        def each():                                   # a piece at a time: no key column
            for t in touch:
                for r, pos, b, start in _pieces(t):
                    k = r.astype(kt)
                    k *= kt(NB)
                    k += remap[b]
                    yield k, (pos, start)
        keyed = each()
    first = np.full(nk, T, dtype=pt)
    last = np.full(nk, -1, dtype=pt)
    for key, (pos, start) in keyed:
        pos = pos.astype(pt, copy=False)
        if isinstance(start, np.ndarray):
            if start.any():
                np.minimum.at(first, key[start], pos[start])
        elif start:
            np.minimum.at(first, key, pos)
        np.maximum.at(last, key, pos)
    n_alive = int(np.count_nonzero(first < T))       # the live (rank, buffer) pairs
    if uniq is None and n_alive >= LIVE_DENSE_SHARE * nk:   # many: dense, ranks a block
        first, last = first.reshape(P, NB), last.reshape(P, NB)     # at a time, no index
        size = size_of[ids].astype(np.float64)        # arrays (whole bytes: sums exact)
        R = max(1, LIVE_SMALL // max(NB, 1))
        peak = np.empty(P, dtype=np.int64)
        for r0 in range(0, P, R):
            f, e = first[r0:r0 + R], last[r0:r0 + R]
            n = len(f)
            row = (np.arange(n, dtype=np.int64) * (T + 1))[:, None]
            F = f.astype(np.int64)
            F += row
            E = np.maximum(e, f).astype(np.int64)
            E += row + 1                              # not alive: past its row, weight 0
            sz = np.where(f < T, size[None, :], 0.0).reshape(-1)
            n_bins = n * (T + 1)
            delta = np.bincount(F.reshape(-1), weights=sz, minlength=n_bins)[:n_bins]
            delta -= np.bincount(E.reshape(-1), weights=sz, minlength=n_bins)[:n_bins]
            peak[r0:r0 + n] = np.cumsum(delta.reshape(n, T + 1), axis=1).max(axis=1).round()
        return peak
    n_bins = P * (T + 1)                              # else the live pairs, in pieces
    alive = np.flatnonzero(first < T)
    delta = np.zeros(n_bins)
    for lo in range(0, len(alive), LIVE_PIECE):
        at = alive[lo:lo + LIVE_PIECE]
        full_key = at if uniq is None else uniq[at]
        lr, lb = full_key // NB, ids[full_key % NB]
        F = lr * (T + 1) + first[at].astype(np.int64)
        E = lr * (T + 1) + np.maximum(last[at], first[at]).astype(np.int64) + 1
        sz = size_of[lb].astype(np.float64)           # whole bytes: sums exact in any order
        np.add.at(delta, F, sz)
        np.subtract.at(delta, E, sz)
    return np.cumsum(delta.reshape(P, T + 1), axis=1).max(axis=1).round().astype(np.int64)


def _counts(index: np.ndarray, weights: np.ndarray, n: int) -> np.ndarray:
    """``np.bincount`` with float64 weights, float64 even when empty."""
    return np.bincount(index, weights=np.asarray(weights, dtype=np.float64),
                       minlength=n).astype(np.float64, copy=False)


#: Transfers :func:`_step_order` sorts at a time.
ORDER_PIECE = 1 << 20


def _step_order(spos: np.ndarray, per_step: np.ndarray) -> np.ndarray:
    """The transfers in step order (a step's in row order): int32 indices where they fit, by
    a counting sort a piece of rows at a time (``np.argsort`` of all 16.8M at P=4,096 makes
    int64 indices, 134 MB at once). ``per_step``: the transfers of each step position."""
    n, T = len(spos), len(per_step)
    out = np.empty(n, dtype=np.int32 if n < _WIDE else np.int64)
    nxt = np.r_[0, np.cumsum(per_step)[:-1]].astype(np.int64)   # each step's next free slot
    small = np.int16 if T < 1 << 15 else np.int64                  # (a radix sort)
    for i in range(0, n, ORDER_PIECE):
        s = spos[i:i + ORDER_PIECE]
        o = np.argsort(s.astype(small), kind="stable")
        ss = s[o]
        head = np.flatnonzero(np.r_[True, ss[1:] != ss[:-1]])
        k = np.arange(len(ss)) - np.repeat(head, np.diff(np.r_[head, len(ss)]))
        out[nxt[ss] + k] = o + i                      # its step's slot, after earlier pieces'
        nxt += np.bincount(s, minlength=T)
    return out


#: The per-(rank, step) quantities of a prediction, in the order :func:`_run` makes them.
FIELDS = ("compute", "wait", "sent", "recv", "tiles")


def _run(flat: _Flat, hw: Hardware, P: int, keep: bool) -> tuple[dict, dict | None]:
    """Event simulation, a block of steps at a time: ``(totals, timelines)``.

    ``totals``: ``{field: [P]}`` per rank, summed over the steps in step order
    (:data:`FIELDS`), and ``end``: each rank's clock when its last step ends;
    ``timelines``: ``{field: [P, T]}`` per rank and step when ``keep``, else None (a block's
    ``[steps, P]`` slabs are summed and dropped: nothing ``[P, T]`` is made).

    At each step every active rank issues its transfers and collectives at its clock,
    computes, then waits for all of them (the interpreter's order). A point-to-point
    transfer starts when both ends have issued it and takes latency + bytes / bandwidth of
    the busier end's traffic in that step. A collective starts when every member has issued
    it (and finished its earlier collectives of the step: they run one after the other) and
    takes :meth:`Hardware.collective_s`. A step ends when its compute and all its
    communication are done. ``compute``: the step's tiles plus the host time of the bytes the
    rank sends and receives in it (``hw.byte_s`` per byte; see :func:`_busy`).
    """
    T = len(flat.steps)
    src, spos, dst, nbytes = flat.sends
    # the transfers in step order (a radix sort of their step positions), once, as int32
    # indices where they fit (16.8M transfers a direction at P=4,096); a block reads its
    # steps' transfers through them
    per_step = np.bincount(spos, minlength=T)
    order = _step_order(spos, per_step)
    bounds = np.r_[0, np.cumsum(per_step)].tolist()
    cbounds = np.searchsorted(flat.cells, np.arange(T + 1, dtype=np.int64) * P).tolist()
    waves: dict = {}
    if flat.colls is not None:
        c_rank, c_pos, c_sent, c_recv, _, waves, c_dur = flat.colls
        kbounds = np.searchsorted(c_pos, np.arange(T + 1)).tolist()
    totals = {f: np.zeros(P, dtype=np.int64 if f == "tiles" else np.float64) for f in FIELDS}
    kept = ({f: np.zeros((T, P), dtype=np.int64 if f == "tiles" else np.float64)
             for f in FIELDS} if keep else None)
    clock = np.zeros(P)
    # a block of steps at a time: (step, rank) cells step-major, the block's sums and gathers
    # in [steps, P] slabs
    B = max(1, STEP_CELLS // max(P, 1))
    for s0 in range(0, T, B):
        s1 = min(T, s0 + B)
        n, a = s1 - s0, bounds[s0]
        nc = n * P
        idx = order[a:bounds[s1]]
        bs, bd = src[idx], dst[idx]
        at = np.repeat(np.arange(n, dtype=np.int64), per_step[s0:s1])
        at *= P                                       # the block's (step, rank) cells
        ks, kd = at + bs, at + bd
        del at
        nb = nbytes[idx].astype(np.float64)           # whole bytes: sums exact in any order
        del idx
        sent, recv = _counts(ks, nb, nc), _counts(kd, nb, nc)
        dur = sent[ks]
        np.maximum(dur, recv[kd], out=dur)            # the busier end's bytes, over its link
        dur = hw.transfer_s(bs, bd, dur)
        # steps where no rank sends (receives) twice: the latest of its transfers is its only
        # one, so a plain assignment does what np.maximum.at does, without its per-element cost
        once_s = (np.bincount(ks, minlength=nc).reshape(n, P).max(axis=1) <= 1).tolist()
        once_d = (np.bincount(kd, minlength=nc).reshape(n, P).max(axis=1) <= 1).tolist()
        del ks, kd, nb
        if flat.colls is not None:
            ka, kb = kbounds[s0], kbounds[s1]
            cell = (c_pos[ka:kb] - s0) * P + c_rank[ka:kb]
            sent += _counts(cell, c_sent[ka:kb], nc)
            recv += _counts(cell, c_recv[ka:kb], nc)
        ca, cb = cbounds[s0], cbounds[s1]
        cell = flat.cells[ca:cb] - s0 * P
        compute = _counts(cell, flat.work[ca:cb], nc).reshape(n, P)
        tiles = np.bincount(cell, minlength=nc).reshape(n, P)
        sent, recv = sent.reshape(n, P), recv.reshape(n, P)
        busy = _busy(compute, sent, recv, hw)
        del compute, cell
        wait = np.zeros((n, P))
        sums = [(totals[f], x) for f, x in zip(FIELDS, (busy, wait, sent, recv, tiles))]
        for i in range(n):
            g = s0 + i
            done = clock + busy[i]
            lo, hi = bounds[g] - a, bounds[g + 1] - a
            if hi > lo:
                s, d = bs[lo:hi], bd[lo:hi]
                fin = np.maximum(clock[s], clock[d])
                fin += dur[lo:hi]
                for ends, one in ((s, once_s[i]), (d, once_d[i])):
                    if one:
                        done[ends] = np.maximum(done[ends], fin)
                    else:                             # a rank's several transfers: the last
                        np.maximum.at(done, ends, fin)
            if g in waves:
                ready = clock.copy()
                for wa, wb, i0, rel in waves[g]:
                    m = c_rank[wa:wb]
                    fin = np.maximum.reduceat(ready[m], rel) + c_dur[i0:i0 + len(rel)]
                    fin_m = np.repeat(fin, np.diff(np.r_[rel, wb - wa]))
                    np.maximum.at(ready, m, fin_m)
                    np.maximum.at(done, m, fin_m)
            wait[i] = done - clock - busy[i]          # exactly 0 where the rank has no step
            clock = done
            for tot, x in sums:                       # step by step: the same sums whatever
                tot += x[i]                           # the block size
        if keep:
            for f, x in zip(FIELDS, (busy, wait, sent, recv, tiles)):
                kept[f][s0:s1] = x
        del bs, bd, dur, busy, wait, sent, recv, tiles
    totals["end"] = clock
    return totals, ({f: x.T for f, x in kept.items()} if keep else None)


def _busy(compute: np.ndarray, sent: np.ndarray, recv: np.ndarray, hw: Hardware) -> np.ndarray:
    """Each rank's busy seconds per step (``[steps, P]`` slabs, elementwise): its tiles'
    compute plus ``hw.byte_s`` for every byte it sends or receives in that step (point to
    point and collectives).

    The host side of moving a byte (the transport's copies, packing a buffer to send,
    unpacking or accumulating one received) runs on the rank's own cores on a CPU, so it
    does not overlap with the rank's tiles the way the transfer's flight time does: it adds
    to them. This is the one place that prices it. The GPU presets set ``byte_s = 0``: their
    bytes move on copy engines beside the compute stream.
    """
    if not hw.byte_s:
        return compute
    return compute + hw.byte_s * (sent + recv)


class _Timelines(Mapping):
    """One per-(rank, step) field of a :class:`Prediction`, ``{direction: [P, T]}`` over the
    directions kept (both or none); reading one that was not kept says how to keep it."""

    def __init__(self, pred: "Prediction", field: str):
        self._pred, self._field = pred, field

    def __getitem__(self, which: str) -> np.ndarray:
        kept = self._pred.timelines
        if which not in self._pred.totals:
            raise KeyError(which)
        if which not in kept:
            P, T = self._pred.world_size, len(self._pred.steps[which])
            raise ValueError(
                f"this prediction kept the {which} per-rank totals only "
                f"(pred.totals[{which!r}]): its per-(rank, step) timelines, P={P:,} ranks x "
                f"T={T:,} steps, would take {P * T * 41 / 1e9:.2g} GB; "
                f"simulate(plan, ..., timelines=True) keeps them")
        return kept[which][self._field]

    def __contains__(self, which) -> bool:
        return which in self._pred.timelines

    def __iter__(self):
        return iter(self._pred.timelines)

    def __len__(self) -> int:
        return len(self._pred.timelines)


@dataclasses.dataclass
class Prediction:
    """What the cost model predicts for one plan on one machine.

    Attributes:
        name: a label (the plan's schedule name).
        hardware: the machine model used.
        shape: the tensor shapes assumed.
        steps: ``{"forward": [T], "backward": [T]}`` global step indices.
        totals: ``{"forward"/"backward": {field: [P]}}`` per rank, summed over its steps, for
            the fields ``compute``, ``wait``, ``sent``, ``recv``, ``tiles`` below, and ``end``:
            the rank's clock when its last step ends (its compute plus its waits): what every
            summary (spans, balance, bytes) reads.
        memory: ``[P]`` predicted peak bytes per rank (resident tensors + received buffers
            alive at once, forward or backward, whichever is larger).
        timelines: ``{direction: {field: [P, T]}}`` for the directions whose per-(rank, step)
            arrays were kept (see :func:`simulate`'s ``timelines``); read them as below.
        compute, wait, sent, recv, tiles: ``{"forward"/"backward": [P, T]}`` arrays (seconds,
            seconds, bytes, bytes, count) per rank and step; ``compute`` is the rank's busy
            time: its tiles plus the host time of the bytes it moves (``Hardware.byte_s``).
            A direction not kept raises a ValueError saying how to keep it.
        active: ``{...: [P, T]}`` whether the rank has that step (kept with the others).
    """

    name: str
    hardware: Hardware
    shape: Shape
    world_size: int
    seq_len: int
    steps: dict
    totals: dict
    memory: np.ndarray
    timelines: dict = dataclasses.field(default_factory=dict, repr=False)

    compute = property(lambda self: _Timelines(self, "compute"))
    wait = property(lambda self: _Timelines(self, "wait"))
    sent = property(lambda self: _Timelines(self, "sent"))
    recv = property(lambda self: _Timelines(self, "recv"))
    tiles = property(lambda self: _Timelines(self, "tiles"))
    active = property(lambda self: _Timelines(self, "active"))

    def span(self, which: str = "forward") -> float:
        """Seconds from the first issue to the last rank's end (the step's makespan)."""
        return float(self.totals[which]["end"].max(initial=0.0))

    @property
    def forward_s(self) -> float:
        return self.span("forward")

    @property
    def backward_s(self) -> float:
        return self.span("backward")

    @property
    def step_s(self) -> float:
        """Forward plus backward of one attention layer."""
        return self.forward_s + self.backward_s

    @property
    def balance(self) -> float:
        """max / mean compute seconds per rank (forward + backward)."""
        c = self.totals["forward"]["compute"] + self.totals["backward"]["compute"]
        return float(c.max() / c.mean()) if c.mean() > 0 else 1.0

    def exposed(self, which: str | None = None) -> float:
        """Waiting / (compute + waiting), summed over ranks (as ``RunStats`` reports it)."""
        whichs = (which,) if which else ("forward", "backward")
        w = sum(float(self.totals[x]["wait"].sum()) for x in whichs)
        c = sum(float(self.totals[x]["compute"].sum()) for x in whichs)
        return w / (w + c) if w + c else 0.0

    def bytes_per_rank(self) -> float:
        """Largest bytes one rank sends (forward + backward)."""
        return float((self.totals["forward"]["sent"] + self.totals["backward"]["sent"]).max())

    def records(self, which: str = "forward") -> list[StepRecord]:
        """The prediction as the per-step records a measured run leaves (one per rank·step);
        needs the direction's timelines (kept: see :func:`simulate`)."""
        act = self.active[which]
        out = []
        for r, i in zip(*np.nonzero(act)):
            out.append(StepRecord(int(r), int(self.steps[which][i]),
                                  float(self.compute[which][r, i]), float(self.wait[which][r, i]),
                                  int(self.tiles[which][r, i]), int(self.sent[which][r, i]),
                                  int(self.recv[which][r, i])))
        return out

    def row(self) -> dict:
        """One summary row (what ``python -m fringe simulate`` prints)."""
        mem = float(self.memory.max())
        return {"schedule": self.name, "step ms": self.step_s * 1e3,
                "fwd ms": self.forward_s * 1e3, "bwd ms": self.backward_s * 1e3,
                "balance": self.balance, "exposed comm": self.exposed(),
                "sent MB/rank": self.bytes_per_rank() / 1e6, "memory MB/rank": mem / 1e6}


def simulate(plan, hardware: str | Hardware = "cpu", shape: Shape = Shape(), *,
             name: str | None = None, timelines: bool | None = None) -> Prediction:
    """Predict a plan's forward and backward on ``hardware`` for tensors of ``shape``.

    Args:
        plan: from :func:`fringe.plan`.
        hardware: a preset name (see :data:`fringe.cost.hardware.HARDWARE`) or a
            :class:`Hardware` (:func:`fringe.cost.calibrate.calibrate` measures this machine).
        shape: batch, heads, kv heads, head dim and dtype of q/k/v.
        name: label for reports (default: the schedule's name).
        timelines: keep each direction's per-(rank, step) arrays (``pred.compute[...]``,
            ``.records()``, the timeline figures): True always, False never (the summaries
            and ``pred.totals`` need only per-rank sums), None (default) where ``P x T`` is
            at most :data:`TIMELINE_CELLS`, T the longer direction's steps (both directions
            kept, or neither). The simulation is the same either way: a block of steps at a
            time, summed per rank.

    Returns:
        A :class:`Prediction`; ``.records("forward")`` are :class:`StepRecord` values.

    Raises:
        ValueError: the plan splits heads in a way ``shape`` does not allow (Ulysses over
            more ranks than heads), saying what would.
    """
    hw = get_hardware(hardware)
    P, L = plan.world_size, plan.local_len
    label = name or plan.schedule.name
    # what does not depend on the hardware, once per plan (several presets, one plan)
    cache = plan.cache.simulate      # {(direction, shape): program columns, "work": tile work}
    def cols(which):
        key = (which, shape)
        if key not in cache:
            cache[key] = columns(plan.forward if which == "forward" else plan.backward, L,
                                 shape, plan.block_size)
        c = cache[key]              # every call: a cached plan is checked as a fresh one
        for n in sorted(set(c.splits) | {int(k) for k in (
                np.flatnonzero(np.bincount(c.comp[5])) if len(c.comp[5]) else ())}):
            if n > 1:               # (splits: small ints)
                check_head_split(n, shape.heads, shape.kv_heads,
                                 what=f"schedule {label!r} (heads split {n} ways)")
        return c

    out = dict(steps={}, totals={}, timelines={})
    peak = np.zeros(P, dtype=np.int64)
    if timelines is None:           # both directions or neither: by the longer one's steps
        timelines = P * max(step_count(plan.forward), step_count(plan.backward)) \
            <= TIMELINE_CELLS
    for which in ("forward", "backward"):       # one direction's columns at a time (memory)
        c = cols(which)
        if "work" not in cache:
            cache["work"] = live_tile_work(plan)
        keys, work = cache["work"]
        fixed, per_heads = _costs(work, L, hw, shape, which == "backward")
        flat = _flatten(c, keys, fixed, per_heads, hw)
        keep = bool(timelines)
        totals, kept = _run(flat, hw, P, keep)
        out["steps"][which] = flat.steps
        out["totals"][which] = totals
        if keep:
            out["timelines"][which] = {**kept, "active": flat.active}
        peak = np.maximum(peak, flat.live_peak)
        del flat, kept
    # resident per rank: q, k, v, out (+lse), and in the backward dout, dq, dk, dv as well
    resident = (2 * shape.buffer_bytes("q", L) + shape.buffer_bytes("kv", L)
                + shape.buffer_bytes("out", L) + shape.buffer_bytes("dq", L)
                + shape.buffer_bytes("dkv", L))
    return Prediction(label, hw, shape, P, plan.seq_len, memory=peak + resident, **out)
