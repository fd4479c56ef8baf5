"""PlanStats reads the programs' columns; the numbers are those of walking every op, and its
bytes are what a run on the virtual mesh moves."""
from __future__ import annotations

import pytest
import torch

import fringe
from fringe import masks, schedules
from fringe.testing import packed_docs
from fringe.plan import PlanStats, _op_counts
from fringe.runtime.costmodel import Shape
from fringe.runtime.virtual import VirtualRuntime
from fringe.schedules.ir import Compute, Program, ProgramTable
from fringe.testing import oracle

BlockKind = masks.BlockKind


def _walked_stats(plan, *, batch=1, heads=1, kv_heads=1, head_dim=64, dtype=torch.bfloat16):
    """The reference: PlanStats by walking every op of every program, collectives slot by
    slot (dense), each buffer priced by the cost model's :meth:`Shape.buffer_bytes`."""
    shape = Shape(batch=batch, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
                  dtype=str(dtype).removeprefix("torch."))
    L = plan.local_len

    def price(buf, blocks=None):
        split = 1 if buf.heads is None else buf.heads[1]
        tokens = L if blocks is None else plan.block_size * sum(h - lo for lo, h in blocks)
        return shape.buffer_bytes(buf.family.value, tokens, split=split)

    def volume(prog):
        return oracle.moved_bytes((op for _, op in prog.ops()), prog.rank, price)

    bs2 = plan.block_size ** 2
    rows = []
    counts = plan.tile_block_counts().tolist()
    for r in range(plan.world_size):
        full = partial = blocks = head_blocks = 0
        for _, op in plan.forward[r].ops():
            if isinstance(op, Compute):
                kind = plan.tile_kind(op.q, op.kv)
                full += kind == BlockKind.FULL
                partial += kind == BlockKind.PARTIAL
                blocks += counts[op.q][op.kv]
                head_blocks += counts[op.q][op.kv] * heads // (op.heads or (0, 1))[1]
        fwd_flops = 4 * head_blocks * bs2 * head_dim * batch
        (fwd_sent, fwd_recv), (bwd_sent, bwd_recv) = (volume(plan.forward[r]),
                                                      volume(plan.backward[r]))
        rows.append(dict(rank=r, full_tiles=full, partial_tiles=partial, blocks=blocks,
                         fwd_flops=fwd_flops, bwd_flops=int(2.5 * fwd_flops),
                         fwd_sent=fwd_sent, fwd_recv=fwd_recv, bwd_sent=bwd_sent,
                         bwd_recv=bwd_recv, steps=len(plan.forward[r].steps)))
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
    shape = dict(batch=2, heads=8, kv_heads=2, head_dim=8, dtype=torch.float16)
    got = p.stats(**shape)
    want = _walked_stats(p, **shape)
    assert got.rows == want.rows
    assert got.balance == want.balance
    for row in got.rows:                        # Python ints, as the table prints them
        assert all(type(v) is int for v in row.values()), row


def _virtual_bytes(p, *, batch, heads, kv_heads, head_dim, dtype):
    """Bytes each rank sent and received in each direction, as a virtual-mesh run records
    them: ``{"fwd_sent": [P ints], ...}``."""
    P, L = p.world_size, p.local_len
    g = torch.Generator().manual_seed(0)
    q = torch.randn(P, batch, heads, L, head_dim, generator=g, dtype=dtype)
    k, v = (torch.randn(P, batch, kv_heads, L, head_dim, generator=g, dtype=dtype)
            for _ in range(2))
    rt = VirtualRuntime(P)
    out, lse, kept = rt.forward(p, q, k, v)
    rt.backward(p, q, k, v, out, lse, torch.ones_like(out), None, kept)
    got = {}
    for which, pre in (("forward", "fwd"), ("backward", "bwd")):
        sent, recv = [0] * P, [0] * P
        for st in rt.last_states[which].values():
            for rec in st.records:
                sent[rec.rank] += rec.sent_bytes
                recv[rec.rank] += rec.recv_bytes
        got[f"{pre}_sent"], got[f"{pre}_recv"] = sent, recv
    return got


BYTES = ("fwd_sent", "fwd_recv", "bwd_sent", "bwd_recv")
COLLECTIVE_NAMES = ("allgather", "allgather:3", "ulysses", "compose:zigzag+ulysses:2",
                    "compose:zigzag+allgather:2:2")


VIRTUAL_CASES = ([(name, P, mask) for name in COLLECTIVE_NAMES for P in (4, 8)
                  for mask in ("causal", "docs")]
                 + [(name, 4, mask) for name in ("ring", "zigzag", "striped", "balanced")
                    for mask in ("causal", "docs")] + [("zigzag", 8, "docs")])


@pytest.mark.parametrize("name,P,mask", VIRTUAL_CASES)
def test_bytes_are_what_the_virtual_mesh_moves(name, P, mask):
    """Every collective's slots (all-gather, its reduce-scatter adjoint, all-to-all of head
    slices) and every point-to-point transfer, per rank, both directions, sent and received."""
    bs = 4
    S = 2 * P * bs
    p = fringe.plan(schedules.get(name), _mask(mask, S), seq_len=S, world_size=P,
                    block_size=bs)
    # H=8, G=2: ulysses over 8 ranks replicates kv heads, over 2 it splits them; float64 for
    # ulysses at P=8 (accumulators at 8 bytes), float32 elsewhere
    dtype = torch.float64 if (name, P, mask) == ("ulysses", 8, "docs") else torch.float32
    shape = dict(batch=1, heads=8, kv_heads=2, head_dim=4, dtype=dtype)
    st = p.stats(**shape)
    want = _virtual_bytes(p, **shape)
    got = {key: [row[key] for row in st.rows] for key in BYTES}
    assert got == want
    assert sum(want["fwd_sent"]) == sum(want["fwd_recv"]) > 0
    assert sum(want["bwd_sent"]) == sum(want["bwd_recv"]) > 0


def test_allgather_receives_every_needed_chunk():
    """A causal all-gather over the zigzag layout: every rank needs every other rank's kv,
    so it receives P-1 kv chunks in the forward and sends P-1 dkv chunks back (reduce-
    scatter), after gathering the kv again unless it kept them; under the previous count
    (point-to-point only) every entry read 0."""
    P, bs = 8, 4
    S = 2 * P * bs
    L = S // P
    kv, dkv = 2 * L * 8 * 2, 2 * L * 8 * 4               # [2, B, G, L, D] bf16 / float32
    for policy, bwd in (("resend", kv + dkv), ("keep", dkv)):   # resend: kv gathered again
        p = fringe.plan(schedules.allgather(), masks.causal(), seq_len=S, world_size=P,
                        block_size=bs, kv=policy, ranges=False)   # whole chunks
        st = p.stats(batch=1, heads=2, kv_heads=1, head_dim=8, dtype=torch.bfloat16)
        for row in st.rows:
            assert (row["fwd_sent"], row["fwd_recv"]) == ((P - 1) * kv,) * 2, row
            assert (row["bwd_sent"], row["bwd_recv"]) == ((P - 1) * bwd,) * 2, (policy, row)


def test_head_split_plans_default_to_the_fewest_heads_they_run_with():
    P, bs = 4, 4
    S = 2 * P * bs
    p = fringe.plan(schedules.ulysses(), masks.causal(), seq_len=S, world_size=P, block_size=bs)
    assert p.stats().rows == p.stats(heads=4, kv_heads=4).rows
    assert p.stats(heads=8, kv_heads=2).rows[0]["fwd_sent"] > 0
    with pytest.raises(ValueError, match="divisible by 4"):
        p.stats(heads=6, kv_heads=6)
    q = fringe.plan(schedules.zigzag(), masks.causal(), seq_len=S, world_size=P, block_size=bs)
    assert q.stats().rows == q.stats(heads=1, kv_heads=1).rows


def _same_counts(a, b):
    def tiles(c):                       # the computes as a sorted list (parts are unordered)
        return sorted(zip(*(x.tolist() for x in c)))
    assert tiles(a.computes) == tiles(b.computes)

    def by_key(c):
        return [{k: int(x[r, i]) for i, k in enumerate(c.keys) if x[r, i]}
                for x in (c.sent, c.recv) for r in range(len(x))]
    assert by_key(a) == by_key(b)
    assert (a.steps == b.steps).all()


@pytest.mark.parametrize("name", ["ring", "zigzag", "striped"])
def test_table_parts_rows_and_ops_count_alike(name):
    """One set of programs three ways (the passes' table parts, a table of row columns, plain
    Program values, which become a table too) count as the oracle walks their ops."""
    P, bs = 4, 4
    S = 2 * P * bs * 4
    p = fringe.plan(schedules.get(name), _mask("docs", S), seq_len=S, world_size=P,
                    block_size=bs)
    for progs in (p.forward, p.backward):
        assert progs[0].table is not None and progs[0].table._parts is not None
        plain = [Program(r, prog.steps) for r, prog in enumerate(progs)]
        rows = ProgramTable.of(plain).programs()
        n = p.local_len // bs                   # counted in blocks: the hops move ranges
        ref = oracle.op_counts(plain, P, n=n)
        assert ref.sent.sum() > 0 and ref.steps.min() > 0
        for other in (progs, rows, plain):
            _same_counts(_op_counts(other, P, n=n), ref)


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
    walked = oracle.op_counts([p.forward[r]], 1, n=S // P // bs)      # in blocks
    assert st.rows[r]["steps"] == int(walked.steps[0])
    kv_bytes = 2 * bs * 64 * 2                       # k and v, a block, D=64, bfloat16
    assert [k[0].value for k in walked.keys] == ["kv"]
    assert st.rows[r]["fwd_sent"] == int(walked.sent[0, 0]) * kv_bytes
