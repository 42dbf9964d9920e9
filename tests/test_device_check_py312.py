"""scripts/device_check.py on the lent device's interpreter shape (issue 35): python 3.12 with no
pydantic (a throwaway venv of /root/.pyenv's 3.12, no system site-packages). The device check's
GPU facts (nvidia-smi rows, usable GPUs, a busy GPU left out) import and run there; a fake
nvidia-smi stands in for the GPUs. The bench part still needs pdsweep's catalogue (pydantic):
docs/gpu-preflight.md says what remains."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from _fakes import fake_nvidia_smi

REPO = Path(__file__).resolve().parents[1]
PY312 = Path(os.environ.get("PDSWEEP_PY312", "/root/.pyenv/versions/3.12.1/bin/python"))

PROBE = """
import importlib.util, json, sys
sys.path[:0] = [sys.argv[1], sys.argv[1] + "/scripts"]
import device_check
from pdsweep.plan.gpus import free_gpu_ids, inventory
facts = device_check.smi_facts()
print(json.dumps({
    "python": list(sys.version_info[:2]),
    "pydantic_installed": importlib.util.find_spec("pydantic") is not None,
    "pydantic_imported": "pydantic" in sys.modules,
    "yaml_imported": "yaml" in sys.modules,
    "gpus": [g["index"] for g in facts["gpus"]],
    "driver": facts["driver"],
    "apps": [a["pid"] for a in facts["compute_apps"]],
    "free": list(free_gpu_ids(inventory())),
}))
"""


@pytest.mark.skipif(not PY312.exists(), reason=f"no python 3.12 at {PY312}")
def test_device_check_gpu_facts_under_python312_without_pydantic(tmp_path):
    venv = tmp_path / "venv312"
    subprocess.run([str(PY312), "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    assert "include-system-site-packages = false" in (venv / "pyvenv.cfg").read_text()
    bin_dir = fake_nvidia_smi(
        tmp_path / "bin", 2, name="NVIDIA H200", total_mib=143771, busy={0: (4242, "python3", 256)}
    )
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "HOME": str(tmp_path)}
    r = subprocess.run(
        [str(venv / "bin" / "python"), "-c", PROBE, str(REPO)], capture_output=True, text=True, env=env, timeout=120
    )
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert d["python"] == [3, 12] and d["pydantic_installed"] is False and d["pydantic_imported"] is False
    assert d["gpus"] == [0, 1] and d["driver"] == "580.65.06" and d["apps"] == [4242]
    assert d["free"] == [1]  # the busy GPU 0 is left out, as detect_gpu_ids() does on the device


@pytest.mark.skipif(not PY312.exists(), reason=f"no python 3.12 at {PY312}")
def test_device_check_refuses_a_wheel_for_another_python(tmp_path):
    """device-check.sh installs the trimmed nixl_cu13 wheel whose cpXY tag is the interpreter's;
    a cp311 wheel next to python 3.12 is refused by name (it would not install)."""
    venv = tmp_path / "venv312"
    subprocess.run([str(PY312), "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    wheels = tmp_path / "device"
    wheels.mkdir()
    (wheels / "nixl_cu13-1.5.1-cp311-cp311-manylinux_2_28_x86_64.whl").write_bytes(b"")
    env = {**os.environ, "PYTHON": str(venv / "bin" / "python"), "NIXL_WHEEL_DIR": str(wheels)}
    env.pop("NIXL_WHEEL", None)
    r = subprocess.run(
        ["bash", str(REPO / "scripts" / "device-check.sh"), "--device", "cpu"],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert r.returncode == 2
    assert "no nixl_cu13 wheel for cp312" in r.stderr
    assert "found: nixl_cu13-1.5.1-cp311-cp311-manylinux_2_28_x86_64.whl" in r.stderr
