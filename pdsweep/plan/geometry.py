"""Per-rank KV-cache layout of a catalogue model at a tensor-parallel (TP) size.

Each model layer contributes one or more *regions*. A region is a pool of equally
sized pages: one page per KV block for attention, one page (state slot) per request for
SSM state. A region is split along one dimension into ``units`` (KV heads, conv
channels, SSM heads; MLA has a single unit) and TP rank ``r`` of ``tp`` holds a
contiguous run of them (:meth:`Region.shard`), so the bytes a rank holds are a slice
of the TP1 page. Page sizes follow vLLM (``vllm/v1/kv_cache_interface.py``):

- MLA (``MLAAttentionSpec``: one latent head of ``head_size = kv_lora_rank +
  qk_rope_head_dim``, ``head_size_v = 0``): ``(kv_lora_rank + qk_rope_head_dim) x
  block_size x dtype`` bytes per block, identical (replicated) on every rank.
- GQA/MHA (``FullAttentionSpec``, split K and V, HND block-contiguous layout so a
  rank's heads are one contiguous run): K and V regions of ``max(1, num_kv_heads/TP) x
  block_size x head_dim x dtype`` bytes each per block (``2 x ...`` per layer).
- SSM (``MambaSpec``, one state page per request; shapes from
  ``MambaStateShapeCalculator.kda_state_shape`` in
  ``vllm/model_executor/layers/mamba/mamba_utils.py``, used by
  ``KimiGatedDeltaNetAttention.get_state_shape`` for Kimi-Linear, upstream
  ``vllm/model_executor/models/kimi_linear.py``): conv state ``(conv_dim/TP,
  conv_kernel-1)`` in the model dtype (DS layout, ``VLLM_SSM_CONV_STATE_LAYOUT=DS``) and
  recurrent state ``(num_heads/TP, head_dim, state_dim)`` in ``state_dtype``.

Simplifications (documented, not hidden): vLLM's hybrid page padding
(``page_size_padded``) is ignored (real page bytes only), and the conv state is one
region, whereas vLLM splits it into per-sub-projection descriptors
(``MambaConvSplitInfo`` in ``kv_connector/v1/ssm_conv_transfer_utils.py``); the bytes
moved per rank are the same.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from pdsweep.core.dtypes import DTYPE_BYTES

if TYPE_CHECKING:  # pydantic is slow to import in every rank process
    from pdsweep.sweepfile.sweep import ModelSpec

RegionKind = Literal["mla", "k", "v", "conv", "recurrent"]
ATTENTION_KINDS = ("mla", "k", "v")
SSM_KINDS = ("conv", "recurrent")


@dataclass(frozen=True)
class Region:
    """One per-layer cache region (a pool of pages of one kind).

    ``units`` is the size of the TP-split dimension (1 for MLA: never split) and
    ``unit_bytes`` the bytes of one unit in one page, so a TP1 page is
    ``units * unit_bytes`` bytes.
    """

    index: int
    layer: int  # 0-based model layer (vLLM ``model.layers.<layer>``)
    kind: RegionKind
    units: int
    unit_bytes: int

    @property
    def per_request(self) -> bool:
        """True for SSM state (one page per request, vLLM ``MambaSpec``), False for
        attention (one page per KV block)."""
        return self.kind in SSM_KINDS

    @property
    def is_ssm(self) -> bool:
        return self.kind in SSM_KINDS

    def shard(self, tp: int, rank: int) -> tuple[int, int]:
        """``(first_unit, num_units)`` held by ``rank`` of ``tp``.

        ``tp <= units``: an even split (``units % tp == 0`` is checked by
        :func:`kv_geometry`). ``tp > units``: one unit, ``rank * units // tp``, shared
        by several ranks (replicated, as vLLM does for MLA and for GQA with fewer KV
        heads than ranks: ``TransferTopology.local_physical_heads``).
        """
        if not 0 <= rank < tp:
            raise ValueError(f"rank {rank} is not in [0, {tp})")
        if tp <= self.units:
            n = self.units // tp
            return rank * n, n
        return rank * self.units // tp, 1

    def page_bytes(self, tp: int) -> int:
        """Bytes of one page (block or state slot) on one rank of ``tp``."""
        return self.shard(tp, 0)[1] * self.unit_bytes

    def replicated(self, tp: int) -> bool:
        """Whether several ranks of ``tp`` hold the same units (MLA always)."""
        return tp > self.units or self.kind == "mla"

    def holders(self, tp: int, unit: int) -> list[int]:
        """Ranks of ``tp`` holding ``unit``."""
        return [r for r in range(tp) if self.shard(tp, r)[0] <= unit < sum(self.shard(tp, r))]


@dataclass(frozen=True)
class KVGeometry:
    """All cache regions of a model at one block size (TP-independent description).

    ``regions`` lists attention regions first, then SSM regions (vLLM registers the
    attention descriptors before the Mamba ones: ``_build_local_splits_from_plan``).
    """

    model: str
    block_size: int
    attention: Literal["mla", "gqa", "mha"]
    has_ssm: bool
    num_kv_heads: int  # total KV heads (1 for MLA, as vLLM's TransferTopology sees it)
    regions: tuple[Region, ...]

    @property
    def is_mla(self) -> bool:
        return self.attention == "mla"

    def rank_bytes(self, tp: int, rank: int = 0) -> dict[str, int]:
        """Bytes per page on ``rank`` of ``tp``, summed by kind: ``attention_per_block``
        (all layers, one block) and ``ssm_per_request`` (all layers, one request)."""
        out = {"attention_per_block": 0, "ssm_per_request": 0}
        for reg in self.regions:
            n = reg.shard(tp, rank)[1] * reg.unit_bytes
            out["ssm_per_request" if reg.is_ssm else "attention_per_block"] += n
        return out


def layer_positions(num_layers: int, attention_layers: int, ssm_layers: int) -> tuple[list[int], list[int]]:
    """0-based layer indices of attention and SSM layers.

    Attention at 1-based ``ceil((i+1) * num_layers / attention_layers)``, SSM in the
    remaining layers in order. Exact for Kimi-Linear (27 layers, MLA at 1-based
    4,8,12,16,20,24,27: ``full_attn_layers`` of its config); an even spread otherwise.
    """
    if attention_layers + ssm_layers > num_layers:
        raise ValueError(
            f"attention_layers ({attention_layers}) + ssm_layers ({ssm_layers}) exceed num_layers ({num_layers})"
        )
    attn = [math.ceil((i + 1) * num_layers / attention_layers) - 1 for i in range(attention_layers)]
    rest = [i for i in range(num_layers) if i not in set(attn)]
    return attn, rest[:ssm_layers]


def _need(model: ModelSpec, name: str, field: str, why: str) -> None:
    if getattr(model, field) is None:
        raise ValueError(f"model '{name}': catalogue field '{field}' is missing ({why}); add it to sweeps/models.yaml")


def kv_geometry(name: str, model: ModelSpec, block_size: int, tps: tuple[int, ...] = ()) -> KVGeometry:
    """Cache regions of catalogue model ``name`` with ``block_size`` tokens per block.

    ``tps``: TP sizes the layout must support; each must divide the split dimension of
    every sharded region (vLLM ``divide`` asserts the same in ``kda_state_shape``).

    Raises ``ValueError`` naming the missing catalogue field (``mla``, ``attn``,
    ``num_kv_heads``, ``ssm_state``, ``attention_layers``, ``ssm_layers``) or the TP
    size that does not divide a dimension.
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    dt = DTYPE_BYTES[model.dtype]
    if model.is_hybrid:
        _need(model, name, "ssm_state", f"per-request {model.ssm} state geometry")
        _need(model, name, "attention_layers", "how many layers are attention layers")
        _need(model, name, "ssm_layers", f"how many layers are {model.ssm} layers")
        attn_layers, ssm_layers = layer_positions(model.num_layers, model.attention_layers, model.ssm_layers)  # type: ignore[arg-type]
    else:
        attn_layers, ssm_layers = list(range(model.attention_layers or model.num_layers)), []

    regions: list[Region] = []
    if model.attention == "mla":
        _need(model, name, "mla", "kv_lora_rank and qk_rope_head_dim of the MLA latent")
        latent = model.mla.kv_lora_rank + model.mla.qk_rope_head_dim  # type: ignore[union-attr]
        num_kv_heads = 1
        for layer in attn_layers:
            regions.append(Region(len(regions), layer, "mla", 1, latent * block_size * dt))
    else:
        _need(model, name, "attn", "head_dim of the K/V heads")
        num_kv_heads = model.num_kv_heads or (model.num_attention_heads if model.attention == "mha" else None)  # type: ignore[assignment]
        if num_kv_heads is None:
            _need(model, name, "num_kv_heads", "K/V heads of GQA attention")
        unit = block_size * model.attn.head_dim * dt  # type: ignore[union-attr]
        for layer in attn_layers:
            for kind in ("k", "v"):
                regions.append(Region(len(regions), layer, kind, num_kv_heads, unit))
    if model.is_hybrid:
        s = model.ssm_state
        assert s is not None
        for layer in ssm_layers:
            regions.append(Region(len(regions), layer, "conv", s.conv_dim, (s.conv_kernel - 1) * dt))
            state_bytes = s.head_dim * s.state_dim * DTYPE_BYTES[s.state_dtype]
            regions.append(Region(len(regions), layer, "recurrent", s.num_heads, state_bytes))

    for tp in tps:
        if tp < 1:
            raise ValueError(f"TP size must be >= 1, got {tp}")
        for reg in regions:
            if reg.kind in SSM_KINDS and reg.units % tp:
                field = "conv_dim" if reg.kind == "conv" else "num_heads"
                raise ValueError(f"model '{name}': ssm_state.{field}={reg.units} is not divisible by TP {tp}")
            if reg.kind in ("k", "v") and tp < reg.units and reg.units % tp:
                raise ValueError(f"model '{name}': num_kv_heads={reg.units} is not divisible by TP {tp}")
    return KVGeometry(
        model=name,
        block_size=block_size,
        attention=model.attention,
        has_ssm=model.is_hybrid,
        num_kv_heads=num_kv_heads,
        regions=tuple(regions),
    )
