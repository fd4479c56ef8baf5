"""Plan stats of a general table (collectives, head slices) are read from its columns
(``fringe._stats._general_counts``) and equal, field by field, the stats of walking every op
(``fringe.testing.oracle.op_counts``, the oracle; programs in any form become a table)."""
from __future__ import annotations

import importlib

import numpy as np
import pytest
import torch

from fringe import masks, schedules
from fringe.testing import packed_docs
from fringe.plan import _op_counts
from fringe.schedules import passes
from fringe.testing import oracle, user_schedules

plan_mod = importlib.import_module("fringe.plan")   # fringe.plan is also the function
stats_mod = importlib.import_module("fringe._stats")

SPECS = ["allgather", "allgather:3", "ulysses", "compose:zigzag+ulysses:2",
         "compose:zigzag+allgather:2:2", "compose:zigzag+ring:2"]
USER = {"two_level_allgather(4)": lambda: user_schedules.two_level_allgather(4),
        "two_level_allgather(4, own=none)":
            lambda: user_schedules.two_level_allgather(4, own="none"),
        "two_level_allgather(4, own=mixed)":
            lambda: user_schedules.two_level_allgather(4, own="mixed"),
        "allgather_then_ring(4)": lambda: user_schedules.allgather_then_ring(4),
        "two_level_allgather_columns(4)": lambda: user_schedules.two_level_allgather_columns(4)}
BLOCK = 16
#: shape variants: the default (heads: the lcm of the splits), MHA, GQA with MLA head dims
#: in float64, a batch
VARIANTS = [dict(), dict(heads=16, kv_heads=16, head_dim=32),
            dict(batch=2, heads=32, kv_heads=2, head_dim=48, v_head_dim=32, dtype=torch.float64)]


def _mask(name: str, S: int, P: int):
    return {"causal": masks.causal(),
            "documents": masks.causal() & masks.document(packed_docs(S, 5, 7)),
            "window": masks.sliding_window(3 * S // P)}[name]


def _schedule(name: str):
    return USER[name]() if name in USER else schedules.get(name)


def _walked(programs, P, *, steps=True, computes=True, n=None):
    """The oracle: every op walked (the backward's steps are not reported: zero)."""
    c = oracle.op_counts(programs, P, computes=computes, n=n)
    return c if steps else plan_mod._OpCounts(c.computes, c.splits, c.keys, c.sent, c.recv,
                                              np.zeros(P, dtype=np.int64))


def _same(a, b):
    """Equal _OpCounts, field by field (computes in any order)."""
    oracle.assert_same_counts(a, b)


@pytest.mark.parametrize("P", [8, 16])
@pytest.mark.parametrize("name", SPECS + sorted(USER))
def test_general_stats_columns_equal_the_op_walk(name, P, monkeypatch):
    S = P * BLOCK * 4
    for mname in ("causal", "documents", "window"):
        for kv in ("resend", "keep"):
            p = plan_mod.plan(_schedule(name), _mask(mname, S, P), seq_len=S, world_size=P,
                              block_size=BLOCK, kv=kv)
            for progs in (p.forward, p.backward):
                assert passes._table(progs) is not None
            n = p.local_len // BLOCK                        # counted in blocks (ranges)
            fwd = _op_counts(p.forward, P, n=n)             # the columns, no op walked
            bwd = _op_counts(p.backward, P, steps=False, computes=False, n=n)
            got = [p.stats(**v) for v in VARIANTS]
            assert all(prog._steps is None for prog in (*p.forward, *p.backward))
            _same(fwd, _walked(p.forward, P, n=n))
            _same(bwd, _walked(p.backward, P, steps=False, computes=False, n=n))
            assert fwd.sent.sum() == fwd.recv.sum() and bwd.sent.sum() == bwd.recv.sum()
            monkeypatch.setattr(stats_mod, "_general_counts",
                                lambda t, P, steps=True, computes=True, n=None:
                                _walked(t.programs(), P, steps=steps, computes=computes, n=n))
            want = [p.stats(**v) for v in VARIANTS]
            monkeypatch.undo()
            assert got == want, (name, mname, kv)
            assert sum(r["fwd_sent"] + r["bwd_sent"] for r in got[0].rows) > 0


def test_collectives_as_op_objects_count_on_their_table():
    """Programs not cut from one table become one: counted on its columns, equal to the
    oracle's op walk."""
    P = 8
    progs = schedules.get("allgather").programs(P)
    rebuilt = [plan_mod.Program(r, prog.steps) for r, prog in enumerate(progs)]
    assert rebuilt[0].table is None
    got = _op_counts(rebuilt, P)
    _same(got, _op_counts(progs, P))
    _same(got, oracle.op_counts(progs, P))
