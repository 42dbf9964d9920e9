"""Bad input of issue 37: every error of a sweep at once, max_model_len above a tiny model's,
``plan --nodes 0``, and ``history show | head`` (a closed stdout is no failure)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from pdsweep.cli import main as cli_main
from pdsweep.core.errors import UserError, run_main
from pdsweep.spec.sweep import load_sweep

MODELS = Path(__file__).resolve().parents[1] / "sweeps" / "models.yaml"
REPO = Path(__file__).resolve().parents[1]


def write(tmp_path: Path, body: str) -> Path:
    path = tmp_path / "s.yaml"
    path.write_text(f"name: s\nplatform: cpu\nmodels_file: {MODELS}\n{body}")
    return path


def test_max_model_len_above_a_tiny_model_is_refused(tmp_path: Path) -> None:
    path = write(tmp_path, "defaults: {max_model_len: 999999999}\nmatrix: {model: [tiny-llama], tp: [p1d1]}\n")
    with pytest.raises(UserError) as e:
        load_sweep(path)
    assert f"{path}:4: defaults.max_model_len: 999999999 is above model 'tiny-llama''s 512 tokens" in str(e.value)
    assert "allowed: 1..512" in str(e.value)
    ok = write(tmp_path, "defaults: {max_model_len: 512}\nmatrix: {model: [tiny-llama], tp: [p1d1]}\n")
    assert load_sweep(ok).sweep.defaults.max_model_len == 512


def test_every_error_of_a_file_at_once(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        "defaults: {max_model_len: 4096}\n"
        "serve_args:\n  base: []\n  x: {both: [], reference: nope}\n"
        "matrix: {model: [tiny-llama, no-such-model], tp: [p1d1], env: [missing]}\n",
    )
    with pytest.raises(UserError) as e:
        load_sweep(path)
    lines = str(e.value).splitlines()
    assert any("unknown model 'no-such-model'" in x for x in lines)
    assert any("unknown env 'missing'" in x for x in lines)
    assert any("serve_args.x.reference: unknown serve_args 'nope'" in x for x in lines)
    assert any("defaults.max_model_len: 4096 is above model 'tiny-llama''s 512" in x for x in lines)


def test_plan_nodes_zero_names_nodes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    sweep = str(REPO / "sweeps" / "cpu-smoke.yaml")
    assert cli_main(["plan", sweep, "--nodes", "0", "--gpus-per-node", "8"]) == 2
    err = capsys.readouterr().err
    assert "--nodes 0: allowed 1.." in err and "give --gpus-per-node" not in err
    assert cli_main(["plan", sweep, "--nodes", "2"]) == 2
    assert "--nodes 2: give --gpus-per-node G as well" in capsys.readouterr().err


CLOSED_STDOUT = """
import os, sys
r, w = os.pipe()
os.close(r)          # the reader (head) has gone
os.dup2(w, 1)
from pdsweep.cli import main
code = main(sys.argv[1:])
os.write(2, f"exit={code}".encode())
"""


def test_history_show_into_a_closed_pipe_exits_0(runs: dict[str, Path], tmp_path: Path) -> None:
    db = tmp_path / "h.sqlite"
    for name in ("mixed", "all-pass"):
        assert cli_main(["history", "add", str(runs[name]), "--db", str(db)]) == 0
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    r = subprocess.run(
        [sys.executable, "-c", CLOSED_STDOUT, "history", "show", "--db", str(db)],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert r.stderr.endswith("exit=0"), r.stderr
    assert "Traceback" not in r.stderr


def test_another_broken_pipe_is_still_a_failure(capsys: pytest.CaptureFixture[str]) -> None:
    def main() -> int:
        raise BrokenPipeError(32, "a child's stdin")

    assert run_main(main) == 3  # stdout is fine: not an early reader, a bug to report
    assert "BrokenPipeError" in capsys.readouterr().err
