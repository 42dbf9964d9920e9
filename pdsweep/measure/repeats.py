"""Repeats of the load phase: one call of :func:`pdsweep.measure.phases.run_load` per repeat,
every repeat's raw figures kept, until ``bench.repeats`` are done or -- with
``bench.target_ci`` -- until the confidence interval of every headline metric is narrow
enough (AIPerf's convergence on CI width), at most ``bench.max_repeats``.

load.json (the body :func:`run_repeats` returns): ``runs`` -- every ``vllm bench serve`` run
of every repeat, each with its ``repeat`` index and ``raw_file`` (logs/load-c<C>.r<i>.json,
vLLM's own result file); ``repeats`` -- per repeat ``wall_s`` and ``kv``, the KV-transfer
figures of that repeat from the decode logs' timed READ lines
(:func:`pdsweep.measure.kvtiming.read_stats`); ``repeat_plan`` -- how many were planned, run,
and why they stopped; ``summary`` -- per series (``c<C>`` or ``kv``) and metric the mean and
Student-t interval over repeats (:func:`pdsweep.core.stats.t_interval`) with the raw values.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pdsweep.core.stats import num, obj, t_interval

PCTS = ("p50", "p90", "p99")
LATENCIES = ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms")
# metrics the convergence rule watches (series c<C> for load runs, kv for the transfer)
HEADLINE = ("ttft_ms.p50", "tpot_ms.p50", "output_tok_s", "kv_gbps.union")
GPU_REPEATS = 3


def flatten_run(run: dict[str, Any]) -> dict[str, float | None]:
    """One load run's figures as ``metric -> value``: ``ttft_ms.p50`` ... ``e2el_ms.p99`` (ms),
    ``output_tok_s`` (tokens/s), ``req_s`` (requests/s)."""
    out: dict[str, float | None] = {}
    for m in LATENCIES:
        d = obj(run.get(m))
        for p in PCTS:
            out[f"{m}.{p}"] = num(d.get(p))
    out["output_tok_s"] = num(run.get("output_tok_s"))
    out["req_s"] = num(run.get("req_s"))
    return out


def flatten_kv(kv: dict[str, Any] | None) -> dict[str, float | None]:
    """One repeat's KV figures (:func:`pdsweep.measure.kvtiming.read_stats`) as ``metric -> value``:
    ``kv_gbps.union`` (reported), ``kv_gbps.sum`` (vLLM's), ``kv_xfer_ms.p50/p90/p99`` per request,
    ``kv_reads.per_request``, ``kv_descs.per_request``; {} without READ timing."""
    if not isinstance(kv, dict) or not kv.get("reads"):
        return {}
    per_req = obj(kv.get("xfer_ms_per_request"))
    return {
        "kv_gbps.union": num(kv.get("gbps_union")),
        "kv_gbps.sum": num(kv.get("gbps_sum")),
        **{f"kv_xfer_ms.{p}": num(per_req.get(p)) for p in PCTS},
        "kv_reads.per_request": num(kv.get("reads_per_request")),
        "kv_descs.per_request": num(kv.get("descriptors_per_request")),
    }


def repeat_series(body: dict[str, Any]) -> dict[str, dict[str, list[float]]]:
    """A load.json body as ``series -> metric -> [value per repeat]``: ``c<C>`` per concurrency
    (from ``runs``), ``kv`` (from ``repeats[].kv``). A load.json of a single run (before repeats)
    gives one value per metric."""
    out: dict[str, dict[str, list[float]]] = {}
    for r in body.get("runs") or []:
        if not isinstance(r, dict):
            continue
        s = out.setdefault(f"c{r.get('concurrency')}", {})
        for k, v in flatten_run(r).items():
            if v is not None:
                s.setdefault(k, []).append(v)
    for rep in body.get("repeats") or []:
        for k, v in flatten_kv(rep.get("kv") if isinstance(rep, dict) else None).items():
            if v is not None:
                out.setdefault("kv", {}).setdefault(k, []).append(v)
    return out


def summarize_repeats(body: dict[str, Any], confidence: float) -> dict[str, dict[str, dict[str, Any]]]:
    """``series -> metric -> {mean, lo, hi, n, values}`` (Student-t interval at ``confidence``)."""
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for name, metrics in repeat_series(body).items():
        for m, vals in metrics.items():
            mean, lo, hi = t_interval(vals, confidence)
            out.setdefault(name, {})[m] = {"mean": mean, "lo": lo, "hi": hi, "n": len(vals), "values": vals}
    return out


def widest(summary: dict[str, dict[str, dict[str, Any]]]) -> tuple[str, float | None]:
    """The headline metric with the widest relative CI half-width ``(hi - lo) / 2 / mean``, and
    that width (None: some headline metric has no interval yet, i.e. not converged)."""
    worst: tuple[str, float | None] = ("no headline metric", None)
    for name, metrics in summary.items():
        for m in HEADLINE:
            x = metrics.get(m)
            if x is None:
                continue
            worst = worst if worst[1] is not None else (f"{name} {m}", 0.0)
            if x["lo"] is None or not x["mean"]:
                return f"{name} {m}", None
            w = (x["hi"] - x["lo"]) / 2 / abs(x["mean"])
            if worst[1] is not None and w >= worst[1]:
                worst = (f"{name} {m}", w)
    return worst


def planned_repeats(b: Any, platform: str) -> tuple[int, int, int]:
    """``(minimum, planned, bound)`` repeats: ``bench.repeats`` (None: 3); with ``target_ci``
    at least 2 (an interval) and at most ``max_repeats``. ``platform`` is the sweep's."""
    planned = b.repeats or GPU_REPEATS
    if b.target_ci is not None:
        return min(2, planned), planned, max(planned, b.max_repeats)
    return (2 if b.repeats is None and platform == "cpu" else planned), planned, planned


def run_repeats(
    ls: Any,
    cell: Any,
    dep: Any,
    mpath: str,
    cdir: Path,
    load: Callable[..., dict[str, Any]],
    decode_logs: list[Path] = (),  # type: ignore[assignment]
    clock: Callable[[], float] = time.monotonic,
) -> dict[str, Any]:
    """Run ``load(ls, cell, dep, mpath, cdir)`` (:func:`pdsweep.measure.phases.run_load`) once per
    repeat and return the load.json body (module doc). ``decode_logs``: the cell's decode
    instance logs, whose timed READ lines each repeat's ``kv`` figures come from. Stops at the
    bound, when converged (``target_ci``), or, on CPU with ``repeats`` unset, past ``minimum``
    when one more repeat would overrun ``repeats_budget_s``. Raises what ``load`` raises."""
    from pdsweep.core.logscan import nixl_read_records
    from pdsweep.measure.kvtiming import read_stats

    b = ls.sweep.bench
    platform = ls.sweep.platform
    minimum, planned, bound = planned_repeats(b, platform)
    body: dict[str, Any] = {"runs": [], "repeats": []}
    t_all, reason = clock(), "planned repeats done"
    for i in range(bound):
        offsets = {p: _size(p) for p in decode_logs}
        t = clock()
        one = load(ls, cell, dep, mpath, cdir)
        wall = clock() - t
        for r in one.get("runs", []):
            conc = r.get("concurrency")
            raw = _keep_raw(cdir / "logs", f"load-c{conc}", i)
            body["runs"].append({**r, "repeat": i, "raw_file": raw})
        text = "".join(_read_from(p, off) for p, off in offsets.items())
        recs = nixl_read_records(text)
        body["repeats"].append({"repeat": i, "wall_s": wall, "kv": read_stats(recs) if recs else None})
        n = i + 1
        if n < minimum:
            continue
        if b.target_ci is not None:
            name, w = widest(summarize_repeats(body, b.confidence))
            if w is not None and w < b.target_ci:
                reason = f"converged: widest headline CI half-width {w:.1%} ({name}) < target_ci {b.target_ci:.1%}"
                break
            reason = f"max_repeats {bound} reached (widest headline CI: {name} {'n/a' if w is None else f'{w:.1%}'})"
        elif n >= planned:
            break
        elif b.repeats is None and platform == "cpu":
            spent = clock() - t_all
            if spent + spent / n > b.repeats_budget_s:
                reason = f"CPU budget: {n} repeats took {spent:.0f} s of repeats_budget_s {b.repeats_budget_s:g}"
                break
    body["repeat_plan"] = {
        "planned": planned,
        "minimum": minimum,
        "bound": bound,
        "run": len(body["repeats"]),
        "target_ci": b.target_ci,
        "confidence": b.confidence,
        "stop_reason": reason,
    }
    body["summary"] = summarize_repeats(body, b.confidence)
    return body


def _size(p: Path) -> int:
    try:
        return Path(p).stat().st_size
    except OSError:
        return 0


def _read_from(p: Path, offset: int) -> str:
    try:
        with open(p, errors="replace") as f:
            f.seek(offset)
            return f.read()
    except OSError:
        return ""


def _keep_raw(logs: Path, stem: str, i: int) -> str | None:
    """Move vLLM's result file (and its log) of this run to ``<stem>.r<i>.*`` so the next
    repeat does not overwrite it; returns the kept JSON's name (None when there was none)."""
    kept = None
    for ext in (".json", ".log"):
        src = logs / f"{stem}{ext}"
        if src.exists():
            src.replace(logs / f"{stem}.r{i}{ext}")
            kept = kept or f"logs/{stem}.r{i}{ext}"
    return kept
