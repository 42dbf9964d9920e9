"""pdsweep.run.progress: a running cell whose phase printed nothing for HEARTBEAT_S gets a
``still in <phase>`` line (quiet mode too, as on CI), and a finished cell gets none."""

from __future__ import annotations

import time

from pdsweep.run import progress


def test_a_silent_phase_gets_a_line(monkeypatch, capsys):
    monkeypatch.setattr(progress, "HEARTBEAT_S", 0.1)
    p = progress.Progress(2, quiet=True)
    p.phase("cell-a", "prepare")
    p.phase("cell-a", "eval")
    p.phase("cell-b", "prepare")
    p.done("cell-b", "ok", None)
    time.sleep(0.6)
    p.close()
    err = capsys.readouterr().err
    assert "cell-a: still in eval" in err
    assert "cell-b: still in" not in err  # done: silent


def test_an_expected_failure_says_so(capsys):
    p = progress.Progress(3, quiet=True)
    p.done("drill", "failed", "prefill-0 (pid 7) killed by signal 9", expect_fail=True)
    p.done("unfixed", "ok", None, expect_fail=True)
    p.done("base", "failed", "decode-0 (exited with code 1): AssertionError")
    p.close()
    lines = capsys.readouterr().err.splitlines()
    assert lines[0].startswith("[1/3] drill: failed (expect: fail) after") and lines[0].endswith("killed by signal 9")
    assert lines[1].startswith("[2/3] unfixed: ok (expect: fail) after")
    assert lines[2].startswith("[3/3] base: failed after")


def test_cells_started_together_get_their_own_start_numbers(capsys):
    """A build pair starts both builds' cells before either ends; a new user's make sweep printed
    ``[1/29] ...fixed: start`` and ``[1/29] ...unfixed: start`` (the start counted finished cells)."""
    p = progress.Progress(3, quiet=True)
    p.phase("pair.fixed", "start")
    p.phase("pair.unfixed", "start")
    p.done("pair.fixed", "ok", None)
    p.phase("next", "start")
    p.close()
    lines = capsys.readouterr().err.splitlines()
    assert [ln.split(" after")[0] for ln in lines] == [
        "[1/3] pair.fixed: start",
        "[2/3] pair.unfixed: start",
        "[1/3] pair.fixed: ok",
        "[3/3] next: start",
    ]
