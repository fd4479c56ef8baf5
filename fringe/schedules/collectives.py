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

import collections
import weakref

import numpy as np
import torch

from .. import layout as _layout
from .base import Schedule
from .ir import (Buffer, Collective, Compute, Family, Program, Recv, Send, program_from_ops,
                 steps_of)

__all__ = ["allgather", "compose", "inner_size_of", "ulysses"]


def _need(P: int, need: np.ndarray | None) -> np.ndarray:
    return np.ones((P, P), dtype=bool) if need is None else np.asarray(need, dtype=bool)


# ---------------------------------------------------------------------------------------
# all-gather
# ---------------------------------------------------------------------------------------
def _offset_pieces(P: int, pieces: int) -> list[list[int]]:
    """Offsets 1..P-1 (rank r gathers kv of r+d) cut into ``pieces`` runs, nearest first."""
    d = list(range(1, P))
    n = max(1, min(pieces, len(d)))
    return [part.tolist() for part in np.array_split(np.array(d, dtype=np.int64), n) if len(part)]


def _allgather_programs(P: int, need: np.ndarray | None, *, pieces: int,
                        group: tuple[int, ...] | None = None) -> list[Program]:
    """Python work per gathered chunk, not per (rank, member) slot: each rank's side is built
    from its occupied slots (:meth:`Collective.sparse`)."""
    need = _need(P, need)
    ops: list[dict[int, list]] = [{} for _ in range(P)]
    members = tuple(range(P))
    kv = [Buffer.of(Family.KV, k) for k in range(P)]
    for r in np.flatnonzero(need.diagonal()).tolist():
        ops[r].setdefault(0, []).append(Compute(r, r))
    ranks = np.arange(P)
    for s, offs in enumerate(_offset_pieces(P, pieces)):
        want = np.zeros((P, P), dtype=bool)          # want[r, k]: rank r gathers kv_k now
        for d in offs:
            k = (ranks + d) % P
            want[ranks, k] = need[ranks, k]
        if not want.any():
            continue
        to_r, to_k = np.nonzero(want.T)              # rank to_r sends kv_{to_r} to to_k
        at_r, at_k = np.nonzero(want)                # rank at_r receives kv_{at_k}
        to_b = np.searchsorted(to_r, np.arange(P + 1)).tolist()
        at_b = np.searchsorted(at_r, np.arange(P + 1)).tolist()
        to_k, at_k = to_k.tolist(), at_k.tolist()
        for r in range(P):
            sent = tuple(to_k[to_b[r]:to_b[r + 1]])
            got = tuple(at_k[at_b[r]:at_b[r + 1]])
            ops[r].setdefault(s, []).append(Collective.sparse(
                "AG", members, (sent, (kv[r],) * len(sent)), (got, tuple(map(kv.__getitem__, got)))))
            if got:
                ops[r].setdefault(s + 1, []).extend(Compute(r, k) for k in got)
    return [program_from_ops(r, ops[r]) for r in range(P)]


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
                    build=lambda P, need: _allgather_programs(P, need, pieces=pieces))


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


def _outer_programs(outer: Schedule | None, m: int, need: np.ndarray) -> list[Program]:
    if outer is None:                   # one group: everything is computed at step 0
        return [program_from_ops(0, {0: [Compute(0, 0)] if need[0, 0] else []})]
    return outer.programs(m, need)


def _composed_programs(outer: Schedule | None, k: int, P: int,
                       need: np.ndarray | None) -> list[Program]:
    """Ulysses inside groups of k consecutive ranks, ``outer`` across the P/k groups."""
    m, need, blocks = _groups(P, k, need)
    outer_progs = _outer_programs(outer, m, blocks)
    rows, cols = need.any(axis=1), need.any(axis=0)
    ops: list[dict[int, list]] = [{} for _ in range(P)]

    def add(r: int, t: int, op) -> None:
        ops[r].setdefault(t, []).append(op)

    def sl(fam: Family, chunk: int, p: int) -> Buffer:
        return Buffer.of(fam, chunk, (p, k))

    T = 1 + max((prog.steps[-1].index for prog in outer_progs if prog.steps), default=-1)
    for g in range(m):
        members = tuple(range(g * k, (g + 1) * k))
        for p, r in enumerate(members):      # step 0: to head slices, inside the group
            add(r, 0, Collective(
                "A2A", members,
                tuple(sl(Family.Q, r, s) if rows[r] else None for s in range(k)),
                tuple(sl(Family.Q, j, p) if rows[j] else None for j in members)))
            add(r, 0, Collective(
                "A2A", members,
                tuple(sl(Family.KV, r, s) if cols[r] else None for s in range(k)),
                tuple(sl(Family.KV, j, p) if cols[j] else None for j in members)))
            add(r, T + 1, Collective(           # and back, after the last compute
                "A2A", members,
                tuple(sl(Family.OUT, j, p) if rows[j] else None for j in members),
                tuple(sl(Family.OUT, r, s) if rows[r] else None for s in range(k))))
    kept = _kept_slices(outer_progs, need, m, k)
    for prog in outer_progs:
        g = prog.rank
        for t, op in prog.ops():
            if isinstance(op, Compute):          # the tile's non-empty (i, j), once per op
                tiles = (np.argwhere(need[op.q * k:(op.q + 1) * k, op.kv * k:(op.kv + 1) * k])
                         + (op.q * k, op.kv * k)).tolist()
            elif isinstance(op, (Send, Recv)):   # the chunks that go on to a group using them
                hop = (t, g, op.peer) if isinstance(op, Send) else (t, op.peer, g)
                moved = [j for j in range(op.buf.chunk * k, (op.buf.chunk + 1) * k)
                         if hop + (j,) in kept]
            for p in range(k):
                r = g * k + p
                if isinstance(op, Compute):
                    for i, j in tiles:
                        add(r, t + 1, Compute(i, j, (p, k)))
                elif isinstance(op, (Send, Recv)):
                    peer = op.peer * k + p
                    for j in moved:
                        add(r, t + 1, type(op)(sl(Family.KV, j, p), peer))
                elif isinstance(op, Collective):
                    group = tuple(a * k + p for a in op.group)
                    for c in range(k):          # one collective per chunk of a group
                        def wants(a: int, j: int) -> bool:     # group a computes with kv_j
                            return bool(need[a * k:(a + 1) * k, j].any())
                        sends = tuple(None if b is None or not wants(a, g * k + c)
                                      else sl(Family.KV, g * k + c, p)
                                      for a, b in zip(op.group, op.sends))
                        recvs = tuple(None if b is None or not wants(g, a * k + c)
                                      else sl(Family.KV, a * k + c, p)
                                      for a, b in zip(op.group, op.recvs))
                        if any(wants(a, b * k + c) for a in op.group for b in op.group if a != b):
                            add(r, t + 1, Collective(op.kind, group, sends, recvs))
                else:
                    raise ValueError(f"compose: the outer schedule's op {op} has no 2D form")
    return [program_from_ops(r, ops[r]) for r in range(P)]


def _kept_slices(outer_progs: list[Program], need: np.ndarray, m: int,
                 k: int) -> set[tuple[int, int, int, int]]:
    """``(step, src group, dst group, kv chunk)`` of the outer hops whose kv chunk (a rank's
    chunk inside the moved group chunk) is computed with by the receiving group or by a group
    it is forwarded to later: what :func:`~fringe.schedules.prune` keeps of the slices, so
    the programs are built pruned (each slice plane moves the same chunks)."""
    from .passes import _keep_hops
    P = m * k
    hops = np.array([(t, prog.rank, op.peer, op.buf.chunk) for prog in outer_progs
                     for t, op in prog.ops() if isinstance(op, Send)], dtype=np.int64).reshape(-1, 4)
    if not len(hops):
        return set()
    j = (hops[:, 3:4] * k + np.arange(k)).reshape(-1)          # every chunk of the group chunk
    t, src, dst = (np.repeat(hops[:, c], k) for c in range(3))
    use = np.zeros((P, P), dtype=bool)                          # use[j, a]: group a uses kv_j
    use[:, :m] = need.reshape(m, k, P).any(axis=1).T
    keep = _keep_hops(P, j, t, src, dst, use)
    return set(zip(t[keep].tolist(), src[keep].tolist(), dst[keep].tolist(), j[keep].tolist()))


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
    return Schedule("ulysses", layout=_layout.contiguous,
                    build=lambda P, need: _composed_programs(None, P, P, need))


# ---------------------------------------------------------------------------------------
# 2D composition with a sequence schedule inside the groups (a double ring)
# ---------------------------------------------------------------------------------------
def _lift(op, a: int, b: int, k: int) -> list:
    """Inner op of group a, computing with group b's kv, in global ranks and chunks.

    An inner all-gather becomes the point-to-point transfers of the same pattern: what it
    forwards arrived by an outer hop, and the passes follow a chunk's route through
    point-to-point hops (a hop that only feeds a collective would be pruned, and re-issuing
    a chain of collectives needs more than the backward's one prologue step).
    """
    def kv(buf: Buffer | None) -> Buffer | None:
        if buf is None:
            return None
        if buf.family is not Family.KV or buf.heads is not None:
            raise ValueError(f"compose: the inner schedule moves {buf}; an inner sequence "
                             f"schedule may move only whole kv chunks (ring, zigzag, striped, "
                             f"balanced, allgather), or use schedules.ulysses() inside")
        return Buffer.of(Family.KV, b * k + buf.chunk)

    if isinstance(op, Compute) and op.heads is None:
        return [Compute(a * k + op.q, b * k + op.kv)]
    if isinstance(op, (Send, Recv)):
        return [type(op)(kv(op.buf), a * k + op.peer)]
    if isinstance(op, Collective) and op.kind == "AG":     # the same pattern, point to point
        return [Send(kv(x), a * k + peer) for peer, x in zip(op.group, op.sends) if x is not None] + [
            Recv(kv(x), a * k + peer) for peer, x in zip(op.group, op.recvs) if x is not None]
    raise ValueError(f"compose: the inner schedule's op {op} has no 2D form; inner sequence "
                     f"schedules compute whole tiles and move kv (ring, zigzag, striped, "
                     f"balanced, allgather)")


def _outer_kv(op, k: int, p: int) -> Buffer | None:
    """Slot p's part of an outer (group-level) kv buffer: group chunk b -> kv chunk b*k+p."""
    if op is None:
        return None
    if op.family is not Family.KV or op.heads is not None:
        raise ValueError(f"compose: the outer schedule moves {op}; an outer schedule may move "
                         f"only whole kv chunks between groups (ring, zigzag, striped, balanced, "
                         f"allgather)")
    return Buffer.of(Family.KV, op.chunk * k + p)


def _double_programs(outer: Schedule, inner: Schedule, k: int, P: int,
                     need: np.ndarray | None) -> list[Program]:
    """``inner`` (a sequence schedule) inside groups of k consecutive ranks, ``outer`` across.

    Rank ``r = g*k + p`` is slot p of group g. The outer programs (over the m groups, pruned
    by the group-level tile map) give, per outer step t, the group tiles to compute and the
    group kv to move. Outer step t spans ``T_in`` global steps (the inner schedule's rounds):

    * an outer compute ``C qa·kvb`` becomes the inner programs of group a run on group b's kv
      (rank (a, p) holds kv chunk b*k+p; inner ``C qi·kvj`` is ``C q(a*k+i)·kv(b*k+j)``, inner
      transfers move those chunks between members of group a), pruned by the rank-level
      tile map of the (a, b) block;
    * an outer transfer of group kv b is done by every slot p for its own chunk b*k+p, to or
      from slot p of the peer group (an all-gather over groups is one all-gather per slot
      plane), in the last of the T_in steps, which carries no inner communication.

    The result is pruned by the tile map like any schedule (a rank that needs nothing of a
    chunk receives nothing) and reversed by rule.
    """
    m, need, blocks = _groups(P, k, need)
    outer_progs = outer.programs(m, torch.from_numpy(blocks))
    T_in = max(1, steps_of(inner.programs(k)))
    cache: dict[bytes, list[list[tuple[int, object]]]] = {}

    def inner_ops(a: int, b: int) -> list[list[tuple[int, object]]]:
        sub = np.ascontiguousarray(need[a * k:(a + 1) * k, b * k:(b + 1) * k])
        key = sub.tobytes()
        hit = cache.get(key)
        if hit is None:
            hit = cache[key] = [list(prog.ops()) for prog in inner.programs(k, torch.from_numpy(sub))]
        return hit

    def wants(a: int, j: int) -> bool:                       # group a computes with kv_j
        return bool(need[a * k:(a + 1) * k, j].any())

    ops: list[dict[int, list]] = [collections.defaultdict(list) for _ in range(P)]
    outer_colls: dict[tuple, dict[int, Collective]] = collections.defaultdict(dict)
    for prog in outer_progs:
        a = prog.rank
        seen: collections.Counter = collections.Counter()
        for t, op in prog.ops():
            base, last = t * T_in, t * T_in + T_in - 1
            if isinstance(op, Compute) and op.heads is None:
                for p, iops in enumerate(inner_ops(a, op.kv)):
                    for s, iop in iops:
                        ops[a * k + p][base + s].extend(_lift(iop, a, op.kv, k))
            elif isinstance(op, (Send, Recv)):
                for p in range(k):
                    ops[a * k + p][last].append(type(op)(_outer_kv(op.buf, k, p), op.peer * k + p))
            elif isinstance(op, Collective) and op.kind == "AG":
                n = seen[(t, op.group)]
                seen[(t, op.group)] += 1
                outer_colls[(t, op.group, n)][a] = op
                for p in range(k):
                    ops[a * k + p][last].append(((t, op.group, n), p))       # placeholder
            else:
                raise ValueError(f"compose: the outer schedule's op {op} has no 2D form; the "
                                 f"outer schedule must compute whole group tiles and move kv "
                                 f"(ring, zigzag, striped, balanced, allgather)")
    expanded: dict[tuple, Collective | None] = {}            # (key, p, group a) -> op
    for key, sides in outer_colls.items():
        t, group, _ = key
        for p in range(k):
            slots = {}
            for a, op in sides.items():
                me = group.index(a)
                sends = tuple(None if x == me or buf is None or not wants(group[x], buf.chunk * k + p)
                              else _outer_kv(buf, k, p) for x, buf in enumerate(op.sends))
                recvs = tuple(None if x == me or buf is None or not wants(a, buf.chunk * k + p)
                              else _outer_kv(buf, k, p) for x, buf in enumerate(op.recvs))
                slots[a] = (sends, recvs)
            live = any(b is not None for sends, _ in slots.values() for b in sends)
            for a, (sends, recvs) in slots.items():
                expanded[(key, p, a)] = (Collective("AG", tuple(x * k + p for x in group), sends,
                                                    recvs) if live else None)
    programs = []
    for r in range(P):
        g = r // k
        steps = {}
        for t, lst in ops[r].items():
            out = []
            for op in lst:
                if isinstance(op, tuple):                     # an outer collective's slot plane
                    op = expanded[(op[0], op[1], g)]
                    if op is None:
                        continue
                out.append(op)
            steps[t] = out
        programs.append(program_from_ops(r, steps))
    return programs


def _is_sequence_schedule(s: Schedule) -> bool:
    return s.name != "ulysses" and not s.name.startswith("compose(")


#: Composed schedules and their inner size (what a 2D DeviceMesh is checked against).
_INNER_SIZES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def inner_size_of(schedule: Schedule) -> int | None:
    """k of a schedule made by :func:`compose` (``None`` for any other schedule).

    ``fringe.attention(..., group=mesh)`` checks a 2D DeviceMesh against it: the mesh must
    have shape ``(P // k, k)``.
    """
    try:
        return _INNER_SIZES.get(schedule)
    except TypeError:
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
    ┌────────┬──────────┬──────────┬──────────┬──────────┐
    │ step   │ rank 0   │ rank 1   │ rank 2   │ rank 3   │
    ├────────┼──────────┼──────────┼──────────┼──────────┤
    │ t0     │ R kv1←r1 │ R kv0←r0 │ R kv3←r3 │ R kv2←r2 │
    │        │ C q0·kv0 │ C q1·kv1 │ C q2·kv2 │ C q3·kv3 │
    │        │ S kv0→r1 │ S kv1→r0 │ S kv2→r3 │ S kv3→r2 │
    ├────────┼──────────┼──────────┼──────────┼──────────┤
    │ t1     │ R kv2←r2 │ R kv3←r3 │ R kv0←r0 │ R kv1←r1 │
    │        │ C q0·kv1 │ C q1·kv0 │ C q2·kv3 │ C q3·kv2 │
    │        │ S kv0→r2 │ S kv1→r3 │ S kv2→r0 │ S kv3→r1 │
    ├────────┼──────────┼──────────┼──────────┼──────────┤
    │ t2     │ R kv3←r1 │ R kv2←r0 │ R kv1←r3 │ R kv0←r2 │
    │        │ C q0·kv2 │ C q1·kv3 │ C q2·kv0 │ C q3·kv1 │
    │        │ S kv2→r1 │ S kv3→r0 │ S kv0→r3 │ S kv1→r2 │
    ├────────┼──────────┼──────────┼──────────┼──────────┤
    │ t3     │ C q0·kv3 │ C q1·kv2 │ C q2·kv1 │ C q3·kv0 │
    └────────┴──────────┴──────────┴──────────┴──────────┘

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
    if not _is_sequence_schedule(outer):
        raise ValueError(f"compose: the outer schedule must move sequence chunks between groups, "
                         f"got {outer.name!r}; heads split inside a group: the inner schedule "
                         f"must be schedules.ulysses() or a sequence schedule, e.g. "
                         f"compose({inner.name if _is_sequence_schedule(inner) else 'zigzag'}(), "
                         f"ulysses(), inner_size=k). {works}")
    if inner.name.startswith("compose("):
        raise ValueError(f"compose: the inner schedule cannot itself be composed, got "
                         f"{inner.name!r}; {works}")
    if isinstance(inner_size, bool) or not isinstance(inner_size, int) or inner_size < 1:
        raise ValueError(f"inner_size must be an int >= 1, got {inner_size!r}")
    k = inner_size
    heads = inner.name == "ulysses"

    def make(seq_len: int, world_size: int, *, block_size: int, block_work=None):
        if world_size % k:
            raise ValueError(f"compose(..., inner_size={k}) needs world_size divisible by {k}, "
                             f"got P={world_size}; use P = {k} x (number of groups)")
        m = world_size // k
        lay = (outer.make_layout(seq_len, m, block_size=block_size, block_work=block_work)
               if outer.mask_aware else outer.make_layout(seq_len, m, block_size=block_size))
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
                raise ValueError(f"{name}: each of the m={m} groups holds S/m={Sm} tokens, "
                                 f"split over its k={k} ranks by the {inner.name} layout, "
                                 f"which says: {e} (pad S so that S/m fits)") from e
            kinds.add(il.kind)
            parts.append(groups[g][il.order])
        return _layout.from_order(torch.cat(parts), world_size,
                                  kind=f"{lay.kind}x{k}:{'/'.join(sorted(kinds))}",
                                  block_size=block_size)

    name = f"compose({outer.name}, {inner.name}, inner_size={k})"
    build = ((lambda P, need: _composed_programs(outer, k, P, need)) if heads else
             (lambda P, need: _double_programs(outer, inner, k, P, need)))
    sched = Schedule(name, layout=make, build=build,
                     mask_aware=outer.mask_aware or inner.mask_aware)
    _INNER_SIZES[sched] = k
    return sched
