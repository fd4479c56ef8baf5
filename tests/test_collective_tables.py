"""The collective schedules' builders give programs cut from one general ProgramTable.

allgather, ulysses, compose(outer, ulysses()) and the double rings compose(outer, inner
sequence schedule) build their forward programs as the columns of a general
:class:`~fringe.schedules.ir.ProgramTable` (head slices, collectives, a receive placed
apart from its send), with numpy. Here: the programs come from such a table, converting them
back to the general form gives the same programs, they pass the structural checks on
random tile maps, and a few plans not drawn elsewhere match the dense float64 reference
on the virtual mesh.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.testing import assert_close

import fringe
from fringe import schedules
from fringe.ops import reference
from fringe.schedules import check
from fringe.schedules.ir import ProgramTable
from fringe.testing import make_qkv, mask_family, tolerances

BLOCK = 2

#: (name, schedule, world size, number of heads it needs to divide)
BUILDERS = [
    ("allgather", schedules.allgather(), 8, 1),
    ("allgather(3)", schedules.allgather(pieces=3), 7, 1),
    ("ulysses", schedules.ulysses(), 4, 4),
    ("compose(zigzag, ulysses, 2)", schedules.compose(schedules.zigzag(), schedules.ulysses(),
                                                      inner_size=2), 8, 2),
    ("compose(striped, ulysses, 4)", schedules.compose(schedules.striped(), schedules.ulysses(),
                                                       inner_size=4), 8, 4),
    ("compose(allgather, ulysses, 2)", schedules.compose(schedules.allgather(),
                                                         schedules.ulysses(), inner_size=2), 8, 2),
    ("compose(zigzag, zigzag, 2)", schedules.compose(schedules.zigzag(), schedules.zigzag(),
                                                     inner_size=2), 8, 1),
    ("compose(allgather, ring, 2)", schedules.compose(schedules.allgather(), schedules.ring(),
                                                      inner_size=2), 6, 1),
    ("compose(balanced, allgather, 4)", schedules.compose(schedules.balanced(),
                                                          schedules.allgather(), inner_size=4),
     8, 1),
]


def _needs(P: int) -> list[np.ndarray | None]:
    """No tile map, causal, block-diagonal, and random maps of three densities."""
    rng = np.random.default_rng(7)
    return [None, np.tril(np.ones((P, P), dtype=bool)), np.eye(P, dtype=bool)] + [
        rng.random((P, P)) < d for d in (0.15, 0.5, 0.9)]


@pytest.mark.parametrize("name,sched,P,_", BUILDERS, ids=[b[0] for b in BUILDERS])
def test_built_programs_are_cut_from_one_general_table_and_round_trip(name, sched, P, _):
    for need in _needs(P):
        progs = sched.build(P, need)
        tab = progs[0].table
        assert tab is not None, name
        assert all(p.table is tab and p.rank == r for r, p in enumerate(progs))
        assert list(ProgramTable.of(progs).programs()) == progs
        check(progs)        # sends meet their receives, members issue the same collectives


CASES = [   # (schedule, P, heads, mask): grids and masks test_collectives, test_compose do not draw
    ("allgather(3)", 6, 2, "window"),
    ("compose(striped, ulysses, 4)", 8, 4, "document"),
    ("compose(allgather, ulysses, 2)", 8, 2, "causal"),
    ("compose(balanced, allgather, 4)", 8, 2, "document"),
]


@pytest.mark.parametrize("name,P,H,mask_kind", CASES)
def test_plans_from_the_tables_match_dense_attention_in_float64(name, P, H, mask_kind):
    sched = next(b[1] for b in BUILDERS if b[0] == name)
    S = 2 * P * BLOCK * 2
    mask = mask_family(mask_kind, S)
    plan = fringe.plan(sched, mask, seq_len=S, world_size=P, block_size=BLOCK)
    q, k, v = make_qkv(B=1, H=H, G=H, S=S, D=4, seed=P)
    g = torch.Generator().manual_seed(P + 1)
    dout = torch.randn(q.shape, generator=g, dtype=torch.float64)
    dlse = torch.randn(q.shape[:-1], generator=g, dtype=torch.float64)
    results = []
    for fn in (lambda a, b, c: fringe.simulate.attention(a, b, c, plan=plan, return_lse=True),
               lambda a, b, c: reference.attention(a, b, c, mask_mod=mask)):
        qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
        out, lse = fn(qg, kg, vg)
        live = torch.isfinite(lse)
        grads = torch.autograd.grad((out, torch.where(live, lse, 0.0)), (qg, kg, vg),
                                    (dout, dlse))
        results.append([out.detach(), torch.where(live, lse, 0.0).detach(), *grads])
    for what, got, want in zip(("out", "lse", "dq", "dk", "dv"), *results):
        assert_close(got, want, **tolerances(torch.float64),
                     msg=lambda s: f"{name} {mask_kind} P={P} {what}: {s}")
