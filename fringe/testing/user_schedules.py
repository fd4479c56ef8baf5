"""Collective schedules written the way a user writes them: op objects, no mask in sight.

They exist for the tests (and as worked examples): fringe must prune them to the mask,
derive their backward under either kv policy, and run them exactly. Own slots (a member's
slot for itself) may hold the buffer on both sides or nothing; the result is the same.
"""
from __future__ import annotations

from .. import layout as _layout
from ..schedules.base import Schedule
from ..schedules.columns import ProgramBuilder
from ..schedules.ir import Buffer, Collective, Compute, Program, Recv, Send, Step

#: own-slot conventions: ``"same"`` (the buffer on both sides), ``"none"`` (empty), and
#: ``"mixed"`` (alternating between the two by collective)
OWN_SLOTS = ("same", "none", "mixed")


def _kv(chunk: int) -> Buffer:
    return Buffer.of("kv", chunk)


def _gather(group: tuple[int, ...], rank: int, mine: Buffer, got: list, empty_own: bool):
    sends, recvs = [mine] * len(group), list(got)
    if empty_own:
        at = group.index(rank)
        sends[at] = recvs[at] = None
    return Collective("AG", group, sends, recvs)


def two_level_allgather(group_size: int, *, own: str = "same") -> Schedule:
    """All-gather kv in two levels: within groups of ``group_size`` consecutive ranks, then
    across groups (one all-gather per position in the group, each forwarding a chunk the
    first level brought): a chain of two collectives. Each rank computes its own tile at
    step 0, its group's at step 1 and everyone else's at step 2.
    """
    if own not in OWN_SLOTS:
        raise ValueError(f"own must be one of {OWN_SLOTS}, got {own!r}")
    g = group_size

    def programs(P: int) -> list[Program]:
        if P % g:
            raise ValueError(f"two_level_allgather({g}) needs world_size divisible by {g}, "
                             f"got {P}")
        progs = []
        for r in range(P):
            j = r // g
            inner = tuple(range(j * g, j * g + g))
            outer = tuple(range(r % g, P, g))
            step0 = (Compute(r, r), _gather(inner, r, _kv(r), [_kv(m) for m in inner],
                                             own == "none"))
            step1 = [Compute(r, c) for c in inner if c != r]
            for m in range(g):                  # forward chunk j*g+m (brought at step 0)
                step1.append(_gather(outer, r, _kv(j * g + m),
                                     [_kv(o - r % g + m) for o in outer],
                                     own == "none" or (own == "mixed" and m % 2 == 1)))
            step2 = tuple(Compute(r, c) for c in range(P) if c // g != j)
            progs.append(Program(r, (Step(0, step0), Step(1, tuple(step1)), Step(2, step2))))
        return progs
    return Schedule(f"two_level_allgather({g},{own})", layout=_layout.contiguous,
                    programs_fn=programs)


def allgather_then_ring(group_size: int, *, own: str = "same") -> Schedule:
    """All-gather kv within groups of ``group_size`` consecutive ranks, then pass the
    group's chunks around a ring of groups by point-to-point sends (rank r to r+g): a
    collective followed by point-to-point hops of what it brought."""
    if own not in OWN_SLOTS:
        raise ValueError(f"own must be one of {OWN_SLOTS}, got {own!r}")
    g = group_size

    def programs(P: int) -> list[Program]:
        if P % g:
            raise ValueError(f"allgather_then_ring({g}) needs world_size divisible by {g}, "
                             f"got {P}")
        n = P // g
        progs = []
        for r in range(P):
            j = r // g
            inner = tuple(range(j * g, j * g + g))
            steps = [Step(0, (Compute(r, r), _gather(inner, r, _kv(r), [_kv(m) for m in inner],
                                                      own != "same")))]
            nxt, prv = (r + g) % P, (r - g) % P
            for s in range(1, n + 1):
                have = (j - s + 1) % n          # the group whose chunks r holds now
                ops = [Compute(r, have * g + m) for m in range(g) if have * g + m != r]
                if s < n:
                    ops += [Send(_kv(have * g + m), nxt) for m in range(g)]
                    ops += [Recv(_kv((j - s) % n * g + m), prv) for m in range(g)]
                steps.append(Step(s, tuple(ops)))
            progs.append(Program(r, tuple(steps)))
        return progs
    return Schedule(f"allgather_then_ring({g},{own})", layout=_layout.contiguous,
                    programs_fn=programs)


def two_level_allgather_columns(group_size: int, *, mask_aware: bool = False) -> Schedule:
    """:func:`two_level_allgather` (own slots ``"same"``) written with the column builder:
    the same programs, without a Python object per op. ``mask_aware=True`` builds it with
    ``build=`` and adds only the computes of the mask's non-empty tiles (the gathers stay
    whole: fringe's ``prune`` thins them)."""
    import numpy as np

    g = group_size

    def programs(P: int, need=None) -> list[Program]:
        if P % g:
            raise ValueError(f"two_level_allgather_columns({g}) needs world_size divisible by "
                             f"{g}, got {P}")
        b = ProgramBuilder(P)
        r = np.arange(P)
        same = r[:, None] // g == r[None, :] // g
        tiles = np.ones((P, P), dtype=bool) if need is None else need
        b.computes(rank=r, step=0, q=r, kv=r)
        for j in range(P // g):
            inner = tuple(range(j * g, j * g + g))
            b.allgather(step=0, group=inner, chunk=list(inner))
        rr, cc = np.nonzero(same & (r[:, None] != r[None, :]) & tiles)
        b.computes(rank=rr, step=1, q=rr, kv=cc)
        for m in range(g):                      # position m's chunk of every group
            for i in range(g):
                outer = tuple(range(i, P, g))
                b.allgather(step=1, group=outer, chunk=[o - i + m for o in outer])
        rr, cc = np.nonzero(~same & tiles)
        b.computes(rank=rr, step=2, q=rr, kv=cc)
        return b.programs()
    name = f"two_level_allgather_columns({g})"
    if mask_aware:
        return Schedule(name, layout=_layout.contiguous, build=programs)
    return Schedule(name, layout=_layout.contiguous, programs_fn=programs)
