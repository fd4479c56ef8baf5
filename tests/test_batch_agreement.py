"""The CP ranks of one replica must shard the same global batch; the agreement checks it.

Two batches with the same documents give the same plans, so a data loader seeded by global
rank instead of dp rank (each CP rank cutting its shard from a different batch) agreed on
everything and trained on nonsense with no error. ``packing.shard_batch`` now records a digest
of the global batch (input_ids, shifted labels, document ids, RoPE positions) in the Shard;
``fringe.hf.model_inputs`` carries it into every attention call, which compares it across
the CP ranks in the same per-call agreement exchange, before any attention data moves.
"""
from __future__ import annotations

import warnings

import pytest
import torch

import fringe.hf
from fringe import packing, schedules
from fringe.launch import Workers
from fringe.testing import tiny_llama

S, BS = 32, 4
CU = [0, 11, 20, S]          # three documents


@pytest.fixture(scope="module")
def pool2():
    with Workers(2, timeout_s=120, threads=1) as w:
        yield w


def _batch(seed: int) -> torch.Tensor:
    return torch.randint(0, 32, (1, S), generator=torch.Generator().manual_seed(seed))


def _reference(model, ids: torch.Tensor) -> tuple[torch.Tensor, float]:
    """The batch's logits ``[1, S, V]`` and mean next-token loss, one document at a time in
    one process (sdpa, float64)."""
    model.config._attn_implementation = "sdpa"
    total, n, parts = 0.0, 0, []
    try:
        with torch.no_grad():
            for a, b in zip(CU[:-1], CU[1:]):
                doc = ids[:, a:b]
                logits = model(input_ids=doc, position_ids=torch.arange(b - a).view(1, -1)).logits
                parts.append(logits)
                total += float(torch.nn.functional.cross_entropy(
                    logits[0, :-1], doc[0, 1:], reduction="sum"))
                n += b - a - 1
    finally:
        model.config._attn_implementation = fringe.hf.NAME
    return torch.cat(parts, dim=1), total / n


def worker(rank: int, world_size: int, what: str):
    torch.manual_seed(0)
    model = tiny_llama(S).double()
    plans = fringe.hf.plans(model, schedules.zigzag(),
                            packing.document_mask(packing.doc_ids_from_cu_seqlens(CU)),
                            seq_len=S, world_size=world_size, block_size=BS, timeout_s=30)
    # "different": rank 1's loader was seeded by its own rank (same documents, other tokens)
    ids = _batch(rank if what == "different" else 0)
    shard = packing.shard_batch(ids, ids, plan=plans.plans, rank=rank, cu_seqlens=CU)
    inputs = fringe.hf.model_inputs(shard, plans)
    if what == "mixed" and rank == 1:           # rank 1 passes the plans directly: no digest
        inputs = dict(shard.model_inputs(), fringe=plans)
    try:
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            res = model(**inputs, use_cache=False)
    except Exception as e:      # noqa: BLE001 - the test reads every rank's error
        return f"{type(e).__name__}: {e}"
    logits, ref_loss = _reference(model, ids)
    out = dict(loss=float(res.loss), digest=shard.batch_digest, reference=ref_loss,
               logits_err=float((res.logits - plans.layout.shard(logits, rank, dim=1)).abs().max()))
    if what == "direct":        # fringe=plans without model_inputs: works, warns once
        fringe.hf._warn_unbound.cache_clear()
        inputs = shard.model_inputs()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with torch.no_grad():
                out["direct_loss"] = float(model(**inputs, fringe=plans, use_cache=False).loss)
        out["warnings"] = [str(w.message) for w in caught if w.category is UserWarning
                           and "fringe.hf" in str(w.message)]
    return out


def test_ranks_that_sharded_different_batches_all_raise(pool2):
    msgs = pool2.run(worker, "different")
    for r, msg in enumerate(msgs):
        assert isinstance(msg, str), msgs          # the current code ran on silently
        assert msg.startswith("RankMismatch: CP ranks sharded different batches: rank 1's "
                              "batch digest #"), msgs
        assert "differs from rank 0's batch digest #" in msg, msgs
        assert f"seen from rank {r}" in msg and "seed the loader by dp rank" in msg, msgs


def test_a_rank_without_a_digest_beside_one_with_it_all_raise(pool2):
    msgs = pool2.run(worker, "mixed")
    for msg in msgs:
        assert isinstance(msg, str), msgs
        assert msg.startswith("RankMismatch: rank 1 disagrees with rank 0 on the batch: rank 0 "
                              "has batch digest #"), msgs
        assert "rank 1 has no batch digest" in msg and "fringe.hf.model_inputs" in msg, msgs


def test_the_same_batch_passes_and_matches_the_one_process_loss(pool2):
    res = pool2.run(worker, "direct")
    assert all(isinstance(r, dict) for r in res), res
    assert res[0]["digest"] == res[1]["digest"] is not None
    assert res[0]["reference"] == res[1]["reference"]
    # float64 logits of this rank's tokens equal the one-process ones; each rank's loss
    # (transformers computes it in float32) is its token-weighted share of the batch's mean
    assert max(r["logits_err"] for r in res) < 1e-10, res
    total = res[0]["loss"] + res[1]["loss"]
    assert abs(total - res[0]["reference"]) < 1e-5, res
    # the direct-plans path still works (no batch checks): same numbers, one warning per rank
    assert abs(res[0]["direct_loss"] + res[1]["direct_loss"] - total) < 1e-12, res
    for r in res:
        assert len(r["warnings"]) == 1 and "not through fringe.hf.model_inputs" in r["warnings"][0], r


def test_the_digest_is_of_the_global_batch_not_the_shard():
    """Every rank's shard of one batch has one digest; another batch (tokens or labels) another."""
    model = tiny_llama(S)
    plans = fringe.hf.plans(model, schedules.zigzag(),
                            packing.document_mask(packing.doc_ids_from_cu_seqlens(CU)),
                            seq_len=S, world_size=2, block_size=BS)
    ids = _batch(0)
    d = [packing.shard_batch(ids, ids, plan=plans.plans, rank=r, cu_seqlens=CU).batch_digest
         for r in (0, 1)]
    assert d[0] == d[1] and isinstance(d[0], int) and 0 <= d[0] < 2 ** 48
    other = _batch(1)
    assert packing.shard_batch(other, other, plan=plans.plans, rank=0,
                               cu_seqlens=CU).batch_digest != d[0]
    labels = ids.clone()
    labels[0, 3] = packing.IGNORE_INDEX
    assert packing.shard_batch(ids, labels, plan=plans.plans, rank=0,
                               cu_seqlens=CU).batch_digest != d[0]
    assert packing.shard_batch(ids, None, plan=plans.plans, rank=0,
                               cu_seqlens=CU).batch_digest != d[0]
    # model_inputs carries it as a 0-d int64 CPU tensor (no recompile per batch)
    ctx = fringe.hf.model_inputs(packing.shard_batch(ids, ids, plan=plans.plans, rank=0,
                                                     cu_seqlens=CU), plans)[fringe.hf.KWARG]
    assert ctx.batch_digest.dim() == 0 and ctx.batch_digest.dtype == torch.int64
    assert int(ctx.batch_digest) == d[0]


def test_the_digest_covers_the_rope_positions():
    """Ranks whose batches differ only in their RoPE positions (``restart_positions`` set
    differently, or position_ids offset on one rank) ran with no error and a loss that is
    neither batch's: the positions are part of the batch the digest compares. The same
    positions given as cu_seqlens or as position_ids keep one digest."""
    model = tiny_llama(S)
    doc = packing.doc_ids_from_cu_seqlens(CU)
    plans = fringe.hf.plans(model, schedules.zigzag(), packing.document_mask(doc),
                            seq_len=S, world_size=2, block_size=BS)
    ids = _batch(0)
    base = packing.shard_batch(ids, ids, plan=plans.plans, rank=0, cu_seqlens=CU).batch_digest
    pos = packing.positions_in_document(doc)
    assert packing.shard_batch(ids, ids, plan=plans.plans, rank=1,
                               position_ids=pos).batch_digest == base
    assert packing.shard_batch(ids, ids, plan=plans.plans, rank=1, cu_seqlens=CU,
                               restart_positions=False).batch_digest != base
    assert packing.shard_batch(ids, ids, plan=plans.plans, rank=1,
                               position_ids=pos + 7).batch_digest != base
