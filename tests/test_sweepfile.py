"""Bad input: one clear message naming file, line, field path and allowed values; exit 2."""

from pathlib import Path

import pytest

from pdsweep.cli import main
from pdsweep.core.errors import UserError
from pdsweep.sweepfile.sweep import load_sweep

REPO = Path(__file__).resolve().parent.parent


def write(tmp_path: Path, body: str) -> Path:
    (tmp_path / "models.yaml").write_text((REPO / "sweeps" / "models.yaml").read_text())
    p = tmp_path / "s.yaml"
    p.write_text(body)
    return p


def err(tmp_path: Path, body: str, capsys) -> str:
    p = write(tmp_path, body)
    assert main(["validate", str(p)]) == 2
    out = capsys.readouterr()
    assert "Traceback" not in out.err
    return out.err


def test_shipped_sweeps_are_valid():
    for f in sorted((REPO / "sweeps").glob("*.yaml")):
        if f.name != "models.yaml":
            assert load_sweep(f).sweep.name


def test_malformed_yaml_names_file_and_line(tmp_path, capsys):
    msg = err(tmp_path, "name: x\nmatrix:\n  model: [tiny-llama\n  tp: [p1d1]\n", capsys)
    assert "s.yaml:" in msg and "malformed YAML" in msg
    assert ":4:" in msg or ":3:" in msg


def test_unknown_top_level_key(tmp_path, capsys):
    msg = err(tmp_path, "name: x\nmatrixx: {}\nmatrix: {model: [tiny-llama]}\n", capsys)
    assert "s.yaml:2: matrixx: unknown key 'matrixx'" in msg
    assert "allowed: name, description, platform" in msg


def test_unknown_nested_key_lists_allowed(tmp_path, capsys):
    msg = err(tmp_path, "name: x\ndefaults:\n  block: 16\nmatrix: {model: [tiny-llama]}\n", capsys)
    assert "s.yaml:3: defaults.block: unknown key 'block'" in msg
    assert "prefill_block_size" in msg


def test_wrong_type(tmp_path, capsys):
    msg = err(tmp_path, "name: x\nmatrix:\n  model: [tiny-llama]\n  prefill_tp: [one]\n", capsys)
    assert "s.yaml:4: matrix.prefill_tp[0]:" in msg and "integer" in msg


def test_unknown_model_lists_catalogue(tmp_path, capsys):
    msg = err(tmp_path, "name: x\nmatrix:\n  model: [tiny-llama, nope]\n", capsys)
    assert "matrix.model[1]: unknown model 'nope'" in msg
    assert "tiny-llama" in msg and "kimi-linear" in msg


def test_a_catalogue_given_as_sweep_says_so(capsys):
    assert main(["validate", str(Path(__file__).parent.parent / "sweeps" / "models.yaml")]) == 2
    msg = capsys.readouterr().err
    assert "models.yaml: a model catalogue (top-level 'models'), not a sweep" in msg and "models_file" in msg


def test_bad_literal_lists_values(tmp_path, capsys):
    msg = err(tmp_path, "name: x\nplatform: tpu\nmatrix: {model: [tiny-llama]}\n", capsys)
    assert "s.yaml:2: platform:" in msg and "'cuda'" in msg and "'cpu'" in msg


def test_impossible_tp_pair(tmp_path, capsys):
    msg = err(tmp_path, "name: x\nmatrix:\n  model: [tiny-llama]\n  tp: [p2x1]\n", capsys)
    assert "matrix.tp" in msg and "p2x1" in msg and "pPdD" in msg


def test_include_unknown_key_and_expect_without_reason(tmp_path, capsys):
    msg = err(
        tmp_path, "name: x\nmatrix:\n  model: [tiny-llama]\n  include:\n    - {model: tiny-llama, foo: 1}\n", capsys
    )
    assert "include[0]: unknown key(s) ['foo']" in msg
    msg = err(
        tmp_path,
        "name: x\nmatrix:\n  model: [tiny-llama]\n  include:\n    - {model: tiny-llama, expect: fail}\n",
        capsys,
    )
    assert "needs a 'reason'" in msg


def test_unknown_build_in_include(tmp_path, capsys):
    msg = err(
        tmp_path,
        "name: x\nmatrix:\n  model: [tiny-llama]\n  include:\n    - {model: tiny-llama, build: nope}\n",
        capsys,
    )
    assert "s.yaml:5: matrix.include[0].build: unknown build 'nope' (allowed: fixed)" in msg


def test_missing_file(tmp_path):
    with pytest.raises(UserError, match="cannot read"):
        load_sweep(tmp_path / "absent.yaml")


def test_catalogue_error_names_catalogue_file(tmp_path, capsys):
    p = write(tmp_path, "name: x\nmatrix: {model: [m]}\n")
    (tmp_path / "models.yaml").write_text("models:\n  m:\n    architecture: X\n    attention: mla\n    num_layers: 2\n")
    assert main(["validate", str(p)]) == 2
    assert "models.yaml:2: models.m: give exactly one of 'hf_id', 'path' or 'tiny'" in capsys.readouterr().err


@pytest.mark.parametrize(
    "matrix, field",
    [
        ("  model: [tiny-llama]\n  tp: [p0d1]\n", "matrix.tp"),
        ("  model: [tiny-llama]\n  tp: [p2d0]\n", "matrix.tp"),
        ("  model: [tiny-llama]\n  prefill_tp: [0]\n", "matrix.prefill_tp[0]"),
        ("  model: [tiny-llama]\n  block_size: [-16]\n", "matrix.block_size[0]"),
        ("  model: [tiny-llama]\n  block_size: []\n", "matrix.block_size"),
        ("  model: [tiny-llama]\n  num_prefill: [0]\n", "matrix.num_prefill[0]"),
        ("  model: []\n", "matrix.model"),
        ("  model: [tiny-llama]\n  include:\n    - {model: tiny-llama, tp: p2x1}\n", "include[0].tp"),
        ("  model: [tiny-llama]\n  include:\n    - {model: tiny-llama, block_size: big}\n", "include[0].block_size"),
        ("  model: [tiny-llama]\n  include:\n    - {model: tiny-llama, num_prefill: two}\n", "include[0].num_prefill"),
        ("  model: [tiny-llama]\n  exclude:\n    - {decode_dp: 0}\n", "exclude[0].decode_dp"),
    ],
)
def test_impossible_axis_values_exit_2_naming_the_field(tmp_path, capsys, matrix, field):
    msg = err(tmp_path, "name: x\nplatform: cpu\nmatrix:\n" + matrix, capsys)
    assert field in msg, msg


def test_no_runnable_cell_is_an_error(tmp_path, capsys):
    msg = err(tmp_path, "name: x\nplatform: cpu\nmatrix:\n  model: [qwen3-0.6b]\n", capsys)
    assert "no PD cell to run (1 rejected)" in msg and "platform" in msg


def test_results_file_with_odd_schema_or_bytes_is_a_user_error(tmp_path):
    from pdsweep.results import layout

    p = tmp_path / "status.json"
    for raw in (b'{"schema": null}', b'{"schema": "one"}', b'\xff\xfe{"schema": 1}'):
        p.write_bytes(raw)
        with pytest.raises(UserError, match="status.json"):
            layout.read_json(p)


def test_typo_inside_a_serve_args_variant_names_the_key(tmp_path, capsys):
    msg = err(
        tmp_path,
        "name: x\nplatform: cpu\nserve_args:\n  base: []\n  x: {bothh: [--foo]}\nmatrix:\n  model: [tiny-llama]\n",
        capsys,
    )
    assert (
        "s.yaml:5: serve_args.x.bothh: unknown key 'bothh' (allowed: both, prefill, decode, enforce_eager, kv_transfer_extra, decode_optimize, reference)"
        in msg
    )
    assert "valid list" not in msg
