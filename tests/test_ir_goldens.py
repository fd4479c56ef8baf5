"""IR goldens for the collective schedules and compose (plain-ASCII program text).

The files under ``tests/golden/`` were written by the code of commit ad293f7 (before the
IR was unified) with the generator below; every later representation of the programs
must print the same forward and backward programs, for both kv policies, on a causal
and a document mask.
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

import fringe
from fringe import masks, schedules
from fringe.schedules.ir import format_programs, parse_programs

GOLDEN = Path(__file__).parent / "golden"
S, P, BS = 64, 4, 4
DOCS = [0] * 20 + [1] * 9 + [2] * 23 + [3] * 12
MASKS = {"causal": lambda: masks.causal(),
         "docs": lambda: masks.causal() & masks.document(torch.tensor(DOCS))}
SPECS = {"allgather": "allgather", "ulysses": "ulysses",
         "compose_zigzag_ulysses2": "compose:zigzag+ulysses:2",
         "compose_zigzag_allgather2_2": "compose:zigzag+allgather:2:2"}
CASES = [(k, m, kv) for k in SPECS for m in MASKS for kv in ("resend", "keep")]


def _text(key: str, mask: str, kv: str) -> tuple[str, fringe.Plan]:
    spec = SPECS[key]
    p = fringe.plan(schedules.get(spec), MASKS[mask](), seq_len=S, world_size=P, block_size=BS,
                    kv=kv, num_heads=4 if "ulysses" in spec else None)
    head = f"{spec} {mask} S={S} P={P} block={BS}"
    return (f"# {head} forward\n" + format_programs(p.forward) +
            f"# {head} backward kv={kv}\n" + format_programs(p.backward)), p


@pytest.mark.parametrize("key,mask,kv", CASES)
def test_collective_goldens(key, mask, kv):
    text, p = _text(key, mask, kv)
    path = GOLDEN / f"{key}_p4_{mask}_{kv}.txt"
    if os.environ.get("FRINGE_REGOLD"):
        path.write_text(text)
    golden = path.read_text()
    assert golden.isascii()
    fwd, bwd = golden.split("\n# ", 1)
    assert parse_programs(fwd) == list(p.forward)
    assert parse_programs("# " + bwd) == list(p.backward)
    assert text == golden, "regenerate with FRINGE_REGOLD=1 only if the change is intended"
