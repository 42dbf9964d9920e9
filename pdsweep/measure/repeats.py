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
Student-t interval over repeats (:func:`pdsweep.core.stats.t_interval`) with the raw values;
with ``bench.pair_builds``, ``pairing`` (the repeats ran interleaved with the partner cell's,
:mod:`pdsweep.measure.paired`) or ``unpaired`` (why not).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pdsweep.core.logscan import nixl_read_records
from pdsweep.core.stats import num, obj, planned_repeats, t_interval
from pdsweep.measure.kvtiming import read_stats

PCTS = ("p50", "p90", "p99")
LATENCIES = ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms")
# metrics the convergence rule watches (series c<C> for load runs, kv for the transfer)
HEADLINE = ("ttft_ms.p50", "tpot_ms.p50", "output_tok_s", "kv_gbps.union")


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
    (from ``runs``), ``kv`` (from ``repeats[].kv``), ``cpu`` (``engine_cpu_ms.per_request``: CPU ms
    of the engine processes per completed request, from ``repeats[].cpu``). A load.json of a
    single run (before repeats) gives one value per metric."""
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
        cpu = num(obj(obj(rep).get("cpu")).get("ms_per_request"))
        if cpu is not None:
            out.setdefault("cpu", {}).setdefault("engine_cpu_ms.per_request", []).append(cpu)
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


@dataclass(frozen=True)
class Probes:
    """What each repeat reads besides the load's own figures: ``decode_logs`` (the cell's decode
    instance logs, whose timed READ lines give the repeat's ``kv`` figures), ``cpu_s`` (CPU
    seconds, user + system, of the engine processes so far: :func:`engine_cpu_s`; None: unknown)
    and the ``clock`` (seconds)."""

    decode_logs: tuple[Path, ...] = ()
    cpu_s: Callable[[], float | None] = lambda: None
    clock: Callable[[], float] = time.monotonic


def engine_cpu_s(pids: list[int]) -> float | None:
    """CPU seconds (user + system) used so far by the processes ``pids`` and all their live
    descendants (vLLM's API server, engine core and workers): ``psutil.Process.cpu_times``.
    On a shared host this is far less noisy per request than wall time (other tenants' load
    delays a request, it does not make it burn more cycles). None when a process is gone."""
    import psutil

    total = 0.0
    try:
        for pid in pids:
            root = psutil.Process(pid)
            for p in [root, *root.children(recursive=True)]:
                try:
                    t = p.cpu_times()
                except psutil.NoSuchProcess:  # a child that ended meanwhile
                    continue
                total += t.user + t.system
    except psutil.Error:
        return None
    return total


def run_repeats(
    ls: Any,
    cell: Any,
    dep: Any,
    mpath: str,
    cdir: Path,
    load: Callable[..., dict[str, Any]],
    probes: Probes = Probes(),
    pair: Any = None,
) -> dict[str, Any]:
    """Run ``load(ls, cell, dep, mpath, cdir)`` (:func:`pdsweep.measure.phases.run_load`) once per
    repeat and return the load.json body (module doc); ``probes`` (:class:`Probes`) give each
    repeat's ``kv`` figures and ``cpu`` (``engine_s``, ``ms_per_request``). Stops at the bound,
    when converged (``target_ci``), or, on CPU with ``repeats`` unset, past ``minimum`` when one
    more repeat would overrun ``repeats_budget_s``. ``pair``: a
    :class:`pdsweep.measure.paired.PairSide` (exactly ``pair.repeats`` repeats, each on its
    turn, no early stop; the body gets ``pairing`` or ``unpaired``) or
    :class:`pdsweep.measure.paired.Unpaired` (plain repeats, ``unpaired``). Raises what ``load`` raises."""
    b = ls.sweep.bench
    clock = probes.clock
    platform = ls.sweep.platform
    minimum, planned, bound = planned_repeats(b, platform)
    turns = pair if pair is not None and hasattr(pair, "turn") and pair.broken is None else None
    if turns is not None:  # both sides run the same count, interleaved: no side stops early
        minimum = planned = bound = turns.repeats
        turns.arrive()
    body: dict[str, Any] = {"runs": [], "repeats": []}
    t_all, reason = clock(), "planned repeats done"
    for i in range(bound):
        with turns.turn(i) if turns is not None else contextlib.nullcontext():
            body["repeats"].append(one_repeat(lambda: load(ls, cell, dep, mpath, cdir), cdir, probes, i, body["runs"]))
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
    if turns is not None:
        turns.finish()
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
    if pair is not None:
        body.update(pair.load_fields())
    return body


def one_repeat(
    call: Callable[[], dict[str, Any]], cdir: Path, probes: Probes, i: int, runs: list[dict[str, Any]]
) -> dict[str, Any]:
    """Repeat ``i`` (``call``: one load, ``{"runs": [...]}``): its load runs appended to ``runs``
    (vLLM's result files kept as ``.r<i>``); returns ``{"repeat", "wall_s", "started", "ended",
    "kv", "cpu"}`` (``started``/``ended``: wall-clock epoch seconds, ``time.time``)."""
    offsets = {p: _size(p) for p in probes.decode_logs}
    cpu0, t, started = probes.cpu_s(), probes.clock(), time.time()
    one = call()
    wall, cpu1, ended = probes.clock() - t, probes.cpu_s(), time.time()
    requests = 0
    for r in one.get("runs", []):
        conc = r.get("concurrency")
        raw = _keep_raw(cdir / "logs", f"load-c{conc}", i)
        runs.append({**r, "repeat": i, "raw_file": raw})
        requests += r.get("completed") or 0
    recs = nixl_read_records("".join(_read_from(p, off) for p, off in offsets.items()))
    cpu = None
    if cpu0 is not None and cpu1 is not None and requests:
        cpu = {"engine_s": cpu1 - cpu0, "requests": requests, "ms_per_request": (cpu1 - cpu0) * 1e3 / requests}
    kv = read_stats(recs) if recs else None
    return {"repeat": i, "wall_s": wall, "started": started, "ended": ended, "kv": kv, "cpu": cpu}


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
