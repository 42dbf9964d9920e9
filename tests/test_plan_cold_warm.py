"""The first plan of a vLLM install (every question asked of the installed vLLM 0.32.0 through one
probe process) and a later plan (every answer read from the store, no vLLM asked) print the
same plan.json (issue 40 item 3). The timings are in bench/test_scale_1000.py."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import pytest

from pdsweep.builds import answers, attnprobe
from pdsweep.cli import main
from pdsweep.core.errors import UserError

pytest.importorskip("vllm.platforms.interface")

REPO = Path(__file__).resolve().parent.parent
# qwen3 at P block 64 and D block 16: NIXL's block_size_ratio refuses it, with its message
# "(called here)"; the other three pairs run, each instance argv checked by vLLM's parser
SWEEP = f"""\
name: coldwarm
platform: cuda
models_file: {REPO / "sweeps" / "models.yaml"}
serve_args:
  base: []
  prefix: {{both: [--enable-prefix-caching]}}
matrix:
  model: [qwen3-0.6b, deepseek-v2-lite-chat]
  tp: [p1d1, p2d1]
  prefill_block_size: [16, 64]
  decode_block_size: [16, 64]
  serve_args: [base, prefix]
"""


def _forget() -> None:
    answers.forget()
    attnprobe._ask.cache_clear()
    attnprobe._version.cache_clear()
    attnprobe.close_probes()


def _plan(path: Path) -> dict:
    _forget()
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["plan", str(path), "--gpus", "8", "--format", "json"]) == 0
    return json.loads(out.getvalue())


def test_a_warm_plan_equals_the_cold_plan_without_asking_vllm(tmp_path: Path, monkeypatch) -> None:
    sweep = tmp_path / "coldwarm.yaml"
    sweep.write_text(SWEEP)
    monkeypatch.setenv(answers.CACHE_ENV, str(tmp_path / "store"))
    cold = _plan(sweep)
    answers.save_all()
    assert sorted(f.name.split("-")[0] for f in (tmp_path / "store").iterdir()) == ["argv", "attn"]
    reasons = [r["reason"] for r in cold["rejected"]]
    assert any("(called here)" in r and "Local block size 16 is not divisible" in r for r in reasons), reasons
    assert cold["cells"] and any("FLASH" in json.dumps(c["blocks"]) for c in cold["cells"])  # vLLM's backends

    def no_vllm(python: str):
        raise UserError("a warm plan asked vLLM")

    monkeypatch.setattr(attnprobe, "_probe", no_vllm)
    warm = _plan(sweep)
    assert warm == cold
    _forget()
