"""The tile call cache (``tile_forward/backward(..., cache=True)``, fringe.ops.tile._CallCache):
reused only when nothing that decides the numbers changed. Each test changes one thing a stale
cache would miss and checks the float64 answer against the dense reference."""
from __future__ import annotations

import gc

import pytest
import torch
from torch.testing import assert_close

import fringe
from fringe import schedules
from fringe.masks import BlockKind
from fringe.ops import reference, tile_backward, tile_forward
from fringe.ops import tile as tile_mod
from fringe.testing import make_qkv, tolerances

TIGHT = tolerances(torch.float64)
BS = 4
S = 24
KERNELS = ["sdpa", "reference"]


def causal(b, h, q, kv):
    return q >= kv


def window(b, h, q, kv):
    return (q >= kv) & (q - kv <= 5)


def anti(b, h, q, kv):
    return q <= kv


def block_map(mask_mod, q_pos, kv_pos):
    """Exact BlockKind map (dense evaluation, test only)."""
    m = reference.mask_for(mask_mod, q_pos, kv_pos, B=1, H=1)[0, 0]
    nq, nk = -(-len(q_pos) // BS), -(-len(kv_pos) // BS)
    out = torch.empty(nq, nk, dtype=torch.int8)
    for i in range(nq):
        for j in range(nk):
            sl = m[i * BS:(i + 1) * BS, j * BS:(j + 1) * BS]
            out[i, j] = int(BlockKind.FULL if bool(sl.all()) else
                            BlockKind.PARTIAL if bool(sl.any()) else BlockKind.EMPTY)
    return out


def expected(q, k, v, mask_mod, q_pos, kv_pos, blocks):
    """The reference answer for the tile as the block map states it: EMPTY blocks skipped,
    FULL blocks unmasked, PARTIAL blocks by mask_mod (all at the CURRENT values)."""
    qp, kp, bl = q_pos.clone(), kv_pos.clone(), blocks.clone()

    def eff(b, h, i, j):
        code = bl[i // BS, j // BS]
        return (code == int(BlockKind.FULL)) | ((code == int(BlockKind.PARTIAL))
                                               & mask_mod(b, h, qp[i], kp[j]))
    q_, k_, v_ = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out, lse = reference.attention(q_, k_, v_, mask_mod=eff)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(7), dtype=out.dtype)
    out.backward(dout)
    return out.detach(), lse.detach(), dout, (q_.grad, k_.grad, v_.grad)


def run(q, k, v, mask_mod, q_pos, kv_pos, blocks, kernel, cache=True):
    kw = dict(q_pos=q_pos, kv_pos=kv_pos, mask_mod=mask_mod, blocks=blocks, block_size=BS,
              kernel=kernel, cache=cache)
    out, lse = tile_forward(q, k, v, **kw)
    ref_out, ref_lse, dout, _ = expected(q, k, v, mask_mod, q_pos, kv_pos, blocks)
    grads = tile_backward(q, k, v, ref_out, ref_lse, dout, **kw)
    return out, lse, grads


def check(q, k, v, mask_mod, q_pos, kv_pos, blocks, kernel):
    out, lse, grads = run(q, k, v, mask_mod, q_pos, kv_pos, blocks, kernel)
    ref_out, ref_lse, _, ref_grads = expected(q, k, v, mask_mod, q_pos, kv_pos, blocks)
    assert_close(out, ref_out, **TIGHT)
    assert_close(lse, ref_lse, **TIGHT)
    for g, r in zip(grads, ref_grads):
        assert_close(g, r, **TIGHT)


@pytest.fixture
def qkv():
    return make_qkv(B=1, H=2, G=1, S=S, D=8, seed=3)


@pytest.fixture(autouse=True)
def fresh_cache(monkeypatch):
    cache = tile_mod._CallCache()
    monkeypatch.setattr(tile_mod, "_CACHE", cache)
    return cache


@pytest.mark.parametrize("kernel", KERNELS)
def test_cache_hits_and_equals_the_uncached_path_bit_for_bit(qkv, fresh_cache, kernel):
    q, k, v = qkv
    pos = torch.arange(S)
    blocks = block_map(window, pos, pos)
    check(q, k, v, window, pos, pos, blocks, kernel)
    assert fresh_cache.misses == 1 and fresh_cache.hits == 1      # the backward reused it
    cached = run(q, k, v, window, pos, pos, blocks, kernel)
    assert fresh_cache.hits == 3
    plain = run(q, k, v, window, pos, pos, blocks, kernel, cache=False)
    for a, b in zip((cached[0], cached[1], *cached[2]), (plain[0], plain[1], *plain[2])):
        assert torch.equal(a, b)


@pytest.mark.parametrize("kernel", KERNELS)
def test_block_map_edited_in_place(qkv, fresh_cache, kernel):
    q, k, v = qkv
    pos = torch.arange(S)
    blocks = block_map(causal, pos, pos)
    check(q, k, v, causal, pos, pos, blocks, kernel)
    blocks[2] = int(BlockKind.EMPTY)           # rows 8..11 now attend to nothing
    blocks[4, 1] = int(BlockKind.PARTIAL)      # FULL -> PARTIAL: same numbers, new calls
    check(q, k, v, causal, pos, pos, blocks, kernel)
    assert fresh_cache.misses == 2


@pytest.mark.parametrize("kernel", KERNELS)
def test_other_mask_mod_with_the_same_blocks(qkv, fresh_cache, kernel):
    q, k, v = qkv
    pos = torch.arange(S)
    blocks = torch.full((S // BS, S // BS), int(BlockKind.PARTIAL), dtype=torch.int8)
    for mod in (causal, anti, window, causal):
        check(q, k, v, mod, pos, pos, blocks, kernel)
    assert fresh_cache.misses == 3              # causal's entry is still valid the 2nd time


@pytest.mark.parametrize("kernel", KERNELS)
def test_positions_mutated_in_place(qkv, fresh_cache, kernel):
    q, k, v = qkv
    q_pos, kv_pos = torch.arange(S), torch.arange(S)
    blocks = torch.full((S // BS, S // BS), int(BlockKind.PARTIAL), dtype=torch.int8)
    check(q, k, v, window, q_pos, kv_pos, blocks, kernel)
    q_pos += 3                                  # the q rows now sit 3 tokens later
    check(q, k, v, window, q_pos, kv_pos, blocks, kernel)
    kv_pos.copy_(kv_pos.flip(0))                # kv reversed
    check(q, k, v, window, q_pos, kv_pos, blocks, kernel)
    assert fresh_cache.misses == 3


def test_new_tensor_at_a_reused_id(qkv, fresh_cache):
    q, k, v = qkv
    pos = torch.arange(S)
    old = block_map(causal, pos, pos)
    check(q, k, v, causal, pos, pos, old, "sdpa")
    key = next(iter(fresh_cache.entries))
    entry = fresh_cache.entries[key]
    # forge what CPython may do: a new map allocated at the freed map's id, same version.
    new = torch.full_like(old, int(BlockKind.PARTIAL))
    new[0] = int(BlockKind.EMPTY)
    forged = dict(entry, vers=(new._version, *entry["vers"][1:]))
    fresh_cache.entries[(id(new), *key[1:])] = forged     # only the weak reference differs
    check(q, k, v, causal, pos, pos, new, "sdpa")
    # and the natural way: the freed map's entry goes with it (weak reference callback)
    del old, entry, forged
    gc.collect()
    assert key not in fresh_cache.entries


def test_cached_mask_written_by_a_kernel_is_not_reused(qkv, fresh_cache):
    q, k, v = qkv
    pos = torch.arange(S)
    blocks = torch.full((S // BS, S // BS), int(BlockKind.PARTIAL), dtype=torch.int8)
    check(q, k, v, window, pos, pos, blocks, "reference")
    (entry,) = fresh_cache.entries.values()
    mask, _ = entry["masks"][0]
    mask.logical_not_()                         # a kernel that wrote into its mask argument
    check(q, k, v, window, pos, pos, blocks, "reference")
    assert fresh_cache.misses == 2


def test_byte_budget_evicts_and_keeps_oversized_plans(qkv, monkeypatch, fresh_cache):
    q, k, v = qkv
    pos = torch.arange(S)
    blocks = torch.full((S // BS, S // BS), int(BlockKind.PARTIAL), dtype=torch.int8)
    check(q, k, v, window, pos, pos, blocks, "reference")
    nb = fresh_cache.bytes                              # one tile's masks
    assert nb > 0
    tiny = tile_mod._CallCache(budget=nb - 1)
    monkeypatch.setattr(tile_mod, "_CACHE", tiny)
    check(q, k, v, window, pos, pos, blocks, "reference")
    (entry,) = tiny.entries.values()
    assert entry["calls"] is None and entry["nbytes"] == 0 and tiny.bytes == 0
    check(q, k, v, window, pos, pos, blocks, "reference")        # plan hit, masks rebuilt
    assert tiny.hits >= 2
    small = tile_mod._CallCache(budget=nb * 3 // 2)
    monkeypatch.setattr(tile_mod, "_CACHE", small)
    for mod in (causal, anti, window):                           # 1 tile's masks fit, 2 do not
        check(q, k, v, mod, pos, pos, blocks, "reference")
        assert small.bytes <= small.budget
    assert len(small.entries) == 1


def test_inference_positions_are_never_cached(qkv, fresh_cache):
    q, k, v = qkv
    with torch.inference_mode():
        pos = torch.arange(S)
    blocks = block_map(window, torch.arange(S), torch.arange(S))
    out, lse = tile_forward(q, k, v, q_pos=pos, kv_pos=pos, mask_mod=window, blocks=blocks,
                            block_size=BS, cache=True)
    assert not fresh_cache.entries
    ref_out, ref_lse, _, _ = expected(q, k, v, window, torch.arange(S), torch.arange(S), blocks)
    assert_close(out, ref_out, **TIGHT)


@pytest.mark.parametrize("mask", ["window", "document"])
def test_runtime_reuses_calls_across_steps_and_matches_reference(fresh_cache, mask):
    n, bs = 64, 8
    q, k, v = make_qkv(B=1, H=2, G=1, S=n, D=8, seed=5, requires_grad=True)
    if mask == "window":
        mod = fringe.masks.sliding_window(9)
    else:
        mod = fringe.masks.document(torch.tensor([0] * 20 + [1] * 30 + [2] * 14))
    plan = fringe.plan(schedules.get("zigzag"), mod, seq_len=n, world_size=2, block_size=bs)
    dout = torch.randn(1, 2, n, 8, generator=torch.Generator().manual_seed(1), dtype=q.dtype)
    got = []
    for _ in range(2):
        out = fringe.simulate.attention(q, k, v, plan=plan)
        grads = torch.autograd.grad(out, (q, k, v), dout)
        got.append((out.detach(), *grads))
    assert fresh_cache.hits > 0 and fresh_cache.misses > 0
    misses = fresh_cache.misses
    out = fringe.simulate.attention(q, k, v, plan=plan)
    assert fresh_cache.misses == misses                     # a third step builds nothing
    for a, b in zip(*got):
        assert torch.equal(a, b)
    qr, kr, vr = (t.detach().clone().requires_grad_() for t in (q, k, v))
    ref, _ = reference.attention(qr, kr, vr, mask_mod=mod)
    ref_grads = torch.autograd.grad(ref, (qr, kr, vr), dout)
    assert_close(got[0][0], ref, **TIGHT)
    for g, r in zip(got[0][1:], ref_grads):
        assert_close(g, r, **TIGHT)


def test_rows_accumulator_equals_zero_fill_and_add():
    """_Rows (copy on first write, add after, intervals for what is seen) == zeros + add."""
    g = torch.Generator().manual_seed(11)
    for trial in range(30):
        L = int(torch.randint(1, 40, (1,), generator=g))
        acc = tile_mod._Rows((1, 2, L, 3), torch.float64, "cpu")
        dense = torch.zeros(1, 2, L, 3, dtype=torch.float64)
        written = torch.zeros(L, dtype=torch.bool)
        for _ in range(int(torch.randint(1, 8, (1,), generator=g))):
            a = int(torch.randint(0, L, (1,), generator=g))
            b = int(torch.randint(a + 1, L + 1, (1,), generator=g))
            x = torch.randn(1, 2, b - a, 3, generator=g, dtype=torch.float64)
            assert acc.touched(slice(a, b)) == bool(written[a:b].any())
            if trial % 3 == 0 and not acc.touched(slice(a, b)):
                acc.put(slice(a, b), x)
            else:
                acc.add(slice(a, b), x)
            dense[:, :, a:b] += x
            written[a:b] = True
            if trial % 2:
                assert torch.equal(acc.get(slice(a, b)), dense[:, :, a:b])
        assert acc.seen == sorted(acc.seen)
        assert all(s1 < t0 for (_, s1), (t0, _) in zip(acc.seen, acc.seen[1:]))
        assert torch.equal(acc.result(torch.float64), dense)


def test_split_columns_covers_each_live_block_once():
    """_split_columns (pure Python over the codes): pieces cover every non-EMPTY block of the
    group exactly once, stay inside it, and carry the codes of the blocks they cover."""
    g = torch.Generator().manual_seed(5)
    E, F = int(BlockKind.EMPTY), int(BlockKind.FULL)
    for t in range(300):
        nr = int(torch.randint(1, 8, (1,), generator=g))
        nc = int(torch.randint(1, 10, (1,), generator=g))
        codes = torch.randint(0, 3, (nr, nc), generator=g, dtype=torch.int8)
        if t % 2:
            codes = torch.where(torch.rand(nr, nc, generator=g) < 0.6, torch.full_like(codes, F),
                                codes)
        grp = tile_mod._Group(8, 8 + nr * BS, 4, 4 + nc * BS, codes)
        pieces = tile_mod._split_columns(grp, block_size=BS, Lq=8 + nr * BS, Lk=4 + nc * BS)
        cover = torch.zeros(nr, nc, dtype=torch.int64)
        for p in pieces:
            r0, r1 = (p.q0 - 8) // BS, -(-(p.q1 - 8) // BS)
            c0, c1 = (p.k0 - 4) // BS, -(-(p.k1 - 4) // BS)
            assert 0 <= r0 < r1 <= nr and 0 <= c0 < c1 <= nc
            assert torch.equal(p.codes, codes[r0:r1, c0:c1])
            cover[r0:r1, c0:c1] += 1
        live = codes != E
        assert bool((cover[live] == 1).all()) and bool((cover <= 1).all())
