"""The install route by driver (issue 35): scripts/install-env.sh in its dry run
(``PDSWEEP_INSTALL_DRY_RUN=1``) on fake nodes picks the CUDA 12 route (constraints/gpu-cu12.txt,
nixl-cu12) on an R570 driver, the CUDA 13 route (constraints/gpu.txt) on >= 580, and refuses a
driver below CUDA 12's minimum; its thresholds are preflight's MIN_DRIVER."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest
from _fakes import fake_nvidia_smi

from pdsweep.run.preflight import MIN_DRIVER

ROOT = Path(__file__).resolve().parents[1]


def dry_install(tmp_path: Path, driver: str) -> subprocess.CompletedProcess:
    bin_dir = fake_nvidia_smi(tmp_path / "bin", driver=driver)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "PDSWEEP_INSTALL_DRY_RUN": "1"}
    env.pop("PDSWEEP_TARGET", None)
    env.pop("PDSWEEP_CUDA_ROUTE", None)
    return subprocess.run(
        ["bash", "scripts/install-env.sh", str(tmp_path / "venv")], cwd=ROOT, env=env, capture_output=True, text=True
    )


def pins(name: str) -> dict[str, str]:
    return dict(re.findall(r"^([a-z0-9-]+)==(\S+)", (ROOT / "constraints" / name).read_text(), re.M))


@pytest.mark.parametrize(
    ("driver", "route"), [("570.124.06", "cu12"), ("525.60.13", "cu12"), ("580.65.06", "cu13"), ("590.1", "cu13")]
)
def test_route_by_driver(tmp_path, driver, route):
    r = dry_install(tmp_path, driver)
    assert r.returncode == 0, r.stderr
    steps = [x[2:] for x in r.stdout.splitlines() if x.startswith("+ ")]
    assert f'the stamp would record "route": "{route}"' in r.stdout
    assert not (tmp_path / "venv").exists()  # a dry run changes nothing
    if route == "cu12":
        assert f"CUDA 12 route (driver {driver} < 580" in r.stdout
        assert any("-c constraints/gpu-cu12.txt" in s and f"vllm=={pins('gpu-cu12.txt')['vllm']}" in s for s in steps)
        assert any("nixl-cu12==1.5.1" in s for s in steps) and not any("nixl-cu13" in s for s in steps)
        assert not any("constraints/gpu.txt" in s for s in steps)
    else:
        assert any("-c constraints/gpu.txt" in s and ".[dev,gpu]" in s for s in steps)
        assert any("nixl-cu13==1.5.1" in s for s in steps) and not any("nixl-cu12" in s for s in steps)


def test_driver_below_cuda12_is_refused(tmp_path):
    r = dry_install(tmp_path, "525.60.12")
    assert r.returncode == 2 and "older than 525.60.13, the minimum of CUDA 12" in r.stderr


def test_routes_match_preflight_and_pypi_evidence():
    script = (ROOT / "scripts" / "install-env.sh").read_text()
    assert MIN_DRIVER[13] == (580,) and "$1 >= 580" in script
    assert MIN_DRIVER[12] == (525, 60, 13) and "$1 == 525 && ($2 > 60 || ($2 == 60 && $3 >= 13))" in script
    cu12 = pins("gpu-cu12.txt")
    # PyPI metadata recorded in the file: vllm 0.19.1 pins torch 2.10.0, the last CUDA 12 (12.8) PyPI torch
    assert (cu12["vllm"], cu12["torch"]) == ("0.19.1", "2.10.0")
    assert cu12["nixl-cu12"] == pins("gpu.txt")["nixl-cu13"]  # one NIXL version on both routes
    assert "nvidia-cuda-runtime-cu12==12.8.90" in (ROOT / "constraints" / "gpu-cu12.txt").read_text()
