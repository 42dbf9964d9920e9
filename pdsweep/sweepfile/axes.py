"""The axes a sweep's matrix varies, their value types and upper bounds (each with where it
comes from, shown in a bound's error), and the fault axis (its names: :mod:`pdsweep.core.faults`).

Read by :mod:`pdsweep.sweepfile.matrix` (the matrix schema), :mod:`pdsweep.sweepfile.sweep` (bound
errors) and :mod:`pdsweep.plan.expand` (cells).
"""

from __future__ import annotations

import re
from typing import Annotated, Literal

from pydantic import AfterValidator, Field

from pdsweep.core.faults import check_sweep_fault

# Axes a matrix may vary; each is also a field of a cell.
AXES = (
    "model",
    "tp",
    "prefill_tp",
    "decode_tp",
    "block_size",
    "prefill_block_size",
    "decode_block_size",
    "num_prefill",
    "num_decode",
    "decode_dp",
    "prefill_pp",
    "kv_cache_layout",
    "kv_buffer_device",
    "build",
    "serve_args",
    "env",
    "router",
    "fault",
)
EXPECT_KEYS = ("expect", "reason", "ref", "match", "vllm", "without")
MATCH_ANY = "any"  # `match: any`: an expected failure of any signature (loud: the gate summary counts it)
# An include entry with ``kind: ref`` adds no cell: it declares the expectation of the
# single-instance reference cells it matches, by these keys (a reference has no prefill side).
REF_ENTRY_KEYS = ("model", "decode_tp", "block_size", "decode_block_size", "build", "serve_args", "env")
TP_PAIR = re.compile(r"^p([1-9]\d*)d([1-9]\d*)$")
Pos = Annotated[int, Field(ge=1)]
# Upper bounds of the axes, each with where it comes from (shown in the error)
MAX_TP = 64
MAX_BLOCK = 4096
MAX_DP = 8
MAX_PP = 8
MAX_ROLE_INSTANCES = 11
Tp = Annotated[int, Field(ge=1, le=MAX_TP)]
Block = Annotated[int, Field(ge=1, le=MAX_BLOCK)]
Dp = Annotated[int, Field(ge=1, le=MAX_DP)]
Pp = Annotated[int, Field(ge=1, le=MAX_PP)]
# decode's KV cache layout (VLLM_KV_CACHE_LAYOUT; vLLM's legacy names for LBHNC / LBNHC), upstream
# run_accuracy_test.sh DECODER_KV_LAYOUT; prefill keeps the NIXL connector's LBHNC (nixl/connector.py)
KvLayout = Literal["HND", "NHD"]
Instances = Annotated[int, Field(ge=1, le=MAX_ROLE_INSTANCES)]
Router = Literal["pdsweep", "vllm-router"]
# Fault drills: the names, where each acts and the failure it must end with are pdsweep.core.faults
Fault = Annotated[str, AfterValidator(check_sweep_fault)]


BOUND_WHY = {
    "tp": f"a cell runs on one host; pdsweep takes TP up to {MAX_TP} ranks",
    "block": f"tokens per KV block; vLLM's attention backends and hybrid page alignment stay far below {MAX_BLOCK}",
    "pp": f"pipeline stages of one prefill instance; pdsweep takes up to {MAX_PP}",
    "dp": f"pdsweep reserves {MAX_DP} NIXL side-channel ports per instance and vLLM adds the DP index to "
    "VLLM_NIXL_SIDE_CHANNEL_PORT (nixl/base_scheduler.py NixlConnectorScheduler.__init__)",
    "instances": "at most 12 instances per cell (pdsweep.plan.instance.MAX_INSTANCES: the per-cell port block)",
    "port_base": "TCP ports end at 65535 and each concurrent cell takes a block of 200",
}
BOUND_OF = {
    "prefill_tp": "tp",
    "decode_tp": "tp",
    "block_size": "block",
    "prefill_block_size": "block",
    "decode_block_size": "block",
    "decode_dp": "dp",
    "prefill_pp": "pp",
    "num_prefill": "instances",
    "num_decode": "instances",
    "port_base": "port_base",
}
