"""One answer to "does this mask or score_mod read b / h" (issue 19): ``masks.reads_bh``.

Before it, four paths answered, with two defaults: ``masks.reads_batch_head`` (and the
classification and digest behind it) said "no" when its probe could not call a mask on
broadcast b / h, the score_mod probe in ``plan`` said "yes" when it could not tell but "no" for
a b it only saw reduced, and the tile ops (``ops.reference.mask_for``, the runtime's head
shift) trusted any truthy ``bh_invariant`` attribute. Each case below is one where the old
answers disagreed and a result was silently wrong (measured on 5273fd8: off by 1.43, 2.55,
2.89 in float64); each is now float64-exact against dense attention on the virtual mesh.
"""
from __future__ import annotations

import warnings

import pytest
import torch
from torch.testing import assert_close

import fringe
from fringe import masks, packing, schedules, simulate
from fringe.ops import reference
from fringe.testing import make_qkv, tolerances

TOL = tolerances(torch.float64)
S, BS = 32, 4

#: one batch row, a causal window per head (2 .. 9)
WIN = torch.tensor([[2, 3, 4, 5, 6, 7, 8, 9]])


def head_windows(b, h, q_idx, kv_idx):
    """Elementwise (broadcast), but its table has one row: the probe's ``b = 1`` fails."""
    return (kv_idx <= q_idx) & (q_idx - kv_idx < WIN[b, h])


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")    # the "evaluated per scalar index" notices
        yield


def _exact(mask_mod, plan, *, B: int, H: int, seed: int = 0) -> None:
    """out, lse and dq, dk, dv of ``plan`` on the virtual mesh equal dense attention over
    FlexAttention's mask (per scalar index, every b < B, h < H)."""
    q, k, v = make_qkv(B=B, H=H, G=1, S=S, D=4, seed=seed, requires_grad=True)
    pos = torch.arange(S)
    truth = masks.evaluate(mask_mod, pos, pos, B=B, H=H, method="vmap")
    assert not torch.equal(truth, truth[:1, :1].expand_as(truth))      # it does read b or h
    ref, ref_lse = reference.attention(q, k, v, mask_mod=lambda b, h, qi, ki: truth[b, h, qi, ki])
    out, lse = simulate.attention(q, k, v, plan=plan, return_lse=True)
    assert_close(out, ref, **TOL)
    assert_close(lse, ref_lse, **TOL)
    dout = torch.randn(ref.shape, generator=torch.Generator().manual_seed(seed + 1),
                       dtype=torch.float64)
    for got, want in zip(torch.autograd.grad(out, (q, k, v), dout),
                         torch.autograd.grad(ref, (q, k, v), dout)):
        assert_close(got, want, **TOL)


def _refused(mask_mod) -> None:
    with pytest.raises(ValueError, match=r"(?s)cannot be proven to ignore b and h.*num_heads=.*"
                                         r"batch_size=.*as_mask\(fn, bh_invariant=True\)"):
        fringe.plan(schedules.zigzag(), mask_mod, seq_len=S, world_size=2, block_size=BS)


# ------------------------------------------------- masks.reads_batch_head / classify / digest


def test_a_mask_the_probe_cannot_call_reads_both():
    # old: the probe's b = 1 raised, reported as "reads neither, proven": planned for b = h = 0
    assert masks.reads_batch_head(head_windows, seq_len=S) == (True, True)
    assert masks.reads_bh(head_windows, seq_len=S).unproven == ("head_windows",)
    _refused(head_windows)
    p = fringe.plan(schedules.zigzag(), head_windows, seq_len=S, world_size=2, block_size=BS,
                    batch_size=1, num_heads=8)
    assert (p.batch_size, p.num_heads) == (1, 8)
    _exact(head_windows, p, B=1, H=8)


def test_the_digest_of_a_mask_the_probe_cannot_call_covers_every_head():
    # old: hashed for h = 0 only, so ranks whose head 5 differs agreed
    other = WIN.clone()
    other[0, 5] += 1

    def head_windows_2(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (q_idx - kv_idx < other[b, h])

    order = torch.arange(S)
    blocks = masks.classify(head_windows, order, order, block_size=BS, B=1, H=8, sparse=True)
    kw = dict(order=order, blocks=blocks, block_size=BS, B=1, H=8)
    assert masks.digest(head_windows, **kw) == masks.digest(head_windows, **kw)
    assert masks.digest(head_windows, **kw) != masks.digest(head_windows_2, **kw)


# ------------------------------------------------------------------- packing.pad_mask


def test_pad_mask_keeps_the_declaration_and_the_answer_stays_reads_both():
    # old: pad_mask probed with reads_batch_head ("reads neither") and wrapped the result
    padded = packing.pad_mask(head_windows, real_len=S - 6, padded_len=S)
    assert padded.bh_invariant is None                        # nothing declared, nothing made up
    assert masks.reads_batch_head(padded, seq_len=S) == (True, True)
    _refused(padded)
    p = fringe.plan(schedules.zigzag(), padded, seq_len=S, world_size=2, block_size=BS,
                    num_heads=8)
    _exact(padded, p, B=1, H=8, seed=2)


# ------------------------------------------------------------ plan's score_mod probe


def test_a_score_mod_reading_b_through_a_reduction_keeps_vmapped_slices_apart():
    # old: broadcast b.sum() has no b axis, so "does not read b": torch.func.vmap folded the
    # slices into the batch and slice i saw rows i*B + r (off by 2.55)
    def row_slope(score, b, h, q_idx, kv_idx):
        return score + 0.25 * b.sum() * (q_idx - kv_idx)     # per scalar index: b

    r = masks.reads_bh(row_slope, seq_len=S, score=True)
    assert (r.b, r.h, r.unproven) == (True, True, ("row_slope",))
    B, N = 2, 3
    p = fringe.plan(schedules.zigzag(), masks.causal(), seq_len=S, world_size=2, block_size=BS,
                    score_mod=row_slope)
    assert p.reads_batch
    qs, ks, vs = (torch.stack(t) for t in zip(*(make_qkv(B=B, H=2, G=1, S=S, D=4, seed=30 + i)
                                                 for i in range(N))))
    got = torch.func.vmap(lambda q, k, v: simulate.attention(q, k, v, plan=p))(qs, ks, vs)
    for i in range(N):
        want, _ = reference.attention(qs[i], ks[i], vs[i], mask_mod=masks.causal(),
                                      score_mod=row_slope)
        assert_close(got[i], want, **TOL)
    # a score_mod proven not to read b (ALiBi-style, per head) leaves the batch folded
    slopes = torch.tensor([0.5, 0.25])

    def alibi(score, b, h, q_idx, kv_idx):
        return score - slopes[h] * (q_idx - kv_idx)
    r = masks.reads_bh(alibi, seq_len=S, score=True)
    assert (r.b, r.h, r.unproven) == (False, True, ())


# ------------------------------------ the tile ops: ops.reference.mask_for, the head shift


@pytest.mark.parametrize("name", ["zigzag", "ulysses"])    # ulysses: each rank a head slice
def test_a_truthy_attribute_that_is_not_true_declares_nothing(name):
    # old: classification read bh_invariant = 1 as "not declared" (classified per head), the
    # tile ops as "invariant" (evaluated for h = 0, not shifted to the rank's heads): off by 2.89
    def heads_any(b, h, q_idx, kv_idx):
        return ((kv_idx <= q_idx) & (q_idx - kv_idx < 2 + h)).any()
    heads_any.bh_invariant = 1

    assert masks.declared_bh_invariant(heads_any) is None
    assert masks.reads_bh(heads_any, seq_len=S).h
    _refused(heads_any)
    p = fringe.plan(schedules.get(name), heads_any, seq_len=S, world_size=2, block_size=BS,
                    num_heads=8)
    _exact(heads_any, p, B=1, H=8, seed=4)
