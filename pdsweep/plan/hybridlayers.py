"""The non-SSM attention layers of a KDA + MLA hybrid, as vLLM builds them, for vLLM's own block
alignment (:func:`pdsweep.builds.attnprobe.kda_hybrid_block`).

vLLM aligns a hybrid's logical block over *every* non-SSM backend of the model
(``Platform._find_non_ssm_backends``, vllm/platforms/interface.py: the distinct backends of the
attention layers, in layer order; ``_align_hybrid_block_size`` takes the first one's smallest kernel
block and the lcm of all their smallest kernel blocks), and NIXL splits the logical block into the
kernel block of the backends it transfers for (``get_current_attn_backends_and_specs``,
kv_connector/utils.py, skips compressed caches: ``tokens_per_state > 1``). Resolving the model class
needs the CUDA kernels, so these layers are listed here, each with the vLLM file it comes from.

GLM-5.3-Flash (``Glm5NextForCausalLM``, vllm/models/glm5next/common/attention.py, vLLM 0.32.0 to
0.34.0): a sparse (DSA, ``index_topk`` set) layer builds its ``Indexer`` before its
``MultiHeadLatentAttentionWrapper``; the indexer holds ``Glm5NextIndexerCache``
(``get_attn_backend``: ``Glm5NextIndexerBackend``, kernel blocks ``index_kpool x (32, 64)``, a
compressed cache: ``tokens_per_state = index_kpool``) and ``Glm5NextTailCache``
(``KpoolTailBackend``, ``[MultipleOf(1)]``). Kimi-Linear (``KimiLinearForCausalLM``): one MLA
backend.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

from pdsweep.core.errors import UserError

if TYPE_CHECKING:
    from pdsweep.sweepfile.sweep import ModelSpec

INDEXER = "vllm.v1.attention.backends.mla.indexer:Glm5NextIndexerBackend"
KPOOL_TAIL = "vllm.v1.attention.backends.mla.indexer:KpoolTailBackend"
_KPOOL_INDEXER_ARCHS = frozenset({"Glm5NextForCausalLM", "Glm5NextForConditionalGeneration"})


class Layers(NamedTuple):
    """``backends``: the non-SSM backends in layer order (``AttentionBackendEnum`` names or
    ``module:Class``); ``transfer``: those NIXL splits blocks for; ``index_kpool``: config.json's
    ``index_kpool`` (tokens per indexer state), None without a kpool indexer."""

    backends: tuple[str, ...]
    transfer: tuple[str, ...]
    index_kpool: int | None = None


def kda_mla_layers(architecture: str, mla_backend: str, sparse: bool, index_kpool: int | None) -> Layers | str:
    """The :class:`Layers` of a KDA + MLA hybrid whose MLA layers got ``mla_backend`` (vLLM's
    selector's choice). A string (why) where the model's layers are not known well enough: a
    GLM-5.3 sparse model without ``index_kpool`` in the catalogue (its indexer's kernel blocks are
    ``index_kpool`` x (32, 64) tokens)."""
    if sparse and architecture in _KPOOL_INDEXER_ARCHS:
        if not index_kpool:
            return (
                f"{architecture}'s sparse indexer (Glm5NextIndexerBackend) aligns the block to index_kpool x 32 "
                "tokens; the catalogue's mla.index_kpool (config.json index_kpool) is missing"
            )
        return Layers((INDEXER, KPOOL_TAIL, mla_backend), (KPOOL_TAIL, mla_backend), index_kpool)
    return Layers((mla_backend,), (mla_backend,))


def hybrid_unverified(model: ModelSpec, backend_source: str) -> str | None:
    """Why vLLM's own hybrid alignment is not asked for ``model`` on CUDA (None: it is): only KDA + MLA
    hybrids have a probe (:func:`vllm_kda_blocks`), and only with the backend vLLM chose."""
    if model.ssm != "kda" or model.attention != "mla":
        return f"vLLM's hybrid alignment is asked for KDA + MLA models only (this one: {model.ssm} + {model.attention})"
    if not backend_source.startswith("vLLM"):
        return "the attention backend is not vLLM's verified choice here (see unverified)"
    return None


def vllm_kda_blocks(
    model: ModelSpec, tp: int, block: int, backend: str, dtypes: tuple[str, str, str | None]
) -> tuple[int, int] | str:
    """``(logical, kernel)`` blocks (tokens) of a KDA + MLA hybrid on CUDA from vLLM's own
    ``Platform._align_hybrid_block_size`` and ``select_common_block_size``
    (:func:`pdsweep.builds.attnprobe.kda_hybrid_block`) over the model's non-SSM backends
    (:func:`kda_mla_layers`; ``backend``: the MLA layers' backend vLLM chose), with the catalogue's
    config.json fields (``mla``, ``ssm_state``). ``dtypes``: ``(model dtype, --kv-cache-dtype,
    --mamba-ssm-cache-dtype or None)``. A string saying why where vLLM could not answer (its probe's
    error, vLLM not importable, geometry missing). Raises ``ValueError`` with vLLM's message when vLLM
    refuses the block (no common kernel block, an aligned block a backend rejects)."""
    from pdsweep.builds import attnprobe

    s, mla = model.ssm_state, model.mla
    if s is None or mla is None:
        return "catalogue entry lacks ssm_state or mla"
    layers = kda_mla_layers(model.architecture, backend, mla.sparse, mla.index_kpool)
    if isinstance(layers, str):
        return layers
    dtype, kv_dtype, ssm_flag = dtypes
    default = "auto" if s.state_dtype == "float32" else s.state_dtype  # KDA's auto temporal state: float32
    ssm_dtype = ssm_flag if ssm_flag not in (None, "auto") else default
    try:
        out = attnprobe.kda_hybrid_block(
            layers,
            tp=tp,
            block_size=block,
            head_size=mla.kv_lora_rank + mla.qk_rope_head_dim,  # ModelConfig.get_head_size for MLA
            ssm=(s.num_heads, s.head_dim, s.conv_kernel),
            dtypes=(dtype, kv_dtype, str(ssm_dtype)),
            architecture=model.architecture,
        )
    except (UserError, ValueError) as e:
        return f"vLLM's Platform._align_hybrid_block_size could not be called here: {e}"
    if out["kernel"] is None:
        raise ValueError(f"{out['kernel_error']} (vLLM vllm/platforms/interface.py, vllm/v1/worker/utils.py)")
    return int(out["logical"]), int(out["kernel"])
