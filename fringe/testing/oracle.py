"""The IR's rules op by op: the readable oracle of the column passes.

:mod:`fringe.schedules.passes` runs ``check``, ``prune`` and ``reverse`` on the columns of
the one :class:`~fringe.schedules.ir.ProgramTable`; :func:`fringe.plan` reads plan stats and
the cost model its programs from the same columns. This module states the same rules on op
objects, one op at a time, from each op's ``reads()`` / ``writes()`` / ``adjoint()`` (the
rule table :data:`fringe.schedules.ir.RULES`), as :mod:`fringe.ops.reference` states
attention for the kernels: ``check``, ``prune``, ``reverse`` and the plan stats' op counts
(``op_counts``). It is slow (Python per op) and exists for the differential tests:
production modules never import it (``tests/test_pass_fallbacks.py``). Where the rules give
a backward that cannot be right (an input arriving at a rank twice, head slices computed
from a buffer that arrived whole), the column ``reverse`` raises instead.
"""
from __future__ import annotations

import bisect
import collections
import itertools
from typing import Sequence

import numpy as np
import torch

from ..schedules.ir import (RULES, Buffer, Collective, Compute, Family, GradCompute, Op,
                            Program, blocks_text, Recv, Send, _BUFS_OF, _FIELDS, _buf, marked,
                            program_from_ops, steps_of)
from ..plan import _OpCounts
from ..schedules.passes import Hop, KV_MODES, ScheduleError, _need_array
from ..schedules.passes._check import _again_text, _lost_text

_INPUTS = frozenset(f for f, _ in RULES["C"].reads)   # what computes read
_INPUT_BUFS, _GRADS, _OUTS = _BUFS_OF["input"], _BUFS_OF["gradient"], _BUFS_OF["out"]
_TILES = frozenset({Compute, GradCompute})


def check(programs: Sequence[Program], *, need: torch.Tensor | None = None,
          backward: bool = False, kv: str = "resend") -> None:
    """:func:`fringe.schedules.check`'s rules op by op (same faults, same messages)."""
    P = len(programs)
    for r, prog in enumerate(programs):
        if prog.rank != r:
            raise ScheduleError(f"program {r} is for rank {prog.rank}; pass programs in rank order")
    posted: collections.Counter = collections.Counter()
    for prog in programs:
        r = prog.rank
        for step in prog.steps:
            t = step.index
            for op in step.ops:
                if isinstance(op, Send):
                    key = (t, r, op.peer, op.buf, op.blocks, True)
                elif isinstance(op, Recv):
                    key = (t, op.peer, r, op.buf, op.blocks, False)
                else:
                    continue
                if not 0 <= op.peer < P or op.peer == r:
                    _fail(programs, r, t, f"{op} names an invalid peer (world size {P})")
                posted[key] += 1
    for (t, src, dst, buf, blocks, is_send), n in posted.items():
        if posted.get((t, src, dst, buf, blocks, not is_send), 0) != n:
            who, op = (src, Send(buf, dst, blocks)) if is_send else (dst, Recv(buf, src, blocks))
            peer = dst if is_send else src
            missing = "receive" if is_send else "send"
            _fail(programs, who, t, f"'{op}' has no matching {missing} on rank {peer} in the "
                                    f"same step")
    _check_collectives(programs)
    _check_presence(programs, backward=backward, kv=kv)
    if need is not None:
        _check_tiles(programs, _need_array(need, P))
    _check_results_home(programs, backward)


def _check_results_home(programs: Sequence[Program], backward: bool) -> None:
    """A partial result (out in the forward, dq and dkv in the backward) a rank writes for
    another rank's chunk is sent on at a later step than its last write (a head slice counts
    as its chunk's buffer), and each such buffer (a head slice its own) is sent once."""
    results = (Family.DQ, Family.DKV) if backward else (Family.OUT,)
    faults, again = [], []
    for prog in programs:
        r = prog.rank
        wrote, sent, sent_at = {}, {}, {}
        for step in prog.steps:
            for op in step.ops:
                if type(op) is Collective:
                    outs, ins = ([b for k, b in enumerate(slots)
                                  if b is not None and op.group[k] != r]
                                 for slots in (op.sends, op.recvs))
                elif isinstance(op, Send):
                    outs, ins = [op.buf], []
                else:
                    outs, ins = [], list(op.writes())
                for into, bufs in ((sent, outs), (wrote, ins)):
                    for b in bufs:
                        if b.family in results and b.chunk != r:
                            f = tuple(Family).index(b.family)
                            into[(f, b.chunk)] = step.index
                            if into is sent:
                                hn, hi = (0, 0) if b.heads is None else b.heads[::-1]
                                sent_at.setdefault((f, b.chunk, hn, hi, b), []).append(step.index)
        for (f, c), t in wrote.items():
            if sent.get((f, c), -1) <= t:
                faults.append((r, t, f, c, sent.get((f, c), -1)))
        for (f, c, hn, hi, b), ts in sent_at.items():
            if len(ts) > 1:
                again.append((r, ts[1], f, c, hn, hi, b, ts[0]))
    if faults:
        r, t, f, c, s = min(faults)
        _fail(programs, r, t, _lost_text(_buf(tuple(Family)[f], c), r, c, s))
    if again:
        r, t, f, c, _, _, b, first = min(again, key=lambda x: x[:6])
        _fail(programs, r, t, _again_text(b, r, c, first))


def prune(programs: Sequence[Program], need: torch.Tensor) -> list[Program]:
    """:func:`fringe.schedules.prune`'s rules op by op."""
    P = len(programs)
    ok = _need_array(need, P)

    okl = ok.tolist()

    def kept(op) -> bool:
        return okl[op.q][op.kv]

    uses: set[tuple[int, Buffer]] = set()              # (rank, buffer) read by a kept compute
    moves: dict[Buffer, list[tuple[int, int, int]]] = collections.defaultdict(list)
    add = uses.add
    changed = [False] * P                   # a compute dropped, or an input moved, or a step empty
    for prog in programs:
        r = prog.rank
        for t, op in prog.ops():
            if type(op) is Compute and op.heads is None:     # the hot path, by attribute
                if okl[op.q][op.kv]:
                    for b in op.reads():
                        add((r, b))
                else:
                    changed[r] = True
                continue
            if isinstance(op, (Compute, GradCompute)):
                changed[r] = changed[r] or not kept(op)
                if kept(op):      # a head slice is read from it or its whole-heads parent
                    uses.update((prog.rank, x) for b in op.reads()
                                for x in ((b,) if b.heads is None else (b, b.parent)))
            elif isinstance(op, Send) and op.buf.family in _INPUTS:
                moves[op.buf].append((t, prog.rank, op.peer))
                changed[r] = True
            elif isinstance(op, Recv) and op.buf.family in _INPUTS:
                changed[r] = True
            elif type(op) is Collective:        # each contribution is a move (own slot: r -> r)
                group = op.group
                for k, b in zip(*op.sparse_sends):
                    if b.family in _INPUTS:
                        moves[b].append((t, r, group[k]))
                        changed[r] = True
                if any(b.family in _INPUTS for b in op.sparse_recvs[1]):
                    changed[r] = True
    keep: set[tuple[Buffer, int, int, int]] = set()     # (buffer, step, src, dst)
    for b, hops in moves.items():
        hops.sort(key=lambda h: -h[0])
        live: set[int] = set()                           # ranks with a kept hop out, later
        n = 0
        while n < len(hops):                             # latest step first, a step at a time
            t = hops[n][0]
            group = []
            while n < len(hops) and hops[n][0] == t:
                group.append(hops[n])
                n += 1
            # kept: its receiver computes with b, or forwards b later (a kept move out of it);
            # a collective's own slot (src == dst) by the same rule
            kept_now = [(src, dst) for (_, src, dst) in group if (dst, b) in uses or dst in live]
            keep.update((b, t, src, dst) for src, dst in kept_now)
            live.update(src for src, _ in kept_now)
    thinned = _thin_collectives(programs, keep)
    pruned = []
    for prog in programs:
        if not changed[prog.rank] and all(step.ops for step in prog.steps):
            pruned.append(prog)             # nothing to drop: the same value, without a rebuild
            continue
        ops: dict[int, list[Op]] = collections.defaultdict(list)
        dropped = False
        seen: collections.Counter = collections.Counter()
        for t, op in prog.ops():
            if isinstance(op, (Compute, GradCompute)):
                if kept(op):
                    ops[t].append(op)
                else:
                    dropped = True
            elif isinstance(op, (Send, Recv)) and op.buf.family in _INPUTS:
                src, dst = (prog.rank, op.peer) if isinstance(op, Send) else (op.peer, prog.rank)
                if (op.buf, t, src, dst) in keep:
                    ops[t].append(op)
                else:
                    dropped = True
            elif type(op) is Collective:
                key = (t, op.group, seen[(t, op.group)])
                seen[(t, op.group)] += 1
                new = thinned.get((prog.rank, key), op)
                if new is not None:
                    ops[t].append(new)
                dropped = dropped or new is not op
            else:
                ops[t].append(op)
        if dropped or not all(step.ops for step in prog.steps):
            prog = program_from_ops(prog.rank, ops)
        pruned.append(prog)                 # unchanged programs stay the same values
    return pruned


def reverse(programs: Sequence[Program], *, kv: str = "resend") -> list[Program]:
    """:func:`fringe.schedules.reverse`'s rules op by op (as many prologue steps as
    re-materialising needs)."""
    if kv not in KV_MODES:
        raise ValueError(f"kv must be one of {KV_MODES}, got {kv!r}")
    T0 = steps_of(programs)
    T = T0
    while True:
        try:
            return _reverse_ops(programs, kv, T)
        except _TooEarly as e:
            if T - T0 + e.by > 2 * T0 + 2:
                raise ScheduleError(f"{e.what}; no number of prologue steps delivers it")
            T += e.by


def _thin_collectives(programs: Sequence[Program], keep: set) -> dict:
    """Each collective side with input slots, thinned to the contributions in ``keep``
    (``(buffer, step, src, dst)``): ``{(rank, (step, group, n)): op}``, the op itself when
    nothing is dropped and None when no member's side of that collective is left moving
    anything (own slots move nothing; then no member issues it)."""
    out: dict = {}
    empty: dict = {}
    for prog in programs:
        r = prog.rank
        seen: collections.Counter = collections.Counter()
        for step in prog.steps:
            t = step.index
            for op in step.collectives:
                key = (t, op.group, seen[(t, op.group)])
                seen[(t, op.group)] += 1
                g = op.group
                (si, sb), (ri, rb) = op.sparse_sends, op.sparse_recvs
                ks = [n for n, (k, b) in enumerate(zip(si, sb))
                      if b.family not in _INPUTS or (b, t, r, g[k]) in keep]
                kr = [n for n, (k, b) in enumerate(zip(ri, rb))
                      if b.family not in _INPUTS or (b, t, g[k], r) in keep]
                if len(ks) == len(si) and len(kr) == len(ri):
                    new = op
                else:
                    new = Collective.sparse(op.kind, g, (tuple(si[n] for n in ks), tuple(sb[n] for n in ks)),
                                            (tuple(ri[n] for n in kr), tuple(rb[n] for n in kr)),
                                            (tuple(op.send_blocks[n] for n in ks),
                                             tuple(op.recv_blocks[n] for n in kr)))
                out[(r, key)] = new
                moves = any(g[si[n]] != r for n in ks) or any(g[ri[n]] != r for n in kr)
                empty[key] = empty.get(key, True) and not moves   # own slots move nothing
    for (r, key) in out:
        if empty[key]:
            out[(r, key)] = None
    return out


class _TooEarly(Exception):
    """A backward move would need a step before 0: so many more prologue steps."""

    def __init__(self, by: int, what: str) -> None:
        super().__init__(what)
        self.by, self.what = by, what


def _reverse_ops(programs: Sequence[Program], kv: str, T: int) -> list[Program]:
    """:func:`reverse` op by op, forward step t becoming backward step ``T - t``."""
    P = len(programs)
    ops: list[dict[int, list[Op]]] = [collections.defaultdict(list) for _ in range(P)]
    # (rank, buffer) -> the last forward step a compute reads it (steps increase in a program)
    reads_at: dict[tuple[int, Buffer], int] = {}
    in_hop: dict[tuple[int, Buffer], Hop] = _Arrivals()
    out_hops: dict[tuple[int, Buffer], list[Hop]] = collections.defaultdict(list)
    by_collective: set[tuple[int, Buffer]] = set()     # inputs a collective brought to a rank
    collectives: dict[tuple, dict[int, Collective]] = collections.defaultdict(dict)
    for prog in programs:
        r = prog.rank
        seen: collections.Counter = collections.Counter()
        for step in prog.steps:
            t = step.index
            dst = ops[r][T - t]
            for op in step.ops:
                if type(op) is Compute:     # the hot path: whole-heads tiles, by attribute
                    q, k, h = op.q, op.kv, op.heads
                    dst.append(_grad_compute(q, k, h))
                    for b in op.reads():
                        reads_at[(r, b)] = t
                    continue
                _reverse_op(prog, r, t, op, T, ops, dst, reads_at, in_hop, out_hops,
                            by_collective, collectives, seen)
    _reissue(T, ops, collectives, reads_at, kv)
    _rematerialise(T, ops, reads_at, in_hop, out_hops, skip=by_collective,
                   families=_INPUTS if kv == "resend" else frozenset({Family.Q}))
    return [program_from_ops(r, ops[r]) for r in range(P)]


class _Arrivals(dict):
    """``(rank, buffer) -> the Hop that brought it``, and in ``blocks`` the block ranges that
    hop carried (None: the whole chunk)."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks: dict = {}


def _grad_compute(q: int, kv: int, heads, _new=object.__new__, _set=object.__setattr__,
                  _cls=GradCompute) -> GradCompute:
    """``GradCompute(q, kv, heads)`` from a Compute's checked fields (no re-validation)."""
    g = _new(_cls)
    _set(g, "q", q)
    _set(g, "kv", kv)
    _set(g, "heads", heads)
    return g


def _reverse_op(prog, r, t, op, T, ops, dst, reads_at, in_hop, out_hops, by_collective,
                collectives, seen) -> None:
    """One op (not a forward Compute) of :func:`reverse`'s rules."""
    if isinstance(op, GradCompute) or (isinstance(op, (Send, Recv))
                                       and op.buf.family.is_gradient) or (
            isinstance(op, Collective) and not (_GRADS.isdisjoint(op.reads())
                                                and _GRADS.isdisjoint(op.writes()))):
        raise ScheduleError(f"rank {r}, step {t}: reverse takes forward programs; found "
                            f"{op}\n{marked(prog, t)}")
    dst.append(op.adjoint())
    if isinstance(op, (Send, Recv)):
        fam = op.buf.family
        if fam is Family.OUT:       # the merged (out, lse) goes with its cotangent
            ops[r][T - t].append(Recv(op.buf, op.peer) if isinstance(op, Send)
                                 else Send(op.buf, op.peer))
        elif fam in _INPUTS and isinstance(op, Send):
            out_hops[(r, op.buf)].append(Hop(t, r, op.peer))
        elif fam in _INPUTS:
            in_hop[(r, op.buf)] = Hop(t, op.peer, r)
            in_hop.blocks[(r, op.buf)] = op.blocks
    elif isinstance(op, Collective):
        if not (_OUTS.isdisjoint(op.reads()) and _OUTS.isdisjoint(op.writes())):
            ops[r][T - t].append(op.transposed())
        by_collective.update((r, b) for b in _INPUT_BUFS.intersection(op.received(r)))
        key = (t, op.group, seen[(t, op.group)])
        seen[(t, op.group)] += 1
        collectives[key][r] = op
    else:
        for b in op.reads():
            reads_at[(r, b)] = t


def _reissue(T, ops, collectives, reads_at, kv: str) -> None:
    """Re-issue each forward collective that brought inputs (q, kv) the backward reads again.

    Every member issues it unchanged, one step before the earliest backward read of what it
    brings on any member (a forward read at step t is a backward read at T - t), and before
    any re-issued collective that sends on what it brings (a 2D schedule forwards head slices
    an all-to-all brought). With ``kv="keep"`` a collective that brings only kv is not
    re-issued (the kv is kept).
    """
    brought: dict[tuple[int, Buffer], tuple] = {}
    when: dict[tuple, int] = {}
    repeat = itertools.repeat
    for key, sides in collectives.items():
        latest, families = None, set()          # the last forward read of what it brought
        for r, op in sides.items():
            got = _INPUT_BUFS.intersection(op.received(r))
            if not got:
                continue
            pairs = list(zip(repeat(r), got))
            brought.update(zip(pairs, repeat(key)))
            families.update(_FIELDS[b][0] for b in got)
            ats = [a for a in map(reads_at.get, pairs) if a is not None]
            if ats:
                latest = max(ats) if latest is None else max(latest, max(ats))
        if latest is not None and not (kv == "keep" and families == {Family.KV}):
            when[key] = T - latest - 1
    for key in sorted(collectives, key=lambda k_: -k_[0]):      # latest forward step first
        if key not in when:
            continue
        for r, op in collectives[key].items():
            for b in op.reads():
                dep = brought.get((r, b))
                if dep is not None:
                    when[dep] = min(when.get(dep, when[key] - 1), when[key] - 1)
    if when and min(when.values()) < 0:
        key, u = min(when.items(), key=lambda kv_: kv_[1])
        raise _TooEarly(-u, f"the collective at forward step {key[0]} over group "
                            f"{list(key[1])} would have to be re-issued at backward step {u}")
    for key, u in sorted(when.items(), key=lambda kv_: (kv_[0][0], kv_[0][1], kv_[0][2])):
        for r, op in collectives[key].items():
            ops[r][u].append(op)


def _rematerialise(T, ops, reads_at, in_hop, out_hops, *, skip=frozenset(),
                   families=_INPUTS) -> None:
    """Add the input moves of the backward: each non-owner that reads buffer b gets it in time.

    No recursion: a rank's first need depends only on its upstream neighbour's, and the
    upstream rank received the buffer earlier, so ranks are visited in forward arrival order.
    ``skip``: (rank, buffer) pairs a re-issued collective delivers; ``families``: the
    buffer families to re-send. A re-send carries the block ranges of the forward hop that
    brought the buffer to its receiver; a rank relays a buffer up only where the hop into it
    carried the same ranges as the hop into the rank above (ranges narrow along a route), else
    the owner sends it.
    """
    blocks = getattr(in_hop, "blocks", {})
    holders: dict[Buffer, set[int]] = collections.defaultdict(set)
    # in program order (buffers that sort alike, head slices of one chunk, keep it)
    for (r, b) in itertools.filterfalse(skip.__contains__, itertools.chain(reads_at, in_hop)):
        fam, chunk, _ = _FIELDS[b]
        if r != chunk and fam in families:
            holders[b].add(r)
    for b in sorted(holders, key=lambda b: (b.family.value, b.chunk)):
        owner = b.chunk
        ranks = sorted(holders[b])

        last_out = {}                          # rank -> its latest hop of b onwards
        for r in ranks:
            hops = out_hops.get((r, b))
            if hops:
                last_out[r] = max(hops, key=lambda h: h.step)

        def supplier(r: int) -> int | None:
            hop = last_out.get(r)
            return None if hop is None else hop.dst

        need_at: dict[int, int | None] = {}    # rank -> first backward step it needs b present
        arrival = sorted(ranks, key=lambda r: in_hop[(r, b)].step if (r, b) in in_hop else -1)
        for r in arrival:
            last = reads_at.get((r, b))
            times = [] if last is None else [T - last]
            hop = in_hop.get((r, b))
            if hop is not None and hop.src != owner and supplier(hop.src) == r and \
                    blocks.get((r, b)) == blocks.get((hop.src, b)):
                if need_at.get(hop.src) is not None:
                    times.append(T - hop.step - 1)      # r sends b up at that step
            need_at[r] = min(times) if times else None
        for r in ranks:
            e = need_at[r]
            if e is None:
                continue
            d = supplier(r)
            mine = blocks.get((r, b))
            if d is not None and blocks.get((d, b)) == mine:
                t_s = last_out[r].step
                if T - t_s <= e and need_at.get(d) is not None:
                    u = T - t_s - 1
                    ops[d][u].append(Send(b, r, mine))
                    ops[r][u].append(Recv(b, d, mine))
                    continue
            if e - 1 < 0:
                raise _TooEarly(1 - e, f"rank {r} needs {b} at backward step {e}; there is "
                                       f"no earlier step to fetch it in")
            ops[owner][e - 1].append(Send(b, r, mine))
            ops[r][e - 1].append(Recv(b, owner, mine))


def _fail(programs: Sequence[Program], rank: int, step: int, what: str):
    raise ScheduleError(f"rank {rank}, step {step}: {what}\n{marked(programs[rank], step)}")


def _check_collectives(programs: Sequence[Program]) -> None:
    """Every member of a group issues the same collectives in the same step and order, and
    what one member sends another receives (the same buffer, or nothing on both sides).

    Work is per occupied slot, not per member pair: a 1024-member gather that moves a few
    chunks costs what it moves (slots are compared as sets of (sender, receiver, buffer)).
    """
    P = len(programs)
    issued: dict[tuple, dict[int, list]] = collections.defaultdict(lambda: collections.defaultdict(list))
    member: dict[int, tuple[tuple, dict[int, int], int]] = {}     # id(group) -> index, max
    for prog in programs:
        r = prog.rank
        for step in prog.steps:
            for op in step.collectives:
                hit = member.get(id(op.group))
                if hit is None or hit[0] is not op.group:
                    hit = member[id(op.group)] = (op.group, {m: i for i, m in enumerate(op.group)},
                                                  max(op.group))
                if r not in hit[1]:
                    _fail(programs, r, step.index, f"'{op}': rank {r} is not a member of its group")
                if hit[2] >= P:
                    _fail(programs, r, step.index, f"'{op}' names a rank outside [0, {P})")
                me = hit[1][r]
                (si, sb), (ri, rb) = op.sparse_sends, op.sparse_recvs
                if _slot(si, sb, me) != _slot(ri, rb, me):
                    _fail(programs, r, step.index, f"'{op}': the slot of rank {r} itself must hold "
                                                   f"the same buffer on both sides (or '-')")
                issued[(step.index, op.group)][r].append(op)
    for (t, group), sides in issued.items():
        counts = {m: len(sides.get(m, ())) for m in group}
        if len(set(counts.values())) != 1:
            few = min(group, key=lambda m: counts[m])
            many = max(group, key=lambda m: counts[m])
            _fail(programs, few, t, f"rank {few} issues {counts[few]} collective(s) over group "
                                    f"{list(group)} in this step but rank {many} issues "
                                    f"{counts[many]}; every member issues the same collectives "
                                    f"in the same order")
        for n in range(counts[group[0]]):
            ops = [sides[m][n] for m in group]
            kind0 = ops[0].kind
            for m, op in zip(group, ops):
                if op.kind != kind0:
                    _fail(programs, m, t, f"'{op}' is collective #{n} over group {list(group)} "
                                          f"here, but rank {group[0]} issues '{ops[0]}'")
            # what a sends to each member is what each member receives from a
            sent, got = set(), set()
            for i, op in enumerate(ops):          # slots by zip (in C); own slots dropped
                (si, sb), (ri, rb) = op.sparse_sends, op.sparse_recvs
                sk, rk = op.send_blocks, op.recv_blocks     # a slot's blocks move with it
                sent.update(zip(itertools.repeat(i), si, sb, sk))
                got.update(zip(ri, itertools.repeat(i), rb, rk))
                at = _slot(si, tuple(range(len(si))), i)
                if at is not None:
                    sent.discard((i, i, sb[at], sk[at]))
                at = _slot(ri, tuple(range(len(ri))), i)
                if at is not None:
                    got.discard((i, i, rb[at], rk[at]))
            if sent != got:
                a_i, b_i = min((a_i, b_i) for a_i, b_i, _, _ in sent ^ got)
                a, b = group[a_i], group[b_i]
                given = _slot_text(ops[a_i].sparse_sends, ops[a_i].send_blocks, b_i)
                taken = _slot_text(ops[b_i].sparse_recvs, ops[b_i].recv_blocks, a_i)
                _fail(programs, a, t, f"'{ops[a_i]}' sends {given or 'nothing'} to rank {b}, but "
                                      f"rank {b}'s side '{ops[b_i]}' receives {taken or 'nothing'} "
                                      f"from rank {a}")


def _slot_text(sparse, blocks, k: int) -> str | None:
    """Slot ``k`` of a collective side as text, with its block ranges (None: empty)."""
    at = _slot(sparse[0], tuple(range(len(sparse[0]))), k)
    return None if at is None else f"{sparse[1][at]}{blocks_text(blocks[at])}"


def _slot(idx: tuple[int, ...], bufs: tuple[Buffer, ...], k: int) -> Buffer | None:
    """Slot ``k`` of a collective side given sparse (its buffer, or None)."""
    at = bisect.bisect_left(idx, k)
    return bufs[at] if at < len(idx) and idx[at] == k else None


def _check_presence(programs: Sequence[Program], *, backward: bool, kv: str) -> None:
    for prog in programs:
        r = prog.rank
        present = {_buf(Family.Q, r), _buf(Family.KV, r)}
        if backward:
            present |= {_buf(f, r) for f in (Family.OUT, Family.DOUT, Family.DQ, Family.DKV)}
            if kv == "keep":
                present |= {b for _, op in prog.ops() if isinstance(op, GradCompute)
                            for b in op.reads() if b.family is Family.KV}
        for step in prog.steps:
            arriving = []
            for op in step.ops:
                # a collective's own slot stays in place: not a read (RULES)
                reads = op.sent(r) if type(op) is Collective else op.reads()
                if present.issuperset(reads):
                    arriving.extend(op.writes())
                    continue
                for b in reads:
                    if b not in present and b.parent not in present:
                        if isinstance(op, Send):
                            what = f"'{op}' sends {b}, which is not on rank {r} yet"
                        else:
                            what = f"'{op}' needs {b}, which is not on rank {r} yet"
                        _fail(programs, r, step.index, what)
                arriving.extend(op.writes())
            present.update(arriving)


def _check_tiles(programs: Sequence[Program], need: np.ndarray) -> None:
    P = len(programs)
    tiles = [(op.q, op.kv, op.heads) for prog in programs for step in prog.steps
             for op in step.ops if type(op) in _TILES]
    qk = np.array([x[:2] for x in tiles], dtype=np.int64).reshape(-1, 2)
    q, k = qk[:, 0], qk[:, 1]
    if len(q) and (q.min() < 0 or q.max() >= P or k.min() < 0 or k.max() >= P):
        raise ScheduleError(f"a compute names a chunk outside [0, {P})")
    sliced: dict[tuple[int, int], list] = collections.defaultdict(list)
    if any(x[2] is not None for x in tiles):
        for i, j, h in tiles:
            sliced[(i, j)].append(h)
        count = np.zeros((P, P), dtype=np.int64)
    else:                                     # whole heads only: a count per tile
        count = np.bincount(q * P + k, minlength=P * P).reshape(P, P)
    for (i, j), heads in sliced.items():      # a tile is whole heads once, or each slice once
        ns = {h[1] for h in heads if h is not None}
        if heads == [None] or (len(ns) == 1 and None not in heads
                               and sorted(h[0] for h in heads) == list(range(ns.pop()))):
            count[i, j] = 1
        else:
            count[i, j] = len(heads) + (len(heads) == 1)     # never 1: not a cover
    bad = np.argwhere(count != need.astype(np.int64))
    if not len(bad):
        return
    i, j = (int(x) for x in bad[0])
    where = [f"rank {prog.rank} step {t}" + ("" if op.heads is None else f" (h{op.heads[0]}/"
                                              f"{op.heads[1]})")
             for prog in programs for t, op in prog.ops()
             if isinstance(op, (Compute, GradCompute)) and (op.q, op.kv) == (i, j)]
    n = len(where)
    what = ("is never computed" if n == 0 and need[i, j] else
            f"is computed {n} times ({', '.join(where)})" if need[i, j] else
            f"is empty but computed at {', '.join(where)}")
    raise ScheduleError(f"tile q{i}·kv{j} {what}; every non-empty tile must be computed "
                        f"exactly once (all heads at once, or each head slice of one split once)")


# ---- the cost model's program reader, op by op ---------------------------------------------
# The oracle of fringe.cost.programs.columns (which reads the ProgramTable's columns): the
# same columns from a walk over every op, as the cost model read programs before the one table.

import gc as _gc  # noqa: E402
import itertools as _itertools  # noqa: E402
import operator  # noqa: E402

from ..cost.programs import (_COLL_KINDS as _COST_COLL_KINDS,  # noqa: E402
                             FAMILIES as _COST_FAMILIES, FAMILY_CODE as _COST_FAMILY_CODE,
                             _Cols as _CostCols, _compute_touches as _cost_compute_touches,
                             _fam_bytes as _cost_fam_bytes, _i64 as _cost_i64)
from ..schedules.ir import TILE_TOUCHES as _COST_TILE_TOUCHES  # noqa: E402

_COST_BULK_OPS = 16       # steps of this many ops take their computes in bulk (the walk)


def cost_columns(programs: Sequence[Program], L: int, shape,
                 block_size: int | None = None) -> _CostCols:
    """The cost model's columns of ``programs`` (one per rank, in rank order) by walking every
    op: what :func:`fringe.cost.programs.columns` reads from their table (buffers and groups
    may be numbered otherwise; nothing the simulation reads differs). ``shape``: a
    :class:`fringe.cost.hardware.Shape`.

    Raises:
        ValueError: a buffer names a chunk past P, a collective does not list the rank that
            runs it, or an op kind the cost model does not model.
    """
    paused = _gc.isenabled()           # the walk makes many small lists and tuples: without
    _gc.disable()                      # a pause, collections traverse the millions of ops
    try:
        return _walk_cost_columns(programs, L, shape, block_size)
    finally:
        if paused:
            _gc.enable()


def _walk_cost_columns(programs: Sequence, L: int, shape, block_size=None) -> _CostCols:
    P = len(programs)
    fams, code = _COST_FAMILIES, _COST_FAMILY_CODE
    fam_bytes = _cost_fam_bytes(L, shape)
    base = len(fams) * P
    sliced: dict[tuple, int] = {}                      # (family code, chunk, (i, n)) -> id
    sliced_bytes: list[int] = []
    splits = {1}
    in_place = {k: rule.own_slot_in_place for k, rule in RULES.items()}
    cache: dict = {}
    sliced_chunks: list[int] = []

    class _Ids(dict):                                  # buffer -> id, learning new buffers
        def __missing__(self, b):
            return of_buffer(b)[0]
    ids_of = _Ids()

    def bid(fc: int, chunk: int, heads) -> int:
        if heads is None:
            return fc * P + chunk
        k = (fc, chunk, heads)
        hit = sliced.get(k)
        if hit is None:
            n = heads[1]
            splits.add(n)
            hit = sliced[k] = base + len(sliced_bytes)
            sliced_bytes.append(shape.buffer_bytes(fams[fc].value, L, split=n))
            sliced_chunks.append(chunk)
        return hit

    def of_buffer(b) -> tuple[int, int, int]:
        """(id, bytes, chunk) of a Buffer, cached."""
        hit = cache.get(b)
        if hit is None:
            fc, chunk, heads = code[b.family], b.chunk, b.heads
            if chunk >= P:
                raise ValueError(f"buffer {b} names chunk {chunk}, but the programs are for "
                                 f"P={P} ranks")
            i = bid(fc, chunk, heads)
            hit = cache[b] = (i, int(fam_bytes[fc]) if heads is None else sliced_bytes[i - base],
                              chunk)
            ids_of[b] = i
        return hit

    comp, send, touch, coll = [], [], [], []      # comp: computes of short steps, a row each
    # computes of long steps, a step at a time: (rank, step, count) and the step's q, kv, grad, heads lists
    c_at, c_q, c_kv, c_g, c_h = [], [], [], [], []
    k_touch = []                                       # collective sides: (rank, step, bufs, side)
    groups: dict[tuple, int] = {}
    qget, kvget, hget = (operator.attrgetter(a) for a in ("q", "kv", "heads"))
    for prog in programs:
        r = prog.rank
        for step in prog.steps:
            t = step.index
            ops = step.ops
            if len(ops) < _COST_BULK_OPS:                   # a short step: op by op
                rest = []
                for op in ops:
                    tp = type(op)
                    if tp is Compute or tp is GradCompute:
                        h = op.heads
                        comp.append((r, t, tp is GradCompute, op.q, op.kv, *(h or (-1, 1))))
                    else:
                        rest.append((op, tp))
                nc = ng = 0
            else:
                types = list(map(type, ops))
                nc, ng = types.count(Compute), types.count(GradCompute)
                rest = zip(ops, types)
            if nc or ng:                               # computes in bulk (most ops are these)
                comps = ops if nc + ng == len(ops) else [
                    op for op, tp in zip(ops, types) if tp is Compute or tp is GradCompute]
                c_at.append((r, t, len(comps)))
                c_q.append(list(map(qget, comps)))
                c_kv.append(list(map(kvget, comps)))
                c_g.append(ng if not nc or not ng else
                           [tp is GradCompute for tp in types if tp is Compute or tp is GradCompute])
                hs = list(map(hget, comps))
                c_h.append(None if hs.count(None) == len(hs) else hs)
                if nc + ng == len(ops):
                    continue
                rest = [(op, tp) for op, tp in zip(ops, types)
                        if tp is not Compute and tp is not GradCompute]
            seen: dict[int, int] = {}
            for op, tp in rest:
                if tp is Send or tp is Recv:
                    i, nbytes, chunk = of_buffer(op.buf)
                    if tp is Send:
                        if op.blocks is not None:      # its blocks' share of the buffer
                            nbytes = nbytes // L * block_size * sum(
                                hi - lo for lo, hi in op.blocks)
                        send.append((r, t, op.peer, nbytes))
                    if chunk != r:
                        touch.append((r, t, i, tp is Recv))
                elif tp is Collective:
                    gid = groups.setdefault(op.group, len(groups))
                    if r not in op.group:
                        raise ValueError(f"rank {r}, step {t}: {op.ascii()} does not list rank "
                                         f"{r} in its group {list(op.group)}")
                    me = op.group.index(r) if in_place[op.kind] else None
                    refs = [-1, -1]                   # its sides in k_touch (bytes: later)
                    for side, ((idx, bufs), ks) in enumerate(
                            ((op.sparse_sends, op.send_blocks), (op.sparse_recvs, op.recv_blocks))):
                        if not bufs:                  # the occupied slots only
                            continue
                        refs[side] = len(k_touch)     # its own slot stays in place (RULES)
                        tokens = None if not op.ranged else [    # ranged slots: their tokens
                            L if k is None else block_size * sum(h - lo for lo, h in k)
                            for k in ks]
                        k_touch.append((r, t, bufs, side, idx.index(me) if me in idx
                                        else None, tokens))   # (its touch is harmless)
                    ordinal = seen.get(gid, 0)
                    seen[gid] = ordinal + 1
                    coll.append((r, t, gid, ordinal, _COST_COLL_KINDS[op.kind], *refs))
                else:
                    raise ValueError(
                        f"the cost model does not model {type(op).__name__} ops (rank {r}, step "
                        f"{t}: {op}); it runs compute, send, receive and collective (AG, RS, A2A) "
                        f"ops")

    def cols(rows, width):
        flat = np.fromiter(_itertools.chain.from_iterable(rows), dtype=np.int64,
                           count=len(rows) * width)
        return tuple(flat.reshape(-1, width).T)

    def flat(lists, n):
        return np.fromiter(_itertools.chain.from_iterable(lists), dtype=np.int64, count=n)

    tc = cols(touch, 4)
    touch_cols = [(tc[0], tc[1], tc[2], tc[3].astype(bool))]
    coll_cols = cols(coll, 7)
    if k_touch:                                        # collective slots, one id lookup a slot
        counts = _cost_i64([len(x[2]) for x in k_touch])
        n = int(counts.sum())
        ids = np.fromiter(map(ids_of.__getitem__, _itertools.chain.from_iterable(
            x[2] for x in k_touch)), dtype=np.int64, count=n)
        by_id = np.concatenate([np.repeat(fam_bytes, P), _cost_i64(sliced_bytes)])
        chunk_by_id = np.concatenate([np.tile(np.arange(P, dtype=np.int64), len(fams)),
                                      _cost_i64(sliced_chunks)])
        slot_bytes = by_id[ids]
        start = np.cumsum(counts) - counts
        for i, x in enumerate(k_touch):
            if x[5] is not None:                       # a ranged slot: its blocks' share
                at = slice(int(start[i]), int(start[i] + counts[i]))
                slot_bytes[at] = slot_bytes[at] // L * _cost_i64(x[5])
        own = [(i, int(start[i]) + x[4]) for i, x in enumerate(k_touch) if x[4] is not None]
        if own:
            o_i, o_at = (_cost_i64(v) for v in zip(*own))
        moved = np.add.reduceat(slot_bytes, start)
        if own:
            moved[o_i] -= slot_bytes[o_at]
        moved = np.r_[moved, 0]                        # ref -1: an empty side moves nothing
        coll_cols = (*coll_cols[:5], moved[coll_cols[5]], moved[coll_cols[6]])
        kr = np.repeat(_cost_i64([x[0] for x in k_touch]), counts)
        far = chunk_by_id[ids] != kr
        touch_cols.append((kr[far], np.repeat(_cost_i64([x[1] for x in k_touch]), counts)[far],
                           ids[far], np.repeat(np.array([x[3] for x in k_touch], bool), counts)[far]))
    at = np.array(c_at, dtype=np.int64).reshape(-1, 3)
    n_c = int(at[:, 2].sum())
    cr, ct = np.repeat(at[:, 0], at[:, 2]), np.repeat(at[:, 1], at[:, 2])
    cq, ckv = flat(c_q, n_c), flat(c_kv, n_c)
    off = np.cumsum(at[:, 2]) - at[:, 2]
    cg = np.repeat(_cost_i64([min(g, 1) if isinstance(g, int) else 0 for g in c_g]), at[:, 2])
    for o, g in zip(off.tolist(), c_g):               # steps mixing C and G (none built-in)
        if not isinstance(g, int):
            cg[o:o + len(g)] = g
    chi, chn = np.full(n_c, -1, dtype=np.int64), np.ones(n_c, dtype=np.int64)
    sliced_steps = [(o, hs) for o, hs in zip(off.tolist(), c_h) if hs is not None]
    if sliced_steps:
        where = np.concatenate([np.arange(o, o + len(hs)) for o, hs in sliced_steps])
        hh = np.array([(-1, 1) if h is None else h for h in
                       _itertools.chain.from_iterable(hs for _, hs in sliced_steps)],
                      dtype=np.int64).reshape(-1, 2)
        chi[where], chn[where] = hh[:, 0], hh[:, 1]
    if comp:                                           # short steps' rows (a cell's computes
        rows = cols(comp, 7)                           # come from one path, in op order)
        cr, ct, cg, cq, ckv, chi, chn = (np.concatenate([x, y]) for x, y in
                                         zip((cr, ct, cg, cq, ckv, chi, chn), rows))
    whole = chi < 0
    touch_cols += _cost_compute_touches(P, cr[whole], ct[whole], cg[whole], cq[whole], ckv[whole])
    if not whole.all():                               # head slices: an id per distinct buffer
        sl = ~whole
        r_, t_, g_, q_, kv_, hi, hn = (x[sl] for x in (cr, ct, cg, cq, ckv, chi, chn))
        for gval, fam_chunks in _COST_TILE_TOUCHES.items():      # the rule table's touches
            for fam, which, start in fam_chunks:
                ch = kv_ if which else q_
                m = (g_ == gval) & (ch != r_)
                if not m.any():
                    continue
                combo = np.stack([ch[m], hi[m], hn[m]], axis=1)
                uniq, inv = np.unique(combo, axis=0, return_inverse=True)
                fc = code[fam]
                ids = _cost_i64([bid(fc, int(c), (int(i), int(n))) for c, i, n in uniq.tolist()])
                touch_cols.append((r_[m], t_[m], ids[inv.reshape(-1)], bool(start)))
    buf_bytes = np.concatenate([np.repeat(fam_bytes, P), _cost_i64(sliced_bytes)])
    return _CostCols(P, (cr, ct, cg, cq, ckv, chn), cols(send, 4), touch_cols, coll_cols,
                 [g for g, _ in sorted(groups.items(), key=lambda x: x[1])], buf_bytes,
                 tuple(sorted(splits)))


# ---------------------------------------------------------------------------------------
# plan stats: the op counts, op by op
# ---------------------------------------------------------------------------------------
class _KeyOf(dict):
    """Buffer -> ``(Family, n)`` (n of its head slice, 1 for all heads), filled on demand;
    one key tuple per (family, n), shared by every buffer that has it."""

    def __init__(self) -> None:
        super().__init__()
        self._keys: dict = {}

    def __missing__(self, b):
        h = b.heads
        key = (b.family, 1 if h is None else h[1])
        key = self[b] = self._keys.setdefault(key, key)
        return key


def op_counts(programs, P: int, *, computes: bool = True, n: int | None = None) -> _OpCounts:
    """The plan stats' op counts (:func:`fringe.plan._op_counts`) by walking every op (with
    ``n``: in blocks, a whole buffer ``n``, a ranged transfer its blocks).

    A step's ops are read as they are held (no per-op tuple or buffer is built); a
    collective's slots are counted from its sparse side, in C (``Counter.update``)."""
    q, kv, split, per_rank = [], [], [], []
    keyof = _KeyOf()
    sent = [collections.Counter() for _ in programs]
    recv = [collections.Counter() for _ in programs]
    steps = np.zeros(P, dtype=np.int64)
    bisect_left = bisect.bisect_left
    in_place = {k: rule.own_slot_in_place for k, rule in RULES.items()}     # the rule table
    for r, prog in enumerate(programs):           # row r: the r-th program, as plan.forward[r]
        s_r, r_r, n0 = sent[r], recv[r], len(q)
        prog_steps = prog.steps
        steps[r] = len(prog_steps)
        for step in prog_steps:
            for op in step.ops:
                t = type(op)
                if t is Compute:
                    if computes:
                        q.append(op.q)
                        kv.append(op.kv)
                        split.append(op.heads)
                elif t is Send or t is Recv:
                    k = 1 if n is None else (n if op.blocks is None else
                                             sum(hi - lo for lo, hi in op.blocks))
                    (s_r if t is Send else r_r)[keyof[op.buf]] += k
                elif t is Collective:
                    me = op.member_index(prog.rank) if in_place[op.kind] else None
                    for (idx, bufs), ks, got in ((op.sparse_sends, op.send_blocks, s_r),
                                                 (op.sparse_recvs, op.recv_blocks, r_r)):
                        if n is None:
                            got.update(map(keyof.__getitem__, bufs))
                        else:
                            ks = [n if k is None else sum(hi - lo for lo, hi in k) for k in ks]
                            for b, k in zip(bufs, ks):
                                got[keyof[b]] += k
                        if me is not None:            # its own slot stays in place
                            at = bisect_left(idx, me)
                            if at < len(idx) and idx[at] == me:
                                got[keyof[bufs[at]]] -= 1 if n is None else ks[at]
        per_rank.append(len(q) - n0)
    keys = tuple(sorted({k for c in (*sent, *recv) for k in c},
                        key=lambda k: (_FAMILY_ORDER[k[0]], k[1])))
    col = {k: i for i, k in enumerate(keys)}
    arrays = []
    for side in (sent, recv):
        a = np.zeros((P, len(keys)), dtype=np.int64)
        for r, c in enumerate(side):
            for k, n in c.items():
                a[r, col[k]] = n
        arrays.append(a)
    rank = np.repeat(np.arange(len(programs), dtype=np.int64), per_rank)
    splits = None
    if any(h is not None for h in split):
        splits = np.array([1 if h is None else h[1] for h in split], dtype=np.int64)
    return _OpCounts((rank, np.array(q, dtype=np.int64), np.array(kv, dtype=np.int64)), splits,
                     keys, *arrays, steps)


_FAMILY_ORDER = {f: n for n, f in enumerate(Family)}


def moved_bytes(ops, rank: int, price) -> tuple[int, int]:
    """``(sent, received)`` bytes of ``ops`` (one rank's, any order) by walking them: a
    ``Send`` / ``Recv`` and each collective slot for another member priced by ``price(buffer,
    blocks)`` (``blocks``: its block ranges, None whole); a member's own slot moves nothing."""
    sent = got = 0
    for op in ops:
        if isinstance(op, Send):
            sent += price(op.buf, op.blocks)
        elif isinstance(op, Recv):
            got += price(op.buf, op.blocks)
        elif isinstance(op, Collective):
            me = op.group.index(rank)
            for (idx, bufs), ks, side in ((op.sparse_sends, op.send_blocks, 0),
                                          (op.sparse_recvs, op.recv_blocks, 1)):
                n = sum(price(b, k) for i, b, k in zip(idx, bufs, ks) if i != me)
                sent, got = (sent + n, got) if side == 0 else (sent, got + n)
    return sent, got


def assert_same_counts(a: _OpCounts, b: _OpCounts, *, steps: bool = True) -> None:
    """Assert two :class:`~fringe._stats._OpCounts` equal field by field (computes in any
    order); ``steps=False`` leaves the step counts out. Sent / received / step counts must be
    int64 when ``steps`` is compared."""
    order = [np.lexsort(c.computes[::-1]) for c in (a, b)]
    for x, y in zip(a.computes, b.computes):
        assert np.array_equal(x[order[0]], y[order[1]])
    assert (a.splits is None) == (b.splits is None)
    if a.splits is not None:
        assert np.array_equal(a.splits[order[0]], b.splits[order[1]])
    assert a.keys == b.keys
    if not steps:
        for x, y in ((a.sent, b.sent), (a.recv, b.recv)):
            assert np.array_equal(x, y)
        return
    for x, y in ((a.sent, b.sent), (a.recv, b.recv), (a.steps, b.steps)):
        assert x.dtype == y.dtype == np.int64 and np.array_equal(x, y)
