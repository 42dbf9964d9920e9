"""Where pdsweep's files are: the repository root (:data:`REPO`, for the default results,
cache and accuracy-task paths) and the interpreter of a sweep's named build."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING

from .errors import UserError

if TYPE_CHECKING:
    from .spec import LoadedSweep

REPO = Path(__file__).resolve().parent.parent


def venv_python(venv: str | Path) -> Path:
    """``<venv>/bin/python``; a relative ``venv`` is taken from the working directory when
    it exists there, else from :data:`REPO` (``make`` runs in the checkout, tests elsewhere)."""
    py = Path(venv) / "bin" / "python"
    if py.is_absolute():
        return py
    return (Path.cwd() / py) if (Path.cwd() / py).exists() else REPO / py


def build_python(ls: LoadedSweep, name: str) -> str:
    """Interpreter of a named build: ``python``, ``venv/bin/python`` or this one. Raises
    ``UserError`` when the build's venv has no interpreter yet."""
    b = ls.sweep.builds[name]
    if b.python:
        return b.python
    if b.venv:
        py = venv_python(b.venv)
        if not py.exists():
            raise UserError(f"{ls.path}: builds.{name}.venv: {py} does not exist "
                            f"(for the unfixed baseline run `make baseline-env`)")
        return str(py)
    return sys.executable
