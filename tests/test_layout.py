"""Layouts: permutations of S global positions into P equal shards."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st

from fringe import layout


def make(kind: str, S: int, P: int, bs: int, seed: int):
    if kind == "contiguous":
        return layout.contiguous(S, P, block_size=bs)
    if kind == "zigzag":
        return layout.zigzag(S, P, block_size=bs)
    if kind == "striped":
        return layout.striped(S, P, stripe=bs, block_size=bs)
    g = torch.Generator().manual_seed(seed)
    return layout.from_order(torch.randperm(S, generator=g), P, block_size=bs)


layouts = st.tuples(st.sampled_from(["contiguous", "zigzag", "striped", "random"]),
                    st.integers(1, 8), st.sampled_from([1, 2, 4]), st.integers(1, 3),
                    st.integers(0, 2**16))


@settings(deadline=None)
@given(layouts)
def test_unshard_inverts_shard_and_positions_partition_the_sequence(args):
    kind, P, bs, m, seed = args
    S = 2 * P * bs * m
    lay = make(kind, S, P, bs, seed)
    x = torch.randn(2, 3, S, 5, generator=torch.Generator().manual_seed(seed))
    shards = [lay.shard(x, r) for r in range(P)]
    assert all(s.shape == (2, 3, S // P, 5) for s in shards)
    assert torch.equal(lay.unshard(shards), x)
    allpos = torch.cat([lay.positions(r) for r in range(P)])
    assert torch.equal(allpos.sort().values, torch.arange(S))
    for r in range(P):         # shard is "take my positions"
        assert torch.equal(shards[r], x[:, :, lay.positions(r)])
    assert torch.equal(lay.owner()[lay.positions(P - 1)], torch.full((S // P,), P - 1))


def test_shard_along_another_dim():
    lay = layout.zigzag(16, 2, block_size=2)
    x = torch.arange(16 * 3).view(16, 3)
    assert torch.equal(lay.unshard([lay.shard(x, r, dim=0) for r in range(2)], dim=0), x)


def test_zigzag_p2_s8():
    lay = layout.zigzag(8, 2, block_size=2)
    assert lay.positions(0).tolist() == [0, 1, 6, 7]
    assert lay.positions(1).tolist() == [2, 3, 4, 5]


def test_striped_round_robin():
    lay = layout.striped(12, 3, stripe=2, block_size=2)
    assert lay.positions(0).tolist() == [0, 1, 6, 7]
    assert lay.positions(2).tolist() == [4, 5, 10, 11]


@pytest.mark.parametrize("make_layout,match", [
    (lambda: layout.zigzag(1000, 4, block_size=64),
     r"S=1000 is not divisible by 2\*P\*block=2\*4\*64=512; pad the sequence to 1024"),
    (lambda: layout.contiguous(100, 3, block_size=8),
     r"S=100 is not divisible by P\*block=3\*8=24; pad the sequence to 120"),
    (lambda: layout.striped(30, 4, stripe=4, block_size=4),
     r"S=30 is not divisible by stripe\*P=4\*4=16; pad the sequence to 32"),
    (lambda: layout.contiguous(64, 0), r"world_size must be >= 1"),
    (lambda: layout.striped(64, 2, block_size=0), r"block_size must be >= 1, got 0"),
    (lambda: layout.from_order(torch.arange(8), 2, block_size=0), r"block_size must be >= 1"),
    (lambda: layout.zigzag(16, 2.0, block_size=2), r"world_size must be an int >= 1, got 2.0"),
    (lambda: layout.from_order(torch.tensor([0, 0, 1, 2]), 2, block_size=1),
     r"permutation of range\(4\)"),
])
def test_bad_sizes_name_the_numbers_and_the_fix(make_layout, match):
    with pytest.raises(ValueError, match=match):
        make_layout()


def test_wrong_length_tensor_is_rejected():
    lay = layout.contiguous(16, 2, block_size=2)
    with pytest.raises(ValueError, match=r"tensor has 8 tokens along dim -2, but the layout is "
                                         r"for S=16"):
        lay.shard(torch.zeros(1, 1, 8, 4), 0)
    with pytest.raises(ValueError, match=r"rank must be in \[0, 2\), got 2"):
        lay.positions(2)


def test_fingerprint_is_equal_for_equal_layouts_only():
    a, b = layout.zigzag(32, 2, block_size=2), layout.zigzag(32, 2, block_size=2)
    assert a.fingerprint() == b.fingerprint()
    assert a.fingerprint() != layout.contiguous(32, 2, block_size=2).fingerprint()


def test_balanced_deals_blocks_evenly_by_work():
    work = torch.tensor([9.0, 8, 7, 6, 1, 1, 0, 0])           # 8 blocks of 2 tokens, P = 2
    lay = layout.balanced(16, 2, block_size=2, block_work=work)
    blocks = [sorted({int(p) // 2 for p in lay.positions(r)}) for r in range(2)]
    assert sorted(len(b) for b in blocks) == [4, 4]
    loads = sorted(float(work[b].sum()) for b in blocks)
    assert loads == [16.0, 16.0]                 # contiguous halves would be 30 / 2

    assert all(torch.equal(lay.positions(r), lay.positions(r).sort().values) for r in range(2))
    with pytest.raises(ValueError, match="block_work has 3 entries; expected S/block_size=8"):
        layout.balanced(16, 2, block_size=2, block_work=work[:3])


def test_layout_package_docstring_runs_and_the_primitives_do_not_import_the_solver():
    """fringe.layout is a curated facade: its docstring example runs, every name in __all__
    is there, and the primitives module (Layout, contiguous, zigzag, ...) does not import the
    balanced solver (the solver sits on top of the primitives, not the other way round)."""
    import ast
    import doctest
    import pathlib

    from fringe.layout import _layout
    result = doctest.testmod(layout)
    assert result.attempted >= 2 and result.failed == 0
    assert all(hasattr(layout, name) for name in layout.__all__)
    tree = ast.parse(pathlib.Path(_layout.__file__).read_text())
    imported = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert not any(m and "_balanced" in m for m in imported), imported


@pytest.mark.parametrize("order, err, match", [
    # a negative entry indexes from the end: [-1, 1, 2, 0] passed as a permutation of range(4)
    # and rank 0 then held position -1 (RoPE, the mask and shard all read it)
    (torch.tensor([-1, 1, 2, 0]), ValueError, r"permutation of range\(4\), but it holds -1"),
    (torch.tensor([0, 1, 2, 7]), ValueError, r"holds 7, outside \[0, 4\)"),
    (torch.tensor([0, 0, 1, 2]), ValueError, r"position 0 appears 2 times and position 3 not"),
    # a bool tensor is a boolean index: all True passed, and the order became [1, 1, 1, 1]
    (torch.ones(4, dtype=torch.bool), TypeError, r"integer tensor .* got dtype torch.bool"),
    (torch.tensor([0.5, 1.0, 2.0, 3.0]), TypeError, r"got dtype torch.float32"),   # not truncated
])
def test_an_order_that_is_not_a_permutation_is_refused(order, err, match):
    with pytest.raises(err, match=match):
        layout.Layout("custom", order, 2)
    if order.dtype != torch.bool:
        with pytest.raises(err, match=match):
            layout.from_order(order, 2, block_size=1)
    assert layout.from_order([3, 2, 1, 0], 2, block_size=1).positions(0).tolist() == [3, 2]


def test_unshard_refuses_shards_of_the_wrong_length_even_when_the_total_is_right():
    lay = layout.zigzag(16, 2, block_size=2)
    x = torch.arange(16.0).view(1, 16, 1)
    s0, s1 = lay.shard(x, 0, dim=1), lay.shard(x, 1, dim=1)
    bad = [s0[:, :7], torch.cat([s0[:, 7:], s1], dim=1)]          # 7 + 9 = 16 tokens
    with pytest.raises(ValueError, match=r"shard 0 has 7 tokens along dim 1, but every rank "
                                         r"holds L=S/P=8"):
        lay.unshard(bad, dim=1)
    assert torch.equal(lay.unshard([s0, s1], dim=1), x)


def test_striped_with_its_own_stripe_takes_the_padded_length_it_is_told_about():
    """``padded_len`` promises a length the layouts accept; a stripe that is not the block
    size needs whole stripes too (``stripe=``), and the striped error names a length that
    both of its conditions accept (S=112 was told "pad to 114", then refused again)."""
    import fringe
    from fringe import schedules
    from fringe.hf import _padded_len
    with pytest.raises(ValueError, match=r"S=112 is not divisible by lcm\(stripe\*P, P\*block\)="
                                         r"lcm\(3\*2, 2\*4\)=24; pad the sequence to 120"):
        layout.striped(112, 2, stripe=3, block_size=4)
    layout.striped(120, 2, stripe=3, block_size=4)
    for P in (2, 3, 4, 5):
        for bs, stripe in ((4, 3), (2, 5), (4, 6), (4, None)):
            S = fringe.padded_len(100, P, block_size=bs, stripe=stripe)
            for make in (layout.contiguous, layout.zigzag, layout.striped):
                make(S, P, block_size=bs)
            lay = layout.striped(S, P, stripe=stripe or bs, block_size=bs)
            assert torch.equal(torch.cat([lay.positions(r) for r in range(P)]).sort().values,
                               torch.arange(S))
            sched = schedules.striped(stripe)       # fringe.hf.plans pads to a length it takes
            n = _padded_len(sched, 100, P, None, {"block_size": bs})
            assert n in (100, S)
            sched.make_layout(n, P, block_size=bs)
    for spec in ("compose:striped:5+ring:2", "compose:ring+striped:3:2"):   # every part's stripe
        sched = schedules.get(spec)
        n = _padded_len(sched, 100, 4, None, {"block_size": 2})
        assert n in (160, 144)
        sched.make_layout(n, 4, block_size=2)


def test_a_plan_refuses_a_layout_edited_in_place_before_it_was_planned():
    """An edit before planning was recorded as the plan's state (its guard reads the version
    then), so the plan classified a non-permutation and failed only inside the run."""
    import fringe
    from fringe import masks, schedules
    lay = layout.zigzag(16, 2, block_size=2)
    lay.order[0] = 5                                     # position 5 twice, 0 nowhere
    with pytest.raises(ValueError, match=r"edited in place after the layout was built"):
        fringe.plan(schedules.ring(), masks.causal(), seq_len=16, world_size=2, block_size=2,
                    layout=lay)


def test_a_layout_edited_in_place_cannot_be_copied_into_a_fresh_one():
    """deepcopy / pickle recorded the copy's version anew, so an edited layout (or a plan over
    it) came out looking unedited: a plan copied after a swap ran on its old classification
    with the new order (error 1.7 against dense, no exception)."""
    import copy
    import pickle

    import fringe
    from fringe import masks, schedules
    lay = layout.zigzag(16, 2, block_size=2)
    copy.deepcopy(lay).positions(0)                              # an unedited one copies
    p = fringe.plan(schedules.ring(), masks.causal(), seq_len=16, world_size=2, block_size=2)
    o = p.layout.order
    a, b = int(o[0]), int(o[15])
    o[0], o[15] = b, a                                           # still a permutation
    for make_copy in (copy.deepcopy, lambda x: pickle.loads(pickle.dumps(x))):
        with pytest.raises(ValueError, match=r"edited in place after the layout was built"):
            make_copy(p.layout)
    with pytest.raises(ValueError, match=r"edited in place after the (plan|layout) was built"):
        copy.deepcopy(p)                     # (the plan's own check names it first)
