"""The Slurm launcher warns when a step would share a core with another step of ours on
its node (issue 39): separate steps are separate scheduler groups (an autogroup or a cpu
cgroup each), the launch behind the P TP 2 -> D TP 1 stall (docs/slurm.md). No Slurm needed:
srun is replaced by a plain process."""

from __future__ import annotations

import logging
import subprocess
from pathlib import Path

import pytest

from pdsweep.deploy.launchers import slurm
from pdsweep.deploy.launchers.base import LaunchRequest


def test_bound_cores_reads_vllm_bind_lists():
    assert slurm.bound_cores({"VLLM_CPU_OMP_THREADS_BIND": "0|1"}) == {0, 1}
    assert slurm.bound_cores({"VLLM_CPU_OMP_THREADS_BIND": "0-3|8,10"}) == {0, 1, 2, 3, 8, 10}
    assert slurm.bound_cores({"VLLM_CPU_OMP_THREADS_BIND": "auto"}) == frozenset()
    assert slurm.bound_cores({}) == frozenset()


def test_shared_cores_names_the_clash_on_one_node_only():
    live = {"prefill-0": ("n1", frozenset({0, 1})), "decode-9": ("n2", frozenset({1}))}
    why = slurm.shared_cores("decode-0", "n1", frozenset({1}), live)
    assert why.startswith("decode-0 shares node n1 with prefill-0 on cores 1: separate Slurm steps"), why
    assert slurm.shared_cores("decode-0", "n2", frozenset({0}), live) == ""  # n2's step is on core 1
    assert slurm.shared_cores("decode-0", "n3", frozenset({0, 1}), live) == ""


@pytest.fixture
def launcher(monkeypatch, tmp_path):
    """A SlurmLauncher of job 1 on nodes n1, n2 whose srun is a plain ``sleep`` (started
    here, killed at the end) and whose squeue/scancel do nothing."""
    monkeypatch.setattr(slurm, "_tool", lambda name: "/bin/true")
    monkeypatch.setattr(slurm, "node_addrs", lambda nodes: {n: n for n in nodes})
    procs: list[subprocess.Popen] = []

    def fake_popen(argv, env, log_path, **kw):
        procs.append(subprocess.Popen(["sleep", "60"]))
        return procs[-1], 0

    monkeypatch.setattr(slurm, "popen_logged", fake_popen)
    yield slurm.SlurmLauncher("1", ["n1", "n2"])
    for p in procs:
        p.kill()
        p.wait()


def _req(name: str, node: str, bind: str, tmp: Path) -> LaunchRequest:
    env = {"VLLM_CPU_OMP_THREADS_BIND": bind}
    return LaunchRequest(name, ["vllm", "serve"], env, 20000, tmp / f"{name}.log", node=node)


def test_start_warns_when_steps_share_a_core(launcher, tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger=slurm.log.name)
    launcher.start(_req("prefill-0", "n1", "0|1", tmp_path))
    launcher.start(_req("decode-0", "n2", "1", tmp_path))  # another node: no clash
    assert not caplog.records
    launcher.start(_req("decode-1", "n1", "1", tmp_path))
    assert [r.getMessage().split(":")[0] for r in caplog.records] == [
        "decode-1 shares node n1 with prefill-0 on cores 1"
    ]
