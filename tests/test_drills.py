"""pdsweep.run.drills: a kill drill fires KILL_AFTER_S into its own phase, while the phase's client
is still starting, so the phase itself fails. A kill 8 s in raced a fast eval: the death
surfaced in the load phase and the drill's signature ("during eval") failed."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

from pdsweep.deploy.launchers import Handle
from pdsweep.run.drills import KILL_AFTER_S, armed


def _dead_within(proc: subprocess.Popen, seconds: float) -> bool:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if proc.poll() is not None:
            return True
        time.sleep(0.05)
    return proc.poll() is not None


def test_the_kill_lands_early_in_its_own_phase_only(tmp_path: Path) -> None:
    assert KILL_AFTER_S <= 2.0  # lm-eval and vllm bench serve take longer than this to send a request
    proc = subprocess.Popen(["sleep", "60"])
    try:
        phases: list[str] = []
        hook = armed(
            "kill-prefill-during-eval", [Handle("prefill-0", proc.pid, 1, tmp_path / "p.log", proc=proc)], phases.append
        )
        hook("consistency")
        assert not _dead_within(proc, KILL_AFTER_S + 0.5)  # another phase: nothing killed
        began = time.monotonic()
        hook("eval")
        assert phases == ["consistency", "eval"]
        assert _dead_within(proc, KILL_AFTER_S + 2.0) and proc.returncode == -9
        assert time.monotonic() - began >= KILL_AFTER_S - 0.05
    finally:
        proc.kill()
        proc.wait()
