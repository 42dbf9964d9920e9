"""Read back the block sizes a running vLLM instance really uses (its ``/metrics`` and
log), to compare with what :mod:`pdsweep.plan.blocks` planned."""

from __future__ import annotations

import re
from typing import Any

CACHE_INFO_METRIC = "vllm:cache_config_info"  # labels: every CacheConfig field (v1/metrics/loggers.py)
# nixl/base_worker.py _sync_block_size_with_kernel (logged only when they differ)
_KERNEL_LOG = re.compile(r"logical block size \((\d+)\) does not match physical kernel block size \((\d+)\)")
# vllm/platforms/interface.py _align_hybrid_block_size
_RAISE_LOG = re.compile(r"Setting attention block size to (\d+) tokens")


def runtime_blocks(metrics_text: str | None, log_text: str, nixl: bool) -> dict[str, Any]:
    """What an instance really runs with: ``logical`` from ``vllm:cache_config_info``'s
    ``block_size`` label (the engine core's value, synced to the front end after the hybrid
    raise: ``core_client.py``), else the last "Setting attention block size to N tokens"
    log line; ``kernel`` from NIXL's "logical block size (L) does not match physical kernel
    block size (K)" line, else ``logical`` for a NIXL instance (it logs only a mismatch)
    and None for a single instance. Values not found are None."""
    from prometheus_client.parser import text_string_to_metric_families

    logical, source = None, None
    if metrics_text:
        for fam in text_string_to_metric_families(metrics_text):
            for s in fam.samples:
                if s.name.startswith(CACHE_INFO_METRIC) and s.labels.get("block_size", "").isdigit():
                    logical, source = int(s.labels["block_size"]), CACHE_INFO_METRIC
    if logical is None and (m := _RAISE_LOG.findall(log_text)):
        logical, source = int(m[-1]), "log"
    k = _KERNEL_LOG.findall(log_text)
    kernel = int(k[-1][1]) if k else (logical if nixl else None)
    return {"logical": logical, "kernel": kernel, "source": source}


def mismatches(planned: dict[str, Any], runtime: dict[str, Any]) -> list[str]:
    """``"logical: planned 1920, vLLM 2048"`` for each size both sides know and disagree on."""
    return [
        f"{k}: planned {planned.get(k)}, vLLM {runtime.get(k)}"
        for k in ("logical", "kernel")
        if planned.get(k) is not None and runtime.get(k) is not None and planned[k] != runtime[k]
    ]
