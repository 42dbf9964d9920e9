"""Which figures of one ``vllm bench serve`` run (a load.json ``runs`` entry,
:func:`pdsweep.measure.benchserve.figures`) are possible: the one rule the gate's
:class:`~pdsweep.judge.load.LoadCheck` and ``pdsweep best``'s load points
(:mod:`pdsweep.judge.pareto`) both apply.

"Possible" is what vLLM's own arithmetic allows (``vllm/benchmarks/serve.py``,
``calculate_metrics``, and ``benchmark``'s ``benchmark_duration``), never a cap of ours:

- every figure present is a finite number >= 0: latencies are differences of
  ``time.perf_counter()`` readings (TTFT, TPOT, ITL, E2EL in ms), throughputs are counts over
  ``dur_s`` (tokens/s, requests/s), counts (``completed``, ``errors``, ``output_tokens``) are
  whole numbers; ``duration_s`` > 0 (``dur_s`` divides every throughput);
- ``req_s = completed / duration_s`` (``request_throughput``) and ``output_tok_s = output_tokens /
  duration_s`` (``output_throughput``), equal to float precision (relative 1e-6);
- ``goodput_req_s <= req_s`` (``request_goodput = good_completed / dur_s``, ``good_completed <=
  completed``);
- per latency ``p50 <= p90 <= p99`` (``np.percentile`` of one list);
- every latency figure (mean, p50, p90, p99) <= ``duration_s`` x 1000: each request started and
  ended inside the benchmark's wall clock (``benchmark_duration``), so none of its TTFT, TPOT, ITL
  or E2EL can exceed it;
- TTFT <= E2EL at each percentile (per request ``ttft <= latency``; order statistics keep it).

``duration_s`` missing while a throughput is recorded fails too (the throughputs cannot be
checked against what they are computed from; a load.json of vLLM's result always has it).
A figure absent altogether is not judged here (LoadCheck fails missing counts itself).
"""

from __future__ import annotations

import math
from typing import Any

from pdsweep.judge.facts import show

LATENCIES = ("ttft", "tpot", "itl", "e2el")  # load.json "<name>_ms": vllm bench serve --percentile-metrics
STATS = ("mean", "p50", "p90", "p99")  # --metric-percentiles 50,90,99 and the mean
THROUGHPUTS = ("output_tok_s", "req_s", "goodput_req_s")
COUNTS = ("completed", "errors", "output_tokens")
REL_TOL = 1e-6


def figure_problem(value: Any) -> str | None:
    """Why ``value`` (one load.json figure, present) is impossible: not a number (a string, a bool,
    NaN, inf: JSON ``NaN``/``Infinity``/``1e999``) or negative; None when it is a finite number >= 0."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return "not a number (allowed: a finite number >= 0)"
    try:
        x = float(value)
    except OverflowError:  # an int beyond float's range
        return "not a finite number (allowed: a finite number >= 0)"
    if not math.isfinite(x):
        return "not a finite number (allowed: a finite number >= 0)"
    return "negative (allowed: >= 0)" if x < 0 else None


def _fields(run: dict[str, Any]) -> dict[str, Any]:
    """Every figure of ``run`` present (not null), by its field path (``ttft_ms.p90``)."""
    out = {k: run[k] for k in (*THROUGHPUTS, *COUNTS, "duration_s") if run.get(k) is not None}
    for m in LATENCIES:
        stats = run.get(f"{m}_ms")
        if stats is not None and not isinstance(stats, dict):
            out[f"{m}_ms"] = stats
            continue
        out |= {f"{m}_ms.{s}": v for s, v in (stats or {}).items() if s in STATS and v is not None}
    return out


def run_problems(run: dict[str, Any], where: str) -> list[str]:
    """Every impossible figure of one load.json run (module doc), each naming ``where`` (file and
    run), the field path and the value, e.g. ``load.json: runs.0: ttft_ms.p90 = -1: negative (allowed:
    >= 0)``; empty: every figure present is possible."""
    figs = _fields(run)
    out = [f"{where}: {k} = {show(v)}: {why}" for k, v in figs.items() if (why := figure_problem(v))]
    out += [
        f"{where}: {k} = {show(figs[k])}: not a whole number (allowed: 0, 1, 2, ...)"
        for k in COUNTS
        if k in figs and not figure_problem(figs[k]) and float(figs[k]) != int(figs[k])
    ]
    if out:
        return out  # the relations below need numbers
    x = {k: float(v) for k, v in figs.items() if not isinstance(v, dict)}
    return _order(x, where) + _against_duration(x, where)


def _order(x: dict[str, float], where: str) -> list[str]:
    out = []
    for m in LATENCIES:
        got = [(s, x[f"{m}_ms.{s}"]) for s in ("p50", "p90", "p99") if f"{m}_ms.{s}" in x]
        out += [
            f"{where}: {m}_ms.{a} = {va:g} > {m}_ms.{b} = {vb:g}: impossible (np.percentile of one list "
            "rises with the percentile)"
            for (a, va), (b, vb) in zip(got, got[1:], strict=False)
            if va > vb * (1 + REL_TOL)
        ]
    for s in ("p50", "p90", "p99"):
        t, e = x.get(f"ttft_ms.{s}"), x.get(f"e2el_ms.{s}")
        if t is not None and e is not None and t > e * (1 + REL_TOL):
            out.append(
                f"{where}: ttft_ms.{s} = {t:g} > e2el_ms.{s} = {e:g}: impossible (a request's TTFT is part of it)"
            )
    good, req = x.get("goodput_req_s"), x.get("req_s")
    if good is not None and req is not None and good > req * (1 + REL_TOL):
        out.append(
            f"{where}: goodput_req_s = {good:g} > req_s = {req:g}: impossible (vLLM request_goodput counts "
            "completed requests meeting the SLO)"
        )
    return out


def _against_duration(x: dict[str, float], where: str) -> list[str]:
    dur = x.get("duration_s")
    rates = [k for k in THROUGHPUTS if k in x]
    if dur is None:
        why = f"{', '.join(rates)} cannot be checked against vLLM's count / duration"
        return [f"{where}: duration_s missing: {why}"] if rates else []
    if dur <= 0:
        return [f"{where}: duration_s = {dur:g}: impossible (allowed: > 0; vLLM divides every throughput by it)"]
    out = []
    pairs = (("req_s", "completed", "request_throughput"), ("output_tok_s", "output_tokens", "output_throughput"))
    for rate, count, name in pairs:
        if rate in x and count in x and not math.isclose(x[rate] * dur, x[count], rel_tol=REL_TOL, abs_tol=1e-9):
            out.append(
                f"{where}: {rate} = {x[rate]:g} but {count} / duration_s = {x[count]:g} / {dur:g} = "
                f"{x[count] / dur:g}: impossible (vLLM {name} is {count} / duration)"
            )
    lat = [k for k in x if k.partition("_ms.")[0] in LATENCIES and "_ms." in k]
    out += [
        f"{where}: {k} = {x[k]:g} ms > duration_s = {dur:g} s: impossible (every request ran inside the benchmark's "
        "duration)"
        for k in lat
        if x[k] > dur * 1000 * (1 + REL_TOL)
    ]
    return out
