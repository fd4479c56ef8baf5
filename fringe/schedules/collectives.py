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

import numpy as np

from .. import layout as _layout
from .base import Schedule
from .ir import Buffer, Collective, Compute, Family, Program, Recv, Send, program_from_ops

__all__ = ["allgather", "compose", "ulysses"]


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
    need = _need(P, need)
    ops: list[dict[int, list]] = [{} for _ in range(P)]
    members = tuple(range(P))
    for r in range(P):
        if need[r, r]:
            ops[r].setdefault(0, []).append(Compute(r, r))
    for s, offs in enumerate(_offset_pieces(P, pieces)):
        want = {(r, (r + d) % P) for r in range(P) for d in offs if need[r, (r + d) % P]}
        if not want:
            continue
        for r in range(P):
            sends = tuple(Buffer.of(Family.KV, r) if (k, r) in want else None for k in members)
            recvs = tuple(Buffer.of(Family.KV, k) if (r, k) in want else None for k in members)
            ops[r].setdefault(s, []).append(Collective("AG", members, sends, recvs))
            for k in sorted(k for (i, k) in want if i == r):
                ops[r].setdefault(s + 1, []).append(Compute(r, k))
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
def _outer_programs(outer: Schedule | None, m: int, need: np.ndarray) -> list[Program]:
    if outer is None:                   # one group: everything is computed at step 0
        return [program_from_ops(0, {0: [Compute(0, 0)] if need[0, 0] else []})]
    return outer.programs(m, need)


def _composed_programs(outer: Schedule | None, k: int, P: int,
                       need: np.ndarray | None) -> list[Program]:
    """Ulysses inside groups of k consecutive ranks, ``outer`` across the P/k groups."""
    if P % k:
        raise ValueError(f"2D context parallelism needs world_size divisible by inner_size: "
                         f"P={P}, inner_size={k}; use P a multiple of {k}")
    m = P // k
    need = _need(P, need)
    blocks = need.reshape(m, k, m, k).any(axis=(1, 3))           # [group a, group b]
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
    for prog in outer_progs:
        g = prog.rank
        for t, op in prog.ops():
            for p in range(k):
                r = g * k + p
                if isinstance(op, Compute):
                    for i in range(op.q * k, (op.q + 1) * k):
                        for j in range(op.kv * k, (op.kv + 1) * k):
                            if need[i, j]:
                                add(r, t + 1, Compute(i, j, (p, k)))
                elif isinstance(op, (Send, Recv)):
                    peer = op.peer * k + p
                    for j in range(op.buf.chunk * k, (op.buf.chunk + 1) * k):
                        if cols[j]:
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


def compose(outer: Schedule, inner: Schedule, *, inner_size: int) -> Schedule:
    """2D context parallelism: ``inner`` inside groups of ``inner_size`` consecutive ranks,
    ``outer`` across the groups.

    ``inner`` must be :func:`ulysses` (head-parallel inside a group, the usual intra-node
    dimension); ``outer`` any ring-family schedule or :func:`allgather`, which then moves head
    slices of kv between the ranks holding the same slice in different groups. The layout is
    the outer one over the groups, each group's tokens split evenly over its ranks.

    Args:
        outer: e.g. ``schedules.zigzag()``.
        inner: ``schedules.ulysses()``.
        inner_size: k, the ranks per group; P must be a multiple of it, and H of k.

    Raises:
        ValueError: an inner schedule other than ulysses, or a bad ``inner_size``.
    """
    if not isinstance(outer, Schedule) or not isinstance(inner, Schedule):
        raise TypeError("compose(outer, inner, inner_size=k) takes two schedules, e.g. "
                        "compose(schedules.zigzag(), schedules.ulysses(), inner_size=2)")
    if inner.name != "ulysses":
        raise ValueError(f"compose: the inner schedule must be schedules.ulysses() (heads split "
                         f"inside a group), got {inner.name!r}; ring-family schedules and "
                         f"allgather go outside: compose({inner.name}(), ulysses(), inner_size=k)")
    if outer.name == "ulysses" or outer.name.startswith("compose("):
        raise ValueError(f"compose: the outer schedule must move sequence chunks (ring, zigzag, "
                         f"striped, balanced or allgather), got {outer.name!r}")
    if isinstance(inner_size, bool) or not isinstance(inner_size, int) or inner_size < 1:
        raise ValueError(f"inner_size must be an int >= 1, got {inner_size!r}")
    k = inner_size

    def make(seq_len: int, world_size: int, *, block_size: int, block_work=None):
        if world_size % k:
            raise ValueError(f"compose(..., inner_size={k}) needs world_size divisible by {k}, "
                             f"got P={world_size}; use P = {k} x (number of groups)")
        m = world_size // k
        lay = (outer.make_layout(seq_len, m, block_size=block_size, block_work=block_work)
               if outer.mask_aware else outer.make_layout(seq_len, m, block_size=block_size))
        return _layout.from_order(lay.order, world_size, kind=f"{lay.kind}x{k}",
                                  block_size=block_size)

    return Schedule(f"compose({outer.name}, {inner.name}, inner_size={k})", layout=make,
                    build=lambda P, need: _composed_programs(outer, k, P, need),
                    mask_aware=outer.mask_aware)
