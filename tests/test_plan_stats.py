"""PlanStats reads the programs' columns; the numbers are those of walking every op."""
from __future__ import annotations

import pytest
import torch

import fringe
from fringe import masks, schedules
from fringe.bench import packed_docs
from fringe.plan import PlanStats, _op_counts, _walk_counts
from fringe.schedules.ir import Compute, Program, ProgramTable, Recv, Send, split_name

BlockKind = masks.BlockKind


def _walked_stats(plan, *, batch=1, heads=1, kv_heads=1, head_dim=64, dtype=torch.bfloat16):
    """The reference: PlanStats as it was computed by walking every op of every program."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    kv_bytes = 2 * batch * kv_heads * plan.local_len * head_dim * itemsize
    grad_bytes = 2 * batch * kv_heads * plan.local_len * head_dim * 4
    bs2 = plan.block_size ** 2
    rows = []
    counts = plan.tile_block_counts().tolist()
    for r in range(plan.world_size):
        full = partial = blocks = 0
        for _, op in plan.forward[r].ops():
            if isinstance(op, Compute):
                kind = plan.tile_kind(op.q, op.kv)
                full += kind == BlockKind.FULL
                partial += kind == BlockKind.PARTIAL
                blocks += counts[op.q][op.kv]
        fwd_flops = 4 * blocks * bs2 * head_dim * heads * batch

        def volume(progs, kind_cls):
            total = 0
            for _, op in progs[r].ops():
                if isinstance(op, kind_cls):
                    total += grad_bytes if split_name(op.buf)[0].startswith("d") else kv_bytes
            return total
        rows.append(dict(rank=r, full_tiles=full, partial_tiles=partial, blocks=blocks,
                         fwd_flops=fwd_flops, bwd_flops=int(2.5 * fwd_flops),
                         fwd_sent=volume(plan.forward, Send),
                         fwd_recv=volume(plan.forward, Recv),
                         bwd_sent=volume(plan.backward, Send),
                         bwd_recv=volume(plan.backward, Recv),
                         steps=len(plan.forward[r].steps)))
    work = [row["blocks"] for row in rows]
    mean = sum(work) / len(work)
    return PlanStats(tuple(rows), max(work) / mean if mean else 1.0)


def _mask(name: str, S: int):
    return {"causal": masks.causal(),
            "docs": masks.causal() & masks.document(packed_docs(S, 5, seed=3)),
            "full": masks.full(),
            "window": masks.sliding_window(3 * S // 16)}[name]


NAMES = ("ring", "zigzag", "striped", "balanced", "allgather", "allgather:3", "ulysses",
         "compose:zigzag+ulysses:2", "compose:ring+allgather:2")
CASES = [(name, P, mask, kv) for name in NAMES for P, mask, kv in
         ((4, "causal", "resend"), (4, "full", "resend"), (4, "window", "keep"),
          (8, "docs", "resend"), (8, "docs", "keep"))]


@pytest.mark.parametrize("name,P,mask,kv", CASES)
def test_column_stats_equal_the_op_walk(name, P, mask, kv):
    bs = 4
    S = 2 * P * bs * 3
    p = fringe.plan(schedules.get(name), _mask(mask, S), seq_len=S, world_size=P,
                    block_size=bs, kv=kv)
    shape = dict(batch=2, heads=4, kv_heads=2, head_dim=8, dtype=torch.float16)
    got = p.stats(**shape)
    want = _walked_stats(p, **shape)
    assert got.rows == want.rows
    assert got.balance == want.balance
    for row in got.rows:                        # Python ints, as the table prints them
        assert all(type(v) is int for v in row.values()), row


def _same_counts(a, b):
    def tiles(c):                       # the computes as a sorted list (parts are unordered)
        return sorted(zip(*(x.tolist() for x in c)))
    assert tiles(a.computes) == tiles(b.computes)
    assert (a.sent == b.sent).all() and (a.recv == b.recv).all()
    assert (a.steps == b.steps).all()


@pytest.mark.parametrize("name", ["ring", "zigzag", "striped"])
def test_table_parts_rows_and_ops_count_alike(name):
    """One set of programs three ways: the passes' table parts, a table of row columns,
    and plain Program values (walked)."""
    P, bs = 4, 4
    S = 2 * P * bs * 4
    p = fringe.plan(schedules.get(name), _mask("docs", S), seq_len=S, world_size=P,
                    block_size=bs)
    for progs in (p.forward, p.backward):
        assert progs[0].table is not None and progs[0].table._parts is not None
        plain = [Program(r, prog.steps) for r, prog in enumerate(progs)]
        rows = ProgramTable.of(plain).programs()
        assert rows[0].table._parts is None
        ref = _walk_counts(plain, P)
        assert ref.sent.sum() > 0 and ref.steps.min() > 0
        for other in (progs, rows, plain):
            _same_counts(_op_counts(other, P), ref)


def test_stats_of_a_large_plan_build_no_op():
    """Many ranks: the counts come from the columns; no rank's steps are materialised."""
    P, bs = 256, 8
    S = 2 * P * bs
    p = fringe.plan(schedules.zigzag(), masks.causal() & masks.document(packed_docs(S, 40, 1)),
                    seq_len=S, world_size=P, block_size=bs)
    st = p.stats()
    assert all(prog._steps is None for prog in (*p.forward, *p.backward))
    assert sum(r["blocks"] for r in st.rows) == int(p.tile_block_counts().sum())
    assert sum(r["fwd_sent"] for r in st.rows) == sum(r["fwd_recv"] for r in st.rows) > 0
    r = max(range(P), key=lambda i: st.rows[i]["fwd_sent"])     # one rank against its ops
    walked = _walk_counts([p.forward[r]], 1)
    assert st.rows[r]["steps"] == int(walked.steps[0])
    kv_bytes = 2 * (S // P) * 64 * 2                 # k and v, L tokens, D=64, bfloat16
    assert walked.sent[0, 1] == 0 and st.rows[r]["fwd_sent"] == int(walked.sent[0, 0]) * kv_bytes
