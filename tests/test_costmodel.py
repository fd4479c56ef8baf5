"""The cost model: symbolic runs of real programs, checked by hand and against invariants."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

import fringe
from fringe import masks, schedules
from fringe.masks import BlockKind
from fringe.ops import tile as tile_ops
from fringe.cost import simulate as cost_simulate, work as cost_work
from fringe.runtime import costmodel
from fringe.testing import oracle
from fringe.runtime.interpreter import StepRecord
from fringe.schedules.ir import Compute, GradCompute, Send

SHAPE = costmodel.Shape(batch=1, heads=2, kv_heads=1, head_dim=4, dtype="float32")


def _calls_only(latency: float, **kw) -> costmodel.Hardware:
    """A machine where a kernel call costs 1 s, pairs cost nothing and transfers ``latency``."""
    return costmodel.Hardware("unit", "test", fwd_flops=1e30, bwd_flops=1e30, call_s=1.0,
                              bwd_call_s=2.0, latency_s=latency, bandwidth=1e30, **kw)


def _issue(pred, which):
    """Issue time of each (rank, step): the rank's clock when the step starts."""
    c, w = pred.compute[which], pred.wait[which]
    return np.cumsum(c + w, axis=1) - (c + w)


def test_two_rank_ring_by_hand():
    # ring, causal, one block per rank: r0 computes q0·kv0 and sends kv0; r1 computes q1·kv1
    # while kv0 arrives (3 s), then q1·kv0. Compute overlaps the transfer; the rest is waiting.
    p = fringe.plan(schedules.ring(), masks.causal(), seq_len=8, world_size=2, block_size=4)
    pred = costmodel.simulate(p, _calls_only(3.0), SHAPE)
    assert pred.compute["forward"].tolist() == [[1.0, 0.0], [1.0, 1.0]]
    assert pred.wait["forward"].tolist() == [[2.0, 0.0], [2.0, 0.0]]
    assert pred.forward_s == 4.0
    assert pred.active["forward"].tolist() == [[True, False], [True, True]]
    kv_bytes = 2 * 1 * 1 * 4 * 4 * 4                   # [2, B, G, L, D] float32
    assert pred.sent["forward"][0, 0] == kv_bytes and pred.recv["forward"][1, 0] == kv_bytes
    assert pred.exposed("forward") == pytest.approx(4.0 / 7.0)


def test_a_transfer_waits_for_both_ends_to_issue():
    for name in ("ring", "zigzag", "balanced"):
        ids = torch.repeat_interleave(torch.arange(3), torch.tensor([40, 8, 16]))
        p = fringe.plan(getattr(schedules, name)(), masks.causal() & masks.document(ids),
                        seq_len=64, world_size=4, block_size=4)
        lat = 0.25
        pred = costmodel.simulate(p, _calls_only(lat), SHAPE)
        for which, progs in (("forward", p.forward), ("backward", p.backward)):
            issue = _issue(pred, which)
            end = issue + pred.compute[which] + pred.wait[which]
            pos = {int(t): i for i, t in enumerate(pred.steps[which])}
            n = 0
            for prog in progs:
                for step in prog.steps:
                    for op in step.comms:
                        if isinstance(op, Send):
                            i, a, b = pos[step.index], prog.rank, op.peer
                            start = max(issue[a, i], issue[b, i])
                            assert end[a, i] >= start + lat - 1e-12
                            assert end[b, i] >= start + lat - 1e-12
                            n += 1
            assert n > 0
            # each step ends exactly when its compute or its last transfer is done
            assert (pred.wait[which] >= -1e-12).all()


def test_compute_is_the_sum_of_tile_costs_and_records_match_the_programs():
    ids = torch.repeat_interleave(torch.arange(4), torch.tensor([70, 10, 100, 76]))
    p = fringe.plan(schedules.zigzag(), masks.causal() & masks.document(ids), seq_len=256,
                    world_size=4, block_size=8)
    hw = costmodel.HARDWARE["cpu"]
    assert hw.byte_s > 0
    pred = costmodel.simulate(p, hw, SHAPE)
    # a rank's busy time: its tiles, plus byte_s per byte it sends or receives (the host side
    # of moving bytes on a CPU); without byte_s, its tiles alone
    bare = costmodel.simulate(p, dataclasses.replace(hw, byte_s=0.0), SHAPE)
    for which, progs, cls in (("forward", p.forward, Compute),
                              ("backward", p.backward, GradCompute)):
        cost = costmodel.tile_costs(p, hw, SHAPE, backward=which == "backward")
        for prog in progs:
            r = prog.rank
            want = sum(cost[op.q, op.kv] for _, op in prog.ops() if isinstance(op, cls))
            assert bare.compute[which][r].sum() == pytest.approx(want)
            moved = pred.sent[which][r] + pred.recv[which][r]
            assert moved.sum() > 0
            np.testing.assert_allclose(pred.compute[which][r],
                                       bare.compute[which][r] + hw.byte_s * moved, rtol=1e-12)
        recs = pred.records(which)
        assert all(isinstance(r, StepRecord) for r in recs)
        assert len(recs) == sum(len(prog.steps) for prog in progs)
        assert sum(r.tiles for r in recs) == sum(len(s.computes) for prog in progs for s in prog.steps)
    stats = p.stats(batch=1, heads=2, kv_heads=1, head_dim=4, dtype=torch.float32)
    for row in stats.rows:
        assert pred.sent["forward"][row["rank"]].sum() == row["fwd_sent"]
        assert pred.sent["backward"][row["rank"]].sum() == row["bwd_sent"]


def _causalish_maps(g: torch.Generator, N: int, n: int, noise: float) -> torch.Tensor:
    """``[N, n, n]`` causal diagonal maps (FULL below, PARTIAL on the diagonal), shifted along
    the kv axis and with a share ``noise`` of blocks redrawn at random."""
    base = torch.full((n, n), int(BlockKind.EMPTY), dtype=torch.int8)
    base[torch.tril(torch.ones(n, n, dtype=torch.bool), -1)] = int(BlockKind.FULL)
    base[torch.arange(n), torch.arange(n)] = int(BlockKind.PARTIAL)
    maps = base.repeat(N, 1, 1)
    hit = torch.rand(N, n, n, generator=g) < noise
    maps[hit] = torch.randint(0, 3, (int(hit.sum()),), generator=g).to(torch.int8)
    for a in range(0, N, 3):
        maps[a] = torch.roll(maps[a], int(torch.randint(0, n, (1,), generator=g)), 1)
    return maps


def test_work_counts_follow_the_tile_grouping():
    # the stacked evaluation gives, map by map, the calls and pairs of the sdpa kernel's
    # grouping (fringe.ops.tile._plan with fused=True, one tile at a time through the one
    # planner, fringe.ops.calls.plan_tile): causal squares, column cuts, row groups
    g = torch.Generator().manual_seed(3)
    bs, causal_seen = 4, 0
    for n in (1, 3, 6, 9):
        maps = torch.cat([torch.randint(0, 3, (12, n, n), generator=g).to(torch.int8),
                          _causalish_maps(g, 12, n, 0.05), _causalish_maps(g, 12, n, 0.25)])
        maps[3] = int(BlockKind.FULL)
        maps[4, n // 2:] = int(BlockKind.EMPTY)
        got = cost_work._maps_work(maps, L=n * bs, block_size=bs, masked_ok=True)
        for m, row in zip(maps, got):
            groups = tile_ops._plan(m, Lq=n * bs, Lk=n * bs, block_size=bs, fused=True)
            pairs = [(gr.q1 - gr.q0) * (gr.k1 - gr.k0) for gr in groups]
            full = sum(p for p, gr in zip(pairs, groups)
                       if not gr.causal and bool((gr.codes == int(BlockKind.FULL)).all()))
            causal = sum(p for p, gr in zip(pairs, groups) if gr.causal)
            assert row.tolist() == [len(groups), full, sum(pairs) - full - causal, causal]
            causal_seen += causal > 0
    assert causal_seen >= 20                      # the squares path is exercised


def test_a_causal_diagonal_tile_is_one_is_causal_call():
    # what the sdpa kernel runs: one square is_causal call, not masked row groups
    n, bs = 8, 16
    m = _causalish_maps(torch.Generator().manual_seed(0), 2, n, 0.0)[1:]     # not shifted
    assert cost_work._maps_work(m, L=n * bs, block_size=bs, masked_ok=True)[0].tolist() == [
        1, 0, 0, (n * bs) ** 2]


@pytest.mark.parametrize("mask_kind", ["causal", "document"])
@pytest.mark.parametrize("name", ["zigzag", "striped", "balanced"])
def test_distinct_maps_from_rects_equal_the_sorted_and_dense_ways(name, mask_kind, monkeypatch):
    m = masks.causal()
    if mask_kind == "document":
        from fringe.testing import packed_docs
        m = m & masks.document(packed_docs(4096, 9, 0))
    p = fringe.plan(schedules.get(name), m, seq_len=4096, world_size=8, block_size=32)
    want = costmodel.tile_work(p)
    P, n = p.world_size, p.local_len // p.block_size
    tiles = torch.as_tensor(p.tiles).to(torch.int64).numpy().reshape(-1)
    part = np.flatnonzero(tiles == int(BlockKind.PARTIAL))
    d = cost_work._distinct_maps_from_rects(p.block_map, tiles, part, P, n)
    maps, inv = d.paint(n), d.inv
    for k, t in enumerate(part.tolist()):          # every tile gets its own map, exactly
        assert torch.equal(maps[inv[k]], p.tile_blocks(t // P, t % P))
    assert len(maps) == len(np.unique(inv))
    for way in (cost_work._distinct_maps_sorted, cost_work._distinct_maps_dense):
        monkeypatch.setattr(cost_work, "_distinct_maps_from_rects",
                            lambda bm, tf, pt, P_, n_: None if way is cost_work._distinct_maps_dense
                            else way(bm, tf, pt, P_, n_))
        p2 = fringe.plan(schedules.get(name), m, seq_len=4096, world_size=8, block_size=32)
        assert np.array_equal(costmodel.tile_work(p2), want)
        monkeypatch.undo()


@pytest.mark.parametrize("collide", [False, True])
@pytest.mark.parametrize("name", ["zigzag", "striped"])
def test_rectangles_hashed_in_chunks_give_every_tile_its_own_map(name, collide, monkeypatch):
    # the hashing and the membership check run a chunk of rectangles at a time; with chunks
    # of 7 they end inside tiles and rows, and every tile must still get exactly its own map
    # and the work of the whole-array way (with every hash alike: the sorted fallback)
    from fringe.testing import packed_docs
    m = masks.causal() & masks.document(packed_docs(4096, 9, 0))
    p = fringe.plan(schedules.get(name), m, seq_len=4096, world_size=8, block_size=32)
    want = costmodel.tile_work(p)
    monkeypatch.setattr(cost_work, "_RECT_CHUNK", 7)
    if collide:
        monkeypatch.setattr(cost_work, "_mix64", lambda x: np.zeros(len(x), dtype=np.uint64))
    P, n = p.world_size, p.local_len // p.block_size
    tiles = torch.as_tensor(p.tiles).to(torch.int64).numpy().reshape(-1)
    part = np.flatnonzero(tiles == int(BlockKind.PARTIAL))
    assert len(p.block_map.rects) > 10 * 7                # many chunks
    d = cost_work._distinct_maps_from_rects(p.block_map, tiles, part, P, n)
    maps, inv = d.paint(n), d.inv
    for k, t in enumerate(part.tolist()):
        assert torch.equal(maps[inv[k]], p.tile_blocks(t // P, t % P))
    assert np.array_equal(costmodel.tile_work(dataclasses.replace(p)), want)


@pytest.mark.parametrize("spec", ["allgather", "compose:zigzag+ulysses:2",
                                  "compose:zigzag+allgather:2:2"])
def test_the_op_walk_in_bulk_equals_the_walk_op_by_op_and_the_table_reader(spec, monkeypatch):
    # the oracle's walk takes long steps' computes in bulk, short ones op by op: every step
    # either way must predict the same numbers as the table reader, bit for bit (compute sums
    # keep each step's op order)
    from fringe.testing import packed_docs
    m = masks.causal() & masks.document(packed_docs(256, 5, 0))
    p = fringe.plan(schedules.get(spec), m, seq_len=256, world_size=8, block_size=4)
    preds = [costmodel.simulate(dataclasses.replace(p), "h100-ib", SHAPE)]
    monkeypatch.setattr(cost_simulate, "columns", oracle.cost_columns)
    for bulk in (1, 10 ** 9):                          # all in bulk / all op by op
        monkeypatch.setattr(oracle, "_COST_BULK_OPS", bulk)
        preds.append(costmodel.simulate(dataclasses.replace(p), "h100-ib", SHAPE))
    for a, b in ((preds[1], preds[2]), (preds[0], preds[1])):
        _same_numbers(a, b)
    assert preds[0].compute["forward"].sum() > 0 and preds[0].sent["forward"].sum() > 0


def _same_numbers(a, b):
    for which in ("forward", "backward"):
        for field in ("compute", "wait", "sent", "recv", "tiles", "active"):
            np.testing.assert_array_equal(getattr(a, field)[which], getattr(b, field)[which])
    np.testing.assert_array_equal(a.memory, b.memory)


def test_a_signature_collision_is_caught_and_grouped_exactly(monkeypatch):
    # every tile hashed alike: the exact check fails and the sorted grouping takes over
    p = fringe.plan(schedules.zigzag(), masks.causal(), seq_len=4096, world_size=8,
                    block_size=32)
    want = costmodel.tile_work(p)
    monkeypatch.setattr(cost_work, "_mix64", lambda x: np.zeros(len(x), dtype=np.uint64))
    called = []
    real = cost_work._distinct_maps_sorted
    monkeypatch.setattr(cost_work, "_distinct_maps_sorted",
                        lambda *a: called.append(1) or real(*a))
    p2 = fringe.plan(schedules.zigzag(), masks.causal(), seq_len=4096, world_size=8,
                     block_size=32)
    assert np.array_equal(costmodel.tile_work(p2), want) and called


def test_balance_and_schedules_rank_as_expected():
    m = masks.causal()
    preds = {name: costmodel.simulate(fringe.plan(getattr(schedules, name)(), m, seq_len=4096,
                                                  world_size=8), "h100-nvlink")
             for name in ("ring", "zigzag")}
    assert preds["zigzag"].balance == pytest.approx(1.0, abs=0.02)
    assert preds["ring"].balance > 1.5
    assert preds["zigzag"].forward_s < preds["ring"].forward_s
    for pred in preds.values():
        assert pred.backward_s > pred.forward_s > 0
        assert 0.0 <= pred.exposed() < 1.0
        row = pred.row()
        assert row["memory MB/rank"] > 0 and row["sent MB/rank"] > 0


def test_memory_counts_received_buffers_alive_at_once():
    p = fringe.plan(schedules.ring(), None, seq_len=64, world_size=4, block_size=4)
    pred = costmodel.simulate(p, "cpu", SHAPE)
    L = 16
    resident = (2 * SHAPE.buffer_bytes("q", L) + SHAPE.buffer_bytes("kv", L)
                + SHAPE.buffer_bytes("out", L) + SHAPE.buffer_bytes("dq", L)
                + SHAPE.buffer_bytes("dkv", L))
    extra = pred.memory - resident
    kv = SHAPE.buffer_bytes("kv", L)
    assert (extra >= kv).all() and (extra <= 8 * kv).all()


def test_hardware_between_nodes_is_slower():
    p = fringe.plan(schedules.ring(), None, seq_len=2048, world_size=16, block_size=64)
    one_node = costmodel.simulate(p, "h100-nvlink")
    ib = costmodel.simulate(p, "h100-ib")
    assert ib.forward_s > one_node.forward_s


def test_errors_say_what_to_do():
    with pytest.raises(ValueError, match="choose one of"):
        costmodel.get_hardware("tpu")
    with pytest.raises(ValueError, match="bandwidth must be > 0"):
        costmodel.Hardware("x", "test", fwd_flops=1, bwd_flops=1, call_s=0, bwd_call_s=0,
                           bandwidth=0)
    with pytest.raises(ValueError, match="multiple of kv_heads"):
        costmodel.Shape(heads=6, kv_heads=4)
    with pytest.raises(ValueError, match="document:N"):
        costmodel.mask_from_spec("docs=3", 1024)
    assert costmodel.mask_from_spec("full", 1024) is None


def test_cli_simulate_prints_a_row_per_schedule_and_writes_the_timeline(tmp_path, capsys):
    from fringe.__main__ import main
    png = tmp_path / "t.png"
    rc = main(["simulate", "--world-size", "8", "--seq-len", "8192", "--mask", "document:10",
               "--hardware", "h100-ib", "--schedules", "ring", "zigzag", "--png", str(png)])
    out = capsys.readouterr().out
    assert rc == 0
    assert "ring" in out and "zigzag" in out and "exposed comm" in out
    assert (tmp_path / "t.ring.png").stat().st_size > 1000
    assert (tmp_path / "t.zigzag.png").stat().st_size > 1000


def test_cli_simulate_takes_collective_and_composed_schedules(capsys):
    from fringe.__main__ import main
    rc = main(["simulate", "--world-size", "8", "--seq-len", "4096", "--mask", "causal",
               "--hardware", "h100-nvlink", "--schedules", "allgather", "ulysses",
               "compose:zigzag+ulysses:2"])
    out = capsys.readouterr().out
    assert rc == 0
    rows = [ln.split()[0] for ln in out.splitlines() if ln.split() and ln.split()[0] in
            ("allgather", "ulysses", "compose:zigzag+ulysses:2")]
    assert rows == ["allgather", "ulysses", "compose:zigzag+ulysses:2"]


@pytest.mark.parametrize("argv, needle", [
    (["--world-size", "0"], "positive integer"),
    (["--schedules", "spiral"], "unknown schedule"),
    (["--mask", "docs"], "--mask 'docs' is not understood"),
    (["--hardware", "abacus"], "unknown hardware"),
    (["--png", "out.jpg"], "ending in .png"),
    (["--world-size", "64", "--schedules", "ulysses"], "needs H % 64 == 0"),
])
def test_cli_simulate_rejects_bad_arguments(argv, needle, capsys):
    from fringe.__main__ import main
    rc = main(["simulate", "--world-size", "2", "--seq-len", "1024", *argv])  # last one wins
    assert rc == 2
    assert needle in capsys.readouterr().err


def test_columns_from_the_program_table_equal_walking_the_ops(monkeypatch):
    ids = torch.repeat_interleave(torch.arange(3), torch.tensor([30, 20, 14]))
    p = fringe.plan(schedules.striped(), masks.causal() & masks.document(ids), seq_len=64,
                    world_size=4, block_size=4)
    fast = costmodel.simulate(p, "h100-ib", SHAPE)
    monkeypatch.setattr(cost_simulate, "columns", oracle.cost_columns)      # the op walk
    slow = costmodel.simulate(dataclasses.replace(p), "h100-ib", SHAPE)   # a fresh plan: no cache
    _same_numbers(fast, slow)
    assert fast.sent["forward"].sum() > 0


def _interpreter_records(p, shape):
    """Each direction's StepRecords of a real run on the virtual mesh (float32, seed 0)."""
    from fringe.runtime.virtual import VirtualRuntime
    P, L = p.world_size, p.local_len
    g = torch.Generator().manual_seed(0)
    q = torch.randn(P, shape.batch, shape.heads, L, shape.head_dim, generator=g)
    k, v = (torch.randn(P, shape.batch, shape.kv_heads, L, shape.head_dim, generator=g)
            for _ in range(2))
    rt = VirtualRuntime(P)
    out, lse, kept = rt.forward(p, q, k, v)
    rt.backward(p, q, k, v, out, lse, torch.ones_like(out), None, kept)
    return {which: [rec for st in rt.last_states[which].values() for rec in st.records]
            for which in ("forward", "backward")}


@pytest.mark.parametrize("spec, mask", [("allgather", "causal"), ("allgather", "document"),
                                        ("ulysses", "document"),
                                        ("compose:zigzag+ulysses:2", "causal"),
                                        ("compose:allgather+ulysses:2", "document")])
def test_collective_schedules_simulate_with_the_bytes_and_tiles_the_interpreter_moves(spec, mask):
    # H=4, G=2: ulysses over 4 ranks replicates kv heads (one per slice), compose over 2 splits them
    shape = costmodel.Shape(batch=1, heads=4, kv_heads=2, head_dim=4, dtype="float32")
    ids = torch.repeat_interleave(torch.arange(3), torch.tensor([30, 20, 14]))
    m = masks.causal() if mask == "causal" else masks.causal() & masks.document(ids)
    p = fringe.plan(schedules.get(spec), m, seq_len=64, world_size=4, block_size=4)
    pred = costmodel.simulate(p, "h100-ib", shape)
    assert pred.step_s > 0 and (pred.wait["forward"] >= -1e-15).all()
    for which, recs in _interpreter_records(p, shape).items():
        pos = {int(t): i for i, t in enumerate(pred.steps[which])}
        assert len(recs) == int(pred.active[which].sum())
        for rec in recs:
            i = pos[rec.step]
            got = (pred.sent[which][rec.rank, i], pred.recv[which][rec.rank, i],
                   pred.tiles[which][rec.rank, i])
            assert got == (rec.sent_bytes, rec.recv_bytes, rec.tiles), (which, rec)
        assert pred.sent[which].sum() == pred.recv[which].sum() > 0


def _hand_plan(forward_text: str, S: int = 16, P: int = 4):
    """A full-mask plan (every tile FULL) whose forward programs are ``forward_text``."""
    from fringe.schedules import ir, reverse
    p = fringe.plan(schedules.ring(), None, seq_len=S, world_size=P, block_size=4)
    fwd = tuple(ir.parse_programs(forward_text))
    return dataclasses.replace(p, forward=fwd, backward=tuple(reverse(list(fwd))))


def _comm_only(latency: float, bandwidth: float, **kw) -> costmodel.Hardware:
    return costmodel.Hardware("comm", "test", fwd_flops=1e30, bwd_flops=1e30, call_s=0.0,
                              bwd_call_s=0.0, latency_s=latency, bandwidth=bandwidth, **kw)


# one kv buffer of SHAPE at L=4 tokens: [2, B=1, G=1, L=4, D=4] float32 = 128 bytes
KV = 2 * 1 * 1 * 4 * 4 * 4


def _one_collective(kind: str, sends: dict, recvs: dict) -> str:
    """Programs of one collective over ranks 0-3 at step 0 (slots as ASCII, '-' empty)."""
    return "\n".join(f"r{r}:\n  t0: {kind}[0,1,2,3] {sends[r]} > {recvs[r]}" for r in range(4))


def test_all_gather_and_all_to_all_cost_the_textbook_formulas_on_four_ranks():
    hw = _comm_only(0.5, KV)                   # 0.5 s a round, 1 s per kv buffer
    full_ag = _one_collective(
        "AG", {r: ",".join([f"kv{r}"] * 4) for r in range(4)},
        {r: "kv0,kv1,kv2,kv3" for r in range(4)})
    pred = costmodel.simulate(_hand_plan(full_ag), hw, SHAPE)
    # ring all-gather: (n-1) * latency + (n-1) * b / bandwidth = 3 * 0.5 + 3 * 1
    assert pred.forward_s == pytest.approx(4.5)
    assert pred.wait["forward"][:, 0].tolist() == pytest.approx([4.5] * 4)
    assert pred.sent["forward"][:, 0].tolist() == [3 * KV] * 4
    # the same movement with rank 0 alone contributing (a broadcast), as AG and as A2A:
    bcast = {0: "kv0,kv0,kv0,kv0", 1: "-,-,-,-", 2: "-,-,-,-", 3: "-,-,-,-"}
    got = {0: "kv0,-,-,-", 1: "kv0,kv1,-,-", 2: "kv0,-,kv2,-", 3: "kv0,-,-,kv3"}
    bcast[1], bcast[2], bcast[3] = "-,kv1,-,-", "-,-,kv2,-", "-,-,-,kv3"
    ag = costmodel.simulate(_hand_plan(_one_collective("AG", bcast, got)), hw, SHAPE)
    a2a = costmodel.simulate(_hand_plan(_one_collective("A2A", bcast, got)), hw, SHAPE)
    # AG: every member receives one buffer: 3 * 0.5 + 1; A2A: pairwise, rank 0 sends three
    assert ag.forward_s == pytest.approx(2.5)
    assert a2a.forward_s == pytest.approx(3 * 0.5 + 3 * 1.0)
    # the backward is the adjoint: a reduce-scatter of dkv, whose busiest member sends 3 * 128 B
    # of float32 gradients into rank 0 (RS is costed by what a member sends: 1 each here)
    assert ag.backward_s == pytest.approx(3 * 0.5 + 1.0)
    # across nodes of 2 ranks the inter-node link prices the whole collective
    two_nodes = _comm_only(0.5, KV, node_size=2, inter_latency_s=1.0, inter_bandwidth=KV / 2)
    pred = costmodel.simulate(_hand_plan(full_ag), two_nodes, SHAPE)
    assert pred.forward_s == pytest.approx(3 * 1.0 + 3 * 2.0)


def test_an_empty_contribution_costs_less_than_a_full_one():
    hw = _comm_only(0.01, KV)
    full = _one_collective("AG", {r: ",".join([f"kv{r}"] * 4) for r in range(4)},
                           {r: "kv0,kv1,kv2,kv3" for r in range(4)})
    # ranks 2 and 3 contribute nothing (a mask that needs only kv0 and kv1)
    half = _one_collective("AG", {r: ",".join([f"kv{r}" if r < 2 else "-"] * 4) for r in range(4)},
                           {r: ",".join(f"kv{k}" if k < 2 or k == r else "-" for k in range(4))
                            for r in range(4)})
    a, b = (costmodel.simulate(_hand_plan(x), hw, SHAPE) for x in (full, half))
    assert b.forward_s < a.forward_s
    assert b.sent["forward"].sum() < a.sent["forward"].sum()
    assert b.forward_s == pytest.approx(3 * 0.01 + 2.0)    # ranks 2, 3 receive kv0 and kv1


def test_a_collective_waits_for_its_last_member_and_overlaps_compute():
    # rank 0 computes for 1 s before its step ends; the AG of step 1 starts when all have issued
    text = "\n".join(
        f"r{r}:\n  t0: " + ("C q0.kv0" if r == 0 else f"C q{r}.kv{r}") +
        f"\n  t1: AG[0,1,2,3] {','.join([f'kv{r}'] * 4)} > kv0,kv1,kv2,kv3"
        + "".join(f" | C q{r}.kv{k}" for k in range(4) if k == r) for r in range(4))
    hw = costmodel.Hardware("unit", "test", fwd_flops=1e30, bwd_flops=1e30, call_s=1.0,
                            bwd_call_s=1.0, latency_s=0.5, bandwidth=KV)
    pred = costmodel.simulate(_hand_plan(text), hw, SHAPE)
    # t0: 1 s compute each; t1: the AG (4.5 s) overlaps the 1 s compute of the same step
    assert pred.compute["forward"][:, 1].tolist() == [1.0] * 4
    assert pred.wait["forward"][:, 1].tolist() == pytest.approx([3.5] * 4)
    assert pred.forward_s == pytest.approx(1.0 + 4.5)


def test_head_sliced_computes_cost_their_share_of_the_heads():
    shape = costmodel.Shape(batch=1, heads=4, kv_heads=2, head_dim=8, dtype="float32")
    p = fringe.plan(schedules.get("compose:zigzag+ulysses:2"), masks.causal(), seq_len=256,
                    world_size=4, block_size=8)
    hw = dataclasses.replace(costmodel.HARDWARE["cpu"], byte_s=0.0)   # the tiles alone
    pred = costmodel.simulate(p, hw, shape)
    for which, progs, cls in (("forward", p.forward, Compute),
                              ("backward", p.backward, GradCompute)):
        whole = costmodel.tile_costs(p, hw, shape, backward=which == "backward")
        half = costmodel.tile_costs(p, hw, shape, backward=which == "backward", split=2)
        assert (half < whole)[whole > 0].all() and (half > whole / 2)[whole > 0].all()
        for prog in progs:
            ops = [op for _, op in prog.ops() if isinstance(op, cls)]
            assert ops and all(op.heads is not None and op.heads[1] == 2 for op in ops)
            want = sum(half[op.q, op.kv] for op in ops)
            assert pred.compute[which][prog.rank].sum() == pytest.approx(want)


def test_ulysses_where_the_heads_do_not_split_is_refused_with_the_fix():
    p = fringe.plan(schedules.ulysses(), masks.causal(), seq_len=64, world_size=4, block_size=4)
    with pytest.raises(ValueError, match="divisible by 4"):
        costmodel.simulate(p, "h100-ib", costmodel.Shape(heads=2, kv_heads=2))
    with pytest.raises(ValueError, match="divisible by 4"):
        costmodel.Shape(heads=6, kv_heads=2).buffer_bytes("q", 16, split=4)


def test_a_thousand_ranks_simulate():
    # structural: every rank has a program, the busiest compute is real, memory is per rank
    # (allgather and compose plan in 20-70 s at P=1024 today; tests/test_collectives covers them
    # small, and the collective tests above check their costs)
    P, S = 1024, 1024 * 64
    docs = masks.causal() & masks.document(torch.repeat_interleave(torch.arange(64), 1024))
    for spec in ("ring",):
        p = fringe.plan(schedules.get(spec), docs, seq_len=S, world_size=P, block_size=32)
        pred = costmodel.simulate(p, "h100-ib")
        assert pred.world_size == P and pred.compute["forward"].shape[0] == P
        assert pred.active["forward"].any(axis=1).all()
        assert pred.step_s > pred.compute["forward"].sum(1).max() > 0
        assert pred.memory.shape == (P,) and (pred.memory > 0).all()
        assert pred.sent["backward"].sum() == pred.recv["backward"].sum() > 0


def test_a_table_of_rows_refuses_kinds_it_does_not_know():
    # the row constructor converts rows into the one table form; a kind past R is refused
    # with what was expected, not carried as a column no reader knows
    from fringe.schedules import ir
    p = fringe.plan(schedules.ring(), masks.causal(), seq_len=64, world_size=4, block_size=4)
    t = p.forward[0].table
    again = ir.ProgramTable(4, t.rank, t.step, t.kind, t.a, t.b, t.c)
    assert again.digest() == t.digest()
    with pytest.raises(ValueError, match="kinds 0-3"):
        ir.ProgramTable(4, t.rank, t.step, np.where(t.kind == 2, 7, t.kind), t.a, t.b, t.c)


def test_a_head_split_the_shape_refuses_is_refused_on_every_call():
    """The simulator keeps a plan's program columns for the next call (other presets); the
    head-split check runs on every call, not only on the one that derived them."""
    from fringe.cost.hardware import Shape
    p = fringe.plan(schedules.get("ulysses"), masks.causal(), seq_len=256, world_size=4,
                    block_size=32)
    ok = cost_simulate.simulate(p, "cpu", Shape(heads=8, kv_heads=8))
    assert ok.step_s > 0
    for _ in range(2):
        with pytest.raises(ValueError, match=r"divisible by 4|heads split 4 ways"):
            cost_simulate.simulate(p, "cpu", Shape(heads=6, kv_heads=6))
