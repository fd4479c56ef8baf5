"""The cost model is a package in layers (fringe/cost): each module imports only the layers
below it, nothing imports the ``fringe.runtime.costmodel`` facade, the tile planner is the
one of ``fringe.ops.calls``, and what the simulator derives from a plan lives in the cost
package, not in the frozen plan."""
from __future__ import annotations

import ast
import dataclasses
import gc
import pathlib

import pytest
import torch

import fringe
from fringe import masks, schedules
from fringe.cost import calibrate, hardware, simulate as cost_simulate, work
from fringe.ops import calls, tile
from fringe.runtime import costmodel

ROOT = pathlib.Path(fringe.__file__).parent

#: What each layer of the cost package may import of fringe (prefixes), as data.
BOTTOM = ("fringe.masks", "fringe.ops", "fringe.cost.hardware", "fringe.cost.work")
MIDDLE = BOTTOM + ("fringe.schedules", "fringe.runtime.interpreter", "fringe.cost.programs",
                   "fringe.cost.simulate")
LAYERS = {"hardware": BOTTOM, "work": BOTTOM, "programs": MIDDLE, "simulate": MIDDLE,
          "calibrate": None, "validate": None, "cli": None, "__init__": ()}   # None: any


def _module(path: pathlib.Path) -> str:
    rel = path.relative_to(ROOT.parent).with_suffix("")
    parts = list(rel.parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: pathlib.Path) -> list[tuple[str, bool]]:
    """``(fringe module, function-local)`` for every import of fringe in ``path``."""
    tree = ast.parse(path.read_text())
    pkg = _module(path) if path.name == "__init__.py" else _module(path).rpartition(".")[0]
    local = {id(n) for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
             for n in ast.walk(f)}
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(a.name, id(node) in local) for a in node.names if a.name.startswith("fringe")]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg.split(".")[:len(pkg.split(".")) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            if not mod.startswith("fringe"):
                continue
            for a in node.names:                     # `from pkg import module` names a module
                sub = f"{mod}.{a.name}"
                is_mod = (ROOT.parent / (sub.replace(".", "/") + ".py")).exists() or \
                    (ROOT.parent / sub.replace(".", "/")).is_dir()
                out.append((sub if is_mod else mod, id(node) in local))
    return out


def test_each_cost_layer_imports_only_the_layers_below_it():
    seen = set()
    for path in sorted((ROOT / "cost").glob("*.py")):
        allowed = LAYERS[path.stem]                  # a new module must be given a layer
        seen.add(path.stem)
        for mod, is_local in _imports(path):
            assert not is_local, f"{path.name}: function-local import of {mod}"
            if allowed is not None:
                assert mod.startswith(allowed), f"{path.name} ({path.stem}) imports {mod}"
    assert seen == set(LAYERS)


def test_no_fringe_module_imports_the_facade_and_layout_reads_only_the_bottom():
    for path in ROOT.rglob("*.py"):
        for mod, _ in _imports(path):
            assert mod != "fringe.runtime.costmodel", f"{path} imports the facade"
            if path.name == "layout.py" and mod.startswith("fringe.cost"):
                assert mod in ("fringe.cost.hardware", "fringe.cost.work"), mod


def test_the_facade_re_exports_the_layers_public_names():
    assert sorted(costmodel.__all__) == [
        "HARDWARE", "Hardware", "Prediction", "Shape", "available_memory", "calibrate",
        "check_memory", "check_plan_memory", "distinct_partial_maps", "get_hardware",
        "mask_from_spec", "memory_budget", "simulate", "tile_costs", "tile_work",
        "tile_work_bytes", "validate"]
    assert costmodel.simulate is cost_simulate.simulate
    assert costmodel.tile_work is work.tile_work and costmodel.Shape is hardware.Shape
    assert costmodel.get_hardware is calibrate.get_hardware      # "this" calibrates: tools
    assert costmodel.get_hardware("h100-ib") is hardware.HARDWARE["h100-ib"]
    with pytest.raises(ValueError, match=r"calibrate\(\)"):     # the bottom layer cannot
        hardware.get_hardware("this")


def test_tiles_and_the_work_model_plan_calls_with_the_one_planner():
    # ops.tile keeps no planner of its own: its groups are plan_tile's pieces, and the work
    # model counts the same pieces from the stacked maps (test_costmodel checks the counts)
    assert not any(hasattr(tile, f) for f in ("_row_groups", "_causal_runs", "_fused_plan"))
    g = torch.Generator().manual_seed(5)
    bs, n = 4, 7
    for _ in range(20):
        m = torch.randint(0, 3, (n, n), generator=g).to(torch.int8)
        m[torch.arange(n), torch.arange(n)] = int(masks.BlockKind.PARTIAL)
        for fused in (False, True):
            groups = tile._plan(m, Lq=n * bs - 1, Lk=n * bs, block_size=bs, fused=fused)
            pieces = calls.plan_tile(m.numpy(), Lq=n * bs - 1, Lk=n * bs, block_size=bs,
                                     fused=fused)
            assert [(gr.q0, gr.q1, gr.k0, gr.k1, gr.causal) for gr in groups] == [
                (a * bs, min(b * bs, n * bs - 1), c * bs, d * bs, sq) for a, b, c, d, sq in pieces]


def test_a_failing_element_check_ends_a_causal_square():
    # with an element check, a diagonal block that is not lower-triangular is not in a square
    n, bs = 6, 4
    m = torch.full((n, n), int(masks.BlockKind.EMPTY), dtype=torch.int8)
    m[torch.tril(torch.ones(n, n, dtype=torch.bool), -1)] = int(masks.BlockKind.FULL)
    m[torch.arange(n), torch.arange(n)] = int(masks.BlockKind.PARTIAL)
    assert calls.plan_tile(m.numpy(), Lq=n * bs, Lk=n * bs, block_size=bs, fused=True) == [
        (0, n, 0, n, True)]
    checked = calls.plan_tile(m.numpy(), Lq=n * bs, Lk=n * bs, block_size=bs, fused=True,
                              causal_block=lambda i, j: i != 3)
    assert (3, 4, 3, 4, True) not in checked
    assert [p for p in checked if p[4]] == [(0, 3, 0, 3, True), (4, 6, 4, 6, True)]


def test_what_the_simulator_derives_is_kept_in_the_plan_cache_not_its_fields():
    p = fringe.plan(schedules.zigzag(), masks.causal(), seq_len=256, world_size=4,
                    block_size=16)
    before = set(p.__dict__)
    a = cost_simulate.simulate(p, "cpu")
    assert set(p.__dict__) == before                              # nothing written into it
    assert "work" in p.cache.simulate                             # the cost model's entry
    b = cost_simulate.simulate(p, "cpu")                          # read from the cache
    assert a.step_s == b.step_s > 0
    copy = dataclasses.replace(p)
    assert copy.cache is not p.cache and not copy.cache.simulate  # a copy derives its own
    assert cost_simulate.simulate(copy, "cpu").step_s == a.step_s


def test_the_simulator_docstring_runs():
    import doctest
    result = doctest.testmod(cost_simulate)
    assert result.attempted >= 5 and result.failed == 0
