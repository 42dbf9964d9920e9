"""pdsweep report's performance part: per-cell figures with intervals, the UCX transport,
READs per request per prefill rank, perf.png, and the fixed-vs-unfixed perf verdicts."""

from __future__ import annotations

import html
from pathlib import Path

from fixtures.make_runs import case, pd, write_run

from pdsweep.measure.repeats import summarize_repeats
from pdsweep.report.html import write_report
from pdsweep.results import layout


def _load(cell_id: str, ttfts: list[float], reads_r1: float) -> dict:
    runs = [
        {
            "concurrency": 2,
            "num_prompts": 60,
            "completed": 60,
            "errors": 0,
            "repeat": i,
            "ttft_ms": {"p50": t, "p90": t, "p99": t},
            "tpot_ms": {"p50": 5.0, "p90": 5.0, "p99": 5.0},
            "output_tok_s": 100.0 + i,
            "req_s": 1.0,
        }
        for i, t in enumerate(ttfts)
    ]
    kv = {
        "reads": 3,
        "gbps_union": 2.0,
        "gbps_sum": 1.0,
        "reads_per_request": 1 + reads_r1,
        "by_prefill_rank": {"0": {"reads_per_request": 1.0}, "1": {"reads_per_request": reads_r1}},
    }
    body = {"cell_id": cell_id, "runs": runs, "repeats": [{"repeat": i, "kv": kv} for i in range(len(ttfts))]}
    body["repeat_plan"] = {"run": len(ttfts), "stop_reason": "planned repeats done", "confidence": 0.95}
    body["summary"] = summarize_repeats(body, 0.95)
    return body


def test_report_shows_intervals_transport_reads_per_rank_and_the_fixed_vs_unfixed_verdict(tmp_path: Path) -> None:
    fixed, unfixed = pd("tiny-mla-mamba2", 2, 1, "fixed"), pd("tiny-mla-mamba2", 2, 1, "unfixed")
    cases = [
        case(c, {layout.LOAD_FILE: _load(c.id, t, r), layout.TRANSFER_FILE: {"ucx_transports": ["cma/memory"]}})
        for c, t, r in ((unfixed, [100, 110, 90], 0.0), (fixed, [200, 210, 190], 1.0))
    ]
    run = write_run(tmp_path, "r", cases)
    made = write_report(run)
    md = made["markdown"].read_text()
    assert "## Performance" in md and made["perf"].name == "perf.png" and made["perf"].stat().st_size > 1000
    row = next(line for line in md.splitlines() if line.startswith(f"| {fixed.id} | 3 (planned"))
    # TTFT 200 +- t_{.975,2} x 10 / sqrt(3) = 24.8; the transport; the fixed build's extra READ from rank 1
    assert "| 200 ±24.8/200 ±24.8/200 ±24.8 |" in row and "| cma/memory |" in row and "| r0 1, r1 1 |" in row
    assert next(line for line in md.splitlines() if line.startswith(f"| {unfixed.id} | 3")).endswith("| r0 1, r1 0 |")
    # unfixed (A) vs fixed (B): TTFT twice as long -> regression with its interval
    perf = next(line for line in md.splitlines() if "| c2 ttft_ms.p50 |" in line)
    assert "| 2.000x | [" in perf and perf.endswith("| **regression** | >= 1.36x |")
    assert "**performance: 1 regression" in md  # TTFT p50; p90/p99 of 8 requests are not judged
    page = made["html"].read_text()
    assert "Performance per cell" in page and '<td class="regression">regression</td>' in page  # verdict coloured


def test_perf_png_error_bars_stop_at_zero_for_a_mean_of_two_repeats() -> None:
    from pdsweep.report.perf_section import error_bars

    # TTFT 10 ms and 50 ms: mean 30, the 95 % t interval over 2 repeats is 30 +- 254 ms
    wide = summarize_repeats({"runs": [{"concurrency": 1, "ttft_ms": {"p50": v}} for v in (10.0, 50.0)]}, 0.95)
    x = wide["c1"]["ttft_ms.p50"]
    assert x["lo"] < 0 < x["mean"] == 30.0
    narrow = {"mean": 20.0, "lo": 18.0, "hi": 22.0}
    below, above = error_bars([x, narrow, None])
    assert below == [30.0, 2.0, 0.0]  # down to 0, not to the interval's negative end
    assert above == [x["hi"] - 30.0, 2.0, 0.0]


def test_each_kv_gbps_says_its_window_and_source(tmp_path: Path, monkeypatch) -> None:
    """The Cells table, builds.png / the GB/s heatmap and the Performance table show three KV GB/s of
    one cell (transfer.json totals.gbps_xfer 10.0 over the whole cell; the load repeats' union 2.0
    and sum 1.0): each names its window and source."""
    from pdsweep.report import plots

    labels: dict[str, list[str]] = {}  # plot file -> its axes' x labels
    save = plots._save

    def spy(fig, path: Path) -> Path:
        labels[path.name] = [ax.get_xlabel() for ax in fig.axes]
        return save(fig, path)

    monkeypatch.setattr(plots, "_save", spy)
    cells = [pd("tiny-llama", 1, 1, b) for b in ("unfixed", "fixed")]
    run = write_run(tmp_path, "r", [case(c, {layout.LOAD_FILE: _load(c.id, [100, 110, 90], 0.0)}) for c in cells])
    made = write_report(run)
    md, page = made["markdown"].read_text(), made["html"].read_text()
    lines = md.splitlines()
    cells_head = next(x for x in lines if x.startswith("| cell | kind |"))
    perf_head = next(x for x in lines if x.startswith("| cell | repeats |"))
    assert "| KV GB/s (whole cell, vLLM NIXL metrics) |" in cells_head
    assert "| KV GB/s (load repeats: union) | KV GB/s (load repeats: vLLM's sum) |" in perf_head
    assert "| 10 |" in next(x for x in lines if x.startswith(f"| {cells[1].id} | pd |"))  # numbers unchanged
    assert "| 2 ±0 | 1 ±0 |" in next(x for x in lines if x.startswith(f"| {cells[1].id} | 3 "))
    note = "over the cell's eval, consistency and bench phases together (transfer.json totals.gbps_xfer)"
    assert note in md and html.escape(note) in page
    assert "The Performance table's KV GB/s cover the load repeats only" in md
    assert "the Cells table's KV GB/s is another window and source" in md
    assert "KV GB/s (whole cell, vLLM NIXL metrics)" in labels["builds.png"]
    assert "### KV GB/s (whole cell, vLLM NIXL metrics): prefill TP x decode TP" in md
