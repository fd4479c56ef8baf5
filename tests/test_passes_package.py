"""``fringe.schedules.passes`` is a package of private modules, one per pass plus what they
share: the names imported from it before the split are still there (the same objects as in
the module that defines them), its modules import one way in the order its docstring lists,
and a setting assigned on the package (a monkeypatch included) reaches every pass."""
from __future__ import annotations

import ast
import importlib
import pathlib
import pkgutil
import re

import numpy as np
import pytest

import fringe.schedules.passes as passes
from fringe.schedules import format_programs, get

#: Bottom to top: each module imports only those before it.
ORDER = ["_keys", "_locate", "_columns", "_blocks", "_check", "_prune", "_lower", "_reverse",
         "_narrow"]

#: What fringe/ and tests/ import from ``fringe.schedules.passes`` (or read as ``passes.<name>``).
IMPORTED = ["BlockNeed", "covered", "narrow",
            "Hop", "HopTable", "KV_MODES", "ScheduleError", "check", "gc_paused", "lower", "prune",
            "reverse", "shared_columns", "_Gen", "_general_ok", "_general_prune", "_general_reverse",
            "_keep_hops", "_lookup", "_need_array", "_resend_parts", "_reverse_parts", "_row_keys",
            "_table", "_tile_touches", "_unique", "DENSE_CELLS", "MATCH_CELLS", "MEMBER_CELLS",
            "PLANE_CELLS"]

SETTINGS = {"DENSE_CELLS": "_columns", "PLANE_CELLS": "_columns", "MEMBER_CELLS": "_columns",
            "MATCH_CELLS": "_check"}

DIR = pathlib.Path(passes.__file__).parent


def _module(name: str):
    return importlib.import_module(f"{passes.__name__}.{name}")


def _fringe_imports(tree: ast.AST) -> list[tuple[str, bool]]:
    """``(module named, inside a function)`` for each relative import of a private module."""
    out = []

    def walk(node, local):
        for n in ast.iter_child_nodes(node):
            if isinstance(n, ast.ImportFrom) and n.level == 1:
                names = [n.module] if n.module else [a.name for a in n.names]
                out.extend((m, local) for m in names)
            walk(n, local or isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))
    walk(tree, False)
    return out


def test_the_modules_import_one_way_in_the_order_the_docstring_lists():
    assert sorted(m.name for m in pkgutil.iter_modules(passes.__path__)) == sorted(ORDER)
    listed = re.findall(r"^\* ``(_\w+)``", passes.__doc__, flags=re.M)
    assert listed == ORDER, "the package docstring lists the modules bottom to top"
    for k, name in enumerate(ORDER):
        tree = ast.parse((DIR / f"{name}.py").read_text())
        for target, local in _fringe_imports(tree):
            assert not local, f"{name} imports {target} inside a function"
            assert target in ORDER[:k], f"{name} imports {target}, which is not below it"


def test_every_name_imported_before_the_split_is_the_one_its_module_defines():
    for name in IMPORTED:
        obj = getattr(passes, name)
        owner = getattr(obj, "__module__", None)
        if owner and owner.startswith(passes.__name__ + "."):
            assert getattr(importlib.import_module(owner), name) is obj, name
    assert set(passes.__all__) <= set(IMPORTED)
    assert passes.reverse.__module__ == f"{passes.__name__}._reverse"   # the function, not a module


def test_a_setting_lives_in_one_module_and_the_others_read_it_there():
    """Only the owner binds a setting; any other module reads it as ``<owner>.NAME`` at call
    time (a ``from ... import NAME`` would keep a copy that an assignment does not reach)."""
    for name in ORDER:
        tree = ast.parse((DIR / f"{name}.py").read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Name) and node.id in SETTINGS:
                assert SETTINGS[node.id] == name, f"{name} reads {node.id} as a bare name"
            if isinstance(node, ast.alias) and node.name in SETTINGS:
                assert False, f"{name} imports {node.name}"
            if isinstance(node, ast.Attribute) and node.attr in SETTINGS:
                assert isinstance(node.value, ast.Name) and node.value.id == SETTINGS[node.attr]
        for setting, owner in SETTINGS.items():
            assert (setting in vars(_module(name))) == (owner == name), (name, setting)


@pytest.mark.parametrize("name", sorted(SETTINGS))
def test_a_setting_assigned_on_the_package_reaches_its_owner_and_is_undone(name, monkeypatch):
    owner = _module(SETTINGS[name])
    before = getattr(owner, name)
    assert getattr(passes, name) == before > 0
    with monkeypatch.context() as m:
        m.setattr(passes, name, 0)
        assert getattr(owner, name) == 0 and getattr(passes, name) == 0
    assert getattr(owner, name) == before and getattr(passes, name) == before


def _run_passes(need):
    """check, prune and reverse (both kv policies) on fresh programs (a table remembers the
    checks it passed), in text form."""
    progs = get("compose:zigzag+ulysses:2").programs(8)
    passes.check(progs)
    got = passes.prune(progs, need)
    return [format_programs(x) for x in [got] + [passes.reverse(got, kv=kv) for kv in passes.KV_MODES]]


def test_a_plane_limit_assigned_on_the_package_reaches_check_prune_and_reverse(monkeypatch):
    """``PLANE_CELLS = 0`` on the package sends the passes of three modules to their sorted
    keys (each sorted path's helper is called, none is by default) with the same programs."""
    need = np.tri(8, dtype=bool) | (np.random.default_rng(0).random((8, 8)) < 0.2)
    calls = {}
    for module, helper in (("_check", "_min_by_key"), ("_prune", "_member"), ("_reverse", "_uniq")):
        real = getattr(_module(module), helper)

        def spy(*a, _real=real, _at=module, **k):
            calls[_at] = calls.get(_at, 0) + 1
            return _real(*a, **k)
        monkeypatch.setattr(_module(module), helper, spy)
    want = _run_passes(need)
    assert calls == {}, "the dense planes fit: no sorted keys"
    monkeypatch.setattr(passes, "PLANE_CELLS", 0)
    assert _run_passes(need) == want
    assert set(calls) == {"_check", "_prune", "_reverse"}


def test_assign_min_casts_for_the_fast_loop_and_refuses_values_that_would_wrap():
    """``_assign_min`` casts the values to the array's dtype (``ufunc.at`` with two dtypes
    leaves NumPy's fast loop) and raises where the cast would wrap, instead of writing a
    wrong minimum."""
    from fringe.schedules.passes import _keys
    arr = np.full(4, np.iinfo(np.int32).max, dtype=np.int32)
    _keys._assign_min(arr, np.array([1, 1, 3]), np.array([7, 5, 2], dtype=np.int64))
    assert arr.tolist() == [2 ** 31 - 1, 5, 2 ** 31 - 1, 2]
    with pytest.raises(OverflowError, match="do not fit the int32 array"):
        _keys._assign_min(arr, np.array([0]), np.array([-2 ** 40], dtype=np.int64))
    assert arr[0] == 2 ** 31 - 1
