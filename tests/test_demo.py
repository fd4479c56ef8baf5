"""The demo: CP training on spawned gloo ranks matches the single-process run; the CLI's show."""
from __future__ import annotations

import math
import re

import pytest
import torch

import fringe
from fringe import demo, render
from fringe.__main__ import main
from fringe.ops import reference


def _first_step_loss(cfg: demo.DemoConfig, mask_kind: str) -> float:
    """Step 0's loss in one process, dense attention under ``mask_kind``, same init and data."""
    model = demo.build_model(cfg)
    tokens, targets, doc_ids = demo.make_batch(0, seq_len=cfg.seq_len, seed=cfg.seed)
    mask = demo.make_mask(mask_kind, doc_ids, window=cfg.window)

    def attend(q, k, v):
        return reference.attention(q, k, v, mask_mod=mask)[0]
    with torch.no_grad():
        logits = model(tokens, torch.arange(cfg.seq_len), attend)
    return (demo._loss_sum(logits, targets) / (targets != demo.IGNORE).sum()).item()


def test_demo_cp_matches_single_process():
    cfg = demo.DemoConfig(world_size=2, seq_len=256, block_size=32, steps=3)
    lines = []
    result = demo.run_demo(cfg, progress=lines.append, timeout_s=120)
    assert [s.step for s in result.steps] == [0, 1, 2]
    for s in result.steps:
        assert math.isfinite(s.loss_cp) and math.isfinite(s.loss_single)
        assert s.diff <= cfg.tolerance, (s.step, s.loss_cp, s.loss_single)
    assert result.ok
    assert result.max_param_diff < 1e-3        # Adam can amplify a near-zero gradient's sign
    # it trains: three AdamW steps at lr 1e-2 lower the loss well beyond the tolerance
    assert result.steps[-1].loss_single < result.steps[0].loss_single - 100 * cfg.tolerance
    # the check has power: step 0's CP loss is the document-masked one, and plain causal
    # attention (documents leaking into each other) is far outside the tolerance
    assert abs(result.steps[0].loss_cp - _first_step_loss(cfg, "document")) <= cfg.tolerance
    assert abs(result.steps[0].loss_cp - _first_step_loss(cfg, "causal")) > 100 * cfg.tolerance
    # progress: one line per step, with the losses of the result
    step_lines = [line for line in lines if line.startswith("step ")]
    assert len(step_lines) == 3
    for s, line in zip(result.steps, step_lines):
        m = re.match(r"step (\d+)/3  loss cp (\S+)  single (\S+)  ", line)
        assert m is not None, line
        assert int(m[1]) == s.step + 1
        assert float(m[2]) == pytest.approx(s.loss_cp, abs=1e-6)
        assert float(m[3]) == pytest.approx(s.loss_single, abs=1e-6)
    verdict = [line for line in result.report().splitlines() if line.startswith("max |loss diff|")]
    assert len(verdict) == 1 and verdict[0].endswith("(float32): OK"), verdict


def test_batches_change_every_step():
    t0, y0, d0 = demo.make_batch(0, seq_len=256, seed=0)
    t1, y1, d1 = demo.make_batch(1, seq_len=256, seed=0)
    assert t0.shape == y0.shape == (1, 256) and d0.shape == (256,)
    assert not torch.equal(d0, d1)                                  # new document boundaries
    ends = torch.nonzero(d0[1:] != d0[:-1]).flatten()
    assert (y0[0, ends] == demo.IGNORE).all() and y0[0, -1] == demo.IGNORE
    inside = (y0[0] != demo.IGNORE)
    assert torch.equal(y0[0, inside], t0[0, 1:][inside[:-1]])


def test_model_is_layout_agnostic():
    # the model only sees positions through RoPE: running it on a permutation of the tokens
    # (with their global positions and the global mask) permutes the logits
    cfg = demo.DemoConfig(seq_len=64, dtype="float64")
    model = demo.build_model(cfg)
    tokens, _, doc_ids = demo.make_batch(0, seq_len=64, seed=0)
    mask = demo.make_mask("document", doc_ids)

    def attend_at(pos):
        def attend(q, k, v):
            out, _ = reference.attend(q, k, v, q_pos=pos, kv_pos=pos,
                                      mask=reference.mask_for(mask, pos, pos, B=1, H=q.shape[1]),
                                      score_mod=None, scale=q.shape[-1] ** -0.5)
            return out
        return attend

    pos = torch.arange(64)
    perm = torch.randperm(64, generator=torch.Generator().manual_seed(0))
    full = model(tokens, pos, attend_at(pos))
    permuted = model(tokens[:, perm], perm, attend_at(perm))
    torch.testing.assert_close(permuted, full[:, perm])


def test_cli_show_prints_the_plans_grid_and_stats(capsys):
    assert main(["show", "--world-size", "2", "--seq-len", "256", "--block-size", "32",
                 "--backward"]) == 0
    out = capsys.readouterr().out
    _, _, doc_ids = demo.make_batch(0, seq_len=256, seed=0)
    p = fringe.plan(demo.make_schedule("zigzag"), demo.make_mask("document", doc_ids),
                    seq_len=256, world_size=2, block_size=32)
    for part in (render.table(p), render.table(p, backward=True), p.stats().table()):
        assert part in out
    assert "rank 1" in out and "rank 2" not in out and "work balance" in out


def test_cli_reports_bad_sizes(capsys):
    assert main(["show", "--world-size", "4", "--seq-len", "100", "--block-size", "32"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: S=100 is not divisible by 2*P*block=2*4*32=256"), err
    assert "pad the sequence to 256" in err and "Traceback" not in err
