"""Issue 59 leftovers: a load.json figure vLLM's own arithmetic cannot produce (a negative TTFT, a NaN, a
1e308 or infinite throughput, a goodput above the request rate, ...) fails the gate's load check naming
file, run, field and value, and the same rule (pdsweep.judge.loadfigures) takes the point off ``pdsweep
best``'s choices. Before: the gate PASSED each of these; only best's latency mean left a negative one out."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
from fixtures.make_runs import LOAD, case, edit, pd, ref, write_run

from pdsweep.judge.gate import FAIL, PASS, gate_run
from pdsweep.judge.pareto import points

CELL = pd("tiny-llama", 1, 1)
# one vllm bench serve run as vLLM writes it (results/cpu-pareto-int6: 16 prompts at concurrency 1)
GOOD: dict[str, Any] = {
    "concurrency": 1,
    "num_prompts": 16,
    "completed": 16,
    "errors": 0,
    "output_tokens": 256,
    "duration_s": 4.0,
    "req_s": 4.0,
    "output_tok_s": 64.0,
    "goodput_req_s": 3.75,
    "ttft_ms": {"mean": 91.9, "p50": 91.2, "p90": 118.9, "p99": 122.0},
    "tpot_ms": {"mean": 10.6, "p50": 10.3, "p90": 14.7, "p99": 16.5},
    "itl_ms": {"mean": 10.7, "p50": 9.5, "p90": 19.1, "p99": 29.5},
    "e2el_ms": {"mean": 251.5, "p50": 244.9, "p90": 312.8, "p99": 335.8},
}
W = f"{CELL.id}/load.json: runs.0 (concurrency 1)"


def _gate(tmp_path: Path, **change: Any) -> tuple[str, list[str], str | None]:
    """Gate a run whose PD cell's one load run is :data:`GOOD` with ``change`` (``ttft_ms__p90=-1`` sets
    ``ttft_ms.p90``); the cell's verdict, its load reasons, and why best leaves its point out."""
    run = write_run(tmp_path, "r", [case(CELL, {LOAD: {"runs": [GOOD]}}), case(ref(CELL))])

    def damage(d: dict[str, Any]) -> None:
        for k, v in change.items():
            field, _, stat = k.partition("__")
            if stat:
                d["runs"][0][field][stat] = v
            elif v is None:
                del d["runs"][0][field]
            else:
                d["runs"][0][field] = v

    edit(run / CELL.id / LOAD, damage)  # json.dumps: NaN and Infinity as Python writes them
    result = gate_run(run)
    g = result.cell(CELL.id)
    (pt,) = [p for p in points(run, result) if p.cell_id == CELL.id]
    return g.verdict, [r for r in g.reasons if "load.json" in r], pt.failed


def test_a_load_run_as_vllm_writes_it_passes(tmp_path):
    assert _gate(tmp_path) == (PASS, [], None)


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({"ttft_ms__p90": -1}, "ttft_ms.p90 = -1: negative (allowed: >= 0)"),
        ({"tpot_ms__p50": math.nan}, "tpot_ms.p50 = NaN: not a finite number (allowed: a finite number >= 0)"),
        ({"itl_ms__p99": "12"}, 'itl_ms.p99 = "12": not a number (allowed: a finite number >= 0)'),
        ({"goodput_req_s": math.inf}, "goodput_req_s = Infinity: not a finite number (allowed: a finite number >= 0)"),
        (
            {"output_tok_s": 1e308},
            "output_tok_s = 1e+308 but output_tokens / duration_s = 256 / 4 = 64: impossible "
            "(vLLM output_throughput is output_tokens / duration)",
        ),
        (
            {"req_s": 40.0},
            "req_s = 40 but completed / duration_s = 16 / 4 = 4: impossible (vLLM request_throughput is "
            "completed / duration)",
        ),
        (
            {"goodput_req_s": 5.0},
            "goodput_req_s = 5 > req_s = 4: impossible (vLLM request_goodput counts completed requests "
            "meeting the SLO)",
        ),
        (
            {"ttft_ms__p50": 200.0},
            "ttft_ms.p50 = 200 > ttft_ms.p90 = 118.9: impossible (np.percentile of one list rises with the percentile)",
        ),
        (
            {"ttft_ms__p99": 400.0},
            "ttft_ms.p99 = 400 > e2el_ms.p99 = 335.8: impossible (a request's TTFT is part of it)",
        ),
        (
            {"duration_s": 0.2, "req_s": 80.0, "output_tok_s": 1280.0, "goodput_req_s": 75.0},
            "e2el_ms.mean = 251.5 ms > duration_s = 0.2 s: impossible (every request ran inside the benchmark's "
            "duration)",
        ),
        ({"duration_s": 0}, "duration_s = 0: impossible (allowed: > 0; vLLM divides every throughput by it)"),
        (
            {"duration_s": None},
            "duration_s missing: output_tok_s, req_s, goodput_req_s cannot be checked against vLLM's count / duration",
        ),
    ],
)
def test_an_impossible_load_figure_fails_the_gate_and_leaves_best(tmp_path, change, reason):
    verdict, reasons, failed = _gate(tmp_path, **change)
    assert verdict == FAIL
    assert reasons[0] == f"{W}: {reason}", reasons
    # best applies the same rule (its point fails with the gate's first reason, never a second copy of it)
    assert failed is not None and reason in failed, failed
