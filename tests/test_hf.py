"""fringe.hf: transformers' attention / mask interfaces under fringe CP.

The equivalence test runs ``examples/hf_train.py`` (Llama; Qwen2 with a sliding-window
layer; gpt-oss with a window layer and sinks passed as s_aux; DeepSeek-V3, MLA: v's head dim
12 beside q/k's 24) on 2 gloo ranks against
transformers' own attention (sdpa; eager for gpt-oss) in one process. The rest checks, in
this process, that every per-layer / per-call mismatch raises before any communication.
"""
from __future__ import annotations

import importlib
import math
import sys
from pathlib import Path

import pytest
import torch
import transformers   # the hf extra (dev.py installs it): pip install 'fringe[hf]'

import fringe
import fringe.hf
from fringe import masks, packing, schedules
from fringe.ops import reference
from fringe.testing import make_qkv, tolerances


EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
S, P, BS = 64, 2, 8


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """The models here are tiny (S <= 128, hidden <= 64): one intra-op thread runs them as fast
    as two, and far faster on a loaded machine, where OpenMP threads wait for a core (measured
    at load 11 on 2 cores: hf_train's one-process gpt-oss steps 0.45 s with 1 thread, 17.9 s
    with 2; llama 0.27 s vs 6.9 s). The gloo ranks already run one thread each."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _tiny(kind: str, attn: str = "fringe", **over):
    kw = dict(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=S,
              attention_dropout=0.0, use_cache=False, head_dim=8)
    kw.update(over)
    if kind == "llama":
        cfg = transformers.LlamaConfig(**kw)
    elif kind == "qwen2":   # the sliding-window layer first, so it is the first attention call
        cfg = transformers.Qwen2Config(**kw, use_sliding_window=True, sliding_window=16,
                                       layer_types=["sliding_attention", "full_attention"])
    elif kind == "mistral":
        cfg = transformers.MistralConfig(**kw, sliding_window=16)
    elif kind == "gemma3":
        cfg = transformers.Gemma3TextConfig(**kw, query_pre_attn_scalar=24, sliding_window=16,
                                            layer_types=["sliding_attention", "full_attention"])
    elif kind == "gemma2":
        cfg = transformers.Gemma2Config(**kw, query_pre_attn_scalar=24, sliding_window=16,
                                        attn_logit_softcapping=30.0)
    else:
        raise ValueError(kind)
    cfg._attn_implementation = attn
    fringe.hf.register()
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(cfg)


def _shard_inputs(model, schedule=None, *, plans=None):
    ids = torch.arange(S).remainder(32).view(1, S)
    cu = [0, 20, S]
    if plans is None:
        plans = fringe.hf.plans(model, schedule or schedules.zigzag(),
                                packing.document_mask(packing.doc_ids_from_cu_seqlens(cu)),
                                seq_len=S, world_size=P, block_size=BS)
    shard = packing.shard_batch(ids, ids, plan=plans.plans, rank=0, cu_seqlens=cu)
    return plans, fringe.hf.model_inputs(shard, plans)


# ---- equivalence on gloo ranks ------------------------------------------------------------


def test_hf_example_matches_sdpa_on_two_ranks():
    sys.path.insert(0, str(EXAMPLES))
    try:
        hf_train = importlib.import_module("hf_train")
        from fringe.launch import Workers
        lines = []
        with Workers(2, timeout_s=240) as w:
            # llama at S=120: fringe pads to 128 (2*P*block); the one-process run is unpadded
            results = {m: hf_train.run(hf_train.Config(world_size=2, seq_len=S_, batch_size=2,
                                                       steps=steps, block_size=16, model=m, window=24,
                                                       boundaries=b, checkpointing=ckpt),
                                       progress=lines.append, workers=w)
                       for m, S_, b, steps, ckpt in (("llama", 120, "cu_seqlens", 3, False),
                                                     ("qwen2", 128, "position_ids", 2, True),   # recompute
                                                     ("gpt_oss", 128, "cu_seqlens", 2, False),
                                                     ("deepseek_v3", 128, "position_ids", 2, False))}
    finally:
        sys.path.remove(str(EXAMPLES))
    for m, res in results.items():
        assert res["ok"], (m, lines)
        assert len(res["cp"]) == len(res["single"]) >= 2
        assert res["param_diff"] < 1e-3, m                  # gradients (gpt-oss: of the sinks too)
        # 2 layers; with activation checkpointing (qwen2) each attention runs again in the backward
        assert {a["attention_calls"] for a in res["cp"]} == {4 if m == "qwen2" else 2}, m
        assert {a["padded_len"] for a in res["cp"]} == {128}, m
        for a, b in zip(res["cp"], res["single"]):
            assert math.isfinite(a["loss"]) and abs(a["loss"] - b["loss"]) <= hf_train.TOLERANCE, (m, a, b)
        assert res["single"][0]["loss"] != res["single"][-1]["loss"]        # it trains
    assert lines[-1].startswith("max |loss diff|") and lines[-1].endswith("OK")
    assert any(line.startswith("S=120 does not fit the layout: fringe padded it to 128") for line in lines)


# ---- padding: a length that does not fit the layout ---------------------------------------


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_a_padded_batch_gives_the_unpadded_loss_in_one_process(kind):
    """S=60 does not fit zigzag at block 8 (2*P*block = 16): fringe.hf.plans pads to 64 and
    shard_batch pads the batch (pad tokens attend to nothing, their labels are ignored); the
    loss and gradients equal transformers' sdpa on the unpadded batch (one gloo rank, so it
    runs in this process)."""
    import torch.distributed as dist
    Sr, B = 60, 2
    g = torch.Generator().manual_seed(12)
    ids = torch.randint(0, 32, (B, Sr), generator=g)
    cus = [torch.tensor([0, 21, Sr]), torch.tensor([0, 7, 40, Sr])]
    doc = packing.doc_ids_from_cu_seqlens(cus)
    model = _tiny(kind)
    assert not dist.is_initialized()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        plans = fringe.hf.plans(model, schedules.zigzag(), packing.document_mask(doc), seq_len=Sr,
                                world_size=1, block_size=BS, batch_size=B)
        assert plans.real_len == Sr and plans.layout.seq_len == 64
        assert all(packing.real_len_of(lp.plan.mask_mod) == Sr for lp in plans.layers)
        shard = packing.shard_batch(ids, ids, plan=plans.plans, rank=0, cu_seqlens=cus)
        assert shard.input_ids.shape == (B, 64) and (shard.shift_labels[:, Sr - 1:] == -100).all()
        out = model(**fringe.hf.model_inputs(shard, plans), use_cache=False)
        out.loss.backward()
    finally:
        dist.destroy_process_group()
    ref = _tiny(kind, attn="sdpa")
    targets = packing.shift_labels(ids, doc)
    assert shard.num_items == int((targets != -100).sum())
    want = ref(input_ids=ids, position_ids=packing.positions_in_document(doc), labels=targets,
               shift_labels=targets, use_cache=False)
    want.loss.backward()
    assert torch.isfinite(out.loss) and abs(out.loss.item() - want.loss.item()) < 1e-5
    for (name, a), b in zip(model.named_parameters(), ref.parameters()):
        assert torch.isfinite(a.grad).all(), name
        torch.testing.assert_close(a.grad, b.grad, atol=1e-5, rtol=1e-4, msg=name)


def test_plans_pad_only_a_length_the_layout_does_not_take():
    model = _tiny("llama")

    def plans(schedule, seq_len, **kw):
        return fringe.hf.plans(model, schedule, None, seq_len=seq_len, world_size=P, block_size=BS, **kw)
    assert plans(schedules.zigzag(), 64).real_len is None                  # fits: 2*P*block = 32
    assert plans(schedules.ring(), 48).real_len is None                    # fits ring: P*block = 16
    p = plans(schedules.ring(), 40)                                         # padded_len(40, 2, block=8)
    assert (p.real_len, p.layout.seq_len) == (40, 64)
    p = plans(schedules.zigzag(), 64, tp_size=3)                            # L % 3: lcm(32, 2*3) = 96
    assert (p.real_len, p.layout.seq_len, p.layout.local_len % 3) == (64, 96, 0)
    assert all(packing.real_len_of(lp.plan.mask_mod) == 64 for lp in p.layers)


# ---- what transformers passes, per layer and per call --------------------------------------


def test_register_makes_the_name_valid_and_a_padding_mask_raises():
    model = _tiny("llama")
    assert "fringe" in transformers.AttentionInterface._global_mapping
    ids = torch.zeros(1, 8, dtype=torch.long)
    pad = torch.ones(1, 8, dtype=torch.long)
    pad[0, -2:] = 0
    with pytest.raises(ValueError, match="pads tokens out"):
        model(input_ids=ids, attention_mask=pad)
    with pytest.raises(ValueError, match="needs this batch's plans"):
        model(input_ids=ids, attention_mask=torch.ones_like(pad))      # an all-ones mask is fine
    with pytest.raises(ValueError, match="KV cache"):
        fringe.hf.mask_function(batch_size=1, q_length=1, kv_length=9, q_offset=8, kv_offset=0)


def test_layer_kinds_read_scaling_window_and_softcap():
    kinds = fringe.hf.layer_kinds(_tiny("qwen2"))
    assert {k["sliding_window"]: tuple(k["layers"]) for k in kinds} == {16: (0,), None: (1,)}
    assert all(k["scaling"] == 8 ** -0.5 and k["causal"] for k in kinds)
    g3 = fringe.hf.layer_kinds(_tiny("gemma3"))
    assert {k["scaling"] for k in g3} == {24 ** -0.5}
    g2 = fringe.hf.layer_kinds(_tiny("gemma2"))
    assert {k["softcap"] for k in g2} == {30.0} and {k["sliding_window"] for k in g2} == {16, None}
    # Mistral passes config.sliding_window to every layer (its modules have no attribute)
    mistral = _tiny("mistral")
    assert [(k["sliding_window"], k["layers"]) for k in fringe.hf.layer_kinds(mistral)] == [(16, [0, 1])]
    plans = fringe.hf.plans(mistral, schedules.zigzag(), None, seq_len=S, world_size=P, block_size=BS)
    assert [lp.sliding_window for lp in plans.layers] == [16]


def test_a_layer_without_its_plan_raises():
    qwen = _tiny("qwen2")
    plans, _ = _shard_inputs(_tiny("llama"))         # plans for full-attention layers only
    _, inputs = _shard_inputs(qwen, plans=plans)
    with pytest.raises(ValueError, match="sliding_window=16.*no plan was made"):
        qwen(**inputs)
    llama = _tiny("llama")
    plans, inputs = _shard_inputs(llama)             # made for causal layers
    llama.model.layers[0].self_attn.is_causal = False
    with pytest.raises(ValueError, match="causal=False, sliding_window=None.*no plan was made"):
        llama(**inputs)


def test_scaling_mismatch_raises():
    gemma = _tiny("gemma3")
    plans = fringe.hf.plans(gemma, schedules.zigzag(), None, seq_len=S, world_size=P, block_size=BS)
    # the same plans but made without the model's scaling (the default 1/sqrt(D)), as a user might
    wrong = fringe.hf.Plans(tuple(fringe.hf.LayerPlan(
        fringe.plan(schedules.zigzag(), lp.plan.mask_mod, seq_len=S, world_size=P, block_size=BS,
                    layout=lp.plan.layout), causal=lp.causal, sliding_window=lp.sliding_window)
        for lp in plans.layers))
    _, inputs = _shard_inputs(gemma, plans=wrong)
    with pytest.raises(ValueError, match=r"scales scores by 0\.204.*scale=None"):
        gemma(**inputs)


def test_softcap_dropout_and_layout_mismatches_raise():
    gemma2 = _tiny("gemma2", attn="fringe")
    no_cap = fringe.hf.Plans(tuple(fringe.hf.LayerPlan(lp.plan, causal=lp.causal,
                                                       sliding_window=lp.sliding_window)
                                   for lp in _shard_inputs(gemma2)[0].layers))
    _, inputs = _shard_inputs(gemma2, plans=no_cap)
    with pytest.raises(ValueError, match="softcap=30.0, but no plan"):
        gemma2(**inputs)
    drop = _tiny("llama", attention_dropout=0.1)
    drop.train()
    _, inputs = _shard_inputs(drop)
    with pytest.raises(ValueError, match="dropout=0.1"):
        drop(**inputs)
    llama = _tiny("llama")
    plans_a, _ = _shard_inputs(llama, schedules.zigzag())
    plans_b, _ = _shard_inputs(llama, schedules.striped())
    ids = torch.arange(S).view(1, S)
    shard_b = packing.shard_batch(ids, ids, plan=plans_b.plans, rank=0, cu_seqlens=[0, 20, S])
    with pytest.raises(ValueError, match="sharded by layout striped"):
        fringe.hf.model_inputs(shard_b, plans_a)
    _, inputs = _shard_inputs(llama, plans=plans_a)
    inputs["fringe"] = fringe.hf.Plans(plans_a.layers, batch_fingerprint=shard_b.layout_fingerprint)
    with pytest.raises(ValueError, match="plan every layer over the batch's layout"):
        llama(**inputs)


def test_balanced_hf_plans_use_fringe_plans_prediction():
    # one layer kind: the layout fringe.plan picks for the same mask
    model = _tiny("llama")
    doc = packing.doc_ids_from_cu_seqlens([0, 13, 40, S])
    mask = packing.document_mask(doc)
    plans = fringe.hf.plans(model, schedules.balanced(), mask, seq_len=S, world_size=P, block_size=BS)
    alone = fringe.plan(schedules.balanced(), mask & masks.causal(), seq_len=S, world_size=P,
                        block_size=BS)
    assert plans.layout.fingerprint() == alone.layout.fingerprint()
    # two kinds with equal masks (a window >= S): the layout of that one mask, however weighted
    same = [mask & masks.causal(), mask & masks.sliding_window(S)]
    lay = fringe.hf._balanced_layout(schedules.balanced(), same, [1, 3], seq_len=S, world_size=P,
                                     plan_kwargs=dict(block_size=BS))
    assert lay.fingerprint() == alone.layout.fingerprint()


def test_plans_over_different_layouts_are_refused():
    a = fringe.plan(schedules.zigzag(), masks.causal(), seq_len=S, world_size=P, block_size=BS)
    b = fringe.plan(schedules.striped(), masks.sliding_window(16), seq_len=S, world_size=P, block_size=BS)
    with pytest.raises(ValueError, match="different layouts"):
        fringe.hf.Plans((fringe.hf.LayerPlan(a), fringe.hf.LayerPlan(b, sliding_window=16)))


@pytest.mark.parametrize("kind", ["qwen2", "gemma2"])
def test_per_layer_plans_share_one_layout_and_match_dense(kind):
    model = _tiny(kind)
    doc = packing.doc_ids_from_cu_seqlens([0, 13, 40, S])
    plans = fringe.hf.plans(model, schedules.balanced(), packing.document_mask(doc), seq_len=S,
                            world_size=P, block_size=BS)
    assert len(plans.layers) == 2
    assert len({lp.plan.layout.fingerprint() for lp in plans.layers}) == 1
    # balanced for both layers together by fringe.plan's prediction (each kind's sequence-order
    # block map weighted by its number of layers), not for the first kind's mask alone
    pos = torch.arange(S)
    layers = {(k["sliding_window"], k["softcap"]): len(k["layers"]) for k in fringe.hf.layer_kinds(model)}
    maps = [(masks.classify(lp.plan.mask_mod, pos, pos, block_size=BS, sparse=True),
             layers[(lp.sliding_window, lp.softcap)]) for lp in plans.layers]
    assert plans.layout.fingerprint() == fringe.layout.balanced(S, P, block_size=BS,
                                                                natural=maps).fingerprint()
    q, k, v = make_qkv(B=1, H=4, G=2, S=S, D=8, seed=3)
    for lp in plans.layers:
        mask = masks.document(doc) & (masks.sliding_window(lp.sliding_window) if lp.sliding_window
                                      else masks.causal())
        cap = lp.softcap

        def softcap(s, b, h, qi, ki):
            return cap * torch.tanh(s / cap)
        want, _ = reference.attention(q, k, v, mask_mod=mask, scale=lp.plan.scale,
                                      score_mod=softcap if cap else None)
        got = fringe.simulate.attention(q, k, v, plan=lp.plan)
        torch.testing.assert_close(got, want, **tolerances(torch.float64))
