"""The transformers config parameters of a tiny checkpoint, one builder per ``tiny.kind``, from
its catalogue entry's dimensions (``sweeps/models.yaml``); the rest are fixed small defaults.

Raises ``UserError`` for an entry lacking a dimension its kind needs, or giving one vLLM's
CPU backends cannot run (head sizes: ``vllm/v1/attention/backends/cpu_attn.py``
``CPUAttentionBackend.get_supported_head_sizes``; the MLA latent:
``backends/mla/cpu_mla.py`` ``CPUMLABackend.get_supported_head_sizes``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pdsweep.core.errors import UserError
from pdsweep.sweepfile.catalogue import ModelSpec
from pdsweep.tiny.tokenizer import BOS_ID, EOS_ID, PAD_ID, VOCAB_SIZE

HIDDEN = 128
INTERMEDIATE = 256
INIT_STD = 0.2  # peaked logits: logit std ~ 0.2 * sqrt(HIDDEN) ~ 2.3
# CPU attention backend head sizes (vllm/v1/attention/backends/cpu_attn.py,
# CPUAttentionBackend.get_supported_head_sizes); MLA latent must be 512 + 64
# (backends/mla/cpu_mla.py, CPUMLABackend.get_supported_head_sizes -> [576]).
CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
CPU_MLA_LATENT = 576
# the shape parameters every kind has (:func:`_common` but initializer_range), and MLA's
SHAPE_KEYS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "max_position_embeddings",
    "tie_word_embeddings",
    "pad_token_id",
    "bos_token_id",
    "eos_token_id",
)
MLA_KEYS = (
    "num_attention_heads",
    "num_key_value_heads",
    "kv_lora_rank",
    "qk_rope_head_dim",
    "qk_nope_head_dim",
    "v_head_dim",
    "q_lora_rank",
)


def _need(value: Any, what: str, name: str) -> Any:
    if value is None:
        raise UserError(f"models.yaml: {name}: tiny checkpoint needs '{what}'")
    return value


def _split_layers(model: ModelSpec, name: str) -> tuple[int, int]:
    """(attention layers, ssm layers) of a hybrid entry; their sum may be < num_layers
    (the rest are MLP-only layers, NemotronH ``-``)."""
    a = _need(model.attention_layers, "attention_layers", name)
    s = _need(model.ssm_layers, "ssm_layers", name)
    if a + s > model.num_layers or a < 1 or s < 1:
        raise UserError(
            f"models.yaml: {name}: attention_layers {a} + ssm_layers {s} "
            f"must be >= 1 each and fit in num_layers {model.num_layers}"
        )
    return a, s


def _interval_layers(model: ModelSpec, name: str, what: str) -> tuple[int, int]:
    """(attention layers, interval) for kinds with one attention layer every ``interval``
    layers and SSM layers elsewhere; raises ``UserError`` when the counts do not tile."""
    a, s = _split_layers(model, name)
    if a + s != model.num_layers or model.num_layers % a:
        raise UserError(
            f"models.yaml: {name}: {what} needs attention_layers + ssm_layers = num_layers "
            "and num_layers a multiple of attention_layers (one attention layer every "
            "num_layers/attention_layers)"
        )
    return a, model.num_layers // a


def _mamba2_state(model: ModelSpec, name: str) -> Any:
    ssm = _need(model.ssm_state, "ssm_state", name)
    if ssm.conv_dim != ssm.num_heads * ssm.head_dim + 2 * ssm.n_groups * ssm.state_dim:
        raise UserError(
            f"models.yaml: {name}: ssm_state.conv_dim must be num_heads*head_dim + 2*n_groups*state_dim (Mamba2)"
        )
    return ssm


def _gqa_dims(model: ModelSpec, name: str) -> dict[str, int]:
    heads = _need(model.num_attention_heads, "num_attention_heads", name)
    kv = _need(model.num_kv_heads, "num_kv_heads", name)
    head_dim = _need(model.attn, "attn.head_dim", name).head_dim
    if head_dim not in CPU_HEAD_SIZES:
        raise UserError(
            f"models.yaml: {name}: attn.head_dim {head_dim} is not a vLLM CPU attention "
            f"head size (allowed: {', '.join(map(str, CPU_HEAD_SIZES))})"
        )
    if heads % kv:
        raise UserError(f"models.yaml: {name}: num_attention_heads {heads} is not a multiple of num_kv_heads {kv}")
    return {"num_attention_heads": heads, "num_key_value_heads": kv, "head_dim": head_dim}


def _mla_dims(model: ModelSpec, name: str) -> dict[str, Any]:
    mla = _need(model.mla, "mla", name)
    if mla.kv_lora_rank + mla.qk_rope_head_dim != CPU_MLA_LATENT:
        raise UserError(
            f"models.yaml: {name}: mla kv_lora_rank + qk_rope_head_dim must be {CPU_MLA_LATENT} "
            "(vLLM CPU MLA decode kernel)"
        )
    heads = _need(model.num_attention_heads, "num_attention_heads", name)
    return {
        "num_attention_heads": heads,
        "num_key_value_heads": heads,
        "kv_lora_rank": mla.kv_lora_rank,
        "qk_rope_head_dim": mla.qk_rope_head_dim,
        "qk_nope_head_dim": 128,
        "v_head_dim": 128,
        "q_lora_rank": None,
    }


def _common(model: ModelSpec) -> dict[str, Any]:
    return {
        "vocab_size": VOCAB_SIZE,
        "hidden_size": HIDDEN,
        "intermediate_size": INTERMEDIATE,
        "num_hidden_layers": model.num_layers,
        "max_position_embeddings": model.max_model_len,
        "initializer_range": INIT_STD,
        "tie_word_embeddings": False,
        "pad_token_id": PAD_ID,
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
    }


def mamba2_mixer_config(params: dict[str, Any]) -> dict[str, Any]:
    """``transformers.NemotronHConfig`` keyword arguments of an all-Mamba2 NemotronH whose
    ``mixer`` modules are an mla_mamba2 checkpoint's SSM layers (its own attention heads are
    unused placeholders); ``params``: :func:`config_params` of an mla_mamba2 entry."""
    return {
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "hybrid_override_pattern": "M" * params["num_hidden_layers"],
        "mamba_num_heads": params["mamba_num_heads"],
        "mamba_head_dim": params["mamba_head_dim"],
        "ssm_state_size": params["ssm_state_size"],
        "n_groups": params["n_groups"],
        "conv_kernel": params["conv_kernel"],
    }


def _llama(model: ModelSpec, name: str) -> dict[str, Any]:
    return {**_gqa_dims(model, name), "rope_theta": 10000.0}


def _deepseek_v2(model: ModelSpec, name: str) -> dict[str, Any]:
    # dense MLP on every layer (first_k_dense_replace = num_layers): MLA is what matters
    return dict(
        _mla_dims(model, name),
        first_k_dense_replace=model.num_layers,
        n_routed_experts=4,
        n_shared_experts=1,
        num_experts_per_tok=2,
        moe_intermediate_size=64,
        rope_theta=10000.0,
    )


def _nemotron_h(model: ModelSpec, name: str) -> dict[str, Any]:
    a, s = _split_layers(model, name)
    ssm = _mamba2_state(model, name)
    # mixers interleaved M/*: attention in the middle, MLP ('-') layers after
    mixers = ["M"] * s
    for i in range(a):
        mixers.insert((i + 1) * len(mixers) // (a + 1) + i, "*")
    pattern = "".join(mixers) + "-" * (model.num_layers - a - s)
    return dict(
        _gqa_dims(model, name),
        hybrid_override_pattern=pattern,
        mamba_num_heads=ssm.num_heads,
        mamba_head_dim=ssm.head_dim,
        ssm_state_size=ssm.state_dim,
        n_groups=ssm.n_groups,
        conv_kernel=ssm.conv_kernel,
        expand=max(1, ssm.num_heads * ssm.head_dim // HIDDEN),
        chunk_size=64,
        mlp_hidden_act="relu2",
        mamba_ssm_cache_dtype=ssm.state_dtype,
    )


def _qwen3_next(model: ModelSpec, name: str) -> dict[str, Any]:
    a, interval = _interval_layers(model, name, "Qwen3-Next (full_attention_interval)")
    ssm = _need(model.ssm_state, "ssm_state", name)
    # GDN: recurrent (v_heads, k_dim, v_dim); conv over q, k (k_heads*k_dim) and v
    k_heads = max(1, ssm.num_heads // 2)
    if ssm.conv_dim != 2 * k_heads * ssm.head_dim + ssm.num_heads * ssm.state_dim:
        raise UserError(
            f"models.yaml: {name}: ssm_state.conv_dim must be 2*(num_heads/2)*head_dim + "
            "num_heads*state_dim (GDN with num_heads/2 key heads)"
        )
    return dict(
        _gqa_dims(model, name),
        layer_types=[
            "full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(model.num_layers)
        ],
        linear_num_value_heads=ssm.num_heads,
        linear_num_key_heads=k_heads,
        linear_key_head_dim=ssm.head_dim,
        linear_value_head_dim=ssm.state_dim,
        linear_conv_kernel_dim=ssm.conv_kernel,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=64,
        shared_expert_intermediate_size=64,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        norm_topk_prob=True,
        partial_rotary_factor=0.25,
        rope_theta=10000.0,
    )


def _kimi_linear(model: ModelSpec, name: str) -> dict[str, Any]:
    a, s = _split_layers(model, name)
    ssm = _need(model.ssm_state, "ssm_state", name)
    interval = model.num_layers // a
    full = [i + 1 for i in range(model.num_layers) if (i + 1) % interval == 0][:a]  # 1-based
    return dict(
        _mla_dims(model, name),
        num_experts=4,
        num_experts_per_token=2,
        moe_intermediate_size=64,
        num_shared_experts=1,
        first_k_dense_replace=1,
        moe_layer_freq=1,
        moe_renormalize=True,
        moe_router_activation_func="sigmoid",
        mla_use_nope=True,
        linear_attn_config={
            "kda_layers": [i for i in range(1, model.num_layers + 1) if i not in full],
            "full_attn_layers": full,
            "num_heads": ssm.num_heads,
            "head_dim": ssm.head_dim,
            "short_conv_kernel_size": ssm.conv_kernel,
        },
    )


def _mla_mamba2(model: ModelSpec, name: str) -> dict[str, Any]:
    a, interval = _interval_layers(model, name, "mla_mamba2")
    ssm = _mamba2_state(model, name)
    types = ["full_attention" if (i + 1) % interval == 0 else "mamba" for i in range(model.num_layers)]
    full = [i + 1 for i, t in enumerate(types) if t == "full_attention"]
    # kimi_linear: vLLM's is_deepseek_mla (use_mla) keys on the model_type; linear_attn_config
    # lists the layers as Kimi-Linear does; the Mamba2 fields are NemotronH's
    return dict(
        _mla_dims(model, name),
        hidden_act="silu",
        rms_norm_eps=1e-6,
        layer_types=types,
        rope_parameters={"rope_theta": 10000.0, "rope_type": "default"},
        linear_attn_config={
            "kda_layers": [i for i in range(1, model.num_layers + 1) if i not in full],
            "full_attn_layers": full,
        },
        mamba_num_heads=ssm.num_heads,
        mamba_head_dim=ssm.head_dim,
        ssm_state_size=ssm.state_dim,
        n_groups=ssm.n_groups,
        conv_kernel=ssm.conv_kernel,
        use_conv_bias=True,
        use_bias=False,
        mamba_hidden_act="silu",
        chunk_size=64,
        mamba_ssm_cache_dtype=ssm.state_dtype,
    )


# one builder per TinyKind (pdsweep.sweepfile.catalogue): the kind's own parameters
_KINDS: dict[str, Callable[[ModelSpec, str], dict[str, Any]]] = {
    "llama": _llama,
    "deepseek_v2": _deepseek_v2,
    "nemotron_h": _nemotron_h,
    "qwen3_next": _qwen3_next,
    "kimi_linear": _kimi_linear,
    "mla_mamba2": _mla_mamba2,
}


def config_params(name: str, model: ModelSpec) -> dict[str, Any]:
    """Keyword arguments of the transformers config class for ``model.tiny.kind``: the shape
    every kind shares (:func:`_common`), then the kind's own (one builder each in ``_KINDS``).

    Raises ``UserError`` when the entry has no ``tiny:``, lacks a dimension the kind needs or
    gives one vLLM's CPU backends cannot run.
    """
    if model.tiny is None:
        raise UserError(f"models.yaml: {name}: not a tiny checkpoint (no 'tiny:')")
    build = _KINDS.get(model.tiny.kind)
    if build is None:  # pragma: no cover - TinyKind is a Literal
        raise UserError(f"models.yaml: {name}: unknown tiny kind {model.tiny.kind!r}")
    p = _common(model)
    p.update(build(model, name))
    return p
