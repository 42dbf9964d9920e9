"""The axes a sweep's matrix varies, their value types and upper bounds (each with where it
comes from, shown in a bound's error), and the fault axis (its names: :mod:`pdsweep.core.faults`).

Read by :mod:`pdsweep.sweepfile.matrix` (the matrix schema), :mod:`pdsweep.sweepfile.sweep` (bound
errors) and :mod:`pdsweep.plan.expand` (cells).
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, Field

from pdsweep.core.faults import check_sweep_fault
from pdsweep.sweepfile.catalogue import KvBufferDevice

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


def _tp_pair(pair: str) -> str:
    """``pair`` when it is a TP pair ``pPdD`` within :data:`MAX_TP`; raises ``ValueError`` saying how to write one."""
    m = TP_PAIR.fullmatch(pair)
    if not m:
        raise ValueError(f"'{pair}' is not a TP pair; write pPdD with P, D >= 1, e.g. p2d1 (prefill TP 2, decode TP 1)")
    if (top := max(map(int, m.groups()))) > MAX_TP:
        raise ValueError(f"'{pair}': TP {top} is more than {MAX_TP} ({BOUND_WHY['tp']})")
    return pair


TpPair = Annotated[str, AfterValidator(_tp_pair)]
_BOUND_OF_TYPE = ((Tp, "tp"), (Block, "block"), (Dp, "dp"), (Pp, "pp"), (Instances, "instances"))
NO_DEFAULT = object()  # an axis `defaults:` has no field for: the model, and the shorthands

# The axes a sweep's matrix varies, declared once: name -> (the type of one value, its value in
# `defaults:`). The matrix (a non-empty list per axis; one without a default is required), an
# include/exclude entry (one value) and `defaults:` take their fields from here
# (pdsweep.sweepfile.matrix, pdsweep.sweepfile.serve); each axis but the shorthands is a field of
# pdsweep.plan.cell.Cell (tests/test_sweepfile_axes.py holds it). Order: the matrix's product order.
AXIS_TYPES: dict[str, tuple[Any, Any]] = {
    "model": (str, NO_DEFAULT),
    "tp": (TpPair, NO_DEFAULT),  # shorthand: prefill_tp and decode_tp as one pPdD pair
    "prefill_tp": (Tp, 1),
    "decode_tp": (Tp, 1),
    "block_size": (Block, NO_DEFAULT),  # shorthand: both block sizes
    "prefill_block_size": (Block, 16),
    "decode_block_size": (Block, 16),
    "num_prefill": (Instances, 1),
    "num_decode": (Instances, 1),
    "decode_dp": (Dp, 1),  # decode as data parallel (+ expert parallel for MoE models), upstream DP_EP
    "prefill_pp": (Pp, 1),  # prefill pipeline stages (--pipeline-parallel-size), upstream PREFILLER_PP_SIZE
    "kv_cache_layout": (KvLayout, "HND"),  # decode's VLLM_KV_CACHE_LAYOUT, upstream DECODER_KV_LAYOUT
    "kv_buffer_device": (KvBufferDevice | None, None),  # None: cuda on GPU, cpu on CPU
    "build": (str, "fixed"),
    "serve_args": (str, "base"),
    "env": (str, "base"),
    "router": (Router, "pdsweep"),  # the PD router: pdsweep's proxy, or vllm-router (pdsweep.deploy.router)
    "fault": (Fault, "none"),  # a fault drill (pdsweep.run.drills)
}
AXES = tuple(AXIS_TYPES)
SHORTHANDS = {"tp": ("prefill_tp", "decode_tp"), "block_size": ("prefill_block_size", "decode_block_size")}
DEFAULTS = {k: d for k, (_, d) in AXIS_TYPES.items() if d is not NO_DEFAULT}  # the axes `defaults:` sets


BOUND_WHY = {
    "tp": f"a cell runs on one host; pdsweep takes TP up to {MAX_TP} ranks",
    "block": f"tokens per KV block; vLLM's attention backends and hybrid page alignment stay far below {MAX_BLOCK}",
    "pp": f"pipeline stages of one prefill instance; pdsweep takes up to {MAX_PP}",
    "dp": f"pdsweep reserves {MAX_DP} NIXL side-channel ports per instance and vLLM adds the DP index to "
    "VLLM_NIXL_SIDE_CHANNEL_PORT (nixl/base_scheduler.py NixlConnectorScheduler.__init__)",
    "instances": "at most 12 instances per cell (pdsweep.plan.instance.MAX_INSTANCES: the per-cell port block)",
    "port_base": "TCP ports end at 65535 and each concurrent cell takes a block of 200",
}
# the bound (BOUND_WHY) of each bounded axis, by its type, and of defaults.port_base
BOUND_OF = {k: b for k, (t, _) in AXIS_TYPES.items() for ty, b in _BOUND_OF_TYPE if t is ty} | {
    "port_base": "port_base"
}
