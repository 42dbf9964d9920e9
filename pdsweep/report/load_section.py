"""The report's load section: per PD cell and workload, correctness under load (checked /
wrong / stale, prefix reuse) beside its performance figures (pdsweep's client: req/s,
output tok/s, end-to-end latency), from ``load_check.json`` and ``load.json``."""

from __future__ import annotations

from typing import Any

from pdsweep.judge.gate import GateResult

LOAD_COLUMNS = (
    "cell",
    "workload",
    "concurrency",
    "checked",
    "wrong",
    "stale",
    "failed",
    "prefix reuse",
    "req/s",
    "output tok/s",
    "e2el p50 ms",
    "e2el p99 ms",
)
LOAD_NOTE = (
    "Every greedy answer under load compared with the single-instance reference's answer to the "
    "same prompt (exact tokens at equal TP, the consistency probe's logprob rule otherwise); stale: "
    "a wrong answer equal to another prompt's reference answer. Figures from pdsweep's client "
    "(non-streaming: no TTFT; vllm bench serve's TTFT/TPOT/ITL for `random` are in load.json runs)."
)


def _f(x: Any, fmt: str = ".3g") -> str:
    return format(x, fmt) if isinstance(x, (int, float)) and not isinstance(x, bool) else "-"


def load_rows(result: GateResult) -> list[tuple[str, ...]]:
    """Rows in :data:`LOAD_COLUMNS` order for every cell with a ``load_check.json``; a cell
    whose files are unreadable is left out (the gate already fails it)."""
    rows: list[tuple[str, ...]] = []
    for c in result.cells:
        # the files as the gate read them (typed, pdsweep.results.schema): an unreadable one is left out
        check, load = c.facts.load_check, c.facts.load
        if not check:
            continue
        perf = {(w.get("workload"), w.get("concurrency")): w for w in (load or {}).get("workloads") or []}
        for w in check.get("workloads") or []:
            p = perf.get((w.get("workload"), w.get("concurrency"))) or {}
            e2el = p.get("e2el_ms") or {}
            rows.append(
                (
                    c.cell_id,
                    str(w.get("workload")),
                    str(w.get("concurrency")),
                    str(w.get("checked")),
                    str(w.get("wrong")),
                    str(w.get("stale")),
                    str(w.get("errors")),
                    (w.get("prefix_reuse") or {}).get("verdict", "-"),
                    _f(p.get("req_s")),
                    _f(p.get("output_tok_s")),
                    _f(e2el.get("p50"), ".1f"),
                    _f(e2el.get("p99"), ".1f"),
                )
            )
    return rows
