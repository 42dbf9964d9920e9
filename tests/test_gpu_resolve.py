"""The GPU install set resolves as pip on the node would (issue 56): scripts/gpu_resolve.py takes the
pip steps scripts/install-env.sh runs on a driver >= 580 node (its dry run) and resolves them in full
against PyPI (``pip install --dry-run --report --ignore-installed``, no ``--no-deps``) for the node:
cp312, manylinux up to glibc 2.31, wheels only. Network: PyPI (marked ``pypi``; 1.5-2.5 min each)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = [pytest.mark.pypi, pytest.mark.timeout(600)]


def resolve(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "scripts/gpu_resolve.py", *args], cwd=ROOT, capture_output=True, text=True, timeout=590
    )


def test_shipped_cuda13_pins_resolve_in_full():
    r = resolve()
    assert r.returncode == 0, r.stdout + r.stderr
    line = r.stdout.strip()
    assert line.startswith("gpu-resolve: cu13 route (cp312 manylinux_2_31_x86_64): "), line
    assert "vllm==0.33.0 torch==2.14.0 nixl-cu13==1.5.1 flashinfer-python==0.7.2.post1" in line, line
    assert int(line.split("): ")[1].split()[0]) > 200  # the whole set, not the pins alone


def test_a_pin_whose_dependency_is_missing_is_named(tmp_path):
    """vllm 0.34.0 requires flashinfer-python==0.7.3, which PyPI never had."""
    bad = tmp_path / "gpu.txt"
    bad.write_text((ROOT / "constraints" / "gpu.txt").read_text().replace("vllm==0.33.0", "vllm==0.34.0"))
    r = resolve("--constraints", str(bad))
    assert r.returncode == 1, r.stdout + r.stderr
    assert r.stdout.strip() == (
        "gpu-resolve: cu13 route (cp312 manylinux_2_31_x86_64): UNRESOLVABLE: flashinfer-python==0.7.3 (from vllm): "
        "no wheel for the target on the index, nor a pure-python sdist"
    )


def test_a_driver_below_580_has_no_route_to_resolve():
    r = resolve("--driver", "570.124.06")
    assert r.returncode == 2 and "install-env.sh refused driver 570.124.06" in r.stdout
