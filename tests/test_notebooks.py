"""Notebooks are jupytext percent-format scripts; the suite executes each one."""
from __future__ import annotations

import runpy
from pathlib import Path

import pytest

NOTEBOOKS = sorted((Path(__file__).parent.parent / "notebooks").glob("*.py"))


def test_there_are_notebooks():
    assert NOTEBOOKS, "notebooks/ should hold at least one jupytext notebook"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_runs(path, monkeypatch, tmp_path):
    monkeypatch.setenv("MPLBACKEND", "Agg")
    monkeypatch.chdir(tmp_path)
    assert "assert " in path.read_text(), f"{path.name} should check what it shows"
    runpy.run_path(str(path), run_name="__main__")     # its own asserts must hold
