"""Processes pdsweep starts stay in pdsweep's session, each leading a process group of its
own (pdsweep.deploy.launchers.base.own_group): one scheduler autogroup for the sweep, the
P TP 2 -> D TP 1 stall's fix, and teardown that signals exactly the group it started."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from pdsweep.deploy.launchers.base import LaunchRequest
from pdsweep.deploy.launchers.local import LocalLauncher


def test_an_instance_leads_its_own_group_in_pdsweeps_session(tmp_path: Path) -> None:
    launcher = LocalLauncher()
    h = launcher.start(
        LaunchRequest("decode-0", [sys.executable, "-c", "import time; time.sleep(60)"], {}, 1, tmp_path / "d.log")
    )
    try:
        assert os.getpgid(h.pid) == h.pid != os.getpgid(0)  # its own group: teardown signals only it
        assert os.getsid(h.pid) == os.getsid(0)  # our session: one autogroup, not one per instance
        if Path("/proc/self/autogroup").exists():  # CONFIG_SCHED_AUTOGROUP kernels
            assert Path(f"/proc/{h.pid}/autogroup").read_text() == Path("/proc/self/autogroup").read_text()
    finally:
        launcher.stop(h, grace_s=5)
    assert h.proc is not None and h.proc.poll() is not None
