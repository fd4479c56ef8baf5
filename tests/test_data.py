"""Test data lives in a leaf every layer may read; the old import paths still give it."""
from __future__ import annotations

import ast
import pathlib

import torch

import fringe
from fringe import _data, bench, testing


def test_packed_docs_has_one_home_reexported_by_bench_and_testing():
    assert bench.packed_docs is _data.packed_docs
    assert testing.packed_docs is _data.packed_docs
    ids = _data.packed_docs(1000, 7, seed=3)
    assert ids.dtype == torch.int64 and ids.shape == (1000,)
    assert int(ids[0]) == 0 and bool((ids[1:] - ids[:-1] >= 0).all())
    assert int(ids[-1]) == 6 and int((ids[1:] != ids[:-1]).sum()) == 6     # 7 documents


def test_the_data_module_is_a_leaf():
    tree = ast.parse(pathlib.Path(_data.__file__).read_text())
    imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module or "." for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert imported <= {"__future__", "torch"}, imported
    root = pathlib.Path(fringe.__file__).parent
    defined = [str(p.relative_to(root)) for p in root.rglob("*.py")
               if "def packed_docs(" in p.read_text()]
    assert defined == ["_data.py"], defined
