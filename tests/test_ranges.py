"""Block-range transfers (issue 20): every hop of kv carries exactly the blocks that its
receiver and the ranks it forwards the buffer to attend, counted from the block map; the
backward's dkv and kv re-sends follow; check names a ranged program that leaves out a block
a tile reads; bytes are the blocks' bytes, and reach the floor where blocks allow it."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import fringe
from fringe import masks, schedules
from fringe.runtime.costmodel import Shape
from fringe.schedules import check
from fringe.schedules.ir import Family, Program, ProgramTable, Recv, ScheduleError, Send
from fringe.schedules.passes import BlockNeed, narrow
from fringe.testing import oracle, packed_docs

S, BS = 1024, 32


def _masks():
    ids = packed_docs(S, 6, seed=7)
    return {
        "documents": masks.document(ids),
        "causal_documents": masks.causal() & masks.document(ids),
        "window": masks.causal() & masks.sliding_window(150),
        "prefix": masks.prefix_lm(200),
        "causal": masks.causal(),
    }


MASKS = _masks()
SCHEDULES = ("ring", "zigzag", "striped", "balanced")


def _need(plan, r: int, c: int, side: str = "kv") -> np.ndarray:
    """bool ``[n]``: the blocks of chunk c that rank r's queries read (dense, from the plan's
    block map: the reference)."""
    t = plan.tile_blocks(r, c).numpy() != 0
    return t.any(0) if side == "kv" else t.any(1)


def _bits(blocks, n: int) -> np.ndarray:
    out = np.zeros(n, dtype=bool)
    if blocks is None:
        out[:] = True
    else:
        for lo, hi in blocks:
            out[lo:hi] = True
    return out


def _hops(programs):
    return [(t, prog.rank, op.peer, op.buf, op.blocks) for prog in programs
            for t, op in prog.ops() if isinstance(op, Send)]


def _reached(hops, r: int, buf, after: int) -> set[int]:
    """Ranks ``buf`` reaches from rank ``r`` by hops after step ``after``, r included."""
    out = {r}
    for t, src, dst, b, _ in hops:
        if src == r and b == buf and t > after:
            out |= _reached(hops, dst, buf, t)
    return out


@pytest.mark.parametrize("sched", SCHEDULES)
@pytest.mark.parametrize("mask", sorted(MASKS))
@pytest.mark.parametrize("P", [2, 4])
def test_each_hop_carries_what_its_route_reads_and_no_more(sched, mask, P):
    p = fringe.plan(schedules.get(sched), MASKS[mask], seq_len=S, world_size=P, block_size=BS)
    n = p.local_len // BS
    hops = _hops(p.forward)
    assert hops or P == 1
    for t, src, dst, buf, blocks in hops:
        side = "kv" if buf.family is Family.KV else "q"
        want = np.zeros(n, dtype=bool)
        for e in _reached(hops, dst, buf, t):
            want |= _need(p, e, buf.chunk, side) if side == "kv" else _need(p, buf.chunk, e, side)
        assert want.any(), f"{sched} {mask}: a hop of {buf} to r{dst} that nobody reads"
        assert np.array_equal(_bits(blocks, n), want), (sched, mask, t, src, dst, buf, blocks)
    # the backward: every dkv goes back with its kv's blocks, every kv re-send carries what the
    # hop into its receiver carried (so at most the forward's bytes again)
    fwd_in = {(dst, buf): blocks for t, src, dst, buf, blocks in hops}
    for t, src, dst, buf, blocks in _hops(p.backward):
        if buf.family is Family.DKV:
            assert fwd_in[(src, buf.cotangent)] == blocks
        elif buf.family is Family.KV:
            assert fwd_in[(dst, buf)] == blocks


def _kv_recv_bytes(plan, direction, fam=Family.KV) -> int:
    shape = Shape(batch=1, heads=1, kv_heads=1, head_dim=8, dtype="float32")
    per_block = shape.buffer_bytes(fam.value, plan.block_size)
    n = plan.local_len // plan.block_size
    return sum(per_block * (n if op.blocks is None else sum(h - l for l, h in op.blocks))
               for prog in getattr(plan, direction) for _, op in prog.ops()
               if isinstance(op, Recv) and op.buf.family is fam)


def test_bytes_reach_the_floor_where_blocks_allow_it():
    """Causal documents on a contiguous ring: what each rank reads of a chunk is nested along
    the ring (a document's kv is read by every later rank it spans), so the hops move exactly
    the blocks the ranks read: the floor of this layout at block granularity."""
    P = 4
    p = fringe.plan(schedules.ring(), MASKS["causal_documents"], seq_len=S, world_size=P,
                    block_size=BS)
    n = p.local_len // BS
    floor_blocks = sum(int(_need(p, r, c).sum()) for r in range(P) for c in range(P) if c != r)
    per_block = Shape(batch=1, heads=1, kv_heads=1, head_dim=8,
                      dtype="float32").buffer_bytes("kv", BS)
    assert 0 < floor_blocks < P * (P - 1) * n
    assert _kv_recv_bytes(p, "forward") == floor_blocks * per_block
    whole = fringe.plan(schedules.ring(), MASKS["causal_documents"], seq_len=S, world_size=P,
                        block_size=BS, ranges=False)
    assert _kv_recv_bytes(whole, "forward") > _kv_recv_bytes(p, "forward")
    assert not ProgramTable.of(whole.forward).ranged


@pytest.mark.parametrize("kv", ["resend", "keep"])
def test_backward_moves_at_most_twice_the_forward(kv):
    for mask in ("documents", "window"):
        p = fringe.plan(schedules.balanced(), MASKS[mask], seq_len=S, world_size=4,
                        block_size=BS, kv=kv)
        fwd = _kv_recv_bytes(p, "forward")
        dkv = _kv_recv_bytes(p, "backward", Family.DKV)   # fp32: dkv and kv bytes alike
        resent = _kv_recv_bytes(p, "backward")
        assert fwd > 0
        assert dkv == fwd                                  # every hop's blocks go back once
        assert resent == 0 if kv == "keep" else resent <= fwd


def test_stats_and_the_cost_model_count_the_blocks():
    p = fringe.plan(schedules.balanced(), MASKS["documents"], seq_len=S, world_size=4,
                    block_size=BS)
    assert ProgramTable.of(p.forward).ranged
    n = p.local_len // BS
    from fringe.plan import _op_counts
    for progs, kw in ((p.forward, {}), (p.backward, dict(steps=False, computes=False))):
        oracle.assert_same_counts(_op_counts(progs, 4, n=n, **kw),
                                  oracle.op_counts(progs, 4, n=n,
                                                   computes=kw.get("computes", True)),
                                  steps="steps" not in kw)
    with pytest.raises(ValueError, match="block ranges"):
        _op_counts(p.forward, 4)
    st = p.stats(batch=1, heads=1, kv_heads=1, head_dim=8, dtype=torch.float32)
    assert sum(r["fwd_recv"] for r in st.rows) == _kv_recv_bytes(p, "forward")
    pred = fringe.runtime.costmodel.simulate(
        p, "h100-ib", Shape(batch=1, heads=1, kv_heads=1, head_dim=8, dtype="float32"))
    for which, short in (("forward", "fwd"), ("backward", "bwd")):   # predicted = counted
        for key in ("sent", "recv"):
            got = [int(x) for x in getattr(pred, key)[which].sum(axis=1)]
            assert got == [r[f"{short}_{key}"] for r in st.rows], (which, key)


def _ring_text(blocks_01: str) -> list[Program]:
    text = f"""
r0:
  t0: C q0.kv0 | S kv0{blocks_01}->r1
r1:
  t0: C q1.kv1 | R kv0{blocks_01}<-r0
  t1: C q1.kv0
"""
    from fringe.schedules.ir import parse_programs
    return parse_programs(text)


def test_check_names_a_ranged_hop_that_leaves_out_a_block_a_tile_reads():
    m = masks.causal() & masks.sliding_window(40)
    p = fringe.plan(schedules.ring(), m, seq_len=128, world_size=2, block_size=16)
    blocks = BlockNeed(2, 4, p.block_map.rects.numpy())
    need = p.tiles != masks.BlockKind.EMPTY
    assert np.array_equal(np.flatnonzero(_need(p, 1, 0)), [1, 2, 3])
    check(_ring_text("[1:4]"), need=need, blocks=blocks)            # exactly what it reads
    check(_ring_text(""), need=need, blocks=blocks)                 # whole: more than enough
    with pytest.raises(ScheduleError, match=r"rank 1, step 1: 'C q1·kv0' reads blocks"):
        check(_ring_text("[2:4]"), need=need, blocks=blocks)
    with pytest.raises(ScheduleError, match="outside|up to 5"):
        check(_ring_text("[1:5]"), need=need, blocks=blocks)
    assert narrow(_ring_text(""), blocks)[0].ascii().count("kv0[1:4]") == 1


@pytest.mark.parametrize("batch", [None, 1])
def test_a_rank_forwards_only_blocks_it_holds(batch, monkeypatch):
    """Also a row at a time (the check reads a ring's hops a batch at a time)."""
    from fringe.schedules.ir import parse_programs
    from fringe.schedules.passes import _blocks
    if batch:
        monkeypatch.setattr(_blocks, "_BATCH", batch)
    m = masks.full()
    p = fringe.plan(schedules.ring(), m, seq_len=96, world_size=3, block_size=16)
    blocks = BlockNeed(3, 2, p.block_map.rects.numpy())
    progs = parse_programs("""
r0:
  t0: C q0.kv0 | S kv0[0:1]->r1
r1:
  t0: C q1.kv1 | R kv0[0:1]<-r0
  t1: S kv0->r2
r2:
  t0: C q2.kv2
  t1: R kv0<-r1
  t2: C q2.kv0
""")
    with pytest.raises(ScheduleError, match="rank 1, step 1: a transfer forwards blocks"):
        check(progs, blocks=blocks)


def test_ranged_text_round_trips_and_digests_by_content():
    p = fringe.plan(schedules.zigzag(), MASKS["window"], seq_len=S, world_size=4, block_size=BS)
    t = ProgramTable.of(p.forward)
    assert t.ranged
    from fringe.schedules.ir import format_programs, parse_programs
    back = parse_programs(format_programs(p.forward))
    assert back == list(p.forward)
    assert ProgramTable.of(back).digest() == t.digest()
    whole = fringe.plan(schedules.zigzag(), MASKS["window"], seq_len=S, world_size=4,
                        block_size=BS, ranges=False)
    assert ProgramTable.of(whole.forward).digest() != t.digest()
    assert whole.fingerprint() != p.fingerprint()
    with pytest.raises(ValueError, match="overlap"):
        Send("kv1", 2, ((0, 3), (2, 4)))
    with pytest.raises(ValueError, match="moves nothing"):
        Send("kv1", 2, ())
    with pytest.raises(ScheduleError, match="merges whole"):
        check([Program.parse("r0:\n  t0: S out0[0:1]->r1"), Program.parse("r1:\n  t0: R out0[0:1]<-r0")])


@pytest.mark.parametrize("sched", ["ring", "zigzag", "balanced", "allgather",
                                   "compose:zigzag+ulysses:2", "compose:zigzag+allgather:2:2"])
@pytest.mark.parametrize("kv", ["resend", "keep"])
def test_the_backward_of_ranged_programs_is_the_oracles(sched, kv):
    """The column reverse and the op-by-op oracle derive the same backward from ranged
    forward programs (the dkv and re-send rules above, written twice on purpose: one is the
    other's test)."""
    from fringe.schedules import reverse
    for mask in ("documents", "window", "causal_documents"):
        p = fringe.plan(schedules.get(sched), MASKS[mask], seq_len=S, world_size=4,
                        block_size=BS, kv=kv)
        assert list(reverse(p.forward, kv=kv)) == list(oracle.reverse(p.forward, kv=kv)) \
            == list(p.backward), (sched, mask, kv)
    assert ProgramTable.of(p.forward).ranged or sched == "ulysses"


@pytest.mark.parametrize("w", [1, 2, 3, 9])
def test_distinct_carry_rows_are_numpys_unique_rows(w):
    """narrow numbers the distinct block sets its moves carry (packed bit rows) by marking the
    keys (up to 16 blocks), by one uint64 key (up to 64) or by rows: each the order and the
    inverse of numpy's unique over the rows, so plans are the same whichever path ran."""
    from fringe.schedules.passes._narrow import _distinct_rows
    rng = np.random.default_rng(w)
    for m in (0, 1, 9, 500):
        bits = rng.integers(0, 256, size=(m, w), dtype=np.uint8)
        bits[::3] = bits[:1]                                     # repeats
        rows, inv = _distinct_rows(bits)
        want, want_inv = np.unique(bits, axis=0, return_inverse=True)
        # one key per row (up to 8 bytes): little-endian key order; wider: numpy's row order
        order = np.lexsort(want.T) if w <= 8 else np.arange(len(want))
        assert rows.dtype == np.uint8 and rows.tolist() == want[order].tolist()
        assert (rows[inv] == bits).all() and len(inv) == m


def test_narrow_returns_the_very_table_when_every_move_needs_its_whole_chunk():
    """Causal ring plans move whole chunks: narrow hands back the table it was given (no
    copy of its columns), and on a mask that narrows, a new ranged table."""
    for mask, ranged in ((masks.causal(), False), (MASKS["causal_documents"], True)):
        p = fringe.plan(schedules.ring(), mask, seq_len=S, world_size=4, block_size=BS,
                        ranges=False)
        blocks = BlockNeed(4, S // 4 // BS, p.block_map.rects.numpy())
        out = narrow(list(p.forward), blocks)
        assert (out[0].table is p.forward[0].table) is not ranged
        assert ProgramTable.of(out).ranged is ranged


def test_narrow_by_dense_cells_and_by_sorted_keys_gives_the_same_table(monkeypatch):
    """narrow keys (moved buffer, rank) cells densely up to PLANE_CELLS and by a sort past
    it: the same ranges on hops, collective slots and head slices."""
    from fringe.schedules import passes, registry
    for spec in ("zigzag", "allgather", "compose:zigzag+ulysses:2"):
        p = fringe.plan(registry.get(spec), MASKS["causal_documents"], seq_len=S,
                        world_size=4, block_size=BS, ranges=False)
        blocks = BlockNeed(4, S // 4 // BS, p.block_map.rects.numpy())
        want = ProgramTable.of(narrow(list(p.forward), blocks))
        with monkeypatch.context() as m:
            m.setattr(passes, "PLANE_CELLS", 0)
            got = ProgramTable.of(narrow(list(p.forward), blocks))
        assert want.ranged and got.digest() == want.digest()


def test_narrow_words_are_the_packed_rows():
    """narrow and covered take block bits as one word per row where a row fits 8 bytes: for every row
    width the words round-trip and OR / gather exactly as the uint8 rows do."""
    import numpy as np
    from fringe.schedules.passes._blocks import _unwords, _words
    rng = np.random.default_rng(3)
    for w in range(1, 11):
        a = rng.integers(0, 256, (50, w), dtype=np.uint8)
        b = rng.integers(0, 256, (50, w), dtype=np.uint8)
        wa, wb = _words(a), _words(b)
        assert (wa.ndim == 1) == (w <= 8)
        assert np.array_equal(_unwords(wa, w), a)
        assert np.array_equal(_unwords(wa | wb, w), a | b)
        lost = wa & ~wb                  # covered's "wanted but not held"
        assert np.array_equal(lost != 0 if lost.ndim == 1 else lost.any(axis=1),
                              (a & ~b).any(axis=1))
        idx = rng.integers(0, 50, 80)
        acc = np.zeros_like(wa)
        np.bitwise_or.at(acc, idx[:50] % 50, wb[idx[:50]])
        ref = np.zeros_like(a)
        np.bitwise_or.at(ref, idx[:50] % 50, b[idx[:50]])
        assert np.array_equal(_unwords(acc, w), ref)
