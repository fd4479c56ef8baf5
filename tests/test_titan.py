"""fringe.titan: torchtitan's Llama 3 with fringe attention.

The equivalence test runs ``examples/titan_train.py`` (a tiny GQA Llama 3 from torchtitan's
debug config) under CP on 2 gloo ranks against one process running torchtitan's own mask
densely. The other tests run in this process, with no communication: the mask fringe plans
equals torchtitan's, and every mistake a training loop can make raises before attention runs.
"""
from __future__ import annotations

import importlib
import math
import sys
from pathlib import Path

import pytest
import torch

if sys.version_info < (3, 11):                   # torchtitan 0.3 and triton need Python >= 3.11
    pytest.skip("torchtitan 0.3 needs Python >= 3.11", allow_module_level=True)

import torchtitan  # noqa: E402,F401  the titan extra (dev.py test installs it): pip install 'fringe[titan]'

import fringe.titan  # noqa: E402
from fringe import masks, schedules  # noqa: E402
from fringe.testing import tolerances  # noqa: E402

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
S, P, BS = 64, 2, 8


@pytest.fixture(scope="module")
def titan_train():
    sys.path.insert(0, str(EXAMPLES))
    try:
        yield importlib.import_module("titan_train")
    finally:
        sys.path.remove(str(EXAMPLES))


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny models: one intra-op thread is as fast as two and far faster on a loaded machine."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _model(titan_train, **over):
    cfg = titan_train.Config(**dict(dict(seq_len=S, layers=2, kv_heads=4, head_dim=8), **over))
    model = titan_train.build_model(cfg)
    assert fringe.titan.apply(model) == len(model.layers)
    return cfg, model


# ---- equivalence on gloo ranks ------------------------------------------------------------


def test_titan_example_matches_one_process_on_two_ranks(titan_train):
    """GQA with scaling set, per-row documents that change per step, activation checkpointing."""
    lines = []
    cfg = titan_train.Config(world_size=2, seq_len=128, batch_size=2, steps=2, block_size=16,
                             layers=2, kv_heads=4, head_dim=8, checkpointing=True)
    res = titan_train.run(cfg, progress=lines.append, timeout_s=240)
    tol = tolerances(torch.float32)
    assert res["ok"], lines
    assert len(res["cp"]) == len(res["single"]) == 2
    for a, b in zip(res["cp"], res["single"]):
        assert math.isfinite(a["loss"])
        assert abs(a["loss"] - b["loss"]) <= tol["atol"] + tol["rtol"] * abs(b["loss"]), lines
        for name, g in b["grads"].items():       # each reduced gradient, summed over the ranks
            torch.testing.assert_close(a["grads"][name], g, atol=tol["rtol"] * float(g.abs().max()),
                                       rtol=0.0, msg=name)
    assert res["param_diff"] <= 1e-5, lines
    # torchtitan's FullAC: each layer's attention runs again in the backward, with its plans
    assert {a["attention_calls"] for a in res["cp"]} == {2 * cfg.layers}, lines
    assert res["single"][0]["loss"] != res["single"][1]["loss"]          # it trains
    assert lines[-1].endswith("OK")


# ---- in this process ----------------------------------------------------------------------


def _positions(rows: list[list[int]]) -> torch.Tensor:
    """[B, S] torchtitan positions from each row's document lengths."""
    return torch.stack([torch.cat([torch.arange(n) for n in row]) for row in rows])


def test_the_planned_mask_is_torchtitans_per_row(titan_train):
    _, model = _model(titan_train)
    pos = _positions([[20, 30, 14], [5, 59]])
    plans = fringe.titan.plans(model, schedules.zigzag(), pos, world_size=P, block_size=BS)
    (p,) = plans.plans
    assert p.batch_size == 2                         # rows differ: fringe.plan got batch_size=B
    idx = torch.arange(S)
    got = masks.evaluate(p.mask_mod, idx, idx, B=2)   # [B, 1, S, S] or [B, H, S, S]
    want = titan_train.torchtitan_mask(pos)
    assert torch.equal(got.expand_as(want), want)
    assert p.scale == 8 ** -0.5                      # GQAttention.scaling (head_dim=8)


def test_doc_ids_follow_torchtitans_rule_and_irregular_positions_raise():
    pos = _positions([[3, 1, 4]])
    assert fringe.titan.doc_ids_from_positions(pos).tolist() == [0, 0, 0, 1, 2, 2, 2, 2]
    with pytest.raises(ValueError, match="start at 2, not 0"):
        fringe.titan.doc_ids_from_positions(pos + 2)
    bad = pos.clone()
    bad[0, 5] = 7
    with pytest.raises(ValueError, match="token 5 has position 7, expected 1"):
        fringe.titan.doc_ids_from_positions(bad)
    with pytest.raises(TypeError, match="int tensor"):
        fringe.titan.doc_ids_from_positions(pos.float())


def test_apply_is_idempotent_and_refuses_other_attention(titan_train):
    _, model = _model(titan_train)
    assert fringe.titan.apply(model) == 2
    assert all(isinstance(m.attention.inner_attention, fringe.titan.FringeAttention)
               and m.attention.inner_attention.replaced == "FlexAttention" for m in model.layers.values())

    class Windowed(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner_attention = torch.nn.Identity()
    with pytest.raises(ValueError, match="inner_attention is Identity"):
        fringe.titan.apply(Windowed())
    with pytest.raises(ValueError, match="no module with an inner_attention"):
        fringe.titan.apply(torch.nn.Linear(2, 2))
    fresh = titan_train.build_model(titan_train.Config(seq_len=S, layers=1))
    with pytest.raises(ValueError, match="call fringe.titan.apply"):
        fringe.titan.plans(fresh, schedules.zigzag(), world_size=P, seq_len=S)


def _batch(titan_train, cfg, model, rows=([20, 30, 14], [5, 59])):
    pos = _positions(list(rows))
    inputs, labels, _ = titan_train.make_batch(0, cfg, model.config.vocab_size)
    plans = fringe.titan.plans(model, schedules.zigzag(), pos, world_size=P, block_size=BS)
    shard = fringe.titan.shard_batch(inputs[:, :S], labels[:, :S], plans, positions=pos, rank=1)
    return pos, plans, shard


def test_shard_holds_the_layouts_global_positions_and_targets_as_given(titan_train):
    cfg, model = _model(titan_train)
    pos, plans, shard = _batch(titan_train, cfg, model)
    tokens = plans.layout.positions(1)
    assert torch.equal(shard.position_ids, pos[:, tokens])             # RoPE at global positions
    inputs, labels, _ = titan_train.make_batch(0, cfg, model.config.vocab_size)
    assert torch.equal(shard.shift_labels, labels[:, :S][:, tokens])   # not shifted again
    assert shard.num_items == 2 * S
    kw = fringe.titan.model_inputs(shard, plans, device="cpu")
    assert set(kw) == {"tokens", "positions", "attention_masks"}
    assert torch.equal(kw["tokens"], shard.input_ids) and kw["attention_masks"].positions is kw["positions"]
    assert kw["attention_masks"].batch_fingerprint == plans.layout_fingerprint


def test_mistakes_raise_before_attention_runs(titan_train):
    cfg, model = _model(titan_train)
    pos, plans, shard = _batch(titan_train, cfg, model)
    kw = fringe.titan.model_inputs(shard, plans)
    with pytest.raises(ValueError, match="needs this batch's plans as attention_masks"):
        model(kw["tokens"], kw["positions"])
    with pytest.raises(ValueError, match="positions=None, so RoPE would use local indices"):
        model(kw["tokens"], None, kw["attention_masks"])
    with pytest.raises(ValueError, match="not the shard's RoPE positions"):
        model(kw["tokens"], torch.arange(S // P).expand(2, -1), kw["attention_masks"])
    # plans not bound to the batch by model_inputs (never checked against it)
    with pytest.raises(ValueError, match="plans not bound to a batch"):
        model(kw["tokens"], kw["positions"], plans)
    # plans for another batch (other documents) with the same layout
    other = fringe.titan.plans(model, schedules.zigzag(), _positions([[32, 32], [5, 59]]),
                               world_size=P, block_size=BS)
    with pytest.raises(ValueError, match="batch mismatch"):
        fringe.titan.model_inputs(shard, other)
    # a layer whose scale is not its plan's
    model.layers["0"].attention.scaling = 0.5            # the first layer: nothing ran yet
    with pytest.raises(ValueError, match=r"layer layers\.0\.attention scales scores by 0\.5"):
        model(**kw)
    with pytest.raises(ValueError, match="reads each layer's scale"):
        fringe.titan.plans(model, schedules.zigzag(), pos, world_size=P, scale=0.5)


def test_layers_with_two_scales_get_two_plans_over_one_layout(titan_train):
    cfg, model = _model(titan_train)
    model.layers["1"].attention.scaling = 0.25
    scales = fringe.titan.layer_scales(model)
    assert scales == {8 ** -0.5: ["layers.0.attention"], 0.25: ["layers.1.attention"]}
    plans = fringe.titan.plans(model, schedules.zigzag(), _positions([[64], [64]]),
                               world_size=P, block_size=BS)
    assert sorted(p.scale for p in plans.plans) == sorted(scales)
    assert len({p.layout.fingerprint() for p in plans.plans}) == 1
    with pytest.raises(ValueError, match="seq_len=32 but positions have S=64"):
        fringe.titan.plans(model, schedules.zigzag(), _positions([[64]]), world_size=P, seq_len=32)
    with pytest.raises(ValueError, match="fringe.titan.plans: "):
        fringe.titan.plans(model, schedules.zigzag(), _positions([[60]]), world_size=P, block_size=BS)


def test_public_surface():
    assert sorted(fringe.titan.__all__) == ["FringeAttention", "Plans", "apply", "doc_ids_from_positions",
                                            "layer_scales", "model_inputs", "plans", "shard_batch"]
