"""The column passes equal the oracle (``fringe.testing.oracle``, the op-by-op rules) on
random and mask-shaped tile maps: prune, reverse under both kv policies, plan stats' op
counts and the cost model's prediction, for every schedule (the ring chain shortcut and the
general tables) and user collective schedules (chains of collectives, a collective then a
ring, own slots either way) at several (P, group size). Programs the rules cannot reverse
correctly (an input arriving twice) raise a named ScheduleError."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

import fringe
from fringe import masks, schedules
from fringe.plan import _OpCounts, _op_counts
from fringe.runtime import costmodel
from fringe.schedules import Compute, Program, ScheduleError, Step, passes
from fringe.schedules.ir import Buffer, Collective, Recv, Send, format_programs
from fringe.testing import oracle
from fringe.testing.user_schedules import (allgather_then_ring, two_level_allgather,
                                           two_level_allgather_columns)

BUILTIN = [("ring", (5, 8)), ("zigzag", (5, 8)), ("striped", (6,)), ("balanced", (6,)),
           ("allgather", (6, 8)), ("allgather:3", (6,)), ("ulysses", (6,)),
           ("compose:zigzag+ulysses:2", (8,)), ("compose:zigzag+allgather:2:2", (8,)),
           ("compose:zigzag+ring:2", (6,)), ("compose:ring+ulysses:4", (8,)),
           ("compose:allgather:4+ulysses:2", (8,))]
USER = [(f"two_level_allgather({g}, own={own!r})", P)
        for own, sizes in (("same", ((6, 3), (8, 4))), ("none", ((8, 2),)), ("mixed", ((8, 4),)))
        for P, g in sizes]
USER += [(f"allgather_then_ring({g}, own={own!r})", P)
         for own, sizes in (("same", ((6, 2), (8, 4))), ("none", ((8, 2),))) for P, g in sizes]
USER += [("two_level_allgather_columns(2)", 6), ("two_level_allgather_columns(4, mask_aware=True)", 8)]
CASES = [(name, P) for name, ps in BUILTIN for P in ps] + USER


def _schedule(name: str):
    return eval(name) if "(" in name else schedules.get(name)   # noqa: S307 (names above)


def _maps(P: int, seed: int) -> dict[str, np.ndarray]:
    """Tile maps: random (sparse, dense), causal, documents (causal within random documents)."""
    rng = np.random.default_rng(seed)
    out = {f"random{d}": rng.random((P, P)) < d for d in (0.3, 0.7)}
    out["causal"] = np.tri(P, dtype=bool)
    doc = np.cumsum(rng.random(P) < 0.4)
    out["documents"] = out["causal"] & (doc[:, None] == doc[None, :])
    return out


def _same_counts(a: _OpCounts, b: _OpCounts) -> None:
    oracle.assert_same_counts(a, b, steps=False)


@pytest.mark.parametrize("name,P", CASES)
def test_column_passes_equal_the_oracle_on_tile_maps(name, P):
    sched = _schedule(name)
    full = sched.programs(P)                      # unpruned (every tile)
    for mname, need in _maps(P, seed=P).items():
        need = need.copy()
        want = oracle.prune(full, need)
        got = passes.prune(full, need)
        assert format_programs(got) == format_programs(want), (mname, "prune")
        if sched.hops is not None:                # lowered and pruned in one pass
            assert format_programs(sched.programs(P, torch.from_numpy(need))) == \
                format_programs(want), (mname, "lower")
        if not need.any():
            continue
        _same_counts(_op_counts(got, P), oracle.op_counts(want, P))
        for kv in ("resend", "keep"):
            back = passes.reverse(got, kv=kv)
            assert format_programs(back) == format_programs(oracle.reverse(want, kv=kv)), \
                (mname, kv)
            _same_counts(_op_counts(back, P, steps=False, computes=False),
                         oracle.op_counts(back, P, computes=False))
            passes.check(back, need=need, backward=True, kv=kv)


def _kv(j: int) -> Buffer:
    return Buffer.of("kv", j)


def test_an_input_that_arrives_twice_is_named():
    """kv0 reaches rank 2 from rank 0 and again from rank 1: its gradient would go back twice."""
    progs = [Program(0, (Step(0, (Compute(0, 0), Send(_kv(0), 1), Send(_kv(0), 2))),)),
             Program(1, (Step(0, (Compute(1, 1), Recv(_kv(0), 0))),
                         Step(1, (Compute(1, 0), Send(_kv(0), 2))))),
             Program(2, (Step(0, (Compute(2, 2), Recv(_kv(0), 0))),
                         Step(1, (Compute(2, 0), Recv(_kv(0), 1)))))]
    passes.check(progs)
    with pytest.raises(ScheduleError, match=r"rank 2, step 1: kv0 arrives at rank 2 again \(it "
                                            r"arrived at step 0\)(.|\n)*ERROR HERE"):
        passes.reverse(progs)


def test_a_collective_and_a_hop_bringing_one_buffer_are_named():
    g = (0, 1)
    ag = [Collective("AG", g, [_kv(r)] * 2, [_kv(0), _kv(1)]) for r in g]
    progs = [Program(0, (Step(0, (Compute(0, 0), ag[0])), Step(1, (Compute(0, 1), Send(_kv(0), 1))))),
             Program(1, (Step(0, (Compute(1, 1), ag[1])), Step(1, (Compute(1, 0), Recv(_kv(0), 0)))))]
    for kv in ("resend", "keep"):
        with pytest.raises(ScheduleError, match=r"rank 1, step 1: kv0 arrives at rank 1 again"):
            passes.reverse(progs, kv=kv)


def test_reverse_of_backward_programs_names_the_first_gradient_op_as_the_oracle_does():
    fwd = schedules.get("allgather").programs(4)
    back = passes.reverse(fwd)
    with pytest.raises(ScheduleError) as got:
        passes.reverse(back)
    with pytest.raises(ScheduleError) as want:
        oracle.reverse(back)
    assert str(got.value) == str(want.value)
    assert "reverse takes forward programs" in str(got.value)


def test_past_the_plane_limit_reverse_and_prune_sort_keys(monkeypatch):
    """Dense (buffer, rank) planes past PLANE_CELLS give way to sorted keys: the same answers
    (ring chain, general tables, reads of head slices that were never sent)."""
    need = np.tri(8, dtype=bool) | (np.random.default_rng(0).random((8, 8)) < 0.2)
    cases = [(n, schedules.get(n).programs(8)) for n in ("zigzag", "compose:zigzag+ulysses:2")]
    cases.append(("two_level", two_level_allgather(4, own="mixed").programs(8)))
    want = {n: (oracle.prune(f, need), ) for n, f in cases}
    monkeypatch.setattr(passes, "PLANE_CELLS", 0)
    monkeypatch.setattr(passes, "DENSE_CELLS", 0)
    for n, full in cases:
        got = passes.prune(full, need)
        assert format_programs(got) == format_programs(want[n][0]), n
        for kv in ("resend", "keep"):
            assert format_programs(passes.reverse(got, kv=kv)) == \
                format_programs(oracle.reverse(want[n][0], kv=kv)), (n, kv)


def test_head_slices_computed_from_a_buffer_that_arrived_whole_are_refused_by_name():
    """A ring of whole kv buffers computed in head slices: the rules would send each dkv back
    whole though it is written in slices (the oracle's backward fails check), so reverse
    raises naming the read and what to write instead; a read that never arrives is check's."""
    P = 4
    progs = []
    for r in range(P):
        j = (r - 1) % P
        progs.append(Program(r, (Step(0, (Compute(r, r), Send(_kv(r), (r + 1) % P),
                                          Recv(_kv(j), j))),
                                  Step(1, (Compute(r, j, heads=(0, 2)),
                                           Compute(r, j, heads=(1, 2)))))))
    need = np.eye(P, dtype=bool) | np.eye(P, k=-1, dtype=bool) | np.eye(P, k=P - 1, dtype=bool)
    passes.check(progs, need=need)
    with pytest.raises(ScheduleError, match="dkv3, which is not on rank 0"):
        passes.check(oracle.reverse(progs), need=need, backward=True)
    for kv in ("resend", "keep"):
        with pytest.raises(NotImplementedError, match=r"rank 0, step 1: 'C q0·kv3 h0/2' reads "
                                                      r"kv3h0/2, a head slice of kv3, which "
                                                      r"arrived whole(.|\n)*ERROR HERE"):
            passes.reverse(progs, kv=kv)
    never = [Program(r, (Step(0, (Compute(r, r),)), Step(1, (Compute(r, (r - 1) % P),))))
             for r in range(P)]
    with pytest.raises(ScheduleError, match="needs kv3, which is not on rank 0"):
        passes.reverse(never)
    # prune and narrow count a head slice's read as a read of the whole buffer it is cut
    # from: they keep the hop (they dropped it, and check then blamed a program never written
    # for a kv3h0/2 "not on rank 0 yet"), so fringe.plan says what reverse says
    assert format_programs(passes.prune(progs, need)) == format_programs(progs) == \
        format_programs(oracle.prune(progs, need))
    import fringe
    from fringe import layout
    from fringe.schedules import Schedule
    L = 4
    sched = Schedule("ring in head slices", layout=layout.contiguous, programs_fn=lambda n: progs)
    for ranges in (True, False):
        with pytest.raises(NotImplementedError, match="a head slice of kv3, which arrived whole"):
            fringe.plan(sched, lambda b, h, q, kv: (q // L - kv // L) % P <= 1, seq_len=P * L,
                        world_size=P, block_size=2, ranges=ranges)


def test_a_fetch_before_step_0_adds_a_prologue_step_as_the_oracle_does():
    """kv0 forwarded at the last step to a rank that never computes with it (an unpruned
    program): in the backward that rank relays kv0 up at step 0, so it fetches it one step
    earlier; both column paths (the ring chain's and the general one) pad as the rules do."""
    progs = [Program(0, (Step(0, (Compute(0, 0), Send(_kv(0), 1))),)),
             Program(1, (Step(0, (Compute(1, 1), Recv(_kv(0), 0))),
                         Step(1, (Compute(1, 0), Send(_kv(0), 2))))),
             Program(2, (Step(0, (Compute(2, 2),)), Step(1, (Recv(_kv(0), 1),))))]
    passes.check(progs)
    want = oracle.reverse(progs)
    assert max(s.index for p in want for s in p.steps) == 3      # T = 2, one more prologue step
    assert format_programs(passes.reverse(progs)) == format_programs(want)
    tab = passes._table(progs)
    assert passes._reverse_parts(tab, "resend") is None           # the chain shortcut passes
    assert format_programs(passes._general_reverse(tab, "resend")) == format_programs(want)


def test_an_own_slot_holding_what_another_slot_brings_reverses_as_the_oracle_does():
    """Rank 0's own receive slot names kv1, which slot 1 also brings (so the own slot is not
    in place, RULES): one arrival of kv1 all the same, reversed as the rules do."""
    g = (0, 1)
    ag = [Collective("AG", g, [_kv(1), _kv(0)], [_kv(1), _kv(1)]),
          Collective("AG", g, [_kv(1), _kv(1)], [_kv(0), _kv(1)])]
    progs = [Program(r, (Step(0, (Compute(r, r), ag[r])), Step(1, (Compute(r, 1 - r),))))
             for r in g]
    passes.check(progs)
    for kv in ("resend", "keep"):
        got = passes.reverse(progs, kv=kv)
        assert format_programs(got) == format_programs(oracle.reverse(progs, kv=kv))
        passes.check(got, backward=True, kv=kv)


def test_a_hop_that_forwards_a_buffer_before_it_arrives_is_named():
    """Rank 1 forwards kv0h0/2 at step 1 (it holds the whole kv0) but receives kv0h0/2
    itself only at step 2: no route in time to re-send along. Receiving a slice of a buffer
    it already holds whole is itself a second arrival of those heads (their gradient would
    go back twice), which reverse names first."""
    h = Buffer.of("kv", 0, (0, 2))
    progs = [Program(0, (Step(0, (Compute(0, 0), Send(_kv(0), 1))), Step(2, (Send(h, 1),)))),
             Program(1, (Step(0, (Compute(1, 1), Recv(_kv(0), 0))),
                         Step(1, (Compute(1, 0), Send(h, 2))), Step(2, (Recv(h, 0),)))),
             Program(2, (Step(0, (Compute(2, 2),)), Step(1, (Recv(h, 1),)),
                         Step(2, (Compute(2, 0, heads=(0, 2)),))))]
    passes.check(progs)
    with pytest.raises(ScheduleError, match=r"rank 1, step 2: kv0h0/2 arrives at rank 1, which "
                                            r"also receives heads of it that overlap(.|\n)*"
                                            r"t2: R kv0h0/2←r0    <-- ERROR HERE"):
        passes.reverse(progs)
