"""KV-transfer figures of one load repeat from the timed READ lines of its decode logs
(:func:`pdsweep.core.logscan.nixl_read_records`, written by :mod:`pdsweep.engine.readlog`).

GB/s: pdsweep reports ``gbps_union`` = bytes / wall-clock length of the union of the READ
intervals (overlapping READs count once). vLLM's NIXL stats ("Throughput (MB/s)",
``kv_connector/v1/nixl/stats.py`` ``NixlKVConnectorStats``) and pdsweep's older ``gbps_xfer``
divide by the *sum* of durations, which understates the rate by the mean number of READs in
flight (vllm issue 48224); it is kept as ``gbps_sum``, and ``in_flight_mean = sum_s / union_s``.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from pdsweep.core.stats import union_seconds


def _pcts(xs: list[float]) -> dict[str, float | None]:
    if not xs:
        return {"mean": None, "p50": None, "p90": None, "p99": None}
    import numpy as np

    a = np.asarray(xs, dtype=float)
    return {
        "mean": float(a.mean()),
        **{f"p{q}": float(np.percentile(a, q)) for q in (50, 90, 99)},
    }


def read_stats(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Figures of the READs in ``records`` (one load repeat): counts, ``bytes``, ``union_s`` and
    ``sum_s`` (s), ``gbps_union`` / ``gbps_sum`` (GB/s, 1e9 bytes), ``in_flight_mean``,
    ``reads_per_request`` / ``descriptors_per_request`` (requests: distinct request ids),
    ``xfer_ms_per_request`` (ms: union of each request's READs; mean/p50/p90/p99) and
    ``by_prefill_rank`` (prefill TP rank -> reads, bytes, descriptors, per request).
    Rates and ratios are None when there is nothing to divide by."""
    n = len(records)
    nbytes = sum(r["bytes"] for r in records)
    descs = sum(r["descs"] for r in records)
    spans = [(r["start_s"], r["end_s"]) for r in records]
    union, total = union_seconds(spans), sum(e - s for s, e in spans)
    by_req: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for r in records:
        by_req[r["req"]].append((r["start_s"], r["end_s"]))
    nreq = len(by_req)
    ranks: dict[str, dict[str, Any]] = {}
    for r in records:
        x = ranks.setdefault(r["rank"], {"reads": 0, "bytes": 0, "descriptors": 0, "_reqs": set()})
        x["reads"] += 1
        x["bytes"] += r["bytes"]
        x["descriptors"] += r["descs"]
        x["_reqs"].add(r["req"])
    for x in ranks.values():
        k = len(x.pop("_reqs"))
        x["reads_per_request"] = x["reads"] / k
        x["descriptors_per_request"] = x["descriptors"] / k

    def div(a: float, b: float) -> float | None:
        return a / b if b > 0 else None

    return {
        "reads": n,
        "bytes": nbytes,
        "descriptors": descs,
        "requests": nreq,
        "union_s": union,
        "sum_s": total,
        "in_flight_mean": div(total, union),
        "gbps_union": div(nbytes, union * 1e9),
        "gbps_sum": div(nbytes, total * 1e9),
        "reads_per_request": div(n, nreq),
        "descriptors_per_request": div(descs, nreq),
        "xfer_ms_per_request": _pcts([union_seconds(v) * 1e3 for v in by_req.values()]),
        "by_prefill_rank": dict(sorted(ranks.items(), key=lambda kv: int(kv[0]))),
    }
