"""Fetch before the clock (issue 56): a snapshot in the HF cache counts as fetched only when complete
(pdsweep.run.hubcache over huggingface_hub.scan_cache_dir: every shard the index maps, no interrupted
download), ``pdsweep run``'s preflight refuses a model not fetched (it would download inside the startup
budget), and ``make sweep`` / ``make nightly`` run ``pdsweep fetch`` before ``pdsweep run``, on a fake GPU
node (the GPU matrix, a fake hub cache) and on the CPU default (nothing to download)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace as NS

import pytest
from _fakes import block_non_loopback, fake_nvidia_smi
from conftest import make_hub_snapshot

from pdsweep.core.errors import UserError
from pdsweep.run import hubcache
from pdsweep.run import preflight as pf
from pdsweep.run.preflight import hf_cache_dir, preflight

ROOT = Path(__file__).resolve().parents[1]
KIMI, GLM, LING = "moonshotai/Kimi-Linear-48B-A3B-Instruct", "JaredforReal/GLM-5.3-Flash-4L", "inclusionAI/Ling-2.5-1T"
INDEX = json.dumps(
    {"metadata": {"total_size": 3}, "weight_map": {"a": "model-1.safetensors", "b": "model-2.safetensors"}}
)


def sharded(cache: Path, repo: str, shards: tuple[str, ...] = ("model-1.safetensors", "model-2.safetensors"), **kw):
    files = {"config.json": "{}", "model.safetensors.index.json": INDEX, **{s: "w" for s in shards}}
    return make_hub_snapshot(cache, repo, files, **kw)


def test_complete_and_partial_snapshots(hub_cache):
    full = sharded(hub_cache, KIMI)
    sharded(hub_cache, GLM, shards=("model-1.safetensors",))
    sharded(hub_cache, LING, incomplete=1)
    make_hub_snapshot(hub_cache, "org/config-only", {"config.json": "{}"})
    assert hubcache.snapshot(KIMI) == hubcache.Snapshot(full, ())
    assert hf_cache_dir(KIMI) == full
    assert hubcache.snapshot(GLM).missing == ("model-2.safetensors",)
    assert hubcache.snapshot(LING).missing == ("1 interrupted download(s) in blobs/ (*.incomplete)",)
    assert hubcache.snapshot("org/config-only").missing == ("no *.safetensors (weights never downloaded)",)
    # the old rule (a config.json is enough) counted each of these as cached
    assert [hf_cache_dir(r) for r in (GLM, LING, "org/config-only", "org/absent")] == [None] * 4
    assert hubcache.not_fetched("org/absent") == "not in the HF cache"
    assert hubcache.not_fetched(GLM).startswith("a partial snapshot in the HF cache at ")


def test_run_preflight_lists_a_partial_snapshot_as_unfetched(hub_cache):
    from pdsweep.plan.expand import expand
    from pdsweep.sweepfile.sweep import load_sweep

    sharded(hub_cache, GLM, shards=("model-1.safetensors",))
    ls = load_sweep(ROOT / "sweeps" / "hybrid-mla-mamba.yaml")
    cells = [c for c in expand(ls).cells if c.model == "glm-5.3-flash-4l"][:1]
    hub = NS(gated=lambda repo, token: False, weights_bytes=lambda repo, token: None)
    (msg,) = preflight(ls, cells, hub=hub, inv=NS(error=None, gpus=[], driver=None), env={}).unfetched
    assert f"model glm-5.3-flash-4l: {GLM} is a partial snapshot in the HF cache at " in msg
    assert "(missing: model-2.safetensors): vLLM would download it at startup, inside the startup budget" in msg
    assert f"run `pdsweep fetch {ls.path}` first" in msg


def test_pdsweep_run_refuses_a_model_not_fetched(tmp_path, hub_cache, capsys):
    """The sweep loop's preflight on a fake GPU node: nothing starts, the model and the remedy named."""
    from pdsweep.cli import main

    sharded(hub_cache, GLM, shards=("model-1.safetensors",))
    bin_dir = fake_nvidia_smi(tmp_path / "bin", driver="580.65.06")
    with pytest.MonkeyPatch.context() as mp, block_non_loopback():
        mp.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
        mp.delenv("HF_HUB_OFFLINE", raising=False)  # a node that reaches the hub (CI exports HF_HUB_OFFLINE=1)
        mp.setattr(pf, "HfHub", lambda: NS(gated=lambda repo, token: False, weights_bytes=lambda repo, token: None))
        mp.setattr(pf, "torch_cuda_version", lambda: "13.0")  # the node's torch (this box's is a CPU build)
        rc = main(
            [
                "run",
                str(ROOT / "sweeps" / "hybrid-mla-mamba.yaml"),
                "--cells",
                "glm-5.3-flash-4l.p1d1*",
                "--out",
                str(tmp_path / "run"),
            ]
        )
    err = capsys.readouterr().err
    assert rc == 2, err
    assert f"model glm-5.3-flash-4l: {GLM} is a partial snapshot in the HF cache" in err
    assert not (tmp_path / "run").exists()


def test_fetch_resumes_a_partial_snapshot_and_refuses_one_still_partial(hub_cache, monkeypatch, capsys):
    import huggingface_hub

    from pdsweep.run import fetch as F

    sharded(hub_cache, GLM, shards=("model-1.safetensors",))
    monkeypatch.setattr(F, "repo_bytes", lambda repo, token, kind="model": 10**9)
    monkeypatch.setattr(F, "free_bytes", lambda p: 10**12)
    got: list[str] = []
    monkeypatch.setattr(huggingface_hub, "snapshot_download", lambda **kw: got.append(kw["repo_id"]))
    from pdsweep.sweepfile.sweep import load_catalogue

    models = {"glm-5.3-flash-4l": load_catalogue(ROOT / "sweeps" / "models.yaml").models["glm-5.3-flash-4l"]}
    with pytest.raises(UserError, match=r"is a partial snapshot .*missing: model-2.safetensors.* after the download"):
        F.fetch(models, env={"HF_HUB_CACHE": str(hub_cache)})
    assert got == [GLM] and "(resuming a partial snapshot)" in capsys.readouterr().err
    sharded(hub_cache, GLM)  # the download completed it
    assert F.fetch(models, env={"HF_HUB_CACHE": str(hub_cache)}) == []


def fake_venv(tmp_path: Path) -> tuple[Path, Path]:
    """A venv whose python logs each call and runs only ``-m pdsweep fetch`` for real (this
    interpreter, this checkout); its install stamp is newer than every file make checks."""
    venv, log = tmp_path / "venv", tmp_path / "calls.log"
    (venv / "bin").mkdir(parents=True)
    py = venv / "bin" / "python"
    py.write_text(
        "#!/bin/sh\n"
        f'echo "$*" >> {log}\n'
        f'if [ "$1 $2 $3" = "-m pdsweep fetch" ]; then PYTHONPATH={ROOT} exec {sys.executable} "$@"; fi\n'
        "exit 0\n"
    )
    py.chmod(0o755)
    stamp = venv / ".pdsweep-installed"
    stamp.write_text("{}")
    later = time.time() + 3600
    os.utime(stamp, (later, later))
    return venv, log


def make(tmp_path: Path, target: str, path: str, venv: Path, cache: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PATH": path, "HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    args = [f"VENV={venv}", f"RUN={tmp_path / 'run'}", f"LATEST={tmp_path / 'latest'}", f"HISTORY={tmp_path / 'h.db'}"]
    return subprocess.run(
        ["make", "--no-print-directory", target, *args], cwd=ROOT, env=env, capture_output=True, text=True
    )


def calls(log: Path) -> list[str]:
    return [" ".join(x.split()[:3]) for x in log.read_text().splitlines()]


@pytest.mark.parametrize("target", ["sweep", "nightly"])
def test_make_on_a_gpu_node_fetches_before_run_and_stops_on_a_partial_snapshot(tmp_path, hub_cache, target):
    bin_dir = fake_nvidia_smi(tmp_path / "bin", driver="580.65.06")
    sharded(hub_cache, KIMI, shards=("model-1.safetensors",))  # an interrupted fetch: one shard of two
    sharded(hub_cache, GLM)
    sharded(hub_cache, LING)
    venv, log = fake_venv(tmp_path)
    r = make(tmp_path, target, f"{bin_dir}:{os.environ['PATH']}", venv, hub_cache)
    assert r.returncode != 0
    # the GPU matrix (a GPU node's default), fetched after the baseline and before any `pdsweep run`
    assert calls(log) == ["-m pdsweep baseline-env", "-m pdsweep fetch"], log.read_text()
    assert "sweeps/hybrid-mla-mamba.yaml" in log.read_text().splitlines()[1]
    assert f"model kimi-linear ({KIMI}: a partial snapshot in the HF cache at " in r.stderr
    assert "glm-5.3-flash-4l" not in r.stderr.split("HF cache:")[1].split("; fetch them")[0].replace(KIMI, "")


def test_make_sweep_on_cpu_fetches_nothing_then_runs(tmp_path, hub_cache):
    venv, log = fake_venv(tmp_path)
    nosmi = ":".join(p for p in os.environ["PATH"].split(":") if not (Path(p) / "nvidia-smi").exists())
    r = make(tmp_path, "sweep", nosmi, venv, hub_cache)
    assert r.returncode == 0, r.stdout + r.stderr
    assert calls(log)[:3] == ["-m pdsweep baseline-env", "-m pdsweep fetch", "-m pdsweep run"]
    assert "sweeps/cpu-smoke.yaml" in log.read_text().splitlines()[1]
    assert "pdsweep fetch: every model and eval dataset is local" in r.stdout
    assert list(hub_cache.iterdir()) == []  # nothing downloaded
