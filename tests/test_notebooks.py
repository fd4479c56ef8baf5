"""The notebooks in notebooks/ run through a real Jupyter kernel, and what is committed is what runs.

Each ``.ipynb`` is committed with its outputs (figures included) so it reads on a code host;
its jupytext ``.py`` pair is for review. The suite executes every notebook with nbclient
(a fresh ipykernel, this interpreter) and fails on any cell error; the notebooks assert
what they show.
"""
from __future__ import annotations

from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat", reason="pip install 'fringe[notebooks]'")
jupytext = pytest.importorskip("jupytext", reason="pip install 'fringe[notebooks]'")
nbclient = pytest.importorskip("nbclient", reason="pip install 'fringe[notebooks]'")

HERE = Path(__file__).parent.parent / "notebooks"
NOTEBOOKS = sorted(HERE.glob("*.ipynb"))
CELL_TIMEOUT_S = 120


def _code(nb) -> list[str]:
    return [c.source.strip() for c in nb.cells if c.cell_type == "code"]


def test_there_are_three_notebooks_each_with_its_pair():
    assert len(NOTEBOOKS) >= 3, "notebooks/ should hold the three tours as .ipynb"
    for path in NOTEBOOKS:
        pair = path.with_suffix(".py")
        assert pair.exists(), f"{path.name} has no jupytext pair; run jupytext --sync {path}"
        assert _code(nbformat.read(path, as_version=4)) == _code(jupytext.read(pair)), (
            f"{path.name} and {pair.name} differ; run jupytext --sync {path} and re-execute")


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_committed_notebook_carries_its_outputs(path):
    nb = nbformat.read(path, as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert code and all(c.get("execution_count") for c in code), (
        f"{path.name} is committed unexecuted; run it (see notebooks/README.md)")
    assert any(o.get("output_type") == "error" for c in code for o in c.outputs) is False
    images = [o for c in code for o in c.outputs if "image/png" in o.get("data", {})]
    assert images, f"{path.name} should show at least one figure"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_runs_in_a_kernel(path, tmp_path, monkeypatch):
    monkeypatch.delenv("MPLBACKEND", raising=False)     # the inline backend, as a user sees it
    nb = nbformat.read(path, as_version=4)
    assert any("assert " in c for c in _code(nb)), f"{path.name} should check what it shows"
    client = nbclient.NotebookClient(
        nb, timeout=CELL_TIMEOUT_S, kernel_name="python3", allow_errors=False,
        resources={"metadata": {"path": str(tmp_path)}})   # python3: ipykernel on this interpreter
    client.execute()                 # raises CellExecutionError naming the cell on any error
    images = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs
              if "image/png" in o.get("data", {})]
    assert images, f"{path.name}: no figure was displayed inline"
