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
pytestmark = pytest.mark.skipif(not PY312.exists(), reason=f"no python 3.12 at {PY312}")

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


@pytest.fixture(scope="module")
def venv(tmp_path_factory) -> Path:
    """A bare python 3.12 venv (no pip, no system site-packages), made once for the module: the
    tests below run their interpreter and install nothing into it."""
    venv = tmp_path_factory.mktemp("py312") / "venv312"
    subprocess.run([str(PY312), "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    return venv


def device_check(env: dict[str, str], timeout: int = 60) -> subprocess.CompletedProcess[str]:
    """scripts/device-check.sh --device cpu under ``env``."""
    cmd = ["bash", str(REPO / "scripts" / "device-check.sh"), "--device", "cpu"]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)


def test_device_check_gpu_facts_under_python312_without_pydantic(tmp_path, venv):
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


def test_device_check_refuses_a_wheel_for_another_python(tmp_path, venv):
    """device-check.sh installs the trimmed nixl_cu13 wheel whose cpXY tag is the interpreter's;
    a cp311 wheel next to python 3.12 is refused by name (it would not install)."""
    wheels = tmp_path / "device"
    wheels.mkdir()
    (wheels / "nixl_cu13-1.5.1-cp311-cp311-manylinux_2_28_x86_64.whl").write_bytes(b"")
    env = {**os.environ, "PYTHON": str(venv / "bin" / "python"), "NIXL_WHEEL_DIR": str(wheels)}
    env.pop("NIXL_WHEEL", None)
    r = device_check(env)
    assert r.returncode == 2
    (line,) = r.stderr.splitlines()  # one line naming every missing module
    assert line.startswith(
        f"device-check: FAILED: missing module(s) nixl_cu13 numpy yaml for {env['PYTHON']} (cp312, torch CUDA 13)"
    )
    assert "found: nixl_cu13-1.5.1-cp311-cp311-manylinux_2_28_x86_64.whl" in line and "scripts/device-wheels.sh" in line


def test_a_cuda12_torch_gets_nixl_cu12(tmp_path, venv):
    """torch.version.cuda 12.x (a stand-in torch module): the check wants nixl_cu12, and names it missing."""
    (tmp_path / "fake" / "torch").mkdir(parents=True)
    (tmp_path / "fake" / "torch" / "__init__.py").write_text("class version:\n    cuda = '12.8'\n")
    (tmp_path / "wheels").mkdir()
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "PYTHON": str(venv / "bin" / "python")}
    env |= {"PYTHONPATH": str(tmp_path / "fake"), "NIXL_WHEEL_DIR": str(tmp_path / "wheels")}
    r = device_check(env)
    assert r.returncode == 2
    assert f"missing module(s) nixl_cu12 numpy yaml for {env['PYTHON']} (cp312, torch CUDA 12)" in r.stderr


WHEELS = REPO / "build" / "device"
FETCH = "bash scripts/device-wheels.sh (pip download of the cp312 wheels, nixl_cu13 trimmed; CI runs it)"


@pytest.mark.nixl
@pytest.mark.timeout(600)
def test_device_check_dry_run_under_python312_without_pydantic(tmp_path):
    """The exact script the device runs (scripts/device-check.sh -> device_check.py), on a bare
    python 3.12 venv (no numpy, PyYAML or pydantic), installing the carried cp312 wheels itself
    (nixl_cu13 trimmed, numpy, PyYAML from build/device): Kimi and GLM geometry at p2d1/p4d1/p4d2 byte-verified
    over real NIXL/UCX, the busy GPU left out, the unfixed plan refused."""
    if not all(list(WHEELS.glob(f"{d}-*-cp312-cp312-*.whl")) for d in ("nixl_cu13", "numpy", "pyyaml")):
        pytest.skip(f"the cp312 wheels are not in {WHEELS}: {FETCH}")
    venv = tmp_path / "venv312"  # bare: pip alone (the device adds torch, which brings neither numpy nor PyYAML)
    subprocess.run([str(PY312), "-m", "venv", str(venv)], check=True, timeout=180)
    py = str(venv / "bin" / "python")
    env = {
        "PATH": "/usr/bin:/bin",
        "HOME": str(tmp_path),
        "PYTHON": py,
        "OUT": str(tmp_path / "out"),
        "NIXL_WHEEL_DIR": str(WHEELS),
        "CHECK_TIMEOUT_S": "500",
    }
    r = device_check(env, timeout=560)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    # installed from the carried wheels, nothing from a registry
    assert r.stdout.startswith(f"device-check: nixl_cu13 numpy yaml from {WHEELS}/nixl_cu13-1.5.1-cp312-cp312-")
    d = json.loads((tmp_path / "out" / "device-check.json").read_text())
    assert d["pydantic_imported"] is False and d["ok"] is True
    found = subprocess.run(
        [py, "-c", "import importlib.util as u; print(u.find_spec('pydantic'))"], capture_output=True
    )
    assert found.stdout.strip() == b"None"
    for model, min_bytes in (("kimi-linear", 80_000_000), ("glm-5.3-flash-4l", 12_000_000)):
        for pair in ("p2d1", "p4d1", "p4d2"):
            b = d["bench"][f"{model} {pair}"]
            assert b["rc"] == 0 and b["verified_bytes"] > min_bytes and b["gbps"] > 0, b
    assert d["bench"]["kimi-linear p2d1-unfixed"]["refused"] is True
    assert d["busy_gpu"]["during"] == [1]
