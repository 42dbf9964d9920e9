"""Readiness is detected within 0.5 s of /health first answering 200 (target).

A fake `vllm serve` (tests/fake_vllm.py) answers 503 until a file appears; the bench
creates the file and measures until ``deploy.wait_healthy`` returns."""

import sys
import threading
import time
from pathlib import Path

from pdsweep.deploy.deployment import wait_healthy
from pdsweep.deploy.launchers import LocalLauncher, port_free
from pdsweep.deploy.launchers.base import LaunchRequest

FAKE = Path(__file__).resolve().parent.parent / "tests" / "fake_vllm.py"


def test_readiness_detection_latency(benchmark, tmp_path):
    launcher = LocalLauncher()
    port = next(p for p in range(33500, 33600) if port_free(p))
    gate = tmp_path / "ready"
    h = launcher.start(
        LaunchRequest(
            "single-0",
            [sys.executable, str(FAKE), "serve", "m", "--port", str(port)],
            {"FAKE_STARTUP_S": "0", "FAKE_READY_FILE": str(gate)},
            port,
            tmp_path / "fake.log",
        )
    )
    try:
        time.sleep(3)  # let the fake import and listen (503 until the file exists)

        def once():
            gate.unlink(missing_ok=True)
            time.sleep(0.3)
            t = {}
            timer = threading.Timer(0.2, lambda: (gate.touch(), t.setdefault("ready", time.monotonic())))
            timer.start()
            wait_healthy([h], timeout_s=30)
            timer.join()
            return time.monotonic() - t["ready"]

        lat = benchmark.pedantic(once, rounds=5, iterations=1)
        benchmark.extra_info["detection_latency_s"] = lat
        assert lat < 0.5
    finally:
        launcher.stop(h)
