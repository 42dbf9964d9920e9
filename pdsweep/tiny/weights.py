"""A tiny checkpoint's seeded random weights and ``config.json``, in Hugging Face layout, from
:func:`pdsweep.tiny.config.config_params`: transformers' own config classes and
``_init_weights`` (``initializer_range`` 0.2, float32), so the next-token distribution is
peaked and deterministic for a seed."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pdsweep.sweepfile.catalogue import ModelSpec
from pdsweep.tiny.config import MLA_KEYS, SHAPE_KEYS, mamba2_mixer_config


def write_kimi_config(params: dict[str, Any], model: ModelSpec, out: Path) -> None:
    """``out/config.json`` of a kind whose ``model_type`` is ``kimi_linear`` (kimi_linear,
    mla_mamba2: vLLM's ``is_deepseek_mla`` keys on it), float32, ``params`` in order."""
    cfg = {
        "architectures": [model.architecture],
        "model_type": "kimi_linear",
        "dtype": "float32",
        "torch_dtype": "float32",
        **params,
    }
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")


def _mla_mamba2_sources(params: dict[str, Any], seed: int) -> tuple[Any, Any]:
    """The two seeded transformers models an mla_mamba2 checkpoint's weights come from:
    DeepSeek-V2 (dense MLP on every layer) and an all-Mamba2 NemotronH of the same width."""
    import torch
    import transformers

    common = {k: params[k] for k in (*SHAPE_KEYS, "initializer_range")}
    torch.manual_seed(seed)
    ds = transformers.AutoModelForCausalLM.from_config(
        transformers.DeepseekV2Config(  # type: ignore[call-arg]  # rope_theta: legacy, via __post_init__(**kwargs)
            **common,
            **{k: params[k] for k in MLA_KEYS},
            first_k_dense_replace=params["num_hidden_layers"],
            n_routed_experts=4,
            n_shared_experts=1,
            num_experts_per_tok=2,
            moe_intermediate_size=64,
            rope_theta=10000.0,
        ),
        dtype=torch.float32,
    )
    nh = transformers.AutoModelForCausalLM.from_config(
        transformers.NemotronHConfig(
            **common,
            **mamba2_mixer_config(params),
            expand=max(1, params["mamba_num_heads"] * params["mamba_head_dim"] // params["hidden_size"]),
            chunk_size=64,
            use_conv_bias=True,
            use_bias=False,
        ),
        dtype=torch.float32,
    )
    return ds, nh


def save_mla_mamba2(params: dict[str, Any], model: ModelSpec, out: Path) -> None:
    """Weights of ``pdsweep.engine.cpu_models.mla_mamba2`` in Hugging Face layout, from two seeded
    transformers models of the same width: DeepSeek-V2 (embeddings, norms, dense MLPs, the MLA
    ``self_attn`` of full-attention layers) and NemotronH (the Mamba2 ``mixer`` of the others,
    ``backbone.layers.N.mixer.*`` or ``model.layers.N.mixer.*``, written as the latter)."""
    from safetensors.torch import save_file

    assert model.tiny is not None
    types = params["layer_types"]
    ds, nh = _mla_mamba2_sources(params, model.tiny.seed)
    tensors = {}
    for k, v in ds.state_dict().items():
        if k.startswith("model.layers.") and ".self_attn." in k and types[int(k.split(".")[2])] != "full_attention":
            continue
        tensors[k] = v
    for k, v in nh.state_dict().items():  # "backbone." (transformers 4) or "model." (5)
        parts = k.split(".")
        if (
            parts[0] in ("backbone", "model")
            and parts[1] == "layers"
            and parts[3] == "mixer"
            and types[int(parts[2])] == "mamba"
        ):
            tensors[".".join(["model", *parts[1:]])] = v
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "model.safetensors"))
    write_kimi_config(params, model, out)


def save_weights(kind: str, params: dict[str, Any], model: ModelSpec, out: Path) -> None:
    """Seeded random weights of a kind with a transformers class (llama, deepseek_v2,
    nemotron_h, qwen3_next) and their ``config.json``, saved by ``save_pretrained`` into ``out``."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    cls = {
        "llama": transformers.LlamaConfig,
        "deepseek_v2": transformers.DeepseekV2Config,
        "nemotron_h": transformers.NemotronHConfig,
        "qwen3_next": transformers.Qwen3NextConfig,
    }[kind]
    config = cls(**params)
    config.architectures = [model.architecture]
    assert model.tiny is not None
    torch.manual_seed(model.tiny.seed)
    lm = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    lm.save_pretrained(out)
    cfg = json.loads((out / "config.json").read_text())
    cfg["torch_dtype"] = "float32"  # older readers (transformers 4.x, vLLM < 0.11) look here
    if kind == "nemotron_h":  # transformers 5 derives both from layers_block_type; older readers need them
        cfg["hybrid_override_pattern"] = params["hybrid_override_pattern"]
        cfg["num_hidden_layers"] = params["num_hidden_layers"]
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
