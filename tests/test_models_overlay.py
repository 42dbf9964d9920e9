"""A maintainer's own models: ``models_overlay`` catalogue files merged over the shipped one."""

from __future__ import annotations

from pathlib import Path

import pytest

from pdsweep.cli import main as cli_main
from pdsweep.core.errors import UserError
from pdsweep.plan.expand import expand
from pdsweep.sweepfile.sweep import load_sweep

MODELS = Path(__file__).resolve().parents[1] / "sweeps" / "models.yaml"
EXTRA = """\
models:
  my-qwen3-1.7b:
    hf_id: Qwen/Qwen3-1.7B
    architecture: Qwen3ForCausalLM
    attention: gqa
    num_layers: 28
    num_attention_heads: 16
    num_kv_heads: 8
    attn: {head_dim: 128}
    max_model_len: 4096
  qwen3-0.6b:   # replaces the shipped entry
    hf_id: Qwen/Qwen3-0.6B
    architecture: Qwen3ForCausalLM
    attention: gqa
    num_layers: 28
    num_attention_heads: 16
    num_kv_heads: 8
    attn: {head_dim: 128}
    max_model_len: 2048
"""


def sweep(tmp_path: Path, overlay: str | None = "extra.yaml") -> Path:
    (tmp_path / "extra.yaml").write_text(EXTRA)
    line = f"models_overlay: [{overlay}]\n" if overlay else ""
    path = tmp_path / "mine.yaml"
    path.write_text(
        f"name: mine\nplatform: cuda\nmodels_file: {MODELS}\n{line}"
        "matrix:\n  model: [my-qwen3-1.7b, qwen3-0.6b, kimi-linear]\n  tp: [p1d1, p2d1]\n"
    )
    return path


def test_overlay_adds_and_replaces_models(tmp_path: Path) -> None:
    ls = load_sweep(sweep(tmp_path))
    assert ls.catalogue.models["my-qwen3-1.7b"].hf_id == "Qwen/Qwen3-1.7B"
    assert ls.catalogue.models["qwen3-0.6b"].max_model_len == 2048  # the overlay's entry, whole
    assert "kimi-linear" in ls.catalogue.models  # the shipped ones stay
    ids = [c.id for c in expand(ls).cells]
    assert "my-qwen3-1.7b.p1d1.b16-16.fixed" in ids and "my-qwen3-1.7b.ref-tp1.b16.fixed" in ids


def test_validate_and_plan_a_sweep_with_an_overlay(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = sweep(tmp_path)
    assert cli_main(["validate", str(path)]) == 0
    assert "valid: 4 PD cells, 2 reference cells, 2 rejected" in capsys.readouterr().out  # kimi-linear: block 16
    assert cli_main(["plan", str(path), "--gpus", "8"]) == 0
    assert "my-qwen3-1.7b.p2d1.b16-16.fixed" in capsys.readouterr().out


def test_without_the_overlay_the_model_is_unknown(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="my-qwen3-1.7b"):
        load_sweep(sweep(tmp_path, overlay=None))


def test_missing_overlay_file_is_named(tmp_path: Path) -> None:
    with pytest.raises(UserError, match=r"mine.yaml: models_overlay: 'nope.yaml': no such file"):
        load_sweep(sweep(tmp_path, overlay="nope.yaml"))
