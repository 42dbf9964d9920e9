"""Sweep files for tests of bad input: ``write`` one beside a copy of sweeps/models.yaml, and
run ``pdsweep validate`` on it expecting refusal (``bad``: exit 2, no traceback) or success
(``good``); ``sweep`` loads one (after ``HEAD``, a CPU sweep with 32-token blocks, unless told);
``SMALL`` is a one-cell CPU sweep."""

from __future__ import annotations

from pathlib import Path

from pdsweep.cli import main
from pdsweep.sweepfile.sweep import LoadedSweep, load_sweep

REPO = Path(__file__).resolve().parent.parent


def write(tmp_path: Path, body: str, models: str | None = None) -> Path:
    (tmp_path / "models.yaml").write_text(models or (REPO / "sweeps" / "models.yaml").read_text())
    p = tmp_path / "s.yaml"
    p.write_text(body)
    return p


HEAD = """name: t
platform: cpu
defaults: {prefill_block_size: 32, decode_block_size: 32}
"""


def sweep(tmp_path: Path, body: str, head: str = HEAD) -> LoadedSweep:
    """The loaded sweep of ``head + body``, written by :func:`write` as ``s.yaml``."""
    return load_sweep(write(tmp_path, head + body))


def bad(tmp_path: Path, body: str, capsys, models: str | None = None) -> str:
    """``pdsweep validate`` on ``body``: exit 2, no traceback; returns stderr."""
    assert main(["validate", str(write(tmp_path, body, models))]) == 2
    out = capsys.readouterr()
    assert "Traceback" not in out.err and out.err.startswith("error: ")
    return out.err


def good(tmp_path: Path, body: str, capsys, models: str | None = None) -> str:
    assert main(["validate", str(write(tmp_path, body, models))]) == 0, capsys.readouterr().err
    return capsys.readouterr().out


SMALL = "name: x\nplatform: cpu\nmatrix: {model: [tiny-llama], tp: [p1d1], block_size: [32]}\n"
