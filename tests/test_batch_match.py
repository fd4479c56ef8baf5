"""Issue 17, item 3: two objects that describe one batch must be checked against each other.

A plan holds one batch's documents; its layout fingerprint is the same for every batch of
that length. ``packing.shard_batch`` and ``fringe.hf.model_inputs`` compare the plans'
document ids (document rules through ``&`` and ``pad_mask``), real length and B with the
batch's, and raise naming the batch mismatch; a plain callable mask is not compared.
"""
from __future__ import annotations

import pytest
import torch
import transformers  # noqa: F401  (the hf extra; tiny_llama needs it)

import fringe
import fringe.hf
from fringe import masks, packing, schedules
from fringe.testing import tiny_llama

S, P, BS = 64, 2, 8
CU_N, CU_N1 = [0, 20, S], [0, 33, 40, S]          # batch N and batch N+1: same length
MISMATCH = "batch mismatch"


def _doc(cu):
    return packing.doc_ids_from_cu_seqlens(torch.tensor(cu))


def _plan(mask, **kw):
    return fringe.plan(schedules.zigzag(), mask, seq_len=S, world_size=P, block_size=BS, **kw)


def _ids(B=1):
    return torch.arange(B * S).remainder(32).view(B, S)


def test_shard_batch_refuses_a_plan_made_for_the_previous_batch():
    plan_n = _plan(masks.causal() & packing.document_mask(_doc(CU_N)))
    ids = _ids()
    packing.shard_batch(ids, ids, plan=plan_n, rank=0, cu_seqlens=CU_N)          # its own batch
    with pytest.raises(ValueError, match=f"shard_batch: {MISMATCH}.*other document boundaries"):
        packing.shard_batch(ids, ids, plan=plan_n, rank=0, cu_seqlens=CU_N1)
    pos = packing.positions_in_document(_doc(CU_N1))
    with pytest.raises(ValueError, match=MISMATCH):
        packing.shard_batch(ids, ids, plan=plan_n, rank=1, position_ids=pos)
    with pytest.raises(ValueError, match=f"{MISMATCH}.*gave no boundaries"):
        packing.shard_batch(ids, ids, plan=plan_n, rank=0)
    # the same documents under other labels (only the grouping counts), and unsorted ids
    relabelled = _plan(packing.document_mask(_doc(CU_N) * 3 + 5) & masks.causal())
    packing.shard_batch(ids, ids, plan=relabelled, rank=0, cu_seqlens=CU_N)
    scattered = torch.tensor([3, 0, 2, 1]).repeat_interleave(S // 4)     # unsorted labels
    plan_s = _plan(masks.document(scattered * 7))
    sh = packing.shard_batch(ids, None, plan=plan_s, rank=0,
                             position_ids=torch.arange(S) % (S // 4))
    assert sh.batch.documents == packing.plan_batch_key(plan_s).documents
    with pytest.raises(ValueError, match=MISMATCH):
        packing.shard_batch(ids, None, plan=plan_s, rank=0, position_ids=torch.arange(S) % (S // 2))


def test_rows_real_length_and_where_the_check_does_not_apply():
    B = 2
    cus = [torch.tensor([0, 10, S]), torch.tensor([0, 3, 40, S])]
    doc = packing.doc_ids_from_cu_seqlens(cus)                            # [B, S], rows differ
    plan_b = _plan(masks.causal() & packing.document_mask(doc), batch_size=B)
    ids = _ids(B)
    packing.shard_batch(ids, ids, plan=plan_b, rank=0, cu_seqlens=cus)
    with pytest.raises(ValueError, match=r"other document boundaries \(row 1 differs"):
        packing.shard_batch(ids, ids, plan=plan_b, rank=0, cu_seqlens=[cus[0], cus[0]])
    with pytest.raises(ValueError, match=f"{MISMATCH}.*B=2 rows, the batch 3"):
        packing.shard_batch(_ids(3), None, plan=plan_b, rank=0, cu_seqlens=cus + [cus[0]])
    # padding: plans for 60 real tokens (pad_mask), a batch of 60 with other documents
    Sr = 60
    pad = _plan(packing.pad_mask(packing.document_mask(_doc([0, 30, Sr])), real_len=Sr,
                                 padded_len=S))
    short = torch.arange(Sr).view(1, Sr)
    assert packing.shard_batch(short, short, plan=pad, rank=0, cu_seqlens=[0, 30, Sr]).real_len == Sr
    with pytest.raises(ValueError, match=MISMATCH):
        packing.shard_batch(short, short, plan=pad, rank=0, cu_seqlens=[0, 31, Sr])
    # where the check does not apply: a plain callable, and a document rule under `|`
    ids_n = _doc(CU_N)

    def plain(b, h, q_idx, kv_idx):
        return ids_n[q_idx] == ids_n[kv_idx]

    one = _ids()
    for m in (plain, masks.causal() | masks.document(ids_n)):
        packing.shard_batch(one, one, plan=_plan(m), rank=0, cu_seqlens=CU_N1)   # not compared


def _tiny():
    return tiny_llama(S)


def test_hf_model_inputs_refuses_plans_of_another_batch():
    model = _tiny()
    ids = _ids()

    def plans_for(cu, seq_len=S):
        return fringe.hf.plans(model, schedules.zigzag(), packing.document_mask(_doc(cu)),
                               seq_len=seq_len, world_size=P, block_size=BS)

    plans_n, plans_n1 = plans_for(CU_N), plans_for(CU_N1)
    assert plans_n.layout_fingerprint == plans_n1.layout_fingerprint     # layouts cannot tell
    shard_n1 = packing.shard_batch(ids, ids, plan=plans_n1.plans, rank=0, cu_seqlens=CU_N1)
    inputs = fringe.hf.model_inputs(shard_n1, plans_n1)
    assert inputs["fringe"].layers == plans_n1.layers
    with pytest.raises(ValueError, match=f"model_inputs: {MISMATCH}.*other document boundaries"):
        fringe.hf.model_inputs(shard_n1, plans_n)
    with pytest.raises(ValueError, match=f"shard_batch: {MISMATCH}"):
        packing.shard_batch(ids, ids, plan=plans_n.plans, rank=0, cu_seqlens=CU_N1)
    # padded by fringe.hf.plans: 60 vs 58 real tokens, one padded layout of 64
    p60, p58 = plans_for([0, 30, 60], 60), plans_for([0, 30, 58], 58)
    short = torch.arange(58).view(1, 58)
    shard58 = packing.shard_batch(short, short, plan=p58.plans, rank=1, cu_seqlens=[0, 30, 58])
    with pytest.raises(ValueError, match=f"{MISMATCH}.*60 real tokens per row.*the batch 58"):
        fringe.hf.model_inputs(shard58, p60)
