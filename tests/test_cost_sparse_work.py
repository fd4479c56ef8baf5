"""The cost model's sparse work model (fringe.cost.work: the fused call plan counted on row runs
of rectangles, never a dense map) equals the one call planner run on dense maps
(fringe.ops.calls.fused_pieces), map by map and tile by tile."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import fringe
from fringe import masks, schedules
from fringe.cost import work as cost_work
from fringe.masks import BlockKind
from fringe.ops.calls import fused_pieces

_FULL, _PARTIAL, _EMPTY = int(BlockKind.FULL), int(BlockKind.PARTIAL), int(BlockKind.EMPTY)


def dense_work(maps: np.ndarray, *, block_size: int, masked_ok: bool) -> np.ndarray:
    """``[N, 4]`` (calls, full, masked, causal pairs) of dense maps ``[N, n, n]`` by the planner
    itself: the maps stacked with an EMPTY row between them, planned in one pass."""
    N, n, _ = maps.shape
    bs = block_size
    tall = np.full((N, n + 1, n), _EMPTY, dtype=np.int8)
    tall[:, :n] = maps
    tall = tall.reshape(N * (n + 1), n)
    q0, q1, k0, k1, causal, src, work = fused_pieces(
        tall, per=n + 1, Lq=tall.shape[0] * bs, Lk=n * bs, block_size=bs, runs_ok=masked_ok)
    out = np.zeros((N, 4))
    for a, b, c, d, sq, s in zip(q0.tolist(), q1.tolist(), k0.tolist(), k1.tolist(),
                                 causal.tolist(), src.tolist()):
        codes = (tall, work)[s][a:b, c:d]
        pairs = float((b - a) * (d - c) * bs * bs)
        u = a // (n + 1)
        out[u, 0] += 1
        if sq:
            out[u, 3] += pairs
        elif (codes == _FULL).all() or not masked_ok:
            out[u, 1] += pairs
        else:
            out[u, 2] += pairs
    return out


def _maps(g: torch.Generator, n: int) -> np.ndarray:
    """Random maps, causal diagonals with noise, shifted ones, and packed documents."""
    out = [torch.randint(0, 3, (8, n, n), generator=g)]
    tri = torch.full((n, n), _EMPTY)
    tri[torch.tril(torch.ones(n, n, dtype=torch.bool), -1)] = _FULL
    tri[torch.arange(n), torch.arange(n)] = _PARTIAL
    for noise in (0.0, 0.03, 0.2):
        m = tri.repeat(6, 1, 1)
        hit = torch.rand(m.shape, generator=g) < noise
        m[hit] = torch.randint(0, 3, (int(hit.sum()),), generator=g)
        for a in range(0, 6, 2):
            m[a] = torch.roll(m[a], int(torch.randint(-n, n, (1,), generator=g)), 1)
        out.append(m)
    for _ in range(6):                                  # documents: causal squares on a diagonal
        cuts = torch.sort(torch.randint(0, n + 1, (3,), generator=g)).values.tolist()
        m = torch.full((n, n), _EMPTY)
        for a, b in zip([0] + cuts, cuts + [n]):
            m[a:b, a:b] = tri[:b - a, :b - a]
        if int(torch.randint(0, 2, (1,), generator=g)):
            m[:, : n // 2] = torch.where(m[:, : n // 2] == _EMPTY, _FULL, m[:, : n // 2])
        out.append(m[None])
    out.append(torch.full((1, n, n), _FULL))
    out.append(torch.full((1, n, n), _EMPTY))
    return torch.cat(out).to(torch.int8).numpy()


@pytest.mark.parametrize("paint", [True, False])
@pytest.mark.parametrize("n", [1, 2, 5, 8, 13, 24])
def test_sparse_work_equals_the_planner_on_dense_maps(n, paint, monkeypatch):
    # column cuts of a row group: painted (small groups) or on its runs (large ones)
    monkeypatch.setattr(cost_work, "_SPLIT_DENSE", 1 << 30 if paint else 0)
    g = torch.Generator().manual_seed(100 + n)
    maps = _maps(g, n)
    squares = 0
    for masked_ok in (True, False):
        want = dense_work(maps, block_size=4, masked_ok=masked_ok)
        got = cost_work._maps_work(maps, L=4 * n, block_size=4, masked_ok=masked_ok)
        np.testing.assert_array_equal(got, want)
        squares += int((want[:, 3] > 0).sum())
    assert squares >= 5                                 # the causal squares are exercised


@pytest.mark.parametrize("mask_kind", ["causal", "document", "window"])
@pytest.mark.parametrize("name", ["ring", "zigzag", "striped", "balanced"])
def test_tile_work_from_rectangles_equals_the_planner_tile_by_tile(name, mask_kind, monkeypatch):
    monkeypatch.setattr(cost_work, "_SPLIT_DENSE", 64)         # both ways of cutting columns
    S, P, bs = 4096, 4, 32
    m = {"causal": masks.causal(),
         "document": masks.causal() & masks.document(fringe.testing.packed_docs(S, 7, 0)),
         "window": masks.sliding_window(700)}[mask_kind]
    p = fringe.plan(schedules.get(name), m, seq_len=S, world_size=P, block_size=bs)
    got = cost_work.tile_work(p)
    n = p.local_len // bs
    tiles = torch.as_tensor(p.tiles).numpy()
    maps = np.stack([p.tile_blocks(i, j).numpy() for i in range(P) for j in range(P)])
    want = dense_work(maps, block_size=bs, masked_ok=True).reshape(P, P, 4)
    want[tiles == _EMPTY] = 0
    np.testing.assert_array_equal(got, want)
    assert (got[..., 0] > 0).sum() == (tiles != _EMPTY).sum() and n > 1
