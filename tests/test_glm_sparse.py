"""GLM-5.3-Flash-4L (KDA + sparse DSA MLA, issue 35, issue 56): its blocks per TP come from vLLM's own
code (the sparse backend's class, ``Platform._align_hybrid_block_size`` over every non-SSM backend of
the model: the indexer's ``Glm5NextIndexerBackend`` with kernel blocks ``index_kpool x (32, 64)`` and
the kpool tail's ``KpoolTailBackend`` beside the MLA backend, ``select_common_block_size`` over the
backends NIXL splits blocks for), and NIXL's ``TransferTopology.block_size_ratio``, called on the
installed vLLM, refuses the TP pairs whose blocks do not divide. With the indexer (index_kpool 16,
transformers' Glm5NextTextConfig default) vLLM aligns to lcm(64, 16 x 32) = 512 tokens: 4608 / 2560 /
1536 at TP 1 / 2 / 4, not upstream PR 57537's 4352 / 2176 / 1152 (the MLA backend alone)."""

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
    # vLLM's alignment over the MLA, indexer and tail backends: multiples of lcm(64, 16 * 32, 1) = 512 tokens
    assert {tp: (e.logical, e.kernel) for tp, e in got.items()} == {1: (4608, 4608), 2: (2560, 2560), 4: (1536, 1536)}
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


def test_glm_without_index_kpool_is_unverified_not_the_mla_backend_alone():
    """The catalogue's index_kpool is what vLLM's indexer backend reads (hf_text_config.index_kpool):
    without it the blocks are not vLLM's, and the plan says so instead of aligning to the MLA backend alone."""
    glm = CAT["glm-5.3-flash-4l"]
    bare = glm.model_copy(update={"mla": glm.mla.model_copy(update={"index_kpool": None})})
    e = effective_blocks(bare, "cuda", 1, ["--block-size", "128", *NIXL])
    assert e.blocks_source.startswith("unverified: Glm5NextForCausalLM's sparse indexer (Glm5NextIndexerBackend)")
    assert "mla.index_kpool (config.json index_kpool) is missing" in e.blocks_source


def test_glm_rejections_are_vllms_block_ratio_on_the_indexer_aligned_blocks():
    ls = load_sweep(REPO / "sweeps" / "hybrid-mla-mamba.yaml")
    plan = expand(ls)
    cells = {c.id: c for c in plan.pd_cells}
    eff = for_cell(cells["glm-5.3-flash-4l.p4d1.b128-128.fixed"], ls)
    assert (eff["prefill"].logical, eff["prefill"].kernel) == (1536, 1536)
    assert (eff["decode"].logical, eff["decode"].kernel) == (4608, 4608)  # ratio 3: the handshake accepts
    rej = {r.cell.id: r for r in plan.rejected}
    for pair, (d, p) in {"p2d1": (4608, 2560), "p4d2": (2560, 1536), "p1d2": (2560, 4608)}.items():
        r = rej[f"glm-5.3-flash-4l.{pair}.b128-128.fixed"]
        assert r.rule == "block-ratio"
        assert f"'Local block size {d} is not divisible by remote block size {p} or vice versa.' (called here)" in (
            r.reason
        )
    assert attnprobe.block_size_ratio(4608, 1536) == (3, None)
    assert glm_kpool_default() == CAT["glm-5.3-flash-4l"].mla.index_kpool == 16


def glm_kpool_default() -> int:
    """transformers' Glm5NextTextConfig default index_kpool (the checkpoint's config.json is not readable here)."""
    cfg = pytest.importorskip("transformers.models.glm5_next.configuration_glm5_next")
    return int(cfg.Glm5NextTextConfig(num_hidden_layers=4).index_kpool)


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
