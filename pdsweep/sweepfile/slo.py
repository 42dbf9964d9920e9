"""A latency SLO: ``"ttft_p90=500,tpot_p90=50"``, each limit in ms that a load point's mean
percentile must be at or below (``pdsweep best --slo``, ``bench.slos``; judged by
:func:`pdsweep.judge.pareto.best`). The percentiles are those pdsweep asks ``vllm bench serve``
for (``--metric-percentiles 50,90,99``, :mod:`pdsweep.measure.benchserve`)."""

from __future__ import annotations

from pdsweep.core.errors import UserError
from pdsweep.core.stats import num

LATENCY_METRICS = ("ttft", "tpot", "itl", "e2el")
PERCENTILES = ("p50", "p90", "p99")
SLO_KEYS = tuple(f"{m}_{p}" for m in LATENCY_METRICS for p in PERCENTILES)


def parse_slo(text: str) -> dict[str, float]:
    """``"ttft_p90=500,tpot_p90=50"`` -> ``{"ttft_p90": 500.0, "tpot_p90": 50.0}`` (ms, each a
    point's mean percentile must be at or below). Raises ``UserError`` naming the metric and the
    allowed keys for an unknown key, a missing or non-positive value, a metric given twice, or an empty SLO."""
    out: dict[str, float] = {}
    for part in (p.strip() for p in text.split(",")):
        key, eq, val = part.partition("=")
        key = key.strip()
        if key not in SLO_KEYS:
            raise UserError(f"--slo: {key or part!r} is not a metric (allowed: {', '.join(SLO_KEYS)})")
        value = num(_float(val)) if eq else None
        if value is None or value <= 0:
            raise UserError(f"--slo: {key} needs a limit in ms > 0, e.g. {key}=500 (got {part!r})")
        if key in out:  # the second would silently replace the first
            raise UserError(f"--slo: {key} given twice ({out[key]:g} and {value:g}; allowed: one limit per metric)")
        out[key] = value
    if not out:
        raise UserError(f"--slo: no metric given (allowed: {', '.join(SLO_KEYS)})")
    return out


def _float(s: str) -> float | None:
    try:
        return float(s)
    except ValueError:
        return None
