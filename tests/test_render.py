"""Figures: the tile map and the timeline return Figures and never touch pyplot's state."""
from __future__ import annotations

import matplotlib
import numpy as np
import pytest
from matplotlib.figure import Figure

import fringe
from fringe import masks, render, schedules
from fringe.runtime import costmodel
from fringe.testing import make_qkv


def _pyplot_figures() -> int:
    import sys
    plt = sys.modules.get("matplotlib.pyplot")
    return len(plt.get_fignums()) if plt else 0


def test_tile_map_colours_each_block_by_the_rank_and_step_computing_it():
    P, S, bs = 4, 64, 4
    p = fringe.plan(schedules.zigzag(), masks.causal(), seq_len=S, world_size=P, block_size=bs)
    backend, before = matplotlib.get_backend(), _pyplot_figures()
    fig = render.tile_map_figure(p)
    assert isinstance(fig, Figure)
    assert matplotlib.get_backend() == backend and _pyplot_figures() == before
    rank_ax, step_ax = [ax for ax in fig.axes if ax.images]   # (colorbars have none)
    rank_img, step_img = rank_ax.images[0].get_array(), step_ax.images[0].get_array()
    owner = np.empty(S // bs, dtype=int)                # natural block -> rank holding it
    for r in range(P):
        owner[p.layout.positions(r)[::bs].numpy() // bs] = r
    when = {(op.q, op.kv): (prog.rank, s.index) for prog in p.forward for s in prog.steps
            for op in s.computes}
    nb = S // bs
    for a in range(nb):
        for b in range(nb):
            if b > a:                                   # causal: above the diagonal is EMPTY
                assert rank_img.mask[a, b] and step_img.mask[a, b]
            else:
                rank, step = when[(owner[a], owner[b])]
                assert rank_img[a, b] == rank and step_img[a, b] == step
    assert "PARTIAL" in fig._suptitle.get_text()


def test_tile_map_samples_large_grids():
    p = fringe.plan(schedules.ring(), masks.causal(), seq_len=8192, world_size=8, block_size=16)
    fig = render.tile_map_figure(p, max_blocks=64)
    assert fig.axes[0].images[0].get_array().shape == (64, 64)
    assert "every 8th block" in fig._suptitle.get_text()


def test_timeline_from_a_virtual_run_and_from_the_cost_model():
    P, S = 4, 64
    p = fringe.plan(schedules.zigzag(), masks.causal(), seq_len=S, world_size=P, block_size=4)
    q, k, v = make_qkv(B=1, H=2, G=1, S=S, D=4, seed=0)
    states = fringe.simulate.forward_states(q, k, v, plan=p)
    records = [rec for st in states.values() for rec in st.records]
    backend, before = matplotlib.get_backend(), _pyplot_figures()
    fig = render.timeline_figure(records)
    assert isinstance(fig, Figure) and len(fig.axes) == 1
    bars = [c for c in fig.axes[0].collections]
    assert len(bars) >= P                              # compute bars for every rank at least
    pred = costmodel.simulate(p, "cpu")
    fig2 = render.timeline_figure(pred)
    assert [ax.get_title(loc="left") for ax in fig2.axes] == ["forward", "backward"]
    fig3 = render.timeline_figure(pred.records("forward"))
    assert len(fig3.axes) == 1
    ax = render.timeline(records)
    assert len(ax.patches) == 2 * len(records) and isinstance(ax.figure, Figure)
    assert matplotlib.get_backend() == backend and _pyplot_figures() == before


def test_timeline_aggregates_many_ranks():
    p = fringe.plan(schedules.ring(), masks.causal(), seq_len=8192, world_size=128, block_size=16)
    pred = costmodel.simulate(p, "h100-ib")
    fig = render.timeline_figure(pred, which="forward", max_ranks=16, bins=50)
    ax = fig.axes[0]
    assert len(ax.images) == 1 and not ax.collections  # one pooled image, no per-rank bars
    img = ax.images[0].get_array()
    assert img.shape == (16, 50, 3)
    assert np.isfinite(img).all() and (img >= 0).all() and (img <= 1 + 1e-9).all()


def test_timeline_rejects_what_it_cannot_draw():
    with pytest.raises(ValueError, match="StepRecords or a costmodel.Prediction"):
        render.timeline_figure([])
    p = fringe.plan(schedules.ring(), None, seq_len=64, world_size=2, block_size=4)
    with pytest.raises(ValueError, match="'forward' and/or 'backward'"):
        render.timeline_figure(costmodel.simulate(p, "cpu"), which="sideways")


def test_show_png_writes_the_tile_map_and_the_timeline(tmp_path, capsys):
    from fringe.__main__ import main
    out = tmp_path / "zz.png"
    assert main(["show", "--world-size", "2", "--seq-len", "512", "--png", str(out)]) == 0
    assert out.stat().st_size > 1000 and (tmp_path / "zz.timeline.png").stat().st_size > 1000
    assert main(["show", "--world-size", "2", "--seq-len", "512", "--png", "x.svg"]) == 2
    assert "ending in .png" in capsys.readouterr().err
