"""Shapes the plan refuses (issue 22 Want 7): pipeline parallelism, port-binding flags pdsweep
does not allocate, per-role differences in what NIXL's compatibility hash covers, and Mamba2
n_groups below prefill TP at tp_ratio < 0."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from pdsweep.core.errors import UserError
from pdsweep.plan.expand import expand
from pdsweep.sweepfile.sweep import load_sweep

SWEEPS = Path(__file__).resolve().parent.parent / "sweeps"


def _sweep(tmp_path: Path, body: str):
    (tmp_path / "models.yaml").write_text((SWEEPS / "models.yaml").read_text())
    (tmp_path / "s.yaml").write_text(body)
    return load_sweep(tmp_path / "s.yaml")


@pytest.mark.parametrize(
    "arg,flag,why",
    [
        ("--kv-events-config", "--kv-events-config", "binds a port pdsweep does not allocate"),
        ("--grpc-port", "--grpc-port", "binds a port pdsweep does not allocate"),
        ("--data_parallel_rpc_port", "--data-parallel-rpc-port", "binds a port"),
    ],
)
def test_refused_serve_flags_name_file_field_and_flag(tmp_path, arg, flag, why):
    body = f"name: s\nserve_args:\n  base: []\n  x: [{arg}, '2']\nmatrix:\n  model: [qwen3-0.6b]\n  tp: [p1d1]\n"
    body += "  serve_args: [x]\n"
    with pytest.raises(UserError) as e:
        _sweep(tmp_path, body)
    msg = str(e.value)
    assert "s.yaml:4" in msg and "serve_args.x[0]" in msg
    assert f"sets {flag}, which pdsweep refuses" in msg and why in msg


def test_decode_only_kv_cache_dtype_fp8_is_refused_as_nixl_hash_mismatch(tmp_path):
    body = """name: s
serve_args:
  base: []
  fp8d: {decode: [--kv-cache-dtype, fp8]}
  fp8: {both: [--kv-cache-dtype, fp8]}
  fip: {prefill: [--attention-backend, FLASHINFER]}
  nocheck: {decode: [--kv-cache-dtype, fp8], kv_transfer_extra: {kv_connector_extra_config: {enforce_handshake_compat: false}}}
matrix:
  model: [qwen3.5-0.8b]
  tp: [p1d1]
  block_size: [128]
  serve_args: [fp8d, fp8, fip, nocheck]
"""
    plan = expand(_sweep(tmp_path, body))
    rej = {r.cell.id: r for r in plan.rejected}
    assert set(rej) == {f"qwen3.5-0.8b.p1d1.b128-128.fixed.{v}" for v in ("fp8d", "fip", "nocheck")}
    # without the hash check, the handshake still refuses the blocks: fp8 halves decode's attention
    # page, so vLLM raises its hybrid block differently (1152 vs 640)
    r = rej["qwen3.5-0.8b.p1d1.b128-128.fixed.nocheck"]
    assert r.rule == "block-ratio" and "'Local block size 1152 is not divisible by remote block size 640" in r.reason
    r = rej["qwen3.5-0.8b.p1d1.b128-128.fixed.fp8d"]
    assert r.rule == "handshake-compat"
    assert r.reason.startswith("--kv-cache-dtype auto on prefill vs fp8 on decode: ")
    assert "compute_nixl_compatibility_hash" in r.reason and "'NIXL compatibility hash mismatch." in r.reason
    r = rej["qwen3.5-0.8b.p1d1.b128-128.fixed.fip"]
    assert r.rule == "handshake-compat"
    assert r.reason.startswith("attention backend FLASHINFER on prefill vs FLASH_ATTN on decode")


def test_mamba2_groups_below_the_larger_tp_in_both_directions(tmp_path):
    body = """name: s
platform: cpu
derive_expectations: false  # the rule alone (a derived vllm#55306 expectation would admit p1d2: test_nightly_plan)
serve_args: {base: []}
matrix:
  model: [tiny-nemotron-h-g1, tiny-nemotron-h]
  tp: [p2d1, p1d2, p2d2]
  block_size: [32]
  include:
    - {model: tiny-nemotron-h-g1, tp: p2d1, block_size: 32, serve_args: base, env: base, expect: fail, match: x, reason: conv}
    - {model: tiny-nemotron-h-g1, tp: p1d2, block_size: 32, serve_args: base, env: base, expect: fail, match: x, reason: conv, without: [vllm#55306]}
"""
    plain = body.split("  include:")[0]
    plan = expand(_sweep(tmp_path, plain))
    rej = {r.cell.id: r for r in plan.rejected}
    # n_groups 1 at prefill TP 2 > decode TP 1, and at decode TP 2 > prefill TP 1 (vLLM issue 55208):
    # rejected unless declared expect: fail
    assert {i: r.rule for i, r in rej.items()} == {
        "tiny-nemotron-h-g1.p2d1.b32-32.fixed": "mamba2-groups",
        "tiny-nemotron-h-g1.p1d2.b32-32.fixed": "mamba2-groups",
    }
    assert (
        "Mamba2 n_groups=1 is not a multiple of prefill TP 2 (tp_ratio -2)"
        in rej["tiny-nemotron-h-g1.p2d1.b32-32.fixed"].reason
    )
    p1d2 = rej["tiny-nemotron-h-g1.p1d2.b32-32.fixed"].reason
    assert "Mamba2 n_groups=1 is not a multiple of decode TP 2 (tp_ratio 2)" in p1d2 and "PR 55306" in p1d2
    ok = {c.id: c.expect_fail for c in plan.pd_cells}
    # n_groups 2 shards B/C at TP 2 in both directions; p2d2 is homogeneous
    assert ok["tiny-nemotron-h.p2d1.b32-32.fixed"] is False and ok["tiny-nemotron-h.p1d2.b32-32.fixed"] is False
    assert "tiny-nemotron-h-g1.p2d2.b32-32.fixed" in ok
    # declared expect: fail, the cells run as witnesses of the bug
    plan = expand(_sweep(tmp_path, body))
    assert plan.rejected == []
    cells = {c.id: c for c in plan.pd_cells}
    assert cells["tiny-nemotron-h-g1.p2d1.b32-32.fixed"].expect_fail is True
    assert cells["tiny-nemotron-h-g1.p1d2.b32-32.fixed"].expect_without == ("vllm#55306",)


def test_granite_geometry_puts_its_hetero_tp_cells_under_the_groups_rule(tmp_path):
    plan = expand(_sweep(tmp_path, "name: g\nmatrix:\n  model: [granite-4.0-h-tiny]\n  tp: [p2d1, p2d2]\n"))
    assert [(r.cell.id, r.rule) for r in plan.rejected] == [("granite-4.0-h-tiny.p2d1.b16-16.fixed", "mamba2-groups")]


def test_pipeline_parallel_flag_names_the_axis_and_quotes_vllms_decode_refusal():
    """Issue 38 shape 5 / issue 37: PP is the prefill_pp axis (its vLLM refusals are the rule
    pipeline-parallel, tests/test_layout_pp.py); the flag in serve_args points there, quoting vLLM
    0.32.0's refusal of decode PP verbatim (the installed nixl/base_worker.py)."""
    import ast
    import re

    from pdsweep.builds.vllmsite import vllm_site
    from pdsweep.sweepfile.guards import RESERVED_FLAGS

    site, _ = vllm_site(sys.executable)
    src = (site / "vllm/distributed/kv_transfer/kv_connector/v1/nixl/base_worker.py").read_text()
    raised = {n.value for n in ast.walk(ast.parse(src)) if isinstance(n, ast.Constant) and isinstance(n.value, str)}
    quoted = re.findall(r'"([^"]+)"', RESERVED_FLAGS["--pipeline-parallel-size"])
    assert quoted == ["NixlPushConnector consumer (decode) does not support pipeline_parallel_size > 1."]
    assert quoted[0] in raised
    assert RESERVED_FLAGS["-pp"].startswith("the prefill_pp axis")
