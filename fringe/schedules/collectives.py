"""All-gather, Ulysses and 2D composition: schedules made of collectives, as data.

Each is a small function producing programs for the mask's tile map; none touches the
interpreter or the autograd Function, and each backward is derived by
:func:`fringe.schedules.reverse` (all-gather becomes reduce-scatter of dkv, all-to-all its
inverse, a partial output's move the move of its cotangent; inputs the backward reads again
come from the re-issued collective).

* :func:`allgather` (Llama-3 style): rank r computes its local tile while kv of the other
  ranks is gathered in ``pieces`` all-gathers over the whole group; each piece's tiles are
  computed while the next is in flight. A rank receives only the chunks its queries need
  (empty contributions), so a document mask gathers little.
* :func:`ulysses`: all-to-all from sequence-sharded to head-sharded (rank p gets heads
  ``[p*H/P, (p+1)*H/P)`` of every chunk), attention over the whole sequence for those heads
  (mask_mod and score_mod see global positions and the **global** head index), all-to-all
  back. Needs ``H % P == 0`` and ``G % P == 0`` or ``P % G == 0`` (then kv heads are
  replicated: the ranks sharing a kv head each receive it, and its gradient is summed at
  the owner); anything else raises before any communication.
* :func:`compose` ``(outer, ulysses(), inner_size=k)``: 2D context parallelism over
  ``P = k*m`` ranks: Ulysses inside groups of k consecutive ranks, ``outer`` (ring, zigzag,
  striped, balanced or allgather) across the m groups, moving head slices of kv
  (TransformerEngine's a2a+p2p, USP).

>>> p = fringe.plan(schedules.compose(schedules.zigzag(), schedules.ulysses(), inner_size=2),
...                 masks.causal(), seq_len=32, world_size=4, block_size=2)
>>> print(p.forward[0])     # rank 0: Ulysses with rank 1, a zigzag ring with rank 2
r0:
  t0: A2A[0,1] q0h0/2,q0h1/2 ⇄ q0h0/2,q1h0/2 | A2A[0,1] kv0h0/2,kv0h1/2 ⇄ kv0h0/2,kv1h0/2
  t1: C q0·kv0 h0/2 | C q1·kv0 h0/2 | C q1·kv1 h0/2 | S kv0h0/2→r2 | R kv2h0/2←r2 | R kv3h0/2←r2
  t2: C q1·kv2 h0/2 | C q1·kv3 h0/2
  t3: A2A[0,1] out0h0/2,out1h0/2 ⇄ out0h0/2,out0h1/2
"""
from __future__ import annotations

import functools

import numpy as np
import torch

from .. import layout as _layout
from .base import AUTO, COMPOSE, Schedule, Spec
from .ir import (_FAMILY_CODE, C_, COLL_KINDS, Buffer, Collective, Compute, Family, Program,
                 ProgramTable, Recv, Send, _no_coll, steps_of)
from .passes import _keep_hops

__all__ = ["allgather", "compose", "inner_size_of", "ulysses"]


def _need(P: int, need: np.ndarray | None) -> np.ndarray:
    return np.ones((P, P), dtype=bool) if need is None else np.asarray(need, dtype=bool)


# ---------------------------------------------------------------------------------------
# the general table, built column by column
# ---------------------------------------------------------------------------------------
_XFER = ("step", "src", "dst", "fam", "chunk", "order", "rorder", "hi", "hn")
_SIDE = ("rank", "step", "order", "kind", "group")
_SLOT = ("slot_side", "slot_dir", "slot_idx", "slot_fam", "slot_chunk", "slot_hi", "slot_hn")


def _cat(parts: list[dict], names: tuple[str, ...] | None = None) -> dict:
    """Columns of ``parts`` (dicts of equal-length int arrays) one after the other."""
    names = names or tuple(parts[0])
    return {n: np.concatenate([np.asarray(d[n], dtype=np.int64) for d in parts] or
                              [np.zeros(0, np.int64)]) for n in names}


def _within(keys: np.ndarray) -> np.ndarray:
    """Each row's index within its run of equal ``keys`` (sorted)."""
    return np.arange(len(keys)) - np.searchsorted(keys, keys)


def _sorted_slots(slots: dict) -> dict:
    """Collective slots in the order a table keeps them: by (side, dir, idx)."""
    o = np.lexsort((slots["slot_idx"], slots["slot_dir"], slots["slot_side"]))
    return {name: slots[name][o] for name in _SLOT}


def _parts_of(programs: list[Program]) -> tuple[dict, dict, dict]:
    """``(comp, xfer, coll)`` of programs in the general column form (read from the table
    they were cut from, else converted)."""
    return ProgramTable.of(programs)._parts


def _first_slots(rank, step, order, tie, count) -> np.ndarray:
    """Ops at ``(rank, step)``, placed in their step by ``(order, tie)``, each to become
    ``count`` ops in its place (``count[i]`` a number, or an array of them for several
    expansions of op i, each in its own step): the position of each one's first op in its
    step, shaped like ``count``."""
    count = np.asarray(count, dtype=np.int64)
    first = np.zeros_like(count)
    if not len(rank):
        return first
    o = np.lexsort((tie, order, step, rank))
    r, s, n = rank[o], step[o], count[o]
    start = np.flatnonzero(np.r_[True, (r[1:] != r[:-1]) | (s[1:] != s[:-1])])
    before = np.cumsum(n, axis=0) - n
    first[o] = before - np.repeat(before[start], np.diff(np.r_[start, len(o)]), axis=0)
    return first


# ---------------------------------------------------------------------------------------
# all-gather
# ---------------------------------------------------------------------------------------
def _offset_pieces(P: int, pieces: int) -> list[list[int]]:
    """Offsets 1..P-1 (rank r gathers kv of r+d) cut into ``pieces`` runs, nearest first."""
    d = list(range(1, P))
    n = max(1, min(pieces, len(d)))
    return [part.tolist() for part in np.array_split(np.array(d, dtype=np.int64), n) if len(part)]


def _allgather_programs(P: int, need: np.ndarray | None, *, pieces: int) -> list[Program]:
    """The all-gather programs, built as a general :class:`ProgramTable` with numpy.

    Rank r's step s: its own tile (s = 0), the tiles of the chunks gathered by piece s-1 (in
    chunk order), then its side of piece s's all-gather (every rank issues it, possibly
    empty, unless no rank gathers anything in that piece)."""
    need = _need(P, need)
    diag = np.flatnonzero(need.diagonal())
    comp = [dict(rank=diag, step=np.zeros_like(diag), q=diag, kv=diag, order=np.zeros_like(diag))]
    sides, slots = [], []
    before = need.diagonal().astype(np.int64)       # ops ahead of the collective in step s
    ranks = np.arange(P)
    for s, offs in enumerate(_offset_pieces(P, pieces)):
        want = np.zeros((P, P), dtype=bool)          # want[r, k]: rank r gathers kv_k now
        for d in offs:
            k = (ranks + d) % P
            want[ranks, k] = need[ranks, k]
        if not want.any():
            before = np.zeros(P, np.int64)
            continue
        first = sum(len(x["rank"]) for x in sides)
        sides.append(dict(rank=ranks, step=np.full(P, s), order=before, kind=np.zeros(P),
                          group=np.zeros(P)))
        to_r, to_k = np.nonzero(want.T)              # rank to_r sends kv_{to_r} to to_k
        at_r, at_k = np.nonzero(want)                # rank at_r receives kv_{at_k}
        for d, (side, idx, chunk) in enumerate(((to_r, to_k, to_r), (at_r, at_k, at_k))):
            z = np.zeros_like(side)
            slots.append(dict(slot_side=first + side, slot_dir=z + d, slot_idx=idx,
                              slot_fam=z + _FAMILY_CODE[Family.KV], slot_chunk=chunk,
                              slot_hi=z, slot_hn=z))
        before = want.sum(axis=1)
        comp.append(dict(rank=at_r, step=np.full(len(at_r), s + 1), q=at_r, kv=at_k,
                         order=_within(at_r)))
    comp = _cat(comp)
    comp["kind"] = np.full(len(comp["rank"]), C_)
    coll = _cat(sides, _SIDE)
    coll.update(_sorted_slots(_cat(slots, _SLOT)))
    coll["groups"] = (tuple(range(P)),)
    return list(ProgramTable._of_parts(P, comp, _cat([], _XFER), coll).programs())


def allgather(pieces: int = 2) -> Schedule:
    """Llama-3 style all-gather of kv over the zigzag layout, in ``pieces`` collectives.

    Step 0 computes the local tile while the first piece (the nearest ranks' kv) is gathered;
    piece s's tiles are computed while piece s+1 is in flight. Only the kv chunks a rank's
    queries need are gathered (an empty contribution otherwise), over one fixed group.

    >>> p = fringe.plan(schedules.allgather(), masks.causal(), seq_len=32, world_size=4, block_size=2)
    >>> print(render.table(p))
    allgather · causal · S=32 P=4 block=2 · forward
    ┌────────┬───────────────────────┬───────────────────────┬───────────────────────┬───────────────────────┐
    │ step   │ rank 0                │ rank 1                │ rank 2                │ rank 3                │
    ├────────┼───────────────────────┼───────────────────────┼───────────────────────┼───────────────────────┤
    │ t0     │ AG[0-3] kv0 ⇄ kv{1,2} │ AG[0-3] kv1 ⇄ kv{2,3} │ AG[0-3] kv2 ⇄ kv{0,3} │ AG[0-3] kv3 ⇄ kv{0,1} │
    │        │ C q0·kv0              │ C q1·kv1              │ C q2·kv2              │ C q3·kv3              │
    ├────────┼───────────────────────┼───────────────────────┼───────────────────────┼───────────────────────┤
    │ t1     │ AG[0-3] kv0 ⇄ kv3     │ AG[0-3] kv1 ⇄ kv0     │ AG[0-3] kv2 ⇄ kv1     │ AG[0-3] kv3 ⇄ kv2     │
    │        │ C q0·kv1              │ C q1·kv2              │ C q2·kv0              │ C q3·kv0              │
    │        │ C q0·kv2              │ C q1·kv3              │ C q2·kv3              │ C q3·kv1              │
    ├────────┼───────────────────────┼───────────────────────┼───────────────────────┼───────────────────────┤
    │ t2     │ C q0·kv3              │ C q1·kv0              │ C q2·kv1              │ C q3·kv2              │
    └────────┴───────────────────────┴───────────────────────┴───────────────────────┴───────────────────────┘
    """
    if isinstance(pieces, bool) or not isinstance(pieces, int) or pieces < 1:
        raise ValueError(f"allgather(pieces=) must be an int >= 1, got {pieces!r}")
    return Schedule("allgather" if pieces == 2 else f"allgather({pieces})", layout=_layout.zigzag,
                    build=functools.partial(_allgather_programs, pieces=pieces),
                    kind="allgather", spec=Spec("allgather", None if pieces == 2 else pieces))


# ---------------------------------------------------------------------------------------
# Ulysses and 2D composition
# ---------------------------------------------------------------------------------------
def _groups(P: int, k: int, need: np.ndarray | None) -> tuple[int, np.ndarray, np.ndarray]:
    """``(m, need, blocks)`` for groups of k consecutive ranks: m = P/k groups, the rank-level
    tile map, and the group-level one (``blocks[a, b]``: group a needs some kv of group b)."""
    if P % k:
        raise ValueError(f"2D context parallelism needs world_size divisible by inner_size: "
                         f"P={P}, inner_size={k}; use P a multiple of {k}")
    m = P // k
    need = _need(P, need)
    return m, need, need.reshape(m, k, m, k).any(axis=(1, 3))


def _composed_programs(outer: Schedule | None, k: int, P: int,
                       need: np.ndarray | None) -> list[Program]:
    """Ulysses inside groups of k consecutive ranks, ``outer`` across the P/k groups, built
    as a general :class:`ProgramTable` with numpy.

    Step 0: the all-to-alls of q and kv to head slices inside each group; outer step t
    becomes step t+1, where every op of group g is done by each of its ranks (slot p) for
    head slice p, in the outer op's place: a compute of group tile (a, b) is the non-empty
    rank tiles of that block, a hop of group kv b the chunks b*k+c that go on to a group
    using them, an all-gather one all-gather per chunk c a group uses; after the last step
    the all-to-all of out back to sequence shards.
    """
    m, need, blocks = _groups(P, k, need)
    if outer is None:                   # one group: everything is computed at step 0
        z = np.zeros(int(need.any()), np.int64)
        ocomp = dict(rank=z, step=z, kind=z, q=z, kv=z, order=z)
        oxfer, ocoll = _cat([], _XFER), _no_coll()
    else:
        ocomp, oxfer, ocoll = _parts_of(outer.programs(m, blocks))
    if (ocomp["kind"] != C_).any():
        raise ValueError("compose: the outer schedule computes gradient tiles; the outer "
                         "schedule must compute whole group tiles and move kv (ring, zigzag, "
                         "striped, balanced, allgather)")
    rows, cols = need.any(axis=1), need.any(axis=0)
    T = 1 + max((int(x["step"].max()) for x in (ocomp, oxfer, ocoll) if len(x["step"])),
                default=-1)
    uses = need.reshape(m, k, P).any(axis=1)            # uses[a, j]: group a computes with kv_j
    tiles = need.reshape(m, k, m, k).transpose(0, 2, 1, 3)      # [a, b]: block (a, b)'s tiles
    kv_code = _FAMILY_CODE[Family.KV]

    # how many ops each outer op becomes, and where the first goes in its step
    n_comp = tiles[ocomp["q"], ocomp["kv"]].sum(axis=(1, 2))
    j = (oxfer["chunk"][:, None] * k + np.arange(k)).reshape(-1)
    keep = (_keep_hops(P, j, *(np.repeat(oxfer[c], k) for c in ("step", "src", "dst")),
                       _uses_by_chunk(uses, P)) if len(j) else np.zeros(0, dtype=bool)
            ).reshape(-1, k)                                    # [hop, c]: moves chunk*k+c
    ogroups = ocoll["groups"]
    live = np.zeros((len(ogroups), k), dtype=bool)              # [group, c]: kv chunks b*k+c
    by_group = uses.reshape(m, m, k)                            # move inside it
    for n, g in enumerate(ogroups):
        sub = by_group[np.ix_(g, g)]
        sub[np.arange(len(g)), np.arange(len(g))] = False
        live[n] = sub.any(axis=(0, 1))
    side_live = live[ocoll["group"]]
    first = _first_slots(*(np.concatenate([ocomp[a], oxfer[b], oxfer[c], ocoll[d]]) for a, b, c, d in
                           (("rank", "src", "dst", "rank"), ("step",) * 4,
                            ("order", "order", "rorder", "order"))),
                         np.repeat(np.arange(4), [len(ocomp["rank"]), len(oxfer["src"]),
                                                  len(oxfer["src"]), len(ocoll["rank"])]),
                         np.concatenate([n_comp, keep.sum(1), keep.sum(1), side_live.sum(1)]))
    f_comp, f_send, f_recv, f_coll = np.split(first, np.cumsum(
        [len(ocomp["rank"]), len(oxfer["src"]), len(oxfer["src"])]))
    slot = np.arange(k)

    def per_slot(x):                    # one value per outer-expanded op, then per slot p
        return np.repeat(x, k)

    # computes: the block's tiles (i-major), then each slot p of the group
    op, ti, tj = np.nonzero(tiles[ocomp["q"], ocomp["kv"]])
    at = _within(op)
    n = len(op)
    comp = dict(rank=per_slot(ocomp["rank"][op] * k) + np.tile(slot, n),
                step=per_slot(ocomp["step"][op] + 1), kind=np.full(n * k, C_),
                q=per_slot(ocomp["q"][op] * k + ti), kv=per_slot(ocomp["kv"][op] * k + tj),
                order=per_slot(f_comp[op] + at), hi=np.tile(slot, n), hn=np.full(n * k, k))
    # transfers: the kept chunks of each hop, between slot p of the two groups
    hop, c = np.nonzero(keep)
    at = _within(hop)
    n = len(hop)
    xfer = dict(step=per_slot(oxfer["step"][hop] + 1),
                src=per_slot(oxfer["src"][hop] * k) + np.tile(slot, n),
                dst=per_slot(oxfer["dst"][hop] * k) + np.tile(slot, n),
                fam=np.full(n * k, kv_code), chunk=per_slot(oxfer["chunk"][hop] * k + c),
                order=per_slot(f_send[hop] + at), rorder=per_slot(f_recv[hop] + at),
                hi=np.tile(slot, n), hn=np.full(n * k, k))
    # the all-to-alls: sides r (q), P + r (kv), 2P + r (out); slots x of [P, k] grids
    r = np.arange(P)
    g, p = r // k, r % k
    a2a = COLL_KINDS.index("A2A")
    sides = [dict(rank=r, step=np.full(P, s), order=np.full(P, o), kind=np.full(P, a2a), group=g)
             for s, o in ((0, 0), (0, 1), (T + 1, 0))]
    member = g[:, None] * k + slot                  # [r, x]: member x of r's group
    own, mine = np.broadcast_to(r[:, None], (P, k)), np.broadcast_to(slot, (P, k))
    rp = np.broadcast_to(p[:, None], (P, k))
    slots = []
    for side, fam, d, chunk, hi, on in (
            (0, Family.Q, 0, own, mine, rows[own]), (0, Family.Q, 1, member, rp, rows[member]),
            (1, Family.KV, 0, own, mine, cols[own]), (1, Family.KV, 1, member, rp, cols[member]),
            (2, Family.OUT, 0, member, rp, rows[member]), (2, Family.OUT, 1, own, mine, rows[own])):
        ri, x = np.nonzero(on)
        slots.append(dict(slot_side=side * P + ri, slot_dir=np.full(len(ri), d), slot_idx=x,
                          slot_fam=np.full(len(ri), _FAMILY_CODE[fam]),
                          slot_chunk=chunk[ri, x], slot_hi=hi[ri, x], slot_hn=np.full(len(ri), k)))
    # an outer all-gather: one per live chunk c, on every slot plane p
    side, c = np.nonzero(side_live)
    n = len(side)
    sides.append(dict(rank=per_slot(ocoll["rank"][side] * k) + np.tile(slot, n),
                      step=per_slot(ocoll["step"][side] + 1),
                      order=per_slot(f_coll[side] + _within(side)),
                      kind=per_slot(ocoll["kind"][side]),
                      group=m + per_slot(ocoll["group"][side] * k) + np.tile(slot, n)))
    expanded = np.full(side_live.shape, -1)
    expanded[side, c] = np.arange(n)
    ss = ocoll["slot_side"]
    if len(ss):
        flat = np.concatenate([np.asarray(x, dtype=np.int64) for x in ogroups])
        start = np.cumsum([0] + [len(x) for x in ogroups])
        a = flat[start[ocoll["group"][ss]] + ocoll["slot_idx"]]     # the slot's member
        og = ocoll["rank"][ss]
        sent = ocoll["slot_dir"] == 0
        chunk = np.where(sent, og, a)[:, None] * k + slot               # [slot, c]
        on = np.where(sent[:, None], uses[a[:, None], og[:, None] * k + slot],
                      uses[og[:, None], chunk]) & (expanded[ss] >= 0)
        e, c = np.nonzero(on)
        n = len(e)
        slots.append(dict(slot_side=3 * P + per_slot(expanded[ss[e], c] * k) + np.tile(slot, n),
                          slot_dir=per_slot(ocoll["slot_dir"][e]),
                          slot_idx=per_slot(ocoll["slot_idx"][e]),
                          slot_fam=np.full(n * k, kv_code), slot_chunk=per_slot(chunk[e, c]),
                          slot_hi=np.tile(slot, n), slot_hn=np.full(n * k, k)))
    coll = _cat(sides, _SIDE)
    coll.update(_sorted_slots(_cat(slots, _SLOT)))
    coll["groups"] = tuple(tuple(range(h * k, (h + 1) * k)) for h in range(m)) + tuple(
        tuple(a * k + q for a in grp) for grp in ogroups for q in range(k))
    return list(ProgramTable._of_parts(P, comp, xfer, coll).programs())


def _uses_by_chunk(uses: np.ndarray, P: int) -> np.ndarray:
    """``use[j, a]`` ([P, P], groups in the first m columns): group a computes with kv_j, the
    form :func:`~fringe.schedules.passes._keep_hops` reads."""
    use = np.zeros((P, P), dtype=bool)
    use[:, :len(uses)] = uses.T
    return use


def _ulysses_programs(P: int, need: np.ndarray | None) -> list[Program]:
    return _composed_programs(None, P, P, need)


def ulysses() -> Schedule:
    """Ulysses (DeepSpeed): all-to-all to head-sharded, full-sequence attention, all-to-all back.

    On P ranks rank p computes heads ``[p*H/P, (p+1)*H/P)`` of every tile (``h p/P``), with the
    mask_mod and score_mod seeing global positions and global head indices. Requires
    ``H % P == 0`` and ``G % P == 0`` or ``P % G == 0`` (kv heads replicated), checked on
    every rank before any communication.

    >>> p = fringe.plan(schedules.ulysses(), masks.causal(), seq_len=16, world_size=2, block_size=2)
    >>> print(render.table(p))
    ulysses · causal · S=16 P=2 block=2 · forward
    ┌────────┬──────────────────────────────────┬──────────────────────────────────┐
    │ step   │ rank 0                           │ rank 1                           │
    ├────────┼──────────────────────────────────┼──────────────────────────────────┤
    │ t0     │ A2A[0,1] kv0h*/2 ⇄ kv{0,1}h0/2   │ A2A[0,1] kv1h*/2 ⇄ kv{0,1}h1/2   │
    │        │ A2A[0,1] q0h*/2 ⇄ q{0,1}h0/2     │ A2A[0,1] q1h*/2 ⇄ q{0,1}h1/2     │
    ├────────┼──────────────────────────────────┼──────────────────────────────────┤
    │ t1     │ C q0·kv0 h0/2                    │ C q0·kv0 h1/2                    │
    │        │ C q1·kv0 h0/2                    │ C q1·kv0 h1/2                    │
    │        │ C q1·kv1 h0/2                    │ C q1·kv1 h1/2                    │
    ├────────┼──────────────────────────────────┼──────────────────────────────────┤
    │ t2     │ A2A[0,1] out{0,1}h0/2 ⇄ out0h*/2 │ A2A[0,1] out{0,1}h1/2 ⇄ out1h*/2 │
    └────────┴──────────────────────────────────┴──────────────────────────────────┘
    """
    return Schedule("ulysses", layout=_layout.contiguous, build=_ulysses_programs,
                    kind="ulysses", spec=Spec("ulysses"))


# ---------------------------------------------------------------------------------------
# 2D composition with a sequence schedule inside the groups (a double ring)
# ---------------------------------------------------------------------------------------
def _inner_template(programs: list[Program], steps: int) -> tuple[np.ndarray, ...]:
    """An inner sequence schedule's programs on k ranks as the rows a double ring copies
    for every group tile it computes.

    Returns ``(comp, xfer, counts)``: computes ``[n, 5]`` (slot p, inner step s, position in
    the step, q, kv), transfers ``[n, 6]`` (s, src slot, dst slot, kv chunk, the send's and
    the receive's positions) and ``counts[p, s]``, the ops of slot p's step s. An inner
    all-gather becomes the point-to-point transfers of the same pattern (its sends, then
    its receives): what it forwards arrived by an outer hop, and the passes follow a
    chunk's route through point-to-point hops (a hop that only feeds a collective would be
    pruned, and re-issuing a chain of collectives needs more than the backward's one
    prologue step).
    """
    k = len(programs)
    comp, sends, recvs = [], {}, {}
    counts = np.zeros((k, steps), dtype=np.int64)

    def chunk(buf: Buffer) -> int:
        if buf.family is not Family.KV or buf.heads is not None:
            raise ValueError(f"compose: the inner schedule moves {buf}; an inner sequence "
                             f"schedule may move only whole kv chunks (ring, zigzag, striped, "
                             f"balanced, allgather), or use schedules.ulysses() inside")
        return buf.chunk

    for prog in programs:
        p = prog.rank
        for step in prog.steps:
            s, at = step.index, 0
            for op in step.ops:
                if type(op) is Compute and op.heads is None:
                    comp.append((p, s, at, op.q, op.kv))
                    at += 1
                elif type(op) in (Send, Recv):
                    hop = (s, p, op.peer) if type(op) is Send else (s, op.peer, p)
                    (sends if type(op) is Send else recvs).setdefault(
                        hop + (chunk(op.buf),), []).append(at)
                    at += 1
                elif type(op) is Collective and op.kind == "AG":
                    for (idx, bufs), out, mine in ((op.sparse_sends, sends, True),
                                                   (op.sparse_recvs, recvs, False)):
                        for x, buf in zip(idx, bufs):
                            peer = op.group[x]
                            if peer == p:        # its own slot (the buffer, or none): no hop
                                continue
                            hop = (s, p, peer) if mine else (s, peer, p)
                            out.setdefault(hop + (chunk(buf),), []).append(at)
                            at += 1
                else:
                    raise ValueError(f"compose: the inner schedule's op {op} has no 2D form; "
                                     f"inner sequence schedules compute whole tiles and move kv "
                                     f"(ring, zigzag, striped, balanced, allgather)")
            counts[p, s] = at
    xfer = []
    for hop, at_src in sends.items():
        at_dst = recvs.get(hop, [])
        if len(at_dst) != len(at_src):
            raise ValueError(f"compose: the inner schedule sends kv{hop[3]} from slot {hop[1]} "
                             f"to slot {hop[2]} in step {hop[0]} {len(at_src)} time(s) but "
                             f"receives it {len(at_dst)} time(s)")
        xfer += [hop + (a, b) for a, b in zip(at_src, at_dst)]
    return (np.array(comp, dtype=np.int64).reshape(-1, 5),
            np.array(xfer, dtype=np.int64).reshape(-1, 6), counts)


def _double_programs(outer: Schedule, inner: Schedule, k: int, P: int,
                     need: np.ndarray | None) -> list[Program]:
    """``inner`` (a sequence schedule) inside groups of k consecutive ranks, ``outer`` across,
    built as a general :class:`ProgramTable` with numpy.

    Rank ``r = g*k + p`` is slot p of group g. The outer programs (over the m groups, pruned
    by the group-level tile map) give, per outer step t, the group tiles to compute and the
    group kv to move. Outer step t spans ``T_in`` global steps (the inner schedule's rounds),
    and every op of group a's outer step becomes, in its place, on each slot p:

    * an outer compute ``C qa·kvb``: the inner programs of group a run on group b's kv
      (rank (a, p) holds kv chunk b*k+p; inner ``C qi·kvj`` is ``C q(a*k+i)·kv(b*k+j)``, inner
      transfers move those chunks between members of group a), pruned by the rank-level
      tile map of the (a, b) block (:func:`_inner_template`);
    * an outer transfer of group kv b: slot p's own chunk b*k+p, to or from slot p of the
      peer group (an all-gather over groups is one all-gather per slot plane, moving the
      chunks the receiving group uses, dropped where it moves none), in the last of the
      T_in steps, which carries no inner communication.

    The result is pruned by the tile map like any schedule (a rank that needs nothing of a
    chunk receives nothing) and reversed by rule.
    """
    m, need, blocks = _groups(P, k, need)
    ocomp, oxfer, ocoll = _parts_of(outer.programs(m, torch.from_numpy(blocks)))
    T_in = max(1, steps_of(inner.programs(k)))
    last = T_in - 1
    if (ocomp["kind"] != C_).any() or np.any(ocomp.get("hn", 0)):
        raise ValueError("compose: the outer schedule computes gradient tiles or head slices; "
                         "the outer schedule must compute whole group tiles and move kv (ring, "
                         "zigzag, striped, balanced, allgather)")
    if len(oxfer["fam"]) and ((oxfer["fam"] != _FAMILY_CODE[Family.KV]).any()
                              or np.any(oxfer.get("hn", 0))):
        raise ValueError("compose: the outer schedule moves buffers other than whole kv "
                         "chunks; an outer schedule may move only whole kv chunks between groups "
                         "(ring, zigzag, striped, balanced, allgather)")
    if len(ocoll["kind"]) and (ocoll["kind"] != COLL_KINDS.index("AG")).any():
        raise ValueError("compose: the outer schedule issues collectives other than "
                         "all-gathers; the outer schedule must compute whole group tiles and "
                         "move kv (ring, zigzag, striped, balanced, allgather)")
    uses = need.reshape(m, k, P).any(axis=1)            # uses[a, j]: group a computes with kv_j
    slot = np.arange(k)
    kv_code = _FAMILY_CODE[Family.KV]

    # the inner programs of each distinct block of the tile map an outer compute covers
    tiles = need.reshape(m, k, m, k).transpose(0, 2, 1, 3)
    bits = np.packbits(tiles[ocomp["rank"], ocomp["kv"]].reshape(-1, k * k), axis=1)
    keys, tpl_of = (np.unique(bits, axis=0, return_inverse=True) if len(bits) else
                    (bits, np.zeros(0, np.int64)))
    tpl_of = tpl_of.reshape(-1)
    templates = []
    for key in keys:
        sub = np.unpackbits(key)[:k * k].reshape(k, k).astype(bool)
        templates.append(_inner_template(inner.programs(k, torch.from_numpy(sub)), T_in))

    # the outer all-gathers: sides of one collective share (step, group, occurrence)
    ss = ocoll["slot_side"]
    ogroups = ocoll["groups"]
    n_side = len(ocoll["rank"])
    where = np.full((len(ogroups), m), -1)             # [group, outer rank]: member index
    for n, g in enumerate(ogroups):
        where[n, list(g)] = np.arange(len(g))
    inst = np.zeros(n_side, np.int64)                  # the collective each side is part of
    if n_side:
        o = np.lexsort((ocoll["order"], ocoll["group"], ocoll["step"], ocoll["rank"]))
        cols = [ocoll[c][o] for c in ("rank", "step", "group")]
        run = np.cumsum(np.r_[True, np.any([x[1:] != x[:-1] for x in cols], axis=0)])
        occurrence = np.empty(n_side, np.int64)
        occurrence[o] = _within(run)
        inst = np.unique(np.stack([ocoll["step"], ocoll["group"], occurrence]), axis=1,
                         return_inverse=True)[1].reshape(-1)
    flat = np.concatenate([np.asarray(g, dtype=np.int64) for g in ogroups] or [np.zeros(0, int)])
    start = np.cumsum([0] + [len(g) for g in ogroups])
    side_g = ocoll["group"][ss]
    member = flat[start[side_g] + ocoll["slot_idx"]] if len(ss) else np.zeros(0, np.int64)
    own = ocoll["rank"][ss]
    chunk = ocoll["slot_chunk"][:, None] * k + slot                     # [slot, p]
    sent = ocoll["slot_dir"] == 0
    on = ((ocoll["slot_idx"] != where[side_g, own])[:, None]
          & uses[np.where(sent, member, own)[:, None], chunk])
    live = np.zeros((int(inst.max(initial=-1)) + 1, k), dtype=bool)    # [collective, p]
    e, p = np.nonzero(on & sent[:, None])
    live[inst[ss[e]], p] = True
    side_live = live[inst]                                              # [side, p]

    # how many ops each outer op gives slot p in inner step s, and where the first goes
    n_comp, n_x = len(ocomp["rank"]), len(oxfer["src"])
    counts = np.zeros((n_comp + 2 * n_x + n_side, k, T_in), dtype=np.int64)
    for n, (_, _, tc) in enumerate(templates):
        counts[np.flatnonzero(tpl_of == n)] = tc
    counts[n_comp:n_comp + 2 * n_x, :, last] = 1
    counts[n_comp + 2 * n_x:, :, last] = side_live
    first = _first_slots(
        *(np.concatenate([ocomp[a], oxfer[b], oxfer[c], ocoll[d]]) for a, b, c, d in
          (("rank", "src", "dst", "rank"), ("step",) * 4, ("order", "order", "rorder", "order"))),
        np.repeat(np.arange(4), [n_comp, n_x, n_x, n_side]), counts)
    f_comp, f_send, f_recv, f_coll = np.split(first, np.cumsum([n_comp, n_x, n_x]))

    comps, xfers = [], []
    for n, (tc, tx, _) in enumerate(templates):      # the inner programs of each outer compute
        op = np.flatnonzero(tpl_of == n)
        a, b, base = ocomp["rank"][op], ocomp["kv"][op], ocomp["step"][op] * T_in
        i, r = np.repeat(np.arange(len(op)), len(tc)), np.tile(np.arange(len(tc)), len(op))
        p, s = tc[r, 0], tc[r, 1]
        comps.append(dict(rank=a[i] * k + p, step=base[i] + s, kind=np.full(len(r), C_),
                          q=a[i] * k + tc[r, 3], kv=b[i] * k + tc[r, 4],
                          order=f_comp[op[i], p, s] + tc[r, 2]))
        i, r = np.repeat(np.arange(len(op)), len(tx)), np.tile(np.arange(len(tx)), len(op))
        s, src, dst = tx[r, 0], tx[r, 1], tx[r, 2]
        xfers.append(dict(step=base[i] + s, src=a[i] * k + src, dst=a[i] * k + dst,
                          fam=np.full(len(r), kv_code), chunk=b[i] * k + tx[r, 3],
                          order=f_comp[op[i], src, s] + tx[r, 4],
                          rorder=f_comp[op[i], dst, s] + tx[r, 5]))
    x = np.repeat(np.arange(n_x), k)                 # outer hops: slot p's own chunk, plane p
    p = np.tile(slot, n_x)
    xfers.append(dict(step=oxfer["step"][x] * T_in + last, src=oxfer["src"][x] * k + p,
                      dst=oxfer["dst"][x] * k + p, fam=np.full(len(x), kv_code),
                      chunk=oxfer["chunk"][x] * k + p, order=f_send[x, p, last],
                      rorder=f_recv[x, p, last]))
    side, p = np.nonzero(side_live)                  # outer all-gathers, one per slot plane
    renumber = np.full(side_live.shape, -1)
    renumber[side, p] = np.arange(len(side))
    sides = dict(rank=ocoll["rank"][side] * k + p, step=ocoll["step"][side] * T_in + last,
                 order=f_coll[side, p, last], kind=ocoll["kind"][side],
                 group=ocoll["group"][side] * k + p)
    e, p = np.nonzero(on & (renumber[ss] >= 0))
    slots = dict(slot_side=renumber[ss[e], p], slot_dir=ocoll["slot_dir"][e],
                 slot_idx=ocoll["slot_idx"][e], slot_fam=np.full(len(e), kv_code),
                 slot_chunk=chunk[e, p], slot_hi=np.zeros(len(e)), slot_hn=np.zeros(len(e)))
    coll = _cat([sides], _SIDE)
    coll.update(_sorted_slots(_cat([slots], _SLOT)))
    coll["groups"] = tuple(tuple(a * k + q for a in g) for g in ogroups for q in range(k))
    comp = _cat(comps, ("rank", "step", "kind", "q", "kv", "order"))
    xfer = _cat(xfers, ("step", "src", "dst", "fam", "chunk", "order", "rorder"))
    return list(ProgramTable._of_parts(P, comp, xfer, coll).programs())


def inner_size_of(schedule: Schedule) -> int | None:
    """k of a schedule made by :func:`compose` (``None`` for any other schedule): its
    ``inner_size`` field.

    ``fringe.attention(..., group=mesh)`` checks a 2D DeviceMesh against it: the mesh must
    have shape ``(P // k, k)``.
    """
    return schedule.inner_size


def _reason(e: ValueError) -> str:
    """A sub-layout's error without its own remedy (a length for that part, not for S)."""
    return str(e).split("; pad the sequence to")[0]


def _fitting_len(layout_of, seq_len: int, world_size: int, *, block_size: int,
                 mask_aware: bool, tries: int = 64) -> int | None:
    """The smallest multiple of P*block_size >= ``seq_len`` that ``layout_of`` accepts (every
    rank holds whole blocks, so nothing in between can), or None within ``tries`` of them."""
    unit = world_size * block_size
    start = -(-seq_len // unit) * unit
    for n in range(start, start + tries * unit, unit):
        work = torch.ones(n // block_size, dtype=torch.int64) if mask_aware else None
        try:
            layout_of(n, world_size, block_size=block_size, block_work=work)
        except ValueError:
            continue
        return n
    return None


def compose(outer: Schedule, inner: Schedule, *, inner_size: int) -> Schedule:
    """2D context parallelism: ``inner`` inside groups of ``inner_size`` consecutive ranks,
    ``outer`` across the groups.

    Over ``P = k*m`` ranks, rank ``r = g*k + p`` is slot p of group g (with a 2D
    ``DeviceMesh`` of shape ``(m, k)``: ``mesh[g, p]``, dims (outer, inner)).

    * ``inner = schedules.ulysses()``: heads split inside a group (the usual intra-node
      dimension); ``outer`` (ring, zigzag, striped, balanced or allgather) moves head slices
      of kv between the ranks holding the same slice in different groups
      (TransformerEngine's a2a+p2p, USP).
    * ``inner`` a sequence schedule (ring, zigzag, striped, balanced or allgather): a double
      ring (LoongTrain, TransformerEngine's hierarchical p2p). Outer step t of group g
      ("compute group q g with group kv b; move group kv b to the next group") becomes the
      inner programs of group g run on group b's kv (rank (g, p) holds kv chunk b*k+p and
      the inner schedule moves those chunks inside the group), and every slot p moves its own
      chunk b*k+p to slot p of the peer group. An all-gather outside gathers per slot plane
      (all-gathers over ``(0,p), (1,p), ...``); an all-gather inside moves the same pattern
      point to point (what it forwards arrived by an outer hop).

    The layout: the outer layout over the m groups, and each group's S/m tokens (in that
    order) split over its k ranks by the inner layout: evenly for ulysses and ring, by zigzag
    for zigzag (2k pieces of the group's tokens, rank p holds pieces p and 2k-1-p, so
    ``compose(zigzag(), zigzag(), inner_size=k)`` holds exactly the zigzag layout over P
    ranks: chunks r and 2P-1-r), by stripes for striped, by the group's own block work for
    balanced. Everything stays data: the backward is derived by
    :func:`fringe.schedules.reverse`, and pruning by the mask drops what a rank does not need.

    A double ring on a causal mask, 2 groups of 2 (kv chunks move inside a group every step,
    between groups every second step):

    >>> s = schedules.compose(schedules.zigzag(), schedules.zigzag(), inner_size=2)
    >>> p = fringe.plan(s, masks.causal(), seq_len=32, world_size=4, block_size=2)
    >>> print(render.table(p))
    compose(zigzag, zigzag, inner_size=2) · causal · S=32 P=4 block=2 · forward
    ┌────────┬───────────────┬───────────────┬───────────────┬───────────────┐
    │ step   │ rank 0        │ rank 1        │ rank 2        │ rank 3        │
    ├────────┼───────────────┼───────────────┼───────────────┼───────────────┤
    │ t0     │ R kv1←r1      │ R kv0[0:2]←r0 │ R kv3←r3      │ R kv2[0:2]←r2 │
    │        │ C q0·kv0      │ C q1·kv1      │ C q2·kv2      │ C q3·kv3      │
    │        │ S kv0[0:2]→r1 │ S kv1→r0      │ S kv2[0:2]→r3 │ S kv3→r2      │
    ├────────┼───────────────┼───────────────┼───────────────┼───────────────┤
    │ t1     │ R kv2←r2      │ R kv3←r3      │ R kv0[0:2]←r0 │ R kv1[0:2]←r1 │
    │        │ C q0·kv1      │ C q1·kv0      │ C q2·kv3      │ C q3·kv2      │
    │        │ S kv0[0:2]→r2 │ S kv1[0:2]→r3 │ S kv2→r0      │ S kv3→r1      │
    ├────────┼───────────────┼───────────────┼───────────────┼───────────────┤
    │ t2     │ R kv3←r1      │ R kv2←r0      │ R kv1[0:2]←r3 │ R kv0[0:2]←r2 │
    │        │ C q0·kv2      │ C q1·kv3      │ C q2·kv0      │ C q3·kv1      │
    │        │ S kv2→r1      │ S kv3→r0      │ S kv0[0:2]→r3 │ S kv1[0:2]→r2 │
    ├────────┼───────────────┼───────────────┼───────────────┼───────────────┤
    │ t3     │ C q0·kv3      │ C q1·kv2      │ C q2·kv1      │ C q3·kv0      │
    └────────┴───────────────┴───────────────┴───────────────┴───────────────┘

    Args:
        outer: a sequence schedule across groups, e.g. ``schedules.zigzag()``.
        inner: ``schedules.ulysses()`` or a sequence schedule inside a group.
        inner_size: k, the ranks per group; P must be a multiple of it (and H of k with
            ulysses inside).

    Raises:
        TypeError: outer or inner is not a schedule.
        ValueError: an outer schedule that does not move sequence chunks (ulysses, another
            compose), a compose inside, or a bad ``inner_size``; at planning time, a world
            size that is not a multiple of k, or group sizes the inner layout cannot split.
    """
    if not isinstance(outer, Schedule) or not isinstance(inner, Schedule):
        raise TypeError("compose(outer, inner, inner_size=k) takes two schedules, e.g. "
                        "compose(schedules.zigzag(), schedules.ulysses(), inner_size=2)")
    works = ("compose(outer, inner, inner_size=k) works with outer one of ring, zigzag, striped, "
             "balanced, allgather (a schedule that moves sequence chunks between groups) and "
             "inner one of ulysses, ring, zigzag, striped, balanced, allgather")
    if not outer.moves_sequence:
        raise ValueError(f"compose: the outer schedule must move sequence chunks between groups, "
                         f"got {outer.name!r}; heads split inside a group: the inner schedule "
                         f"must be schedules.ulysses() or a sequence schedule, e.g. "
                         f"compose({inner.name if inner.moves_sequence else 'zigzag'}(), "
                         f"ulysses(), inner_size=k). {works}")
    if inner.kind == COMPOSE:
        raise ValueError(f"compose: the inner schedule cannot itself be composed, got "
                         f"{inner.name!r}; {works}")
    if inner.kind == AUTO:
        raise ValueError(f"compose: the inner schedule cannot be schedules.auto(), which "
                         f"fringe.plan resolves to one schedule; name the inner schedule, or "
                         f"pass auto(candidates=['{COMPOSE}:zigzag+ulysses:2', ...]) to "
                         f"fringe.plan. {works}")
    if isinstance(inner_size, bool) or not isinstance(inner_size, int) or inner_size < 1:
        raise ValueError(f"inner_size must be an int >= 1, got {inner_size!r}")
    k = inner_size
    heads = inner.kind == "ulysses"
    if heads and (inner.build is not _ulysses_programs or inner.layout is not _layout.contiguous):
        raise ValueError(f"compose: the inner schedule {inner.name!r} has kind='ulysses' but "
                         f"programs or a layout of its own, which compose would not run (it "
                         f"builds the 2D head split itself); give it kind='user' "
                         f"(dataclasses.replace(s, kind='user', spec=None)), or use "
                         f"schedules.ulysses()")

    def layout_of(seq_len: int, world_size: int, *, block_size: int, block_work=None):
        m = world_size // k
        try:
            lay = (outer.make_layout(seq_len, m, block_size=block_size, block_work=block_work)
                   if outer.mask_aware else outer.make_layout(seq_len, m, block_size=block_size))
        except ValueError as e:
            raise ValueError(f"the {outer.name} layout across the m={m} groups (its P is m) "
                             f"says: {_reason(e)}") from e
        if heads:
            return _layout.from_order(lay.order, world_size, kind=f"{lay.kind}x{k}",
                                      block_size=block_size)
        Sm = seq_len // m
        groups = lay.order.view(m, Sm)
        parts, kinds = [], set()
        for g in range(m):
            try:
                if inner.mask_aware:          # the group's blocks, in group order, by work
                    w = torch.as_tensor(block_work)[groups[g] // block_size]
                    w = w.reshape(-1, block_size).to(torch.float64).mean(1)
                    il = inner.make_layout(Sm, k, block_size=block_size, block_work=w)
                elif g == 0:
                    il = inner.make_layout(Sm, k, block_size=block_size)
            except ValueError as e:
                raise ValueError(f"each of the m={m} groups holds S/m={Sm} tokens, split over "
                                 f"its k={k} ranks by the {inner.name} layout, which says: "
                                 f"{_reason(e)}") from e
            kinds.add(il.kind)
            parts.append(groups[g][il.order])
        return _layout.from_order(torch.cat(parts), world_size,
                                  kind=f"{lay.kind}x{k}:{'/'.join(sorted(kinds))}",
                                  block_size=block_size)

    def make(seq_len: int, world_size: int, *, block_size: int, block_work=None):
        if world_size % k:
            raise ValueError(f"compose(..., inner_size={k}) needs world_size divisible by {k}, "
                             f"got P={world_size}; use P = {k} x (number of groups)")
        try:
            return layout_of(seq_len, world_size, block_size=block_size, block_work=block_work)
        except ValueError as e:
            pad = _fitting_len(layout_of, seq_len, world_size, block_size=block_size,
                               mask_aware=outer.mask_aware or inner.mask_aware)
            fix = (f"pad the sequence to {pad} tokens (the next length this 2D layout "
                   f"accepts on P={world_size} ranks; fringe.packing.pad_batch)" if pad else
                   "pad the sequence so that every part fits")
            raise ValueError(f"{name} cannot lay out S={seq_len} tokens on P={world_size} "
                             f"ranks (m={world_size // k} groups of k={k}): {_reason(e)}; {fix}"
                             ) from e

    name = f"compose({outer.name}, {inner.name}, inner_size={k})"
    build = (functools.partial(_composed_programs, outer, k) if heads else
             functools.partial(_double_programs, outer, inner, k))
    parts = (outer.spec, inner.spec)
    return Schedule(name, layout=make, build=build,
                    mask_aware=outer.mask_aware or inner.mask_aware, kind=COMPOSE, inner_size=k,
                    spec=None if None in parts else Spec(COMPOSE, outer=outer.spec,
                                                         inner=inner.spec, inner_size=k))
