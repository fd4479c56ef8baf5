"""A probe proves nothing about values it did not try (issue 17, item 1).

fringe evaluates a mask_mod that is not elementwise on broadcast index tensors (``.any()``,
``.all()``, a read of ``q_idx.numel()``) per scalar index, as FlexAttention does; whether such a
mask reads ``b`` or ``h`` cannot be proven by evaluating it for a few values. So it is
classified for every ``b < batch_size`` and ``h < num_heads`` the plan is given (and the plan
accepts only those), or declared ``masks.as_mask(fn, bh_invariant=True)``, or refused.
Every check here is float64-exact against dense attention on FlexAttention's definition of
the mask (evaluated per scalar index, for every b and h).
"""
from __future__ import annotations

import warnings

import pytest
import torch
from torch.testing import assert_close

import fringe
from fringe import masks, packing, schedules, simulate
from fringe.launch import Workers
from fringe.ops import reference
from fringe.testing import check_mask, make_qkv, tolerances

TOL = tolerances(torch.float64)
S, BS = 32, 4


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")    # the "evaluated per scalar index" notices
        yield


def heads4(b, h, q_idx, kv_idx):
    """Causal window of 4 on heads 0-3, all of causal on heads 4-7; ``.any()`` makes fringe
    evaluate it per scalar index (a probe of h < 3 sees one head's mask)."""
    return ((kv_idx <= q_idx) & ((q_idx - kv_idx < 4) | (h >= 4))).any()


def rows2(b, h, q_idx, kv_idx):
    """The same, reading b: rows 0-1 windowed, row 2 all of causal."""
    return ((kv_idx <= q_idx) & ((q_idx - kv_idx < 4) | (b >= 2))).any()


def numel_window(b, h, q_idx, kv_idx):
    """Per scalar index (FlexAttention) a causal window of 2; called on broadcast index tensors
    of more than 16 positions a window of 3. Broadcast and per-scalar agree on small probes."""
    return (kv_idx <= q_idx) & (q_idx - kv_idx < 2 + int(q_idx.numel() > 16))


def _exact(mask_mod, plan, B: int, H: int, seed: int = 0):
    """Run ``plan`` on the virtual mesh and compare out, lse, dq, dk, dv with dense attention
    over FlexAttention's mask (per scalar index, every b < B and h < H)."""
    q, k, v = make_qkv(B=B, H=H, G=1, S=S, D=4, seed=seed, requires_grad=True)
    pos = torch.arange(S)
    truth = masks.evaluate(mask_mod, pos, pos, B=B, H=H, method="vmap")
    assert not torch.equal(truth, truth[:1, :1].expand_as(truth))      # it does read b or h
    ref, ref_lse = reference.attention(
        q, k, v, mask_mod=lambda b, h, qi, ki: truth[b, h, qi, ki])
    out, lse = simulate.attention(q, k, v, plan=plan, return_lse=True)
    assert_close(out, ref, **TOL)
    assert_close(lse, ref_lse, **TOL)
    dout = torch.randn(ref.shape, generator=torch.Generator().manual_seed(seed + 1),
                       dtype=torch.float64)
    for got, want in zip(torch.autograd.grad(out, (q, k, v), dout),
                         torch.autograd.grad(ref, (q, k, v), dout)):
        assert_close(got, want, **TOL)


def _refused(mask_mod):
    """Planned without num_heads / batch_size: refused, naming both remedies."""
    with pytest.raises(ValueError, match=r"(?s)per scalar index.*num_heads=.*batch_size=.*"
                                         r"as_mask\(fn, bh_invariant=True\)"):
        fringe.plan(schedules.zigzag(), mask_mod, seq_len=S, world_size=2, block_size=BS)


# ------------------------------------------------------------------- the reported cases


@pytest.mark.parametrize("name", ["zigzag", "ulysses"])      # ulysses: each rank a head slice
def test_a_mask_reading_h_only_for_heads_4_and_up(name):
    _refused(heads4)
    p = fringe.plan(schedules.get(name), heads4, seq_len=S, world_size=2, block_size=BS,
                    num_heads=8)
    _exact(heads4, p, B=1, H=8)
    assert (p.batch_size, p.num_heads) == (1, 8)     # classified for these, and only these


def test_a_mask_reading_b_only_for_row_2():
    _refused(rows2)
    p = fringe.plan(schedules.ring(), rows2, seq_len=S, world_size=2, block_size=BS,
                    batch_size=3)
    _exact(rows2, p, B=3, H=1)
    assert (p.batch_size, p.num_heads) == (3, 1)


def test_a_call_with_rows_the_plan_was_not_classified_for_raises():
    # num_heads alone: the plan is classified (and valid) for B = 1 only
    p = fringe.plan(schedules.zigzag(), rows2, seq_len=S, world_size=2, block_size=BS,
                    num_heads=2)
    q, k, v = make_qkv(B=3, H=2, G=1, S=S, D=4, seed=0)
    with pytest.raises(ValueError, match=r"classified for batch_size=1 only.*q has 3.*"
                                         r"re-plan with fringe\.plan\(\.\.\., batch_size=3\)"):
        simulate.attention(q, k, v, plan=p)
    q, k, v = make_qkv(B=1, H=4, G=1, S=S, D=4, seed=0)
    with pytest.raises(ValueError, match=r"classified for num_heads=2 only.*q has 4"):
        simulate.attention(q, k, v, plan=p)


def worker_other_rows(rank: int, world_size: int):
    p = fringe.plan(schedules.zigzag(), rows2, seq_len=S, world_size=world_size,
                    block_size=BS, num_heads=2)
    q, k, v = (p.layout.shard(t, rank) for t in make_qkv(B=3, H=2, G=1, S=S, D=4, seed=0))
    if rank == 0:                                 # rank 0 runs the planned B = 1
        q, k, v = q[:1], k[:1], v[:1]
    try:
        fringe.attention(q, k, v, plan=p, timeout_s=60)
    except ValueError as e:
        return str(e)
    return "no error"


def test_every_rank_refuses_rows_the_plan_was_not_classified_for():
    with Workers(2, timeout_s=120, threads=1) as w:
        msgs = w.run(worker_other_rows)
    for msg in msgs:                              # rank 0's input was fine: it names rank 1
        assert msg.startswith("rank 1 of 2 got invalid input"), msg
        assert "before any attention data moved" in msg and "batch_size=1 only" in msg, msg


def test_a_mask_reading_its_index_tensors_shape_is_evaluated_per_scalar():
    pos = torch.arange(S)
    flex = masks.evaluate(numel_window, pos, pos, method="vmap")
    assert not torch.equal(masks.evaluate(numel_window, pos, pos, method="broadcast"), flex)
    assert torch.equal(masks.evaluate(numel_window, pos, pos), flex)
    _refused(numel_window)                 # per scalar: b / h not proven (nothing declared)
    declared = masks.as_mask(numel_window, bh_invariant=True)
    p = fringe.plan(schedules.zigzag(), declared, seq_len=S, world_size=2, block_size=BS)
    assert (p.batch_size, p.num_heads) == (None, None)      # declared: any B and H
    q, k, v = make_qkv(B=2, H=3, G=1, S=S, D=4, seed=3, requires_grad=True)
    ref, ref_lse = reference.attention(q, k, v, mask_mod=lambda b, h, qi, ki: flex[0, 0, qi, ki])
    out, lse = simulate.attention(q, k, v, plan=p, return_lse=True)
    assert_close(out, ref, **TOL)
    assert_close(lse, ref_lse, **TOL)


def test_check_mask_runs_eight_heads_and_three_rows_unless_told():
    kw = dict(world_sizes=(2,), block_sizes=(2,), schedules={"zigzag": schedules.zigzag()})
    with pytest.raises(ValueError, match=r"num_heads=.*batch_size=.*bh_invariant=True"):
        check_mask(heads4, **kw)                   # as fringe.plan: neither given, refused
    # a false declaration is caught on the heads / rows a probe never tries
    for lie in (heads4, rows2):
        with pytest.raises(AssertionError, match=r"schedule=zigzag P=2 .*(classified|differs)"):
            check_mask(masks.as_mask(lie, bh_invariant=True), **kw)
    assert check_mask(heads4, num_heads=8, **kw) == 1         # B: the plan's 1
    assert check_mask(rows2, batch_size=3, **kw) == 1


# ------------------------------------------------- unreported cases of the same class


def test_pad_mask_does_not_turn_a_probe_into_a_declaration():
    # pad_mask wrapped a plain callable with bh_invariant=<the probe saw no b / h>: a
    # declaration, trusted by classify and by the tile kernels (evaluated for h = 0 only)
    padded = packing.pad_mask(heads4, real_len=S - 6, padded_len=S)
    _refused(padded)
    p = fringe.plan(schedules.zigzag(), padded, seq_len=S, world_size=2, block_size=BS,
                    num_heads=8)
    _exact(padded, p, B=1, H=8, seed=5)


def test_classifying_every_head_past_the_budget_raises(monkeypatch):
    monkeypatch.setattr(masks, "BH_BUDGET_PAIRS", 6 * S * S)      # 6 (b, h) values' worth
    with pytest.raises(ValueError, match=r"(?s)heads4 is not proven to ignore b and h.*b < 1 "
                                         r"and h < 8.*BH_BUDGET_PAIRS.*bh_invariant=True"):
        fringe.plan(schedules.zigzag(), heads4, seq_len=S, world_size=2, block_size=BS,
                    num_heads=8)
    # inside a tree of structured rules only the pairs the rules leave open are counted
    tree = masks.causal() & masks.as_mask(heads4)
    p = fringe.plan(schedules.zigzag(), tree, seq_len=S, world_size=2, block_size=BS,
                    num_heads=8)
    _exact(tree, p, B=1, H=8, seed=7)
