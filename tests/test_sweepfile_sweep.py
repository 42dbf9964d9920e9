"""pdsweep.sweepfile.sweep: every error of a sweep file at once, max_model_len above a tiny model's
(bad input of issue 37); a models_file that is a symlink loop is bad input (issue 23)."""

from __future__ import annotations

from pathlib import Path

import pytest
from _sweepfiles import sweep

from pdsweep.cli import main
from pdsweep.core.errors import UserError
from pdsweep.sweepfile.sweep import load_sweep

MODELS = Path(__file__).resolve().parents[1] / "sweeps" / "models.yaml"


def write(tmp_path: Path, body: str) -> Path:
    path = tmp_path / "s.yaml"
    path.write_text(f"name: s\nplatform: cpu\nmodels_file: {MODELS}\n{body}")
    return path


def test_max_model_len_above_a_tiny_model_is_refused(tmp_path: Path) -> None:
    path = write(tmp_path, "defaults: {max_model_len: 999999999}\nmatrix: {model: [tiny-llama], tp: [p1d1]}\n")
    with pytest.raises(UserError) as e:
        load_sweep(path)
    assert f"{path}:4: defaults.max_model_len: 999999999 is above model 'tiny-llama''s 512 tokens" in str(e.value)
    assert "allowed: 1..512" in str(e.value)
    ok = write(tmp_path, "defaults: {max_model_len: 512}\nmatrix: {model: [tiny-llama], tp: [p1d1]}\n")
    assert load_sweep(ok).sweep.defaults.max_model_len == 512


def test_every_error_of_a_file_at_once(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        "defaults: {max_model_len: 4096}\n"
        "serve_args:\n  base: []\n  x: {both: [], reference: nope}\n"
        "matrix: {model: [tiny-llama, no-such-model], tp: [p1d1], env: [missing]}\n",
    )
    with pytest.raises(UserError) as e:
        load_sweep(path)
    lines = str(e.value).splitlines()
    assert any("unknown model 'no-such-model'" in x for x in lines)
    assert any("unknown env 'missing'" in x for x in lines)
    assert any("serve_args.x.reference: unknown serve_args 'nope'" in x for x in lines)
    assert any("defaults.max_model_len: 4096 is above model 'tiny-llama''s 512" in x for x in lines)


def test_a_models_file_that_is_a_symlink_loop_is_bad_input(tmp_path: Path, capsys) -> None:
    (tmp_path / "a").symlink_to(tmp_path / "b")
    (tmp_path / "b").symlink_to(tmp_path / "a")
    (tmp_path / "s.yaml").write_text(
        "name: x\nplatform: cpu\nmodels_file: a\nmatrix: {model: [tiny-llama], tp: [p1d1]}\n"
    )
    assert main(["validate", str(tmp_path / "s.yaml"), "--no-check-argv"]) == 2
    err = capsys.readouterr().err
    assert "models_file 'a': cannot resolve" in err and "Traceback" not in err, err


REPO = Path(__file__).resolve().parent.parent


def test_reference_serve_args_must_exist(tmp_path):
    with pytest.raises(
        UserError,
        match=r"s.yaml:6: serve_args.x.reference: unknown serve_args 'nope' "
        r"\(allowed: base, x\)",
    ):
        sweep(tmp_path, "serve_args:\n  base: []\n  x: {reference: nope}\nmatrix: {model: [tiny-llama], tp: [p1d1]}\n")
