"""mask_mods mean what they mean in FlexAttention; planned masks do not alias the caller's
tensors; masks and score_mods have content digests that ranks can compare (issue 7, items
2-4)."""
from __future__ import annotations

import contextlib
import functools
import io
import os
import subprocess
import sys
import warnings

import numpy as np
import pytest
import torch
from torch.nn.attention.flex_attention import create_mask

import fringe
from fringe import masks as M
from fringe import schedules
from fringe.masks import BlockKind, MaskError
from fringe.ops import reference
from fringe.testing import check_mask, make_qkv, tolerances


def flex(mod, q_pos, kv_pos, B=1, H=1):
    """FlexAttention's own dense mask: torch's create_mask (vmap over scalar indices)."""
    return create_mask(lambda b, h, qi, ki: mod(b, h, q_pos[qi], kv_pos[ki]), B, H,
                       q_pos.numel(), kv_pos.numel(), device="cpu")


def block_reduce(dense: torch.Tensor, bs: int) -> torch.Tensor:
    lq, lk = dense.shape
    d = dense.reshape(lq // bs, bs, lk // bs, bs).transpose(1, 2).reshape(lq // bs, lk // bs, -1)
    return torch.where(d.all(-1), int(BlockKind.FULL),
                       torch.where(d.any(-1), int(BlockKind.PARTIAL), int(BlockKind.EMPTY))).to(torch.int8)


def reduction_mods():
    """Mods written for scalar indices whose broadcast meaning differs (new objects per call)."""
    def all_causal(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx).all()

    def sum_causal(b, h, q_idx, kv_idx):
        return (q_idx - kv_idx).sum() >= 0

    def any_band(b, h, q_idx, kv_idx):
        return ((q_idx - kv_idx).abs() <= 1).any()

    return [all_causal, sum_causal, any_band]


# ----------------------------------------------------------------------------- semantics


@pytest.mark.parametrize("which", range(3))
def test_reductions_give_flexattentions_answer(which):
    mod = reduction_mods()[which]
    g = torch.Generator().manual_seed(which)
    q_pos, kv_pos = torch.randperm(24, generator=g)[:12], torch.randperm(24, generator=g)[:16]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = M.evaluate(mod, q_pos, kv_pos)
        want = flex(mod, q_pos, kv_pos)
        assert want.any() and not want.all()            # a real mask, not all / nothing
        assert torch.equal(out, want)
        # broadcasting really means something else for these (the bug this guards against)
        assert not torch.equal(M.evaluate(mod, q_pos, kv_pos, method="broadcast"), want)
        # classify decides the same way: the block map of FlexAttention's mask
        order = torch.randperm(24, generator=g)
        bm = M.classify(mod, order, order, block_size=4)
        assert torch.equal(bm, block_reduce(flex(mod, order, order)[0, 0], 4))
        # and so does a Mask tree holding it: structured leaves broadcast, this leaf vmaps
        tree = M.document(torch.arange(24) // 7) & M.as_mask(mod, name="mine")
        assert torch.equal(M.evaluate(tree, q_pos, kv_pos, B=2, H=3), flex(tree, q_pos, kv_pos, 2, 3))
        assert torch.equal(M.classify(tree, order, order, block_size=4),
                           block_reduce(flex(tree, order, order)[0, 0], 4))
        # per scalar index: a probe cannot prove it ignores b / h, so it reads both; the probe
        # saw it read neither (a witness would be named)
        assert M.reads_batch_head(mod, seq_len=24) == (True, True)
        r = M.reads_bh(mod, seq_len=24, witness=True)
        assert (r.seen_b, r.seen_h, r.unproven) == (False, False, (mod.__name__,))


def test_vmap_fallback_warns_once_with_reason_and_cost():
    def all_causal_once(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx).all()

    q = torch.arange(10)
    with pytest.warns(UserWarning, match=r"all_causal_once does not evaluate elementwise.*"
                                         r"broadcasting gives .* FlexAttention's per-index .*"
                                         r"\.all\(\).*torch\.vmap.*ms by vmap vs .* ms"):
        M.evaluate(all_causal_once, q, q)
    with warnings.catch_warnings():
        warnings.simplefilter("error")                 # decided and cached: no second warning
        assert torch.equal(M.evaluate(all_causal_once, q, q)[0, 0], q[:, None] >= q[None, :])


def test_elementwise_mods_keep_the_fast_path_without_warning():
    ids = torch.arange(20) // 6
    calls = []

    def doc(b, h, q_idx, kv_idx):       # keeps q_idx: reading its shape in here is not elementwise
        calls.append(q_idx)
        return ids[q_idx] == ids[kv_idx]

    def everything(b, h, q_idx, kv_idx):                # a scalar result broadcasts, like full()
        return torch.tensor(True)

    q = torch.arange(20)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert torch.equal(M.evaluate(doc, q, q)[0, 0], ids[:, None] == ids[None, :])
        calls.clear()
        M.evaluate(doc, q, q)
        assert [tuple(t.shape) for t in calls] == [(1, 1, 20, 1)]   # one broadcast call
        assert M.evaluate(everything, q, q[:7], B=2, H=3).all()
        assert M.evaluate(M.causal() & M.document(ids), q, q).shape == (1, 1, 20, 20)


def test_item_raises_what_flexattention_raises():
    def with_item(b, h, q_idx, kv_idx):
        return torch.tensor(q_idx.item() >= kv_idx.item())

    q = torch.arange(8)
    for call in (lambda: M.evaluate(with_item, q, q), lambda: M.evaluate(with_item, q, q, method="vmap"),
                 lambda: M.classify(with_item, q, q, block_size=2),
                 lambda: M.evaluate(M.causal() & M.as_mask(with_item), q, q)):
        with pytest.raises(MaskError, match=r"\.item\(\).*traced per scalar index under torch\.vmap, "
                                            r"as in FlexAttention"):
            call()
    with pytest.raises(MaskError, match=r"\.item\(\)"):
        fringe.plan(schedules.ring(), with_item, seq_len=8, world_size=2, block_size=2)


def test_non_bool_results_are_refused_with_what_was_expected():
    q = torch.arange(6)
    with pytest.raises(MaskError, match=r"must return a bool tensor, got NoneType"):
        M.evaluate(lambda b, h, qi, ki: None, q, q)
    with pytest.raises(MaskError, match=r"must return a bool tensor, got torch\.int64"):
        M.evaluate(lambda b, h, qi, ki: qi - ki, q, q)
    with pytest.raises(MaskError, match=r"must return a bool tensor, got NoneType"):
        M.classify(lambda b, h, qi, ki: None, q, q, block_size=3)


def test_reads_batch_head_uses_the_same_decision():
    table = torch.tensor([1, 3])

    def per_head_all(b, h, q_idx, kv_idx):              # reads h, and needs vmap (.all())
        return ((q_idx - kv_idx >= 0) & (q_idx - kv_idx < table[h])).all()

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        # a 2-entry head table: the 3-head probe fails, a 2-head one sees it read h; per
        # scalar index, so unproven: it reads both
        r = M.reads_bh(per_head_all, seq_len=16, witness=True)
        assert (r.b, r.h, r.seen_b, r.seen_h) == (True, True, False, True)
        assert M.reads_batch_head(per_head_all, seq_len=16) == (True, True)
        q = torch.arange(16)
        assert torch.equal(M.evaluate(per_head_all, q, q, H=2), flex(per_head_all, q, q, 1, 2))
        with pytest.raises(MaskError, match=r"fails when called per scalar index.*IndexError"):
            M.evaluate(per_head_all, q, q, H=3)                 # FlexAttention fails too
        assert check_mask(per_head_all, world_sizes=(2,), block_sizes=(2,), heads=2, num_heads=2,
                          schedules={"zigzag": schedules.zigzag()}) == 1


def test_a_verdict_on_made_up_positions_is_not_kept():
    def far_any(b, h, q_idx, kv_idx):            # its reduction shows only where |q - kv| = 5
        return ((q_idx - kv_idx).abs() == 5).any() | (q_idx >= kv_idx)

    assert M.reads_batch_head(far_any) == (True, True)    # positions 0, 1 only: undecided
    q = torch.arange(16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert torch.equal(M.evaluate(far_any, q, q), flex(far_any, q, q))


def test_check_mask_catches_a_broadcast_meaning_and_passes_once_fringe_vmaps(monkeypatch):
    def all_causal_cm(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx).all()

    kw = dict(world_sizes=(2,), block_sizes=(2,), schedules={"zigzag": schedules.zigzag()})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        # fringe as it was: every mod broadcast. The FlexAttention oracle must catch it.
        for module in (M._eval, M._bh):
            monkeypatch.setattr(module, "_decide", lambda *a, **k: "broadcast")
        with pytest.raises(AssertionError, match=r"schedule=zigzag P=2 block_size=2.*(classified|differs)"):
            check_mask(all_causal_cm, **kw)
        monkeypatch.undo()
        # per scalar index, so b / h are classified (the rows and heads check_mask runs)
        assert check_mask(all_causal_cm, num_heads=8, batch_size=3, **kw) == 1
        assert check_mask(reduction_mods()[2], num_heads=8, batch_size=3, **kw) == 1


def test_check_mask_fails_on_nan_where_dense_is_finite(monkeypatch):
    real = fringe.simulate.attention

    def poisoned(*args, **kw):
        out, lse = real(*args, **kw)
        row = torch.zeros_like(out)
        row[..., 3, :] = float("nan")
        return out + row, lse

    monkeypatch.setattr(fringe.simulate, "attention", poisoned)
    with pytest.raises(AssertionError, match=r"out differs from dense attention \(NaN at 4 entries"):
        check_mask(M.causal(), world_sizes=(2,), block_sizes=(2,),
                   schedules={"ring": schedules.ring()}, heads=1, batch=1)


# ----------------------------------------------------------------------------- snapshot


def test_document_does_not_alias_doc_ids():
    ids = torch.tensor([0, 0, 0, 1, 1, 1, 1, 2])
    mask = M.causal() & M.document(ids)
    q = torch.arange(8)
    before = M.evaluate(mask, q, q).clone()
    blocks = M.classify(mask, q, q, block_size=2)
    ids.copy_(torch.tensor([0, 1, 2, 3, 4, 5, 6, 7]))              # the next batch, in place
    assert torch.equal(M.evaluate(mask, q, q), before)
    assert torch.equal(M.classify(mask, q, q, block_size=2), blocks)


def test_snapshot_of_a_lambda_does_not_alias_its_tensors():
    ids = torch.tensor([0, 0, 1, 1, 1, 2, 2, 2])
    lam = lambda b, h, q, kv: (ids[q] == ids[kv]) & (q >= kv)     # noqa: E731
    lam.bh_invariant = True
    snap = M.snapshot(lam)
    q = torch.arange(8)
    before = M.evaluate(lam, q, q).clone()
    ids.copy_(torch.arange(8))
    assert torch.equal(M.evaluate(snap, q, q), before)
    assert not torch.equal(M.evaluate(lam, q, q), before)          # the original does alias
    assert snap is not lam and snap.__name__ == lam.__name__ and snap.bh_invariant


def test_snapshot_rebuilds_mask_trees_defaults_and_nested_functions():
    ids = torch.tensor([0, 0, 1, 1, 1, 2, 2, 2])

    def same_doc(b, h, q, kv):
        return ids[q] == ids[kv]

    def outer(b, h, q, kv):                                         # a cell holding a function
        return same_doc(b, h, q, kv) & (q >= kv)

    def with_default(b, h, q, kv, table=ids.clone()):
        return table[q] == table[kv]

    table = with_default.__defaults__[0]
    tree = (M.sliding_window(3) | M.as_mask(outer, name="outer")) & M.as_mask(with_default, name="dflt")
    snap = M.snapshot(tree)
    q = torch.arange(8)
    before = M.evaluate(tree, q, q).clone()
    ids.copy_(torch.arange(8))
    table.copy_(torch.arange(8))
    assert repr(snap) == repr(tree) == "(sliding_window(3) | outer) & dflt"
    assert [c.name for c in snap.children] == [c.name for c in tree.children]
    assert torch.equal(M.evaluate(snap, q, q), before)
    assert not torch.equal(M.evaluate(tree, q, q), before)
    # nothing to copy: the very same object
    causal = M.causal() & M.sliding_window(4)
    assert M.snapshot(causal) is causal
    plain = lambda b, h, q, kv: q >= kv                            # noqa: E731
    assert M.snapshot(plain) is plain


def test_snapshot_keeps_learnable_tensors_live_and_bound_methods_as_is():
    bias = torch.zeros(8, dtype=torch.float64, requires_grad=True)
    scale = torch.tensor(2.0, dtype=torch.float64)

    def score_mod(score, b, h, q, kv):
        return score * scale + bias[q - kv]

    snap = M.snapshot(score_mod)
    assert snap is not score_mod
    assert any(c.cell_contents is bias for c in snap.__closure__)   # the live parameter
    assert not any(c.cell_contents is scale for c in snap.__closure__)  # a copy of the constant
    s = torch.randn(1, 1, 4, 4, dtype=torch.float64)
    idx = torch.arange(4)
    assert torch.equal(snap(s, 0, 0, idx[:, None], idx[None, :]),
                       score_mod(s, 0, 0, idx[:, None], idx[None, :]))

    class Holder:
        def __init__(self):
            self.ids = torch.arange(4)

        def mod(self, b, h, q, kv):
            return self.ids[q] == self.ids[kv]

    bound = Holder().mod
    assert M.snapshot(bound) is bound                               # documented limit


def test_plan_is_not_changed_by_refilling_the_callers_doc_ids():
    S, P, bs = 32, 2, 4
    ids = torch.arange(S) // 5
    first = ids.clone()
    p = fringe.plan(schedules.zigzag(), M.causal() & M.document(ids), seq_len=S, world_size=P,
                    block_size=bs)
    lam_ids = ids.clone()
    lam = lambda b, h, q, kv: (lam_ids[q] == lam_ids[kv]) & (q >= kv)   # noqa: E731
    p2 = fringe.plan(schedules.ring(), lam, seq_len=S, world_size=P, block_size=bs)
    ids.copy_(torch.arange(S) // 3)                                    # the next batch, in place
    lam_ids.copy_(torch.arange(S) // 3)
    q, k, v = make_qkv(B=1, H=2, G=1, S=S, D=4, seed=3)
    want, _ = reference.attention(q, k, v, mask_mod=M.causal() & M.document(first))
    for plan in (p, p2):
        out = fringe.simulate.attention(q, k, v, plan=plan)
        torch.testing.assert_close(out, want, **tolerances(torch.float64))


def test_plan_is_not_changed_by_editing_a_numpy_array_list_or_dict_its_mask_reads():
    """A mask closing over a numpy array, or a list / dict of numbers, edited after planning:
    snapshot copied only containers holding tensors, so the plan's tiles read the new values
    in its PARTIAL blocks under the old block classification: equal to neither dense answer,
    no error. Now the plan owns copies."""
    S, P, bs = 32, 2, 4
    arr = np.array([0] * 9 + [1] * (S - 9))
    cut = [9]
    cfg = {"cut": 9}
    cases = [
        (lambda b, h, q, kv: torch.from_numpy(arr)[q] == torch.from_numpy(arr)[kv],
         lambda: arr.__setitem__(slice(None), np.arange(S) // 10)),
        (lambda b, h, q, kv: (q < cut[0]) == (kv < cut[0]), lambda: cut.__setitem__(0, 14)),
        (lambda b, h, q, kv: (q < cfg["cut"]) == (kv < cfg["cut"]),
         lambda: cfg.__setitem__("cut", 14)),
    ]
    q, k, v = make_qkv(B=1, H=2, G=1, S=S, D=4, seed=3)
    for mask, edit in cases:
        plan = fringe.plan(schedules.zigzag(), M.as_mask(mask, bh_invariant=True), seq_len=S,
                           world_size=P, block_size=bs)
        want, _ = reference.attention(q, k, v, mask_mod=mask)
        edit()
        out = fringe.simulate.attention(q, k, v, plan=plan)
        torch.testing.assert_close(out, want, **tolerances(torch.float64))


_GLOBAL_IDS = torch.tensor([0] * 9 + [1] * 23)       # a module-level batch buffer


def _global_doc_mask(b, h, q_idx, kv_idx):                  # the attention-gym idiom
    return _GLOBAL_IDS[q_idx] == _GLOBAL_IDS[kv_idx]


def test_plan_is_not_changed_by_refilling_or_rebinding_a_global_its_mask_reads():
    """A mask_mod reading a module-level tensor by name: snapshot left globals as they were,
    so refilling it in place (or rebinding the name) for the next batch ran the new ids in
    the plan's PARTIAL blocks under the old block classification: off by ~1 from both dense
    answers, no error. Now the plan's copy reads its own snapshot of the globals it names."""
    global _GLOBAL_IDS
    S, P, bs = 32, 2, 4
    q, k, v = make_qkv(B=1, H=2, G=1, S=S, D=4, seed=3)
    for edit in ("refill", "rebind"):
        _GLOBAL_IDS = torch.tensor([0] * 9 + [1] * (S - 9))
        plan = fringe.plan(schedules.zigzag(), _global_doc_mask, seq_len=S, world_size=P,
                           block_size=bs)
        want, _ = reference.attention(q, k, v, mask_mod=_global_doc_mask)
        new = torch.tensor([0] * 10 + [1] * 6 + [2] * (S - 16))
        if edit == "refill":
            _GLOBAL_IDS.copy_(new)
        else:
            _GLOBAL_IDS = new
        out = fringe.simulate.attention(q, k, v, plan=plan)
        torch.testing.assert_close(out, want, **tolerances(torch.float64))


# ----------------------------------------------------------------------------- digests


def plan_digest(mask, S=32, bs=4, order=None):
    order = torch.arange(S) if order is None else order
    blocks = M.classify(mask, order, order, block_size=bs)
    return blocks, M.digest(mask, order=order, blocks=blocks, block_size=bs)


def test_digest_sees_one_doc_id_moved_by_one_token_with_the_same_blocks():
    a = torch.tensor([0] * 9 + [1] * 23)
    b = torch.tensor([0] * 10 + [1] * 22)                            # boundary inside block 2
    ba, da = plan_digest(M.causal() & M.document(a))
    bb, db = plan_digest(M.causal() & M.document(b))
    assert torch.equal(ba, bb) and da != db
    # the same for a plain callable, digested by value over the PARTIAL blocks
    fa = lambda b_, h, q, kv: (a[q] == a[kv]) & (q >= kv)           # noqa: E731
    fb = lambda b_, h, q, kv: (b[q] == b[kv]) & (q >= kv)           # noqa: E731
    pa, ea = plan_digest(fa)
    pb, eb = plan_digest(fb)
    assert torch.equal(pa, pb) and ea != eb
    # and for a plain leaf inside a Mask tree
    ta, tb = M.sliding_window(20) & M.as_mask(fa, name="f"), M.sliding_window(20) & M.as_mask(fb, name="f")
    (qa, ga), (qb, gb) = plan_digest(ta), plan_digest(tb)
    assert torch.equal(qa, qb) and ga != gb


def test_digest_equal_for_equal_masks_built_separately():
    ids = torch.arange(32) // 6
    _, d1 = plan_digest(M.causal() & M.document(ids))
    _, d2 = plan_digest(M.causal() & M.document(ids.clone().to(torch.int32)))
    assert d1 == d2 and len(d1) == 40 and int(d1, 16) >= 0
    order = torch.randperm(32, generator=torch.Generator().manual_seed(0))
    lam1 = lambda b, h, q, kv: q >= kv                              # noqa: E731

    def lam2(b, h, q_idx, kv_idx):                                  # other code, same mask
        return ~(q_idx < kv_idx)

    assert plan_digest(lam1, order=order)[1] == plan_digest(lam2, order=order)[1]


def test_digest_differs_for_window_and_prefix_sizes():
    d = {w: plan_digest(M.sliding_window(w))[1] for w in (3, 4)}
    assert d[3] != d[4]
    assert plan_digest(M.sliding_window(3))[1] == d[3]
    assert plan_digest(M.prefix_lm(5))[1] != plan_digest(M.prefix_lm(6))[1]
    both, either = M.causal() & M.sliding_window(3), M.causal() | M.sliding_window(3)
    assert plan_digest(both)[1] != plan_digest(either)[1]


def test_digest_validates_its_inputs():
    with pytest.raises(ValueError, match=r"expected order \[S\] and blocks"):
        M.digest(M.causal(), order=torch.arange(8), blocks=torch.zeros(3, 3, dtype=torch.int8),
                 block_size=2)


def make_score(c, table):
    def score_mod(score, b, h, q, kv):
        return score + c * table[(q - kv).abs() % table.numel()]
    return score_mod


def test_fn_digest_follows_code_constants_and_captured_tensors():
    t = torch.arange(4.0)
    d = M.fn_digest(make_score(2, t))
    assert d == M.fn_digest(make_score(2, t.clone()))               # same source, same values
    assert d != M.fn_digest(make_score(3, t))                       # another captured constant
    assert d != M.fn_digest(make_score(2, t + 1))                   # another captured tensor
    assert d != M.fn_digest(make_score(2, t[:3]))
    assert M.fn_digest(lambda s, b, h, q, kv: s * 2) != M.fn_digest(lambda s, b, h, q, kv: s * 3)
    # learnable tensors: dtype and shape only (their values change and DDP syncs them)
    p1 = torch.zeros(4, requires_grad=True)
    p2 = torch.ones(4, requires_grad=True)
    assert M.fn_digest(make_score(2, p1)) == M.fn_digest(make_score(2, p2))
    p3 = torch.zeros(5, requires_grad=True)
    assert M.fn_digest(make_score(2, p1)) != M.fn_digest(make_score(2, p3))
    # partials, nested functions and Masks are looked into
    assert M.fn_digest(functools.partial(make_score(2, t), b=0)) != \
        M.fn_digest(functools.partial(make_score(2, t), b=1))
    ids = torch.arange(8) // 3
    assert M.fn_digest(M.document(ids)) == M.fn_digest(M.document(ids.clone()))
    assert M.fn_digest(M.document(ids)) != M.fn_digest(M.document(ids // 2))

    class Opaque:
        def __call__(self, score, b, h, q, kv):
            return score

    assert M.fn_digest(Opaque()) == M.fn_digest(Opaque())           # by type, marked opaque


_GLOBAL_SLOPES = torch.tensor([0.5, 0.25])


def _global_alibi(score, b, h, q, kv):                     # a module-level table, by name
    return score - _GLOBAL_SLOPES[h] * (q - kv).abs()


def test_fn_digest_follows_the_globals_a_score_mod_reads():
    """A score_mod reading a module-level tensor by name: fn_digest hashed only the name, so
    ranks whose tables differ (a global drawn without a seed, or refilled on one rank) agreed
    and each ran its own score_mod on its own rows, no error. Now data globals are hashed."""
    global _GLOBAL_SLOPES
    d = M.fn_digest(_global_alibi)
    _GLOBAL_SLOPES = _GLOBAL_SLOPES.clone()
    assert M.fn_digest(_global_alibi) == d                          # equal values, equal digest
    _GLOBAL_SLOPES[1] = 0.125
    assert M.fn_digest(_global_alibi) != d
    _GLOBAL_SLOPES = torch.tensor([0.5, 0.25])


_CROSS_PROCESS = r"""
import torch
from fringe import masks as M
ids = torch.arange(32) // 5
def score(s, b, h, q, kv):
    return s if str(q.dtype) in {"torch.int64", "torch.int32", "x"} else s * 2
order = torch.arange(32)
lam = lambda b, h, q, kv: (ids[q] == ids[kv]) & (q >= kv)
blocks = M.classify(lam, order, order, block_size=4)
class Cap:                  # an object's state: a set and a dict of strings, in hash order
    def __init__(self):
        self.cap, self.tags, self.table = 30.0, {"a", "b", "c"}, {"x": ids, "y": (1, "z")}
    def score(self, s, b, h, q, kv):
        return self.cap * torch.tanh(s / self.cap)
print(M.fn_digest(Cap().score), M.fn_digest(score), M.fn_digest(M.causal() & M.document(ids)),
      M.digest(lam, order=order, blocks=blocks, block_size=4),
      M.digest(M.causal() & M.document(ids), order=order, blocks=blocks, block_size=4))
"""


def test_digests_are_equal_across_processes():
    # this process hashes strings with a random seed, the child with none (PYTHONHASHSEED=0)
    env = dict(os.environ, PYTHONHASHSEED="0")
    r = subprocess.run([sys.executable, "-c", _CROSS_PROCESS], env=env, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    here = io.StringIO()
    with contextlib.redirect_stdout(here):
        exec(compile(_CROSS_PROCESS, "<digests>", "exec"), {"__name__": "__main__"})
    assert r.stdout.split() == here.getvalue().split() and len(here.getvalue().split()) == 5
