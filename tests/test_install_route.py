"""The install route by driver and the python check (issues 35, 56): scripts/install-env.sh in its
dry run (``PDSWEEP_INSTALL_DRY_RUN=1``) on fake nodes takes the CUDA 13 route (constraints/gpu.txt)
on a driver >= 580 and refuses an R570/R535 node at once (no CUDA 12 vLLM on PyPI carries PR #49297),
naming the driver, the minimum (preflight's MIN_DRIVER[13]) and the remedies; a Python < 3.11 is
refused before anything is made, naming the interpreter and ``PYTHON=``."""

from __future__ import annotations

import os
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


def steps_of(out: str) -> list[str]:
    return [x[2:] for x in out.splitlines() if x.startswith("+ ")]


@pytest.mark.parametrize("driver", ["580.65.06", "590.1"])
def test_cuda13_route(tmp_path, driver):
    r = dry_install(tmp_path, driver)
    assert r.returncode == 0, r.stderr
    steps = steps_of(r.stdout)
    assert 'the stamp would record "route": "cu13"' in r.stdout
    assert not (tmp_path / "venv").exists()  # a dry run changes nothing
    assert any("-c constraints/gpu.txt" in s and ".[dev,gpu]" in s for s in steps)
    assert any("nixl-cu13==1.5.1" in s for s in steps) and not any("nixl-cu12" in s for s in steps)


@pytest.mark.parametrize("driver", ["570.124.06", "535.183.01", "525.60.12"])
def test_driver_below_580_is_refused_at_once(tmp_path, driver):
    """No vLLM on PyPI carries PR #49297 for CUDA 12 (0.19.1, the last, predates it): an R570 node is
    refused before a venv is made, naming its driver, the minimum and the remedies."""
    r = dry_install(tmp_path, driver)
    assert r.returncode == 2, r.stdout + r.stderr
    assert f"NVIDIA driver '{driver}' is older than 580, the minimum of CUDA 13" in r.stderr
    assert "Remedy: a driver >= 580 (R580)" in r.stderr and "PDSWEEP_CUDA_ROUTE=cu13" in r.stderr
    assert steps_of(r.stdout) == []  # nothing would be created or installed


def test_forward_compat_override_takes_the_cuda13_route(tmp_path):
    bin_dir = fake_nvidia_smi(tmp_path / "bin", driver="570.124.06")
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "PDSWEEP_INSTALL_DRY_RUN": "1"}
    env.pop("PDSWEEP_TARGET", None)
    env["PDSWEEP_CUDA_ROUTE"] = "cu13"
    r = subprocess.run(
        ["bash", "scripts/install-env.sh", str(tmp_path / "venv")], cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert r.returncode == 0, r.stderr
    assert "CUDA 13 route (driver 570.124.06 >= 580, PDSWEEP_CUDA_ROUTE=cu13)" in r.stdout


def fake_python(tmp_path: Path, version: str) -> Path:
    """A stand-in interpreter answering install-env.sh's two version questions as Python ``version`` would."""
    exe = tmp_path / f"python{version}"
    ok = tuple(int(x) for x in version.split(".")[:2]) >= (3, 11)
    exe.write_text(
        "#!/bin/sh\n"
        f'case "$2" in *print*) echo "{version} {exe}" ;; *sys.exit*) exit {0 if ok else 1} ;; *) exit 0 ;; esac\n'
    )
    exe.chmod(0o755)
    return exe


@pytest.mark.parametrize("target", ["gpu", "cpu"])
def test_python_310_is_refused_before_anything_installs(tmp_path, target):
    py = fake_python(tmp_path, "3.10.12")
    env = {
        **os.environ,
        "PYTHON": str(py),
        "PDSWEEP_INSTALL_DRY_RUN": "1",
        "PDSWEEP_TARGET": target,
        "PDSWEEP_DRIVER": "580.65.06",
    }
    r = subprocess.run(
        ["bash", "scripts/install-env.sh", str(tmp_path / "venv")], cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert r.returncode == 2, r.stdout + r.stderr
    assert r.stderr.strip() == (
        f"install-env: Python 3.10.12 ({py}) is too old: vLLM needs Python >= 3.11; "
        "pick another interpreter: make install PYTHON=python3.12 (or python3.11)"
    )
    assert r.stdout == ""  # refused before the venv, the pip upgrade or the route


def test_python_312_passes_the_check(tmp_path):
    py = fake_python(tmp_path, "3.12.3")
    env = {**os.environ, "PYTHON": str(py), "PDSWEEP_INSTALL_DRY_RUN": "1", "PDSWEEP_TARGET": "cpu"}
    r = subprocess.run(
        ["bash", "scripts/install-env.sh", str(tmp_path / "venv")], cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert r.returncode == 0, r.stderr
    assert steps_of(r.stdout)[0] == f"{py} -m venv {tmp_path / 'venv'}"


def test_make_passes_python_to_the_check(tmp_path):
    py = fake_python(tmp_path, "3.10.12")
    env = {**os.environ, "PDSWEEP_INSTALL_DRY_RUN": "1", "PDSWEEP_TARGET": "cpu"}
    r = subprocess.run(
        ["make", "--no-print-directory", "install", f"VENV={tmp_path / 'venv'}", f"PYTHON={py}"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
    )
    assert r.returncode != 0 and f"Python 3.10.12 ({py}) is too old" in r.stderr


def test_minimum_matches_preflight():
    script = (ROOT / "scripts" / "install-env.sh").read_text()
    assert MIN_DRIVER[13] == (580,) and "$1 >= 580" in script
    assert not (ROOT / "constraints" / "gpu-cu12.txt").exists()  # the CUDA 12 route is gone (no fix-bearing vLLM)
