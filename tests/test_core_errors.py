"""pdsweep.core.errors.run_main: ``history show | head`` (a closed stdout) is no failure, another
broken pipe still is (bad input of issue 37); an internal error is exit 3 with its traceback (issue 15)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from pdsweep.cli import main
from pdsweep.cli import main as cli_main
from pdsweep.core.errors import run_main

REPO = Path(__file__).resolve().parents[1]


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


REPO = Path(__file__).resolve().parent.parent


def test_internal_error_is_exit_3_with_a_traceback(monkeypatch, capsys) -> None:
    import pdsweep.commands.validate

    def boom(*a, **k):
        raise RuntimeError("a bug")

    monkeypatch.setattr(pdsweep.commands.validate, "expand", boom)  # where validate looks it up
    assert main(["validate", str(REPO / "sweeps" / "cpu-smoke.yaml")]) == 3
    err = capsys.readouterr().err
    assert "Traceback" in err and "RuntimeError: a bug" in err and "internal error in pdsweep (exit 3)" in err


INTERRUPTED_IN_EXEC = """
import sys
from pdsweep.core.errors import run_main


def main():
    # Ctrl-C while a module imports under httpx.Client() (pdsweep's readiness wait): the
    # handler's KeyboardInterrupt leaves the source text dataclasses exec's for h11's events
    exec("raise KeyboardInterrupt")


sys.exit(run_main(main))
"""


def test_an_interrupt_caught_after_exec_still_exits_130(tmp_path: Path) -> None:
    """CPython 3.10-3.13 mark a KeyboardInterrupt that left exec'd source text as unhandled
    even when caught, and ``python -m`` then kills itself by SIGINT at exit: -2, no traceback,
    what CI saw once from ``python -m pdsweep run`` (pdsweep.core.errors.ignore_stop_signals)."""
    (tmp_path / "interrupted_in_exec.py").write_text(INTERRUPTED_IN_EXEC)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(REPO)])}
    r = subprocess.run(
        [sys.executable, "-m", "interrupted_in_exec"], env=env, capture_output=True, text=True, timeout=120
    )
    assert (r.returncode, r.stderr.strip()) == (130, "interrupted")
