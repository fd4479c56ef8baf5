"""Tests for fringe.masks: dense evaluation, composition, exact block classification."""
from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.nn.attention.flex_attention import create_mask

from fringe import masks as M
from fringe.masks import BlockKind, MaskError

SEEDS = st.integers(0, 2**31 - 1)


# ----------------------------------------------------------------------------- helpers


def broadcast_oracle(mask_mod, q_pos, kv_pos):
    """``mask_mod(0, 0, q[:, None], kv[None, :])`` — the definition of a dense mask."""
    zero = torch.tensor(0)
    return mask_mod(zero, zero, q_pos[:, None], kv_pos[None, :]).expand(q_pos.numel(), kv_pos.numel())


def loop_oracle(mask_mod, q_pos, kv_pos):
    """Python double loop over scalar tensors (tiny sizes only)."""
    zero = torch.tensor(0)
    return torch.tensor([[bool(mask_mod(zero, zero, q, k)) for k in kv_pos] for q in q_pos],
                        dtype=torch.bool).view(q_pos.numel(), kv_pos.numel())


def block_reduce(dense: torch.Tensor, bs: int) -> torch.Tensor:
    """Block-wise reduction of a dense ``[Lq, Lk]`` bool mask into BlockKind codes."""
    lq, lk = dense.shape
    d = dense.reshape(lq // bs, bs, lk // bs, bs).transpose(1, 2).reshape(lq // bs, lk // bs, -1)
    return torch.where(d.all(-1), int(BlockKind.FULL),
                       torch.where(d.any(-1), int(BlockKind.PARTIAL), int(BlockKind.EMPTY))).to(torch.int8)


def layout(kind: str, S: int, P: int, g: torch.Generator) -> torch.Tensor:
    """Global positions in rank order (rank 0's tokens first) for a layout kind."""
    if kind == "contiguous":
        return torch.arange(S)
    if kind == "zigzag":  # 2P chunks, rank r holds chunks r and 2P-1-r
        ch = torch.arange(S).view(2 * P, -1)
        return torch.cat([torch.cat([ch[r], ch[2 * P - 1 - r]]) for r in range(P)])
    if kind == "striped":  # round-robin, one token per rank per round
        return torch.arange(S).view(-1, P).t().reshape(-1)
    if kind == "permutation":
        return torch.randperm(S, generator=g)
    raise AssertionError(kind)


def random_doc_ids(S: int, rng: random.Random, *, packed: bool = True) -> torch.Tensor:
    """Doc ids over S positions: packed (non-decreasing, 1-token docs likely) or shuffled."""
    lengths = []
    while sum(lengths) < S:
        lengths.append(rng.choice([1, 1, 2, 3, rng.randint(1, S)]))
    ids = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))[:S]
    if not packed:
        ids = ids[torch.randperm(S, generator=torch.Generator().manual_seed(rng.randint(0, 10**6)))]
    return ids


def random_leaf(S: int, rng: random.Random) -> M.Mask:
    k = rng.randrange(7)
    if k == 0:
        return M.causal()
    if k == 1:
        return M.sliding_window(rng.randint(1, S), causal=rng.random() < 0.5)
    if k == 2:
        return M.document(random_doc_ids(S, rng))
    if k == 3:
        return M.document(random_doc_ids(S, rng, packed=False))
    if k == 4:
        return M.prefix_lm(rng.randint(0, S))
    if k == 5:
        return M.full()
    w = rng.randint(1, S)
    return M.as_mask(lambda b, h, q, kv: (q + kv) % w != 0, name=f"sum%{w}")


def random_mask(S: int, rng: random.Random, depth: int = 2) -> M.Mask:
    if depth == 0 or rng.random() < 0.3:
        return random_leaf(S, rng)
    a, b = random_mask(S, rng, depth - 1), random_mask(S, rng, depth - 1)
    return a & b if rng.random() < 0.5 else a | b


# ----------------------------------------------------------------------------- evaluate


@settings(deadline=None, max_examples=40)
@given(seed=SEEDS, lq=st.integers(0, 9), lk=st.integers(0, 9))
def test_evaluate_matches_oracles(seed, lq, lk):
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    S = 16
    mask = random_mask(S, rng)
    q_pos = torch.randperm(S, generator=g)[:lq]
    kv_pos = torch.randperm(S, generator=g)[:lk]
    out = M.evaluate(mask, q_pos, kv_pos)
    assert out.shape == (1, 1, lq, lk) and out.dtype == torch.bool
    assert torch.equal(out[0, 0], broadcast_oracle(mask, q_pos, kv_pos))
    assert torch.equal(out[0, 0], loop_oracle(mask, q_pos, kv_pos))
    assert torch.equal(M.evaluate(mask, q_pos, kv_pos, method="vmap"), out)


def test_evaluate_batch_head_shape():
    def head_mask(b, h, q, kv):
        return (q >= kv) | (h == 1) & (b == 0)
    q = torch.arange(5)
    out = M.evaluate(head_mask, q, q, B=2, H=3)
    assert out.shape == (2, 3, 5, 5)
    assert torch.equal(out, create_mask(head_mask, 2, 3, 5, 5, device="cpu"))


def test_evaluate_falls_back_to_create_mask():
    # Written for scalar indices: stacking [Lq,1] with [1,Lk] fails when broadcast.
    def stacked(b, h, q_idx, kv_idx):
        pair = torch.stack([q_idx, kv_idx])
        return (pair[0] >= pair[1]) & (pair[0] - pair[1] < 3)

    g = torch.Generator().manual_seed(0)
    q_pos, kv_pos = torch.randperm(12, generator=g), torch.randperm(12, generator=g)[:7]
    with pytest.raises(RuntimeError):
        M.evaluate(stacked, q_pos, kv_pos, method="broadcast")
    with pytest.warns(UserWarning, match=r"stacked does not evaluate elementwise .* raises "
                                         r"RuntimeError.*torch\.vmap"):
        out = M.evaluate(stacked, q_pos, kv_pos, B=2, H=2)
    expect = create_mask(lambda b, h, qi, ki: stacked(b, h, q_pos[qi], kv_pos[ki]), 2, 2, 12, 7,
                         device="cpu")
    assert torch.equal(out, expect)
    assert torch.equal(out[0, 0], loop_oracle(stacked, q_pos, kv_pos))
    # classify goes through the same fallback for such a mod
    bm = M.classify(stacked, q_pos, q_pos, block_size=4)
    assert torch.equal(bm, block_reduce(loop_oracle(stacked, q_pos, q_pos), 4))


# ----------------------------------------------------------------------------- Mask values


def test_names_and_composition():
    ids = torch.repeat_interleave(torch.arange(12), 3)
    assert repr(M.causal()) == "causal" and M.causal().__name__ == "causal"
    assert repr(M.sliding_window(64)) == "sliding_window(64)"
    assert repr(M.sliding_window(8, causal=False)) == "sliding_window(8, causal=False)"
    assert repr(M.causal() & M.document(ids)) == "causal & document(12 docs)"
    assert repr(M.prefix_lm(5)) == "prefix_lm(5)"
    assert repr((M.causal() | M.prefix_lm(3)) & M.full()) == "(causal | prefix_lm(3)) & full"

    def mine(b, h, q, kv):
        return q != kv
    m = mine & M.causal()
    assert repr(m) == "mine & causal" and isinstance(m, M.Mask)
    assert repr(M.causal() | mine) == "causal | mine"
    assert repr(M.as_mask(mine, "offdiag")) == "offdiag"
    assert all(f.bh_invariant is True for f in (M.causal(), M.full(), M.sliding_window(3),
                                                M.document(ids), M.prefix_lm(2),
                                                M.as_mask(mine, bh_invariant=True)))
    assert M.as_mask(mine).bh_invariant is None         # not declared: decided, never assumed
    assert not (M.causal() & M.as_mask(mine, bh_invariant=False)).bh_invariant
    with pytest.raises(dataclasses_frozen_error()):
        M.causal().name = "x"
    # and_masks / or_masks semantics
    q = torch.arange(10)
    assert torch.equal(M.evaluate(m, q, q)[0, 0], (q[:, None] > q[None, :]))


def dataclasses_frozen_error():
    import dataclasses
    return dataclasses.FrozenInstanceError


# ----------------------------------------------------------------------------- classify


LAYOUTS = ["contiguous", "zigzag", "striped", "permutation"]


@settings(deadline=None, max_examples=30)
@given(seed=SEEDS, P=st.sampled_from([1, 2, 4]), bs=st.sampled_from([1, 2, 3, 4, 8]),
       k=st.integers(1, 3))
def test_classify_is_exact(seed, P, bs, k):
    """Every (q layout, kv layout) pair, whole sequences and one rank against another."""
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    S = 2 * P * bs * k
    L = S // P
    mask = random_mask(S, rng)
    pos = {kind: layout(kind, S, P, g) for kind in LAYOUTS}
    for qk in LAYOUTS:
        for kk in LAYOUTS:
            r, r2 = rng.randrange(P), rng.randrange(P)
            pairs = [(pos[qk], pos[kk])]
            if qk == kk:  # one rank's q against another rank's kv
                pairs.append((pos[qk][r * L:(r + 1) * L], pos[kk][r2 * L:(r2 + 1) * L]))
            for q_pos, kv_pos in pairs:
                got = M.classify(mask, q_pos, kv_pos, block_size=bs)
                expect = block_reduce(broadcast_oracle(mask, q_pos, kv_pos), bs)
                assert got.dtype == torch.int8
                assert torch.equal(got, expect), (mask, qk, kk, bs)


@settings(deadline=None, max_examples=50)
@given(seed=SEEDS, P=st.sampled_from([2, 3, 4]), bs=st.sampled_from([2, 3, 4]),
       leaf=st.sampled_from(["window", "bidirectional", "document", "prefix"]),
       param=st.integers(1, 9))
def test_classify_leaves_exact(seed, P, bs, leaf, param):
    """Single structured leaves with small parameters (narrow windows fall between the
    strides of striped blocks; short documents are skipped by strided blocks)."""
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    S = 2 * P * bs * 2
    mask = {"window": lambda: M.sliding_window(param),
            "bidirectional": lambda: M.sliding_window(param, causal=False),
            "document": lambda: M.document(random_doc_ids(S, rng)),
            "prefix": lambda: M.prefix_lm(param * bs)}[leaf]()
    pos = {kind: layout(kind, S, P, g) for kind in LAYOUTS}
    L = S // P
    for qk in LAYOUTS:
        for kk in LAYOUTS:
            r, r2 = rng.randrange(P), rng.randrange(P)
            q_pos, kv_pos = pos[qk][r * L:(r + 1) * L], pos[kk][r2 * L:(r2 + 1) * L]
            got = M.classify(mask, q_pos, kv_pos, block_size=bs)
            assert torch.equal(got, block_reduce(broadcast_oracle(mask, q_pos, kv_pos), bs)), \
                (mask, qk, kk, r, r2)


@settings(deadline=None, max_examples=30)
@given(seed=SEEDS, bs=st.sampled_from([4, 8, 16]), P=st.sampled_from([2, 4]),
       kind=st.sampled_from(["contiguous", "zigzag", "striped"]))
def test_structured_masks_need_little_dense_work(seed, bs, P, kind):
    """Band masks are exact from summaries on contiguous / zigzag / striped blocks."""
    rng = random.Random(seed)
    S = 2 * P * bs * 4
    pos = layout(kind, S, P, torch.Generator().manual_seed(seed))
    mask = [M.causal(), M.sliding_window(rng.randint(1, S)),
            M.sliding_window(rng.randint(1, S), causal=False)][rng.randrange(3)]
    stats = {}
    got = M.classify(mask, pos, pos, block_size=bs, stats=stats)
    assert torch.equal(got, block_reduce(broadcast_oracle(mask, pos, pos), bs))
    assert stats["dense_blocks"] == 0
    # packed documents on contiguous blocks: exact too
    doc = M.document(random_doc_ids(S, rng))
    got = M.classify(doc, torch.arange(S), torch.arange(S), block_size=bs, stats=stats)
    assert stats["dense_blocks"] == 0
    assert torch.equal(got, block_reduce(broadcast_oracle(doc, torch.arange(S), torch.arange(S)), bs))


@settings(deadline=None, max_examples=25)
@given(seed=SEEDS, bs=st.sampled_from([1, 3, 4]), nq=st.integers(1, 4), nk=st.integers(1, 4))
def test_classify_arbitrary_callable(seed, bs, nq, nk):
    g = torch.Generator().manual_seed(seed)
    S = 24
    table = torch.rand(S, S, generator=g) < torch.rand((), generator=g)
    q_pos = torch.randperm(S, generator=g)[:nq * bs]
    kv_pos = torch.randperm(S, generator=g)[:nk * bs]

    def lookup(b, h, q_idx, kv_idx):
        return table[q_idx, kv_idx] | (q_idx == kv_idx)

    stats = {}
    got = M.classify(lookup, q_pos, kv_pos, block_size=bs, stats=stats)
    assert torch.equal(got, block_reduce(loop_oracle(lookup, q_pos, kv_pos), bs))
    assert stats["dense_blocks"] == nq * nk


def test_classify_union_over_batch_and_heads():
    def per_head(b, h, q_idx, kv_idx):  # head 0 causal, head 1 full, batch 1 diagonal only
        return torch.where(b == 0, (q_idx >= kv_idx) | (h == 1), q_idx == kv_idx)

    q = torch.arange(8)
    mask = M.as_mask(per_head, bh_invariant=False)
    got = M.classify(mask, q, q, block_size=4, B=2, H=2)
    # FULL only if full for every (b, h); EMPTY only if empty for all
    d = M.evaluate(per_head, q, q, B=2, H=2).reshape(2, 2, 2, 4, 2, 4)
    expect = torch.where(d.all(dim=(0, 1, 3, 5)), 2,
                         torch.where(d.any(dim=(0, 1, 3, 5)), 1, 0)).to(torch.int8)
    assert torch.equal(got, expect)
    assert got.tolist() == [[1, 1], [1, 1]]
    assert M.classify(mask, q, q, block_size=4, H=2).tolist() == [[1, 1], [2, 1]]
    assert M.classify(mask, q, q, block_size=4).tolist() == [[1, 0], [2, 1]]  # b = h = 0
    # an invariant mask ignores B / H
    assert torch.equal(M.classify(M.causal(), q, q, block_size=4, B=3, H=5),
                       torch.tensor([[1, 0], [2, 1]], dtype=torch.int8))


def test_classify_million_tokens_causal_document():
    S, n_docs, bs = 1 << 20, 1000, 128
    g = torch.Generator().manual_seed(0)
    cuts = torch.randperm(S - 1, generator=g)[:n_docs - 1] + 1
    doc_ids = torch.zeros(S, dtype=torch.int64)
    doc_ids[cuts] = 1
    doc_ids = doc_ids.cumsum(0)
    mask = M.causal() & M.document(doc_ids)
    assert repr(mask) == "causal & document(1000 docs)"
    stats = {}
    pos = torch.arange(S)
    bm = M.classify(mask, pos, pos, block_size=bs, stats=stats)
    print(f"\n1M causal&document: {stats['seconds']:.2f}s, dense block pairs "
          f"{stats['dense_blocks']}, dense token pairs {stats['dense_pairs']:.3g} vs S^2={S * S:.3g}")
    assert bm.shape == (S // bs, S // bs)
    assert stats["dense_pairs"] <= n_docs * bs * bs  # ~ one diagonal block per boundary
    assert stats["dense_pairs"] < S * S // 10_000
    # the quadtree splits only cells along the diagonal and document boundaries
    assert stats["cells"] < 20 * (S // bs) and stats["rects"] < 50_000
    # spot-check a band of block rows against the dense mask
    rows = slice(4000 * bs, 4004 * bs)
    expect = block_reduce(broadcast_oracle(mask, pos[rows], pos[:5000 * bs]), bs)
    assert torch.equal(bm[4000:4004, :5000], expect)
    assert (bm[:, 5000:][4000:4004] == 0).all()


# ----------------------------------------------------------------------------- errors


def test_error_non_bool():
    q = torch.arange(4)
    with pytest.raises(MaskError, match=r"mask_mod must return a bool tensor, got torch\.float32; "
                                        r"build it from comparisons combined with & and \|"):
        M.evaluate(lambda b, h, qi, ki: (qi - ki).float(), q, q)
    with pytest.raises(MaskError, match="bool tensor, got torch.int64"):
        M.classify(lambda b, h, qi, ki: qi - ki, q, q, block_size=2)


@pytest.mark.parametrize("method", ["auto", "broadcast", "vmap"])
def test_error_python_control_flow(method):
    def with_if(b, h, q_idx, kv_idx):
        if q_idx >= kv_idx:
            return q_idx == q_idx
        return q_idx != q_idx

    def with_and(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) and (q_idx - kv_idx < 4)

    def with_or(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) or (kv_idx < 2)

    q = torch.arange(6)
    for fn in (with_if, with_and, with_or):
        with pytest.raises(MaskError, match=r"Python control flow.*& instead of 'and'.*\| instead "
                                            r"of 'or'.*torch\.where") as info:
            M.evaluate(fn, q, q, method=method)
        assert isinstance(info.value, ValueError)
    with pytest.raises(MaskError, match="Python control flow"):
        M.classify(with_and, q, q, block_size=3)


def test_error_block_size_not_dividing():
    q = torch.arange(1000)
    with pytest.raises(ValueError, match=r"len\(q_pos\)=1000 is not divisible by block_size=128; "
                                         r"pad the sequence to 1024"):
        M.classify(M.causal(), q, q, block_size=128)
    with pytest.raises(ValueError, match=r"len\(kv_pos\)=10 is not divisible by block_size=4"):
        M.classify(M.causal(), torch.arange(8), torch.arange(10), block_size=4)


def test_error_bad_inputs():
    with pytest.raises(ValueError, match="1-D integer tensor"):
        M.document(torch.rand(4))
    with pytest.raises(ValueError, match="window=0 must be >= 1"):
        M.sliding_window(0)
    with pytest.raises(MaskError, match="doc_ids has 4 entries"):
        M.classify(M.document(torch.zeros(4, dtype=torch.long)), torch.arange(8), torch.arange(8),
                   block_size=4)


def test_module_docstring_example_runs():
    import doctest
    import importlib
    import pkgutil
    result = doctest.testmod(M, extraglobs=dict(torch=torch))
    assert result.attempted >= 3 and result.failed == 0
    # the private modules' examples (BlockMap's) run with the package's public names
    attempted = 0
    for info in pkgutil.iter_modules(M.__path__):
        mod = importlib.import_module(f"{M.__name__}.{info.name}")
        r = doctest.testmod(mod, extraglobs=dict(vars(M), torch=torch))
        assert r.failed == 0, info.name
        attempted += r.attempted
    assert attempted >= 8
