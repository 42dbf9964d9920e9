"""The performance part of ``pdsweep report``: per cell the load phase's figures with their
confidence intervals over repeats (load.json ``summary``, :mod:`pdsweep.measure.repeats`), the
KV transfer (GB/s over the union of READ intervals, vLLM's sum-of-durations figure beside it,
time / READs / descriptors per request, READs per request per prefill rank) and the UCX
transport; and ``perf.png``, the headline metrics per cell as bars with their intervals."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from matplotlib.figure import Figure

from pdsweep.core.stats import num, obj
from pdsweep.judge.gate import CellResult, GateResult
from pdsweep.measure.repeats import summarize_repeats

PERF_CELL_COLUMNS = (
    "cell",
    "repeats",
    "UCX transport",
    "TTFT p50/p90/p99 ms",
    "TPOT p50 ms",
    "ITL p50 ms",
    "E2E p50 ms",
    "output tok/s",
    "req/s",
    "KV GB/s (load repeats: union)",
    "KV GB/s (load repeats: vLLM's sum)",
    "KV ms/request p50",
    "READs / descs per request",
    "READs per request by prefill rank",
)
# (series, metric, title) of perf.png's panels; series "c*" is the first concurrency
PLOT_METRICS = (
    ("c*", "ttft_ms.p50", "TTFT p50 (ms)"),
    ("c*", "tpot_ms.p50", "TPOT p50 (ms)"),
    ("c*", "output_tok_s", "output tokens/s"),
    ("kv", "kv_gbps.union", "KV GB/s (load repeats: union of READs)"),
)
PERF_NOTE = (
    "Mean over the load phase's repeats with its 95 % Student-t interval (mean ±half-width; perf.png "
    "draws it cut at 0: every figure here is non-negative, and with 2 repeats the t interval often "
    "reaches below 0). KV GB/s "
    "(union): bytes / wall-clock of the union of the READ intervals, what pdsweep reports; vLLM's "
    "figure divides by the sum of the READ durations and understates by the READs in flight "
    "(vllm issue 48224). Both cover the load repeats only, from decode's READ log lines: the Cells table's "
    "KV GB/s is another window and source (the whole cell, vLLM's NIXL metrics)."
)


def _stat(summary: dict[str, Any], series: str, metric: str) -> dict[str, Any] | None:
    if series == "c*":
        series = next((k for k in summary if k.startswith("c")), "")
    x = (summary.get(series) or {}).get(metric)
    return x if isinstance(x, dict) and x.get("mean") is not None else None


def fmt_ci(x: dict[str, Any] | None, fmt: str = ".3g") -> str:
    """``mean ±half-width`` (``mean (n=1)`` without an interval; ``—`` without a value)."""
    if x is None:
        return "—"
    if x.get("lo") is None:
        return f"{x['mean']:{fmt}} (n={x.get('n', 1)})"
    return f"{x['mean']:{fmt}} ±{(x['hi'] - x['lo']) / 2:{fmt}}"


def _by_rank(load: dict[str, Any]) -> str:
    """READs per request per prefill rank, averaged over repeats: ``r0 1.0, r1 2.0``."""
    acc: dict[str, list[float]] = {}
    for rep in load.get("repeats") or []:
        kv = rep.get("kv") if isinstance(rep, dict) else None
        for rank, x in ((kv or {}).get("by_prefill_rank") or {}).items():
            acc.setdefault(rank, []).append(x.get("reads_per_request") or 0.0)
    return ", ".join(f"r{k} {sum(v) / len(v):.2g}" for k, v in sorted(acc.items(), key=lambda kv: int(kv[0]))) or "—"


def perf_cells(result: GateResult) -> list[CellResult]:
    return [c for c in result.cells if isinstance(c.facts.load.get("summary"), dict)]


def summary_of(c: CellResult) -> dict[str, Any]:
    """The cell's repeat statistics recomputed from its load.json runs and repeats
    (:func:`pdsweep.measure.repeats.summarize_repeats` at ``repeat_plan.confidence``, else 0.95), never the
    file's stored ``summary`` (a summary of text and lists made the report raise TypeError)."""
    load = c.facts.load
    return summarize_repeats(load, num(obj(load.get("repeat_plan")).get("confidence")) or 0.95)


def perf_cell_rows(result: GateResult) -> list[tuple[str, ...]]:
    """One row per cell with load repeats, in :data:`PERF_CELL_COLUMNS` order."""
    rows: list[tuple[str, ...]] = []
    for c in perf_cells(result):
        load = c.facts.load
        s = summary_of(c)
        plan = load.get("repeat_plan") or {}
        ttft = "/".join(fmt_ci(_stat(s, "c*", f"ttft_ms.{p}")) for p in ("p50", "p90", "p99"))
        rows.append(
            (
                c.cell_id,
                f"{plan.get('run', '?')} ({plan.get('stop_reason', '?')})",
                ", ".join(c.facts.ucx_transports)
                if c.facts.ucx_transports
                else ("—" if c.kind == "ref" else "unknown"),
                ttft,
                fmt_ci(_stat(s, "c*", "tpot_ms.p50")),
                fmt_ci(_stat(s, "c*", "itl_ms.p50")),
                fmt_ci(_stat(s, "c*", "e2el_ms.p50")),
                fmt_ci(_stat(s, "c*", "output_tok_s")),
                fmt_ci(_stat(s, "c*", "req_s")),
                fmt_ci(_stat(s, "kv", "kv_gbps.union")),
                fmt_ci(_stat(s, "kv", "kv_gbps.sum")),
                fmt_ci(_stat(s, "kv", "kv_xfer_ms.p50")),
                f"{fmt_ci(_stat(s, 'kv', 'kv_reads.per_request'))} / {fmt_ci(_stat(s, 'kv', 'kv_descs.per_request'))}",
                _by_rank(load),
            )
        )
    return rows


def error_bars(stats: list[dict[str, Any] | None]) -> list[list[float]]:
    """``[below, above]`` error-bar lengths of bars at each stat's mean (matplotlib's ``yerr``):
    the Student-t interval cut at 0, since every plotted figure (ms, tokens/s, GB/s) is
    non-negative and the interval of such a mean intersected with ``[0, inf)`` keeps its coverage
    (with 2 repeats ``mean - t x sem`` is often below 0); 0 where there is no interval."""
    below = [(x["mean"] - max(0.0, x["lo"])) if x and x.get("lo") is not None else 0.0 for x in stats]
    above = [(x["hi"] - x["mean"]) if x and x.get("hi") is not None else 0.0 for x in stats]
    return [below, above]


def repeats_title(ns: list[int]) -> str:
    """perf.png's title: the repeats ``n`` behind each mean (one n for every cell, else each
    cell's beside its name) and the interval drawn."""
    n = f"n={ns[0]}" if len(set(ns)) == 1 else "n (beside each cell)"
    interval = ", 95 % Student-t interval, cut at 0" if max(ns, default=1) > 1 else " (no interval)"
    return f"Mean of {n} load repeats{interval}"


def plot_perf(result: GateResult, path: Path) -> Path | None:
    """``perf.png``: one panel per :data:`PLOT_METRICS`, a bar per cell at its mean with the
    interval as error bar (:func:`error_bars`), the repeats ``n`` in the title
    (:func:`repeats_title`); None when no cell has load repeats."""
    cells = perf_cells(result)
    if not cells:
        return None
    sums = [summary_of(c) for c in cells]  # once per cell: every plotted metric reads it
    ns = [  # a cell's repeats: the largest n among its plotted figures
        max((x.get("n") or 1 for m in PLOT_METRICS if (x := _stat(s, m[0], m[1]))), default=1) for s in sums
    ]
    fig = Figure(figsize=(max(6.0, 0.6 * len(cells) + 3), 2.6 * len(PLOT_METRICS)), layout="constrained")
    axes = fig.subplots(len(PLOT_METRICS), 1, sharex=True)
    xs = range(len(cells))
    for ax, (series, metric, title) in zip(axes, PLOT_METRICS):
        stats = [_stat(s, series, metric) for s in sums]
        means = [x["mean"] if x else 0.0 for x in stats]
        ax.bar(xs, means, yerr=error_bars(stats), capsize=4, color="#4c72b0")
        for i, x in enumerate(stats):
            if x is None:
                ax.text(i, 0, "n/a", ha="center", va="bottom", fontsize=7)
        ax.set_title(title, fontsize=9)
        ax.tick_params(labelsize=7)
    labels = [c.cell_id if len(set(ns)) == 1 else f"{c.cell_id} (n={n})" for c, n in zip(cells, ns)]
    axes[-1].set_xticks(list(xs), labels, rotation=60, ha="right", fontsize=7)
    fig.suptitle(repeats_title(ns), fontsize=10)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    return path
