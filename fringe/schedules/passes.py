"""Passes over programs: lowering a communication pattern, pruning by the mask, deriving
the backward by rule, and the structural checks every schedule must pass.

All of these work on :class:`~fringe.schedules.ir.Program` values only, so a hand-written
list of steps gets the same pruning, checks and backward as the built-in schedules.
"""
from __future__ import annotations

import collections
import dataclasses
from typing import Sequence

import torch

from .ir import Compute, GradCompute, Op, Program, Recv, Send, buffer_name, program_from_ops, split_name


class ScheduleError(ValueError):
    """A program violates the IR's rules; the message names the rank and step."""


@dataclasses.dataclass(frozen=True)
class Hop:
    """kv chunk ``chunk`` moves from rank ``src`` to rank ``dst`` during step ``step``."""

    step: int
    src: int
    dst: int


# ---------------------------------------------------------------------------------------
# lowering
# ---------------------------------------------------------------------------------------
def lower(world_size: int, hops: dict[int, Sequence[Hop]]) -> list[Program]:
    """Programs that move each kv chunk along its hops and compute every tile on arrival.

    Args:
        world_size: P.
        hops: for each kv chunk j (owned by rank j), the hops it takes, forming a tree
            rooted at rank j.

    Returns:
        One unpruned program per rank: every (q_r, kv_j) tile that reaches rank r is
        computed at the first step kv_j is present there.
    """
    P = world_size
    ops: list[dict[int, list[Op]]] = [collections.defaultdict(list) for _ in range(P)]
    for r in range(P):
        ops[r][0].append(Compute(r, r))
    for j in range(P):
        arrival = {j: 0}
        for hop in sorted(hops.get(j, ()), key=lambda h: h.step):
            for rank in (hop.src, hop.dst):
                if not 0 <= rank < P:
                    raise ScheduleError(f"hop {hop} of kv{j} names rank {rank}, outside [0, {P})")
            if hop.src not in arrival or arrival[hop.src] > hop.step:
                raise ScheduleError(f"kv{j} is sent from rank {hop.src} at step {hop.step} "
                                    f"before it is there")
            if hop.dst in arrival:
                raise ScheduleError(f"kv{j} reaches rank {hop.dst} twice (again at step {hop.step})")
            arrival[hop.dst] = hop.step + 1
            name = buffer_name("kv", j)
            ops[hop.src][hop.step].append(Send(name, hop.dst))
            ops[hop.dst][hop.step].append(Recv(name, hop.src))
            ops[hop.dst][hop.step + 1].append(Compute(hop.dst, j))
    return [program_from_ops(r, ops[r]) for r in range(P)]


# ---------------------------------------------------------------------------------------
# pruning
# ---------------------------------------------------------------------------------------
def _kv_hops(programs: Sequence[Program]) -> dict[int, list[Hop]]:
    hops: dict[int, list[Hop]] = collections.defaultdict(list)
    for prog in programs:
        for t, op in prog.ops():
            if isinstance(op, Send):
                kind, j = split_name(op.buf)
                if kind == "kv":
                    hops[j].append(Hop(t, prog.rank, op.peer))
    return hops


def prune(programs: Sequence[Program], need: torch.Tensor) -> list[Program]:
    """Drop EMPTY tiles, and sends of a kv buffer past the last rank that needs it.

    Args:
        programs: forward programs, one per rank.
        need: bool ``[P, P]``; ``need[i, j]`` is True when tile (q_i, kv_j) is non-empty.

    Returns:
        Programs without computes of empty tiles, without hops whose receiving subtree
        computes nothing with that buffer, and without steps left with nothing to do.
    """
    P = len(programs)
    uses: dict[int, set[int]] = collections.defaultdict(set)      # kv chunk -> ranks computing it
    for prog in programs:
        for _, op in prog.ops():
            if isinstance(op, Compute) and bool(need[op.q, op.kv]):
                uses[op.kv].add(prog.rank)
    keep: set[tuple[int, int, int, int]] = set()                  # (j, step, src, dst)
    for j, hops in _kv_hops(programs).items():
        # a hop is kept when its receiver, or anyone it forwards to later, computes with kv_j
        for hop in sorted(hops, key=lambda h: -h.step):
            downstream = any((j, h.step, h.src, h.dst) in keep for h in hops
                             if h.src == hop.dst and h.step > hop.step)
            if hop.dst in uses[j] or downstream:
                keep.add((j, hop.step, hop.src, hop.dst))
    pruned = []
    for prog in programs:
        ops: dict[int, list[Op]] = collections.defaultdict(list)
        for t, op in prog.ops():
            if isinstance(op, Compute):
                if bool(need[op.q, op.kv]):
                    ops[t].append(op)
            elif isinstance(op, (Send, Recv)):
                kind, j = split_name(op.buf)
                src, dst = (prog.rank, op.peer) if isinstance(op, Send) else (op.peer, prog.rank)
                if kind != "kv" or (j, t, src, dst) in keep:
                    ops[t].append(op)
            else:
                ops[t].append(op)
        pruned.append(program_from_ops(prog.rank, ops))
    if len(pruned) != P:
        raise AssertionError("prune changed the number of ranks")
    return pruned


# ---------------------------------------------------------------------------------------
# reverse: the backward program, derived by rule
# ---------------------------------------------------------------------------------------
KV_MODES = ("resend", "keep")


def reverse(programs: Sequence[Program], *, kv: str = "resend") -> list[Program]:
    """Derive the backward programs from forward ones.

    Rules (no schedule has a hand-written backward):

    * Steps run in reverse: forward step t becomes backward step ``T - t`` (T = number of
      forward rounds); backward step 0 is a prologue that only moves kv.
    * ``C qi·kvj`` becomes its VJP ``G qi·kvj`` (dq_i accumulates locally, dkv_j into the
      gradient buffer that travels back with kv_j).
    * A receive of ``kvj`` from p becomes a send of ``dkvj`` back to p (accumulated
      there), and a send becomes the matching receive: the adjoint of the forward's
      communication, so gradients end on the rank that owns the data.
    * ``kv="resend"`` (default, O(L) memory): kv_j is re-sent along the reversed route to
      the ranks that need it again, one step before their first use; the last rank on the
      route (or one whose downstream cannot deliver in time) fetches it from the owner.
      ``kv="keep"``: ranks keep every kv buffer they computed with in the forward (more
      memory, no kv traffic in the backward).

    Raises:
        ScheduleError: if the programs are not forward programs or kv cannot be delivered.
    """
    if kv not in KV_MODES:
        raise ValueError(f"kv must be one of {KV_MODES}, got {kv!r}")
    P = len(programs)
    T = 1 + max((s.index for p in programs for s in p.steps), default=-1)
    ops: list[dict[int, list[Op]]] = [collections.defaultdict(list) for _ in range(P)]
    computes: dict[tuple[int, int], list[int]] = collections.defaultdict(list)   # (rank, j) -> t
    in_hop: dict[tuple[int, int], Hop] = {}                                        # (rank, j)
    out_hops: dict[tuple[int, int], list[Hop]] = collections.defaultdict(list)     # (rank, j)
    for prog in programs:
        r = prog.rank
        for t, op in prog.ops():
            u = T - t
            if isinstance(op, Compute):
                if op.q != r:
                    raise ScheduleError(f"rank {r}, step {t}: {op} computes with q{op.q}, but "
                                        f"queries do not move in these programs")
                ops[r][u].append(GradCompute(op.q, op.kv))
                computes[(r, op.kv)].append(t)
                continue
            if not isinstance(op, (Send, Recv)):
                raise ScheduleError(f"rank {r}, step {t}: reverse takes forward programs; "
                                    f"found {op}")
            kind, j = split_name(op.buf)
            if kind != "kv":
                raise ScheduleError(f"rank {r}, step {t}: only kv buffers move forward, got {op}")
            grad = buffer_name("dkv", j)
            if isinstance(op, Send):
                ops[r][u].append(Recv(grad, op.peer))
                out_hops[(r, j)].append(Hop(t, r, op.peer))
            else:
                ops[r][u].append(Send(grad, op.peer))
                in_hop[(r, j)] = Hop(t, op.peer, r)

    if kv == "resend":
        _resend_kv(P, T, ops, computes, in_hop, out_hops)
    return [program_from_ops(r, ops[r]) for r in range(P)]


def _resend_kv(P, T, ops, computes, in_hop, out_hops) -> None:
    """Add the kv moves of the backward: each non-owner that needs kv_j gets it in time."""
    chunks = {j for (_, j) in list(computes) + list(in_hop)}
    for j in sorted(chunks):
        holders = [r for r in range(P) if r != j and ((r, j) in in_hop or (r, j) in computes)]

        def supplier(r: int) -> int | None:
            hops = out_hops.get((r, j), [])
            return max(hops, key=lambda h: h.step).dst if hops else None

        need_at: dict[int, int] = {}      # rank -> first backward step it needs kv_j present

        def first_need(r: int) -> int | None:
            if r in need_at:
                return need_at[r]
            times = [T - t for t in computes.get((r, j), [])]
            hop = in_hop.get((r, j))
            if hop is not None and hop.src != j and supplier(hop.src) == r:
                up = first_need(hop.src)
                if up is not None:
                    times.append(T - hop.step - 1)    # r sends kv_j up at that step
            need_at[r] = min(times) if times else None
            return need_at[r]

        name = buffer_name("kv", j)
        for r in holders:
            e = first_need(r)
            if e is None:
                continue
            d = supplier(r)
            if d is not None:
                t_s = max(h.step for h in out_hops[(r, j)])
                if T - t_s <= e and first_need(d) is not None:
                    u = T - t_s - 1
                    ops[d][u].append(Send(name, r))
                    ops[r][u].append(Recv(name, d))
                    continue
            if e - 1 < 0:
                raise ScheduleError(f"rank {r} needs kv{j} at backward step {e}; there is no "
                                    f"earlier step to fetch it in")
            ops[j][e - 1].append(Send(name, r))
            ops[r][e - 1].append(Recv(name, j))


# ---------------------------------------------------------------------------------------
# checks
# ---------------------------------------------------------------------------------------
def check(programs: Sequence[Program], *, need: torch.Tensor | None = None,
          backward: bool = False, kv: str = "resend") -> None:
    """Structural checks, raising :class:`ScheduleError` with the rank and step.

    * programs are for ranks 0..P-1 in order; peers are valid and never the rank itself;
    * every send has its receive of the same buffer on the peer in the same step, and
      vice versa;
    * a buffer is sent or computed with only while present on that rank (owned, or
      received at an earlier step; in the backward with ``kv="keep"``, kv kept from the
      forward counts as present);
    * with ``need``: every non-empty (q, kv) tile is computed exactly once across ranks
      and no empty tile is computed.
    """
    P = len(programs)
    for r, prog in enumerate(programs):
        if prog.rank != r:
            raise ScheduleError(f"program {r} is for rank {prog.rank}; pass programs in rank order")
    posted: dict[tuple[int, int, int, str, str], int] = collections.Counter()
    for prog in programs:
        for t, op in prog.ops():
            if isinstance(op, (Send, Recv)):
                if not 0 <= op.peer < P or op.peer == prog.rank:
                    raise ScheduleError(f"rank {prog.rank}, step {t}: {op} names an invalid peer "
                                        f"(world size {P})")
                src, dst = (prog.rank, op.peer) if isinstance(op, Send) else (op.peer, prog.rank)
                posted[(t, src, dst, op.buf, type(op).__name__)] += 1
    for (t, src, dst, buf, kind), n in posted.items():
        other = "Recv" if kind == "Send" else "Send"
        if posted.get((t, src, dst, buf, other), 0) != n:
            who, op = (src, Send(buf, dst)) if kind == "Send" else (dst, Recv(buf, src))
            peer = dst if kind == "Send" else src
            missing = "receive" if kind == "Send" else "send"
            raise ScheduleError(f"rank {who}, step {t}: '{op}' has no matching {missing} on rank "
                                f"{peer} in the same step")
    _check_presence(programs, backward=backward, kv=kv)
    if need is not None:
        count = torch.zeros(P, P, dtype=torch.int64)
        where: dict[tuple[int, int], list[str]] = collections.defaultdict(list)
        for prog in programs:
            for t, op in prog.ops():
                if isinstance(op, (Compute, GradCompute)):
                    count[op.q, op.kv] += 1
                    where[(op.q, op.kv)].append(f"rank {prog.rank} step {t}")
        bad = (count != need.to(torch.int64)).nonzero().tolist()
        if bad:
            i, j = bad[0]
            n = int(count[i, j])
            what = ("is never computed" if n == 0 and bool(need[i, j]) else
                    f"is computed {n} times ({', '.join(where[(i, j)])})" if bool(need[i, j]) else
                    f"is empty but computed at {', '.join(where[(i, j)])}")
            raise ScheduleError(f"tile q{i}·kv{j} {what}; every non-empty tile must be computed "
                                f"exactly once")


def _check_presence(programs: Sequence[Program], *, backward: bool, kv: str) -> None:
    for prog in programs:
        r = prog.rank
        present = {buffer_name("kv", r)}
        if backward and kv == "keep":
            present |= {buffer_name("kv", op.kv) for _, op in prog.ops()
                        if isinstance(op, GradCompute)}
        for step in prog.steps:
            arriving = set()
            for op in step.ops:
                if isinstance(op, (Compute, GradCompute)):
                    name = buffer_name("kv", op.kv)
                    if name not in present:
                        raise ScheduleError(f"rank {r}, step {step.index}: '{op}' needs {name}, "
                                            f"which is not on rank {r} yet")
                elif isinstance(op, Send) and split_name(op.buf)[0] == "kv":
                    if op.buf not in present:
                        raise ScheduleError(f"rank {r}, step {step.index}: '{op}' sends {op.buf}, "
                                            f"which is not on rank {r} yet")
                elif isinstance(op, Recv) and split_name(op.buf)[0] == "kv":
                    arriving.add(op.buf)
            present |= arriving
