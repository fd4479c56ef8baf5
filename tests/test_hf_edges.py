"""The documented Hugging Face snippet's sharp edges.

* errors raised under ``fringe.hf.plans`` name ``fringe.hf.plans`` and the keyword to pass
  (``batch_size=`` with its value for per-row documents), not ``fringe.plan``;
* label shifting is explicit: ``shard_batch(..., shift=True)`` (the default, transformers'
  convention: labels aligned with input_ids, shifted by the loss) or ``shift=False`` (labels
  already next-token targets), with ``num_items`` right either way;
* the README's snippet passes ``batch_size=``.
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
import transformers  # noqa: F401  (the hf extra, dev.py installs it: pip install "fringe[hf]")
from torch.nn.attention.flex_attention import create_block_mask

import fringe
import fringe.hf
from fringe import masks, packing, schedules
from fringe.testing import tiny_llama

S, P, BS, IGN = 64, 2, 8, packing.IGNORE_INDEX
ROOT = Path(__file__).resolve().parents[1]


def _llama():
    return tiny_llama(S)


def _batch(seed: int = 0, B: int = 2):
    g = torch.Generator().manual_seed(seed)
    cus = [torch.tensor([0, 20, S]), torch.tensor([0, 9, 40, S])][:B]
    ids = torch.randint(0, 32, (B, S), generator=g)
    return ids, cus


# ---- errors under fringe.hf.plans ---------------------------------------------------------

def test_per_row_documents_without_batch_size_name_hf_plans():
    model = _llama()
    ids, cus = _batch()
    mask = packing.document_mask(packing.doc_ids_from_cu_seqlens(cus))
    with pytest.raises(ValueError) as e:
        fringe.hf.plans(model, schedules.zigzag(), mask, seq_len=S, world_size=P, block_size=BS)
    msg = str(e.value)
    assert msg.startswith("fringe.hf.plans:") and "batch_size=2" in msg
    assert not re.search(r"fringe\.plan\b(?!s)", msg)
    with pytest.raises(ValueError, match=r"^fringe\.hf\.plans: batch_size=3 but the mask's "
                                         r"document ids have 2 rows.*pass batch_size=2"):
        fringe.hf.plans(model, schedules.zigzag(), mask, seq_len=S, world_size=P, block_size=BS,
                        batch_size=3)
    plans = fringe.hf.plans(model, schedules.zigzag(), mask, seq_len=S, world_size=P,
                            block_size=BS, batch_size=2)
    assert all(p.batch_size == 2 for p in plans.plans)


def test_errors_from_fringe_plan_are_renamed_under_hf_plans():
    """A plain callable that reads b (fringe.plan's own error), a bad keyword: the message
    names fringe.hf.plans and its keyword; the exception type is kept."""
    model = _llama()
    ids, cus = _batch()
    doc = packing.doc_ids_from_cu_seqlens(cus)

    def row_docs(b, h, q_idx, kv_idx):
        return doc[b, q_idx] == doc[b, kv_idx]
    with pytest.raises(ValueError) as e:
        fringe.hf.plans(model, schedules.zigzag(), row_docs, seq_len=S, world_size=P,
                        block_size=BS)
    msg = str(e.value)
    assert "pass batch_size= to fringe.hf.plans" in msg and msg.startswith("fringe.hf.plans: ")
    assert not re.search(r"fringe\.plan\b(?!s)", msg)
    with pytest.raises(ValueError, match=r"^fringe\.hf\.plans: kv must be one of"):
        fringe.hf.plans(model, schedules.zigzag(), None, seq_len=S, world_size=P, block_size=BS,
                        kv="bogus")
    with pytest.raises(TypeError, match=r"^fringe\.hf\.plans: schedule must be"):
        fringe.hf.plans(model, "zigzag", None, seq_len=S, world_size=P, block_size=BS)


def test_hf_plans_takes_a_block_mask():
    model = _llama()
    doc = torch.arange(S) // 24
    bm = create_block_mask(masks.document(doc), None, None, S, S, device="cpu", BLOCK_SIZE=BS)
    got = fringe.hf.plans(model, schedules.zigzag(), bm, seq_len=S, world_size=P, block_size=BS)
    want = fringe.hf.plans(model, schedules.zigzag(), masks.document(doc), seq_len=S,
                           world_size=P, block_size=BS)
    assert [p.digests() for p in got.plans] == [p.digests() for p in want.plans]
    short = create_block_mask(masks.document(doc[:32]), None, None, 32, 32, device="cpu")
    with pytest.raises(ValueError, match=r"^fringe\.hf\.plans: the BlockMask was built for "
                                         r"Q_LEN=32"):
        fringe.hf.plans(model, schedules.zigzag(), short, seq_len=S, world_size=P, block_size=BS)


# ---- label shifting -----------------------------------------------------------------------

def _plan(doc, B):
    return fringe.plan(schedules.zigzag(), masks.causal() & packing.document_mask(doc),
                       seq_len=S, world_size=P, block_size=BS, batch_size=B)


def _targets(plan, shards):
    return plan.layout.unshard([s.shift_labels for s in shards], dim=1)


def test_default_shifts_labels_aligned_with_input_ids():
    """shift=True (default): targets[:, i] = labels[:, i+1] within a document; num_items is
    the count of those not ignored (transformers' labels=input_ids convention)."""
    ids, cus = _batch(1)
    doc = packing.doc_ids_from_cu_seqlens(cus)
    plan = _plan(doc, 2)
    labels = ids.clone()
    labels[0, 7] = IGN
    shards = [packing.shard_batch(ids, labels, plan=plan, rank=r, cu_seqlens=cus)
              for r in range(P)]
    tgt = _targets(plan, shards)
    want = torch.full_like(labels, IGN)
    for b in range(2):
        for i in range(S - 1):
            if doc[b, i] == doc[b, i + 1]:
                want[b, i] = labels[b, i + 1]
    assert torch.equal(tgt, want)
    # 2 rows x 63 pairs, minus 1 + 2 document boundaries, minus the one ignored label
    assert shards[0].num_items == shards[1].num_items == 2 * (S - 1) - 3 - 1 == 122
    explicit = packing.shard_batch(ids, labels, plan=plan, rank=1, cu_seqlens=cus, shift=True)
    assert torch.equal(explicit.shift_labels, shards[1].shift_labels)


def test_already_shifted_labels_are_not_shifted_again():
    """shift=False uses next-token targets as given (same shards and num_items as shifting
    the unshifted labels); shift=True on them raises instead of shifting twice."""
    ids, cus = _batch(2)
    doc = packing.doc_ids_from_cu_seqlens(cus)
    plan = _plan(doc, 2)
    pre = packing.shift_labels(ids, doc)            # what a user's pipeline already did
    by_default = [packing.shard_batch(ids, ids, plan=plan, rank=r, cu_seqlens=cus)
                  for r in range(P)]
    given = [packing.shard_batch(ids, pre, plan=plan, rank=r, cu_seqlens=cus, shift=False)
             for r in range(P)]
    for a, b in zip(by_default, given):
        assert torch.equal(a.shift_labels, b.shift_labels)
        assert a.num_items == b.num_items == int((pre != IGN).sum())
    with pytest.raises(ValueError, match=r"already next-token targets.*shift=False"):
        packing.shard_batch(ids, pre, plan=plan, rank=0, cu_seqlens=cus)
    # shifted without regard to documents (the plain torch way): still caught
    naive = torch.cat([ids[:, 1:], ids.new_full((2, 1), IGN)], dim=1)
    with pytest.raises(ValueError, match="shift=False"):
        packing.shard_batch(ids, naive, plan=plan, rank=0, cu_seqlens=cus)
    # shifted with the last position filled by the loader (EOS / pad id, not ignore_index):
    # it has no next token to compare with, so it must not hide the shift (it was shifted twice)
    filled = torch.cat([ids[:, 1:], ids.new_full((2, 1), 0)], dim=1)
    with pytest.raises(ValueError, match="shift=False"):
        packing.shard_batch(ids, filled, plan=plan, rank=0, cu_seqlens=cus)
    # the same batch padded (pad_batch, real_len=S): the padding does not hide it either
    eos = torch.cat([ids[:, 1:], ids.new_full((2, 1), 31)], dim=1)     # EOS 31, pad id 0
    padded = packing.pad_batch(ids, eos, length=2 * S, cu_seqlens=cus)
    with pytest.raises(ValueError, match="shift=False"):
        packing._shard._check_unshifted(padded["input_ids"], padded["labels"], IGN,
                                        padded["real_len"])
    sh = packing.shard_batch(ids, naive, plan=plan, rank=0, cu_seqlens=cus, shift=False)
    assert sh.num_items == int((naive != IGN).sum()) == 2 * (S - 1)   # as given: 126
    with pytest.raises(TypeError, match="shift must be True"):
        packing.shard_batch(ids, ids, plan=plan, rank=0, cu_seqlens=cus, shift="no")


def test_shift_false_with_padding_ignores_the_pad_targets():
    """A batch padded by shard_batch itself (the plans remove the padding): pad tokens have no
    target either way, and num_items counts the real ones."""
    n = 60                                          # padded to 64
    g = torch.Generator().manual_seed(4)
    ids = torch.randint(0, 32, (1, n), generator=g)
    mask = packing.pad_mask(masks.causal(), real_len=n, padded_len=S)
    plan = fringe.plan(schedules.zigzag(), mask, seq_len=S, world_size=P, block_size=BS)
    pre = packing.shift_labels(ids)
    shifted = [packing.shard_batch(ids, ids, plan=plan, rank=r) for r in range(P)]
    given = [packing.shard_batch(ids, pre, plan=plan, rank=r, shift=False) for r in range(P)]
    for a, b in zip(shifted, given):
        assert torch.equal(a.shift_labels, b.shift_labels)
        assert a.num_items == b.num_items == n - 1
    tgt = _targets(plan, given)
    assert bool((tgt[:, n - 1:] == IGN).all())


def test_labels_equal_to_input_ids_are_not_mistaken_for_shifted():
    """A constant run (labels == input_ids == input_ids moved left) stays the default."""
    ids = torch.full((1, S), 5)
    plan = fringe.plan(schedules.zigzag(), masks.causal(), seq_len=S, world_size=P,
                       block_size=BS)
    sh = packing.shard_batch(ids, ids, plan=plan, rank=0)
    assert sh.num_items == S - 1


# ---- the documented snippet ---------------------------------------------------------------

def test_snippets_pass_batch_size():
    for text in ((ROOT / "README.md").read_text(), fringe.hf.__doc__):
        calls = re.findall(r"fringe\.hf\.plans\(model,.*?\)\s", text, flags=re.S)
        assert calls and all("batch_size=" in c for c in calls), calls
