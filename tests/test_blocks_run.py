"""Effective blocks read back from running instances into cell.json, plan/run mismatch
reporting, and probe prompts sized from the effective decode block (fake vllm serve)."""

from __future__ import annotations

import sys

import pytest
from _fakes import build_tokenizer
from test_run_fake import make_sweep

from pdsweep.plan.runtimeblocks import mismatches, runtime_blocks
from pdsweep.results import layout
from pdsweep.run.context import RunOptions
from pdsweep.run.sweep import run_sweep


@pytest.fixture(autouse=True)
def _real_python(monkeypatch):
    monkeypatch.setenv("PDSWEEP_REAL_PYTHON", sys.executable)


METRICS = (
    "# HELP vllm:cache_config_info x\n# TYPE vllm:cache_config_info gauge\n"
    'vllm:cache_config_info{block_size="288",engine="0",enable_prefix_caching="True"} 1.0\n'
)


def test_runtime_blocks_from_metric_and_logs():
    log = (
        "INFO [interface.py:1096] Setting attention block size to 288 tokens to ensure that attention page "
        "size is >= mamba page size.\nINFO [base_worker.py:965] User-specified logical block size (1920) does "
        "not match physical kernel block size (64). Using the latter.\n"
    )
    assert runtime_blocks(METRICS, "", nixl=True) == {"logical": 288, "kernel": 288, "source": "vllm:cache_config_info"}
    assert runtime_blocks(None, log, nixl=True) == {"logical": 288, "kernel": 64, "source": "log"}
    assert runtime_blocks(None, "", nixl=False) == {"logical": None, "kernel": None, "source": None}
    assert mismatches({"logical": 1920, "kernel": 64}, {"logical": 1024, "kernel": 64}) == [
        "logical: planned 1920, vLLM 1024"
    ]
    assert mismatches({"logical": None, "kernel": None}, {"logical": 1024, "kernel": 64}) == []


def test_fake_run_records_blocks_and_reports_mismatch(tmp_path):
    tok = build_tokenizer(tmp_path / "tok")
    sweep = make_sweep(
        tmp_path,
        tok,
        port_base=31400,
        matrix="  model: [fake-gqa]\n  tp: [p1d1]\n  env: [base, raised]\n",
        env="  base: {}\n  raised: {FAKE_BLOCK_SIZE: '48'}",
    )
    sweep.write_text(sweep.read_text().replace("lengths: [short, 40]", "lengths: [short, blocks, long]"))
    run = run_sweep(sweep, RunOptions(out=tmp_path / "run", quiet=True, skip_eval=True))
    ok = run / "fake-gqa.p1d1.b16-16.fixed"
    blocks = layout.read_json(ok / "cell.json")["blocks"]
    assert blocks["decode-0"] == {
        "planned": {"logical": 16, "kernel": 16},
        "runtime": {"logical": 16, "kernel": 16, "source": "vllm:cache_config_info"},
        "mismatch": [],
    }
    assert "block_mismatch" not in layout.read_json(ok / "status.json")
    probe = layout.read_json(ok / "probe.json")
    # text: the probe text eval.consistency.text "auto" picked (prose: the fixture model is untrained)
    assert probe["sizing"] == {"block_size": 16, "block_source": "runtime", "max_model_len": 256, "text": "prose"}
    assert {p["name"]: p["prompt_tokens"] for p in probe["prompts"]} == {"short": 15, "blocks": 56, "long": 251}

    bad = run / "fake-gqa.p1d1.b16-16.fixed.env-raised"
    st = layout.read_json(bad / "status.json")
    assert st["block_mismatch"] == [
        "prefill-0: logical: planned 16, vLLM 48",
        "prefill-0: kernel: planned 16, vLLM 48",
        "decode-0: logical: planned 16, vLLM 48",
        "decode-0: kernel: planned 16, vLLM 48",
    ]
    probe = layout.read_json(bad / "probe.json")
    assert probe["sizing"]["block_size"] == 48  # sized from what the engine runs, not the YAML
    assert {p["name"]: p["prompt_tokens"] for p in probe["prompts"]} == {"short": 47, "blocks": 168, "long": 251}
    assert "note" not in probe["sizing"]


def test_probe_notes_when_max_model_len_cannot_hold_three_blocks(tmp_path):
    tok = build_tokenizer(tmp_path / "tok")
    sweep = make_sweep(
        tmp_path,
        tok,
        port_base=31600,
        matrix="  model: [fake-gqa]\n  tp: [p1d1]\n",
        env="  base: {FAKE_BLOCK_SIZE: '96'}",
    )
    sweep.write_text(sweep.read_text().replace("lengths: [short, 40]", "lengths: [short, blocks]"))
    run = run_sweep(sweep, RunOptions(out=tmp_path / "run", quiet=True, skip_eval=True))
    sizing = layout.read_json(run / "fake-gqa.p1d1.b16-16.fixed" / "probe.json")["sizing"]
    assert sizing["note"] == (
        "max_model_len 256 holds no 3 effective blocks of 96 tokens (with max_tokens 4): "
        "the 'blocks' prompt is 251 tokens, 2.61 blocks"
    )
