"""The runtime copies nothing it does not have to (issue 9), so each place where a result could
now share memory with something else is tried here: the inputs (q, k, v, out, lse, dout) are
never written, results of one call are not buffers of the next, in-place edits after a call
fail loudly or change nothing else, and a finished run's states hold no tensors.
"""
from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

import fringe
from fringe import masks, schedules
from fringe.ops import reference
from fringe.runtime.interpreter import RankState
from fringe.runtime.virtual import VirtualRuntime
from fringe.schedules.ir import Buffer, Family
from fringe.testing import make_qkv, tolerances

TOL = tolerances(torch.float64)
S, BLOCK = 32, 4

# (schedule, P): whole-buffer rings at P=1 (one tile: the kernel's results are returned as
# they are) and P=2, q-moving all-gather, head-sliced Ulysses, and the 2D compose.
CASES = [("zigzag", 1), ("ring", 2), ("allgather", 2), ("ulysses", 2), ("compose", 4)]


def _plan(name: str, P: int, **kw):
    sched = (schedules.compose(schedules.ring(), schedules.ulysses(), inner_size=2)
             if name == "compose" else schedules.get(name))
    return fringe.plan(sched, masks.causal(), seq_len=S, world_size=P, block_size=BLOCK, **kw)


def _leaves(seed: int = 3, G: int = 2):
    return [t.requires_grad_() for t in make_qkv(B=1, H=4, G=G, S=S, D=8, seed=seed)]


@pytest.mark.parametrize("name,P", CASES)
def test_inputs_saved_tensors_and_cotangents_are_never_written(name, P):
    """k and v are used where they are (no stacked copy) and the saved out/lse and dout are
    read in place: none of them may change."""
    plan = _plan(name, P)
    q, k, v = _leaves()
    before = [t.detach().clone() for t in (q, k, v)]
    out, lse = fringe.simulate.attention(q, k, v, plan=plan, return_lse=True)
    saved = [out.detach().clone(), lse.detach().clone()]
    g = torch.Generator().manual_seed(5)
    dout = torch.randn(out.shape, generator=g, dtype=out.dtype)
    dlse = torch.randn(lse.shape, generator=g, dtype=lse.dtype)
    cot = [dout.clone(), dlse.clone()]
    torch.autograd.backward((out, lse), (dout, dlse))
    for a, b in zip((q, k, v), before):
        assert torch.equal(a.detach(), b)
    assert torch.equal(out.detach(), saved[0]) and torch.equal(lse.detach(), saved[1])
    assert torch.equal(dout, cot[0]) and torch.equal(dlse, cot[1])
    ref_out, ref_lse = reference.attention(*before, mask_mod=masks.causal())
    assert_close(out.detach(), ref_out, **TOL)
    assert_close(lse.detach(), ref_lse, **TOL)


@pytest.mark.parametrize("name,P", CASES)
def test_results_of_one_call_are_not_buffers_of_the_next(name, P):
    """Outputs and gradients are fresh per call: a second call (same runtime pools would be
    the risk) leaves the first call's results as they were, and editing them in place
    changes nothing of the second."""
    plan = _plan(name, P)
    q, k, v = _leaves()
    out1 = fringe.simulate.attention(q, k, v, plan=plan)
    out1.sum().backward()
    g1 = [t.grad.clone() for t in (q, k, v)]
    keep1 = [out1.detach().clone()] + [t.grad for t in (q, k, v)]
    snap1 = [t.clone() for t in keep1]
    for t in (q, k, v):
        t.grad = None
    out2 = fringe.simulate.attention(q, k, v, plan=plan)
    (2 * out2).sum().backward()
    for a, b in zip(keep1, snap1):
        assert torch.equal(a, b)
    for t, g in zip((q, k, v), g1):
        assert_close(t.grad, 2 * g, rtol=0, atol=0)
    snap2 = [out2.detach().clone()] + [t.grad.clone() for t in (q, k, v)]
    with torch.no_grad():
        for t in keep1:
            t.add_(1.0)
    assert all(torch.equal(a, b) for a, b in
               zip([out2.detach()] + [t.grad for t in (q, k, v)], snap2))
    ptrs = {t.untyped_storage().data_ptr() for t in
            [out1, out2] + [t.grad for t in (q, k, v)] + keep1[1:]}
    assert len(ptrs) == 8


def test_editing_out_or_k_in_place_before_backward_is_never_silently_used():
    """out is the kernel's own tensor at P=1 and k is read where it is. Editing k or out after
    the call either fails in autograd (a saved tensor changed, or an in-place edit of a view
    autograd guards) or leaves the gradient of the inputs the call saw (what it saved was a
    copy). Both hold whether or not fringe.simulate copies at an identity layout."""
    plan = _plan("zigzag", 1)
    q, k, v = _leaves()
    seen = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    (reference.attention(*seen, mask_mod=masks.causal())[0].sum()).backward()
    for edit in ("k", "out"):
        q, k, v = _leaves()
        out = fringe.simulate.attention(q, k, v, plan=plan)
        try:                    # refused at the edit (out a view autograd guards) or later
            if edit == "k":
                with torch.no_grad():
                    k.mul_(2.0)
            else:
                out.add_(1.0)
            out.sum().backward()
        except RuntimeError as e:
            assert "inplace" in str(e)
        else:
            for t, s in zip((q, k, v), seen):
                assert_close(t.grad, s.grad, **TOL)


@pytest.mark.parametrize("name,P", CASES)
def test_finished_runs_hold_no_tensors(name, P):
    """The runtime keeps each direction's states (for the step records) after the call: they
    must not keep buffers alive (memory) nor alias the results."""
    plan = _plan(name, P)
    rt = VirtualRuntime(P)
    q, k, v = (torch.stack([plan.layout.shard(t.detach(), r) for r in range(P)])
               for t in _leaves())
    out, lse, kept = rt.forward(plan, q, k, v)
    rt.backward(plan, q, k, v, out, lse, torch.ones_like(out), None, kept)
    for which in ("forward", "backward"):
        for st in rt.last_states[which].values():
            assert not st.bufs and not st.parts and not st.pool._free
            assert st.records


def test_grad_and_vjp_match_dense_at_one_rank():
    """The P=1 path returns the kernel's (strided) gradients: torch.func sees the dense ones."""
    plan = _plan("zigzag", 1)
    q, k, v = (t.detach() for t in _leaves())

    def f(q, k, v):
        return (fringe.simulate.attention(q, k, v, plan=plan) ** 2).sum()

    def g(q, k, v):
        return (reference.attention(q, k, v, mask_mod=masks.causal())[0] ** 2).sum()
    for a, b in zip(torch.func.grad(f, argnums=(0, 1, 2))(q, k, v),
                    torch.func.grad(g, argnums=(0, 1, 2))(q, k, v)):
        assert_close(a, b, **TOL)


def _state(borrowed: torch.Tensor) -> RankState:
    from fringe.schedules.ir import Program
    L = borrowed.shape[-2]
    st = RankState(0, Program(0, ()), like=lambda b: ((2, 1, 2, L, 3), torch.float64),
                   heads=(2, 2), device="cpu")
    st.set_parts(Buffer.of(Family.DKV, 0), tuple(borrowed.clone()), borrowed=False)
    st.set_parts(Buffer.of(Family.KV, 0), tuple(borrowed), borrowed=True)
    return st


def test_writes_into_borrowed_parts_pack_a_copy_first():
    """A head slice arriving into a borrowed buffer (the caller's k and v) lands in a copy."""
    kv = torch.randn(2, 1, 2, 4, 3, dtype=torch.float64)
    keep = kv.clone()
    st = _state(kv)
    piece = torch.full((2, 1, 1, 4, 3), 7.0, dtype=torch.float64)
    st.arrived("kv0h1/2", piece)
    assert torch.equal(kv, keep)                                 # the caller's tensors
    got = st.get("kv0")
    assert torch.equal(got[:, :, 0], keep[:, :, 0]) and bool((got[:, :, 1] == 7).all())


def test_tensor_accumulate_copies_and_owned_parts_are_taken_over():
    """``accumulate`` keeps the caller's value untouched (tests pass shared probes);
    ``accumulate_parts`` takes its parts over and adds into them."""
    st = _state(torch.zeros(2, 1, 2, 4, 3, dtype=torch.float64))
    x = torch.ones(2, 1, 2, 4, 3, dtype=torch.float64)
    st.accumulate("dkv1", x)
    st.accumulate("dkv1", x)
    assert torch.equal(x, torch.ones_like(x)) and bool((st.get("dkv1") == 2).all())
    a, b = torch.ones(1, 2, 4, 3, dtype=torch.float64), torch.ones(1, 2, 4, 3, dtype=torch.float64)
    st.accumulate_parts("dkv2", (a, b))
    st.accumulate_parts("dkv2", (a.clone(), b.clone()))
    assert st.get_parts("dkv2")[0] is a and bool((a == 2).all())
