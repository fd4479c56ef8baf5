"""fringe.plan accepts a FlexAttention BlockMask where it accepts a mask_mod.

A BlockMask from ``create_block_mask`` is taken as its ``mask_mod``: the plan equals the one
made from that mask_mod (same digests) and matches dense attention in float64 on the virtual
mesh. Its sequence lengths, B and H are checked; a block size other than the plan's is
re-blocked with a warning; a BlockMask without a mask_mod is its block tables.
"""
from __future__ import annotations

import warnings

import pytest
import torch
from torch.nn.attention.flex_attention import BlockMask, create_block_mask

import fringe
from fringe import masks, packing, schedules, simulate
from fringe.ops import reference
from fringe.testing import make_qkv, tolerances

S, P, BS = 128, 4, 16


def _every_third(b, h, q_idx, kv_idx):         # a plain callable: classified densely
    return (q_idx >= kv_idx) & ((q_idx - kv_idx) % 3 == 0)


def _head_window(b, h, q_idx, kv_idx):          # reads h: head h sees a window of 8 * (h + 1)
    d = q_idx - kv_idx
    return (d >= 0) & (d < 8 * (h + 1))


MASKS = {
    "causal": lambda: masks.causal(),
    "window&document": lambda: masks.sliding_window(20) & masks.document(
        torch.arange(S) // 50),
    "row_documents&causal": lambda: packing.document_mask(
        torch.stack([torch.arange(S) // 40, torch.arange(S) // 70])) & masks.causal(),
    "plain": lambda: _every_third,
}
BATCH = {"row_documents&causal": 2}       # a [B, S] document mask reads b


def _block_mask(m, B=None, H=None, *, seq_len=S, block=BS):
    return create_block_mask(m, B, H, seq_len, seq_len, device="cpu", BLOCK_SIZE=block)


def _dense_check(p, mask_mod, *, B=1, H=2, G=1, seed=0):
    q, k, v = make_qkv(B=B, H=H, G=G, S=S, D=8, seed=seed, requires_grad=True)
    got = simulate.attention(q, k, v, plan=p)
    want, _ = reference.attention(q, k, v, mask_mod=mask_mod)
    torch.testing.assert_close(got, want, **tolerances(torch.float64))
    dout = torch.randn(got.shape, generator=torch.Generator().manual_seed(seed + 1),
                       dtype=torch.float64)
    g_got = torch.autograd.grad(got, (q, k, v), dout)
    g_want = torch.autograd.grad(want, (q, k, v), dout)
    for a, b in zip(g_got, g_want):
        torch.testing.assert_close(a, b, **tolerances(torch.float64))


@pytest.mark.parametrize("name", sorted(MASKS))
@pytest.mark.parametrize("schedule", [schedules.ring(), schedules.zigzag()], ids=str)
def test_block_mask_plans_as_its_mask_mod(name, schedule):
    m = MASKS[name]()
    B = BATCH.get(name)
    bm = _block_mask(m, B)
    with warnings.catch_warnings():
        warnings.simplefilter("error")          # same block size: nothing to say
        p = fringe.plan(schedule, bm, seq_len=S, world_size=P, block_size=BS)
    q = fringe.plan(schedule, m, seq_len=S, world_size=P, block_size=BS, batch_size=B)
    assert p.digests() == q.digests()
    assert p.fingerprint() == q.fingerprint()
    assert p.batch_size == q.batch_size and p.num_heads == q.num_heads
    _dense_check(p, m, B=B or 1)


def test_block_mask_seq_len_mismatch_raises():
    bm = _block_mask(masks.causal(), seq_len=96)
    with pytest.raises(ValueError, match=r"Q_LEN=96, KV_LEN=96 but seq_len=128.*"
                                         r"create_block_mask\(mask_mod, B, H, 128, 128"):
        fringe.plan(schedules.zigzag(), bm, seq_len=S, world_size=P, block_size=BS)
    cross = create_block_mask(masks.causal(), None, None, S, 2 * S, device="cpu",
                              BLOCK_SIZE=BS)
    with pytest.raises(ValueError, match="KV_LEN=256 but seq_len=128"):
        fringe.plan(schedules.zigzag(), cross, seq_len=S, world_size=P, block_size=BS)


@pytest.mark.parametrize("block", [8, 32, (16, 32)], ids=str)
def test_other_block_size_is_reblocked_with_a_warning(block):
    """The plan's block_size decides; the mask_mod is classified at it, exactly."""
    m = masks.sliding_window(20) & masks.document(torch.arange(S) // 50)
    bm = create_block_mask(m, None, None, S, S, device="cpu", BLOCK_SIZE=block)
    with pytest.warns(UserWarning, match=r"BLOCK_SIZE=\(\d+, \d+\) but the plan's "
                                         r"block_size=16, so fringe re-blocked it"):
        p = fringe.plan(schedules.zigzag(), bm, seq_len=S, world_size=P, block_size=BS)
    q = fringe.plan(schedules.zigzag(), m, seq_len=S, world_size=P, block_size=BS)
    assert p.block_size == BS
    assert p.digests() == q.digests()
    _dense_check(p, m, seed=3)


def test_block_mask_batch_and_heads():
    """B / H above 1 are recorded and checked; B=None / H=None broadcast (nothing recorded)."""
    bm = _block_mask(_head_window, 2, 4)
    p = fringe.plan(schedules.zigzag(), bm, seq_len=S, world_size=P, block_size=BS)
    assert (p.batch_size, p.num_heads) == (2, 4)
    q = fringe.plan(schedules.zigzag(), _head_window, seq_len=S, world_size=P, block_size=BS,
                    batch_size=2, num_heads=4)
    assert p.digests() == q.digests()
    _dense_check(p, _head_window, B=2, H=4, G=2, seed=5)
    with pytest.raises(ValueError, match=r"built for H=4 but num_heads=8; pass num_heads=4"):
        fringe.plan(schedules.zigzag(), bm, seq_len=S, world_size=P, block_size=BS, num_heads=8)
    with pytest.raises(ValueError, match=r"built for B=2 but batch_size=3; pass batch_size=2"):
        fringe.plan(schedules.zigzag(), bm, seq_len=S, world_size=P, block_size=BS, batch_size=3)
    bcast = fringe.plan(schedules.zigzag(), _block_mask(masks.causal()), seq_len=S, world_size=P,
                        block_size=BS)
    assert (bcast.batch_size, bcast.num_heads) == (None, None)
    given = fringe.plan(schedules.zigzag(), _block_mask(masks.causal()), seq_len=S,
                        world_size=P, block_size=BS, batch_size=3)   # B=1 broadcasts to any
    assert given.batch_size == 3


def test_block_mask_without_mask_mod_is_its_block_tables():
    """``BlockMask.from_kv_blocks`` without a mask_mod (``noop_mask``): a pair is allowed iff
    its block is listed, as FlexAttention's fused kernels run it."""
    base = _block_mask(_every_third)
    tables = BlockMask.from_kv_blocks(base.kv_num_blocks, base.kv_indices, BLOCK_SIZE=BS)
    dense = tables.to_dense()[0, 0].bool()
    assert 0 < int(dense.sum()) < dense.numel()
    tok = dense.repeat_interleave(BS, 0).repeat_interleave(BS, 1)

    def from_tables(b, h, q_idx, kv_idx):
        return tok[q_idx, kv_idx]
    for schedule in (schedules.ring(), schedules.zigzag()):
        p = fringe.plan(schedule, tables, seq_len=S, world_size=P, block_size=BS)
        assert (p.batch_size, p.num_heads) == (None, None)
        assert int((p.blocks == masks.BlockKind.FULL).sum()) == int(dense.sum())
        _dense_check(p, from_tables, seed=7)
    with pytest.warns(UserWarning, match="its block tables"):   # re-blocked at token level
        p = fringe.plan(schedules.ring(), tables, seq_len=S, world_size=P, block_size=32)
    _dense_check(p, from_tables, seed=9)
    every = BlockMask.from_kv_blocks(torch.full((1, 1, S // BS), S // BS, dtype=torch.int32),
                                     torch.arange(S // BS, dtype=torch.int32).expand(
                                         1, 1, S // BS, S // BS).contiguous(), BLOCK_SIZE=BS)
    full = fringe.plan(schedules.zigzag(), every, seq_len=S, world_size=P, block_size=BS)
    assert full.digests() == fringe.plan(schedules.zigzag(), None, seq_len=S, world_size=P,
                                         block_size=BS).digests()


def test_not_a_mask_names_block_mask():
    with pytest.raises(TypeError, match="or a FlexAttention BlockMask, got int"):
        fringe.plan(schedules.zigzag(), 3, seq_len=S, world_size=P, block_size=BS)
