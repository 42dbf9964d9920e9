"""pdsweep.sweepfile.guards: unsafe names, and flags or env variables that define the cell, are refused
with the axis that sets them (issue 15)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from _sweepfiles import SMALL, bad, good, sweep
from hypothesis import given, settings
from hypothesis import strategies as st

from pdsweep.core.errors import UserError

REPO = Path(__file__).resolve().parent.parent


NAMES = st.text(st.characters(codec="utf-8"), min_size=1, max_size=80)


FLAG_CHARS = st.text(st.sampled_from("abcdefghijklmnopqrstuvwxyz-_"), min_size=1, max_size=30)


@pytest.mark.parametrize(
    "name", ["../escape", "a/b", "two\nlines", "trailing\n", "x" * 300, "has.dot", "-dash", "p2d1", "env-x"]
)
def test_unsafe_variant_names_are_refused(tmp_path: Path, capsys, name: str) -> None:
    body = SMALL.replace("matrix:", f"serve_args: {{base: [], {json.dumps(name)}: []}}\nmatrix:")
    assert "serve_args: name " in bad(tmp_path, body, capsys)


@pytest.mark.parametrize("field", ["builds", "env"])
def test_unsafe_build_and_env_names_are_refused(tmp_path: Path, capsys, field: str) -> None:
    body = SMALL.replace("matrix:", f"{field}: {{'../../etc': {{}}}}\nmatrix:")
    assert f"{field}: name '../../etc' is not safe" in bad(tmp_path, body, capsys)


def test_unsafe_model_name_is_refused(tmp_path: Path, capsys) -> None:
    models = (REPO / "sweeps" / "models.yaml").read_text().replace("  tiny-llama:\n", "  ../tiny-llama:\n", 1)
    assert "models: name '../tiny-llama' is not safe" in bad(tmp_path, SMALL, capsys, models)


@given(NAMES)
@settings(max_examples=200, deadline=None)
def test_property_accepted_names_are_one_safe_path_component(name: str) -> None:
    from pdsweep.sweepfile.guards import unsafe_name

    for model in (False, True):
        if unsafe_name(name, model) is None:
            assert "/" not in name and ".." not in name and name.strip() == name and name.isascii()
            assert (Path("/run") / name).parent == Path("/run") and len(name) <= 64
            assert model or "." not in name


@pytest.mark.parametrize(
    "arg, axis",
    [
        ("--tensor-parallel-size", "the tp axis"),
        ("--tensor_parallel_size=2", "the tp axis"),
        ("-tp", "the tp axis"),
        ("-tp=2", "the tp axis"),
        ("--tensor-parallel", "the tp axis"),
        ("--data-parallel-size", "decode_dp"),
        ("-dp", "decode_dp"),
        ("--block-size=32", "the block_size axis"),
        ("--port", "defaults.port_base"),
        ("--host", "127.0.0.1"),
        ("--kv-transfer-config", "kv_buffer_device"),
        ("--kv-transfer-config.kv_role", "kv_role"),
        ("--config", "a --config file"),
    ],
)
def test_cell_defining_flags_are_refused_with_the_axis(tmp_path: Path, capsys, arg: str, axis: str) -> None:
    body = SMALL.replace("matrix:", f"serve_args: {{base: [], x: {{decode: [{json.dumps(arg)}, '2']}}}}\nmatrix:")
    msg = bad(tmp_path, body, capsys)
    assert "serve_args.x.decode[0]: " in msg and "defines the cell" in msg and axis in msg


@pytest.mark.parametrize(
    "var",
    [
        "VLLM_PORT",
        "VLLM_NIXL_SIDE_CHANNEL_PORT",
        "VLLM_NIXL_SIDE_CHANNEL_HOST",
        "VLLM_KV_CACHE_LAYOUT",
        "CUDA_VISIBLE_DEVICES",
    ],
)
def test_cell_defining_env_is_refused(tmp_path: Path, capsys, var: str) -> None:
    body = SMALL.replace("matrix:", f"env: {{base: {{}}, x: {{{var}: '1'}}}}\nmatrix:")
    assert f"env.x.{var}: {var} is set by pdsweep and defines the cell: use " in bad(tmp_path, body, capsys)


def test_catalogue_serve_args_cannot_set_the_block_size(tmp_path: Path, capsys) -> None:
    models = (
        (REPO / "sweeps" / "models.yaml")
        .read_text()
        .replace("  tiny-llama:\n", "  tiny-llama:\n    serve_args: [--block-size, '64']\n", 1)
    )
    assert "models.tiny-llama.serve_args[0]: '--block-size' sets --block-size" in bad(tmp_path, SMALL, capsys, models)


def test_flags_models_and_sweeps_legitimately_set_pass(tmp_path: Path, capsys) -> None:
    body = SMALL.replace(
        "matrix:",
        "serve_args: {base: [], x: [--attention-backend, CPU_ATTN, "
        "--no-enable-prefix-caching, --num-gpu-blocks-override, '512', "
        "--max-model-len, '512', --speculative-config, '{\"method\": \"mtp\"}']}\nmatrix:",
    )
    assert "valid: 1 PD cells" in good(tmp_path, body, capsys)


@given(FLAG_CHARS)
@settings(max_examples=300, deadline=None)
def test_property_a_flag_vllm_would_read_as_a_reserved_one_is_refused(name: str) -> None:
    """Whatever spelling vLLM's parser maps to a reserved flag (``_`` for ``-``, ``.key``
    suffixes, ``=value``, unique prefixes) is refused; other flags pass."""
    from pdsweep.sweepfile.guards import RESERVED_FLAGS, reserved_flag

    arg = "--" + name
    canon = "--" + name.replace("_", "-")
    hits = [
        f for f in RESERVED_FLAGS if f.startswith("--") and (canon == f or (len(canon) > 3 and f.startswith(canon)))
    ]
    assert (reserved_flag(arg) is not None) == bool(hits)
    assert (reserved_flag(arg + "=1") is not None) == bool(hits)
    assert (reserved_flag(arg + ".key") is not None) == bool(hits)


@pytest.mark.parametrize(
    "arg",
    [
        '--kv-transfer-config={"kv_connector":"LMCacheConnectorV1","kv_role":"kv_both"}',
        "--kv-transfer-config.kv_role=kv_both",
        "--kv_transfer_config",
    ],
)
def test_serve_args_replacing_the_kv_transfer_config_are_refused(tmp_path, arg):
    with pytest.raises(UserError) as e:
        sweep(
            tmp_path,
            f"""serve_args:
  base: []
  other: {{decode: ['{arg}']}}
matrix: {{model: [tiny-llama], tp: [p1d1]}}
""",
        )
    msg = str(e.value)
    # refused by the spec's cell-defining-flag guard (pdsweep.sweepfile.guards) before the
    # kv_transfer_extra check: either names the file, line, field and the arg
    assert "s.yaml:6: serve_args.other.decode" in msg and arg.split("=")[0][:18] in msg
    assert "defines the cell" in msg and "kv_transfer_extra" in msg and "connector and role cannot change" in msg
