#!/usr/bin/env python3
"""One entry point for a fresh machine: ``python3 dev.py demo`` or ``python3 dev.py test``.

Creates (or reuses) ``.venv`` next to this file, installs torch first (``torch==2.13.0``,
the CPU wheel on our machines; override with ``FRINGE_TORCH="torch==X"`` or
``FRINGE_TORCH=skip`` when torch is already provided), then fringe with its extras, and
runs the demo or the test suite inside it. Extra arguments are passed through.

``test`` (what CI runs) also installs the ``titan`` extra (torchtitan 0.3.0 and triton, about
1.4 GB with torchtitan's own dependencies); ``demo`` and ``setup`` do not need it. The extras
are installed with torch held at the version installed first (a pip constraint), so no
dependency can swap in another (CUDA) torch.
"""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
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


BASE_EXTRAS = ("test", "plots", "notebooks", "hf")
TEST_EXTRAS = BASE_EXTRAS + ("titan",)


def setup(extras: tuple[str, ...] = BASE_EXTRAS) -> None:
    deps = (ROOT / "pyproject.toml").stat().st_mtime
    if STAMP.exists() and STAMP.stat().st_mtime >= deps and PY.exists() \
            and set(extras) <= set(STAMP.read_text().split()):
        return
    if not PY.exists():
        venv.EnvBuilder(with_pip=True).create(VENV)
    torch_spec = os.environ.get("FRINGE_TORCH", "torch==2.13.0")
    if torch_spec != "skip":
        _run(PY, "-m", "pip", "install", "-q", torch_spec)
    pinned = subprocess.run([str(PY), "-c", "import torch; print(torch.__version__)"],
                            capture_output=True, text=True)
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [PY, "-m", "pip", "install", "-q"]
        if pinned.returncode == 0:                  # hold torch where it is
            constraint = Path(tmp) / "torch.txt"
            constraint.write_text(f"torch=={pinned.stdout.strip()}\n")
            cmd += ["-c", constraint]
        _run(*cmd, "-e", f"{ROOT}[{','.join(extras)}]")
    STAMP.write_text(" ".join(extras) + "\n")


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in {"demo", "test", "setup"}:
        print(__doc__)
        return 2
    cmd, rest = argv[0], argv[1:]
    setup(TEST_EXTRAS if cmd == "test" else BASE_EXTRAS)
    if cmd == "setup":
        return 0
    if cmd == "demo":
        return subprocess.call([str(PY), "-m", "fringe", "demo", *rest], cwd=ROOT)
    return subprocess.call([str(PY), "-m", "pytest", *rest], cwd=ROOT)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
