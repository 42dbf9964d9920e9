"""pdsweep compare's noise-aware performance verdict on hand-made runs with load repeats,
and the gate's UCX transport check (gate.transports)."""

from __future__ import annotations

import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

import pytest
from fixtures.make_runs import case, merge, pd, write_run

from pdsweep.core.errors import GateFailed
from pdsweep.judge.compare import REGRESSION, SAME, compare_runs
from pdsweep.judge.gate import gate_run
from pdsweep.judge.perf import IMPROVEMENT, NOISY
from pdsweep.measure.percentiles import MIN_TAIL_REQUESTS, requests_for
from pdsweep.report.perf_compare import write_compare_junit
from pdsweep.report.render import COMPARE_COLUMNS, compare_markdown, compare_rows
from pdsweep.results import layout
from pdsweep.sweepfile.gatespec import GateSpec

CELL = pd("tiny-llama", 1, 1)


def load(ttfts: list[float], tpot: float = 5.0, gbps: list[float] | None = None, prompts: int = 60) -> dict[str, Any]:
    """A load.json of ``len(ttfts)`` repeats at concurrency 2 (TPOT ``tpot`` +-1 %, KV GB/s ``gbps``)."""
    runs, reps = [], []
    for i, t in enumerate(ttfts):
        tp = tpot * (1 + 0.01 * (i % 3 - 1))
        runs.append(
            {
                "concurrency": 2,
                "num_prompts": prompts,
                "completed": prompts,
                "errors": 0,
                "repeat": i,
                "ttft_ms": {"p50": t, "p90": t * 1.1, "p99": t * 1.2},
                "tpot_ms": {"p50": tp, "p90": tp, "p99": tp},
                "output_tok_s": 1000.0 / tp,
                "req_s": 1.0,
            }
        )
        g = (gbps or [2.0] * len(ttfts))[i]
        reps.append({"repeat": i, "kv": {"reads": 8, "gbps_union": g, "gbps_sum": g / 2}})
    return {layout.LOAD_FILE: {"cell_id": CELL.id, "runs": runs, "repeats": reps}}


def _runs(tmp_path: Path, a: dict[str, Any], b: dict[str, Any]) -> tuple[Path, Path]:
    return write_run(tmp_path, "a", [case(CELL, a)]), write_run(tmp_path, "b", [case(CELL, b)])


def test_slowed_run_is_a_regression_on_the_slowed_metric_only(tmp_path: Path) -> None:
    a, b = _runs(tmp_path, load([100, 102, 98]), load([150, 153, 147]))
    res = compare_runs(a, b)
    c = res.cell(CELL.compare_key)
    perf = {d.name: d for d in c.perf}
    assert perf["c2 ttft_ms.p50"].verdict == REGRESSION and perf["c2 ttft_ms.p50"].ratio == pytest.approx(1.5)
    assert perf["c2 ttft_ms.p50"].lo > 1.1
    assert perf["c2 tpot_ms.p50"].verdict == SAME and perf["kv kv_gbps.union"].verdict == SAME
    assert c.verdict == REGRESSION and res.regressed
    assert any(r.startswith("perf c2 ttft_ms.p50: 1.500x [") for r in c.reasons)
    with pytest.raises(GateFailed, match="c2 ttft_ms.p50"):
        res.raise_for_verdict()
    md = compare_markdown(res)
    assert (
        "## Performance (load repeats)" in md and "**performance: 1 regression, 0 improvement" in md
    )  # TTFT p50 (p90/p99 of 8 requests: not judged)
    row = next(line for line in md.splitlines() if "| c2 ttft_ms.p50 |" in line)
    assert "| 1.500x | [" in row and row.rstrip().endswith("| **regression** | >= 1.15x |")
    junit = ET.parse(write_compare_junit(res, tmp_path / "j.xml")).getroot()[0]
    assert (junit.get("failures"), junit.get("skipped")) == ("1", "0")
    failed = [c.get("name") for c in junit if c.find("failure") is not None]
    assert failed == ["c2 ttft_ms.p50"]


def test_two_normal_runs_are_never_a_regression(tmp_path: Path) -> None:
    a, b = _runs(tmp_path, load([100, 104, 97]), load([101, 96, 103]))
    res = compare_runs(a, b)
    c = res.cell(CELL.compare_key)
    assert c.verdict == SAME and not res.regressed
    assert {d.verdict for d in c.perf} <= {SAME, NOISY} and not [d for d in c.perf if d.verdict == REGRESSION]


def test_faster_kv_is_an_improvement(tmp_path: Path) -> None:
    a, b = _runs(tmp_path, load([100, 101, 99], gbps=[2.0, 2.1, 1.9]), load([100, 101, 99], gbps=[4.0, 4.1, 3.9]))
    c = compare_runs(a, b).cell(CELL.compare_key)
    assert {d.name: d.verdict for d in c.perf}["kv kv_gbps.union"] == IMPROVEMENT and c.verdict == "improvement"


def test_noisy_is_counted_and_fails_only_when_the_sweep_says_so(tmp_path: Path) -> None:
    a, b = _runs(tmp_path, load([100, 101, 99]), load([60, 150, 130]))
    res = compare_runs(a, b)
    assert res.cell(CELL.compare_key).verdict == SAME and not res.regressed
    assert res.noisy_metrics >= 1 and res.to_dict()["noisy_metrics"] == res.noisy_metrics
    n = res.noisy_metrics
    assert f"{n} noisy metric(s) -- noisy is undecided at the threshold and does not fail it" in compare_markdown(res)
    (row,) = compare_rows(res)  # the cell's "same" says its perf was undecided
    assert row[COMPARE_COLUMNS.index("verdict")] == f"same ({n} perf metric(s) noisy)"
    junit = ET.parse(write_compare_junit(res, tmp_path / "j.xml")).getroot()[0]
    assert (junit.get("failures"), junit.get("skipped")) == ("0", str(n))
    assert len(junit.findall(".//skipped")) == n and not junit.findall(".//failure")
    strict = compare_runs(a, b, GateSpec(perf_noisy_fails=True))
    assert strict.regressed
    with pytest.raises(GateFailed, match="noisy"):
        strict.raise_for_verdict()
    junit = ET.parse(write_compare_junit(strict, tmp_path / "s.xml")).getroot()[0]
    assert (junit.get("failures"), junit.get("skipped")) == (str(n), "0")
    assert sum(c.find("failure") is not None for c in junit) == n and not junit.findall(".//skipped")


def test_a_threshold_per_metric(tmp_path: Path) -> None:
    a, b = _runs(tmp_path, load([100, 101, 99]), load([120, 121, 119]))
    assert compare_runs(a, b).cell(CELL.compare_key).verdict == REGRESSION  # 20 % > default 10 %
    loose = compare_runs(a, b, GateSpec(perf={"ttft_ms": 0.5})).cell(CELL.compare_key)
    assert loose.verdict == SAME and {d.name: d.verdict for d in loose.perf}["c2 ttft_ms.p50"] == SAME


def test_a_metric_lost_in_b_is_a_regression(tmp_path: Path) -> None:
    body = load([100, 101, 99])
    del body[layout.LOAD_FILE]["repeats"]
    a, b = _runs(tmp_path, load([100, 101, 99]), body)
    c = compare_runs(a, b).cell(CELL.compare_key)
    lost = {d.name: d for d in c.perf}["kv kv_gbps.union"]
    assert (lost.verdict, lost.note, c.verdict) == (REGRESSION, "metric missing in B", REGRESSION)


def test_one_run_per_side_is_noisy_not_same(tmp_path: Path) -> None:
    a, b = _runs(tmp_path, load([100]), load([100]))
    c = compare_runs(a, b).cell(CELL.compare_key)
    assert c.perf and all(d.verdict == NOISY for d in c.perf)
    assert c.perf[0].note == "fewer than 2 repeats a side (1/1)"


# ---------------------------------------------------------------- gate.transports
def _gated(tmp_path: Path, transports: Any, expected: list[str]) -> Any:
    run = write_run(tmp_path, "t", [case(CELL, {layout.TRANSFER_FILE: {"ucx_transports": transports}})])
    return gate_run(run, GateSpec(transports=expected)).cell(CELL.id)


def test_a_cell_fallen_back_to_tcp_fails_naming_the_transports(tmp_path: Path) -> None:
    r = _gated(tmp_path, ["tcp/lo"], ["cma"])
    assert r.verdict == "FAIL"
    assert (
        f"{CELL.id}/transfer.json: KV READ over UCX transport(s) tcp/lo (fell back to tcp); expected: cma" in r.reasons
    )


def test_the_expected_transport_passes_and_an_unknown_one_fails(tmp_path: Path) -> None:
    assert _gated(tmp_path / "1", ["cma/memory"], ["cma"]).verdict == "PASS"
    assert _gated(tmp_path / "2", ["rc_mlx5/mlx5_0:1"], ["rc"]).verdict == "PASS"
    r = _gated(tmp_path / "3", None, ["cma"])
    assert r.verdict == "FAIL" and "ucx_transports is null: the UCX READ transport is unknown" in r.reasons[0]


def test_a_percentile_is_judged_only_with_30_requests_beyond_it(tmp_path: Path) -> None:
    """p99 of 8 requests is their maximum (on this host two runs of one build differed 4x in it);
    a percentile is judged once each repeat holds MIN_TAIL_REQUESTS (30) requests past it."""
    assert MIN_TAIL_REQUESTS == 30 and [requests_for(q) for q in (50, 90, 99)] == [60, 300, 3000]
    judged_at = {}
    for n in (8, 59, 60, 299, 300, 3000):
        a, b = _runs(tmp_path / str(n), load([100, 102, 98], prompts=n), load([150, 153, 147], prompts=n))
        perf = {d.name: d.verdict for d in compare_runs(a, b).cell(CELL.compare_key).perf}
        judged_at[n] = sorted(k.split(".")[-1] for k in perf if k.startswith("c2 ttft_ms."))
        assert all(perf[f"c2 ttft_ms.{q}"] == REGRESSION for q in judged_at[n])
    assert judged_at == {8: [], 59: [], 60: ["p50"], 299: ["p50"], 300: ["p50", "p90"], 3000: ["p50", "p90", "p99"]}


def test_the_legend_names_the_interval_methods_its_rows_use(tmp_path: Path) -> None:
    """3 unpaired repeats a side: welch only; 8: bootstrap; interleaved (one pairing.id): paired."""

    def legend(a: dict[str, Any], b: dict[str, Any], name: str) -> str:
        md = compare_markdown(compare_runs(*_runs(tmp_path / name, a, b)))
        return next(line for line in md.splitlines() if line.startswith("B/A with its confidence interval"))

    welch = legend(load([100, 102, 98]), load([101, 96, 103]), "welch")
    assert welch.endswith(
        "Method here: welch (5 of 5 rows: repeats not paired, fewer than 8 a side: Welch t interval of the log means)."
    )
    assert "bootstrap" not in welch and "paired (" not in welch
    assert "p (MWU): two-sided Mann-Whitney U test over the repeats, null hypothesis: A's and B's values" in welch
    eight = [100.0 + i for i in range(8)]
    assert "Method here: bootstrap (5 of 5 rows: repeats not paired, 8 or more a side" in legend(
        load(eight), load(eight), "bootstrap"
    )
    side = lambda s: {layout.LOAD_FILE: {"pairing": {"id": "p1", "side": s}}}  # noqa: E731
    paired = legend(merge(load([100, 102, 98]), side("A")), merge(load([101, 96, 103]), side("B")), "paired")
    assert "Method here: paired (5 of 5 rows: A and B repeats interleaved (bench.pair_builds)" in paired
