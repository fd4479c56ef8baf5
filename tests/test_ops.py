"""fringe.ops against the dense reference: tiles + merge, tile backward, kernels, block sparsity.

Legend: B batch · H query heads · G kv heads · S sequence · L tokens · D head dim.
"""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch.testing import assert_close

import fringe.ops as ops
from fringe.masks import BlockKind
from fringe.ops import get_kernel, merge, reference, tile_backward, tile_forward
from fringe.ops.tile import check_qkv
from fringe.testing import make_qkv, seeds, tolerances

TIGHT = tolerances(torch.float64)
HEADS = [(1, 1), (2, 1), (2, 2), (4, 2)]  # (H, G)
MASKS = ["none", "causal", "window", "document", "arbitrary", "dead_rows"]


def make_mask(name: str, S: int, seed: int):
    """Plain lambdas over GLOBAL positions."""
    if name == "none":
        return None
    if name == "causal":
        return lambda b, h, q, kv: q >= kv
    if name == "window":
        return lambda b, h, q, kv: (q >= kv) & (q - kv <= 3)
    if name == "document":
        g = torch.Generator().manual_seed(seed)
        doc = torch.cumsum((torch.rand(S, generator=g) < 0.25).long(), 0)
        return lambda b, h, q, kv: doc[q] == doc[kv]
    if name == "arbitrary":
        return lambda b, h, q, kv: ((q * 7 + kv * 3 + h + 2 * b) % 5) != 0
    if name == "dead_rows":                        # rows q % 4 == 1 attend to nothing
        return lambda b, h, q, kv: (q % 4 != 1) & (q >= kv)
    raise ValueError(name)


def split_layout(S: int, n_tiles: int, seed: int):
    """A random permutation of q positions and the kv positions cut into n_tiles pieces."""
    g = torch.Generator().manual_seed(seed + 1)
    q_pos = torch.randperm(S, generator=g)
    kv_perm = torch.randperm(S, generator=g)
    cuts = sorted(torch.randint(1, S, (n_tiles - 1,), generator=g).tolist()) if S > 1 else []
    edges = [0, *cuts, S]
    return q_pos, [kv_perm[a:b] for a, b in zip(edges, edges[1:]) if b > a]


def tiled(q, k, v, q_pos, pieces, **kw):
    """Forward over kv pieces and merge: (out, lse) for q rows at q_pos."""
    out = lse = None
    for kv_pos in pieces:
        o, l = tile_forward(q[:, :, q_pos], k[:, :, kv_pos], v[:, :, kv_pos], q_pos=q_pos,
                            kv_pos=kv_pos, **kw)
        out, lse = (o, l) if out is None else merge(out, lse, o, l)
    return out, lse


def tiled_grads(q, k, v, out, lse, dout, q_pos, pieces, **kw):
    """Sum tile_backward over kv pieces into full-sequence (dq, dk, dv)."""
    dq = torch.zeros_like(q)
    dk, dv = torch.zeros_like(k), torch.zeros_like(v)
    for kv_pos in pieces:
        gq, gk, gv = tile_backward(q[:, :, q_pos], k[:, :, kv_pos], v[:, :, kv_pos], out, lse,
                                   dout, q_pos=q_pos, kv_pos=kv_pos, **kw)
        dq[:, :, q_pos] += gq
        dk[:, :, kv_pos] += gk
        dv[:, :, kv_pos] += gv
    return dq, dk, dv


def exact_blocks(mask_mod, q_pos, kv_pos, *, B, H, block_size):
    """Exact BlockKind map of a tile (dense evaluation: test-only)."""
    m = reference.mask_for(mask_mod, q_pos, kv_pos, B=B, H=H).any(0).any(0) \
        if mask_mod is not None else torch.ones(len(q_pos), len(kv_pos), dtype=torch.bool)
    allm = reference.mask_for(mask_mod, q_pos, kv_pos, B=B, H=H).all(0).all(0) \
        if mask_mod is not None else m
    nq, nk = -(-len(q_pos) // block_size), -(-len(kv_pos) // block_size)
    out = torch.empty(nq, nk, dtype=torch.int8)
    for i in range(nq):
        for j in range(nk):
            sl = (slice(i * block_size, (i + 1) * block_size),
                  slice(j * block_size, (j + 1) * block_size))
            out[i, j] = (BlockKind.FULL if bool(allm[sl].all()) else
                         BlockKind.EMPTY if not bool(m[sl].any()) else BlockKind.PARTIAL)
    return out


# ---------------------------------------------------------------------------------------------
# tiles + merge == reference, forward and backward


@given(seed=seeds(), S=st.integers(1, 24), n_tiles=st.integers(1, 4),
       heads=st.sampled_from(HEADS), mask=st.sampled_from(MASKS),
       kernel=st.sampled_from(["reference", "sdpa"]))
def test_tiles_merge_and_backward_match_reference(seed, S, n_tiles, heads, mask, kernel):
    H, G = heads
    q, k, v = make_qkv(B=2, H=H, G=G, S=S, D=4, seed=seed, requires_grad=True)
    mask_mod = make_mask(mask, S, seed)
    ro, rl = reference.attention(q, k, v, mask_mod=mask_mod)
    q_pos, pieces = split_layout(S, n_tiles, seed)
    with torch.no_grad():
        out, lse = tiled(q, k, v, q_pos, pieces, mask_mod=mask_mod, kernel=kernel)
    assert_close(out, ro[:, :, q_pos].detach(), **TIGHT)
    assert_close(lse, rl[:, :, q_pos].detach(), **TIGHT)

    dout = torch.randn(ro.shape, generator=torch.Generator().manual_seed(seed), dtype=ro.dtype)
    ref_grads = torch.autograd.grad(ro, (q, k, v), dout)
    with torch.no_grad():
        grads = tiled_grads(q, k, v, out, lse, dout[:, :, q_pos], q_pos, pieces,
                            mask_mod=mask_mod, kernel=kernel)
    for got, want in zip(grads, ref_grads):
        assert not got.isnan().any()
        assert_close(got, want, **TIGHT)


@given(seed=seeds(), S=st.integers(2, 16), n_tiles=st.integers(1, 3),
       heads=st.sampled_from(HEADS), softcap=st.booleans())
def test_score_mod_under_permuted_layout(seed, S, n_tiles, heads, softcap):
    H, G = heads
    slope = 2.0 ** -torch.arange(1, H + 1, dtype=torch.float64)

    def alibi(score, b, h, q, kv):
        s = score + slope[h] * (kv - q)
        return 4.0 * torch.tanh(s / 4.0) if softcap else s

    q, k, v = make_qkv(B=1, H=H, G=G, S=S, D=4, seed=seed, requires_grad=True)
    causal = make_mask("causal", S, seed)
    ro, rl = reference.attention(q, k, v, mask_mod=causal, score_mod=alibi)
    q_pos, pieces = split_layout(S, n_tiles, seed)
    kw = dict(mask_mod=causal, score_mod=alibi)
    with torch.no_grad():
        out, lse = tiled(q, k, v, q_pos, pieces, **kw)
    assert_close(out, ro[:, :, q_pos].detach(), **TIGHT)
    assert_close(lse, rl[:, :, q_pos].detach(), **TIGHT)
    dout = torch.randn(ro.shape, generator=torch.Generator().manual_seed(seed), dtype=ro.dtype)
    ref_grads = torch.autograd.grad(ro, (q, k, v), dout)
    with torch.no_grad():
        grads = tiled_grads(q, k, v, out, lse, dout[:, :, q_pos], q_pos, pieces, **kw)
    for got, want in zip(grads, ref_grads):
        assert_close(got, want, **TIGHT)


# ---------------------------------------------------------------------------------------------
# block sparsity inside a tile


@given(seed=seeds(), S=st.integers(1, 40), block_size=st.integers(1, 6),
       mask=st.sampled_from(MASKS), heads=st.sampled_from(HEADS), loosen=st.booleans(),
       permute=st.booleans())
def test_blocks_path_equals_unblocked(seed, S, block_size, mask, heads, loosen, permute):
    H, G = heads
    q, k, v = make_qkv(B=2, H=H, G=G, S=S, D=4, seed=seed)
    mask_mod = make_mask(mask, S, seed)
    g = torch.Generator().manual_seed(seed)
    q_pos = torch.randperm(S, generator=g) if permute else torch.arange(S)
    kv_pos = torch.arange(S)
    blocks = exact_blocks(mask_mod, q_pos, kv_pos, B=2, H=H, block_size=block_size)
    if loosen:   # a conservative classifier may call FULL / EMPTY-free blocks PARTIAL
        loose = torch.rand(blocks.shape, generator=g) < 0.3
        blocks = torch.where(loose & (blocks == BlockKind.FULL), int(BlockKind.PARTIAL), blocks)
        blocks = blocks.to(torch.int8)
    kw = dict(q_pos=q_pos, kv_pos=kv_pos, mask_mod=mask_mod)
    want = tile_forward(q[:, :, q_pos], k, v, **kw)
    got = tile_forward(q[:, :, q_pos], k, v, blocks=blocks, block_size=block_size, **kw)
    assert_close(got, want, **TIGHT)
    out, lse = want
    dout = torch.randn(out.shape, generator=g, dtype=out.dtype)
    want_g = tile_backward(q[:, :, q_pos], k, v, out, lse, dout, **kw)
    got_g = tile_backward(q[:, :, q_pos], k, v, out, lse, dout, blocks=blocks,
                          block_size=block_size, **kw)
    assert_close(got_g, want_g, **TIGHT)


class CountingKernel:
    """Wraps the reference kernel and records the work it is given."""

    name = "counting"

    def __init__(self):
        self.area = 0
        self.calls = 0

    def available(self, device=None):
        return True, "test"

    def forward(self, q, k, v, **kw):
        self.area += q.shape[2] * k.shape[2]
        self.calls += 1
        return ops.KERNELS["reference"].forward(q, k, v, **kw)

    def backward(self, q, k, v, out, lse, dout, **kw):
        self.area += q.shape[2] * k.shape[2]
        self.calls += 1
        return ops.KERNELS["reference"].backward(q, k, v, out, lse, dout, **kw)


def test_block_sparse_work_follows_the_mask():
    S, bs, n_docs = 256, 16, 8
    doc = torch.arange(S) // (S // n_docs)
    evaluated = []

    def document(b, h, q, kv):
        evaluated.append(q.numel() * kv.numel())
        return doc[q] == doc[kv]

    document.bh_invariant = True
    q, k, v = make_qkv(B=1, H=2, G=1, S=S, D=4, seed=0)
    pos = torch.arange(S)
    blocks = exact_blocks(document, pos, pos, B=1, H=2, block_size=bs)
    evaluated.clear()
    kern = CountingKernel()
    out, lse = tile_forward(q, k, v, q_pos=pos, kv_pos=pos, mask_mod=document, blocks=blocks,
                            block_size=bs, kernel=kern)
    nonempty = int((blocks != BlockKind.EMPTY).sum()) * bs * bs
    assert kern.area <= 1.25 * nonempty < S * S / 4
    assert kern.calls == n_docs
    assert evaluated == []                      # block-aligned documents: all FULL or EMPTY
    assert_close((out, lse), reference.attention(q, k, v, mask_mod=document), **TIGHT)

    # causal: only the diagonal blocks are PARTIAL; mask evaluation stays near the diagonal
    causal = make_mask("causal", S, 0)
    cblocks = exact_blocks(causal, pos, pos, B=1, H=2, block_size=bs)
    kern = CountingKernel()
    counted = []

    def counting_causal(b, h, q, kv):
        counted.append(q.numel() * kv.numel())
        return q >= kv

    out, lse = tile_forward(q, k, v, q_pos=pos, kv_pos=pos, mask_mod=counting_causal,
                            blocks=cblocks, block_size=bs, kernel=kern)
    assert kern.area <= 1.25 * int((cblocks != BlockKind.EMPTY).sum()) * bs * bs
    assert kern.calls < S // bs                 # similar rows grouped
    assert sum(counted) < S * S / 2
    assert_close((out, lse), reference.attention(q, k, v, mask_mod=causal), **TIGHT)


def test_full_kind_equals_partial_with_all_true_mask():
    q, k, v = make_qkv(B=1, H=4, G=2, S=9, D=4, seed=3)
    pos = torch.arange(9)
    calls = []

    def everything(b, h, q, kv):
        calls.append(1)
        return torch.ones_like(q >= kv)

    part = tile_forward(q, k, v, q_pos=pos, kv_pos=pos, mask_mod=everything)
    assert calls
    calls.clear()
    full = tile_forward(q, k, v, q_pos=pos, kv_pos=pos, mask_mod=everything,
                        kind=BlockKind.FULL)
    assert calls == []
    assert_close(full, part, **TIGHT)
    dout = torch.randn_like(q)
    assert_close(tile_backward(q, k, v, *part, dout, q_pos=pos, kv_pos=pos, kind=BlockKind.FULL),
                 tile_backward(q, k, v, *part, dout, q_pos=pos, kv_pos=pos, mask_mod=everything),
                 **TIGHT)


# ---------------------------------------------------------------------------------------------
# fully masked rows, merge edge cases


@pytest.mark.parametrize("kernel", ["reference", "sdpa"])
def test_fully_masked_rows_are_zero_and_never_nan(kernel):
    q, k, v = make_qkv(B=1, H=2, G=1, S=8, D=4, seed=1, requires_grad=True)
    dead = make_mask("dead_rows", 8, 0)
    out, lse = reference.attention(q, k, v, mask_mod=dead)
    rows = torch.arange(8) % 4 == 1
    assert torch.equal(out[:, :, rows], torch.zeros_like(out[:, :, rows]))
    assert torch.isneginf(lse[:, :, rows]).all() and torch.isfinite(lse[:, :, ~rows]).all()
    (out.sum() + lse[torch.isfinite(lse)].sum()).backward()
    for t in (q, k, v):
        assert torch.isfinite(t.grad).all()
    assert torch.equal(q.grad[:, :, rows], torch.zeros_like(q.grad[:, :, rows]))

    pos = torch.arange(8)
    with torch.no_grad():
        o, l = tile_forward(q, k, v, q_pos=pos, kv_pos=pos, mask_mod=dead, kernel=kernel)
        assert not o.isnan().any() and torch.isneginf(l[:, :, rows]).all()
        assert_close(o, out, **TIGHT)
        grads = tile_backward(q, k, v, o, l, torch.ones_like(o), q_pos=pos, kv_pos=pos,
                              mask_mod=dead, kernel=kernel)
    for g in grads:
        assert torch.isfinite(g).all()
    assert torch.equal(grads[0][:, :, rows], torch.zeros_like(grads[0][:, :, rows]))


def test_merge_edge_cases():
    g = torch.Generator().manual_seed(0)
    oa = torch.randn(1, 2, 3, 4, generator=g)
    la = torch.randn(1, 2, 3, generator=g)
    none_o, none_l = torch.zeros_like(oa), torch.full_like(la, -math.inf)
    for out, lse in (merge(oa, la, none_o, none_l), merge(none_o, none_l, oa, la)):
        assert torch.equal(out, oa) and torch.equal(lse, la)
    out, lse = merge(none_o, none_l, none_o, none_l)
    assert torch.equal(out, none_o) and torch.isneginf(lse).all()
    # associativity/commutativity and the float32 / float64 accumulation dtype
    ob, lb = torch.randn(1, 2, 3, 4, generator=g), torch.randn(1, 2, 3, generator=g)
    assert_close(merge(oa, la, ob, lb), merge(ob, lb, oa, la))
    assert merge(oa.half(), la, ob.half(), lb)[0].dtype == torch.float32
    assert merge(oa.double(), la.double(), ob, lb)[1].dtype == torch.float64
    big = merge(oa, la + 1e4, ob, lb)             # no overflow for far-apart lse
    assert torch.equal(big[0], oa) and torch.equal(big[1], la + 1e4)


# ---------------------------------------------------------------------------------------------
# autograd: gradcheck, and a tile-based autograd.Function usable by torch.func


class TiledAttention(torch.autograd.Function):
    """Two kv tiles merged; backward = sum of tile_backward (the runtime's shape in miniature)."""

    @staticmethod
    def forward(q, k, v, mask_mod, score_mod):
        S = q.shape[2]
        pos = torch.arange(S)
        out = lse = None
        for kv_pos in (pos[: S // 2], pos[S // 2:]):
            o, l = tile_forward(q, k[:, :, kv_pos], v[:, :, kv_pos], q_pos=pos, kv_pos=kv_pos,
                                mask_mod=mask_mod, score_mod=score_mod)
            out, lse = (o, l) if out is None else merge(out, lse, o, l)
        return out.to(q.dtype), lse

    @staticmethod
    def setup_context(ctx, inputs, output):
        q, k, v, mask_mod, score_mod = inputs
        ctx.save_for_backward(q, k, v, *output)
        ctx.mods = mask_mod, score_mod
        ctx.mark_non_differentiable(output[1])

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse = ctx.saved_tensors
        mask_mod, score_mod = ctx.mods
        S = q.shape[2]
        pos = torch.arange(S)
        dq = torch.zeros_like(q)
        dk, dv = torch.zeros_like(k), torch.zeros_like(v)
        for kv_pos in (pos[: S // 2], pos[S // 2:]):
            gq, gk, gv = tile_backward(q, k[:, :, kv_pos], v[:, :, kv_pos], out, lse, dout,
                                       q_pos=pos, kv_pos=kv_pos, mask_mod=mask_mod,
                                       score_mod=score_mod)
            dq = dq + gq
            dk = dk.index_add(2, kv_pos, gk)
            dv = dv.index_add(2, kv_pos, gv)
        return dq, dk, dv, None, None


def test_gradcheck_reference_and_tiled_function():
    q, k, v = make_qkv(B=1, H=2, G=1, S=6, D=3, seed=5, requires_grad=True)
    dead = make_mask("dead_rows", 6, 0)
    assert torch.autograd.gradcheck(
        lambda q, k, v: reference.attention(q, k, v, mask_mod=dead)[0], (q, k, v))

    def lse_finite(q, k, v):
        lse = reference.attention(q, k, v, mask_mod=dead)[1]
        return lse.masked_fill(torch.isneginf(lse), 0.0)

    assert torch.autograd.gradcheck(lse_finite, (q, k, v))
    assert torch.autograd.gradcheck(lambda q, k, v: TiledAttention.apply(q, k, v, dead, None)[0],
                                    (q, k, v))


def test_tiled_function_under_torch_func_grad_with_score_mod():
    q, k, v = make_qkv(B=1, H=4, G=2, S=7, D=3, seed=6)
    causal = make_mask("causal", 7, 0)

    def softcap(score, b, h, qi, kvi):
        return 3.0 * torch.tanh(score / 3.0) - 0.1 * (qi - kvi)

    def loss_tiled(q, k, v):
        return TiledAttention.apply(q, k, v, causal, softcap)[0].pow(2).sum()

    def loss_ref(q, k, v):
        return reference.attention(q, k, v, mask_mod=causal, score_mod=softcap)[0].pow(2).sum()

    got = torch.func.grad(loss_tiled, argnums=(0, 1, 2))(q, k, v)
    want = torch.func.grad(loss_ref, argnums=(0, 1, 2))(q, k, v)
    assert_close(got, want, **TIGHT)


# ---------------------------------------------------------------------------------------------
# kernels


def test_kernel_registry():
    assert set(ops.KERNELS) >= {"reference", "sdpa", "flex"}
    ok, reason = ops.KERNELS["sdpa"].available("cpu")
    assert isinstance(reason, str) and reason
    assert get_kernel(None).name == ("sdpa" if ok else "reference")
    assert get_kernel(None, score_mod=lambda s, b, h, q, kv: s).name == "reference"
    assert get_kernel("reference") is ops.KERNELS["reference"]
    with pytest.raises(KeyError, match="unknown kernel 'flash3'; choose one of"):
        get_kernel("flash3")
    assert set(ops.__all__) == {"KERNELS", "Kernel", "ReferenceKernel", "SdpaKernel",
                                "attention", "check_qkv", "get_kernel", "merge",
                                "tile_backward", "tile_forward"}


class BlocksKernel:
    """A ``wants_blocks`` kernel: records what tile.py hands it, computes with the reference
    over the element mask its block map means (FULL True, PARTIAL mask_mod, EMPTY False) and
    returns float64 so that tile.py's casts show."""

    name = "blocks"
    wants_blocks = True

    def __init__(self):
        self.seen = []

    def available(self, device=None):
        return True, "test"

    def _mask(self, q_pos, kv_pos, blocks, block_size, mask_mod):
        e = blocks.repeat_interleave(block_size, 0).repeat_interleave(block_size, 1)
        e = e[:q_pos.numel(), :kv_pos.numel()]
        m = torch.ones(1, 1, *e.shape, dtype=torch.bool) if mask_mod is None else \
            reference.mask_for(mask_mod, q_pos, kv_pos, B=1, H=1)
        return (e == BlockKind.FULL) | ((e == BlockKind.PARTIAL) & m)

    def forward(self, q, k, v, *, q_pos, kv_pos, blocks, block_size, mask_mod, score_mod,
                scale):
        self.seen.append(dict(blocks=blocks, block_size=block_size, mask_mod=mask_mod))
        mask = self._mask(q_pos, kv_pos, blocks, block_size, mask_mod)
        o, l = ops.KERNELS["reference"].forward(q, k, v, q_pos=q_pos, kv_pos=kv_pos, mask=mask,
                                                score_mod=score_mod, scale=scale)
        return o.double(), l.double()

    def backward(self, q, k, v, out, lse, dout, *, q_pos, kv_pos, blocks, block_size, mask_mod,
                 score_mod, scale, dlse=None, score_params=()):
        self.seen.append(dict(blocks=blocks, block_size=block_size, mask_mod=mask_mod, out=out,
                              lse=lse, dout=dout, dlse=dlse))
        mask = self._mask(q_pos, kv_pos, blocks, block_size, mask_mod)
        res = ops.KERNELS["reference"].backward(q, k, v, out, lse, dout, q_pos=q_pos,
                                                kv_pos=kv_pos, mask=mask, score_mod=score_mod,
                                                scale=scale, dlse=dlse)
        return tuple(t.double() for t in res)


def test_wants_blocks_kernels_get_the_whole_tile_with_its_block_map():
    from fringe.masks import DEFAULT_BLOCK_SIZE, classify, document

    kern = BlocksKernel()
    Lq, Lk = 48, 72                          # not multiples of the default block, nor Lk of 16
    q, k, v = make_qkv(B=1, H=4, G=2, S=Lq, Lk=Lk, D=4, seed=9, dtype=torch.float32)
    q_pos, kv_pos = torch.arange(50, 50 + Lq), torch.arange(Lk)
    mask = document(torch.arange(128) // 30)
    base = dict(q_pos=q_pos, kv_pos=kv_pos, scale=0.4)
    blocks = classify(mask, q_pos, kv_pos, block_size=8)
    cases = {   # kind/blocks arguments -> (block_size, block code everywhere or the map itself)
        "full": (dict(kind=BlockKind.FULL, mask_mod=mask), DEFAULT_BLOCK_SIZE, BlockKind.FULL),
        "partial": (dict(kind=BlockKind.PARTIAL, mask_mod=mask), DEFAULT_BLOCK_SIZE,
                    BlockKind.PARTIAL),
        "partial_bs": (dict(kind=BlockKind.PARTIAL, mask_mod=mask, block_size=16), 16,
                       BlockKind.PARTIAL),
        "blocks": (dict(kind=BlockKind.PARTIAL, mask_mod=mask, blocks=blocks, block_size=8),
                   8, blocks),
    }
    gen = torch.Generator().manual_seed(10)
    dout = torch.randn(1, 4, Lq, 4, generator=gen)
    dlse = torch.randn(1, 4, Lq, generator=gen)
    for name, (kw, bs, code) in cases.items():
        kern.seen.clear()
        out, lse = tile_forward(q, k, v, kernel=kern, **base, **kw)
        want_o, want_l = tile_forward(q, k, v, kernel="reference", **base,
                                      **(kw if name != "full" else dict(kind=BlockKind.FULL)))
        assert out.dtype == torch.float32 and lse.dtype == torch.float32, name
        assert_close(out, want_o, **tolerances(torch.float32))
        grads = tile_backward(q, k, v, out, lse, dout, kernel=kern, dlse=dlse, **base, **kw)
        want = tile_backward(q, k, v, out, lse, dout, kernel="reference", dlse=dlse, **base,
                             **(kw if name != "full" else dict(kind=BlockKind.FULL)))
        assert [g.dtype for g in grads] == [torch.float32] * 3, name
        assert_close(grads, want, **tolerances(torch.float32))
        assert len(kern.seen) == 2, name                  # one call each way: the whole tile
        shape = (-(-Lq // bs), -(-Lk // bs))
        for seen in kern.seen:
            assert seen["block_size"] == bs and tuple(seen["blocks"].shape) == shape, name
            if isinstance(code, torch.Tensor):
                assert seen["blocks"] is code
            else:
                assert bool((seen["blocks"] == int(code)).all()), name
            assert seen["mask_mod"] is (None if name == "full" else mask), name
        back = kern.seen[1]                               # the GLOBAL out/lse, untouched
        assert back["out"] is out and back["lse"] is lse and back["dout"] is dout
        assert back["dlse"] is dlse


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("heads", [(4, 4), (4, 2), (6, 1)])
@pytest.mark.parametrize("mask", ["none", "causal", "arbitrary", "dead_rows"])
def test_sdpa_matches_reference(dtype, heads, mask):
    sdpa = ops.KERNELS["sdpa"]
    if not sdpa.available("cpu")[0]:
        pytest.skip(sdpa.available("cpu")[1])
    H, G = heads
    Lq, Lk = 12, 20                                # Lq < Lk, offset positions: not top-left
    q, k, v = make_qkv(B=2, H=H, G=G, S=Lq, Lk=Lk, D=8, seed=7, dtype=dtype)
    q_pos, kv_pos = torch.arange(8, 8 + Lq), torch.arange(Lk)
    mask_mod = make_mask(mask, Lk + 8, 0)
    kw = dict(q_pos=q_pos, kv_pos=kv_pos, mask_mod=mask_mod, scale=0.4)
    want = tile_forward(q, k, v, kernel="reference", **kw)
    got = tile_forward(q, k, v, kernel="sdpa", **kw)
    tol = tolerances(dtype)
    assert got[0].dtype == dtype and got[1].dtype == want[1].dtype
    assert_close(got, want, **tol)
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(1), dtype=dtype)
    # backward against a GLOBAL out/lse (here: a merge with a second, disjoint kv tile)
    extra_pos = torch.arange(Lk, Lk + 5)
    ek, ev = k[:, :, :5] + 1, v[:, :, :5] - 1
    o2, l2 = tile_forward(q, ek, ev, q_pos=q_pos, kv_pos=extra_pos, kernel="reference",
                          scale=0.4)
    out, lse = merge(*want, o2, l2)
    out = out.to(dtype)
    want_g = tile_backward(q, k, v, out, lse, dout, kernel="reference", **kw)
    got_g = tile_backward(q, k, v, out, lse, dout, kernel="sdpa", **kw)
    assert all(g.dtype == dtype for g in got_g)
    assert_close(got_g, want_g, **tol)


def _head_dim_strided(t: torch.Tensor) -> torch.Tensor:
    """``t``'s values with stride 2 along D (the fused CPU op read such tensors as if D were
    contiguous: wrong numbers, no error)."""
    return torch.stack([t, t], dim=-1)[..., 0]


@pytest.mark.parametrize("mask", ["none", "causal"])
def test_sdpa_inputs_strided_along_the_head_dim_match_reference(mask):
    sdpa = ops.KERNELS["sdpa"]
    if not sdpa.available("cpu")[0]:
        pytest.skip(sdpa.available("cpu")[1])
    q, k, v = make_qkv(B=1, H=4, G=2, S=12, D=8, seed=11)
    pos = torch.arange(12)
    kw = dict(q_pos=pos, kv_pos=pos, mask_mod=make_mask(mask, 12, 0), scale=0.4)
    out, lse = tile_forward(q, k, v, kernel="reference", **kw)
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(2), dtype=q.dtype)
    want_g = tile_backward(q, k, v, out, lse, dout, kernel="reference", **kw)
    for which in range(4):              # q, k, v, out: one strided at a time
        args = [q, k, v, out]
        args[which] = _head_dim_strided(args[which])
        assert args[which].stride(-1) == 2
        if which < 3:
            assert_close(tile_forward(*args[:3], kernel="sdpa", **kw), (out, lse), **TIGHT)
        got_g = tile_backward(*args, lse, _head_dim_strided(dout), kernel="sdpa", **kw)
        assert_close(got_g, want_g, **TIGHT)


def test_sdpa_with_score_mod_delegates_to_reference():
    q, k, v = make_qkv(B=1, H=2, G=1, S=5, D=4, seed=2)
    pos = torch.arange(5)
    bias = lambda s, b, h, qi, kvi: s + 0.5 * h      # noqa: E731
    kw = dict(q_pos=pos, kv_pos=pos, score_mod=bias)
    assert_close(tile_forward(q, k, v, kernel="sdpa", **kw),
                 tile_forward(q, k, v, kernel="reference", **kw), **TIGHT)


def test_low_precision_tile_close_to_float64_reference():
    q, k, v = make_qkv(B=1, H=2, G=1, S=16, D=8, seed=4)
    causal = make_mask("causal", 16, 0)
    want, want_lse = reference.attention(q, k, v, mask_mod=causal)
    pos = torch.arange(16)
    for dtype in (torch.bfloat16, torch.float16):
        out, lse = tile_forward(q.to(dtype), k.to(dtype), v.to(dtype), q_pos=pos, kv_pos=pos,
                                mask_mod=causal)
        assert out.dtype == dtype and lse.dtype == torch.float32
        assert_close(out.double(), want, **tolerances(dtype))
        assert_close(lse.double(), want_lse, **tolerances(dtype))


# ---------------------------------------------------------------------------------------------
# validation


def _qkv(qs=(1, 4, 5, 8), ks=(1, 2, 6, 8), vs=None, dtype=torch.float64):
    return torch.zeros(qs, dtype=dtype), torch.zeros(ks), torch.zeros(vs or ks)


@pytest.mark.parametrize("args, match", [
    (dict(qs=(4, 5, 8)), r"q must be 4-D \[B, H, Lq, D\], got shape \(4, 5, 8\)"),
    (dict(ks=(2, 6, 8)), r"k must be 4-D \[B, G, Lk, D\]"),
    (dict(ks=(1, 2, 6, 4)), r"head dim mismatch: q has D=8 but k has D=4"),
    (dict(vs=(1, 2, 7, 8)), r"k and v must agree in \[B, G, Lk\] \(v's head dim Dv may differ"),
    (dict(qs=(1, 6, 5, 8), ks=(1, 4, 6, 8)),
     r"H=6 query heads is not a multiple of G=4 kv heads"),
    (dict(dtype=torch.float32), r"dtype mismatch: q torch.float32, k torch.float64"),
    (dict(qs=(1, 4, 5, 0), ks=(1, 2, 6, 0)), r"head dim D=0 .* needs every dimension >= 1"),
    (dict(qs=(1, 0, 5, 8)), r"query heads H=0"),
    (dict(ks=(1, 0, 6, 8)), r"kv heads G=0"),
    (dict(qs=(1, 4, 0, 8)), r"query rows Lq=0"),
    (dict(ks=(1, 2, 0, 8)), r"key/value rows Lk=0"),
    (dict(qs=(0, 4, 5, 8), ks=(0, 2, 6, 8)), r"batch size B=0"),
])
def test_bad_input_raises_clear_errors(args, match):
    qs = dict(args)
    dtype = qs.pop("dtype", torch.float64)
    q, k, v = (t.double() for t in _qkv(**qs))
    q = q.to(dtype)
    with pytest.raises(ValueError, match=match):
        check_qkv(q, k, v)
    with pytest.raises(ValueError, match=match):
        reference.attention(q, k, v)
    with pytest.raises(ValueError, match=match):
        tile_forward(q, k, v, q_pos=torch.arange(q.shape[-2]), kv_pos=torch.arange(k.shape[-2]))


def test_bad_scale_raises_clear_errors():
    q, k, v = (t.double() for t in _qkv())
    pos = dict(q_pos=torch.arange(5), kv_pos=torch.arange(6))
    for scale, match in ((math.inf, "scale must be finite"), (math.nan, "scale must be finite"),
                         ("big", "scale must be a real number")):
        with pytest.raises(ValueError, match=match):
            reference.attention(q, k, v, scale=scale)
        with pytest.raises(ValueError, match=match):
            tile_forward(q, k, v, scale=scale, **pos)
    out, lse = reference.attention(q, k, v, scale=0.0)       # scale 0 is uniform attention
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()


def test_bad_positions_kind_blocks_and_device_raise():
    q, k, v = _qkv()
    q, k, v = q.double(), k.double(), v.double()
    with pytest.raises(ValueError, match=r"q_pos must be 1-D with q's Lq=5 global positions"):
        tile_forward(q, k, v, q_pos=torch.arange(4), kv_pos=torch.arange(6))
    with pytest.raises(ValueError, match=r"kv_pos must be 1-D with k/v's Lk=6"):
        tile_backward(q, k, v, q, q[..., 0], q, q_pos=torch.arange(5), kv_pos=torch.arange(7))
    with pytest.raises(ValueError, match="tile kind is EMPTY"):
        tile_forward(q, k, v, q_pos=torch.arange(5), kv_pos=torch.arange(6),
                     kind=BlockKind.EMPTY)
    with pytest.raises(ValueError, match=r"blocks must have shape .* = \[3, 3\]"):
        tile_forward(q, k, v, q_pos=torch.arange(5), kv_pos=torch.arange(6),
                     blocks=torch.ones(2, 2, dtype=torch.int8), block_size=2)
    with pytest.raises(ValueError, match="blocks given without a positive block_size"):
        tile_forward(q, k, v, q_pos=torch.arange(5), kv_pos=torch.arange(6),
                     blocks=torch.ones(3, 3, dtype=torch.int8))
    with pytest.raises(ValueError, match=r"device mismatch: q on meta, k on cpu"):
        check_qkv(q.to("meta"), k, v)


def test_sdpa_falls_back_to_reference_with_a_reason(monkeypatch):
    kern = ops.SdpaKernel()

    def broken():
        raise RuntimeError("private op changed")

    monkeypatch.setattr(kern, "_self_test", broken)
    ok, reason = kern.available("cpu")
    assert not ok and "private op changed" in reason and "reference" in reason
    ok, reason = kern.available("cuda")
    assert not ok and "reference" in reason
    q, k, v = make_qkv(B=1, H=2, G=1, S=5, D=4, seed=2)
    pos = torch.arange(5)
    kw = dict(q_pos=pos, kv_pos=pos, mask_mod=make_mask("causal", 5, 0))
    assert_close(tile_forward(q, k, v, kernel=kern, **kw),
                 tile_forward(q, k, v, kernel="reference", **kw), **TIGHT)
