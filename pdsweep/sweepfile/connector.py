"""The NixlConnector settings a sweep may set through ``serve_args.<variant>.kv_transfer_extra``
(issue 23): every key known and bounded, or refused. Names, types and defaults come from
vLLM: ``KVTransferConfig`` (``vllm/config/kv_transfer.py``) for the top level and the
``get_from_extra_config`` calls of ``kv_connector/v1/nixl/`` (``base_worker.py``,
``base_scheduler.py``, ``push_scheduler.py``, ``connector.py``) for
``kv_connector_extra_config``. ``engine_id`` is pdsweep's: the same id on prefill and decode
would make the two engines one NIXL agent name."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

Positive = Annotated[float, Field(gt=0)]


class NixlExtraConfig(BaseModel):
    """``kv_connector_extra_config`` keys NIXL reads (defaults in vLLM 0.32: kv_lease_duration 30 s,
    num_threads 4, engine_ttl 3600 s, kv_recompute_threshold 64, decoder_kv_blocks_ttl 480 s)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    kv_lease_duration: Annotated[int, Field(gt=0)] | None = None  # s; base_scheduler/base_worker
    backends: Annotated[list[Annotated[str, Field(min_length=1)]], Field(min_length=1)] | None = None  # UCX, ...
    num_threads: Annotated[int, Field(ge=1, le=1024)] | None = None  # base_worker
    engine_ttl: Positive | None = None  # s; base_worker
    kv_recompute_threshold: Annotated[int, Field(ge=0)] | None = None  # tokens; base_scheduler
    decoder_kv_blocks_ttl: Annotated[int, Field(gt=0)] | None = None  # s; base_scheduler
    push_registration_timeout: Positive | None = None  # s; push_scheduler
    enforce_handshake_compat: bool | None = None  # base_worker
    bidirectional_kv_xfer: bool | None = None  # connector


# The NIXL connectors vLLM registers (kv_connector/factory.py: NixlConnector and its alias
# NixlPullConnector read KV from prefill on decode; NixlPushConnector has prefill WRITE it into
# the blocks decode registered, nixl/push_scheduler.py and push_worker.py).
KvConnectorName = Literal["NixlConnector", "NixlPushConnector"]


class KvTransferExtra(BaseModel):
    """Top-level ``KVTransferConfig`` fields a sweep may set (role, buffer device and engine
    id are pdsweep's; ``kv_connector`` only among the NIXL connectors, default NixlConnector)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    kv_connector: KvConnectorName | None = None

    kv_port: Annotated[int, Field(ge=1024, le=65535)] | None = None
    kv_connector_extra_config: NixlExtraConfig | None = None
    enable_permute_local_kv: bool | None = None
    kv_load_failure_policy: Literal["recompute", "fail"] | None = None


KV_TRANSFER_EXTRA_KEYS = tuple(KvTransferExtra.model_fields)
NIXL_EXTRA_KEYS = tuple(NixlExtraConfig.model_fields)
