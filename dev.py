#!/usr/bin/env python3
"""One entry point for a fresh machine: ``python3 dev.py demo`` or ``python3 dev.py test``.

Creates (or reuses) ``.venv`` next to this file, installs torch first (``torch==2.13.0``,
the CPU wheel on our machines; override with ``FRINGE_TORCH="torch==X"`` or
``FRINGE_TORCH=skip`` when torch is already provided), then fringe with its extras, and
runs the demo or the test suite inside it. Extra arguments are passed through.
"""
from __future__ import annotations

import os
import subprocess
import sys
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parent
VENV = Path(os.environ.get("FRINGE_VENV", ROOT / ".venv"))
BIN = VENV / ("Scripts" if os.name == "nt" else "bin")
PY = BIN / ("python.exe" if os.name == "nt" else "python")
STAMP = VENV / ".fringe-installed"


def _run(*cmd: str | Path) -> None:
    print("+", " ".join(map(str, cmd)), flush=True)
    subprocess.run([str(c) for c in cmd], check=True)


def setup() -> None:
    deps = (ROOT / "pyproject.toml").stat().st_mtime
    if STAMP.exists() and STAMP.stat().st_mtime >= deps and PY.exists():
        return
    if not PY.exists():
        venv.EnvBuilder(with_pip=True).create(VENV)
    torch_spec = os.environ.get("FRINGE_TORCH", "torch==2.13.0")
    if torch_spec != "skip":
        _run(PY, "-m", "pip", "install", "-q", torch_spec)
    _run(PY, "-m", "pip", "install", "-q", "-e", f"{ROOT}[test,plots,notebooks,hf]")
    STAMP.touch()


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in {"demo", "test", "setup"}:
        print(__doc__)
        return 2
    setup()
    cmd, rest = argv[0], argv[1:]
    if cmd == "setup":
        return 0
    if cmd == "demo":
        return subprocess.call([str(PY), "-m", "fringe", "demo", *rest], cwd=ROOT)
    return subprocess.call([str(PY), "-m", "pytest", *rest], cwd=ROOT)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
