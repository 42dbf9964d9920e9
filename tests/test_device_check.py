"""scripts/device-check.sh --device cpu (the dry run of the GPU check, as CI runs it): a
fake nvidia-smi lists the torch holder process on GPU 0, which detect_gpus must leave out;
`pdsweep bench transfer` with Kimi-Linear and GLM-5.3-Flash-4L geometry verifies p2d1, p4d1 and
p4d2 byte for byte over real NIXL/UCX, and the unfixed plan is refused. ~70 s here."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

pytestmark = [pytest.mark.nixl, pytest.mark.timeout(300)]


def test_device_check_cpu_dry_run(tmp_path):
    pytest.importorskip("nixl_cu13")
    env = {**os.environ, "PYTHON": sys.executable, "OUT": str(tmp_path), "CHECK_TIMEOUT_S": "280"}
    r = subprocess.run(
        ["bash", str(REPO / "scripts" / "device-check.sh"), "--device", "cpu"],
        capture_output=True,
        text=True,
        env=env,
        timeout=290,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    d = json.loads((tmp_path / "device-check.json").read_text())
    assert d["ok"] is True and all(d["checks"].values()) and len(d["checks"]) == 9
    assert d["kv_digest"]["equals_host_digest"] and d["kv_digest"]["64k"]["gbps"] > 0  # the torch KV digest step
    busy = d["busy_gpu"]
    assert busy["seen_on_gpu"] == 0 and busy["during"] == [1] and busy["detect_gpus_during"] == 1
    assert f"is in use by pid {busy['holder_pid']} python3" in busy["busy_text"]
    for model, min_bytes in (("kimi-linear", 80_000_000), ("glm-5.3-flash-4l", 12_000_000)):
        for pair in ("p2d1", "p4d1", "p4d2"):
            b = d["bench"][f"{model} {pair}"]
            assert b["rc"] == 0 and b["verified_bytes"] > min_bytes and b["gbps"] > 0, b
    assert d["bench"]["kimi-linear p2d1-unfixed"]["refused"] is True
    assert d["ucx_transports"] and "device-check: OK" in r.stdout


def test_device_check_fails_a_gpu_read_over_tcp_naming_the_cause() -> None:
    """The lent H200 READ VRAM over tcp/lo at 0.06-0.68 GB/s with every byte right (UCX turns
    cuda_ipc GET off without NVLink); the check must not call that ok."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("device_check", REPO / "scripts" / "device_check.py")
    assert spec and spec.loader
    dc = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(dc)
    assert dc.transport_verdict("cuda", "cuda_ipc/cuda") is None
    assert dc.transport_verdict("cpu", "cma/memory") is None
    why = dc.transport_verdict("cuda", "tcp/lo")
    assert (
        why
        and why.startswith("KV READ over UCX tcp/lo; expected cuda_ipc")
        and 'ucx: {UCX_CUDA_IPC_ENABLE_GET_ZCOPY: "y"}' in why  # the remedy, as the sweep spells it
        and "uct_cuda_ipc_iface_get_max_get_zcopy" in why  # the cause, in UCX
    )
    assert dc.transport_verdict("cuda", "cuda_ipc/cuda, tcp/lo") is not None  # any tcp lane fails
    assert dc.transport_verdict("cpu", None) == "KV READ over UCX unknown; expected cma"  # fail closed
    assert dc.GET_ZCOPY_ENV == {"UCX_CUDA_IPC_ENABLE_GET_ZCOPY": "y"}
