"""pdsweep.sweepfile.yamlfile: duplicate keys name both lines; invalid UTF-8 and any bytes are bad
input, never a traceback (issue 15)."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
from _sweepfiles import SMALL, bad, write
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdsweep.cli import main
from pdsweep.core.errors import UserError
from pdsweep.sweepfile.sweep import load_sweep

REPO = Path(__file__).resolve().parent.parent


HC = [HealthCheck.function_scoped_fixture]


def test_duplicate_key_in_a_sweep_names_both_lines(tmp_path: Path, capsys) -> None:
    msg = bad(tmp_path, "name: x\nplatform: cpu\nmatrix: {model: [tiny-llama]}\nplatform: cuda\n", capsys)
    assert f"{tmp_path / 's.yaml'}:4: duplicate key 'platform' (first at line 2)" in msg


def test_duplicate_key_in_the_catalogue_names_both_lines(tmp_path: Path, capsys) -> None:
    models = (
        (REPO / "sweeps" / "models.yaml")
        .read_text()
        .replace("  tiny-llama:\n", "  tiny-llama:\n    num_layers: 3\n", 1)
    )
    msg = bad(tmp_path, SMALL, capsys, models)
    assert f"{tmp_path / 'models.yaml'}:" in msg and "duplicate key 'num_layers' (first at line " in msg


@given(st.sampled_from(["name", "platform", "defaults", "eval"]), st.integers(0, 3))
@settings(max_examples=20, deadline=None, suppress_health_check=HC)
def test_property_any_repeated_key_is_refused(tmp_path: Path, key: str, pad: int) -> None:
    lines = [
        "name: x",
        "platform: cpu",
        "defaults: {max_num_seqs: 4}",
        "eval: {limit: 2}",
        "matrix: {model: [tiny-llama], tp: [p1d1], block_size: [32]}",
    ]
    first = next(i for i, line in enumerate(lines) if line.startswith(key + ":")) + 1
    body = "\n".join(lines + ["# pad"] * pad + [next(x for x in lines if x.startswith(key + ":"))]) + "\n"
    p = write(Path(tempfile.mkdtemp(dir=tmp_path)), body)
    with pytest.raises(UserError, match=rf":{len(lines) + pad + 1}: duplicate key '{key}' \(first at line {first}\)"):
        load_sweep(p)


def test_invalid_utf8_sweep_is_bad_input(tmp_path: Path, capsys) -> None:
    p = tmp_path / "s.yaml"
    p.write_bytes(b"name: x\nplatform: cpu\ndescription: caf\xe9\nmatrix: {model: [tiny-llama]}\n")
    (tmp_path / "models.yaml").write_text((REPO / "sweeps" / "models.yaml").read_text())
    assert main(["validate", str(p)]) == 2
    assert f"error: {p}:3: not UTF-8 text (byte 0xe9 at offset 38)" in capsys.readouterr().err


@given(st.binary(min_size=1, max_size=200))
@settings(max_examples=100, deadline=None, suppress_health_check=HC)
def test_property_any_bytes_give_exit_0_or_2(tmp_path: Path, blob: bytes) -> None:
    root = Path(tempfile.mkdtemp(dir=tmp_path))
    p = root / "s.yaml"
    p.write_bytes(blob)
    (root / "models.yaml").write_text("models: {}\n")
    assert main(["validate", str(p)]) in (0, 2)
