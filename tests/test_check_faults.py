"""``check`` names every fault on the columns itself (issue 18): on random single-fault
injections into ring-family, collective, compose and user schedules, in each form a user
can write (op objects, parsed text, a table's views), it raises what the op-by-op oracle
(:func:`fringe.testing.oracle.check`) raises, message for message, or both pass; columns
that no program can hold are named by their table row.
"""
from __future__ import annotations

import collections
import dataclasses
import functools

import numpy as np
import pytest
import torch

import fringe
from fringe import masks, schedules
from fringe.schedules import passes
from fringe.schedules.ir import (Buffer, Collective, Compute, Family, GradCompute, Program,
                                 ProgramTable, Recv, ScheduleError, Send, format_programs,
                                 parse_programs, program_from_ops, steps_of)
from fringe.testing import oracle, user_schedules

P, BLOCK = 4, 4
S = P * BLOCK * 4
SPECS = {"ring": lambda: schedules.get("ring"), "zigzag": lambda: schedules.get("zigzag"),
         "striped": lambda: schedules.get("striped"),
         "allgather": lambda: schedules.get("allgather"),
         "allgather:2": lambda: schedules.get("allgather:2"),
         "ulysses": lambda: schedules.get("ulysses"),
         "compose:zigzag+ulysses:2": lambda: schedules.get("compose:zigzag+ulysses:2"),
         "compose:zigzag+allgather:2:2": lambda: schedules.get("compose:zigzag+allgather:2:2"),
         "two_level_allgather(2,mixed)": lambda: user_schedules.two_level_allgather(2, own="mixed"),
         "allgather_then_ring(2,none)": lambda: user_schedules.allgather_then_ring(2, own="none"),
         "two_level_allgather_columns(2)":
             lambda: user_schedules.two_level_allgather_columns(2)}
FAULTS = ("drop", "chunk", "family", "kind", "peer", "step", "earlier", "swap", "slot", "group")
CASES_PER_PROGRAM = 20


@functools.lru_cache(maxsize=None)
def _programs(spec: str) -> list:
    """``(programs, need, backward, kv)`` of the spec's plans: forward and backward under
    both kv policies, on a causal and a document mask."""
    docs = torch.bucketize(torch.arange(S), torch.tensor([S * 5 // 16, S * 11 // 16]), right=True)
    out = []
    for mask, kv in ((masks.causal(), "resend"), (masks.causal() & masks.document(docs), "keep")):
        p = fringe.plan(SPECS[spec](), mask, seq_len=S, world_size=P, block_size=BLOCK, kv=kv)
        need = (p.tiles != 0).numpy()
        out += [(list(p.forward), need, False, kv), (list(p.backward), need, True, kv)]
    return out


def _verdict(fn, *args, **kw):
    """What ``fn`` raises (type name, message), or None."""
    try:
        fn(*args, **kw)
    except (ScheduleError, ValueError, TypeError, RuntimeError, AssertionError) as e:
        return type(e).__name__, str(e)
    return None


def _buf(b: Buffer, *, family=None, chunk=None) -> Buffer:
    return Buffer.of(b.family if family is None else family,
                     b.chunk if chunk is None else chunk, b.heads)


def _coll(op: Collective, *, kind=None, group=None, sends=None, recvs=None) -> Collective:
    return Collective.sparse(kind or op.kind, op.group if group is None else group,
                             op.sparse_sends if sends is None else sends,
                             op.sparse_recvs if recvs is None else recvs)


def _slots_with(slots, n: int, rng, *, edit) -> tuple:
    """Sparse slots ``(idx, bufs)`` with one slot edited: ``edit(buffer) -> buffer``, moved
    to a free member index, or dropped."""
    idx, bufs = list(slots[0]), list(slots[1])
    k = int(rng.integers(len(idx)))
    how = int(rng.integers(3))
    if how == 0:
        bufs[k] = edit(bufs[k])
    elif how == 1:
        free = sorted(set(range(n)) - set(idx))
        if not free:
            return None
        idx[k] = free[int(rng.integers(len(free)))]
    else:
        del idx[k], bufs[k]
    order = np.argsort(idx, kind="stable")
    return tuple(idx[i] for i in order), tuple(bufs[i] for i in order)


def _inject(progs: list, fault: str, rng) -> list | None:
    """The programs with one fault of kind ``fault`` at a random op (None: nothing to
    break that way)."""
    n = len(progs)
    T = steps_of(progs)
    ops = [{s.index: list(s.ops) for s in p.steps} for p in progs]
    every = [(r, t, i, op) for r, d in enumerate(ops) for t in sorted(d)
             for i, op in enumerate(d[t])]
    tile, comm = (Compute, GradCompute), (Send, Recv)
    want = {"drop": object, "chunk": object, "family": (Send, Recv, Collective), "kind": object,
            "peer": comm, "step": object, "earlier": tile, "swap": object,
            "slot": Collective, "group": Collective}[fault]
    cands = [x for x in every if isinstance(x[3], want)
             and (fault != "earlier" or x[1] > 0)
             and (fault != "swap" or len(ops[x[0]][x[1]]) > 1)
             and (fault not in ("slot", "chunk", "family") or not isinstance(x[3], Collective)
                  or x[3].sparse_sends[0] or x[3].sparse_recvs[0])]
    if not cands:
        return None
    r, t, i, op = cands[int(rng.integers(len(cands)))]
    step_ops = ops[r][t]
    chunk = int(rng.integers(n + 1))                  # now and then one past the last rank
    fam = tuple(Family)[int(rng.integers(len(Family)))]
    if fault == "drop":
        del step_ops[i]
    elif fault in ("chunk", "family", "slot"):
        edit = (functools.partial(_buf, chunk=chunk) if fault != "family"
                else functools.partial(_buf, family=fam))
        if isinstance(op, tile):
            new = dataclasses.replace(op, **{("q", "kv")[int(rng.integers(2))]: chunk})
        elif isinstance(op, comm):
            new = type(op)(edit(op.buf), op.peer)
        else:
            side = int(rng.integers(2)) if op.sparse_sends[0] and op.sparse_recvs[0] else (
                0 if op.sparse_sends[0] else 1)
            slots = _slots_with((op.sparse_sends, op.sparse_recvs)[side], len(op.group), rng,
                                edit=edit) if fault == "slot" else None
            if fault != "slot":
                idx, bufs = (op.sparse_sends, op.sparse_recvs)[side]
                k = int(rng.integers(len(idx)))
                slots = (idx, bufs[:k] + (edit(bufs[k]),) + bufs[k + 1:])
            if slots is None:
                return None
            new = _coll(op, **{("sends", "recvs")[side]: slots})
        step_ops[i] = new
    elif fault == "kind":
        if isinstance(op, tile):
            new = (GradCompute if type(op) is Compute else Compute)(op.q, op.kv, op.heads)
        elif isinstance(op, comm):
            new = (Recv if type(op) is Send else Send)(op.buf, op.peer)
        else:
            new = _coll(op, kind=[k for k in ("AG", "RS", "A2A") if k != op.kind][int(rng.integers(2))])
        step_ops[i] = new
    elif fault == "peer":
        step_ops[i] = type(op)(op.buf, int(rng.integers(n)))
    elif fault in ("step", "earlier"):
        u = int(rng.integers(T + 1)) if fault == "step" else int(rng.integers(t))
        if u == t:
            return None
        del step_ops[i]
        ops[r].setdefault(u, []).append(op)
    elif fault == "swap":                             # two ops (collectives where there are)
        colls = [j for j, o in enumerate(step_ops) if isinstance(o, Collective)]
        pool = colls if len(colls) > 1 else list(range(len(step_ops)))
        a, b = (int(x) for x in rng.choice(pool, size=2, replace=False))
        if step_ops[a] == step_ops[b]:
            return None
        step_ops[a], step_ops[b] = step_ops[b], step_ops[a]
    else:                                             # group: members swapped or shifted
        g = list(op.group)
        if rng.integers(2) and len(g) > 1:
            a, b = (int(x) for x in rng.choice(len(g), size=2, replace=False))
            g[a], g[b] = g[b], g[a]
        else:
            g = [m + 1 for m in g]
        step_ops[i] = _coll(op, group=tuple(g))
    return [program_from_ops(rank, ops[rank]) for rank in range(n)]


def _same_verdicts(progs, need, backward, kv, *, text: bool) -> tuple:
    """check's and the oracle's verdicts on ``progs`` (op objects), asserted equal, and on
    the same programs as a table's views and (``text``) parsed back from their text."""
    kw = dict(need=need, backward=backward, kv=kv)
    want = _verdict(oracle.check, progs, **kw)
    got = _verdict(passes.check, progs, **kw)
    assert got == want, (format_programs(progs), got, want)
    try:
        views = list(ProgramTable.of(progs).programs())
    except ScheduleError:
        views = None                    # a transfer without its partner: no table holds it
    if views is not None:
        assert _verdict(passes.check, views, **kw) == want
    if text:
        assert _verdict(passes.check, parse_programs(format_programs(progs)), **kw) == want
    return want


@pytest.mark.parametrize("spec", sorted(SPECS))
def test_check_names_each_fault_as_the_oracle_does(spec):
    rng = np.random.default_rng(sorted(SPECS).index(spec))
    seen = collections.Counter()
    for n_prog, (progs, need, backward, kv) in enumerate(_programs(spec)):
        assert _same_verdicts(progs, need, backward, kv, text=True) is None   # valid: both pass
        assert _same_verdicts(progs, None, backward, kv, text=False) is None
        for case in range(CASES_PER_PROGRAM):
            fault = FAULTS[(case + n_prog) % len(FAULTS)]
            bad = _inject(progs, fault, rng)
            if bad is None:
                continue
            v = _same_verdicts(bad, need if case % 3 else None, backward, kv, text=case % 4 == 0)
            seen[v is not None] += 1
    assert seen[True] >= CASES_PER_PROGRAM, seen   # most injections are faults


def test_the_injected_faults_reach_every_rule():
    """Across the schedules the injections hit every fault the rules name (so the
    differential test above compares each of them)."""
    rng = np.random.default_rng(99)
    kinds = collections.Counter()
    phrases = {"invalid peer": "names an invalid peer", "unmatched": "has no matching",
               "not a member": "is not a member of its group",
               "outside": "names a rank outside", "own slot": "itself must hold the same buffer",
               "count": "collective(s) over group", "kind": "is collective #",
               "contribution": "'s side '", "presence": "which is not on rank",
               "tiles": "every non-empty tile must be computed"}
    for spec in ("zigzag", "compose:zigzag+ulysses:2", "two_level_allgather(2,mixed)"):
        for progs, need, backward, kv in _programs(spec):
            for case in range(30):
                bad = _inject(progs, FAULTS[case % len(FAULTS)], rng)
                if bad is None:
                    continue
                v = _same_verdicts(bad, need, backward, kv, text=False)
                for name, phrase in phrases.items():
                    if v is not None and phrase in v[1]:
                        kinds[name] += 1
    assert set(kinds) == set(phrases), kinds


def test_the_chain_shortcut_and_the_sorted_presence_check_name_the_same_faults(monkeypatch):
    """Past the dense limits (the chain's planes, the presence plane, the member table) the
    checks sort keys: the same verdicts, no fallback."""
    rng = np.random.default_rng(5)
    cases = []
    for spec in ("ring", "allgather:2", "two_level_allgather(2,mixed)"):
        for progs, need, backward, kv in _programs(spec):
            for case in range(8):
                bad = _inject(progs, FAULTS[case % len(FAULTS)], rng)
                if bad is not None:
                    cases.append((bad, need, backward, kv))
    want = [_verdict(oracle.check, b, need=n, backward=bw, kv=kv) for b, n, bw, kv in cases]
    with monkeypatch.context() as m:    # the presence check's reads looked up a few at a time
        m.setattr(passes._check, "LATE_PIECE", 3)
        assert [_verdict(passes.check, b, need=n, backward=bw, kv=kv)
                for b, n, bw, kv in cases] == want
    monkeypatch.setattr(passes, "DENSE_CELLS", 0)
    monkeypatch.setattr(passes, "PLANE_CELLS", 0)
    monkeypatch.setattr(passes, "MEMBER_CELLS", 0)
    got = [_verdict(passes.check, b, need=n, backward=bw, kv=kv) for b, n, bw, kv in cases]
    assert got == want
    assert sum(v is not None for v in want) > len(want) // 2


# ---- columns no program holds: named by their table row -------------------------------------
def _parts():
    """The parts of a small collective plan (computes, transfers, collectives) to edit."""
    progs, need, _, _ = _programs("compose:zigzag+ulysses:2")[0]
    assert ProgramTable.of(progs)._parts[2]["groups"]
    comp, xfer, coll = ProgramTable.of(progs)._parts
    copy = lambda d: {k: (v if k == "groups" else np.array(v)) for k, v in d.items()}  # noqa: E731
    return copy(comp), copy(xfer), copy(coll), need


def _table_check(comp, xfer, coll, need=None):
    tab = ProgramTable._of_parts(P, comp, xfer, coll)
    passes.check(list(tab.programs()), need=need)


@pytest.mark.parametrize("edit,match", [
    (lambda c, x, k: c["kind"].__setitem__(0, 7), r"compute row 0: kind code 7 .*outside \[0, 2\)"),
    (lambda c, x, k: c["step"].__setitem__(1, -1), r"compute row 1: step -1 is outside"),
    (lambda c, x, k: c["hi"].__setitem__(0, 3), r"compute row 0: a head slice h3/\d+ \(needs 0 <= i < n"),
    (lambda c, x, k: x["fam"].__setitem__(0, 9), r"transfer row 0: family code 9 is outside"),
    (lambda c, x, k: (x["src"].__setitem__(0, 9), x["dst"].__setitem__(0, 8)),
     r"transfer row 0: ranks 9 -> 8 are outside \[0, 4\)"),
    (lambda c, x, k: k["kind"].__setitem__(0, 5), r"collective side row 0: kind code 5"),
    (lambda c, x, k: k["group"].__setitem__(0, 9), r"collective side row 0: group index 9"),
    (lambda c, x, k: k["slot_idx"].__setitem__(0, 9), r"collective slot row 0: member index 9"),
    (lambda c, x, k: k["slot_dir"].__setitem__(0, 1), r"collective slot row \d+: slots must be sorted"),
    (lambda c, x, k: k.__setitem__("groups", ((0, 0),) + k["groups"][1:]), r"group 0 \[0, 0\]"),
])
def test_columns_no_program_holds_are_named_by_row(edit, match):
    comp, xfer, coll, need = _parts()
    edit(comp, xfer, coll)
    with pytest.raises(ScheduleError, match=match):
        _table_check(comp, xfer, coll, need)


def test_a_transfer_to_itself_in_a_table_is_named_as_the_rules_name_it():
    comp, xfer, coll, need = _parts()
    xfer["dst"][0] = xfer["src"][0]
    tab = ProgramTable._of_parts(P, comp, xfer, coll)
    progs = list(tab.programs())
    want = _verdict(oracle.check, progs, need=need)
    assert want is not None and "names an invalid peer (world size 4)" in want[1]
    assert "<-- ERROR HERE" in want[1]
    assert _verdict(passes.check, progs, need=need) == want


def test_other_passes_name_a_chunk_past_the_last_rank():
    """reverse and prune read the same validated columns: a chunk past P - 1 is named at
    its op (check names it where the rules find it: a read of a buffer nobody has)."""
    progs = [Program(r, p.steps) for r, p in enumerate(_programs("allgather:2")[0][0])]
    op = progs[1].steps[-1].ops[-1]
    assert isinstance(op, Compute)
    steps = progs[1].steps[:-1] + (dataclasses.replace(
        progs[1].steps[-1], ops=progs[1].steps[-1].ops[:-1] + (Compute(op.q, P + 2),)),)
    bad = progs[:1] + [Program(1, steps)] + progs[2:]
    with pytest.raises(ScheduleError, match=rf"rank 1, step \d+: 'C q1·kv{P + 2}' names chunk "
                                            rf"{P + 2}, outside \[0, {P}\)(.|\n)*ERROR HERE"):
        passes._Gen(ProgramTable.of(bad))
    assert _verdict(passes.check, bad) == _verdict(oracle.check, bad) is not None


def test_row_keys_are_equal_for_equal_rows_and_ordered_past_int64_spans():
    rng = np.random.default_rng(3)
    a = rng.integers(0, 3, 200) * (1 << 40)             # spans whose product is past int64
    b = rng.integers(0, 3, 200) * (1 << 40) - (1 << 41)
    c = rng.integers(0, 2, 200)
    for cols in ((a, b, c), (c, a)):
        keys = passes._row_keys(*cols)
        rows = list(zip(*(x.tolist() for x in cols)))
        for i in range(0, 200, 7):
            for j in range(0, 200, 11):
                assert (keys[i] == keys[j]) == (rows[i] == rows[j])
                assert (keys[i] < keys[j]) == (rows[i] < rows[j])
