"""The PD proxy's Prometheus metrics (``pdsweep_proxy_*``, read by the transfer gate through
:mod:`pdsweep.measure.metrics`) and its error body, shared by the proxy
(:mod:`pdsweep.deploy.proxy`) and the vllm-router passthrough (:mod:`pdsweep.deploy.router`)."""

from __future__ import annotations

import json

from fastapi.responses import JSONResponse
from prometheus_client import CollectorRegistry, Counter, Histogram

# fmt: off
LATENCY_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
                   60.0, 120.0, 300.0)
# fmt: on


def error_body(stage: str, message: str) -> bytes:
    """``{"error": {"message": str, "stage": str}}`` as JSON bytes."""
    return json.dumps({"error": {"message": message, "stage": stage}}).encode()


def error_response(status: int, stage: str, message: str) -> JSONResponse:
    """``{"error": {"message": str, "stage": str}}`` with HTTP ``status``."""
    return JSONResponse({"error": {"message": message, "stage": stage}}, status_code=status)


class ProxyMetrics:
    """The proxy's own Prometheus metrics, in a private registry (one per app; the
    vllm-router passthrough keeps the same ones, :mod:`pdsweep.deploy.router`)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("pdsweep_proxy_requests", "Client requests by endpoint.", ["endpoint"], registry=r)
        self.errors = Counter(
            "pdsweep_proxy_errors",
            "Failed client requests by endpoint and stage (request|prefill|decode|models).",
            ["endpoint", "stage"],
            registry=r,
        )
        self.added = Histogram(
            "pdsweep_proxy_added_latency_seconds",
            "Time spent in the proxy outside the decode leg: prefill leg plus overhead.",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.prefill = Histogram(
            "pdsweep_proxy_prefill_seconds", "Duration of the prefill leg.", buckets=LATENCY_BUCKETS, registry=r
        )
        self.faults = Counter(
            "pdsweep_proxy_faults",
            "Test-only faults injected into decode legs (scramble|scramble_under_load|stale|decode_delay).",
            ["fault"],
            registry=r,
        )
        self.kv_requests = Counter(
            "pdsweep_proxy_kv_requests",
            "PD requests answered by decode whose prompt (prefill usage.prompt_tokens) spans at least one KV block.",
            ["endpoint"],
            registry=r,
        )
