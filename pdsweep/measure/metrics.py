"""Scrape vLLM ``/metrics``, take before/after deltas, and summarize KV transfer figures.

Metric names (vLLM ``vllm/distributed/kv_transfer/kv_connector/v1/nixl/stats.py`` and
``vllm/v1/metrics/loggers.py``; labels ``model_name``, ``engine``):

- NIXL histograms, one sample per transfer on the side that initiates it (decode READs
  in pull mode; prefill WRITEs in push mode, ``nixl/push_worker.py``):
  ``vllm:nixl_xfer_time_seconds``, ``vllm:nixl_post_time_seconds`` (s),
  ``vllm:nixl_bytes_transferred`` (bytes), ``vllm:nixl_num_descriptors``;
- NIXL counters: ``vllm:nixl_num_failed_transfers`` (since vLLM PR 55854 it also counts
  handshake and notification failures: ``stats.py`` ``NixlPromMetrics.observe``),
  ``vllm:nixl_num_failed_notifications``, ``vllm:nixl_num_kv_expired_reqs`` (prefill side),
  ``vllm:nixl_num_notifications_after_expiry`` (prefill side: a decode's completion
  notification for a request whose KV lease had expired, ``pull_worker.py``
  ``_get_new_notifs``; the blocks may have been reused before the READ: a stale read);
- latency histograms (s): ``vllm:time_to_first_token_seconds``,
  ``vllm:request_time_per_output_token_seconds`` (TPOT), ``vllm:inter_token_latency_seconds``
  (ITL), ``vllm:e2e_request_latency_seconds``.

Parsing uses ``prometheus_client.parser`` (no regexes); it strips ``_total`` from counter
family names, so counters are keyed ``vllm:nixl_num_failed_transfers``. A metric that no
instance exposes is ``None`` in every summary, never 0: gates fail closed on ``None``.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

NIXL_XFER_TIME = "vllm:nixl_xfer_time_seconds"
NIXL_POST_TIME = "vllm:nixl_post_time_seconds"
NIXL_BYTES = "vllm:nixl_bytes_transferred"
NIXL_DESCRIPTORS = "vllm:nixl_num_descriptors"
NIXL_FAILED_TRANSFERS = "vllm:nixl_num_failed_transfers"
NIXL_FAILED_NOTIFICATIONS = "vllm:nixl_num_failed_notifications"
NIXL_EXPIRED_REQS = "vllm:nixl_num_kv_expired_reqs"
NIXL_NOTIFS_AFTER_EXPIRY = "vllm:nixl_num_notifications_after_expiry"
TTFT = "vllm:time_to_first_token_seconds"
TPOT = "vllm:request_time_per_output_token_seconds"
ITL = "vllm:inter_token_latency_seconds"
E2E = "vllm:e2e_request_latency_seconds"
# pdsweep's PD proxy (pdsweep/deploy/proxy.py): PD requests whose prompt spans >= 1 block, each of
# which decode must have read KV for (the gate compares it with num_transfers)
PROXY_KV_REQUESTS = "pdsweep_proxy_kv_requests"

ROLES = ("prefill", "decode", "single", "proxy")
KEPT_LABELS = ("model_name", "engine")  # label values recorded on the Snapshot; everything is summed over


@dataclass(frozen=True)
class Histogram:
    """Cumulative histogram: ``buckets`` = ((upper bound, cumulative count), ...), ascending,
    the last bound ``+inf``; ``sum`` of observations (the metric's unit); ``count``."""

    buckets: tuple[tuple[float, float], ...]
    sum: float
    count: float

    def bounds(self) -> tuple[float, ...]:
        return tuple(le for le, _ in self.buckets)

    def mean(self) -> float | None:
        return self.sum / self.count if self.count > 0 else None


@dataclass
class Snapshot:
    """One scrape, summed over label sets: ``counters`` (name without ``_total`` -> value),
    ``gauges`` (name -> value), ``histograms`` (name -> :class:`Histogram`), and ``labels``
    (``model_name`` / ``engine`` -> values seen)."""

    counters: dict[str, float] = field(default_factory=dict)
    gauges: dict[str, float] = field(default_factory=dict)
    histograms: dict[str, Histogram] = field(default_factory=dict)
    labels: dict[str, frozenset[str]] = field(default_factory=dict)


def _metrics_url(url: str) -> str:
    import httpx  # here, not at import: the device check reads parse_ucx_proto_info without httpx

    u = httpx.URL(url)
    return str(u.copy_with(path="/metrics")) if u.path in ("", "/") else url


def scrape_sync(url: str, timeout: float = 10) -> str:
    """GET ``url`` (an instance base URL or its ``/metrics`` URL) -> exposition text, with
    its own client; ``timeout`` in seconds. Raises ``httpx.HTTPError`` (transport errors,
    non-2xx status)."""
    import httpx

    with httpx.Client(timeout=timeout, trust_env=False) as client:
        r = client.get(_metrics_url(url))
        r.raise_for_status()
        return r.text


def _add_hist(a: Histogram | None, b: Histogram, name: str) -> Histogram:
    if a is None:
        return b
    if a.bounds() != b.bounds():
        raise ValueError(f"{name}: bucket bounds differ: {a.bounds()} vs {b.bounds()}")
    return Histogram(
        tuple((le, x + y) for (le, x), (_, y) in zip(a.buckets, b.buckets)), a.sum + b.sum, a.count + b.count
    )


def parse(text: str) -> Snapshot:
    """Prometheus exposition text -> :class:`Snapshot`, summed over label sets.

    Counters, gauges and histograms are kept (summaries and untyped metrics are not).
    Raises ValueError for text prometheus_client cannot parse, or a histogram whose label
    sets have different bucket bounds.
    """
    from prometheus_client.parser import text_string_to_metric_families

    snap = Snapshot()
    seen: dict[str, set[str]] = {k: set() for k in KEPT_LABELS}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            for k in KEPT_LABELS:
                if k in s.labels:
                    seen[k].add(s.labels[k])
        if fam.type == "counter":
            vals = [s.value for s in fam.samples if s.name in (fam.name + "_total", fam.name)]
            snap.counters[fam.name] = snap.counters.get(fam.name, 0.0) + sum(vals)
        elif fam.type == "gauge" and not fam.name.endswith("_created"):  # _created: text-format timestamps
            vals = [s.value for s in fam.samples if s.name == fam.name]
            snap.gauges[fam.name] = snap.gauges.get(fam.name, 0.0) + sum(vals)
        elif fam.type == "histogram":
            for h in _histograms(fam.name, fam.samples):
                snap.histograms[fam.name] = _add_hist(snap.histograms.get(fam.name), h, fam.name)
    snap.labels = {k: frozenset(v) for k, v in seen.items() if v}
    return snap


def _histograms(name: str, samples: Iterable[Any]) -> list[Histogram]:
    """One :class:`Histogram` per label set (labels other than ``le``)."""
    groups: dict[tuple, dict[str, Any]] = {}
    for s in samples:
        key = tuple(sorted((k, v) for k, v in s.labels.items() if k != "le"))
        g = groups.setdefault(key, {"buckets": {}, "sum": 0.0, "count": None})
        if s.name == name + "_bucket":
            g["buckets"][float(s.labels["le"])] = s.value
        elif s.name == name + "_sum":
            g["sum"] = s.value
        elif s.name == name + "_count":
            g["count"] = s.value
    out = []
    for g in groups.values():
        if not g["buckets"]:
            continue  # e.g. only a _created sample
        buckets = tuple(sorted(g["buckets"].items()))
        if not math.isinf(buckets[-1][0]):
            raise ValueError(f"{name}: histogram without a +Inf bucket")
        count = g["count"] if g["count"] is not None else buckets[-1][1]
        out.append(Histogram(buckets, g["sum"], count))
    return out


def delta(before: Snapshot, after: Snapshot) -> Snapshot:
    """``after - before`` for counters and histograms (gauges and labels: ``after``'s).

    A metric only in ``after`` counts from zero. Raises ValueError on a counter reset
    (a counter, bucket or histogram count lower after than before: the instance restarted),
    on a metric present before but gone after, or on changed bucket bounds.
    """
    out = Snapshot(gauges=dict(after.gauges), labels=dict(after.labels))
    gone = (before.counters.keys() - after.counters.keys()) | (before.histograms.keys() - after.histograms.keys())
    if gone:
        raise ValueError(f"metrics gone between scrapes (instance restarted?): {sorted(gone)}")
    for name, v in after.counters.items():
        b = before.counters.get(name, 0.0)
        if v < b:
            raise ValueError(f"counter reset: {name} went from {b} to {v} (instance restarted?)")
        out.counters[name] = v - b
    for name, h in after.histograms.items():
        hb = before.histograms.get(name)
        if hb is None:
            out.histograms[name] = h
            continue
        if hb.bounds() != h.bounds():
            raise ValueError(f"{name}: bucket bounds changed between scrapes")
        buckets = tuple((le, y - x) for (le, x), (_, y) in zip(hb.buckets, h.buckets))
        if h.count < hb.count or any(c < 0 for _, c in buckets):
            raise ValueError(
                f"counter reset: histogram {name} count went from {hb.count} to {h.count} (instance restarted?)"
            )
        out.histograms[name] = Histogram(buckets, h.sum - hb.sum, h.count - hb.count)
    return out


def merge(snaps: Iterable[Snapshot]) -> Snapshot:
    """Sum of snapshots (phases of one instance): counters, gauges, histograms; label values
    united. Raises ValueError for mismatched bucket bounds."""
    out = Snapshot()
    labels: dict[str, set[str]] = {}
    for s in snaps:
        for name, v in s.counters.items():
            out.counters[name] = out.counters.get(name, 0.0) + v
        for name, v in s.gauges.items():
            out.gauges[name] = out.gauges.get(name, 0.0) + v
        for name, h in s.histograms.items():
            out.histograms[name] = _add_hist(out.histograms.get(name), h, name)
        for k, values in s.labels.items():
            labels.setdefault(k, set()).update(values)
    out.labels = {k: frozenset(v) for k, v in labels.items()}
    return out


def histogram_quantile(q: float, buckets: Histogram | Sequence[tuple[float, float]]) -> float | None:
    """Prometheus ``histogram_quantile``: the ``q``-quantile (0 <= q <= 1) by linear
    interpolation inside the bucket holding rank ``q * count``; the lower bound of the
    first bucket is 0. A rank in the +Inf bucket gives the highest finite bound.

    ``buckets``: a :class:`Histogram` or ((upper bound, cumulative count), ...), last bound
    +Inf. Returns None when the count is 0 (or there is no finite bucket). Raises ValueError
    for q outside [0, 1] or no +Inf bucket. Non-monotonic counts are made monotonic, as
    Prometheus does.
    """
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"quantile must be in [0, 1], got {q}")
    raw = buckets.buckets if isinstance(buckets, Histogram) else buckets
    merged: dict[float, float] = {}
    for le, c in raw:
        merged[float(le)] = merged.get(float(le), 0.0) + float(c)  # coalesce duplicate bounds
    bs = sorted(merged.items())
    if not bs or not math.isinf(bs[-1][0]):
        raise ValueError("histogram needs a +Inf bucket")
    mono, hi = [], 0.0
    for le, c in bs:
        hi = max(hi, c)
        mono.append((le, hi))
    total = mono[-1][1]
    if len(mono) < 2 or total <= 0:
        return None
    rank = q * total
    b = next((i for i, (_, c) in enumerate(mono[:-1]) if c >= rank), len(mono) - 1)
    if b == len(mono) - 1:
        return mono[-2][0]
    if b == 0 and mono[0][0] <= 0:
        return mono[0][0]
    start, end, count = 0.0, mono[b][0], mono[b][1]
    if b > 0:
        start = mono[b - 1][0]
        count -= mono[b - 1][1]
        rank -= mono[b - 1][1]
    if count <= 0:  # rank 0 on an empty first bucket
        return start
    return start + (end - start) * (rank / count)


def role_of(name: str) -> str:
    """Role of an instance name (``decode-0`` -> ``decode``); ValueError for an unknown prefix."""
    role = name.split("-", 1)[0]
    if role not in ROLES:
        raise ValueError(f"instance name {name!r} must start with one of {[r + '-' for r in ROLES]}")
    return role


def _hist(snaps: Sequence[Snapshot], name: str) -> Histogram | None:
    found = [s.histograms[name] for s in snaps if name in s.histograms]
    if not found:
        return None
    out = None
    for h in found:
        out = _add_hist(out, h, name)
    return out


def _counter(snaps: Sequence[Snapshot], name: str) -> float | None:
    found = [s.counters[name] for s in snaps if name in s.counters]
    return sum(found) if found else None


def _int(x: float | None) -> int | float | None:
    return int(x) if x is not None and float(x).is_integer() else x


def _gbps(nbytes: float | None, seconds: float | None) -> float | None:
    """Decimal GB/s; None when either is missing or ``seconds`` is not > 0."""
    return nbytes / seconds / 1e9 if nbytes is not None and seconds is not None and seconds > 0 else None


def _summary(
    nixl: Sequence[Snapshot], latency: Sequence[Snapshot], counters: Sequence[Snapshot], wall_s: float
) -> dict[str, Any]:
    xfer, post = _hist(nixl, NIXL_XFER_TIME), _hist(nixl, NIXL_POST_TIME)
    nbytes, descs = _hist(nixl, NIXL_BYTES), _hist(nixl, NIXL_DESCRIPTORS)
    ttft, tpot, itl, e2e = (_hist(latency, n) for n in (TTFT, TPOT, ITL, E2E))
    total_bytes = nbytes.sum if nbytes else None
    xfer_s = xfer.sum if xfer else None

    def q(p: float, h: Histogram | None) -> float | None:
        return histogram_quantile(p, h) if h else None

    return {
        "num_transfers": _int(xfer.count) if xfer else None,
        "bytes": _int(total_bytes),
        "xfer_time_s": xfer_s,
        "post_time_s": post.sum if post else None,
        "gbps_xfer": _gbps(total_bytes, xfer_s),
        "gbps_wall": _gbps(total_bytes, wall_s),
        "xfer_time_p50_s": q(0.5, xfer),
        "xfer_time_p90_s": q(0.9, xfer),
        "xfer_time_p99_s": q(0.99, xfer),
        "descriptors_per_transfer": descs.mean() if descs else None,
        "failed_transfers": _int(_counter(counters, NIXL_FAILED_TRANSFERS)),
        "failed_notifications": _int(_counter(counters, NIXL_FAILED_NOTIFICATIONS)),
        "expired_reqs": _int(_counter(counters, NIXL_EXPIRED_REQS)),
        "notifications_after_expiry": _int(_counter(counters, NIXL_NOTIFS_AFTER_EXPIRY)),
        "kv_requests": _int(_counter(counters, PROXY_KV_REQUESTS)),
        "ttft_mean_s": ttft.mean() if ttft else None,
        "ttft_p50_s": q(0.5, ttft),
        "ttft_p99_s": q(0.99, ttft),
        "tpot_mean_s": tpot.mean() if tpot else None,
        "itl_mean_s": itl.mean() if itl else None,
        "e2e_mean_s": e2e.mean() if e2e else None,
        "num_requests": _int(e2e.count) if e2e else None,
    }


def summarize_transfer(deltas: dict[str, Snapshot], wall_s: float, initiator: str = "decode") -> dict[str, Any]:
    """The ``T`` dict of results/README.md (``transfer.json``) for one phase.

    ``deltas``: instance name (``prefill-N`` / ``decode-N`` / ``single-N``) -> :func:`delta`
    over the phase; ``wall_s``: the phase's wall time in seconds; ``initiator``: the role
    whose instances post the transfers (``decode``; ``prefill`` in push mode).

    NIXL histograms come from the initiator's instances (``num_transfers`` = xfer-time count, ``bytes``,
    ``xfer_time_s`` / ``post_time_s`` = sums, p50/p90/p99 by :func:`histogram_quantile`,
    ``descriptors_per_transfer``); ``gbps_xfer = bytes / xfer_time_s / 1e9``,
    ``gbps_wall = bytes / wall_s / 1e9``. Failure counters are summed over all instances
    (``expired_reqs`` and ``notifications_after_expiry`` are counted on prefill);
    ``kv_requests`` is the PD proxy's count of PD requests whose prompt spans >= 1 block
    (instance ``proxy``). Latency (TTFT mean/p50/p99, TPOT, ITL, E2E means in s;
    ``num_requests`` = E2E count) comes from decode and single instances. A metric absent
    from every relevant instance, or a ratio over a zero count, is None.
    Raises ValueError for an unknown name prefix or mismatched bucket bounds.
    """
    roles = {name: role_of(name) for name in deltas}
    nixl = [s for n, s in deltas.items() if roles[n] == initiator]
    latency = [s for n, s in deltas.items() if roles[n] in ("decode", "single")]
    return _summary(nixl, latency, list(deltas.values()), wall_s)


def instance_summary(name: str, d: Snapshot, wall_s: float) -> dict[str, Any]:
    """``{role, **T}`` from one instance's own metrics, whatever its role (a prefill's TTFT
    is its prefill time)."""
    return {"role": role_of(name), **_summary([d], [d], [d], wall_s)}


def cell_transfer(
    phases: dict[str, dict[str, tuple[Snapshot, Snapshot, float]]], initiator: str = "decode"
) -> dict[str, Any]:
    """The body of ``transfer.json`` (without ``cell_id``/``schema``, added by the caller).

    ``phases``: phase -> instance name -> (before, after, wall_s); ``initiator``: as for
    :func:`summarize_transfer`. Returns
    ``{"phases": {phase: {"wall_s", "instances": {name: instance_summary}, "totals": T}},
    "totals": T}``; a phase's ``wall_s`` is the largest of its instances', the cell's
    totals sum each instance's deltas and the walls over phases. Raises ValueError as
    :func:`delta` and :func:`summarize_transfer` do.
    """
    out: dict[str, Any] = {}
    per_instance: dict[str, list[Snapshot]] = {}
    total_wall = 0.0
    for phase, instances in phases.items():
        deltas = {name: delta(before, after) for name, (before, after, _) in instances.items()}
        wall = max((w for _, _, w in instances.values()), default=0.0)
        out[phase] = {
            "wall_s": wall,
            "instances": {name: instance_summary(name, d, wall) for name, d in deltas.items()},
            "totals": summarize_transfer(deltas, wall, initiator),
        }
        for name, d in deltas.items():
            per_instance.setdefault(name, []).append(d)
        total_wall += wall
    totals = summarize_transfer({name: merge(ds) for name, ds in per_instance.items()}, total_wall, initiator)
    return {"phases": out, "totals": totals}


# ---------------------------------------------------------------- UCX transport
def parse_ucx_proto_info(text: str, op: str = "read") -> list[str]:
    """Transports of UCX's 'remote memory <op>' protocol tables (``UCX_PROTO_INFO=y``
    output; ``op``: ``read`` for pull mode's READs, ``write`` for push mode's WRITEs), e.g.
    ``["cma/memory"]``; empty when none is found."""
    found: list[str] = []
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if f"remote memory {op}" not in line:
            continue
        in_rows = False
        for row in lines[i + 1 : i + 60]:
            cells = [c.strip() for c in row.split("|")[1:-1]]
            if not cells:  # a +----+ border: the one after the rows ends the table
                if in_rows:
                    break
                continue
            if len(cells) == 3 and re.match(r"^\d", cells[0]):
                found.append(cells[2])
                in_rows = True
    return sorted(set(found))


def ucx_transports_from_logs(paths: Iterable[Any], op: str = "read") -> list[str] | None:
    """UCX READ (``op="write"``: WRITE) transports found in instance logs written with
    ``UCX_PROTO_INFO=y`` (e.g. ``["cma/memory"]`` on one host); None when no log has a
    protocol table."""
    found: set[str] = set()
    for p in paths:
        try:
            found |= set(parse_ucx_proto_info(open(p, errors="replace").read(), op))
        except OSError:
            continue
    return sorted(found) or None
