"""pdsweep.run.drills: a kill drill fires while its phase's requests reach the target, not on a
fixed timer that can outlast the phase (a fast eval then had the kill land in the load phase)."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

from pdsweep.deploy.launchers import Handle
from pdsweep.run import drills
from pdsweep.run.drills import armed

POST = b'INFO:     127.0.0.1:1 - "POST /v1/completions HTTP/1.1" 200 OK\n'


def _dead_within(proc: subprocess.Popen, seconds: float) -> bool:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if proc.poll() is not None:
            return True
        time.sleep(0.05)
    return proc.poll() is not None


def test_the_kill_waits_for_the_phases_first_request_to_reach_the_target(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(drills, "AFTER_TRAFFIC_S", 0.2)
    log = tmp_path / "prefill-0.log"
    log.write_bytes(POST * 3)  # requests of an earlier phase do not count
    proc = subprocess.Popen(["sleep", "60"])
    try:
        h = Handle("prefill-0", proc.pid, 1, log, proc=proc)
        phases: list[str] = []
        hook = armed("kill-prefill-during-eval", [h], phases.append)
        hook("consistency")
        hook("eval")
        assert phases == ["consistency", "eval"]
        assert not _dead_within(proc, 1.5)  # the phase began, no request of it yet: not killed
        with open(log, "ab") as f:
            f.write(POST)
        assert _dead_within(proc, 3.0)  # its first request reached prefill-0: killed
        assert proc.returncode == -9
    finally:
        proc.kill()
        proc.wait()


def test_with_no_request_the_kill_still_lands_at_the_latest_bound(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(drills, "MAX_WAIT_S", 0.5)
    monkeypatch.setattr(drills, "AFTER_TRAFFIC_S", 0.0)
    proc = subprocess.Popen(["sleep", "60"])
    try:
        hook = armed(
            "kill-decode-during-load", [Handle("decode-0", proc.pid, 1, tmp_path / "none.log", proc=proc)], print
        )
        hook("bench")
        assert _dead_within(proc, 3.0)
    finally:
        proc.kill()
        proc.wait()
