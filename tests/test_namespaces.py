"""The public surface is deliberate: adding or removing a name is a visible change here."""
from __future__ import annotations

import importlib

import pytest

PUBLIC = {
    "fringe": ["CommTimeout", "DEFAULT_BLOCK_SIZE", "KVPolicy", "Layout", "Plan", "PlanStats",
               "RankMismatch", "RunStats", "attention", "last_run", "launch", "layout", "masks", "ops",
               "padded_len", "plan", "recording", "render", "runtime", "schedules", "simulate"],
    "fringe.masks": ["BlockKind", "BlockMap", "Mask", "MaskError", "MaskMod", "as_mask", "causal", "classify",
                     "digest", "document", "evaluate", "fn_digest", "full", "prefix_lm",
                     "reads_batch_head", "sliding_window", "snapshot"],
    "fringe.layout": ["BALANCE_SHAPE", "BALANCE_SLACK", "CHAIN_BALANCED", "DEFAULT_BLOCK_SIZE",
                      "EXACT_BLOCKS", "HOP_SLACK", "Layout", "balanced", "block_costs", "candidates",
                      "contiguous", "from_order", "predict", "segments", "striped", "zigzag"],
    "fringe.ops": ["KERNELS", "Kernel", "ReferenceKernel", "SdpaKernel", "attention", "check_qkv",
                   "get_kernel", "merge", "tile_backward", "tile_forward"],
    "fringe.schedules": ["Collective", "Compute", "GradCompute", "Hop", "KV_MODES", "KVPolicy",
                         "Program", "ProgramBuilder", "Recv",
                         "allgather", "auto", "balanced", "compose", "ulysses", "get", "names",
                         "register",
                         "Schedule", "ScheduleError", "Send", "Step", "check", "lower", "parse_op",
                         "prune", "reverse", "ring", "ring_hops", "striped", "zigzag"],
    "fringe.train": ["GradSync", "Step", "dp_cp_mesh", "group_ranks"],
    "fringe.runtime": ["CommTimeout", "DistRuntime", "DistTransport", "Pool", "RankMismatch",
                       "RankState", "Runtime", "StepRecord", "VirtualMesh", "VirtualRuntime",
                       "execute"],
}


@pytest.mark.parametrize("module", sorted(PUBLIC))
def test_public_names_are_pinned(module):
    mod = importlib.import_module(module)
    assert sorted(mod.__all__) == sorted(PUBLIC[module])
    for name in mod.__all__:
        assert hasattr(mod, name), f"{module}.{name} is in __all__ but missing"


def test_no_private_torch_imports_outside_the_fast_path():
    import pathlib
    import re
    root = pathlib.Path(importlib.import_module("fringe").__file__).parent
    pattern = re.compile(r"torch\._(higher_order_ops|inductor|dynamo|prims)|torch\.ops\.aten\._|"
                         r"from torch[\w.]* import _")
    offenders = [str(p.relative_to(root)) for p in root.rglob("*.py")
                 if p.name != "_fast.py" and pattern.search(p.read_text())]
    assert offenders == [], f"private torch API outside fringe/ops/_fast.py: {offenders}"


def test_masks_does_not_import_layout():
    """masks sits below layout (layout re-exports masks.DEFAULT_BLOCK_SIZE): no cycle."""
    import ast
    import pathlib

    import fringe.masks
    files = sorted(pathlib.Path(fringe.masks.__file__).parent.glob("*.py"))
    assert len(files) > 1                           # a package of private modules
    for path in files:
        tree = ast.parse(path.read_text())
        imported = {node.module for node in ast.walk(tree)
                    if isinstance(node, ast.ImportFrom) and node.module}
        assert not any(m == "layout" or m.endswith(".layout") for m in imported), (path, imported)


def test_masks_modules_import_one_way():
    """Inside fringe.masks the private modules import one way (no cycle) and never the
    package back; no function-local import of fringe's own modules."""
    import ast
    import pathlib

    import fringe.masks
    root = pathlib.Path(fringe.masks.__file__).parent
    edges: dict[str, set[str]] = {}
    for path in (p for p in root.glob("_*.py") if p.name != "__init__.py"):
        tree = ast.parse(path.read_text())
        top = {id(node) for node in tree.body}
        edges[path.stem] = set()
        for node in ast.walk(tree):
            if not isinstance(node, ast.ImportFrom) or not node.level:
                continue
            assert node.module, f"{path.name} imports the masks package back"
            assert id(node) in top, f"{path.name}: function-local import of .{node.module}"
            assert node.level == 1, f"{path.name} imports above fringe.masks: {node.module}"
            edges[path.stem].add(node.module)
    done: set[str] = set()

    def visit(mod: str, stack: tuple[str, ...]) -> None:
        assert mod not in stack, f"import cycle: {' -> '.join(stack + (mod,))}"
        if mod not in done:
            for dep in edges[mod]:
                visit(dep, stack + (mod,))
            done.add(mod)
    for mod in edges:
        visit(mod, ())


def test_no_import_cycle_inside_ops():
    """tile imports the kernel registry from fringe.ops.kernels at module level; nothing in ops
    imports the package back."""
    import ast
    import pathlib

    import fringe.ops
    for path in pathlib.Path(fringe.ops.__file__).parent.glob("*.py"):
        if path.name == "__init__.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 1:
                assert node.module is not None, f"{path.name} imports the ops package back"
