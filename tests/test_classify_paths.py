"""Classification shortcuts give the dense reference's block map, bit for bit.

Two shortcuts are checked here: an AND of reflexive masks (true on every pair (p, p)) is
PARTIAL on a block pair that shares a position when an operand is certainly PARTIAL (no
dense evaluation of the diagonal blocks of ``causal & document``), and block summaries skip
the per-block sort when the positions already increase within each block.
"""
from __future__ import annotations

import random

import pytest
import torch

import fringe
from fringe import masks as M
from fringe import schedules
from fringe.testing import packed_docs
from fringe.masks import BlockKind
from fringe.masks._mask import _leaf
from fringe.masks._rules import _Band, _Blocks


def oracle(mask, q_pos, kv_pos, bs):
    zero = torch.tensor(0)
    dense = mask(zero, zero, q_pos[:, None], kv_pos[None, :]).expand(q_pos.numel(),
                                                                     kv_pos.numel())
    lq, lk = dense.shape
    d = dense.reshape(lq // bs, bs, lk // bs, bs).transpose(1, 2).reshape(lq // bs, lk // bs, -1)
    return torch.where(d.all(-1), int(BlockKind.FULL),
                       torch.where(d.any(-1), int(BlockKind.PARTIAL),
                                   int(BlockKind.EMPTY))).to(torch.int8)


def strictly_causal() -> M.Mask:
    """``q_idx > kv_idx``: a band without offset 0, so not reflexive."""
    def strict_mod(b, h, q_idx, kv_idx):
        return q_idx > kv_idx
    return _leaf(strict_mod, "strictly_causal", _Band(1, None))


def random_reflexive(S: int, rng: random.Random, ids: torch.Tensor, depth: int = 2) -> M.Mask:
    """An AND / OR tree whose leaves are mostly reflexive (and sometimes not)."""
    if depth and rng.random() < 0.7:
        a = random_reflexive(S, rng, ids, depth - 1)
        b = random_reflexive(S, rng, ids, depth - 1)
        return a & b if rng.random() < 0.7 else a | b
    k = rng.randrange(7)
    if k == 0:
        return M.causal()
    if k == 1:
        return M.sliding_window(rng.randint(1, S), causal=rng.random() < 0.5)
    if k in (2, 3):
        return M.document(ids)
    if k == 4:
        return M.prefix_lm(rng.randint(0, S))
    if k == 5:
        return strictly_causal()
    return M.as_mask(lambda b, h, q, kv: (q + kv) % 3 != 0, name="sum%3")   # not reflexive


def layout_positions(kind: str, S: int, bs: int, g: torch.Generator) -> torch.Tensor:
    if kind == "sequence":
        return torch.arange(S)
    if kind == "reversed blocks":          # each block decreasing: the sorting path
        return torch.arange(S).view(-1, bs).flip(1).reshape(-1)
    if kind == "random":
        return torch.randperm(S, generator=g)
    P = 4
    return schedules.get(kind).make_layout(S, P, block_size=bs).order


@pytest.mark.parametrize("kind", ["sequence", "zigzag", "striped", "reversed blocks", "random"])
def test_reflexive_and_shortcut_matches_the_dense_blocks(kind):
    for seed in range(24):
        rng = random.Random(seed)
        g = torch.Generator().manual_seed(seed)
        bs = rng.choice([1, 2, 3, 4])
        S = 8 * bs * rng.randint(1, 3)
        ids = torch.sort(torch.randint(0, max(2, S // 3), (S,), generator=g)).values
        mask = random_reflexive(S, rng, ids)
        pos = layout_positions(kind, S, bs, g)
        want = oracle(mask, pos, pos, bs)
        for kv_pos in (pos, pos.clone()):          # one tensor, and an equal copy
            got = M.classify(mask, pos, kv_pos, block_size=bs)
            assert torch.equal(got, want), (seed, kind, mask)


def test_strictly_causal_and_document_is_not_taken_for_reflexive():
    """Boundaries between the two positions of each diagonal block: strictly causal pairs
    there cross documents, so those blocks are EMPTY (a reflexive mask's would be PARTIAL)."""
    S, bs = 32, 2
    ids = (torch.arange(S) + 1) // 2                 # documents {0}, {1, 2}, {3, 4}, ...
    pos = torch.arange(S)
    for mask in (strictly_causal() & M.document(ids), M.document(ids) & strictly_causal()):
        got = M.classify(mask, pos, pos, block_size=bs)
        want = oracle(mask, pos, pos, bs)
        assert torch.equal(got, want)
        assert bool((got.diagonal() == int(BlockKind.EMPTY)).all())
    got = M.classify(M.causal() & M.document(ids), pos, pos, block_size=bs)
    assert bool((got.diagonal() == int(BlockKind.PARTIAL)).all())


@pytest.mark.parametrize("name", ["ring", "zigzag", "striped"])
def test_causal_document_plans_evaluate_no_block_densely(name):
    """Packed documents: every block the summaries leave open is a diagonal block holding a
    boundary, which the reflexive rule decides; the plan's map is still the dense one."""
    S, P, bs = 2048, 4, 16
    ids = packed_docs(S, 40, seed=5)
    mask = M.causal() & M.document(ids)
    stats = {}
    M.classify(mask, torch.arange(S), torch.arange(S), block_size=bs, stats=stats)
    assert stats["dense_blocks"] == 0
    boundary = (ids.view(-1, bs)[:, 0] != ids.view(-1, bs)[:, -1]).sum()
    assert int(boundary) > 10                       # the shortcut had blocks to decide
    p = fringe.plan(schedules.get(name), mask, seq_len=S, world_size=P, block_size=bs)
    order = p.layout.order
    assert torch.equal(p.blocks, oracle(mask, order, order, bs))


def test_block_summaries_agree_with_and_without_the_sort():
    g = torch.Generator().manual_seed(11)
    for bs in (1, 2, 5, 8):
        base = torch.randperm(40 * bs, generator=g).view(-1, bs).sort(dim=1).values
        pos = torch.cat([base[:20], torch.arange(20 * bs).view(-1, bs) * 3]).reshape(-1)
        a = _Blocks.of(pos, bs)                         # rows increasing: no sort
        b = _Blocks.of(pos.view(-1, bs).flip(1).reshape(-1), bs)       # rows decreasing
        for x, y in ((a.lo, b.lo), (a.hi, b.hi), (a.stride, b.stride)):
            assert torch.equal(x, y)
        assert bool((a.stride[20:] == (3 if bs > 1 else 1)).all())
