"""Headless Chromium for page checks (dashboard, report): the rendered DOM and the browser's
log. ``.ci/run`` installs chromium and sets ``PDSWEEP_REQUIRE_CHROMIUM=1``: there a missing
browser fails the test instead of skipping it."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


def need_chromium() -> None:
    """Skip (or, where CI requires the browser, fail) when chromium is not installed."""
    if CHROMIUM is None:
        assert not os.environ.get("PDSWEEP_REQUIRE_CHROMIUM"), "chromium is required but not installed"
        pytest.skip("no chromium (apt-get install chromium)")


def render(page: Path, tmp: Path) -> tuple[str, str]:
    """(DOM after scripts ran, chromium's stderr log) of ``page``."""
    assert CHROMIUM is not None
    cmd = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
           "--disable-component-update", "--disable-sync", "--no-first-run", f"--user-data-dir={tmp / 'chrome'}",
           "--enable-logging=stderr", "--v=0", "--virtual-time-budget=2000", "--dump-dom", page.as_uri()]  # fmt: skip
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    return r.stdout, r.stderr


def console_errors(log: str) -> list[str]:
    """Lines of a chromium log that report a console message or an uncaught script error."""
    return [line for line in log.splitlines() if "CONSOLE" in line or "Uncaught" in line]
