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
