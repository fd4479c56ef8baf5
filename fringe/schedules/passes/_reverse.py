"""``reverse``: the backward programs, derived by rule from forward ones (the ring chain's
shortcut :func:`_reverse_parts` first, else :func:`_general_reverse`), with the re-sends of
the inputs the backward reads again (:func:`_resend_parts`)."""
from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from ..ir import (ADJOINT_CODE, C_, COLL_KINDS as ir_kinds, COLLECTIVE_ADJOINT, OWN_SLOT_IN_PLACE,
                  TILE_TOUCH_CODES, Buffer, Collective, Family, GradCompute, Program, ProgramTable,
                  Recv, ScheduleError, Send, concat_column, marked, step_scalar)
from . import _columns
from ._check import _gen, check
from ._columns import (_F, _FAMILIES, _FAMILY_CODE, _INPUTS, _KV, _OUT, _Q, _Gen, _slices, _table,
                       gc_paused)
from ._keys import (_assign_min, _by_step, _lookup, _member, _min_by_key, _row_keys, _runs,
                    _spans, _uniq)


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
    if P * P > _columns.DENSE_CELLS or (ck != C_).any() or (cq != cr).any() or (xf != KV).any():
        return None
    if not len(cr) and not len(xs):
        return list(ProgramTable._of_parts(P, comp, xfer).programs())
    if len(xs) and ((xc == xd).any() or np.bincount(xc * P + xd, minlength=P * P).max() > 1):
        return None                         # kv arriving twice: the general reverse names it
    T = max(int(ct.max()) if len(ct) else -1, int(xt.max()) if len(xt) else -1) + 1
    bcomp = dict(rank=cr, step=T - ct, kind=np.full(len(cr), ADJOINT_CODE[C_], np.int64), q=cq, kv=ckv,
                 order=comp["order"])
    Tx = step_scalar(T)
    bx = [dict(step=Tx - xt, src=xd, dst=xs, fam=np.full(len(xs), _FAMILY_CODE[Family.DKV]),
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


def _resend_parts(P, T, cr, ct, ckv, xt, xs, xd, xc, xorder, after, owner=None, xrng=None):
    """The backward's kv re-send on the hops themselves: the kv re-sends of the backward as
    transfers (orders from ``after`` on, in (chunk, rank) order: after every adjoint op).

    With ``owner`` (int array), ``ckv`` and ``xc`` are buffer ids ``[0, len(owner))`` instead
    of kv chunks, ``owner[id]`` the rank that owns the buffer's data; the rows' ``chunk`` is
    then the buffer id, and orders go by (id, rank).

    With ``xrng`` (the hops' range-set ids, -1 whole), a re-send carries the ranges of the
    hop that brought the buffer to its receiver in the forward, and a rank relays a buffer
    up only where the hop into it carried the same ranges as the hop into the rank above
    (ranges narrow along a route, so a rank further down holds fewer blocks than the one
    above needs): else the owner sends it (the rows' ``rng``).

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
    own = np.arange(P) if owner is None else owner
    nb = len(own)
    n = len(xc)
    # steps, ranks and hop numbers in int32 where they fit: [buffer, rank] planes and arrays
    # per hop (16.8M hops at P=4,096: 67 MB each, not 134)
    it = np.int32 if max(T, n, P) < 2 ** 31 - 1 else np.int64
    NONE = it(np.iinfo(it).max)                     # no re-send (steps are < T < NONE)
    if nb * P <= _columns.PLANE_CELLS:              # (buffer, rank) cells < 2**31: int32 keys
        K = nb * P

        def ix(b, r):
            k = b.astype(it)
            k *= it(P)
            k += r
            return k
        rk = ix(ckv, cr)
        remote = own[ckv] != cr
        in_key, out_key = ix(xc, xd), ix(xc, xs)
    else:                                           # the (buffer, rank) keys that occur
        i64 = np.int64                              # (ids may be int32: keys past 2**31)
        rk0 = ckv.astype(i64) * P + cr              # (buffer, rank) of each read
        remote = own[ckv] != cr
        in0, out0 = xc.astype(i64) * P + xd, xc.astype(i64) * P + xs
        space = _uniq(np.concatenate([in0, out0, rk0[remote]]))
        K = len(space) + 1                          # + a sink for keys that do not occur

        def ix(b, r):
            return _lookup(b.astype(i64) * P + r, space, np.arange(len(space)), len(space))[0]
        in_key, out_key, rk = ix(xc, xd), ix(xc, xs), ix(ckv, cr)
        del rk0, in0, out0
    maxread = np.full(K, -1, it)
    maxread[rk] = np.maximum(maxread[rk], ct)
    if len(rk) and not (maxread[rk] >= ct).all():
        np.maximum.at(maxread, rk, ct.astype(it))
    hop_of = np.full(K, -1, it)                     # [buffer, rank]: the hop that brought it
    hop_of[in_key] = np.arange(n, dtype=it)
    if remote.any() and (hop_of[rk[remote]] < 0).any():
        raise _Unsent()
    del remote, rk                                  # (memory: hops are 16.8M at P=4,096)
    if not n:
        return _no_xfer()
    # each (buffer, rank)'s latest hop onwards (first in program order among the latest)
    if n and np.bincount(out_key, minlength=K).max() > 1:
        o = np.lexsort((xorder, -xt, out_key))
        o = o[_runs(out_key[o])[1]]
    else:
        o = slice(None)
    sup_t = np.full(K, -1, it)
    sup_d = np.full(K, -1, it)
    sup_t[out_key[o]] = xt[o]
    sup_d[out_key[o]] = xd[o]
    del o
    reads = maxread[in_key]                         # per hop: the receiver's last read
    up = hop_of[out_key]                            # per hop: the hop that brought it to src
    del maxread
    # the receiver relays b up: its upstream's latest hop of b went to it, so it re-sends b
    relay_up = sup_d[out_key] == xd
    relay_up &= up >= 0
    del out_key
    # up >= 0 wherever relay_up: from here on up is read there only, so clipped in place (the
    # upstream hop, 0 where none: 16.8M hops at P=4,096)
    up0 = np.maximum(up, 0, out=up)
    if xrng is not None:                            # and holds what its upstream reads
        relay_up &= xrng[up0] == xrng
    late = relay_up & (xt[up0] >= xt)
    if late.any():
        i = int(np.flatnonzero(late)[0])
        raise _Late(i, int(up[i]))
    del late
    # a rank needs b when it reads it, or when it relays b up to a rank that needs it
    idx = np.arange(n, dtype=it)
    if (up[relay_up] == idx[relay_up] - 1).all():  # chains in hop order: segmented prefix OR
        seg = np.where(relay_up, 0, idx)
        del idx
        np.maximum.accumulate(seg, out=seg)
        cs = np.cumsum(reads >= 0, dtype=it)        # reads in the segment up to each hop:
        seg -= 1                                    # cs minus cs before the segment (in place)
        first = seg < 0
        np.maximum(seg, 0, out=seg)
        prev = cs[seg]
        del seg
        prev[first] = 0
        del first
        cs -= prev
        del prev
        defined = cs > 0
        del cs
    else:                                           # any tree: upstream ranks received b earlier
        del idx
        defined = reads >= 0
        g = np.nonzero(relay_up)[0]
        g = g[_by_step(xt[g])]
        _, starts = _runs(xt[g])
        gu = up[g]
        for lo, hi in zip(starts.tolist(), starts[1:].tolist() + [len(g)]):
            defined[g[lo:hi]] |= defined[gu[lo:hi]]
    relay_up &= defined[up0]
    del up, up0
    e = np.where(reads >= 0, it(T) - reads.astype(it, copy=False), NONE)
    del reads
    e2 = np.where(relay_up, it(T) - xt.astype(it, copy=False) - it(1), NONE)  # (T < NONE)
    np.minimum(e, e2, out=e)
    del e2, relay_up
    emit = np.nonzero(e != NONE)[0]
    key, e = in_key[emit], e[emit]
    del in_key
    d = sup_d[key]
    c_ = xc[emit]
    dh = hop_of[ix(c_, np.maximum(d, 0))]           # the hop that took b on from this rank
    relay = (d >= 0) & (T - sup_t[key].astype(np.int64) <= e) & (dh >= 0)
    relay &= defined[np.maximum(dh, 0)]
    if xrng is not None:                            # the rank below holds what this one reads
        relay &= xrng[np.maximum(dh, 0)] == xrng[emit]
    fetch = ~relay
    if (fetch & (e - 1 < 0)).any():
        raise _Pad(int((1 - e[fetch]).max()))
    frm = np.where(relay, d, own[c_])
    u = np.where(relay, T - sup_t[key] - 1, e - 1)
    # orders in (buffer, rank) order, as the op rules emit (int64 where after + key may not
    # fit int32: key may be int32); one family, a zero-stride column
    ot = np.int32 if int(after) + K < 2 ** 31 - 1 else np.int64
    rows = dict(step=u, src=frm, dst=xd[emit],
                fam=np.broadcast_to(np.array([_FAMILY_CODE[Family.KV]]), (len(emit),)),
                chunk=c_, order=ot(after) + key.astype(ot, copy=False))
    if xrng is not None:
        rows["rng"] = xrng[emit]
    return rows


def _no_xfer():
    z = np.zeros(0, np.int64)
    return dict(step=z, src=z, dst=z, fam=z, chunk=z, order=z)


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
    h = slice(None) if h.all() else h       # every hop an input's (rings): the columns, no copy
    ss = g.ss[brought]

    def arrivals(x, y):                     # (16.8M hops at P=4,096: no concatenation of
        return x[h] if not len(y) else np.concatenate([x[h], y])    # views with nothing)
    r = arrivals(g.xd, g.kr[ss])
    if not len(r):
        return
    f = arrivals(g.xf, g.sf[brought])
    c = arrivals(g.xc, g.sc[brought])
    t = arrivals(g.xt, g.kt[ss])
    b = g.bkey(f, c, arrivals(g.xhs, g.shs[brought]))
    used = np.zeros(_F * P * g.HS, dtype=bool)
    used[b] = True
    ids = np.cumsum(used) - 1
    n = int(ids[-1]) + 1
    key = ids[b]
    del b
    key += r * np.int64(n)                  # (r may be int32: the product in int64)
    again = c == r                          # at its owner
    if P * n <= _columns.PLANE_CELLS:                # distinct cells fewer than arrivals
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
    hi_a = arrivals(g.xhi, g.shi[brought])
    hn_a = arrivals(g.xhn, g.shn[brought])
    overlap = (_overlapping_heads(r * np.int64(_F * P) + f * np.int64(P) + c, t, hi_a, hn_a)
               & ~again if hn_a.any() else np.zeros(len(r), dtype=bool))
    if not (again | overlap).any():
        return
    i = min(np.flatnonzero(again | overlap).tolist(), key=lambda i: (int(r[i]), int(t[i])))
    hi, hn = hi_a[i], hn_a[i]
    buf = Buffer.of(_FAMILIES[int(f[i])], int(c[i]), None if hn == 0 else (int(hi), int(hn)))
    rank, step = int(r[i]), int(t[i])
    if c[i] == r[i]:
        what = f"{buf} arrives at rank {rank}, which owns it"
    elif overlap[i]:
        what = (f"{buf} arrives at rank {rank}, which also receives heads of it that overlap "
                f"these (a whole {buf.parent} and a slice of it, or slices of two splits)")
    else:
        first = int(t[(key == key[i]) & ~again].min(initial=step))
        what = f"{buf} arrives at rank {rank} again (it arrived at step {first})"
    raise ScheduleError(
        f"rank {rank}, step {step}: {what}; a rank receives each input at most once (reverse "
        f"returns the gradient along every route a buffer came by, so it would return it "
        f"twice): drop the second arrival\n{marked(tab.programs()[rank], step)}")


def _merge_once(tab: ProgramTable, g: _Gen) -> None:
    """A rank sends its partial output of a chunk (``out``, point to point or as a
    collective's contribution) at most once, and not whole and as an overlapping slice: the
    receiver merges every copy it gets, so a second send would count the same partial twice
    (a wrong ``out``, no error). Raises naming the first second send (by rank, then step)."""
    P, OUT = g.P, _FAMILY_CODE[_OUT]
    x = g.xf == OUT
    k = (g.sf == OUT) & (g.sdir == 0) & (g.sidx != g.me[g.ss])     # contributions to others
    if not x.any() and not k.any():
        return
    r = np.concatenate([g.xs[x], g.kr[g.ss[k]]])
    c = np.concatenate([g.xc[x], g.sc[k]])
    if P * P <= _columns.PLANE_CELLS and np.bincount(r * P + c).max() < 2:
        return                              # each rank sends each chunk's out once at most
    t = np.concatenate([g.xt[x], g.kt[g.ss[k]]])
    hi = np.concatenate([g.xhi[x], g.shi[k]])
    hn = np.concatenate([g.xhn[x], g.shn[k]])
    hs = np.concatenate([g.xhs[x], g.shs[k]])
    key = (r * P + c) * g.HS + hs
    o = np.lexsort((t, key))
    again = np.zeros(len(key), dtype=bool)
    again[o[1:]] = key[o[1:]] == key[o[:-1]]
    again |= _overlapping_heads(r * P + c, t, hi, hn)
    if not again.any():
        return
    i = min(np.flatnonzero(again).tolist(), key=lambda i: (int(r[i]), int(t[i])))
    rank, step = int(r[i]), int(t[i])
    buf = Buffer.of(Family.OUT, int(c[i]), None if hn[i] == 0 else (int(hi[i]), int(hn[i])))
    first = int(t[(r == r[i]) & (c == c[i])].min())
    raise ScheduleError(
        f"rank {rank}, step {step}: rank {rank} sends {buf} again (it first sent heads of it at "
        f"step {first}); a rank sends its partial output of a chunk once, after its last "
        f"compute into it (the receiver merges every copy, so a second send counts the same "
        f"partial twice): drop the second send\n{marked(tab.programs()[rank], step)}")


def _overlapping_heads(whole: np.ndarray, t: np.ndarray, hi: np.ndarray,
                       hn: np.ndarray) -> np.ndarray:
    """Which arrivals bring heads of a buffer that another arrival of the same buffer at the
    same rank (``whole``: one key per rank and whole buffer) also brings, with a different
    head slice (a whole buffer and a slice of it, ``h0/2`` and ``h1/4``): of each overlapping
    pair, the later one (by step ``t``). Equal slices are :func:`_arrive_once`'s plain
    "arrives twice"; they are not marked here."""
    out = np.zeros(len(whole), dtype=bool)
    if not len(whole) or not hn.any():
        return out
    if int(whole.max()) < _columns.PLANE_CELLS and np.bincount(whole).max() < 2:
        return out                          # every buffer arrives once (the common case)
    keys, gid, counts = np.unique(whole, return_inverse=True, return_counts=True)
    sliced = np.zeros(len(keys), dtype=bool)
    sliced[gid[hn != 0]] = True
    sel = np.flatnonzero(sliced[gid] & (counts[gid] > 1))
    if not len(sel):
        return out
    D = 1                                   # heads as integer intervals of [0, D)
    for n in np.unique(hn[sel]).tolist():
        D = math.lcm(D, int(n)) if n else D
    n_g = int(gid[sel].max()) + 1
    if n_g * (D + 1) >= 2 ** 62:
        raise NotImplementedError(f"reverse cannot compare head slices of {sorted(set(hn[sel].tolist()))} "
                                  f"splits (their common multiple {D} is too large); split "
                                  f"heads the same way for each buffer")
    w = np.where(hn[sel] == 0, D, D // np.maximum(hn[sel], 1))
    lo = np.where(hn[sel] == 0, 0, hi[sel] * w)
    hi_ = lo + w
    gg = gid[sel]
    o = np.lexsort((-hi_, lo, gg))          # by buffer, then interval start (longest first)
    gs, ls, hs_ = gg[o], lo[o], hi_[o]
    reach = np.maximum.accumulate(gs * (D + 1) + hs_)    # the furthest end so far, per buffer
    hit = np.zeros(len(o), dtype=bool)
    hit[1:] = (gs[1:] == gs[:-1]) & (gs[1:] * (D + 1) + ls[1:] < reach[:-1])
    same = np.zeros(len(o), dtype=bool)     # equal slices: arrives twice, named elsewhere
    same[1:] = (gs[1:] == gs[:-1]) & (ls[1:] == ls[:-1]) & (hs_[1:] == hs_[:-1])
    bad = np.unique(gs[hit & ~same])
    if not len(bad):
        return out
    # in each buffer with an overlap, mark the latest arrival (by step)
    rows = sel[np.isin(gg, bad)]
    o2 = np.lexsort((t[rows], gid[rows]))
    last = np.ones(len(rows), dtype=bool)
    last[:-1] = gid[rows][o2][1:] != gid[rows][o2][:-1]
    out[rows[o2][last]] = True
    return out


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
    cot = np.array([_FAMILY_CODE[f.cotangent] if f is not Family.ACC else -1 for f in _FAMILIES],
                   dtype=np.int32)
    # adjoints, at twice the forward order (+1: an op that goes with its adjoint)
    bcomp = dict(rank=g.cr, step=T - g.ct, kind=np.full(len(g.cr), ADJOINT_CODE[C_]), q=g.cq, kv=g.ckv,
                 order=2 * g.co, hi=g.chi, hn=g.chn)
    top = max([int(x.max()) for x in (g.xo, g.xro) if len(x)] or [0])
    two = (np.int32 if 2 * top + 1 < 2 ** 31 else np.int64)(2)   # (order columns may be int32:
    Tx = step_scalar(T)                                         # int64 where 2x would wrap)

    def adjoints() -> list:
        """The transfers' adjoints (made after the re-sends: their columns and the re-sends'
        working arrays, 16.8M hops each at P=4,096, are not alive at once)."""
        xs = [dict(step=Tx - g.xt, src=g.xd, dst=g.xs, fam=cot[g.xf], chunk=g.xc,
                   order=two * g.xro, rorder=two * g.xo, hi=g.xhi, hn=g.xhn,
                   rng=g.xrng)]              # the adjoint: same blocks
        o_ = g.xf == OUT                    # the merged (out, lse) goes with its cotangent
        if o_.any():
            xs.append(dict(step=Tx - g.xt[o_], src=g.xd[o_], dst=g.xs[o_], fam=g.xf[o_],
                           chunk=g.xc[o_], order=two * g.xro[o_] + 1,
                           rorder=two * g.xo[o_] + 1, hi=g.xhi[o_], hn=g.xhn[o_],
                           rng=g.xrng[o_]))
        return xs
    adj = np.array([ir_kinds.index(COLLECTIVE_ADJOINT[k]) for k in ir_kinds])
    n_side = len(g.kr)
    sides = [dict(rank=g.kr, step=T - g.kt, order=2 * g.ko, kind=adj[g.kk], group=g.kg)]
    slots = [dict(slot_side=g.ss, slot_dir=1 - g.sdir, slot_idx=g.sidx, slot_fam=cot[g.sf],
                  slot_chunk=g.sc, slot_hi=g.shi, slot_hn=g.shn, slot_rng=g.srng)]
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
                          slot_hi=g.shi[sel], slot_hn=g.shn[sel], slot_rng=g.srng[sel]))
    n_next = n_side + int(touch_out.sum())
    # reads_at: the last forward step each rank's computes read each input buffer
    c_reads = [(f, sd) for f, sd, w in TILE_TOUCH_CODES[C_] if not w]   # (only C rows here)
    rd_k = np.concatenate([g.rkey(g.cr, f, (g.cq, g.ckv)[sd], g.chs) for f, sd in c_reads])
    rd_t = np.concatenate([g.ct] * len(c_reads))
    ra_k, ra_t = _min_by_key(rd_k, rd_t, np.maximum)
    del rd_k, rd_t                          # (memory: two reads per compute)
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
    _merge_once(tab, g)
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
                          slot_hn=g.shn[at], slot_rng=g.srng[at]))
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
    xs = adjoints() + [extra]
    bxfer = {k: concat_column([x.pop(k) for x in xs]) for k in list(xs[0])}   # (each piece
    del xs, extra                                                           # freed as it goes)
    bxfer["ranges"] = g.ranges
    bcoll = {k: np.concatenate([x[k] for x in sides]) for k in sides[0]}
    sl = {k: np.concatenate([x[k] for x in slots]) for k in slots[0]}
    n_idx = int(g.glen.max()) + 1
    o = np.argsort((sl["slot_side"] * 2 + sl["slot_dir"]) * n_idx + sl["slot_idx"])
    bcoll.update({k: v[o] for k, v in sl.items()})
    bcoll["groups"], bcoll["ranges"] = g.groups, g.sranges
    return list(ProgramTable._of_parts(P, bcomp, bxfer, bcoll, fresh=True).programs())


def _remote_reads(g: _Gen, skip: np.ndarray) -> tuple[np.ndarray, ...]:
    """Reads of input buffers (q, kv) by computes on ranks that do not own them, less what a
    re-issued collective delivers (``skip``: sorted (rank, buffer) keys): ``(rank, step,
    buffer code, position in program order: rank, step, order, q before kv)``."""
    P = g.P
    NBC = _F * P * g.HS                       # buffer codes (family, chunk, head slice)
    # (rank, step, order) as one increasing key: orders are row indices (millions at
    # P=4,096), so no fixed field width holds them; _row_keys sizes the fields to the columns
    pos = _row_keys(g.cr, g.ct, g.co) * 2
    side = (g.cq, g.ckv)
    c_reads = [(fam, side[sd]) for fam, sd, w in TILE_TOUCH_CODES[C_] if not w]
    reads = []
    for part, (fam, ch) in enumerate(c_reads):
        m = np.flatnonzero(ch != g.cr)
        reads.append((g.cr[m], g.ct[m], g.bkey(fam, ch[m], g.chs[m]), pos[m] + part))
    del pos
    rr, rt, rb, rp = ([np.concatenate(c) for c in zip(*reads)] if reads else
                      [np.zeros(0, np.int64)] * 4)
    del reads
    if len(skip) and len(rr):               # reads of what a re-issued collective delivers
        skip_r, skip_b = skip // NBC, skip % NBC
        used = np.zeros(NBC, dtype=bool)    # compact ids over the buffers involved
        used[rb] = True
        used[skip_b] = True
        id_of = np.cumsum(used) - 1
        n = int(id_of[-1]) + 1
        if P * n <= _columns.PLANE_CELLS:            # a (rank, id) plane
            by_coll = np.zeros(P * n, dtype=bool)
            by_coll[skip_r * n + id_of[skip_b]] = True
            keep = ~by_coll[rr * n + id_of[rb]]
        else:                               # sorted keys
            keep = ~_member(rr * NBC + rb, skip)
        rr, rt, rb, rp = rr[keep], rt[keep], rb[keep], rp[keep]
    return rr, rt, rb, rp


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
    h = slice(None) if h.all() else h               # every hop an input's: views
    xb, xd = g.bkey(g.xf[h], g.xc[h], g.xhs[h]), g.xd[h]
    used = np.zeros(NBC, dtype=bool)
    used[rb] = True
    used[xb] = True
    ids = np.cumsum(used) - 1
    n = int(ids[-1]) + 1
    if P * n <= _columns.PLANE_CELLS:
        plane = np.zeros(P * n, dtype=bool)
        plane[xd * n + ids[xb]] = True
        bad = ~plane[rr * n + ids[rb]]
    else:
        bad = ~_member(rr * NBC + rb, _uniq(xd.astype(np.int64) * NBC + xb))
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
    sel = slice(None) if isin.all() else isin   # every hop (a ring's kv): views, no copies
    xt, xs, xd, xf, xc, xhs = (x[sel] for x in (g.xt, g.xs, g.xd, g.xf, g.xc, g.xhs))
    xo = g.xro[sel]
    NBC = _F * P * g.HS                       # buffer codes (family, chunk, head slice)
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
    never = np.iinfo(np.int64).max
    first_r = np.full(n, never)               # the first read of each buffer (program order)
    _assign_min(first_r, id_of[rb], rp)
    first_h = np.full(n, never)               # else its first hop: (dst, step, order)
    _assign_min(first_h, id_of[xb], _row_keys(xd, xt, xo))
    ub = np.flatnonzero(used)                 # buffer code of each compact id
    fam_rank = np.argsort(np.argsort([f.value for f in _FAMILIES]))
    ufam, uchunk = ub // g.HS // P, ub // g.HS % P
    emit_order = np.lexsort((first_h, first_r, uchunk, fam_rank[ufam]))
    bid = np.empty(n, np.int64)
    bid[emit_order] = np.arange(n)
    r_bid, x_bid = bid[id_of[rb]], bid[id_of[xb]].astype(np.int32 if n < 2 ** 31 else np.int64)
    del xb                                    # (16.8M hops: 134 MB)
    owner = np.empty(n, np.int32 if P < 2 ** 31 else np.int64)
    owner[bid] = uchunk
    try:
        rows = _resend_parts(P, T, rr, rt, r_bid, xt, xs, xd, x_bid, g.xo[sel], after,
                             owner=owner, xrng=g.xrng[sel])
    except _Late as e:                      # hops numbered as the table's transfers
        row = np.flatnonzero(isin)
        raise _Late(int(row[e.hop]), int(row[e.arrival])) from None
    code = ub[emit_order]                     # the buffer code of each id (int32 where
    if NBC < 2 ** 31:                         # the codes fit: 16.8M rows at P=4,096)
        code = code.astype(np.int32)
    b = code[rows["chunk"]]                   # the buffer code of each row's id
    del code
    m = len(b)

    def const(v):                             # a column of one value: zero-stride
        return np.broadcast_to(np.array([v], np.int64), (m,))
    hi, hn = _slices(b % g.HS) if g.HS > 1 else (const(0), const(0))
    b //= g.HS
    return dict(step=rows["step"], src=rows["src"], dst=rows["dst"], fam=b // P,
                chunk=b % P, order=rows["order"], rorder=rows["order"], hi=hi, hn=hn,
                rng=rows.get("rng", const(-1)))


def _no_xfer_general():
    z = np.zeros(0, np.int64)
    return dict(step=z, src=z, dst=z, fam=z, chunk=z, order=z, rorder=z, hi=z, hn=z, rng=z)
