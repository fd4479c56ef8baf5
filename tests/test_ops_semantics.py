"""fringe.ops: exact in the corner cases (issue 7): lse cotangents, gradients for tensors a
score_mod captures, score_mod semantics (FlexAttention's, per scalar), NaN confinement, D=0.

Every check is float64 against the dense reference ``fringe.ops.reference.attention`` with
plain autograd, with the problem split into kv tiles of different kinds (FULL, PARTIAL, and
PARTIAL with a block map) and the GLOBAL out/lse passed to every tile's backward.

Legend: B batch · H query heads · G kv heads · S sequence · L tokens · D head dim.
"""
from __future__ import annotations

import math

import pytest
import torch
from torch.testing import assert_close

from fringe.masks import BlockKind
from fringe.ops import merge, reference, tile_backward, tile_forward
from fringe.testing import make_qkv, tolerances

TIGHT = tolerances(torch.float64)
KERNELS = ["reference", "sdpa"]


def doc_mask(S: int, n_docs: int):
    """Document (& causal) mask over S tokens in n_docs equal documents; returns (mod, doc)."""
    doc = torch.arange(S) * n_docs // S
    return (lambda b, h, q, kv: (doc[q] == doc[kv]) & (q >= kv)), doc


def block_map(mask_mod, q_pos, kv_pos, *, B, H, block_size):
    """Exact BlockKind map of one tile by dense evaluation (test-only)."""
    m = reference.mask_for(mask_mod, q_pos, kv_pos, B=B, H=H)
    shape = (q_pos.numel(), kv_pos.numel())
    some, every = m.any(0).any(0).expand(shape), m.all(0).all(0).expand(shape)
    nq, nk = -(-shape[0] // block_size), -(-shape[1] // block_size)
    blocks = torch.empty(nq, nk, dtype=torch.int8)
    for i in range(nq):
        for j in range(nk):
            box = (slice(i * block_size, (i + 1) * block_size),
                   slice(j * block_size, (j + 1) * block_size))
            blocks[i, j] = int(BlockKind.FULL if every[box].all() else
                               BlockKind.PARTIAL if some[box].any() else BlockKind.EMPTY)
    return blocks


def tile_kwargs(mask_mod, q_pos, kv_pos, *, B, H, how, block_size=4):
    """kind/blocks arguments for one tile: 'full' (only when the mask is all True there),
    'partial' (dense mask), 'blocks' (block-sparse path)."""
    if how == "full":
        return dict(kind=BlockKind.FULL)
    if how == "partial":
        return dict(kind=BlockKind.PARTIAL, mask_mod=mask_mod)
    blocks = block_map(mask_mod, q_pos, kv_pos, B=B, H=H, block_size=block_size)
    return dict(kind=BlockKind.PARTIAL, mask_mod=mask_mod, blocks=blocks, block_size=block_size)


def run_tiles(q, k, v, dout, dlse, pieces, *, kernel, score_mod=None, score_params=(),
              mask_mod=None):
    """Forward over kv pieces (pos, how) + merge, then the sum of tile_backward over them."""
    B, H, S = q.shape[0], q.shape[1], q.shape[2]
    q_pos = torch.arange(S)
    out = lse = None
    for kv_pos, how in pieces:
        kw = tile_kwargs(mask_mod, q_pos, kv_pos, B=B, H=H, how=how)
        o, l = tile_forward(q, k[:, :, kv_pos], v[:, :, kv_pos], q_pos=q_pos, kv_pos=kv_pos,
                            score_mod=score_mod, kernel=kernel, **kw)
        out, lse = (o, l) if out is None else merge(out, lse, o, l)
    out = out.to(q.dtype)
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    dparams = [torch.zeros_like(p) for p in score_params]
    for kv_pos, how in pieces:
        kw = tile_kwargs(mask_mod, q_pos, kv_pos, B=B, H=H, how=how)
        res = tile_backward(q, k[:, :, kv_pos], v[:, :, kv_pos], out, lse, dout, q_pos=q_pos,
                            kv_pos=kv_pos, score_mod=score_mod, kernel=kernel, dlse=dlse,
                            score_params=score_params, **kw)
        assert len(res) == (4 if score_params else 3)
        dq += res[0]
        dk[:, :, kv_pos] += res[1]
        dv[:, :, kv_pos] += res[2]
        for acc, g in zip(dparams, res[3] if score_params else ()):
            acc += g
    return out, lse, (dq, dk, dv), tuple(dparams)


# ---------------------------------------------------------------------------------------------
# item 7: the lse cotangent


LOSSES = {
    "out_and_lse": lambda out, lse, w, u: (out * w).sum() + (lse * u).sum(),
    "z_loss": lambda out, lse, w, u: (out * w).sum() + 1e-1 * (lse ** 2).sum(),
    "lse_only": lambda out, lse, w, u: (lse * u).sum(),
}


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("loss", sorted(LOSSES))
def test_lse_cotangent_summed_over_tiles_is_exact(kernel, loss, monkeypatch):
    B, H, G, S, D = 2, 4, 2, 24, 5
    if kernel == "sdpa":            # the fused op takes dlse itself (lse_only: padded route)
        import fringe.ops._fast as fast

        assert fast.SDPA.available("cpu")[0] and fast.SDPA.exact_dlse
        monkeypatch.setattr(fast.REFERENCE, "backward", None)
    mod, doc = doc_mask(S, 3)
    live = lambda b, h, q, kv: mod(b, h, q, kv) & (q % 7 != 3)       # noqa: E731 (dead rows)
    q, k, v = make_qkv(B=B, H=H, G=G, S=S, D=D, seed=11, requires_grad=True)
    g = torch.Generator().manual_seed(12)
    w = torch.randn(B, H, S, D, generator=g, dtype=torch.float64)
    u = torch.randn(B, H, S, generator=g, dtype=torch.float64)
    out_r, lse_r = reference.attention(q, k, v, mask_mod=live)
    lse_f = lse_r.masked_fill(torch.isneginf(lse_r), 0.0)          # dead rows: lse -inf
    want = torch.autograd.grad(LOSSES[loss](out_r, lse_f, w, u), (q, k, v), allow_unused=True)
    want = tuple(torch.zeros_like(t) if g is None else g for t, g in zip((q, k, v), want))

    qd, kd, vd = (t.detach() for t in (q, k, v))
    out_d, lse_d = out_r.detach().requires_grad_(), lse_r.detach().requires_grad_()
    lse_d2 = lse_d.masked_fill(torch.isneginf(lse_d), 0.0)
    dout, dlse = torch.autograd.grad(LOSSES[loss](out_d, lse_d2, w, u), (out_d, lse_d),
                                     allow_unused=True)
    dout = torch.zeros_like(out_d) if dout is None else dout
    pos = torch.arange(S)
    pieces = [(pos[:8], "partial"), (pos[8:17], "blocks"), (pos[17:], "partial")]
    out, lse, got, _ = run_tiles(qd, kd, vd, dout, dlse, pieces, kernel=kernel, mask_mod=live)
    assert_close(out, out_r.detach(), **TIGHT)
    assert torch.equal(torch.isneginf(lse), torch.isneginf(lse_r))
    assert_close(got, want, **TIGHT)
    if loss != "out_and_lse":
        return
    # the lse term matters: dropping it changes dq by far more than the tolerance
    _, _, without, _ = run_tiles(qd, kd, vd, dout, None, pieces, kernel=kernel, mask_mod=live)
    assert (without[0] - want[0]).abs().max() > 1e-2


@pytest.mark.parametrize("kernel", KERNELS)
def test_dead_rows_get_zero_gradient_whatever_dlse(kernel):
    B, H, S, D = 1, 2, 8, 3
    q, k, v = make_qkv(B=B, H=H, G=H, S=S, D=D, seed=3)
    dead_mod = lambda b, h, q, kv: (q % 2 == 0) & (q >= kv)           # noqa: E731
    pos = torch.arange(S)
    out, lse = tile_forward(q, k, v, q_pos=pos, kv_pos=pos, mask_mod=dead_mod, kernel=kernel)
    assert torch.isneginf(lse[..., 1::2]).all()
    dout = torch.randn(B, H, S, D, generator=torch.Generator().manual_seed(4), dtype=q.dtype)
    dlse = torch.full((B, H, S), 5.0, dtype=q.dtype)
    dq, dk, dv = tile_backward(q, k, v, out, lse, dout, q_pos=pos, kv_pos=pos,
                               mask_mod=dead_mod, kernel=kernel, dlse=dlse)
    assert torch.equal(dq[..., 1::2, :], torch.zeros_like(dq[..., 1::2, :]))
    assert all(torch.isfinite(t).all() for t in (dq, dk, dv))
    with pytest.raises(ValueError, match=r"dlse must have shape \[1, 2, 8\]"):
        tile_backward(q, k, v, out, lse, dout, q_pos=pos, kv_pos=pos, kernel=kernel,
                      dlse=dlse[..., :3])


# ---------------------------------------------------------------------------------------------
# item 5: gradients for tensors a score_mod captures


def relative_bias(H: int, S: int, seed: int):
    """attention-gym's relative-position bias: an nn.Parameter indexed inside the score_mod."""
    g = torch.Generator().manual_seed(seed)
    bias = torch.nn.Parameter(torch.randn(H, 2 * S - 1, generator=g, dtype=torch.float64))

    def rel_bias(score, b, h, q_idx, kv_idx):
        return score + bias[h, q_idx - kv_idx + S - 1]

    return rel_bias, bias


@pytest.mark.parametrize("kernel", KERNELS)
def test_score_params_gradient_summed_over_tiles_is_exact(kernel):
    B, H, G, S, D = 2, 4, 2, 20, 4
    mod, _ = doc_mask(S, 2)
    score_mod, bias = relative_bias(H, S, seed=21)
    scale_t = torch.nn.Parameter(torch.tensor(0.7, dtype=torch.float64))

    def two_params(score, b, h, q_idx, kv_idx):         # a second, multiplicative param
        return score_mod(score, b, h, q_idx, kv_idx) * scale_t

    q, k, v = make_qkv(B=B, H=H, G=G, S=S, D=D, seed=22, requires_grad=True)
    gen = torch.Generator().manual_seed(23)
    w = torch.randn(B, H, S, D, generator=gen, dtype=torch.float64)
    u = torch.randn(B, H, S, generator=gen, dtype=torch.float64)
    out_r, lse_r = reference.attention(q, k, v, mask_mod=mod, score_mod=two_params)
    params = (bias, scale_t)
    want = torch.autograd.grad((out_r * w).sum() + (lse_r * u).sum(), (q, k, v, *params))

    pos = torch.arange(S)
    pieces = [(pos[:6], "partial"), (pos[6:13], "blocks"), (pos[13:], "partial")]
    qd, kd, vd = (t.detach() for t in (q, k, v))
    out, lse, got, dparams = run_tiles(qd, kd, vd, w, u, pieces, kernel=kernel, mask_mod=mod,
                                       score_mod=two_params, score_params=params)
    assert_close(out, out_r.detach(), **TIGHT)
    assert_close(got, want[:3], **TIGHT)
    assert [p.shape for p in dparams] == [p.shape for p in params]
    assert [p.dtype for p in dparams] == [p.dtype for p in params]
    assert_close(dparams, want[3:], **TIGHT)
    assert bias.grad is None                       # returned, never accumulated into .grad
    assert dparams[0].abs().sum() > 0


def test_score_params_full_tile_and_unused_param():
    B, H, S, D = 1, 2, 6, 3
    score_mod, bias = relative_bias(H, S, seed=31)
    unused = torch.nn.Parameter(torch.ones(3, dtype=torch.float64))
    q, k, v = make_qkv(B=B, H=H, G=H, S=S, D=D, seed=32, requires_grad=True)
    out_r, lse_r = reference.attention(q, k, v, score_mod=score_mod)
    dout = torch.randn_like(out_r)
    want = torch.autograd.grad(out_r, (q, k, v, bias), dout)
    pos = torch.arange(S)
    dq, dk, dv, (dbias, dunused) = tile_backward(
        q.detach(), k.detach(), v.detach(), out_r.detach(), lse_r.detach(), dout, q_pos=pos,
        kv_pos=pos, kind=BlockKind.FULL, score_mod=score_mod, score_params=(bias, unused))
    assert_close((dq, dk, dv, dbias), want, **TIGHT)
    assert torch.equal(dunused, torch.zeros_like(unused))
    with pytest.raises(ValueError, match="score_params given .* without a score_mod"):
        tile_backward(q.detach(), k.detach(), v.detach(), out_r.detach(), lse_r.detach(), dout,
                      q_pos=pos, kv_pos=pos, score_params=(bias,))
    with pytest.raises(ValueError, match=r"score_params\[0\] must be a tensor that requires grad"):
        tile_backward(q.detach(), k.detach(), v.detach(), out_r.detach(), lse_r.detach(), dout,
                      q_pos=pos, kv_pos=pos, score_mod=score_mod, score_params=(bias.detach(),))


# ---------------------------------------------------------------------------------------------
# item 4: score_mod means what it means in FlexAttention (defined per scalar, vmapped)


def embedding_mods(S: int, H: int, seed: int):
    """Two score_mods written for scalar indices, and the elementwise mod they equal."""
    g = torch.Generator().manual_seed(seed)
    emb = torch.randn(S, 3, generator=g, dtype=torch.float64)
    per_head = torch.randn(H, 4, generator=g, dtype=torch.float64)

    def dot_mod(score, b, h, q_idx, kv_idx):          # torch.dot rejects broadcast vectors
        return score + torch.dot(emb[q_idx], emb[kv_idx])

    def sum_mod(score, b, h, q_idx, kv_idx):          # broadcasting would sum over every head
        return score + per_head[h].sum() * 0.1

    gram, head_sum = emb @ emb.T, per_head.sum(-1) * 0.1

    def elementwise(score, b, h, q_idx, kv_idx):
        return score + gram[q_idx, kv_idx] + head_sum[h]

    def both(score, b, h, q_idx, kv_idx):
        return sum_mod(dot_mod(score, b, h, q_idx, kv_idx), b, h, q_idx, kv_idx)

    return both, elementwise, (dot_mod, sum_mod)


def test_score_mod_broadcast_only_where_it_agrees_with_vmap():
    both, elementwise, (dot_mod, sum_mod) = embedding_mods(12, 3, seed=41)
    pos = torch.arange(12)
    kw = dict(B=2, H=3, q_pos=pos, kv_pos=pos)
    assert reference.broadcast_agrees(elementwise, **kw)
    assert not reference.broadcast_agrees(dot_mod, **kw)       # broadcasting raises
    assert not reference.broadcast_agrees(sum_mod, **kw)       # broadcasting mis-evaluates
    assert not reference.broadcast_agrees(both, **kw)
    # the sum_mod would run silently wrong by broadcasting: the probe is what catches it
    s = torch.zeros(2, 3, 4, 4, dtype=torch.float64)
    b, h = torch.arange(2).view(-1, 1, 1, 1), torch.arange(3).view(1, -1, 1, 1)
    bcast = sum_mod(s, b, h, pos[:4].view(1, 1, -1, 1), pos[:4].view(1, 1, 1, -1))
    assert not torch.allclose(bcast.expand_as(s),
                              reference.apply_score_mod(s, sum_mod, pos[:4], pos[:4]))


@pytest.mark.parametrize("kernel", KERNELS)
def test_scalar_score_mods_tile_forward_backward_match_elementwise_twin(kernel):
    B, H, G, S, D = 2, 3, 3, 12, 4
    both, elementwise, _ = embedding_mods(S, H, seed=42)
    mod, _ = doc_mask(S, 2)
    q, k, v = make_qkv(B=B, H=H, G=G, S=S, D=D, seed=43, requires_grad=True)
    out_r, lse_r = reference.attention(q, k, v, mask_mod=mod, score_mod=elementwise)
    dout = torch.randn_like(out_r)
    want = torch.autograd.grad(out_r, (q, k, v), dout)
    pos = torch.arange(S)
    pieces = [(pos[:5], "partial"), (pos[5:], "blocks")]
    qd, kd, vd = (t.detach() for t in (q, k, v))
    out, lse, got, _ = run_tiles(qd, kd, vd, dout, None, pieces, kernel=kernel, mask_mod=mod,
                                 score_mod=both)
    assert_close((out, lse), (out_r.detach(), lse_r.detach()), **TIGHT)
    assert_close(got, want, **TIGHT)
    # the dense reference itself applies mods per FlexAttention
    assert_close(reference.attention(qd, kd, vd, mask_mod=mod, score_mod=both)[0],
                 out_r.detach(), **TIGHT)


def test_score_mod_that_cannot_be_vmapped_raises_as_flex_would():
    def item_mod(score, b, h, q_idx, kv_idx):
        return score + (1.0 if q_idx.item() > 2 else 0.0)

    def bad_shape(score, b, h, q_idx, kv_idx):
        return torch.stack([score, score])

    q, k, v = make_qkv(B=1, H=2, G=2, S=6, D=3, seed=44)
    for mod, match in ((item_mod, "fails when applied per .* with torch.func.vmap"),
                       (bad_shape, "must return one score per")):
        with pytest.raises(reference.ScoreModError, match=match):
            reference.attention(q, k, v, score_mod=mod)
        with pytest.raises(ValueError, match=match):
            tile_forward(q, k, v, q_pos=torch.arange(6), kv_pos=torch.arange(6), score_mod=mod)


# ---------------------------------------------------------------------------------------------
# item 6: a NaN never crosses documents


def ragged_docs(bounds: list[int]):
    """Document & causal mask with documents [bounds[i], bounds[i+1]) (not block-aligned)."""
    doc = torch.bucketize(torch.arange(bounds[-1]), torch.tensor(bounds[1:]), right=True)
    return (lambda b, h, q, kv: (doc[q] == doc[kv]) & (q >= kv)), doc


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("layout", ["one_partial_tile", "blocks", "mixed"])
def test_nan_in_one_documents_keys_stays_in_that_document(kernel, layout):
    B, H, G, D = 1, 4, 2, 5
    bounds = [0, 6, 14, 23, 32]                  # block_size 4: blocks straddle documents
    S = bounds[-1]
    mod, doc = ragged_docs(bounds)
    q, k, v = make_qkv(B=B, H=H, G=G, S=S, D=D, seed=51)
    k_nan = k.clone()
    k_nan[:, 1, 2:5, 1] = math.nan               # doc 0, one kv head, a few keys
    k_nan[:, 0, 4, :] = math.nan
    other = doc != 0
    gen = torch.Generator().manual_seed(52)
    dout = torch.randn(B, H, S, D, generator=gen, dtype=torch.float64)
    dout_nan = dout.clone()
    dout_nan[:, :, ~other] = math.nan            # e.g. the gradient of out**2 on NaN rows

    # oracle: masked keys never contribute, so any finite value in their place gives the
    # other documents' exact result
    qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
    out_r, lse_r = reference.attention(qr, kr, vr, mask_mod=mod)
    want = torch.autograd.grad(out_r, (qr, kr, vr), dout.masked_fill(~other[:, None], 0.0))
    # and the dense reference's forward confines it already
    out_d, lse_d = reference.attention(q, k_nan, v, mask_mod=mod)
    assert torch.isnan(out_d[:, :, ~other]).any()
    assert_close(out_d[:, :, other], out_r.detach()[:, :, other], **TIGHT)

    pos = torch.arange(S)
    pieces = {"one_partial_tile": [(pos, "partial")],
              "blocks": [(pos, "blocks")],
              "mixed": [(pos[:9], "blocks"), (pos[9:], "partial")]}[layout]
    out, lse, got, _ = run_tiles(q, k_nan, v, dout_nan, None, pieces, kernel=kernel,
                                 mask_mod=mod)
    assert torch.isnan(out[:, :, ~other]).any()
    assert torch.isfinite(out[:, :, other]).all() and torch.isfinite(lse[:, :, other]).all()
    assert_close(out[:, :, other], out_r.detach()[:, :, other], **TIGHT)
    assert_close(lse[:, :, other], lse_r.detach()[:, :, other], **TIGHT)
    for g, w in zip(got, want):
        rows = g[:, :, other]
        assert torch.isfinite(rows).all()
        assert_close(rows, w[:, :, other], **TIGHT)


# ---------------------------------------------------------------------------------------------
# issue 9: calls the fused kernel likes (is_causal squares, unmasked FULL pieces, float masks
# only where a block is genuinely partial), equal to the reference on every tile kind


def _cover(groups, shape, bs):
    """How many calls compute each block (a call's EMPTY codes are masked out in it)."""
    cover = torch.zeros(shape, dtype=torch.int64)
    for gr in groups:
        cover[gr.q0 // bs:-(-gr.q1 // bs), gr.k0 // bs:-(-gr.k1 // bs)] += \
            (gr.codes != int(BlockKind.EMPTY)).long()
    return cover


def test_fused_plan_covers_every_non_empty_block_once():
    from fringe.ops import tile as T

    EMPTY, PARTIAL, FULL = int(BlockKind.EMPTY), int(BlockKind.PARTIAL), int(BlockKind.FULL)
    g = torch.Generator().manual_seed(61)
    bs = 4
    maps = [torch.randint(0, 3, (7, 9), generator=g).to(torch.int8) for _ in range(20)]
    n = 8
    causal = torch.full((n, n), EMPTY, dtype=torch.int8)
    causal[torch.ones(n, n, dtype=torch.bool).tril(-1)] = FULL
    causal[range(n), range(n)] = PARTIAL
    docs = causal.clone()
    docs[4:, :3] = EMPTY
    docs[4:, 3] = PARTIAL
    maps += [causal, docs, torch.cat([torch.full((n, 3), FULL, dtype=torch.int8), causal], 1)]
    for m in maps:
        nq, nk = m.shape
        for Lq, Lk in ((nq * bs, nk * bs), (nq * bs - 1, nk * bs - 3)):
            groups = T._plan(m, Lq=Lq, Lk=Lk, block_size=bs, fused=True)
            assert len(groups) <= len(T._plan(m, Lq=Lq, Lk=Lk, block_size=bs))  # no more calls
            cover = _cover(groups, m.shape, bs)
            ne = m != EMPTY
            assert torch.equal(cover[ne], torch.ones_like(cover[ne]))
            for gr in groups:
                assert 0 <= gr.q0 < gr.q1 <= Lq and 0 <= gr.k0 < gr.k1 <= Lk
                c = gr.codes
                if gr.causal:
                    k = c.shape[0]
                    assert c.shape == (k, k) and gr.q1 - gr.q0 == gr.k1 - gr.k0 == k * bs
                    tri = torch.ones(k, k, dtype=torch.bool)
                    assert (c[tri.tril(-1)] == FULL).all() and (c[tri.triu(1)] == EMPTY).all()
                    assert (c.diagonal() == PARTIAL).all()
    # the causal and shifted-causal maps become one causal call (+ one FULL piece)
    groups = T._plan(maps[-3], Lq=n * bs, Lk=n * bs, block_size=bs, fused=True)
    assert [(gr.causal, gr.q0, gr.q1, gr.k0, gr.k1) for gr in groups] == [(True, 0, 32, 0, 32)]
    groups = T._plan(maps[-1], Lq=n * bs, Lk=(n + 3) * bs, block_size=bs, fused=True)
    assert sorted((gr.causal, gr.k0, gr.k1) for gr in groups) == [(False, 0, 12), (True, 12, 44)]
    # a document map: a square per document, its partial first column masked, the FULL
    # columns between them unmasked (column cuts that add no calls)
    groups = T._plan(docs, Lq=n * bs, Lk=n * bs, block_size=bs, fused=True)
    got = sorted((gr.causal, gr.q0 // bs, gr.q1 // bs, gr.k0 // bs, gr.k1 // bs,
                  bool((gr.codes == FULL).all())) for gr in groups)
    assert got == [(False, 4, 8, 3, 4, False), (True, 0, 4, 0, 4, False),
                   (True, 4, 8, 4, 8, False)]
    # a banded map whose squares would leave a ragged remainder in many calls: plain grouping
    band = causal.clone()
    band[torch.ones(n, n, dtype=torch.bool).tril(-3)] = EMPTY
    band[range(2, n), range(n - 2)] = PARTIAL
    base = T._plan(band, Lq=n * bs, Lk=n * bs, block_size=bs)
    fused = T._plan(band, Lq=n * bs, Lk=n * bs, block_size=bs, fused=True)
    assert len(fused) <= len(base)


def fused_cases(S: int):
    """(name, mask_mod, q_pos, kv_pos) for tiles of every kind the fused split meets."""
    g = torch.Generator().manual_seed(62)
    causal = lambda b, h, q, kv: q >= kv                                   # noqa: E731
    docs, _ = ragged_docs([0, 5, 30, 31, 47, 80, S])
    window = lambda b, h, q, kv: (q >= kv) & (q - kv < 24)                 # noqa: E731
    per_head = lambda b, h, q, kv: (q >= kv) & ((h == 0) | (q - kv < 20))  # noqa: E731
    prefix = lambda b, h, q, kv: (q >= kv) | (kv < 10)                     # noqa: E731
    pos = torch.arange(S)
    half = S // 2
    zig = torch.cat([pos[: half // 2], pos[S - half // 2:]])               # zigzag chunk
    return [("causal", causal, pos, pos),
            ("causal_tail", causal, pos[:S - 5], pos[:S - 5]),             # Lq % bs != 0
            ("causal_shifted", causal, pos[half:], pos),                   # Lq != Lk
            ("causal_zigzag", causal, zig, zig),
            ("causal_permuted", causal, torch.randperm(S, generator=g), pos),
            ("docs", docs, pos, pos),
            ("docs_shifted", docs, pos[half:], pos[16:]),
            ("window", window, pos, pos),
            ("per_head", per_head, pos, pos),
            ("prefix", prefix, pos, pos)]


@pytest.mark.parametrize("case", [c[0] for c in fused_cases(96)])
def test_fused_calls_equal_reference_float64(case):
    S, B, H, G, D, bs = 96, 2, 4, 2, 8, 16
    name, mod, q_pos, kv_pos = next(c for c in fused_cases(S) if c[0] == case)
    q, k, v = make_qkv(B=B, H=H, G=G, S=S, D=D, seed=63)
    q, k, v = q[:, :, q_pos], k[:, :, kv_pos], v[:, :, kv_pos]
    gen = torch.Generator().manual_seed(64)
    dout = torch.randn(q.shape, generator=gen, dtype=q.dtype)
    dlse = torch.randn(q.shape[:3], generator=gen, dtype=q.dtype)
    blocks = block_map(mod, q_pos, kv_pos, B=B, H=H, block_size=bs)
    kw = dict(q_pos=q_pos, kv_pos=kv_pos, mask_mod=mod)
    want_o, want_l = tile_forward(q, k, v, kernel="reference", **kw)
    want_g = tile_backward(q, k, v, want_o, want_l, dout, kernel="reference", dlse=dlse, **kw)
    for extra in (dict(blocks=blocks, block_size=bs), {}):
        out, lse = tile_forward(q, k, v, kernel="sdpa", **kw, **extra)
        assert_close((out, lse), (want_o, want_l), **TIGHT)
        got = tile_backward(q, k, v, want_o, want_l, dout, kernel="sdpa", dlse=dlse, **kw,
                            **extra)
        assert_close(got, want_g, **TIGHT)


@pytest.mark.parametrize("case", ["causal", "docs_shifted", "window"])
def test_fused_calls_on_packed_strided_out_and_zero_dlse_float64(case):
    """What the runtime passes: out/dout as strided views of packed ``[.., D+1]`` buffers and a
    zero lse cotangent (autograd materialises it). One call over the whole tile (causal) returns
    the kernel's result as is; several calls accumulate by first-touch copies (docs, window)."""
    S, B, H, G, D, bs = 96, 1, 4, 2, 8, 16
    _, mod, q_pos, kv_pos = next(c for c in fused_cases(S) if c[0] == case)
    q, k, v = make_qkv(B=B, H=H, G=G, S=S, D=D, seed=66)
    q, k, v = q[:, :, q_pos], k[:, :, kv_pos], v[:, :, kv_pos]
    gen = torch.Generator().manual_seed(67)
    kw = dict(q_pos=q_pos, kv_pos=kv_pos, mask_mod=mod)
    want_o, want_l = tile_forward(q, k, v, kernel="reference", **kw)
    packed = torch.randn(q.shape[:3] + (D + 1,), generator=gen, dtype=q.dtype)
    packed[..., :D] = want_o
    dpacked = torch.randn(q.shape[:3] + (D + 1,), generator=gen, dtype=q.dtype)
    dpacked[..., D] = 0.0
    out, dout, dlse = packed[..., :D], dpacked[..., :D], dpacked[..., D]
    assert not out.is_contiguous() and not dout.is_contiguous()
    want_g = tile_backward(q, k, v, want_o, want_l, dout.contiguous(), kernel="reference", **kw)
    blocks = block_map(mod, q_pos, kv_pos, B=B, H=H, block_size=bs)
    extra = dict(blocks=blocks, block_size=bs, kernel="sdpa")
    assert_close(tile_forward(q, k, v, **kw, **extra), (want_o, want_l), **TIGHT)
    got = tile_backward(q, k, v, out, want_l, dout, dlse=dlse, **kw, **extra)
    assert_close(got, want_g, **TIGHT)


def test_row_accumulator_first_touch_and_zero_rows():
    from fringe.ops.tile import _Rows

    acc = _Rows((1, 2, 10, 3), torch.float64, "cpu")
    acc.add(slice(2, 4), torch.ones(1, 2, 2, 3, dtype=torch.float64))
    acc.add(slice(3, 7), torch.full((1, 2, 4, 3), 2.0, dtype=torch.float64))  # half seen
    acc.add(slice(8, 9), torch.ones(1, 2, 1, 3, dtype=torch.float64))
    want = torch.tensor([0, 0, 1, 3, 2, 2, 2, 0, 1, 0], dtype=torch.float64)
    assert torch.equal(acc.result(torch.float64), want.view(1, 1, 10, 1).expand(1, 2, 10, 3))


def test_causal_checks_run_only_when_squares_would_be_chosen():
    """The element-level tril check (a mask evaluation per diagonal block) is skipped where
    the block pattern alone already rules the is_causal squares out (a narrow window)."""
    from fringe.ops import tile as T

    S, bs = 96, 16
    pos = torch.arange(S)
    for name, expect_checks in (("causal", True), ("window", False)):
        _, mod, q_pos, kv_pos = next(c for c in fused_cases(S) if c[0] == name)
        blocks = block_map(mod, q_pos, kv_pos, B=1, H=1, block_size=bs)
        checked = []
        real = T._tril_check(mod, pos, pos, B=1, H=1, block_size=bs)

        def check(i, j, _real=real):
            checked.append((i, j))
            return _real(i, j)

        groups = T._plan(blocks, Lq=S, Lk=S, block_size=bs, fused=True, causal_block=check)
        assert bool(checked) == expect_checks
        assert any(g.causal for g in groups) == expect_checks


def test_fused_calls_are_the_ones_the_kernel_likes(monkeypatch):
    import fringe.ops._fast as fast

    S, B, H, D, bs = 96, 1, 2, 8, 16
    assert fast.SDPA.available("cpu")[0] and fast.SDPA.native_causal    # self-test done first
    calls = []
    for phase in ("_forward", "_backward"):
        real = getattr(fast.SdpaKernel, phase)

        def spy(self, q, k, *a, _real=real, _phase=phase, **kw):
            calls.append((_phase, bool(kw.get("causal")), kw.get("mask") is not None,
                          q.shape[2], k.shape[2]))
            return _real(self, q, k, *a, **kw)

        monkeypatch.setattr(fast.SdpaKernel, phase, spy)
    q, k, v = make_qkv(B=B, H=H, G=H, S=S, D=D, seed=65)
    cases = {c[0]: c for c in fused_cases(S)}
    cases["docs"] = ("docs", ragged_docs([0, 32, 80, 96])[0], torch.arange(S), torch.arange(S))
    for name in ("causal", "causal_zigzag", "docs"):
        _, mod, q_pos, kv_pos = cases[name]
        kw = dict(q_pos=q_pos, kv_pos=kv_pos, mask_mod=mod, kernel="sdpa",
                  blocks=block_map(mod, q_pos, kv_pos, B=B, H=H, block_size=bs), block_size=bs)
        calls.clear()
        qt, kt, vt = q[:, :, q_pos], k[:, :, kv_pos], v[:, :, kv_pos]
        out, lse = tile_forward(qt, kt, vt, **kw)
        tile_backward(qt, kt, vt, out, lse, out, **kw)
        if name != "docs":          # a causal tile (zigzag chunks too): one is_causal call each
            n = q_pos.numel()
            assert calls == [("_forward", True, False, n, n), ("_backward", True, False, n, n)]
            continue
        # block-aligned documents: one is_causal square each, nothing masked, 3 calls where
        # the plain grouping makes more, all masked
        fwd = [c for c in calls if c[0] == "_forward"]
        assert sorted(c[3] for c in fwd if c[1]) == [16, 32, 48]
        assert len(fwd) == len(calls) // 2 == 3 and not any(c[2] for c in fwd)
        calls.clear()
        monkeypatch.setattr(fast.SDPA, "fused_calls", False)
        tile_forward(qt, kt, vt, **kw)
        monkeypatch.setattr(fast.SDPA, "fused_calls", True)
        assert len(calls) > 3 and all(c[2] and not c[1] for c in calls)
    # the whole-tile path (no block map) runs a square lower-triangular tile with is_causal
    calls.clear()
    pos = torch.arange(S)
    tile_forward(q, k, v, q_pos=pos, kv_pos=pos, mask_mod=cases["causal"][1], kernel="sdpa")
    assert calls == [("_forward", True, False, S, S)]


def test_sdpa_lse_cotangent_float32_with_small_dout():
    """The fold ``out' = out - dlse * dout / |dout|^2`` stays accurate when dout is small."""
    B, H, S, D = 1, 4, 64, 16
    q, k, v = make_qkv(B=B, H=H, G=2, S=S, D=D, seed=71)
    gen = torch.Generator().manual_seed(72)
    dout = 1e-3 * torch.randn(B, H, S, D, generator=gen, dtype=torch.float64)
    dlse = torch.randn(B, H, S, generator=gen, dtype=torch.float64)
    pos = torch.arange(S)
    kw = dict(q_pos=pos, kv_pos=pos, mask_mod=lambda b, h, q, kv: q >= kv)
    out, lse = tile_forward(q, k, v, kernel="reference", **kw)
    want = tile_backward(q, k, v, out, lse, dout, kernel="reference", dlse=dlse, **kw)
    f = [t.float() for t in (q, k, v, out, lse, dout, dlse)]
    got = tile_backward(*f[:6], kernel="sdpa", dlse=f[6], **kw)
    assert_close(tuple(t.double() for t in got), want, **tolerances(torch.float32))
