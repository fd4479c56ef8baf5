"""The ``flex`` kernel on CPU (issue 9): what can be checked without a GPU.

- :func:`fringe.ops.flex.block_mask` follows fringe's exact block classification (FULL ->
  ``full_kv``, PARTIAL -> partial with the mask_mod, EMPTY absent), with global positions,
  also when fringe's blocks are merged into 128-token flex blocks;
- FlexAttention's eager forward (real ``flex_attention``, float64 on CPU) through
  ``tile_forward(kernel=FlexKernel(backend=None, devices=("cpu",)))`` equals the reference on
  FULL / PARTIAL / EMPTY-block / causal-diagonal tiles, Lq != Lk, GQA, global offsets,
  score_mod, dead rows. (The eager path is dense math that ignores the block map: the block
  map's meaning is checked by the stand-in below, not by flex.)
- the backward's composition (:func:`fringe.ops.flex.tile_vjp`) with the reference standing in
  for flex's tile forward, restricted to the BlockMask's own semantics (FULL blocks unmasked,
  PARTIAL blocks masked, absent blocks skipped), summed over kv tiles with the GLOBAL out/lse,
  equals dense autograd in float64: lse cotangent, score_params, dead rows included;
- compiled FlexAttention keeps one graph across tiles of one shape (new document ids, new
  positions, new block maps), measured with a counting ``torch.compile`` backend on CPU.

Untested here (no GPU): the Triton kernels themselves, their block-size configs, bf16/fp32
accuracy and speed; ``examples/gpu_check.py`` runs those.

Legend: B batch · H query heads · G kv heads · S sequence · L tokens · D head dim.
"""
from __future__ import annotations

import functools
import warnings

import pytest
import torch
from torch.testing import assert_close

from fringe import masks
from fringe.masks import BlockKind
from fringe.ops import KERNELS, get_kernel, merge, reference, tile_backward, tile_forward
from fringe.ops.flex import (FlexKernel, _merge_blocks, block_mask, flex_block_size, on_device,
                             tile_vjp)
from fringe.testing import make_qkv, tolerances

TIGHT = tolerances(torch.float64)

pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")


def eager_flex(**kw) -> FlexKernel:
    """FlexAttention's real eager forward on CPU (no backward there)."""
    return FlexKernel(backend=None, devices=("cpu",), **kw)


def semantic_mask(bm, *, B: int, H: int) -> torch.Tensor:
    """The element mask ``[B|1, H|1, Lq, Lk]`` a BlockMask means to a block-sparse kernel:
    True in full_kv blocks, ``mask_mod`` (local indices) in partial blocks, False elsewhere."""
    Lq, Lk = bm.seq_lengths
    fq, fk = bm.BLOCK_SIZE

    def dense(num, idx):
        nq, nk = idx.shape[-2:]
        d = torch.zeros(nq, nk, dtype=torch.bool)
        for i in range(nq):
            d[i, idx[0, 0, i, :int(num[0, 0, i])].long().cpu()] = True
        return d

    def elems(d):
        return d.repeat_interleave(fq, 0).repeat_interleave(fk, 1)[:Lq, :Lk]

    part = dense(bm.kv_num_blocks, bm.kv_indices)
    full = dense(bm.full_kv_num_blocks, bm.full_kv_indices)
    assert not bool((part & full).any())
    # the q-major copies flex's backward iterates are the transposes
    assert torch.equal(dense(bm.q_num_blocks, bm.q_indices), part.T)
    assert torch.equal(dense(bm.full_q_num_blocks, bm.full_q_indices), full.T)
    mm = masks.evaluate(bm.mask_mod, torch.arange(Lq), torch.arange(Lk), B=B, H=H)
    return elems(full)[None, None] | (elems(part)[None, None] & mm)


class StandIn(FlexKernel):
    """flex with its tile forward replaced by the differentiable reference restricted to the
    BlockMask's semantics: everything of the flex kernel but the FlexAttention call."""

    def __init__(self, **kw):
        super().__init__(backend=None, devices=("cpu",), **kw)

    def _attend(self, q, k, v, *, block_mask, score_mod, scale):
        Lq, Lk = q.shape[2], k.shape[2]
        mask = semantic_mask(block_mask, B=q.shape[0], H=q.shape[1])
        return reference.attend(q, k, v, q_pos=torch.arange(Lq), kv_pos=torch.arange(Lk),
                                mask=mask, score_mod=score_mod, scale=scale)


def packed(S: int, sizes: list[int]) -> torch.Tensor:
    return torch.repeat_interleave(torch.arange(len(sizes)), torch.tensor(sizes))[:S]


def doc_causal(S: int) -> masks.Mask:
    return masks.causal() & masks.document(packed(S, [5, 19, 1, 23, 16, S]))


# ---------------------------------------------------------------------------------------------
# the BlockMask


def test_flex_block_size_and_exact_merge():
    assert [flex_block_size(b) for b in (16, 64, 128, 256, 96)] == [128, 128, 128, 256, 384]
    assert flex_block_size(64, None) == 64
    with pytest.raises(ValueError, match="positive"):
        flex_block_size(0)
    g = torch.Generator().manual_seed(5)
    for nq, nk, f in ((5, 7, 2), (4, 4, 4), (3, 8, 3)):
        blocks = torch.randint(0, 3, (nq, nk), generator=g, dtype=torch.int8)
        blocks[0, :] = int(BlockKind.FULL)
        blocks[-1, :] = int(BlockKind.EMPTY)
        got = _merge_blocks(blocks, f)
        for i in range(got.shape[0]):
            for j in range(got.shape[1]):
                cell = blocks[i * f:(i + 1) * f, j * f:(j + 1) * f]
                want = (BlockKind.FULL if (cell == BlockKind.FULL).all() else
                        BlockKind.EMPTY if (cell == BlockKind.EMPTY).all() else BlockKind.PARTIAL)
                assert got[i, j] == want, (blocks, f, i, j)


CLASSIFIED = {
    "causal_offset": (masks.causal(), 40, 24, 64),             # q rows 40.., kv 24..: diagonal
    "doc_causal": (None, 0, 0, 96),
    "window_zigzag": (masks.sliding_window(20), 0, 0, 64),
}


@pytest.mark.parametrize("case", sorted(CLASSIFIED))
@pytest.mark.parametrize("sparse_multiple", [None, 16])
def test_block_mask_follows_fringe_classification(case, sparse_multiple):
    mask, q0, k0, L = CLASSIFIED[case]
    mask = mask if mask is not None else doc_causal(160)
    bs = 8
    q_pos = torch.arange(q0, q0 + L)
    kv_pos = torch.arange(k0, k0 + L - 8)                       # Lq != Lk
    if case == "window_zigzag":                                # a zigzag-like, non-contiguous kv
        kv_pos = torch.cat([torch.arange(0, 24), torch.arange(100, 132)])
    blocks = masks.classify(mask, q_pos, kv_pos, block_size=bs)
    kinds = {int(x) for x in blocks.unique()}
    assert kinds == {0, 1, 2} or case == "causal_offset"
    bm = block_mask(blocks, block_size=bs, q_pos=q_pos, kv_pos=kv_pos, mask_mod=mask,
                    sparse_multiple=sparse_multiple)
    fb = flex_block_size(bs, sparse_multiple)
    assert bm.BLOCK_SIZE == (fb, fb) and bm.seq_lengths == (q_pos.numel(), kv_pos.numel())
    merged = _merge_blocks(blocks, fb // bs)
    full, part = semantic_parts(bm)
    assert torch.equal(full, merged == BlockKind.FULL)
    assert torch.equal(part, merged == BlockKind.PARTIAL)
    # the kernel's reading of the BlockMask is the mask itself, on global positions
    assert torch.equal(semantic_mask(bm, B=1, H=1), masks.evaluate(mask, q_pos, kv_pos))


def semantic_parts(bm) -> tuple[torch.Tensor, torch.Tensor]:
    def dense(num, idx):
        d = torch.zeros(idx.shape[-2:], dtype=torch.bool)
        for i in range(idx.shape[-2]):
            d[i, idx[0, 0, i, :int(num[0, 0, i])].long()] = True
        return d
    return (dense(bm.full_kv_num_blocks, bm.full_kv_indices),
            dense(bm.kv_num_blocks, bm.kv_indices))


def test_block_mask_rejects_a_wrong_map():
    with pytest.raises(ValueError, match=r"= \[2, 3\] for Lq=16, Lk=24, block_size=8; got \[2, 2\]"):
        block_mask(torch.zeros(2, 2, dtype=torch.int8), block_size=8, q_pos=torch.arange(16),
                   kv_pos=torch.arange(24), mask_mod=None)


# ---------------------------------------------------------------------------------------------
# forward: FlexAttention's eager path on CPU, float64, against the reference


def softcap(score, b, h, q_idx, kv_idx):
    return 3.0 * torch.tanh(score / 3.0) - 0.01 * (q_idx - kv_idx).abs()


TILES = {
    # name: (B, H, G, mask, q_pos, kv_pos, how, score_mod)
    "full_tile_gqa": (2, 4, 2, None, range(32, 64), range(0, 24), "full", None),
    "causal_diagonal": (1, 4, 4, masks.causal(), range(32, 64), range(32, 64), "blocks", None),
    "doc_blocks_offset_gqa": (2, 4, 1, "doc", range(40, 80), range(16, 64), "blocks", None),
    "partial_no_map": (1, 2, 2, "doc", range(8, 40), range(0, 48), "partial", None),
    "score_mod_window": (1, 4, 2, masks.sliding_window(12), range(16, 48), range(8, 40), "blocks",
                         softcap),
}


def tile_args(name: str) -> tuple:
    B, H, G, mask, qr, kr, how, score_mod = TILES[name]
    mask = doc_causal(96) if mask == "doc" else mask
    q_pos, kv_pos = torch.arange(qr.start, qr.stop), torch.arange(kr.start, kr.stop)
    q, _, _ = make_qkv(B=B, H=H, G=G, S=q_pos.numel(), D=8, seed=31)
    _, k, v = make_qkv(B=B, H=H, G=G, S=kv_pos.numel(), D=8, seed=32)
    kw = dict(q_pos=q_pos, kv_pos=kv_pos, score_mod=score_mod, scale=0.4)
    if how == "full":
        kw.update(kind=BlockKind.FULL)
    elif how == "partial":
        kw.update(kind=BlockKind.PARTIAL, mask_mod=mask)
    else:
        kw.update(kind=BlockKind.PARTIAL, mask_mod=mask, block_size=8,
                  blocks=masks.classify(mask, q_pos, kv_pos, block_size=8))
    return q, k, v, kw


@pytest.mark.parametrize("name", sorted(TILES))
def test_eager_flex_forward_equals_reference_float64(name):
    q, k, v, kw = tile_args(name)
    out, lse = tile_forward(q, k, v, kernel=eager_flex(), **kw)
    want_o, want_l = tile_forward(q, k, v, kernel="reference", **kw)
    assert out.dtype == q.dtype and lse.dtype == torch.float64
    assert_close(out, want_o, **TIGHT)
    assert torch.equal(torch.isneginf(lse), torch.isneginf(want_l))
    assert_close(lse, want_l, **TIGHT)
    if name == "doc_blocks_offset_gqa":          # rows with nothing in this kv tile: dead
        dead = torch.isneginf(lse)
        assert dead.any() and not dead.all()
        assert torch.equal(out[dead.unsqueeze(-1).expand_as(out)],
                           torch.zeros_like(out[dead.unsqueeze(-1).expand_as(out)]))


def test_eager_flex_on_the_whole_sequence_equals_the_dense_oracle():
    S = 64
    mask = doc_causal(S)
    q, k, v = make_qkv(B=1, H=4, G=2, S=S, D=8, seed=33)
    pos = torch.arange(S)
    blocks = masks.classify(mask, pos, pos, block_size=16)
    out, lse = tile_forward(q, k, v, q_pos=pos, kv_pos=pos, mask_mod=mask, blocks=blocks,
                            block_size=16, kernel=eager_flex())
    want_o, want_l = reference.attention(q, k, v, mask_mod=mask)
    assert_close(out, want_o, **TIGHT)
    assert_close(lse, want_l, **TIGHT)


# ---------------------------------------------------------------------------------------------
# backward: the composition, with the reference standing in for flex's tile forward


def dense_grads(q, k, v, mask, score_mod, w, u, params=()):
    """Dense autograd of ``<w, out> + <u, lse>`` (lse -inf rows contribute 0)."""
    qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))
    out, lse = reference.attention(qg, kg, vg, mask_mod=mask, score_mod=score_mod, scale=0.4)
    loss = (out * w).sum() + (lse.masked_fill(torch.isneginf(lse), 0.0) * u).sum()
    return out.detach(), lse.detach(), torch.autograd.grad(loss, (qg, kg, vg, *params))


def run_pieces(kernel, q, k, v, w, u, mask, pieces, *, score_mod=None, params=(), bs=8):
    """Forward over kv pieces, merge, then sum each piece's tile_backward (GLOBAL out/lse)."""
    S = q.shape[2]
    q_pos = torch.arange(S)

    def kw(kv_pos, how):
        if how == "full":
            return dict(kind=BlockKind.FULL)
        if how == "partial":
            return dict(kind=BlockKind.PARTIAL, mask_mod=mask)
        return dict(kind=BlockKind.PARTIAL, mask_mod=mask, block_size=bs,
                    blocks=masks.classify(mask, q_pos, kv_pos, block_size=bs))

    out = lse = None
    for kv_pos, how in pieces:
        o, l = tile_forward(q, k[:, :, kv_pos], v[:, :, kv_pos], q_pos=q_pos, kv_pos=kv_pos,
                            score_mod=score_mod, scale=0.4, kernel=kernel, **kw(kv_pos, how))
        out, lse = (o, l) if out is None else merge(out, lse, o, l)
    out = out.to(q.dtype)
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    dparams = [torch.zeros_like(p) for p in params]
    for kv_pos, how in pieces:
        res = tile_backward(q, k[:, :, kv_pos], v[:, :, kv_pos], out, lse, w, q_pos=q_pos,
                            kv_pos=kv_pos, score_mod=score_mod, scale=0.4, kernel=kernel,
                            dlse=u, score_params=params, **kw(kv_pos, how))
        dq += res[0]
        dk[:, :, kv_pos] += res[1]
        dv[:, :, kv_pos] += res[2]
        for acc, g in zip(dparams, res[3] if params else ()):
            acc += g
    return out, lse, (dq, dk, dv, *dparams)


@pytest.mark.parametrize("sparse_multiple", [None, 16])
def test_stand_in_backward_summed_over_tiles_is_exact(sparse_multiple):
    B, H, G, S, D = 2, 4, 2, 48, 6
    mask = doc_causal(S) & masks.as_mask(lambda b, h, q, kv: q % 11 != 7, "dead rows")
    q, k, v = make_qkv(B=B, H=H, G=G, S=S, D=D, seed=41)
    gen = torch.Generator().manual_seed(42)
    w = torch.randn(B, H, S, D, generator=gen, dtype=torch.float64)
    u = torch.randn(B, H, S, generator=gen, dtype=torch.float64)
    out_r, lse_r, want = dense_grads(q, k, v, mask, None, w, u)
    pos = torch.arange(S)
    pieces = [(pos[:16], "blocks"), (pos[16:24], "partial"), (pos[24:], "blocks")]
    out, lse, got = run_pieces(StandIn(sparse_multiple=sparse_multiple), q, k, v, w, u, mask,
                               pieces)
    assert_close(out, out_r, **TIGHT)
    assert torch.equal(torch.isneginf(lse), torch.isneginf(lse_r))
    assert_close(got, want, **TIGHT)
    # the lse cotangent matters: the same without it is far off
    _, _, without = run_pieces(StandIn(), q, k, v, w, torch.zeros_like(u), mask, pieces)
    assert (without[0] - want[0]).abs().max() > 1e-2


def test_stand_in_backward_with_score_params_and_a_full_tile():
    B, H, G, S, D = 1, 2, 1, 32, 4
    gen = torch.Generator().manual_seed(51)
    bias = torch.nn.Parameter(torch.randn(H, 2 * S - 1, generator=gen, dtype=torch.float64))

    def rel_bias(score, b, h, q_idx, kv_idx):
        return score + bias[h, q_idx - kv_idx + S - 1]

    mask = masks.sliding_window(40, causal=False)                 # every pair of the first tile
    q, k, v = make_qkv(B=B, H=H, G=G, S=S, D=D, seed=52)
    w = torch.randn(B, H, S, D, generator=gen, dtype=torch.float64)
    u = torch.randn(B, H, S, generator=gen, dtype=torch.float64)
    _, _, want = dense_grads(q, k, v, mask, rel_bias, w, u, params=(bias,))
    pos = torch.arange(S)
    pieces = [(pos[:8], "full"), (pos[8:], "blocks")]
    _, _, got = run_pieces(StandIn(), q, k, v, w, u, mask, pieces, score_mod=rel_bias,
                           params=(bias,))
    assert_close(got, want, **TIGHT)
    assert bias.grad is None and got[3].abs().sum() > 0


def test_tile_vjp_matches_the_reference_backward_per_tile():
    """One tile, GLOBAL out/lse from the whole sequence: tile_vjp == reference.grad_tile."""
    B, H, G, S, D = 1, 4, 2, 24, 5
    q, k, v = make_qkv(B=B, H=H, G=G, S=S, D=D, seed=61)
    mask = reference.mask_for(doc_causal(S), torch.arange(S), torch.arange(S), B=B, H=H)
    pos = torch.arange(S)
    out, lse = reference.attend(q, k, v, q_pos=pos, kv_pos=pos, mask=mask, score_mod=None,
                                scale=0.4)
    gen = torch.Generator().manual_seed(62)
    dout = torch.randn(B, H, S, D, generator=gen, dtype=torch.float64)
    dlse = torch.randn(B, H, S, generator=gen, dtype=torch.float64)
    cols = slice(5, 17)
    kt, vt, mt = k[:, :, cols], v[:, :, cols], mask[..., cols]

    def fwd(qq, kk, vv):
        return reference.attend(qq, kk, vv, q_pos=pos, kv_pos=pos[cols], mask=mt,
                                score_mod=None, scale=0.4)

    got = tile_vjp(fwd, q, kt, vt, out, lse, dout, dlse=dlse)
    want = reference.grad_tile(q, kt, vt, out, lse, dout, q_pos=pos, kv_pos=pos[cols], mask=mt,
                               score_mod=None, scale=0.4, dlse=dlse)
    assert_close(got, want, **TIGHT)


# ---------------------------------------------------------------------------------------------
# compiled: one graph per tile shape


def test_compiled_flex_keeps_one_graph_across_batches_positions_and_maps():
    graphs = []

    def counting(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    kern = FlexKernel(backend=counting, devices=("cpu",))
    S, L = 128, 32
    for n, (sizes, r) in enumerate((([9, 30, 2, 60, 27], 1), ([40, 40, 48], 2),
                                    ([3, 5, 100, 20], 3))):
        mask = masks.causal() & masks.document(packed(S, sizes))   # a new batch's documents
        q_pos, kv_pos = torch.arange(r * L, (r + 1) * L), torch.arange(0, L + 16)
        blocks = masks.classify(mask, q_pos, kv_pos, block_size=16)
        q, k, v = make_qkv(B=1, H=2, G=1, S=L, D=8, seed=70 + n, Lk=L + 16)
        kw = dict(q_pos=q_pos, kv_pos=kv_pos, mask_mod=mask, blocks=blocks, block_size=16)
        out, lse = tile_forward(q, k, v, kernel=kern, **kw)
        want_o, want_l = tile_forward(q, k, v, kernel="reference", **kw)
        assert_close(out, want_o, **TIGHT)
        assert_close(lse, want_l, **TIGHT)
    assert len(graphs) == 1


# ---------------------------------------------------------------------------------------------
# registry and CPU behaviour


def test_flex_is_registered_never_chosen_automatically_and_falls_back_on_cpu(monkeypatch):
    import fringe.ops.tile as tile

    monkeypatch.setattr(tile, "_WARNED", set())
    flex = KERNELS["flex"]
    assert get_kernel("flex") is flex and flex.wants_blocks
    ok, why = flex.available("cpu")
    assert not ok and "CPU backward" in why
    assert get_kernel(None).name != "flex"
    q, k, v, kw = tile_args("doc_blocks_offset_gqa")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out, lse = tile_forward(q, k, v, kernel="flex", **kw)
        tile_forward(q, k, v, kernel="flex", **kw)
    said = [str(c.message) for c in caught if issubclass(c.category, RuntimeWarning)]
    assert len(said) == 1 and all("'flex' is not available on cpu" in s for s in said)
    want_o, want_l = tile_forward(q, k, v, kernel="reference", **kw)
    assert_close(out, want_o, **TIGHT)
    assert_close(lse, want_l, **TIGHT)


def test_on_device_moves_captured_tensors_but_not_parameters():
    table = torch.arange(6)
    bias = torch.nn.Parameter(torch.zeros(3, dtype=torch.float64))

    def custom(b, h, q_idx, kv_idx):
        return table[q_idx] >= table[kv_idx]

    picky = functools.partial(lambda t, b, h, q_idx, kv_idx: t[q_idx] > 0, table)
    mask = masks.causal() & masks.document(torch.tensor([0, 0, 1, 1, 2, 2])) & custom
    for mod in (mask, picky, lambda s, b, h, q_idx, kv_idx: s + bias[h]):
        assert on_device(mod, "cpu") is (mod.mod if isinstance(mod, masks.Mask) else mod)
        moved = on_device(mod, "meta")
        found = list(captured(moved))
        assert found, mod
        for t in found:
            assert t.device.type == ("cpu" if t is bias else "meta"), (mod, t)
    assert table.device.type == "cpu" and {t.device.type for t in captured(mask.mod)} == {"cpu"}


def captured(obj, seen=None):
    """Every tensor reachable from a mod's closures, partial args and containers."""
    seen = set() if seen is None else seen
    if id(obj) in seen:
        return
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, functools.partial):
        for x in (obj.func, *obj.args):
            yield from captured(x, seen)
    elif callable(obj) and hasattr(obj, "__closure__"):
        for c in obj.__closure__ or ():
            yield from captured(c.cell_contents, seen)
    elif isinstance(obj, (tuple, list)):
        for x in obj:
            yield from captured(x, seen)


def test_stand_in_through_a_plan_on_the_virtual_mesh_float64():
    """The engine hands flex-like kernels whole tiles, GLOBAL out/lse and the lse cotangent."""
    import fringe
    from fringe import schedules

    S = 96
    mask = doc_causal(S)
    q, k, v = make_qkv(B=1, H=4, G=2, S=S, D=6, seed=81, requires_grad=True)
    p = fringe.plan(schedules.zigzag(), mask, seq_len=S, world_size=3, block_size=8,
                    kernel=StandIn())
    out, lse = fringe.simulate.attention(q, k, v, plan=p, return_lse=True)
    ro, rl = reference.attention(q, k, v, mask_mod=mask)
    got = torch.autograd.grad(out.square().sum() + lse.sum(), (q, k, v))
    want = torch.autograd.grad(ro.square().sum() + rl.sum(), (q, k, v))
    assert_close(out, ro, **TIGHT)
    assert_close(got, want, **TIGHT)


# ---------------------------------------------------------------------------------------------
# several masks in one process (issue 17 item 4: pytorch #176211)


def test_eager_flex_runs_several_masks_and_schedules_in_one_process_float64():
    """A document mask, then a sliding window, then a prefix-LM mask, each under ring,
    ulysses and compose(ring, ulysses) in one process: before one compiled function per call
    structure, the second mask raised ``TypeError: 'int' object is not subscriptable`` from
    Dynamo's guards (pytorch #176211). A new batch's document ids reuse their function."""
    import fringe
    from fringe import schedules
    from fringe.simulate import attention

    S, H, G = 32, 4, 2
    kern = eager_flex()
    q, k, v = make_qkv(B=1, H=H, G=G, S=S, D=4, seed=91)

    def docs(sizes):
        return masks.causal() & masks.document(packed(S, sizes))

    cases = [docs([5, 14, S]), masks.sliding_window(7), masks.prefix_lm(9)]
    plans = {"ring": (schedules.ring(), 2), "ulysses": (schedules.ulysses(), 2),
             "compose": (schedules.compose(schedules.ring(), schedules.ulysses(),
                                           inner_size=2), 4)}
    next_batch = docs([17, 2, S])                       # both cross the middle (tile q1.kv0)
    for mask in [*cases, next_batch]:
        want, _ = reference.attention(q, k, v, mask_mod=mask)
        for name, (sched, P) in plans.items():
            made = getattr(kern, "_made", None)      # compiled functions so far
            p = fringe.plan(sched, mask, seq_len=S, world_size=P, block_size=8, kernel=kern)
            with torch.no_grad():
                out = attention(q, k, v, plan=p)
            assert_close(out, want, **TIGHT, msg=lambda m, mask=mask, name=name: f"{mask} "
                         f"{name}: {m}")
            if mask is next_batch:
                assert kern._made == made, f"{name}: a new batch compiled a new function"
    assert 0 < len(kern._fns) == kern._made
