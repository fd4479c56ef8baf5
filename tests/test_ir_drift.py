"""Drift between program forms: a check or a digest must not depend on how a plan's
programs are held (general table, plain table, op objects, pickled)."""
from __future__ import annotations

import copy
import pickle

import pytest
import torch

import fringe
from fringe import masks, schedules
from fringe.runtime import engine
from fringe.schedules.ir import Program, ProgramTable

SPECS = ["ulysses", "allgather", "compose:zigzag+ulysses:2", "compose:zigzag+allgather:2:2",
         "zigzag"]


def _unpickled(p):
    """The plan with its programs pickled and loaded back (op objects: no table behind)."""
    q = copy.copy(p)
    for name in ("forward", "backward"):
        object.__setattr__(q, name, tuple(pickle.loads(pickle.dumps(list(getattr(p, name))))))
    return q


def _plan(spec, kv="resend", mask=None):
    return fringe.plan(schedules.get(spec), mask or masks.causal(), seq_len=64, world_size=4,
                       block_size=4, kv=kv)


@pytest.mark.parametrize("spec,splits", [("ulysses", (4,)), ("compose:zigzag+ulysses:2", (2,)),
                                         ("allgather", ()), ("zigzag", ())])
def test_head_splits_read_every_program_form(spec, splits):
    p = _plan(spec)
    assert engine.head_splits(p) == splits
    q = _unpickled(p)
    assert all(prog.table is None for prog in q.forward)
    assert engine.head_splits(q) == splits


@pytest.mark.parametrize("spec", ["ulysses", "compose:zigzag+ulysses:2"])
def test_unsplittable_heads_raise_before_any_communication(spec):
    p = _plan(spec)
    H = 3                                       # divisible by neither 4 nor 2
    q = torch.zeros(1, H, 64, 8, dtype=torch.float64)
    k = torch.zeros(1, H, 64, 8, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"heads split \d ways"):
        engine.check_inputs(q, k, k, plan=p, local=False)


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("kv", ["resend", "keep"])
def test_fingerprint_does_not_depend_on_the_programs_form(spec, kv):
    docs = torch.tensor([0] * 20 + [1] * 9 + [2] * 23 + [3] * 12)
    p = _plan(spec, kv, masks.causal() & masks.document(docs))
    q = _unpickled(p)
    assert q.digests()["programs"] == p.digests()["programs"]
    assert q.fingerprint() == p.fingerprint()
    for progs in (p.forward, p.backward):
        ops = [Program(x.rank, x.steps) for x in progs]     # no table behind them
        try:
            plain = ProgramTable.of(ops)
        except TypeError:
            plain = None
        general = ProgramTable.of(ops)
        want = ProgramTable.of(progs).digest()
        assert general.digest() == want
        assert plain is None or plain.digest() == want


def test_digest_tells_different_programs_apart():
    a, b = _plan("compose:zigzag+ulysses:2"), _plan("compose:zigzag+ulysses:2", kv="keep")
    assert ProgramTable.of(a.forward).digest() == ProgramTable.of(b.forward).digest()
    assert ProgramTable.of(a.backward).digest() != ProgramTable.of(b.backward).digest()
    c = _plan("ulysses")
    progs = [Program(x.rank, x.steps) for x in c.forward]
    swapped = [Program(0, progs[1].steps), Program(1, progs[0].steps)] + progs[2:]
    with pytest.raises(Exception):              # a rank's program is not another's
        assert ProgramTable.of(swapped).digest() == ProgramTable.of(c.forward).digest()
