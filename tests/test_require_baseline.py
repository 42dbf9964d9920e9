"""scripts/require-baseline.py: `make sweep` stops (exit 2, a clear message) when the
unfixed baseline venv is missing and the sweep has unfixed cells; goes on otherwise."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from _fakerun import write_models

REPO = Path(__file__).resolve().parents[1]
FAKE_PY = REPO / "tests" / "fake_build" / "python"


def sweep(tmp_path: Path, builds: str) -> Path:
    tok = tmp_path / "tok"
    tok.mkdir(exist_ok=True)
    write_models(tmp_path, tok)
    p = tmp_path / "sweep.yaml"
    p.write_text(f"""name: rb
platform: cpu
builds:
  fixed: {{python: {FAKE_PY}}}
  unfixed: {{venv: {tmp_path / "no-such-venv"}}}
matrix:
  model: [fake-gqa]
  tp: [p1d1]
  block_size: [32]
  build: [{builds}]
eval:
  tasks: [pdsweep_arith]
""")
    return p


def run(p: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run(
        [sys.executable, str(REPO / "scripts" / "require-baseline.py"), str(p)], capture_output=True, text=True, env=env
    )


def test_stops_when_unfixed_cells_lack_their_baseline(tmp_path):
    r = run(sweep(tmp_path, "fixed, unfixed"))
    assert r.returncode == 2
    assert "make: STOP: the unfixed baseline could not be built for the installed vLLM" in r.stderr
    assert "has 1 cell(s) of build(s) unfixed" in r.stderr and "no-such-venv/bin/python" in r.stderr


def test_goes_on_without_unfixed_cells(tmp_path):
    r = run(sweep(tmp_path, "fixed"))
    assert r.returncode == 0, r.stderr
    assert "none of the 2 cells of" in r.stdout and "needs one: going on" in r.stdout
