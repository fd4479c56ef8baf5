"""No op path in production (issue 18): the passes, plan stats and the cost model run on the
one program table; the op-by-op rules are an oracle in ``fringe.testing`` that no production
module imports, and every plan runs with the oracle made unimportable."""
from __future__ import annotations

import ast
import os
import pathlib
import subprocess
import sys
import textwrap

import fringe

ROOT = pathlib.Path(fringe.__file__).resolve().parent          # the fringe package

#: Imports of fringe.testing still in production, as (module path, enclosing function): each
#: is to go, and one that is gone must leave this list (the test fails until it does).
#: check's failure tail asks the oracle to name a fault until the column check names it.
TRANSITIONAL: set = set()      # every production import of fringe.testing is gone

SPECS = ["ring", "zigzag", "striped", "balanced", "allgather", "allgather:3", "ulysses",
         "compose:zigzag+ulysses:2", "compose:zigzag+allgather:2:2", "compose:zigzag+ring:2",
         "compose:allgather:4+ulysses:2", "compose:ring+ulysses:4"]
USER = ["two_level_allgather(4)", "two_level_allgather(4, own='none')",
        "two_level_allgather(4, own='mixed')", "allgather_then_ring(4)",
        "allgather_then_ring(4, own='none')", "two_level_allgather_columns(4)",
        "two_level_allgather_columns(4, mask_aware=True)"]


def _testing_imports(src: str, package: list[str]) -> list[tuple[str, int]]:
    """``(enclosing function or '<module>', line)`` of each import of fringe.testing in a
    module's source (``package``: its package, as parts), function-local and relative
    imports included."""
    found = []

    def visit(node, where):
        for child in ast.iter_child_nodes(node):
            name = where
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                name = child.name
            targets = []
            if isinstance(child, ast.Import):
                targets = [a.name for a in child.names]
            elif isinstance(child, ast.ImportFrom):
                base = package[:len(package) - child.level + 1] if child.level else []
                mod = ".".join(base + ([child.module] if child.module else []))
                targets = [mod] + [f"{mod}.{a.name}" for a in child.names]
            if any(t == "fringe.testing" or t.startswith("fringe.testing.") for t in targets):
                found.append((name, child.lineno))
            visit(child, name)
    visit(ast.parse(src), "<module>")
    return found


def test_no_production_module_imports_the_oracle():
    """No module under fringe/ but fringe/testing/ imports fringe.testing (the AST of every
    module, function-local imports included), but the transitional sites listed."""
    seen = set()
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel.startswith("testing/"):
            continue
        package = ["fringe", *path.relative_to(ROOT).parent.parts]
        for where, line in _testing_imports(path.read_text(), package):
            assert (rel, where) in TRANSITIONAL, f"fringe/{rel}:{line} ({where}) imports fringe.testing"
            seen.add((rel, where))
    assert seen == TRANSITIONAL, f"gone, remove from TRANSITIONAL: {TRANSITIONAL - seen}"


def test_the_import_walk_finds_every_form():
    """The walk sees absolute, relative, from-package and function-local imports."""
    src = textwrap.dedent("""
        import fringe.testing.oracle
        from fringe import testing
        def f():
            from ..testing import oracle
        def g():
            from .. import testing as t
        from ..schedules import passes
    """)
    got = _testing_imports(src, ["fringe", "schedules"])
    assert got == [("<module>", 2), ("<module>", 3), ("f", 5), ("g", 7)]


_SCRIPT = """
import importlib.abc, sys

class NoOracle(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "fringe.testing.oracle":
            raise ImportError("fringe.testing.oracle is for tests; production imported it")
        return None

sys.meta_path.insert(0, NoOracle())
try:
    import fringe.testing.oracle
except ImportError:
    pass
else:
    raise SystemExit("the blocker did not block")

from fringe import masks, schedules
from fringe.testing import packed_docs
from fringe.cost import programs as cost_programs
from fringe.plan import plan as make_plan
from fringe.runtime import costmodel
from fringe.schedules import passes
from fringe.testing.user_schedules import (allgather_then_ring, two_level_allgather,
                                           two_level_allgather_columns)

P, S, BLOCK = 16, 2048, 16
MASKS = {"causal": masks.causal(),
         "documents": masks.causal() & masks.document(packed_docs(S, 5, 1)),
         "window": masks.sliding_window(3 * S // P)}
done = 0
for name in %(specs)r + %(user)r:
    sched = eval(name) if "(" in name else schedules.get(name)
    for mname, mask in MASKS.items():
        for kv in ("resend", "keep"):
            p = make_plan(sched, mask, seq_len=S, world_size=P, block_size=BLOCK, kv=kv)
            again = passes.reverse(p.forward, kv=kv)
            assert [x.ascii() for x in again] == [x.ascii() for x in p.backward], name
            assert costmodel.simulate(p, "cpu").forward_s > 0, name
            rows = p.stats(heads=16).rows
            assert sum(r["blocks"] for r in rows) > 0, name
            done += 1
assert "fringe.testing.oracle" not in sys.modules
print("planned", done)
"""


def test_every_schedule_plans_reverses_and_simulates_without_the_oracle():
    """Every registered schedule, compose variants, allgather:3 and the user schedules plan
    (check, prune, reverse), reverse again, simulate and report stats at P=16 on causal,
    documents and window masks under both kv policies, in one process where importing the
    oracle raises: no pass reaches it."""
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(ROOT.parent), os.environ.get("PYTHONPATH", "")]))
    script = _SCRIPT % dict(specs=SPECS, user=USER)
    res = subprocess.run([sys.executable, "-c", script], env=env, cwd=ROOT.parent,
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.split() == ["planned", str(len(SPECS + USER) * 3 * 2)]


def test_the_registry_is_covered():
    """Every registered name is planned above (compose variants and user schedules besides)."""
    assert set(fringe.schedules.names()) <= {s.split(":")[0] for s in SPECS}
