"""GLM-5.3-Flash-4L (KDA + sparse DSA MLA, issue 35): its blocks per TP come from vLLM 0.32.0's own
code (the sparse backend's class, ``Platform._align_hybrid_block_size``,
``select_common_block_size``), and NIXL's ``TransferTopology.block_size_ratio``, called on the
installed vLLM, refuses the TP pairs whose blocks do not divide. The catalogue's config.json fields
(transformers' Glm5NextTextConfig) reproduce upstream PR 57537's 4352 / 2176 / 1152 tokens."""

from __future__ import annotations

from pathlib import Path

import pytest

from pdsweep.builds import attnprobe
from pdsweep.plan.blocks import effective_blocks, for_cell
from pdsweep.plan.expand import expand
from pdsweep.sweepfile.sweep import load_catalogue, load_sweep

pytest.importorskip("vllm")
REPO = Path(__file__).resolve().parents[1]
CAT = load_catalogue(REPO / "sweeps" / "models.yaml").models
NIXL = ["--kv-transfer-config", "{}"]  # a KV connector: use_kv_connector in vLLM's selector


def test_glm_blocks_per_tp_come_from_vllms_sparse_backend_and_alignment():
    glm = CAT["glm-5.3-flash-4l"]
    got = {tp: effective_blocks(glm, "cuda", tp, ["--block-size", "128", *NIXL]) for tp in (1, 2, 4)}
    # upstream PR 57537: auto block size 4352 / 2176 / 1152 tokens at TP 1 / 2 / 4
    assert {tp: (e.logical, e.kernel) for tp, e in got.items()} == {1: (4352, 4352), 2: (2176, 2176), 4: (1152, 1152)}
    e = got[2]
    # sparse MLA on SM90: the dense MLA backends say "sparse not supported"; head 512 puts FlashInfer's first
    assert e.backend == "FLASHINFER_MLA_SPARSE_SM90" and e.arch == "sm90"
    assert e.backend_source == "vLLM 0.32.0"
    assert e.blocks_source == "vLLM 0.32.0 Platform._align_hybrid_block_size + select_common_block_size"
    sizes = attnprobe.select((9, 0), use_mla=True, head_size=512, dtype="bfloat16", selected=e.backend, use_sparse=True)
    assert sizes["backends"][0]["sizes"] == {"exact": [], "multiple_of": 64}  # MultipleOf(64): kernel = logical
    dense = attnprobe.select(
        (9, 0), use_mla=True, head_size=512, dtype="bfloat16", selected="FLASHMLA", use_sparse=True
    )
    assert "sparse not supported" in dense["backends"][0]["reasons"]


def test_glm_p2d1_shows_vllm_blocks_and_p4d1_is_refused_with_vllms_message():
    ls = load_sweep(REPO / "sweeps" / "hybrid-mla-mamba.yaml")
    plan = expand(ls)
    cells = {c.id: c for c in plan.pd_cells}
    eff = for_cell(cells["glm-5.3-flash-4l.p2d1.b128-128.fixed"], ls)
    assert (eff["prefill"].logical, eff["prefill"].kernel) == (2176, 2176)
    assert (eff["decode"].logical, eff["decode"].kernel) == (4352, 4352)  # ratio 2: the handshake accepts
    rej = {r.cell.id: r for r in plan.rejected}
    for pair, (d, p) in {"p4d1": (4352, 1152), "p4d2": (2176, 1152), "p1d2": (2176, 4352)}.items():
        r = rej[f"glm-5.3-flash-4l.{pair}.b128-128.fixed"]
        assert r.rule == "block-ratio"
        assert f"'Local block size {d} is not divisible by remote block size {p} or vice versa.' (called here)" in (
            r.reason
        )
    assert attnprobe.block_size_ratio(4352, 2176) == (2, None)


def test_glm_weights_gb_is_the_parameter_count_in_bf16():
    torch = pytest.importorskip("torch")
    cfg = pytest.importorskip("transformers.models.glm5_next.configuration_glm5_next")
    mod = pytest.importorskip("transformers.models.glm5_next.modeling_glm5_next")
    text = cfg.Glm5NextTextConfig(num_hidden_layers=4)
    glm = CAT["glm-5.3-flash-4l"]
    # the catalogue's geometry is these config.json fields
    assert (glm.mla.kv_lora_rank, glm.mla.qk_rope_head_dim, glm.mla.sparse) == (text.kv_lora_rank, 0, True)
    s = glm.ssm_state
    assert (s.num_heads, s.head_dim, s.conv_kernel) == (
        text.linear_num_heads,
        text.linear_head_dim,
        text.linear_conv_kernel_dim,
    )
    assert text.layer_types.count("linear_attention") == glm.ssm_layers == 3
    with torch.device("meta"):
        model = mod.Glm5NextForConditionalGeneration(cfg.Glm5NextConfig(text_config={"num_hidden_layers": 4}))
    n = sum(p.numel() for p in model.parameters())
    assert n == 9_997_232_664
    assert glm.weights_gb == round(n * 2 / 1e9, 0)  # bf16, GB of 1e9 bytes
