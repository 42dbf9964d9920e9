"""The nightly's plan (issue 57): expectations that follow the build, the core case's absence
said, identical deployments folded, the CI clock (``--budget``, the sweep's ``budget``) and
``--shard i/n``. GPU cases plan on fake 8 x H100 / H200 nodes (tests/_fakes.py nvidia-smi)."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
from _fakes import fake_nvidia_smi
from _sweepfiles import REPO

from pdsweep.builds import fixprobes
from pdsweep.cli import main
from pdsweep.plan.readplan import UNFIXED_ASSERT

UNFIXED_PY = str(REPO / "tests" / "fake_build" / "python")  # the probe (faked) finds it lacking PR #49297

KIMI = f"""name: kimi-nightly
platform: cuda
models_file: {REPO}/sweeps/models.yaml
builds:
  fixed: {{}}
  unfixed: {{python: {UNFIXED_PY}}}
defaults: {{gpu_memory_utilization: 0.8, max_num_seqs: 256}}
serve_args:
  base: [--no-enable-prefix-caching]
matrix:
  model: [kimi-linear]
  tp: [p1d1, p2d1, p4d1, p8d1]
  block_size: [64, 128]
  build: [fixed, unfixed]
  serve_args: [base]
"""


@pytest.fixture
def node(tmp_path, monkeypatch):
    """A fake GPU node: ``node(**nvidia_smi_kwargs)`` puts its nvidia-smi first on PATH; the
    fix probe answers as vLLM 0.32 with every fix, but the unfixed build lacks vllm#49297."""
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))  # empty HF cache: catalogue weights_gb decides
    for k in ("CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER", "PDSWEEP_GPU_ARCH"):
        monkeypatch.delenv(k, raising=False)

    def probe(python: str):
        return "0.32.0", {f: not (python == UNFIXED_PY and f == "vllm#49297") for f in fixprobes.FIXES}

    monkeypatch.setattr(fixprobes, "probe_python", probe)

    def make(**kw) -> None:
        monkeypatch.setenv("PATH", f"{fake_nvidia_smi(tmp_path / 'bin', **kw)}:{os.environ['PATH']}")

    return make


def plan(capsys, sweep: Path, *extra: str, rc: int = 0) -> tuple[dict, str]:
    assert main(["plan", str(sweep), "--no-check-argv", "--format", "json", *extra]) == rc
    out = capsys.readouterr()
    return (json.loads(out.out) if rc == 0 else {}), out.err


def test_kimi_on_h100_derived_expectations_core_case_and_folds(tmp_path, node, capsys):
    node()
    sweep = tmp_path / "kimi.yaml"
    sweep.write_text(KIMI)
    d, err = plan(capsys, sweep)
    cells = {c["id"]: c for c in d["cells"]}
    # 1. the unfixed p>d cells expect PR #49297's failure, derived from the probe, and say so
    for tp in ("p2d1", "p4d1", "p8d1"):
        un, fx = cells[f"kimi-linear.{tp}.b64-64.unfixed"], cells[f"kimi-linear.{tp}.b64-64.fixed"]
        assert (un["expect_fail"], un["expect_match"]) == (True, re.escape(UNFIXED_ASSERT))
        assert un["expect_note"] == (
            "derived from fix probe vllm#49297 (pdsweep.builds.fixprobes): applies: build unfixed lacks vllm#49297"
        )
        assert fx["expect_fail"] is False
        assert fx["expect_note"].endswith("does not apply: build fixed contains vllm#49297")
    assert cells["kimi-linear.p1d1.b64-64.unfixed"]["expect_fail"] is False  # tp_ratio 1: out of scope
    assert cells["kimi-linear.p1d1.b64-64.unfixed"]["expect_note"] is None
    # 2. every core cell is NOT-RUNNABLE on 80 GB H100s: said
    assert (
        "warning: " + str(sweep) + ": the core case (hybrid MLA + SSM, prefill TP > decode TP) has no runnable "
        "cell here: 12 NOT-RUNNABLE on this node, 0 rejected by rules" in err
    )
    assert d["warnings"] and d["warnings"][0] in err
    # 3. b64 and b128 are one deployment after vLLM's block arithmetic: one runs, both reported
    assert d["folded"]["kimi-linear.p2d1.b128-128.unfixed"] == {
        "runs_as": "kimi-linear.p2d1.b64-64.unfixed",
        "blocks": "P FLASHMLA 1024/64 D FLASHMLA 1920/64",
    }
    assert len(d["folded"]) == 9  # 8 PD cells and the TP-1 reference of b128
    assert "kimi-linear.p2d1.b128-128.unfixed" not in cells
    assert cells["kimi-linear.p2d1.b64-64.unfixed"]["also"] == ["kimi-linear.p2d1.b128-128.unfixed"]
    assert len(cells) == 9  # 8 PD + 1 reference of 16 PD + 2 references


def test_core_case_runnable_on_h200_no_warning(tmp_path, node, capsys):
    node(name="NVIDIA H200", total_mib=143771)
    sweep = tmp_path / "kimi.yaml"
    sweep.write_text(KIMI)
    d, err = plan(capsys, sweep)
    assert d["warnings"] == [] and "core case" not in err
    assert "kimi-linear.p2d1.b64-64.unfixed" in {p["cell"] for p in d["schedule"]["placements"]}


def test_sweep_says_otherwise(tmp_path, node, capsys):
    """A declared expectation wins; ``derive_expectations: false`` derives none."""
    node()
    body = KIMI.replace("  serve_args: [base]\n", "  serve_args: [base]\n  include:\n")
    body += (
        "    - {model: kimi-linear, tp: p2d1, block_size: 64, build: unfixed, expect: fail, match: gsm8k, "
        "reason: declared}\n"
    )
    sweep = tmp_path / "kimi.yaml"
    sweep.write_text(body)
    cells = {c["id"]: c for c in plan(capsys, sweep)[0]["cells"]}
    assert (
        cells["kimi-linear.p2d1.b64-64.unfixed"]["expect_match"],
        cells["kimi-linear.p2d1.b64-64.unfixed"]["expect_note"],
    ) == ("gsm8k", None)
    assert cells["kimi-linear.p4d1.b64-64.unfixed"]["expect_fail"] is True
    sweep.write_text("derive_expectations: false\n" + KIMI)
    cells = {c["id"]: c for c in plan(capsys, sweep)[0]["cells"]}
    assert not any(c["expect_fail"] for c in cells.values())


def test_mamba2_replicated_bc_derives_pr55306(tmp_path, monkeypatch):
    """vllm#55306's scope: Mamba2 n_groups 1 < decode TP 2 at P TP 1 -> D TP 2."""
    from _sweepfiles import sweep as load

    from pdsweep.plan.expand import expand

    monkeypatch.setattr(fixprobes, "probe_python", lambda py: ("0.32.0", dict.fromkeys(fixprobes.FIXES, False)))
    ls = load(tmp_path, "matrix: {model: [tiny-nemotron-h-g1], tp: [p1d2, p1d1], block_size: [32]}\n")
    cells = {c.id: c for c in expand(ls).cells}
    c = cells["tiny-nemotron-h-g1.p1d2.b32-32.fixed"]
    assert (c.expect_fail, c.expect_match, c.expect_without) == (True, "triage transfer", ("vllm#55306",))
    assert c.expect_note == (
        "derived from fix probe vllm#55306 (pdsweep.builds.fixprobes): applies: build fixed lacks vllm#55306"
    )
    assert cells["tiny-nemotron-h-g1.p1d1.b32-32.fixed"].expect_fail is False


CPU = REPO / "sweeps" / "cpu-smoke.yaml"


def test_budget_fails_plan_and_validate_naming_both_figures(tmp_path, capsys):
    d, _ = plan(capsys, CPU, "--budget", "600")
    assert d["budget"]["fits"] is True and d["budget"]["makespan_min"] == round(d["makespan"]["s"] / 60, 1)
    minutes = round(d["makespan"]["s"] / 60)
    _, err = plan(capsys, CPU, "--budget", "10", rc=2)
    assert (
        f"planned makespan {minutes} min ({d['makespan']['s']:.0f} s, the whole sweep; pdsweep's duration "
        "estimate) exceeds the budget of 10 min (--budget); split it: at least --shard i/4" in err
    )
    sweep = tmp_path / "s.yaml"
    sweep.write_text(CPU.read_text().replace("name: cpu-smoke\n", "name: cpu-smoke\nbudget: 10\n"))
    (tmp_path / "models.yaml").write_text((REPO / "sweeps" / "models.yaml").read_text())
    assert main(["validate", str(sweep), "--no-check-argv"]) == 2
    err = capsys.readouterr().err
    assert f"planned makespan {minutes} min" in err and f"exceeds the budget of 10 min ({sweep}: budget)" in err
    assert main(["validate", str(sweep), "--no-check-argv", "--budget", "600"]) == 0
    assert f"budget: planned makespan {minutes} min" in capsys.readouterr().out


def test_shards_are_disjoint_whole_chains(capsys):
    whole, _ = plan(capsys, CPU)
    parts = [plan(capsys, CPU, "--shard", f"{i}/2")[0] for i in (1, 2)]
    ids = [{c["id"] for c in p["cells"]} for p in parts]
    assert ids[0] and ids[1] and not ids[0] & ids[1]
    assert ids[0] | ids[1] == {c["id"] for c in whole["cells"]}
    assert [p["shard"]["cells"] for p in parts] == [len(i) for i in ids]
    # whole chains: no instance in two shards, every PD cell with its reference
    inst = [{r["instance_id"] for r in p["reuse"]["instances"]} for p in parts]
    assert not inst[0] & inst[1]
    for p, own in zip(parts, ids):
        assert all(c["reference_cell"] in own for c in p["cells"] if c["reference_cell"])
    assert max(p["makespan"]["s"] for p in parts) < whole["makespan"]["s"]
    with pytest.raises(SystemExit) as e:  # argparse: usage, exit 2
        main(["plan", str(CPU), "--shard", "3/2"])
    assert e.value.code == 2
    assert "--shard 3/2: allowed 1 <= i <= n <= 256" in capsys.readouterr().err
