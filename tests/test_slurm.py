"""The slurm launcher against a real Slurm cluster (tests/_slurm.py: Debian's slurmctld,
two slurmd as nodes pdsweep-n1/-n2 and munge, started here on private ports, stopped by
PID), with the fake ``vllm serve`` of tests/fake_vllm.py: every instance a job step of a
test allocation of both nodes, prefill on one node and decode on the other.
Skipped where Slurm is not installed unless ``PDSWEEP_REQUIRE_SLURM=1`` (``.ci/run`` sets it
after installing the packages): then a missing Slurm fails."""

from __future__ import annotations

import os
import signal
import socket
import sys
import time
from pathlib import Path

import pytest
from _slurm import (
    NODE_ADDR,
    NODELIST,
    NODES,
    slurm_cluster,  # noqa: F401  (fixture)
)
from test_run_fake import make_sweep, ours, start_run, status, tok  # noqa: F401  (tok: fixture)

from pdsweep.cli import main
from pdsweep.core.errors import UserError
from pdsweep.results import layout
from pdsweep.run.context import RunOptions
from pdsweep.run.sweep import run_sweep

PD = "fake-gqa.p1d1.b16-16.fixed"
REPO = Path(__file__).resolve().parent.parent
# port bases stay below the ephemeral range (32768+), where srun listens for step I/O


@pytest.fixture(scope="module")
def cluster(slurm_cluster):  # noqa: F811
    return slurm_cluster


@pytest.fixture(scope="module")
def job(cluster):
    """One allocation of the whole node for the module; cancelled at the end (ours)."""
    j = cluster.salloc()
    yield j
    cluster.run("scancel", j, check=False)


@pytest.fixture
def in_alloc(cluster, job, monkeypatch):
    """This process as if inside ``salloc``: SLURM_CONF, SLURM_JOB_ID, SLURM_JOB_NODELIST."""
    monkeypatch.setenv("SLURM_CONF", cluster.env["SLURM_CONF"])
    monkeypatch.setenv("SLURM_JOB_ID", job)
    monkeypatch.setenv("SLURM_JOB_NODELIST", NODELIST)
    monkeypatch.setenv("PDSWEEP_REAL_PYTHON", sys.executable)
    yield
    assert cluster.steps(job) == [], "a step of ours is left in squeue"
    assert job in cluster.run("squeue", "-h", "-o", "%i").stdout.split(), "the allocation itself was cancelled"


def test_srun_hostname(cluster):
    assert cluster.run("srun", "-N1", "-n1", "hostname").stdout.strip() == socket.gethostname()
    out = cluster.run("srun", "-N2", "-n2", "printenv", "SLURMD_NODENAME")
    assert sorted(out.stdout.split()) == list(NODES)


def test_sweep_through_slurm_steps(tmp_path, tok, in_alloc, cluster, job):  # noqa: F811
    sweep = make_sweep(tmp_path, tok, matrix="  model: [fake-gqa]\n  tp: [p1d1]\n", port_base=25000)
    run = run_sweep(sweep, RunOptions(out=tmp_path / "run", quiet=True, launcher="slurm"))
    assert status(run, PD)["status"] == "ok", status(run, PD)
    cell = layout.read_json(run / PD / "cell.json")
    pre, dec = cell["instances"]
    assert (pre["node"], dec["node"]) == NODES  # P on one node, D on the other
    assert (pre["host"], dec["host"]) == (NODE_ADDR, NODE_ADDR)  # each node's NodeAddr
    assert pre["env"]["VLLM_NIXL_SIDE_CHANNEL_HOST"] == NODE_ADDR
    assert pre["argv"][pre["argv"].index("--host") + 1] == NODE_ADDR
    assert (run / PD / "logs" / "decode-0.log").read_text().startswith("fake vllm serve fake-gqa")
    assert main(["gate", str(run)]) == 0
    assert not ours(tmp_path)


def test_step_dies_at_start(tmp_path, tok, in_alloc):  # noqa: F811
    sweep = make_sweep(
        tmp_path,
        tok,
        env="  base: {FAKE_EXIT_AT_STARTUP: '3'}",
        port_base=25400,
        matrix="  model: [fake-gqa]\n  tp: [p1d1]\n",
        extra="  reference: false\n",
    )
    t0 = time.monotonic()
    run = run_sweep(sweep, RunOptions(out=tmp_path / "run", quiet=True, launcher="slurm", skip_eval=True))
    st = status(run, PD)
    assert time.monotonic() - t0 < 25
    assert st["status"] == "failed" and st["phase"] == "start"
    assert "exited with code 3 during startup" in st["reason"]
    assert any("fake startup failure" in line for line in st["log_tail"])  # the step's own output
    assert not ours(tmp_path)


def test_node_never_answers(tmp_path, tok, in_alloc):  # noqa: F811
    """The step runs but nothing answers on the node's address: a timeout naming node and step."""
    sweep = make_sweep(
        tmp_path,
        tok,
        env="  base: {FAKE_STARTUP_S: '600'}",
        port_base=25800,
        matrix="  model: [fake-gqa]\n  tp: [p1d1]\n",
        extra="  reference: false\n",
    )
    text = sweep.read_text().replace("startup_timeout_s: 30", "startup_timeout_s: 4")
    sweep.write_text(text)
    run = run_sweep(sweep, RunOptions(out=tmp_path / "run", quiet=True, launcher="slurm", skip_eval=True))
    st = status(run, PD)
    assert st["status"] == "failed" and st["phase"] == "start"
    assert f"prefill-0 at {NODES[0]} {NODE_ADDR}:25808 (step {os.environ['SLURM_JOB_ID']}." in st["reason"]
    assert "not healthy after 4 s" in st["reason"]
    assert not ours(tmp_path)


def test_sigint_cancels_our_steps_not_the_allocation(tmp_path, tok, in_alloc, cluster, job):  # noqa: F811
    sweep = make_sweep(
        tmp_path,
        tok,
        env="  base: {FAKE_STARTUP_S: '600'}",
        port_base=26200,
        matrix="  model: [fake-gqa]\n  tp: [p1d1]\n",
        extra="  reference: false\n",
    )
    proc = start_run(sweep, tmp_path / "run", "--launcher", "slurm")
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and len(cluster.steps(job)) < 2:
        time.sleep(0.2)
    steps = cluster.steps(job)
    assert len(steps) == 2 and all(".prefill-0" in s or ".decode-0" in s for s in steps), steps
    proc.send_signal(signal.SIGINT)
    out = proc.communicate(timeout=60)[0].decode()
    assert proc.returncode == 130, out
    time.sleep(0.5)
    assert cluster.steps(job) == []
    assert not ours(tmp_path)


def test_cell_larger_than_allocation(tmp_path, tok, in_alloc):  # noqa: F811
    sweep = make_sweep(
        tmp_path,
        tok,
        matrix="  model: [fake-gqa]\n  tp: [p1d1, p2d2]\n  num_decode: [2]\n",
        port_base=26600,
        extra="  reference: false\n",
    )
    sweep.write_text(sweep.read_text().replace("platform: cpu", "platform: cuda"))
    models = tmp_path / "models.yaml"
    models.write_text(models.read_text().replace("platforms: {cpu: {}}", "platforms: {cuda: {}}"))
    run = run_sweep(
        sweep,
        RunOptions(out=tmp_path / "run", quiet=True, launcher="slurm", skip_eval=True, gpus_per_node=2, cells="*.p*"),
    )
    idx = layout.read_json(run / "run.json")
    rej = {r["cell_id"]: r["reason"] for r in idx["rejected"]}
    assert rej["fake-gqa.p2d2.b16-16.fixed.1x2"] == "needs 6 GPUs on 3 nodes, allocation has 2 nodes x 2 GPUs"
    pd = "fake-gqa.p1d1.b16-16.fixed.1x2"
    cell = layout.read_json(run / pd / "cell.json")
    n1, n2 = NODES
    assert [(i["node"], i["env"]["CUDA_VISIBLE_DEVICES"]) for i in cell["instances"]] == [
        (n1, "0"),
        (n1, "1"),
        (n2, "0"),
    ]
    logs = run / pd / "logs"  # what each step's process saw (srun runs it under `env CUDA_VISIBLE_DEVICES=`)
    assert [
        f"cuda={c}" in (logs / f"{n}.log").read_text() for n, c in (("prefill-0", 0), ("decode-0", 1), ("decode-1", 0))
    ] == [True] * 3
    assert status(run, pd)["status"] == "ok", status(run, pd)
    # a valid cell the allocation cannot hold is NOT-RUNNABLE (listed, not a failure) by default, and
    # fails the gate with --require-all-cells (cluster nightlies; issue 22 item 5)
    assert main(["gate", str(run)]) == 0
    assert main(["gate", str(run), "--require-all-cells"]) == 1


def test_slurm_launcher_outside_an_allocation(monkeypatch):
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    from pdsweep.deploy.launchers import make_launcher

    with pytest.raises(UserError, match="inside a Slurm allocation"):
        make_launcher("slurm")
    with pytest.raises(UserError, match="allowed: local, slurm"):
        make_launcher("kubernetes")


def test_plan_inside_allocation_places_on_its_node(tmp_path, tok, in_alloc, capsys):  # noqa: F811
    sweep = make_sweep(tmp_path, tok, matrix="  model: [fake-gqa]\n  tp: [p1d1]\n", port_base=27000)
    assert main(["plan", str(sweep), "--launcher", "slurm", "--format", "json"]) == 0
    import json

    d = json.loads(capsys.readouterr().out)
    assert d["nodes"] == list(NODES)
    pd = {c["id"]: c for c in d["cells"]}[PD]
    assert [(i["node"], i["host"]) for i in pd["instances"]] == [(n, NODE_ADDR) for n in NODES]


def test_run_outside_an_allocation_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    out = tmp_path / "run"
    assert main(["run", str(REPO / "sweeps" / "cpu-smoke.yaml"), "--launcher", "slurm", "--out", str(out)]) == 2
    assert not out.exists()
