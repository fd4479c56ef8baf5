"""Issue 17, item 2: never hand out mutable state, and never let a cached check outlive what
it covers.

Accessors of a plan or layout return copies (editing them changes no plan); the tensors a
plan holds as state are guarded by their ``_version`` on every call (an in-place edit raises
before any communication), and the cached digests hash again after such an edit. Also: a
layout does not alias the order it was built from, and ``layout.shard(t, group=mesh)`` takes
the mesh coordinate (sharding by ``dist.get_rank()`` on a permuted DeviceMesh is wrong).
"""
from __future__ import annotations

import collections
import dataclasses
import types

import pytest
import torch
from torch.testing import assert_close

import fringe
import fringe.simulate
from fringe import layout, masks, packing, schedules
from fringe.launch import Workers
from fringe.ops import reference
from fringe.testing import make_qkv, tolerances

TOL = tolerances(torch.float64)
S, P, BLOCK = 64, 4, 4
CU = [0, 10, 29, 40, S]


def _case(schedule="zigzag", score_mod=None):
    doc = packing.doc_ids_from_cu_seqlens(torch.tensor(CU))
    mask = masks.causal() & packing.document_mask(doc)
    plan = fringe.plan(schedules.get(schedule), mask, seq_len=S, world_size=P, block_size=BLOCK,
                       score_mod=score_mod)
    q, k, v = make_qkv(B=1, H=2, G=2, S=S, D=4, seed=17)
    want, _ = reference.attention(q, k, v, mask_mod=mask, score_mod=score_mod)
    return doc, plan, (q, k, v), want


def test_editing_positions_in_place_changes_no_plan_and_results_stay_exact():
    """The issue's case: per-document RoPE positions derived in place from
    ``layout.positions(rank)`` after the first call (its digest cached) must not move the
    plan's tokens. Also the plan's own positions / tile-map accessors."""
    doc, plan, (q, k, v), want = _case()
    assert_close(fringe.simulate.attention(q, k, v, plan=plan), want, **TOL)
    before = dict(plan.digests())
    order = plan.layout.order.clone()
    starts = torch.tensor(CU[:-1])
    for r in range(P):
        pos = plan.layout.positions(r)
        pos -= starts[doc[pos]]                     # RoPE positions within each document
        p2 = plan.positions(r)
        p2.zero_()
        plan.tile_blocks(r, (r + 1) % P).fill_(int(masks.BlockKind.FULL))
    assert torch.equal(plan.layout.order, order)
    assert plan.digests() == before
    assert_close(fringe.simulate.attention(q, k, v, plan=plan), want, **TOL)
    # a shard is the caller's to edit: editing it leaves the plan alone too
    sh = plan.layout.shard(q, 1)
    sh.zero_()
    assert torch.equal(plan.layout.order, order)


def test_in_place_edit_of_plan_state_after_the_first_call_raises():
    """A covered tensor edited after the first call (digest cached): the next call raises
    naming it, and the digest is not the stale cached one."""
    bias = torch.linspace(-1.0, 1.0, S, dtype=torch.float64)

    def bias_mod(score, b, h, q_idx, kv_idx):
        return score + bias[kv_idx]

    edits = {
        "layout order": lambda p: p.layout.order[:2].copy_(p.layout.order[:2].flip(0)),
        "tiles": lambda p: p.tiles.fill_(int(masks.BlockKind.FULL)),
        "block map": lambda p: p.block_map.codes.fill_(int(masks.BlockKind.FULL)),
        "document ids": lambda p: next(packing_doc_ids(p.mask_mod)).copy_(torch.zeros(S)),
        "score_mod tensor": lambda p: p.score_mod.__closure__[0].cell_contents.mul_(2.0),
    }
    for what, edit in edits.items():
        doc, plan, (q, k, v), want = _case(score_mod=bias_mod)
        assert_close(fringe.simulate.attention(q, k, v, plan=plan), want, **TOL)
        before = dict(plan.digests())
        edit(plan)
        with pytest.raises(ValueError, match="edited in place after the plan was built"):
            fringe.simulate.attention(q, k, v, plan=plan)
        if what == "layout order":                  # the layout refuses to hash an edited order
            with pytest.raises(ValueError, match="order tensor was edited in place"):
                plan.digests()
        else:                                       # hashed again, not the stale cached digest
            assert plan.digests() != before, what
    # the layout itself refuses to shard by an edited order
    lay = layout.zigzag(S, P, block_size=BLOCK)
    lay.order[:2] = lay.order[:2].flip(0)
    with pytest.raises(ValueError, match="order tensor was edited in place"):
        lay.shard(torch.zeros(1, 1, S, 2), 0)


def test_in_place_edit_of_plan_state_between_forward_and_backward_raises():
    """The check runs on the backward too: an edit after the forward (the plan's order, tiles
    or documents) would otherwise give gradients of another plan, with no error."""
    edits = {
        "layout order": lambda p: p.layout.order[:2].copy_(p.layout.order[:2].flip(0)),
        "tiles": lambda p: p.tiles.fill_(int(masks.BlockKind.FULL)),
    }
    for what, edit in edits.items():
        doc, plan, (q, k, v), want = _case()
        q = q.detach().requires_grad_()
        out = fringe.simulate.attention(q, k, v, plan=plan)
        edit(plan)
        with pytest.raises(ValueError, match="edited in place after the plan was built"):
            torch.autograd.grad(out.sum(), q)


def test_copies_and_pickles_of_a_plan_guard_their_own_state():
    """A copy of a plan, or an unpickled layout (unpickling bumps a tensor's ``_version``),
    runs exactly and records its own versions; an edit of a copy raises there and leaves the
    original alone."""
    import copy
    import pickle
    doc, plan, (q, k, v), want = _case()
    fringe.simulate.attention(q, k, v, plan=plan)
    for other in (copy.deepcopy(plan), copy.copy(plan)):
        assert other.digests() == plan.digests()
        assert_close(fringe.simulate.attention(q, k, v, plan=other), want, **TOL)
    lay = pickle.loads(pickle.dumps(plan.layout))
    assert torch.equal(lay.shard(q, 1), plan.layout.shard(q, 1))
    twin = copy.deepcopy(plan)
    twin.tiles.fill_(int(masks.BlockKind.FULL))
    with pytest.raises(ValueError, match="plan.tiles was edited in place"):
        fringe.simulate.attention(q, k, v, plan=twin)
    assert_close(fringe.simulate.attention(q, k, v, plan=plan), want, **TOL)


def packing_doc_ids(m):
    """The document-id tensors of a Mask tree."""
    if m.rule is not None and isinstance(getattr(m.rule, "doc_ids", None), torch.Tensor):
        yield m.rule.doc_ids
    for c in m.children:
        yield from packing_doc_ids(c)


def test_a_layout_owns_its_order():
    """Unreported case of the class: ``from_order`` kept the caller's tensor, so refilling
    it (the next batch's order) silently changed a layout, and every plan over it."""
    order = torch.arange(S).view(P, -1).flip(0).reshape(-1).clone()
    lay = layout.from_order(order, P, block_size=BLOCK)
    plan = fringe.plan(schedules.ring(), masks.causal(), seq_len=S, world_size=P,
                       block_size=BLOCK, layout=lay)
    want = lay.positions(0)
    order.copy_(torch.arange(S))                     # the caller reuses its buffer
    assert torch.equal(lay.positions(0), want) and torch.equal(plan.layout.positions(0), want)
    q, k, v = make_qkv(B=1, H=2, G=2, S=S, D=4, seed=3)
    ref, _ = reference.attention(q, k, v, mask_mod=masks.causal())
    assert_close(fringe.simulate.attention(q, k, v, plan=plan), ref, **TOL)


def test_a_document_mask_edited_in_place_before_planning_raises():
    """Unreported case of the class: ``masks.document`` records whether its ids are sorted
    (its block rule reads only a block's end ids then); ids edited in place afterwards were
    classified by that stale flag: off by ~1.4 with no error. Now planning raises."""
    m = masks.document(torch.tensor([0] * (S // 2) + [1] * (S // 2)))
    m.rule.doc_ids.copy_(torch.tensor([0, 1, 1, 0]).repeat(S // 4))     # unsorted now
    with pytest.raises(ValueError, match="doc_ids were edited in place"):
        fringe.plan(schedules.zigzag(), m & masks.causal(), seq_len=S, world_size=P,
                    block_size=BLOCK)


class _Docs:
    """Document ids held by an object whose method (or the object itself) is the mask_mod:
    :func:`fringe.plan` cannot snapshot those, so it must guard them."""

    def __init__(self) -> None:
        self.ids = torch.tensor([0] * (S // 2) + [1] * (S // 2))

    def mask(self, b, h, q_idx, kv_idx):
        return (self.ids[q_idx] == self.ids[kv_idx]) & (q_idx >= kv_idx)

    __call__ = mask


@pytest.mark.parametrize("how", ["bound method", "callable object"])
def test_refilling_ids_a_method_mask_reads_raises(how):
    """A mask_mod that is a bound method (or a callable object) reading ``self.ids``: the plan
    keeps it as is (no snapshot), so refilling the ids in place (next batch's documents) left
    the old block classification under the new mask: off by ~2.5 from both the old and the
    new dense answer, no error. Now the next call raises."""
    docs = _Docs()
    plan = fringe.plan(schedules.zigzag(), docs.mask if how == "bound method" else docs,
                       seq_len=S, world_size=P, block_size=BLOCK)
    q, k, v = make_qkv(B=1, H=2, G=2, S=S, D=4, seed=17)
    want, _ = reference.attention(q, k, v, mask_mod=docs.mask)
    assert_close(fringe.simulate.attention(q, k, v, plan=plan), want, **TOL)
    docs.ids.copy_(torch.tensor([0] * 5 + [1] * (S - 5)))
    with pytest.raises(ValueError, match="mask_mod holds was edited in place"):
        fringe.simulate.attention(q, k, v, plan=plan)


@pytest.mark.parametrize("holder", ["namespace", "dataclass", "namedtuple", "slots"])
def test_refilling_ids_an_object_in_a_closure_holds_raises(holder):
    """A lambda reading ``batch.ids`` of an object it closes over (a SimpleNamespace or a
    dataclass holding the batch): snapshot cannot copy the object and the guard walked only
    callables, so refilling the ids in place left the old block classification under the new
    ids in the PARTIAL blocks: equal to neither dense answer, no error. Now the call raises.
    Defect found (fixed) for a namedtuple or an object with ``__slots__`` (no ``__dict__``):
    the guard walked neither, off by ~1.2 from the old dense answer, no error."""
    ids = torch.tensor([0] * 9 + [1] * (S - 9))          # a boundary inside a block: PARTIAL
    batch = {"namespace": lambda x: types.SimpleNamespace(ids=x), "dataclass": _Batch,
             "namedtuple": _BatchTuple, "slots": _SlotBatch}[holder](ids)
    mask = lambda b, h, q_idx, kv_idx: batch.ids[q_idx] == batch.ids[kv_idx]   # noqa: E731
    plan = fringe.plan(schedules.zigzag(), mask, seq_len=S, world_size=P, block_size=BLOCK)
    q, k, v = make_qkv(B=1, H=2, G=2, S=S, D=4, seed=17)
    batch.ids.copy_(torch.tensor([0] * 10 + [1] * 6 + [2] * (S - 16)))
    with pytest.raises(ValueError, match="mask_mod holds was edited in place"):
        fringe.simulate.attention(q, k, v, plan=plan)


def test_an_object_holding_an_inference_tensor_still_plans():
    """Inference tensors keep no version counter: guarding the objects a closure reads must
    skip them rather than fail every plan with torch's RuntimeError."""
    with torch.inference_mode():
        ids = torch.tensor([0] * 9 + [1] * (S - 9))
    batch = types.SimpleNamespace(ids=ids)
    mask = lambda b, h, q_idx, kv_idx: batch.ids[q_idx] == batch.ids[kv_idx]   # noqa: E731
    plan = fringe.plan(schedules.zigzag(), mask, seq_len=S, world_size=P, block_size=BLOCK)
    q, k, v = make_qkv(B=1, H=2, G=2, S=S, D=4, seed=17)
    want, _ = reference.attention(q, k, v, mask_mod=mask)
    assert_close(fringe.simulate.attention(q, k, v, plan=plan), want, **TOL)


@dataclasses.dataclass
class _Batch:
    ids: torch.Tensor


_BatchTuple = collections.namedtuple("_BatchTuple", "ids")


class _SlotBatch:
    __slots__ = ("ids",)

    def __init__(self, ids: torch.Tensor) -> None:
        self.ids = ids


def test_shard_takes_the_rank_or_the_group_not_both():
    lay = layout.zigzag(S, P, block_size=BLOCK)
    x = torch.arange(S, dtype=torch.float64).view(1, S, 1)
    assert torch.equal(lay.shard(x, 2, dim=1).flatten().long(), lay.positions(2))
    with pytest.raises(ValueError, match="give the plan rank"):
        lay.shard(x, dim=1)
    with pytest.raises(ValueError, match="not both"):
        lay.shard(x, 1, dim=1, group=object())
    with pytest.raises(ValueError, match=r"rank must be in \[0, 4\)"):
        lay.positions(4)


# ---- gloo ranks on a permuted DeviceMesh ------------------------------------------------


def worker_permuted_mesh(rank: int, world_size: int, seed: int):
    """Plan rank 0 is global rank 1. Shard by the mesh (group=mesh), run, then edit this
    rank's positions in place (rank 0 only) and run again."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    mesh = DeviceMesh("cpu", torch.tensor([1, 0]))
    doc = packing.doc_ids_from_cu_seqlens(torch.tensor([0, 10, 29, 32]))
    mask = masks.causal() & packing.document_mask(doc)
    plan = fringe.plan(schedules.zigzag(), mask, seq_len=32, world_size=2, block_size=4)
    q, k, v = make_qkv(B=1, H=2, G=2, S=32, D=4, seed=seed)
    me = plan.layout.rank_in(mesh)
    ql, kl, vl = (plan.layout.shard(t, group=mesh) for t in (q, k, v))
    first = fringe.attention(ql, kl, vl, plan=plan, group=mesh, timeout_s=60)
    if dist.get_rank() == 0:
        pos = plan.layout.positions(group=mesh)
        pos -= torch.tensor([0, 10, 29])[doc[pos]]
    second = fringe.attention(ql, kl, vl, plan=plan, group=mesh, timeout_s=60)
    by_global_rank = plan.layout.shard(q, dist.get_rank())     # the mistake group= prevents
    tokens = torch.arange(32).view(1, 32)
    sh = packing.shard_batch(tokens, tokens, plan=plan, group=mesh, cu_seqlens=[0, 10, 29, 32])
    same = torch.equal(sh.input_ids, plan.layout.shard(tokens, me, dim=1)) and sh.rank == me
    if dist.get_rank() == 0:                  # plan state edited on one rank: every rank raises
        plan.tiles.fill_(int(masks.BlockKind.FULL))
    try:
        fringe.attention(ql, kl, vl, plan=plan, group=mesh, timeout_s=60)
        err = ""
    except ValueError as e:
        err = str(e)
    return me, first, second, torch.equal(by_global_rank, ql), same, err


def test_shard_by_a_permuted_device_mesh_reads_the_mesh_coordinate():
    seed = 23
    with Workers(2, timeout_s=120, threads=1) as w:
        res = w.run(worker_permuted_mesh, seed)
    doc = packing.doc_ids_from_cu_seqlens(torch.tensor([0, 10, 29, 32]))
    mask = masks.causal() & packing.document_mask(doc)
    plan = fringe.plan(schedules.zigzag(), mask, seq_len=32, world_size=2, block_size=4)
    q, k, v = make_qkv(B=1, H=2, G=2, S=32, D=4, seed=seed)
    want, _ = reference.attention(q, k, v, mask_mod=mask)
    assert [res[g][0] for g in (0, 1)] == [1, 0]     # global rank 1 is plan rank 0
    by_plan_rank = {res[g][0]: res[g] for g in (0, 1)}
    for i in (1, 2):                                 # before and after the in-place edit
        got = plan.layout.unshard([by_plan_rank[r][i] for r in (0, 1)])
        assert_close(got, want, **TOL)
    assert not res[0][3] and not res[1][3]           # dist.get_rank() would shard wrongly
    assert res[0][4] and res[1][4]                   # shard_batch(group=mesh) likewise
    for g in (0, 1):                                 # global rank 0 is plan rank 1
        assert "rank 1 of 2 got invalid input" in res[g][5], res[g][5]
        assert "plan.tiles was edited in place" in res[g][5], res[g][5]


def worker_edit_between_forward_and_backward(rank, world_size):
    """Plan state edited on rank 0 only between the forward and the backward."""
    import time
    doc, plan, (q, k, v), _ = _case()
    plan = fringe.plan(schedules.zigzag(), masks.causal() & packing.document_mask(doc),
                       seq_len=S, world_size=world_size, block_size=BLOCK)
    x = [plan.layout.shard(t, rank).clone().requires_grad_() for t in (q, k, v)]
    out = fringe.attention(*x, plan=plan, timeout_s=60)
    if rank == 0:
        plan.tiles.fill_(int(masks.BlockKind.FULL))
    start = time.monotonic()
    try:
        out.sum().backward()
        err = ""
    except Exception as e:      # noqa: BLE001 - the type is part of the answer
        err = f"{type(e).__name__}: {e}"
    return err, time.monotonic() - start


def test_plan_edited_on_one_rank_before_the_backward_raises_on_every_rank():
    """The backward ran no agreement: the rank with the edited plan raised alone and its
    peer waited out its timeout (CommTimeout after 60 s here, 300 s by default). Now the
    backward exchanges the same check as the forward: every rank raises rank 0's reason."""
    with Workers(2, timeout_s=120, threads=1) as w:
        res = w.run(worker_edit_between_forward_and_backward)
    for err, took in res:
        assert err.startswith("ValueError: rank 0 of 2 got invalid input"), err
        assert "plan.tiles was edited in place" in err, err
        assert took < 30, took


def test_a_plan_edited_in_place_cannot_be_copied_or_pickled_clean():
    """A copy or pickle records its tensors' versions afresh: copying a plan whose tiles were
    edited in place would launder the edit (the copy passed check_unchanged and ran the old
    programs on the edited state); it is refused instead."""
    import copy
    import pickle
    import pytest
    import torch
    import fringe
    from fringe import masks, schedules
    p = fringe.plan(schedules.get("ring"), masks.causal(), seq_len=16, world_size=2, block_size=2)
    copy.deepcopy(p).check_unchanged()            # an unedited plan copies fine
    p.tiles[0, 1] = True
    for make in (copy.deepcopy, copy.copy, lambda x: pickle.loads(pickle.dumps(x))):
        with pytest.raises(ValueError, match="edited in place"):
            make(p)
