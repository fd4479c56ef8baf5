"""The rule table (``fringe.schedules.ir.RULES``) is the one source of what each op kind
reads, writes and has as its adjoint: the op views and the column passes agree with it."""
from __future__ import annotations

import random

import numpy as np
import pytest

import fringe
from fringe import schedules
from fringe.schedules import ir, passes
from fringe.schedules.ir import (C_, G_, KV_SIDE, Q_SIDE, RULES, TILE_TOUCH_CODES, TILE_TOUCHES,
                                 Buffer, Collective, Compute, Family, GradCompute, Recv, Send)


def _expected(op, rank=None):
    """(reads, writes, adjoint kind) of ``op`` worked out from the table alone."""
    if isinstance(op, Collective):
        rule = RULES[op.kind]
        side = {"sends": op.sends, "recvs": op.recvs}
        pick = lambda words: tuple(dict.fromkeys(  # noqa: E731
            b for w in words for b in side[w] if b is not None))
        return pick(rule.reads), pick(rule.writes), rule.adjoint
    letter = {Compute: "C", GradCompute: "G", Send: "S", Recv: "R"}[type(op)]
    rule = RULES[letter]
    if letter in "SR":
        pick = lambda words: tuple(op.buf for w in words if w == "buf")  # noqa: E731
    else:
        pick = lambda pairs: tuple(Buffer.of(f, (op.q, op.kv)[s], op.heads)  # noqa: E731
                                   for f, s in pairs)
    return pick(rule.reads), pick(rule.writes), rule.adjoint


def _letter(op) -> str:
    return op.kind if isinstance(op, Collective) else op.ascii()[0]


def _random_op(rng: random.Random):
    P = rng.randint(2, 9)
    heads = None if rng.random() < 0.5 else (lambda n: (rng.randrange(n), n))(rng.randint(2, 4))
    kind = rng.choice("CGSRX")
    if kind == "C":
        return Compute(rng.randrange(P), rng.randrange(P), heads)
    if kind == "G":
        return GradCompute(rng.randrange(P), rng.randrange(P), heads)
    fam = rng.choice([Family.Q, Family.KV, Family.OUT, Family.DQ, Family.DKV, Family.DOUT])
    if kind in "SR":
        b = Buffer.of(fam, rng.randrange(P), heads)
        return (Send if kind == "S" else Recv)(b, rng.randrange(P))
    group = tuple(rng.sample(range(P), rng.randint(1, P)))
    slot = lambda: None if rng.random() < 0.3 else Buffer.of(fam, rng.randrange(P))  # noqa: E731
    return Collective(rng.choice(["AG", "RS", "A2A"]), group, [slot() for _ in group],
                      [slot() for _ in group])


def test_every_op_view_reads_the_table():
    rng = random.Random(18)
    seen = set()
    for _ in range(600):
        op = _random_op(rng)
        reads, writes, adj = _expected(op)
        assert op.reads() == reads, op
        assert op.writes() == writes, op
        assert _letter(op.adjoint()) == adj, op
        seen.add(_letter(op))
    assert seen == set(RULES)


def test_a_collectives_own_slot_stays_in_place_by_the_table():
    op = Collective("RS", (0, 1, 2), ("dkv0", "dkv1", None), ("dkv1", "dkv1", None))
    assert RULES["RS"].own_slot_in_place
    assert op.sent(1) == (Buffer("dkv0"),)          # its own slot (dkv1) is not a read
    assert op.received(1) == {Buffer("dkv1")}       # member 0's slot holds it too: received
    # r0's own receive slot holds dkv1, which member 1's slot also holds: still received
    assert op.received(0) == {Buffer("dkv1")}
    op2 = Collective("AG", (0, 1), ("kv0", "kv0"), ("kv0", "kv1"))
    assert op2.sent(0) == (Buffer("kv0"),) and op2.received(0) == {Buffer("kv1")}


def test_tile_touch_codes_are_the_rules():
    code = {f: n for n, f in enumerate(Family)}
    for k, letter in ((C_, "C"), (G_, "G")):
        rule = RULES[letter]
        assert TILE_TOUCHES[k] == tuple((f, s, False) for f, s in rule.reads) + tuple(
            (f, s, True) for f, s in rule.writes)
        assert TILE_TOUCH_CODES[k] == tuple((code[f], s, w) for f, s, w in TILE_TOUCHES[k])


def test_a_column_pass_gives_the_views_families():
    """The column passes' tile touches (``passes._tile_touches`` over a kind column) name,
    row by row, the buffers the op views read and write, in the views' order."""
    rng = np.random.default_rng(18)
    P, n = 6, 40
    kind = rng.integers(0, 2, n)
    q, kv = rng.integers(0, P, n), rng.integers(0, P, n)
    side = {Q_SIDE: q, KV_SIDE: kv}
    fams = tuple(Family)
    for written in (False, True):
        got: list[dict] = [{} for _ in range(n)]
        for f, rows, sd, k in passes._tile_touches(kind, written=written):
            for i in np.arange(n)[rows]:
                got[i][k] = Buffer.of(fams[f], int(side[sd][i]))
        for i in range(n):
            op = (Compute if kind[i] == C_ else GradCompute)(int(q[i]), int(kv[i]))
            want = op.writes() if written else op.reads()
            assert tuple(got[i][k] for k in sorted(got[i])) == want, (i, op)


@pytest.mark.parametrize("spec", ["ring", "allgather"])
def test_column_check_and_op_check_agree_through_the_table(spec):
    """A planned schedule's programs pass the column check, and the same programs as plain op
    objects (no table) pass the op-by-op check, which reads the views."""
    p = fringe.plan(schedules.get(spec), fringe.masks.causal(), seq_len=256, world_size=4,
                    block_size=32)
    for progs, backward in ((p.forward, False), (p.backward, True)):
        plain = [ir.Program(q.rank, tuple(q.steps)) for q in progs]
        assert all(q.table is None for q in plain)
        schedules.check(list(progs), backward=backward)
        schedules.check(plain, backward=backward)


def test_adjoint_codes_are_the_rules():
    from fringe.schedules.ir import ADJOINT_CODE, R_, S_
    letter = {C_: "C", G_: "G", S_: "S", R_: "R"}
    code = {v: k for k, v in letter.items()}
    for k in (C_, G_, S_, R_):
        assert ADJOINT_CODE[k] == code[RULES[letter[k]].adjoint]
    assert ir.COLLECTIVE_ADJOINT == {k: RULES[k].adjoint for k in ("AG", "RS", "A2A")}
