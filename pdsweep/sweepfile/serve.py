"""A sweep's vLLM builds (``builds:``), serve-arg variants (``serve_args:``) and per-cell
defaults (``defaults:``): the settings of a cell's deployment."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

from pydantic import Field, create_model, field_validator, model_validator

from pdsweep.sweepfile.axes import AXIS_TYPES, DEFAULTS
from pdsweep.sweepfile.catalogue import Strict as _Strict
from pdsweep.sweepfile.catalogue import validate_nested
from pdsweep.sweepfile.connector import KV_TRANSFER_EXTRA_KEYS, NIXL_EXTRA_KEYS, KvTransferExtra


class BuildSpec(_Strict):
    """A named vLLM build. ``python``/``venv`` unset = the interpreter running pdsweep."""

    python: str | None = None
    venv: str | None = None
    description: str | None = None
    # PR #49297 reverted (``make baseline-env``); None: inferred, see :meth:`is_unfixed`
    unfixed: bool | None = None

    @model_validator(mode="after")
    def _not_both(self) -> BuildSpec:
        if self.python and self.venv:
            raise ValueError("give 'python' or 'venv', not both")
        return self

    def is_unfixed(self, name: str) -> bool:
        """Whether this build is pdsweep's unfixed baseline: ``unfixed`` when given, else
        the build's name or its venv/python path contains "unfixed" (``.venv-unfixed``)."""
        if self.unfixed is not None:
            return self.unfixed
        return any("unfixed" in (x or "").lower() for x in (name, self.venv, self.python))


# KVTransferConfig fields (vllm/config/kv_transfer.py) a sweep may set through
# kv_transfer_extra (kv_connector: NixlConnector or NixlPushConnector only); kv_connector_module_path,
# kv_role and kv_buffer_device define the cell (pdsweep gates on NIXL metrics and its own roles) and are pdsweep's.
# (pdsweep.sweepfile.connector: every key bounded; engine_id is pdsweep's)


class ServeArgsVariant(_Strict):
    """Extra ``vllm serve`` args for both roles, prefill only, decode only; appended
    after pdsweep's own flags, so a repeated flag here wins (argparse keeps the last).
    ``kv_transfer_extra``: keys merged into pdsweep's ``--kv-transfer-config`` JSON
    (``kv_connector_extra_config`` merged key by key), e.g. ``kv_load_failure_policy``."""

    both: list[str] = []
    prefill: list[str] = []
    decode: list[str] = []
    enforce_eager: bool | None = None  # override defaults.enforce_eager (e.g. MTP, CUDA graphs)
    kv_transfer_extra: dict[str, Any] = {}
    # PYTHONOPTIMIZE of decode's vLLM processes (python -O): 1 compiles `assert` out, as users who run
    # vLLM that way do (the unfixed build's `assert len(read_specs) == 1`, docs/integrity.md); 0: as is
    decode_optimize: Literal[0, 1, 2] = 0
    # serve_args variant of the single-instance reference of cells with this variant (None:
    # this one), e.g. `base`, so a fault the variant causes outside PD is not on both sides
    reference: str | None = None

    @field_validator("kv_transfer_extra")
    @classmethod
    def _extra_keys(cls, v: dict[str, Any]) -> dict[str, Any]:
        bad = sorted(set(v) - set(KV_TRANSFER_EXTRA_KEYS))
        if bad:
            raise ValueError(
                f"kv_transfer_extra: key(s) {bad} not allowed "
                f"(allowed: {', '.join(KV_TRANSFER_EXTRA_KEYS)}; "
                "the role, kv_buffer_device and engine_id are pdsweep's)"
            )
        if not isinstance(v.get("kv_connector_extra_config", {}), dict):
            raise ValueError("kv_transfer_extra.kv_connector_extra_config must be a mapping")
        unknown = sorted(set(v.get("kv_connector_extra_config") or {}) - set(NIXL_EXTRA_KEYS))
        if unknown:
            raise ValueError(
                f"kv_transfer_extra.kv_connector_extra_config: key(s) {unknown} unknown "
                f"(allowed: {', '.join(NIXL_EXTRA_KEYS)}: the keys vLLM's NIXL connector reads)"
            )
        extra = v.get("kv_connector_extra_config") or {}
        nulls = [f"kv_transfer_extra.{k}" for k, x in v.items() if x is None]
        nulls += [f"kv_transfer_extra.kv_connector_extra_config.{k}" for k, x in extra.items() if x is None]
        if nulls:  # vLLM's get_from_extra_config would hand its code None, not its default (kv_lease_duration // 6)
            raise ValueError(
                f"{nulls[0]}: null is no value vLLM takes (allowed: a value of the key's type, "
                "pdsweep.sweepfile.connector; leave the key out for vLLM's default)"
            )
        validate_nested(KvTransferExtra, v, "kv_transfer_extra")
        return v


class _Settings(_Strict):
    """``defaults:`` besides each axis's default (:data:`pdsweep.sweepfile.axes.DEFAULTS`)."""

    gpu_memory_utilization: float = Field(default=0.8, gt=0, le=1)
    enforce_eager: bool = True
    max_model_len: int | None = Field(default=None, gt=0)
    max_num_seqs: int | None = Field(default=None, gt=0)
    startup_timeout_s: float = Field(default=1200, gt=0)
    request_timeout_s: float = Field(default=300, gt=0)
    # redeploy a cell whose first request timed out (a hang, never a crash or a wrong answer)
    # up to this many times; every attempt's reason stays in status.json ``retries``
    ready_retries: int = Field(default=0, ge=0, le=3)
    kv_lease_duration_s: int | None = Field(default=None, gt=0)
    # kv_producer/kv_consumer per role ("split"), or kv_both on both (older vLLM, upstream scripts)
    kv_role: Literal["split", "both"] = "split"
    cpu_kvcache_space_gib: int = Field(default=1, ge=1)
    # --num-gpu-blocks-override; None: 256 on CPU (see pdsweep.plan.instance.CPU_NUM_BLOCKS), vLLM's own on GPU
    num_blocks: int | None = Field(default=None, ge=1, le=10_000_000)
    port_base: int = Field(default=20000, ge=1024, le=60000)


if TYPE_CHECKING:

    class Defaults(_Settings):
        """``defaults:`` as mypy sees it: its axes are :data:`pdsweep.sweepfile.axes.DEFAULTS`."""

        def __getattr__(self, name: str) -> Any: ...

else:
    Defaults = create_model("Defaults", __base__=_Settings, **{k: (AXIS_TYPES[k][0], d) for k, d in DEFAULTS.items()})
