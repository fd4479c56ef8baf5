"""Every import in fringe/ runs one way, down the layers of DESIGN.md, and no import cycle remains.

The walk reads the source with ``ast`` (nothing is imported): every ``import`` / ``from ...
import`` of a fringe module, at module level and inside functions alike (relative imports
resolved; ``if TYPE_CHECKING:`` blocks excepted, they never run). Importing ``fringe.a.b`` from
outside ``fringe.a`` also runs ``fringe/a/__init__.py``, so it counts as an import of ``fringe.a``
as well. The root package ``fringe/__init__.py`` is the public facade, the top layer: every import
runs it first, so it is no implicit edge, and no module of fringe may import it.

The layer order is data (:data:`LAYERS`), the order DESIGN.md shows. :data:`KNOWN` lists the
violations that other work in progress removes; each names its reason and owner, and an entry
that no longer matches an import fails the test, so the list only shrinks.
"""
from __future__ import annotations

import ast
import pathlib
from collections import defaultdict
from typing import NamedTuple

import fringe

ROOT = pathlib.Path(fringe.__file__).resolve().parent

#: Bottom to top. ``"x.*"`` is the module or package ``x`` and everything under it; a name without
#: ``*`` is that module only. The most specific pattern wins (an exact name over any ``*``, a longer
#: ``*`` over a shorter one).
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("masks", ("fringe.masks.*", "fringe._data")),       # _data: test data any layer may read
    # pure tile math, and the one tile-call planner the cost model's work model asks too
    ("ops", ("fringe.ops.*",)),
    # the cost package's bottom: plain data and the tile work model; its __init__ must stay as low
    # (importing fringe.cost.hardware runs it)
    ("hardware", ("fringe.hardware.*", "fringe.cost", "fringe.cost.hardware.*", "fringe.cost.work.*")),
    ("layout", ("fringe.layout.*", "fringe._balanced.*")),
    ("schedules", ("fringe.schedules.*",)),
    ("runtime", ("fringe.runtime.*",)),
    ("cost", ("fringe.cost.*",)),                       # the simulator: reads the IR only
    ("plan", ("fringe.plan.*", "fringe._handle", "fringe._stats", "fringe._auto")),
    ("autograd", ("fringe.autograd", "fringe._attention_op")),
    ("api", ("fringe.api", "fringe.simulate")),
    ("integrations", ("fringe.hf", "fringe.titan", "fringe.train", "fringe.packing.*")),
    ("render", ("fringe.render",)),
    # CLI and tools; fringe.testing is tools that production never imports; the cost model's
    # calibration/validation runs spawn ranks (launch) and measure (bench)
    ("tools", ("fringe.__main__", "fringe.bench", "fringe.launch", "fringe.demo", "fringe.testing.*",
               "fringe.runtime.costmodel", "fringe.cost.calibrate", "fringe.cost.validate",
               "fringe.cost.cli")),
    ("package", ("fringe",)),                           # the public facade, fringe/__init__.py
]

#: Violations other work removes: (importer, imported, reason, owner). ``imported`` is the module
#: the rule counts (a package's ``__init__`` where the import runs it). The lead empties this list.
KNOWN: list[tuple[str, str, str, str]] = []      # emptied: every import runs down the layers


class Import(NamedTuple):
    importer: str           # module name, e.g. "fringe.plan"
    imported: str           # module the rule counts
    path: str               # fringe/plan.py
    line: int
    local: bool             # inside a function
    via: str                # the module named in the statement, when ``imported`` is its package


def _modules(root: pathlib.Path) -> dict[str, tuple[pathlib.Path, bool]]:
    """Every module of the package at ``root`` by name: (file, is a package)."""
    mods = {}
    for path in sorted(root.rglob("*.py")):
        parts = (root.name,) + path.relative_to(root).with_suffix("").parts
        package = parts[-1] == "__init__"
        mods[".".join(parts[:-1] if package else parts)] = (path, package)
    return mods


def _type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _targets(node: ast.Import | ast.ImportFrom, module: str, package: bool,
             mods: dict) -> list[str]:
    """The fringe modules one import statement names (``from a import b``: ``a.b`` if a module)."""
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    else:
        base = node.module or ""
        if node.level:
            parts = module.split(".")[:len(module.split(".")) - (not package) - (node.level - 1)]
            base = ".".join(parts + ([node.module] if node.module else []))
        names = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
    return [n for n in dict.fromkeys(names) if n == "fringe" or n.startswith("fringe.")]


def _imports(root: pathlib.Path = ROOT) -> tuple[dict, list[Import]]:
    """Every import of a fringe module in fringe/, package ``__init__`` runs included."""
    mods = _modules(root)
    found: list[Import] = []
    for module, (path, package) in mods.items():
        rel = str(path.relative_to(root.parent))

        def walk(node, local: bool):
            for child in ast.iter_child_nodes(node):
                if isinstance(child, ast.If) and _type_checking(child):
                    body = child.orelse              # the TYPE_CHECKING branch never runs
                else:
                    body = [child]
                for n in body:
                    if isinstance(n, (ast.Import, ast.ImportFrom)):
                        for target in _targets(n, module, package, mods):
                            found.append(Import(module, target, rel, n.lineno, local, target))
                            parts = target.split(".")
                            for i in range(2, len(parts)):      # packages whose __init__ runs
                                parent = ".".join(parts[:i])
                                if module != parent and not module.startswith(parent + "."):
                                    found.append(Import(module, parent, rel, n.lineno, local, target))
                    walk(n, local or isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef,
                                                    ast.Lambda)))
        walk(ast.parse(path.read_text(), filename=rel), False)
    return mods, found


def _layer(module: str) -> int | None:
    best, rank = None, None
    for index, (_, patterns) in enumerate(LAYERS):
        for pattern in patterns:
            if pattern.endswith(".*"):
                stem = pattern[:-2]
                score = (0, len(stem)) if module == stem or module.startswith(stem + ".") else None
            else:
                score = (1, 0) if module == pattern else None
            if score is not None and (rank is None or score > rank):
                best, rank = index, score
    return best


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out = []
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(edges[w]))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


def _graph(found: list[Import], skip=frozenset()) -> dict[str, set[str]]:
    edges: dict[str, set[str]] = defaultdict(set)
    for imp in found:
        if imp.importer != imp.imported and (imp.importer, imp.imported) not in skip:
            edges[imp.importer].add(imp.imported)
            edges[imp.imported]
    return edges


def _cycle_path(edges: dict[str, set[str]], members: list[str]) -> list[str]:
    """One shortest cycle through ``members[0]`` inside the component ``members``."""
    start, inside = members[0], set(members)
    back = {start: None}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(edges[v] & inside):
                if w == start:
                    path = [v]
                    while back[path[-1]] is not None:
                        path.append(back[path[-1]])
                    return [start] + path[::-1][1:] + [start] if v != start else [start, start]
                if w not in back:
                    back[w] = v
                    nxt.append(w)
        frontier = nxt
    raise AssertionError(f"{members} is no cycle")


def _describe(imp: Import) -> str:
    init = imp.imported.replace(".", "/") + "/__init__.py"
    via = f" (via {imp.via}, which runs {init})" if imp.via != imp.imported else ""
    where = "function-local " if imp.local else ""
    return f"{imp.path}:{imp.line}: {where}import of {imp.imported}{via}"


def test_every_module_is_in_a_layer():
    mods, _ = _imports()
    missing = sorted(m for m in mods if _layer(m) is None)
    assert not missing, (f"modules in no layer: {missing}; add each to LAYERS in tests/test_layers.py "
                         f"(and to DESIGN.md's layer list) where its imports put it")


def test_layer_table_matches_the_known_order():
    names = [name for name, _ in LAYERS]
    assert names == ["masks", "ops", "hardware", "layout", "schedules", "runtime", "cost", "plan",
                     "autograd", "api", "integrations", "render", "tools", "package"]
    assert _layer("fringe.cost.hardware") < _layer("fringe.layout") < _layer("fringe.cost.simulate")
    assert _layer("fringe.runtime.engine") == names.index("runtime")
    assert _layer("fringe.runtime.costmodel") == _layer("fringe.testing.oracle") == names.index("tools")
    assert _layer("fringe.nowhere") is None


def test_imports_run_down_the_layers():
    _, found = _imports()
    known = {(a, b) for a, b, _, _ in KNOWN}
    bad, seen = [], set()
    for imp in found:
        lo, hi = _layer(imp.importer), _layer(imp.imported)
        if lo is None or hi is None or hi <= lo:
            continue
        seen.add((imp.importer, imp.imported))
        if (imp.importer, imp.imported) not in known:
            bad.append(f"{_describe(imp)}: layer {LAYERS[lo][0]} imports layer {LAYERS[hi][0]} above it")
    assert not bad, ("imports against the layer order (move the helper down to the layer that "
                     "needs it, or pass a value instead of importing upward):\n  " + "\n  ".join(bad))
    stale = [k for k in KNOWN if (k[0], k[1]) not in seen]
    assert not stale, f"KNOWN entries that no longer match an upward import; delete them: {stale}"


def test_no_import_cycle():
    _, found = _imports()
    full = _cycles(_graph(found))
    if full:
        print(f"cycles before the KNOWN violations are removed: {full}")
    edges = _graph(found, {(a, b) for a, b, _, _ in KNOWN})
    first = {}
    for imp in found:
        first.setdefault((imp.importer, imp.imported), imp)
    msgs = []
    for members in _cycles(edges):
        path = _cycle_path(edges, members)
        msgs.append(f"{len(members)} modules {members}, e.g.\n    " + "\n    ".join(
            _describe(first[a, b]) for a, b in zip(path, path[1:])))
    assert not msgs, ("import cycles (function-local imports included); break each by moving "
                      "the helper to the lower module:\n  " + "\n  ".join(msgs))


def test_known_entries_are_explained():
    for importer, imported, reason, owner in KNOWN:
        assert _layer(importer) is not None and _layer(imported) is not None, (importer, imported)
        assert reason and owner, (importer, imported)


def test_count_function_local_imports():
    """The count the note quotes: function-local import statements of fringe's own modules."""
    _, found = _imports()
    local = sorted({(imp.path, imp.line) for imp in found if imp.local})
    by_file: dict[str, int] = defaultdict(int)
    for path, _ in local:
        by_file[path] += 1
    print(f"function-local imports of fringe modules: {len(local)} statements "
          f"({', '.join(f'{p} {n}' for p, n in sorted(by_file.items()))})")
    assert all(n > 0 for n in by_file.values())


def test_the_walk_sees_local_relative_and_package_imports(tmp_path):
    pkg = tmp_path / "fringe"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("from . import low\n")
    (pkg / "low.py").write_text("import os\n")
    (pkg / "sub" / "__init__.py").write_text("from .deep import x\n")
    (pkg / "sub" / "deep.py").write_text(
        "from typing import TYPE_CHECKING\n"
        "from .. import low\n"                          # relative, two levels
        "if TYPE_CHECKING:\n"
        "    from fringe import high\n"                 # never runs: not counted
        "else:\n"
        "    import fringe.low\n"
        "def f():\n"
        "    from . import other\n"                     # function-local, sibling module
        "x = 1\n")
    (pkg / "sub" / "other.py").write_text("")
    (pkg / "high.py").write_text("def g():\n    from .sub import deep\n")
    _, found = _imports(pkg)
    got = {(i.importer, i.imported, i.line, i.local) for i in found}
    assert got == {("fringe", "fringe.low", 1, False),
                   ("fringe.sub", "fringe.sub.deep", 1, False),
                   ("fringe.sub.deep", "fringe.low", 2, False),
                   ("fringe.sub.deep", "fringe.low", 6, False),
                   ("fringe.sub.deep", "fringe.sub.other", 8, True),
                   ("fringe.high", "fringe.sub.deep", 2, True),
                   ("fringe.high", "fringe.sub", 2, True)}       # runs sub/__init__.py
    assert _cycles(_graph(found)) == []
    (pkg / "low.py").write_text("def h():\n    from .high import g\n")
    _, found = _imports(pkg)
    edges = _graph(found)
    assert _cycles(edges) == [["fringe.high", "fringe.low", "fringe.sub", "fringe.sub.deep"]]
    assert _cycle_path(edges, _cycles(edges)[0]) == ["fringe.high", "fringe.sub.deep", "fringe.low",
                                                     "fringe.high"]
