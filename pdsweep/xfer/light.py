"""A catalogue entry's KV geometry without pydantic, for ``pdsweep bench transfer`` on a machine
that lacks it (the lent device: python 3.12, torch, numpy, PyYAML, no pydantic; docs/gpu-preflight.md).

:func:`load_model` reads ``sweeps/models.yaml`` with PyYAML into :class:`LightModel`, the fields
:func:`pdsweep.plan.geometry.kv_geometry` reads, with the same allowed values as
:class:`pdsweep.sweepfile.catalogue.ModelSpec`; every other key is ignored (the full schema checks them
where pydantic is installed). Bad input raises ``ValueError`` naming the file, model, field and the
allowed values.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

ATTENTION = ("mla", "gqa", "mha")
SSM = ("none", "mamba1", "mamba2", "gdn", "kda", "linear")
DTYPES = ("bfloat16", "float16", "float32")


@dataclass(frozen=True)
class LightMla:
    kv_lora_rank: int
    qk_rope_head_dim: int
    sparse: bool = False
    index_kpool: int | None = None


@dataclass(frozen=True)
class LightAttn:
    head_dim: int


@dataclass(frozen=True)
class LightSsm:
    num_heads: int
    head_dim: int
    state_dim: int
    conv_kernel: int
    conv_dim: int
    state_dtype: str = "float32"
    n_groups: int = 1


@dataclass(frozen=True)
class LightModel:
    """What ``kv_geometry`` reads of a ``ModelSpec``: layer counts, heads, per-token MLA latent
    (elements), K/V head size (elements), SSM state shape (elements), dtypes."""

    attention: str
    num_layers: int
    ssm: str = "none"
    attention_layers: int | None = None
    ssm_layers: int | None = None
    num_attention_heads: int | None = None
    num_kv_heads: int | None = None
    dtype: str = "bfloat16"
    mla: LightMla | None = None
    attn: LightAttn | None = None
    ssm_state: LightSsm | None = None

    @property
    def is_hybrid(self) -> bool:
        return self.ssm != "none"


def _sub(cls: type, raw: Any, where: str) -> Any:
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise ValueError(f"{where}: expected a mapping, got {raw!r}")
    fields = cls.__dataclass_fields__  # type: ignore[attr-defined]
    bad = sorted(set(raw) - set(fields))
    if bad:
        raise ValueError(f"{where}: unknown field(s) {', '.join(bad)} (allowed: {', '.join(fields)})")
    for k, v in raw.items():
        if k == "sparse" and not isinstance(v, bool):
            raise ValueError(f"{where}.{k}: expected true or false, got {v!r}")
        if k in ("state_dtype", "sparse") or (k == "index_kpool" and v is None):
            continue
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise ValueError(f"{where}.{k}: expected a non-negative integer, got {v!r}")
    if "state_dtype" in raw and raw["state_dtype"] not in DTYPES:
        raise ValueError(f"{where}.state_dtype: {raw['state_dtype']!r} (allowed: {', '.join(DTYPES)})")
    return cls(**raw)


def _choice(raw: dict[str, Any], key: str, allowed: tuple[str, ...], where: str, default: str | None = None) -> str:
    v = raw.get(key, default)
    if v not in allowed:
        raise ValueError(f"{where}.{key}: {v!r} (allowed: {', '.join(allowed)})")
    return str(v)


def load_model(path: Path, name: str) -> LightModel:
    """Model ``name`` of the catalogue (or sweep file with a ``models:`` section) at ``path``.
    Raises ``ValueError`` for an unknown model (listing the known ones) or a bad field."""
    import yaml

    data = yaml.safe_load(Path(path).read_text()) or {}
    models = data.get("models") or {}
    if name not in models:
        raise ValueError(f"{path}: unknown model '{name}' (allowed: {', '.join(models)})")
    raw = models[name]
    where = f"{path}: models.{name}"
    ints: dict[str, int | None] = {}
    for k in ("num_layers", "attention_layers", "ssm_layers", "num_attention_heads", "num_kv_heads"):
        v = raw.get(k)
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 0):
            raise ValueError(f"{where}.{k}: expected a non-negative integer, got {v!r}")
        ints[k] = v
    layers = ints.pop("num_layers")
    if layers is None:
        raise ValueError(f"{where}.num_layers: required")
    return LightModel(
        num_layers=layers,
        attention=_choice(raw, "attention", ATTENTION, where),
        ssm=_choice(raw, "ssm", SSM, where, "none"),
        dtype=_choice(raw, "dtype", DTYPES, where, "bfloat16"),
        mla=_sub(LightMla, raw.get("mla"), f"{where}.mla"),
        attn=_sub(LightAttn, raw.get("attn"), f"{where}.attn"),
        ssm_state=_sub(LightSsm, raw.get("ssm_state"), f"{where}.ssm_state"),
        **ints,  # the optional int fields, checked above
    )
