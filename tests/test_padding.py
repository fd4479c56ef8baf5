"""Padding that attends to nothing: ``packing.real_tokens`` / ``pad_mask`` / ``pad_batch``.

A length that does not fit the layout is padded at the end; pad tokens attend to nothing and
nothing attends to them (FlexAttention's fully masked rows: out 0, lse -inf, gradients 0, no
NaN), their labels are ignored, and blocks wholly in the padding are EMPTY: never computed,
never communicated. Every check is float64 against the dense reference with the same mask.
"""
from __future__ import annotations

import pytest
import torch

import fringe
from fringe import layout, masks, packing, schedules
from fringe.ops import reference
from fringe.schedules.ir import Compute, Send, split_name
from fringe.testing import make_qkv, tolerances

IGN = packing.IGNORE_INDEX


def _dense(m, S: int, B: int = 1) -> masks.Mask:
    """The same mask as an unstructured callable (classified by evaluating every pair)."""
    return masks.as_mask(lambda b, h, q, kv: m(b, h, q, kv), name=f"dense({m.name})",
                         bh_invariant=getattr(m, "bh_invariant", True))


def _masks_over(S: int):
    doc = packing.doc_ids_from_cu_seqlens([0, 9, 20, S])
    rows = packing.doc_ids_from_cu_seqlens([torch.tensor([0, 9, 20, S]), torch.tensor([0, 3, S])])
    return {
        "causal&document": (masks.causal() & packing.document_mask(doc), None),
        "rows": (masks.causal() & packing.document_mask(rows), 2),
        "window": (masks.sliding_window(5, causal=False), None),
        "prefix": (masks.prefix_lm(6), None),
        "full": (None, None),
    }


@pytest.mark.parametrize("name", ["causal&document", "rows", "window", "prefix", "full"])
def test_padded_mask_classifies_exactly_and_padding_is_empty(name):
    S, Sp, bs = 27, 40, 4
    base, B = _masks_over(S)[name]
    m = packing.pad_mask(base, real_len=S, padded_len=Sp)
    assert packing.real_len_of(m) == S
    pos = torch.arange(Sp)
    allowed = masks.evaluate(m, pos, pos, B=B or 1).any(dim=(0, 1))        # [Sp, Sp]
    assert not allowed[S:].any() and not allowed[:, S:].any()               # attends to nothing
    if base is not None:                                                    # real tokens unchanged
        want = masks.evaluate(base, torch.arange(S), torch.arange(S), B=B or 1)
        assert torch.equal(masks.evaluate(m, pos, pos, B=B or 1)[..., :S, :S], want)
    lays = [layout.contiguous(Sp, 2, block_size=bs), layout.zigzag(Sp, 5, block_size=bs),
            layout.striped(Sp, 2, block_size=bs)]
    for order in [pos] + [lay.order for lay in lays]:
        got = masks.classify(m, order, order, block_size=bs, B=B)
        assert torch.equal(got, masks.classify(_dense(m, Sp), order, order, block_size=bs, B=B))
    st: dict = {}
    nat = masks.classify(m, pos, pos, block_size=bs, B=B, stats=st)
    first_pad = S // bs                                     # block 6 holds 24..27: 3 real, 1 pad
    assert (nat[first_pad + 1:] == masks.BlockKind.EMPTY).all()
    assert (nat[:, first_pad + 1:] == masks.BlockKind.EMPTY).all()
    if base is not None and name != "rows":                 # unpadded map in the top-left corner
        real = masks.classify(base, torch.arange(24), torch.arange(24), block_size=bs)
        assert torch.equal(nat[:first_pad, :first_pad], real)
    assert st["dense_blocks"] <= 2 * (Sp // bs) + (16 if name == "rows" else 0)   # no S^2 evaluation


@pytest.mark.parametrize("schedule, P, kernel", [("zigzag", 2, "reference"), ("zigzag", 2, "sdpa"),
                                                 ("ring", 4, "sdpa"), ("balanced", 4, "reference")])
def test_padded_attention_matches_dense_float64(schedule, P, kernel):
    S, B = 37, 2
    Sp = fringe.padded_len(S, P, block_size=4)
    assert Sp == (48 if P == 2 else 64)
    doc = packing.doc_ids_from_cu_seqlens([torch.tensor([0, 11, S]), torch.tensor([0, 30, S])])
    m = masks.causal() & packing.pad_mask(packing.document_mask(doc), real_len=S, padded_len=Sp)
    plan = fringe.plan(getattr(schedules, schedule)(), m, seq_len=Sp, world_size=P, block_size=4,
                       batch_size=B, kernel=kernel)
    q, k, v = make_qkv(B=B, H=2, G=1, S=Sp, D=8, seed=21, requires_grad=True)
    out, lse = fringe.simulate.attention(q, k, v, plan=plan, return_lse=True)
    want, want_lse = reference.attention(q, k, v, mask_mod=m)
    tol = tolerances(torch.float64)
    torch.testing.assert_close(out, want, **tol)
    torch.testing.assert_close(lse, want_lse, **tol)
    assert (out[:, :, S:] == 0).all() and torch.isneginf(lse[:, :, S:]).all()   # attends to nothing
    # the real rows are those of the unpadded batch
    real, real_lse = reference.attention(q[:, :, :S], k[:, :, :S], v[:, :, :S],
                                         mask_mod=masks.causal() & packing.document_mask(doc[:, :S]))
    torch.testing.assert_close(out[:, :, :S], real, **tol)
    torch.testing.assert_close(lse[:, :, :S], real_lse, **tol)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(22), dtype=torch.float64)
    got = torch.autograd.grad(out, (q, k, v), dout)
    ref = torch.autograd.grad(want, (q, k, v), dout)
    for a, b in zip(got, ref):
        assert torch.isfinite(a).all()
        torch.testing.assert_close(a, b, **tol)
        assert (a[:, :, S:] == 0).all()                     # nothing flows to or from padding


def test_pad_blocks_are_empty_and_not_communicated():
    # ring over 4 ranks of 16 tokens: 40 real tokens, so rank 3 (48..63) holds only padding
    S, Sp, P, bs = 40, 64, 4, 8
    doc = packing.doc_ids_from_cu_seqlens([0, 13, S])
    m = masks.causal() & packing.pad_mask(packing.document_mask(doc), real_len=S, padded_len=Sp)
    plan = fringe.plan(schedules.ring(), m, seq_len=Sp, world_size=P, block_size=bs)
    counts = plan.tile_block_counts()
    assert (counts[3] == 0).all() and (counts[:, 3] == 0).all()
    assert int(counts.sum()) == int((masks.classify(masks.causal() & packing.document_mask(doc),
                                                    torch.arange(S), torch.arange(S), block_size=bs)
                                     != masks.BlockKind.EMPTY).sum())
    for progs in (plan.forward, plan.backward):
        for r, prog in enumerate(progs):
            for _, op in prog.ops():
                assert not (isinstance(op, Compute) and 3 in (op.q, op.kv)), (r, op)
                assert not (isinstance(op, Send) and split_name(op.buf)[1] == 3), (r, op)
    rows = plan.stats(batch=1, heads=1, head_dim=8).rows
    assert rows[3]["blocks"] == 0 and rows[3]["fwd_sent"] == rows[3]["bwd_sent"] == 0
    # the unpadded mask over the padded length (pads as a document of their own) computes more
    own_doc = fringe.plan(schedules.ring(), masks.causal() & packing.document_mask(
        packing.doc_ids_from_cu_seqlens([0, 13, S, Sp])), seq_len=Sp, world_size=P, block_size=bs)
    assert int(own_doc.tile_block_counts()[3].sum()) > 0


def test_pad_mask_of_a_plain_mask_mod_indexing_real_tokens():
    S, Sp = 13, 16
    bias = torch.arange(S) % 3                              # indexed by position: length S only

    def same_class(b, h, q, kv):
        return bias[q] == bias[kv]

    def by_row(b, h, q, kv):
        return (bias[q] + b) % 3 != bias[kv]

    # padded_len == real_len: nothing to pad, and a mask_mod that reads b still plans (B=2)
    m = packing.pad_mask(by_row, real_len=S, padded_len=S)
    assert not m.bh_invariant and packing.real_len_of(m) == S
    for fn, B in ((same_class, None), (by_row, 2)):
        m = packing.pad_mask(fn, real_len=S, padded_len=Sp)
        plan = fringe.plan(schedules.zigzag(), m, seq_len=Sp, world_size=2, block_size=4, batch_size=B)
        q, k, v = make_qkv(B=B or 1, H=1, G=1, S=Sp, D=4, seed=5)
        out, lse = fringe.simulate.attention(q, k, v, plan=plan, return_lse=True)
        want, want_lse = reference.attention(q[:, :, :S], k[:, :, :S], v[:, :, :S],
                                             mask_mod=masks.as_mask(fn, bh_invariant=B is None))
        torch.testing.assert_close(out[:, :, :S], want, **tolerances(torch.float64))
        torch.testing.assert_close(lse[:, :, :S], want_lse, **tolerances(torch.float64))
        assert (out[:, :, S:] == 0).all() and torch.isneginf(lse[:, :, S:]).all()


def test_pad_batch_then_shard_batch_counts_real_targets_only():
    S, B, P = 27, 2, 2
    g = torch.Generator().manual_seed(4)
    ids = torch.randint(0, 9, (B, S), generator=g)
    cus = [torch.tensor([0, 10, S]), torch.tensor([0, 3, 20, S])]
    Sp = fringe.padded_len(S, P, block_size=4)
    padded = packing.pad_batch(ids, ids, length=Sp, cu_seqlens=cus)
    assert padded["real_len"] == S and padded["input_ids"].shape == (B, Sp)
    assert (padded["labels"][:, S:] == IGN).all() and (padded["input_ids"][:, S:] == 0).all()
    doc_p = packing.doc_ids_from_cu_seqlens(padded["cu_seqlens"])
    assert bool((doc_p[:, S] != doc_p[:, S - 1]).all())                  # a document of its own
    m = masks.causal() & packing.document_mask(doc_p, real_len=S)
    plan = fringe.plan(schedules.zigzag(), m, seq_len=Sp, world_size=P, block_size=4, batch_size=B)
    shards = [packing.shard_batch(**padded, plan=plan, rank=r) for r in range(P)]
    want = packing.shift_labels(ids, packing.doc_ids_from_cu_seqlens(cus))
    got = plan.layout.unshard([s.shift_labels for s in shards], dim=1)
    assert torch.equal(got[:, :S], want) and (got[:, S:] == IGN).all()
    assert {s.num_items for s in shards} == {int((want != IGN).sum())} and shards[0].real_len == S
    # the loss helpers: the shares of the padded batch add up to the unpadded mean
    logits = torch.randn(B, Sp, 9, generator=g, dtype=torch.float64)
    shares = sum(packing.token_weighted_loss(plan.layout.shard(logits, r, dim=1), s.shift_labels,
                                             num_items=s.num_items) for r, s in enumerate(shards))
    mean = torch.nn.functional.cross_entropy(logits[:, :S].reshape(-1, 9).float(), want.reshape(-1))
    torch.testing.assert_close(shares, mean, **tolerances(torch.float32))
    # the same batch, unpadded, against plans made for padding it: shard_batch pads it itself
    auto = packing.shard_batch(ids, ids, plan=plan, rank=1, cu_seqlens=cus)
    assert torch.equal(auto.input_ids, shards[1].input_ids) and auto.real_len == S
    assert torch.equal(auto.shift_labels, shards[1].shift_labels)
    assert torch.equal(auto.position_ids, shards[1].position_ids)
    pos = packing.positions_in_document(packing.doc_ids_from_cu_seqlens(cus))
    by_pos = packing.shard_batch(ids, ids, plan=plan, rank=1, position_ids=pos)
    assert torch.equal(by_pos.shift_labels, shards[1].shift_labels)


def test_padding_errors_say_how_to_fix():
    S, Sp = 27, 32
    ids = torch.zeros(1, S, dtype=torch.long)
    padded = packing.pad_batch(ids, ids, multiple=16)
    assert padded["input_ids"].shape == (1, Sp) and padded["real_len"] == S
    doc_p = packing.doc_ids_from_cu_seqlens(padded["cu_seqlens"])
    # a plan whose mask lets the padding attend (pads as a plain document) is refused
    leaky = fringe.plan(schedules.zigzag(), masks.causal() & packing.document_mask(doc_p),
                        seq_len=Sp, world_size=2, block_size=4)
    fix = r"has no real_tokens term.*pad_mask\(mask, real_len=27, padded_len=32\)"
    with pytest.raises(ValueError, match=fix):
        packing.shard_batch(**padded, plan=leaky, rank=0)
    with pytest.raises(ValueError, match=r"S=27 tokens per row but the plan's layout is for S=32.*pad_mask"):
        packing.shard_batch(ids, ids, plan=leaky, rank=0)
    other = fringe.plan(schedules.zigzag(), packing.pad_mask(None, real_len=20, padded_len=Sp),
                        seq_len=Sp, world_size=2, block_size=4)
    with pytest.raises(ValueError, match=r"real_tokens\(20\)"):
        packing.shard_batch(**padded, plan=other, rank=0)
    with pytest.raises(ValueError, match="exactly one"):
        packing.pad_batch(ids, multiple=16, length=32)
    with pytest.raises(ValueError, match="length must be an int >= S=27"):
        packing.pad_batch(ids, length=20)
    with pytest.raises(ValueError, match="real_tokens: n must be an int >= 1"):
        packing.real_tokens(0)
    with pytest.raises(ValueError, match="padded_len=20 < real_len=27"):
        packing.pad_mask(masks.causal(), real_len=S, padded_len=20)
    with pytest.raises(ValueError, match=r"real_len must be an int in \[1, S=32\]"):
        packing.document_mask(doc_p, real_len=40)
    with pytest.raises(TypeError, match="mask must be a mask_mod"):
        packing.pad_mask(3, real_len=S, padded_len=Sp)
    with pytest.raises(ValueError, match="has 20 document ids per row but real_len=27"):
        packing.pad_mask(packing.document_mask(torch.zeros(20, dtype=torch.long)), real_len=S, padded_len=Sp)
    # document ids already over the padded length are kept (the padding is removed all the same)
    kept = packing.pad_mask(packing.document_mask(doc_p[0]), real_len=S, padded_len=Sp)
    want = packing.document_mask(doc_p[0], real_len=S)
    pos = torch.arange(Sp)
    assert torch.equal(masks.evaluate(kept, pos, pos), masks.evaluate(want, pos, pos))
