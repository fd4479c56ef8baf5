"""The sparse block map: rectangles that densify to the exact block classification, permuted
into layouts, held by plans in place of the dense ``(S/block)^2`` map."""
from __future__ import annotations

import random
import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import fringe
from fringe.testing import packed_docs
from fringe import masks as M
from fringe import schedules
from fringe.masks import BlockKind, BlockMap

SEEDS = st.integers(0, 2**31 - 1)


def block_reduce(dense: torch.Tensor, bs: int) -> torch.Tensor:
    """Block-wise reduction of a dense ``[Lq, Lk]`` bool mask into BlockKind codes."""
    lq, lk = dense.shape
    d = dense.reshape(lq // bs, bs, lk // bs, bs).transpose(1, 2).reshape(lq // bs, lk // bs, -1)
    return torch.where(d.all(-1), int(BlockKind.FULL),
                       torch.where(d.any(-1), int(BlockKind.PARTIAL),
                                   int(BlockKind.EMPTY))).to(torch.int8)


def oracle(mask, q_pos, kv_pos, bs):
    zero = torch.tensor(0)
    dense = mask(zero, zero, q_pos[:, None], kv_pos[None, :]).expand(q_pos.numel(),
                                                                     kv_pos.numel())
    return block_reduce(dense, bs)


def packed_ids(S: int, rng: random.Random) -> torch.Tensor:
    lengths = []
    while sum(lengths) < S:
        lengths.append(rng.choice([1, 2, 3, rng.randint(1, S)]))
    return torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))[:S]


def random_mask(S: int, rng: random.Random, depth: int = 2) -> M.Mask:
    if depth and rng.random() < 0.6:
        a, b = random_mask(S, rng, depth - 1), random_mask(S, rng, depth - 1)
        return a & b if rng.random() < 0.6 else a | b
    k = rng.randrange(6)
    if k == 0:
        return M.causal()
    if k == 1:
        return M.sliding_window(rng.randint(1, S), causal=rng.random() < 0.5)
    if k == 2:
        return M.document(packed_ids(S, rng))
    if k == 3:
        return M.prefix_lm(rng.randint(0, S))
    if k == 4:
        return M.full()
    w = rng.randint(2, 7)
    return M.as_mask(lambda b, h, q, kv: (q + kv) % w != 0, name=f"sum%{w}")


def positions(kind: str, S: int, n: int, g: torch.Generator) -> torch.Tensor:
    """``n`` global positions: a contiguous run, zigzag-like halves, or a random subset."""
    if kind == "run":
        start = int(torch.randint(0, S - n + 1, (), generator=g))
        return torch.arange(start, start + n)
    if kind == "halves":
        h = n // 2
        return torch.cat([torch.arange(h), torch.arange(S - (n - h), S)])
    return torch.randperm(S, generator=g)[:n]


def check_rects(bm: BlockMap) -> None:
    """Rectangles in range, non-empty, disjoint (areas add up to the painted blocks), sorted,
    codes FULL or PARTIAL (CAUSAL is reserved and not produced)."""
    nq, nk = bm.shape
    r = bm.rects
    if len(r):
        assert bool((r[:, 0] < r[:, 1]).all() and (r[:, 2] < r[:, 3]).all())
        assert bool((r[:, 0] >= 0).all() and (r[:, 1] <= nq).all() and (r[:, 2] >= 0).all()
                    and (r[:, 3] <= nk).all())
        key = r[:, 0] * (nk + 1) + r[:, 2]
        assert bool((key[1:] > key[:-1]).all())
    assert set(bm.codes.tolist()) <= {int(BlockKind.FULL), int(BlockKind.PARTIAL)}
    dense = bm.dense()
    assert int((dense != 0).sum()) == int(((r[:, 1] - r[:, 0]) * (r[:, 3] - r[:, 2])).sum())


@settings(deadline=None, max_examples=15)
@given(seed=SEEDS, bs=st.sampled_from([1, 2, 3, 4]), nq=st.integers(1, 13),
       nk=st.integers(1, 13), qk=st.sampled_from(["run", "halves", "random"]),
       kk=st.sampled_from(["run", "halves", "random"]))
def test_sparse_classify_densifies_to_the_exact_block_map(seed, bs, nq, nk, qk, kk):
    """Non-square position sets, odd block counts (quadtree nodes with one child)."""
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    S = bs * max(nq, nk) * 2
    mask = random_mask(S, rng)
    q_pos, kv_pos = positions(qk, S, nq * bs, g), positions(kk, S, nk * bs, g)
    stats = {}
    bm = M.classify(mask, q_pos, kv_pos, block_size=bs, sparse=True, stats=stats)
    want = oracle(mask, q_pos, kv_pos, bs)
    assert bm.shape == (nq, nk)
    assert torch.equal(bm.dense(), want), (mask, qk, kk)
    assert torch.equal(M.classify(mask, q_pos, kv_pos, block_size=bs), want)
    check_rects(bm)
    assert stats["rects"] == len(bm)
    for kind in BlockKind:
        assert bm.count(kind) == int((want == int(kind)).sum())
    i, j = bm.nonzero(BlockKind.PARTIAL)
    assert torch.equal(torch.stack([i, j]), (want == int(BlockKind.PARTIAL)).nonzero().t())
    assert torch.equal(bm.row_counts(), (want != 0).sum(dim=1))
    full, part = bm.row_kind_counts()
    assert torch.equal(full, (want == int(BlockKind.FULL)).sum(dim=1))
    assert torch.equal(part, (want == int(BlockKind.PARTIAL)).sum(dim=1))
    first, end = bm.row_spans()
    idx = torch.arange(nk)
    assert torch.equal(first, torch.where(want != 0, idx, nk).min(dim=1).values)
    assert torch.equal(end, torch.where(want != 0, idx + 1, 0).max(dim=1).values)
    again = BlockMap.from_dense(want)
    check_rects(again)
    assert torch.equal(again.dense(), want)
    rows, cols = torch.randint(0, nq, (5,), generator=g), torch.randint(0, nk, (7,), generator=g)
    assert torch.equal(bm.take(rows, cols), want[rows][:, cols])
    r0, c0 = rng.randrange(nq), rng.randrange(nk)
    assert torch.equal(bm.dense(rows=(r0, nq), cols=(c0, nk)), want[r0:, c0:])


@settings(deadline=None, max_examples=15)
@given(seed=SEEDS, n=st.integers(1, 24), cut=st.sampled_from([None, 1, 2, 3, 4]))
def test_permute_moves_blocks_and_cuts_at_tiles(seed, n, cut):
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    S = 2 * n
    mask = random_mask(S, rng)
    bm = M.classify(mask, torch.arange(S), torch.arange(S), block_size=2, sparse=True)
    qi, ki = torch.randperm(n, generator=g), torch.randperm(n, generator=g)
    out = bm.permute(qi, ki, cut=cut)
    dense = bm.dense()
    want = torch.empty_like(dense)
    want[qi[:, None], ki[None, :]] = dense
    assert torch.equal(out.dense(), want)
    check_rects(out)
    assert bm.pieces(qi, ki, cut=cut) == len(out)
    if cut:
        r = out.rects
        assert bool(((r[:, 0] // cut) == ((r[:, 1] - 1) // cut)).all())
        assert bool(((r[:, 2] // cut) == ((r[:, 3] - 1) // cut)).all())


SCHEDULES = {"ring": schedules.ring, "zigzag": schedules.zigzag, "striped": schedules.striped,
             "balanced": schedules.balanced}


@settings(deadline=None, max_examples=8)
@given(seed=SEEDS, P=st.sampled_from([1, 2, 3, 4]), bs=st.sampled_from([1, 2, 4]),
       m=st.integers(1, 3), name=st.sampled_from(sorted(SCHEDULES)))
def test_plan_block_map_is_the_dense_classification(seed, P, bs, m, name):
    rng = random.Random(seed)
    S = 2 * P * bs * m
    mask = random_mask(S, rng)
    p = fringe.plan(SCHEDULES[name](), mask, seq_len=S, world_size=P, block_size=bs)
    order = p.layout.order
    want = M.classify(mask, order, order, block_size=bs)
    assert torch.equal(p.blocks, want)
    check_rects(p.block_map)
    n = p.local_len // bs
    tiles = want.view(P, n, P, n).transpose(1, 2)
    for i in range(P):
        for j in range(P):
            t = tiles[i, j]
            assert torch.equal(p.tile_blocks(i, j), t)
            kind = BlockKind.EMPTY if bool((t == 0).all()) else \
                BlockKind.FULL if bool((t == int(BlockKind.FULL)).all()) else BlockKind.PARTIAL
            assert p.tile_kind(i, j) == kind
            assert int(p.tile_block_counts()[i, j]) == int((t != 0).sum())
            r = p.block_map.rects                     # no rectangle crosses a tile boundary
            assert bool(((r[:, 0] // n) == ((r[:, 1] - 1) // n)).all())
    # the mask digest is the same from the sparse map and from the dense one
    assert p.digests()["mask"] == M.digest(p.mask_mod, order=order, blocks=want, block_size=bs)


def test_block_kind_reserves_a_causal_code():
    assert int(BlockKind.CAUSAL) == 3
    assert [int(k) for k in BlockKind] == [0, 1, 2, 3]
    bm = M.classify(M.causal(), torch.arange(64), torch.arange(64), block_size=8, sparse=True)
    assert int(BlockKind.CAUSAL) not in bm.codes.tolist()      # reserved, not produced yet


def test_dense_refuses_above_the_limit_and_names_the_ways_out():
    bm = M.classify(M.causal(), torch.arange(64), torch.arange(64), block_size=4, sparse=True)
    with pytest.raises(ValueError, match=r"16 x 16 blocks exceeds the limit of 100 blocks; "
                                         r"read it by tile \(plan.tile_blocks\(i, j\)\)"):
        bm.dense(limit=100)
    assert bm.dense(rows=(0, 4), cols=(0, 4), limit=100).tolist() == \
        [[1, 0, 0, 0], [2, 1, 0, 0], [2, 2, 1, 0], [2, 2, 2, 1]]


def test_plain_callables_warn_once_above_the_dense_budget(monkeypatch):
    monkeypatch.setattr(M, "WARN_DENSE_PAIRS", 1000)
    monkeypatch.setattr(M._classify, "_WARNED_DENSE", set())

    def lookup(b, h, q_idx, kv_idx):
        return (q_idx * 7 + kv_idx) % 5 != 0
    pos = torch.arange(64)
    with pytest.warns(UserWarning, match=r"mask lookup is evaluated densely on 4.1e\+03 token "
                                         r"pairs \(O\(S\^2\).*fringe.masks.causal"):
        got = M.classify(lookup, pos, pos, block_size=8)
    assert torch.equal(got, oracle(lookup, pos, pos, 8))
    with warnings.catch_warnings():
        warnings.simplefilter("error")                  # once per mask name
        M.classify(lookup, pos, pos, block_size=8)
        # structured masks evaluate only the blocks they cannot decide: no warning
        M.classify(M.causal() & M.document(torch.arange(64) // 10), pos, pos, block_size=8)


def test_million_token_plan_holds_no_dense_map():
    """S = 2^20 tokens, 1,000 packed documents, causal & document, zigzag on 8 ranks: the plan
    keeps ~1 MB of rectangles instead of the 64 MiB dense map, which it never builds."""
    S, P, bs = 1 << 20, 8, 128
    mask = M.causal() & M.document(packed_docs(S, 1000, seed=0))
    p = fringe.plan(schedules.zigzag(), mask, seq_len=S, world_size=P, block_size=bs)
    nb = S // bs
    assert p.block_map.shape == (nb, nb)
    assert p.block_map.nbytes < 4 << 20                       # dense: nb^2 = 64 MiB
    assert len(p.block_map) < 100_000
    with pytest.raises(ValueError, match="exceeds the limit"):
        p.blocks
    # spot-check two block rows of the diagonal tile of rank 3 against the dense mask
    n = p.local_len // bs
    q = p.positions(3)[100 * bs:102 * bs]
    want = oracle(mask, q, p.positions(3), bs)
    assert torch.equal(p.tile_blocks(3, 3)[100:102], want)
    assert int(p.tiles[0, 7]) == int(BlockKind.EMPTY)           # no document spans them
    assert torch.equal(p.block_map.dense(rows=(3 * n + 100, 3 * n + 102),
                                         cols=(3 * n, 4 * n)), want)


def test_from_dense_rejects_what_is_not_a_map_of_codes():
    with pytest.raises(ValueError, match=r"2-D integer tensor of BlockKind codes"):
        BlockMap.from_dense(torch.zeros(4))
    with pytest.raises(ValueError, match=r"BlockKind codes only \(0 EMPTY, 1 PARTIAL, 2 FULL\)"):
        BlockMap.from_dense(torch.full((2, 2), 3, dtype=torch.int8))
    assert len(BlockMap.from_dense(torch.zeros(3, 5, dtype=torch.int8))) == 0


def test_balanced_plan_never_densifies_the_block_map(monkeypatch):
    """The balanced layout is chosen from the rectangles: no dense map, not even of the
    natural order (S = 2^18, 250 packed documents, block 64: 4096^2 blocks dense; the same
    code plans S = 2^20 in about a second, see ``fringe.bench.bench_plan``)."""
    S, P, bs = 1 << 18, 8, 64
    mask = M.causal() & M.document(packed_docs(S, 250, seed=0))

    def refuse(*args, **kwargs):
        raise AssertionError("densified a block map")
    monkeypatch.setattr(BlockMap, "dense", refuse)
    monkeypatch.setattr(BlockMap, "from_dense", staticmethod(refuse))
    p = fringe.plan(schedules.balanced(), mask, seq_len=S, world_size=P, block_size=bs)
    assert p.layout.kind == "balanced" and p.block_map.shape == (S // bs, S // bs)
    assert p.stats().balance < 1.1
