"""The demo: CP training on spawned gloo ranks matches the single-process run; the CLI's show."""
from __future__ import annotations

import math

import torch

from fringe import demo
from fringe.__main__ import main


def test_demo_cp_matches_single_process():
    cfg = demo.DemoConfig(world_size=2, seq_len=256, block_size=32, steps=3)
    lines = []
    result = demo.run_demo(cfg, progress=lines.append, timeout_s=120)
    assert len(result.steps) == 3
    for s in result.steps:
        assert math.isfinite(s.loss_cp) and math.isfinite(s.loss_single)
        assert s.diff <= cfg.tolerance, (s.step, s.loss_cp, s.loss_single)
    assert result.ok
    assert result.max_param_diff < 1e-3
    assert sum(line.startswith("step ") for line in lines) == 3
    report = result.report()
    assert "loss (CP)" in report and "OK" in report


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
    from fringe.ops import reference

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


def test_cli_show_prints_grid(capsys):
    assert main(["show", "--world-size", "2", "--seq-len", "256", "--block-size", "32"]) == 0
    out = capsys.readouterr().out
    assert "rank 0" in out and "rank 1" in out and "work balance" in out


def test_cli_reports_bad_sizes(capsys):
    assert main(["show", "--world-size", "4", "--seq-len", "100", "--block-size", "32"]) == 2
    assert "error" in capsys.readouterr().err
