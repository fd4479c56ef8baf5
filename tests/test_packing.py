"""fringe.packing: document ids from cu_seqlens / position_ids, per-row document masks, the
batch helper (labels shifted before sharding) and the token-weighted CP loss."""
from __future__ import annotations

import pytest
import torch

import fringe
from fringe import layout, masks, packing, schedules
from fringe.ops import reference
from fringe.testing import make_qkv, tolerances

IGN = packing.IGNORE_INDEX


def _dense_doc_mask(ids: torch.Tensor) -> torch.Tensor:
    ids = ids.view(-1, ids.shape[-1])
    return ids[:, :, None] == ids[:, None, :]                      # [B or 1, S, S]


def _random_cu(g: torch.Generator, S: int) -> torch.Tensor:
    cuts = torch.randperm(S - 1, generator=g)[:int(torch.randint(0, 6, (), generator=g))] + 1
    return torch.cat([torch.tensor([0]), cuts.sort().values, torch.tensor([S])])


# ---- document ids --------------------------------------------------------------------------


def test_cu_seqlens_and_position_ids_give_the_same_documents():
    g = torch.Generator().manual_seed(1)
    for _ in range(20):
        S = int(torch.randint(2, 40, (), generator=g))
        cu = _random_cu(g, S)
        ids = packing.doc_ids_from_cu_seqlens(cu)
        lengths = (cu[1:] - cu[:-1]).tolist()
        want = torch.cat([torch.full((n,), d) for d, n in enumerate(lengths)])
        assert torch.equal(ids, want)
        pos = torch.cat([torch.arange(n) for n in lengths])          # restart per document
        assert torch.equal(packing.positions_in_document(ids), pos)
        assert torch.equal(packing.doc_ids_from_position_ids(pos), ids)
        assert torch.equal(packing.doc_ids_from_position_ids(pos[None]), ids)
        # the mask equals the doc-id mask, densely
        got = masks.evaluate(packing.document_mask(ids), torch.arange(S), torch.arange(S))
        assert torch.equal(got[0, 0], _dense_doc_mask(ids)[0])


def test_position_ids_follow_transformers_packing_rule():
    # a new document wherever the step is not exactly +1 (also 5 -> 5 and a jump up)
    pos = torch.tensor([0, 1, 2, 0, 1, 1, 2, 7, 8, 0])
    assert packing.doc_ids_from_position_ids(pos).tolist() == [0, 0, 0, 1, 1, 2, 2, 3, 3, 4]
    from transformers.masking_utils import find_packed_sequence_indices
    assert torch.equal(packing.doc_ids_from_position_ids(pos), find_packed_sequence_indices(pos[None])[0])


def test_empty_documents_and_per_row_cu_seqlens():
    assert packing.doc_ids_from_cu_seqlens([0, 2, 2, 5]).tolist() == [0, 0, 2, 2, 2]
    rows = packing.doc_ids_from_cu_seqlens([torch.tensor([0, 3, 6]), torch.tensor([0, 1, 6])])
    assert rows.tolist() == [[0, 0, 0, 1, 1, 1], [0, 1, 1, 1, 1, 1]]
    assert torch.equal(packing.doc_ids_from_cu_seqlens(torch.tensor([[0, 3, 6], [0, 1, 6]])), rows)
    flat = packing.doc_ids_from_cu_seqlens(torch.tensor([0, 3, 6, 7, 12]), batch_size=2)
    assert flat.tolist() == [[0, 0, 0, 1, 1, 1], [0, 1, 1, 1, 1, 1]]
    pos_rows = packing.doc_ids_from_position_ids(torch.tensor([[0, 1, 2, 0, 1, 2], [0, 0, 1, 2, 3, 4]]))
    assert torch.equal(pos_rows, rows)


@pytest.mark.parametrize("cu, match", [
    ([1, 3, 8], "start at 0"),
    ([0, 5, 3, 8], "non-decreasing"),
    ([0, 3, 7], "end at the sequence length S=8"),
    ([[[0, 8]]], "1-D"),
    ([0.0, 8.0], "integers"),
])
def test_cu_seqlens_validation(cu, match):
    with pytest.raises(ValueError, match=match):
        packing.doc_ids_from_cu_seqlens(torch.tensor(cu), seq_len=8)


def test_cu_seqlens_document_across_rows_and_position_validation():
    with pytest.raises(ValueError, match="crosses from row 0 into row 1"):
        packing.doc_ids_from_cu_seqlens(torch.tensor([0, 4, 12]), batch_size=2)
    with pytest.raises(ValueError, match="not batch_size=2 rows"):
        packing.doc_ids_from_cu_seqlens(torch.tensor([0, 4, 11]), batch_size=2)
    with pytest.raises(ValueError, match=">= 0"):
        packing.doc_ids_from_position_ids(torch.tensor([0, 1, -1]))
    with pytest.raises(ValueError, match=r"\[S\] or \[B, S\]"):
        packing.doc_ids_from_position_ids(torch.zeros(1, 2, 3, dtype=torch.long))


# ---- per-row document masks (B > 1, different boundaries) ----------------------------------


def _rows(S: int, seed: int, B: int = 3) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.stack([packing.doc_ids_from_cu_seqlens(_random_cu(g, S)) for _ in range(B)])


def test_row_document_mask_classifies_exactly():
    S = 64
    ids = _rows(S, seed=3)
    m = masks.causal() & packing.document_mask(ids)
    dense = masks.evaluate(m, torch.arange(S), torch.arange(S), B=3)[:, 0]
    causal = torch.arange(S)[:, None] >= torch.arange(S)[None, :]
    assert torch.equal(dense, _dense_doc_mask(ids) & causal)
    plain = masks.as_mask(lambda b, h, q, kv: ids[b, q] == ids[b, kv], bh_invariant=False) & masks.causal()
    for lay in (layout.zigzag(S, 2, block_size=8), layout.striped(S, 2, block_size=4),
                layout.contiguous(S, 4, block_size=4)):
        for bs in (4, 8):
            if lay.local_len % bs:
                continue
            got = masks.classify(m, lay.order, lay.order, block_size=bs, B=3)
            want = masks.classify(plain, lay.order, lay.order, block_size=bs, B=3)
            assert torch.equal(got, want), (lay, bs)


def test_equal_rows_collapse_to_one_document_mask():
    ids = packing.doc_ids_from_cu_seqlens([0, 3, 8])
    m = packing.document_mask(torch.stack([ids, ids]))
    assert m.bh_invariant and m.name == masks.document(ids).name


@pytest.mark.parametrize("schedule", ["zigzag", "balanced"])
def test_row_document_plan_matches_dense_float64(schedule):
    S, B = 64, 3
    ids = _rows(S, seed=5, B=B)
    m = masks.causal() & packing.document_mask(ids)
    plan = fringe.plan(getattr(schedules, schedule)(), m, seq_len=S, world_size=2, block_size=8,
                       batch_size=B)
    q, k, v = make_qkv(B=B, H=2, G=1, S=S, D=8, seed=7, requires_grad=True)
    out = fringe.simulate.attention(q, k, v, plan=plan)
    want, _ = reference.attention(q, k, v, mask_mod=m)
    torch.testing.assert_close(out, want, **tolerances(torch.float64))
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(8), dtype=torch.float64)
    g1 = torch.autograd.grad(out, (q, k, v), dout)
    g2 = torch.autograd.grad(want, (q, k, v), dout)
    for a, b in zip(g1, g2):
        torch.testing.assert_close(a, b, **tolerances(torch.float64))


# ---- labels, the batch helper --------------------------------------------------------------


def test_shift_labels_ignores_document_crossings_and_the_end():
    labels = torch.arange(10, 20).view(1, 10)
    ids = packing.doc_ids_from_cu_seqlens([0, 4, 7, 10])
    out = packing.shift_labels(labels, ids)
    assert out.tolist() == [[11, 12, 13, IGN, 15, 16, IGN, 18, 19, IGN]]
    lab = labels.clone()
    lab[0, 2] = IGN                        # an ignored label stays ignored as a target
    assert packing.shift_labels(lab, ids)[0, 1] == IGN


@pytest.mark.parametrize("schedule, P", [("zigzag", 2), ("zigzag", 4), ("balanced", 4), ("striped", 2)])
def test_sharded_shifted_labels_reassemble_to_the_global_shift(schedule, P):
    S, B = 64, 2
    g = torch.Generator().manual_seed(11)
    cus = [_random_cu(g, S) for _ in range(B)]
    ids = packing.doc_ids_from_cu_seqlens(cus)
    input_ids = torch.randint(0, 50, (B, S), generator=g)
    labels = input_ids.clone()
    labels[:, 5] = IGN
    plan = fringe.plan(getattr(schedules, schedule)(), masks.causal() & packing.document_mask(ids),
                       seq_len=S, world_size=P, block_size=8, batch_size=B)
    shards = [packing.shard_batch(input_ids, labels, plan=plan, rank=r, cu_seqlens=cus) for r in range(P)]
    lay = plan.layout
    want = packing.shift_labels(labels, ids)
    assert torch.equal(lay.unshard([s.shift_labels for s in shards], dim=1), want)
    assert torch.equal(lay.unshard([s.input_ids for s in shards], dim=1), input_ids)
    assert torch.equal(lay.unshard([s.position_ids for s in shards], dim=1),
                       packing.positions_in_document(ids))
    assert all(s.num_items == int((want != IGN).sum()) for s in shards)
    assert {s.layout_fingerprint for s in shards} == {lay.fingerprint()}
    # shifting AFTER sharding (the bug) would differ: some rank's last target lies elsewhere
    after = [packing.shift_labels(lay.shard(labels, r, dim=1), lay.shard(ids.expand(B, S), r, dim=1))
             for r in range(P)]
    assert not torch.equal(lay.unshard(after, dim=1), want)


def test_shard_batch_position_ids_and_global_positions():
    S = 32
    pos = torch.cat([torch.arange(10), torch.arange(22)])
    plan = fringe.plan(schedules.zigzag(), masks.causal(), seq_len=S, world_size=2, block_size=8)
    ids = torch.arange(S)
    sh = [packing.shard_batch(ids, ids, plan=plan, rank=r, position_ids=pos) for r in range(2)]
    assert torch.equal(plan.layout.unshard([s.position_ids for s in sh], dim=1)[0], pos)
    assert sh[0].shift_labels[0].tolist()[:1] == [1]
    assert torch.equal(sh[0].doc_ids, packing.doc_ids_from_position_ids(pos))
    glob = packing.shard_batch(ids, None, plan=plan, rank=1, cu_seqlens=[0, 10, 32],
                               restart_positions=False)
    assert torch.equal(glob.position_ids[0], plan.layout.positions(1))
    assert glob.shift_labels is None and glob.num_items == 0


def test_shard_batch_errors():
    S = 32
    p1 = fringe.plan(schedules.zigzag(), masks.causal(), seq_len=S, world_size=2, block_size=8)
    p2 = fringe.plan(schedules.striped(), masks.causal(), seq_len=S, world_size=2, block_size=8)
    ids = torch.arange(S)
    with pytest.raises(ValueError, match="different layouts"):
        packing.shard_batch(ids, ids, plan=[p1, p2], rank=0)
    with pytest.raises(ValueError, match="S=16 tokens per row but the plan's layout is for S=32"):
        packing.shard_batch(ids[:16], ids[:16], plan=p1, rank=0)
    with pytest.raises(ValueError, match="not both"):
        packing.shard_batch(ids, ids, plan=p1, rank=0, cu_seqlens=[0, 32], position_ids=ids)
    with pytest.raises(ValueError, match="shape of input_ids"):
        packing.shard_batch(ids, ids[:16], plan=p1, rank=0)


def test_token_weighted_shares_add_up_to_the_global_mean():
    S, B, V, P = 32, 2, 11, 4
    g = torch.Generator().manual_seed(2)
    cus = [torch.tensor([0, 5, 32]), torch.tensor([0, 20, 31, 32])]
    ids = torch.randint(0, V, (B, S), generator=g)
    logits = torch.randn(B, S, V, generator=g, dtype=torch.float64)
    plan = fringe.plan(schedules.zigzag(), masks.causal(), seq_len=S, world_size=P, block_size=4)
    shards = [packing.shard_batch(ids, ids, plan=plan, rank=r, cu_seqlens=cus) for r in range(P)]
    shares = [packing.token_weighted_loss(plan.layout.shard(logits, r, dim=1), s.shift_labels,
                                          num_items=s.num_items) for r, s in enumerate(shards)]
    target = packing.shift_labels(ids, packing.doc_ids_from_cu_seqlens(cus))
    want = torch.nn.functional.cross_entropy(logits.reshape(-1, V).float(), target.reshape(-1))
    torch.testing.assert_close(sum(shares), want, **tolerances(torch.float32))
    # the mean of per-rank means is NOT the global mean (ranks hold different target counts)
    means = [packing.loss_sum(plan.layout.shard(logits, r, dim=1), s.shift_labels)
             / (s.shift_labels != IGN).sum() for r, s in enumerate(shards)]
    assert abs(float(sum(means) / P) - float(want)) > 1e-3
    with pytest.raises(ValueError, match="no target"):
        packing.token_weighted_loss(logits, target, num_items=0)
    assert packing.global_token_count(target) == int((target != IGN).sum())


def test_padding_boundaries_and_labels():
    # the pad tokens' boundaries (a document of their own, positions restarting) and labels;
    # that they attend to nothing is tests/test_padding.py
    S, B, V = 27, 2, 9
    g = torch.Generator().manual_seed(4)
    ids = torch.randint(0, V, (B, S), generator=g)
    cus = [torch.tensor([0, 10, 27]), torch.tensor([0, 3, 20, 27])]
    padded = packing.pad_batch(ids, ids, multiple=16, cu_seqlens=cus)
    Sp = 32
    assert padded["input_ids"].shape == (B, Sp) and (padded["labels"][:, S:] == IGN).all()
    assert padded["real_len"] == S
    doc = packing.doc_ids_from_cu_seqlens(cus)
    doc_p = packing.doc_ids_from_cu_seqlens(padded["cu_seqlens"])
    assert torch.equal(doc_p[:, :S], doc) and bool((doc_p[:, S:] == doc_p[:, -1:]).all())
    assert bool((doc_p[:, S] != doc_p[:, S - 1]).all())                  # a new document
    pos_p = packing.pad_batch(ids, None, multiple=16,
                              position_ids=packing.positions_in_document(doc))["position_ids"]
    assert torch.equal(packing.doc_ids_from_position_ids(pos_p), doc_p)
    # the same targets: none crosses into the padding
    assert torch.equal(packing.shift_labels(padded["labels"], doc_p)[:, :S], packing.shift_labels(ids, doc))
    one = packing.pad_batch(ids, multiple=16)                           # no boundaries: one document
    assert [c.tolist() for c in one["cu_seqlens"]] == [[0, S, Sp]] * B and "labels" not in one
    with pytest.raises(ValueError, match="multiple must be"):
        packing.pad_batch(ids, multiple=0)


# ---- the package ---------------------------------------------------------------------------


def test_package_docstring_examples_run():
    """The examples in fringe.packing's docstring run against the names the package re-exports
    from its private modules."""
    import doctest
    result = doctest.testmod(packing, extraglobs=dict(torch=torch))
    assert result.attempted >= 3 and result.failed == 0


def test_package_reexports_each_name_from_the_module_that_defines_it():
    """``fringe.packing`` is a facade: every public name (and ``_and_documents``, which
    fringe.hf reads) is the object its private module defines, not a second copy."""
    import importlib
    for name in [*packing.__all__, "_and_documents"]:
        obj = getattr(packing, name)
        if name == "IGNORE_INDEX":
            assert obj == importlib.import_module("fringe.packing._common").IGNORE_INDEX == -100
            continue
        home = importlib.import_module(obj.__module__)
        assert obj.__module__.startswith("fringe.packing._"), (name, obj.__module__)
        assert getattr(home, name) is obj, name
