"""The cost model reads a general ProgramTable (head slices, collectives) as columns, and
predicts exactly what walking the same programs op by op predicts (the oracle,
fringe.testing.oracle.cost_columns); what no valid program holds is refused, never walked."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

import fringe
from fringe import masks, schedules
from fringe.cost import programs as cost_programs, simulate as cost_simulate
from fringe.cost import programs as cost_programs
from fringe.runtime import costmodel
from fringe.schedules import ir
from fringe.testing import oracle

# H=16, G=4: Ulysses over 16 ranks replicates kv heads, over 2 or 4 it splits them
SHAPE = costmodel.Shape(batch=1, heads=16, kv_heads=4, head_dim=8, dtype="bfloat16")
PRESETS = ("h100-ib", "h100-nvlink", "cpu")
SPECS = ("allgather", "ulysses", "compose:zigzag+ulysses:2", "compose:zigzag+ulysses:4",
         "compose:ring+ulysses:2", "compose:allgather+ulysses:2")
S = 512


def _mask(name: str):
    if name == "causal":
        return masks.causal()
    ids = torch.repeat_interleave(torch.arange(5), torch.tensor([150, 20, 200, 80, 62]))
    return masks.causal() & masks.document(ids)


def _general(plan):
    """The plan with programs cut from general tables (what the collective builders make)."""
    return dataclasses.replace(
        plan, forward=ir.ProgramTable.of(plan.forward).programs(),
        backward=ir.ProgramTable.of(plan.backward).programs())


def _untabled(plan):
    """The plan with plain Program values (no table: the cost model makes one up front)."""
    def plain(progs):
        return tuple(ir.Program(p.rank, p.steps) for p in progs)
    return dataclasses.replace(plan, forward=plain(plan.forward), backward=plain(plan.backward))


def _walked(plan, hw, shape, monkeypatch):
    """The prediction from the oracle's op walk instead of the table reader."""
    with monkeypatch.context() as m:
        m.setattr(cost_simulate, "columns", oracle.cost_columns)
        return costmodel.simulate(dataclasses.replace(plan), hw, shape)


def _assert_same(x, y, where: tuple) -> None:
    if isinstance(x, dict):
        assert x.keys() == y.keys(), where
        for k in x:
            _assert_same(x[k], y[k], where + (k,))
    elif isinstance(x, np.ndarray):
        assert x.dtype == y.dtype and np.array_equal(x, y), where
    else:
        assert x == y, where


def assert_same_prediction(a: costmodel.Prediction, b: costmodel.Prediction) -> None:
    """Every field bit for bit (totals and timelines included), and what reports derive."""
    for f in dataclasses.fields(a):
        _assert_same(getattr(a, f.name), getattr(b, f.name), (f.name,))
    assert (a.step_s, a.forward_s, a.backward_s, a.balance, a.exposed(), a.bytes_per_rank()) == \
        (b.step_s, b.forward_s, b.backward_s, b.balance, b.exposed(), b.bytes_per_rank())
    for which in ("forward", "backward"):
        assert a.records(which) == b.records(which)
        assert a.exposed(which) == b.exposed(which)


@pytest.mark.parametrize("mask", ["causal", "document"])
@pytest.mark.parametrize("spec", SPECS)
def test_general_tables_predict_what_the_op_walk_predicts(spec, mask, monkeypatch):
    checked = 0
    for P, kv in ((4, "resend"), (4, "keep"), (8, "resend"), (16, "keep")):
        if spec == "compose:allgather+ulysses:2" and P == 16:
            continue                                 # (its planning is the slow part)
        p = fringe.plan(schedules.get(spec), _mask(mask), seq_len=S, world_size=P,
                        block_size=8, kv=kv)
        gen, walked = _general(p), _untabled(p)
        assert all(x.table is not None for x in gen.forward + gen.backward)
        assert all(x.table is None for x in walked.forward + walked.backward)
        for hw in PRESETS:
            want = _walked(walked, hw, SHAPE, monkeypatch)
            assert_same_prediction(costmodel.simulate(gen, hw, SHAPE), want)
            assert_same_prediction(costmodel.simulate(walked, hw, SHAPE), want)
            with monkeypatch.context() as m:     # the transfers' bytes three at a time
                m.setattr(cost_programs, "_BYTES_PIECE", 3)
                assert_same_prediction(
                    costmodel.simulate(dataclasses.replace(gen), hw, SHAPE), want)
            checked += 1
        if "ulysses" in spec or spec == "allgather":  # they do communicate
            assert want.bytes_per_rank() > 0
    assert checked >= 9


def test_head_slices_numbered_by_sorting_give_the_same_prediction(monkeypatch):
    # past programs._SLICE_LOOKUP possible slice keys the reader sorts them instead of
    # marking a dense table: the same ids, the same prediction
    p = _general(fringe.plan(schedules.get("compose:zigzag+ulysses:4"), _mask("document"),
                             seq_len=S, world_size=8, block_size=8, kv="keep"))
    want = _walked(p, "h100-ib", SHAPE, monkeypatch)
    monkeypatch.setattr(cost_programs, "_SLICE_LOOKUP", 0)
    assert_same_prediction(costmodel.simulate(p, "h100-ib", SHAPE), want)


def test_plans_whose_builders_make_general_tables_are_read_as_columns(monkeypatch):
    # whatever form the builders give (general tables, or programs cut from them here), the
    # prediction is the walk's
    p = fringe.plan(schedules.get("compose:zigzag+ulysses:2"), masks.causal(), seq_len=S,
                    world_size=8, block_size=8)
    want = _walked(p, "h100-ib", SHAPE, monkeypatch)
    src = p.forward[0].table
    if src is None:
        p = _general(p)
    assert_same_prediction(costmodel.simulate(p, "h100-ib", SHAPE), want)


def _parts_of(plan):
    t = ir.ProgramTable.of(plan.forward)
    comp, xfer, coll = (dict(d) for d in t._parts)
    return t.world_size, comp, xfer, coll


def test_a_table_the_reader_cannot_read_is_refused_saying_what():
    # no fallback: a column the reader does not know, or a value no valid program holds,
    # raises naming it (the op walk is the tests' oracle, not a path of the cost model)
    p = fringe.plan(schedules.get("compose:zigzag+ulysses:2"), masks.causal(), seq_len=S,
                    world_size=4, block_size=8)
    P, comp, xfer, coll = _parts_of(p)
    L = p.local_len
    t = ir.ProgramTable._of_parts(P, comp, xfer, coll)
    assert len(cost_programs._general_columns(t, P, L, SHAPE).comp[0]) > 0
    extra = ir.ProgramTable._of_parts(P, {**comp, "dtype": comp["q"]}, xfer, coll)
    with pytest.raises(NotImplementedError, match="does not know the table's parts"):
        cost_programs._general_columns(extra, P, L, SHAPE)
    odd_kind = ir.ProgramTable._of_parts(P, comp, xfer, {**coll, "kind": coll["kind"] * 0 + 7})
    with pytest.raises(ValueError, match=r"a collective kind code 7 \(row 0\), outside \[0, 3\)"):
        cost_programs._general_columns(odd_kind, P, L, SHAPE)
    far = ir.ProgramTable._of_parts(P, {**comp, "kv": comp["kv"] * 0 + P}, xfer, coll)
    with pytest.raises(ValueError, match=f"a compute kv chunk {P} .*outside \\[0, {P}\\)"):
        cost_programs._general_columns(far, P, L, SHAPE)
    sliced = ir.ProgramTable._of_parts(P, {**comp, "hi": comp["hn"] * 0 + 5,
                                           "hn": comp["hn"] * 0 + 2}, xfer, coll)
    with pytest.raises(ValueError, match="head slice h5/2"):
        cost_programs._general_columns(sliced, P, L, SHAPE)


def test_a_side_outside_its_group_gets_the_walks_error():
    # a general table whose collective side names a rank outside its group: the reader does
    # not guess, it raises what the op walk raises
    p = fringe.plan(schedules.ulysses(), masks.causal(), seq_len=S, world_size=4, block_size=8)
    P, comp, xfer, coll = _parts_of(p)
    assert len(coll["groups"]) >= 1 and len(coll["rank"]) > 0
    coll["groups"] = tuple(g[:-1] if len(g) > 1 else g for g in coll["groups"])
    keep = np.isin(coll["slot_idx"], [len(g) for g in coll["groups"]], invert=True)
    for k in ("slot_side", "slot_dir", "slot_idx", "slot_fam", "slot_chunk", "slot_hi",
              "slot_hn"):
        coll[k] = coll[k][keep]
    progs = ir.ProgramTable._of_parts(P, comp, xfer, coll).programs()
    bad = dataclasses.replace(p, forward=progs)
    with pytest.raises(ValueError, match="does not list rank"):
        costmodel.simulate(bad, "h100-ib", SHAPE)
    with pytest.raises(ValueError, match="does not list rank"):
        oracle.cost_columns(progs, p.local_len, SHAPE)


def test_head_splits_the_shape_cannot_take_are_refused_on_both_paths():
    p = fringe.plan(schedules.ulysses(), masks.causal(), seq_len=S, world_size=4, block_size=8)
    narrow = costmodel.Shape(heads=2, kv_heads=1, head_dim=8)
    for plan in (_general(p), _untabled(p)):
        with pytest.raises(ValueError, match="4"):
            costmodel.simulate(plan, "h100-ib", narrow)
