"""write_report on hand-made runs: files, every cell listed, images embedded and decodable."""

from __future__ import annotations

import base64
import html
import io
import re
from pathlib import Path

import matplotlib.image
import pytest
from _chromium import console_errors, need_chromium, render
from fixtures.make_runs import LOAD, MIXED, MIXED_REJECTED, acc, case, crashed, ids, pd, ref, totals, write_run
from matplotlib.figure import Figure

from pdsweep.report.html import write_report
from pdsweep.results import layout

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
DATA_URI = re.compile(r"src='data:image/png;base64,([A-Za-z0-9+/=]+)'")


@pytest.fixture(scope="module")
def mixed_report(runs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return write_report(runs["mixed"], tmp_path_factory.mktemp("report"))


def embedded_images(page: str) -> list[bytes]:
    return [base64.b64decode(m, validate=True) for m in DATA_URI.findall(page)]


def test_files_and_plots(mixed_report: dict[str, Path]) -> None:
    assert set(mixed_report) == {"markdown", "html", "accuracy", "heatmap_accuracy", "heatmap_gbps"}
    assert all(p.is_file() and p.stat().st_size > 0 for p in mixed_report.values())
    assert mixed_report["accuracy"].parent.name == "plots"


def test_every_cell_appears(mixed_report: dict[str, Path]) -> None:
    md, page = mixed_report["markdown"].read_text(), mixed_report["html"].read_text()
    every = [*ids(MIXED).values(), MIXED_REJECTED[0][0].id]
    for cid in every:
        assert f"| {cid} |" in md
        assert f">{cid}</a></td>" in page or f"<td>{cid}</td>" in page
    rejected = "rejected by rule platform-limit: prefill TP > 2 on cuda: fixture limit"
    assert rejected in md and html.escape(rejected) in page
    for text in (md, page):
        assert "decode-0 exited with code -11" in text
        assert "Gate FAILED: 5 PASS, 12 FAIL, 1 XFAIL, 1 XPASS, 1 SKIPPED" in text


def test_html_is_self_contained_and_images_decode(mixed_report: dict[str, Path]) -> None:
    page = mixed_report["html"].read_text()
    images = embedded_images(page)
    assert len(images) == 3 == page.count("<img ")
    assert not re.search(r"""src=['"](?!data:)""", page) and "<link" not in page and "http" not in page
    hrefs = re.findall(r"""href=['"]([^'"]*)['"]""", page)
    assert hrefs and all(":" not in h and not h.startswith("/") for h in hrefs)  # links into the run, never out
    for data in images:
        assert data.startswith(PNG_MAGIC)
        pixels = matplotlib.image.imread(io.BytesIO(data), format="png")
        h, w = pixels.shape[:2]
        assert 300 <= w <= 2000 and 200 <= h <= 4000  # readable, not a poster


def test_html_escapes_cell_text(mixed_report: dict[str, Path]) -> None:
    page = mixed_report["html"].read_text()
    assert "max |dlogprob| 7.1 &gt; 0.5" in page
    assert '<td class="XPASS">XPASS</td>' in page and '<td class="XFAIL">XFAIL</td>' in page


def test_markdown_links_plots(mixed_report: dict[str, Path]) -> None:
    md = mixed_report["markdown"].read_text()
    for name in ("accuracy", "heatmap_accuracy", "heatmap_gbps"):
        assert f"![{name}](plots/{name}.png)" in md


def test_default_out_dir_is_the_run(tmp_path: Path) -> None:
    run = write_run(tmp_path, "r", [MIXED["pass"], MIXED["ref"]])
    paths = write_report(run)
    assert paths["markdown"] == run / "report.md" and paths["html"] == run / "report.html"
    assert (run / "plots" / "accuracy.png").is_file()


def test_both_builds_in_one_run(runs: dict[str, Path], tmp_path: Path) -> None:
    paths = write_report(runs["mission"], tmp_path)
    assert "builds" in paths
    md = paths["markdown"].read_text()
    assert "## mission [unfixed] (A, baseline) vs mission [fixed] (B, candidate)" in md
    assert "| + | kimi-linear.p2d1.b16-16 (unfixed -> fixed) | FAIL | PASS |" in md
    assert len(embedded_images(paths["html"].read_text())) == 4


def test_compare_with(runs: dict[str, Path], tmp_path: Path) -> None:
    paths = write_report(runs["unfixed"], tmp_path, compare_with=runs["fixed"])
    md = paths["markdown"].read_text()
    assert "## fixed (A, baseline) vs unfixed (B, candidate)" in md and "REGRESSED" in md
    assert "| - | kimi-linear.p2d1.b16-16 (fixed -> unfixed) | PASS | FAIL |" in md
    assert paths["builds"].read_bytes().startswith(PNG_MAGIC)
    assert not (runs["unfixed"] / "report.md").exists()  # out_dir respected


def test_run_without_scores_still_reports_every_cell(tmp_path: Path) -> None:
    cell = pd("tiny-qwen3-next", 1, 1)
    run = write_run(tmp_path, "r", [case(cell, crashed("start", "prefill-0 never became ready", []))])
    paths = write_report(run)
    assert "accuracy" not in paths  # nothing to plot, no empty figure
    assert f"| {cell.id} | pd | FAIL |" in paths["markdown"].read_text()
    for data in embedded_images(paths["html"].read_text()):
        assert matplotlib.image.imread(io.BytesIO(data), format="png").size


def test_missing_run_json_is_a_user_error(tmp_path: Path) -> None:
    from pdsweep.core.errors import UserError

    with pytest.raises(UserError):
        write_report(tmp_path)
    assert not (tmp_path / "report.md").exists()


def test_reads_per_prefill_rank_table(tmp_path: Path) -> None:
    from fixtures.make_runs import TR

    cell = pd("kimi-linear", 2, 1)
    split = {
        TR: {
            "transfer_plans": [{"tp_ratio": -2, "remote_tp": 2}],
            "reads_by_prefill_rank": {
                "0": {"reads": 31, "bytes": 750, "descriptors": 90, "engines": 1},
                "1": {"reads": 31, "bytes": 250, "descriptors": 40, "engines": 1},
            },
        }
    }
    run = write_run(tmp_path, "r", [case(cell, split), MIXED["ref"]])
    paths = write_report(run)
    md = paths["markdown"].read_text()
    assert "## NIXL READs per prefill rank" in md
    assert f"| {cell.id} | -2 | 0 | 31 | 750 B | 75.0% |" in md and f"| {cell.id} | -2 | 1 | 31 | 250 B | 25.0% |" in md
    assert "NIXL READs per prefill rank" in paths["html"].read_text()
    unrecorded = case(pd("tiny-llama", 1, 1), {TR: {"reads_by_prefill_rank": None}})
    plain = write_report(write_run(tmp_path / "b", "r", [unrecorded, MIXED["ref"]]))
    assert "READs per prefill rank" not in plain["markdown"].read_text()  # nothing recorded: no empty table


def test_report_opens_with_verdicts_build_pairs_and_failures(runs: dict[str, Path], tmp_path: Path) -> None:
    paths = write_report(runs["mission"], tmp_path)
    md, page = paths["markdown"].read_text(), paths["html"].read_text()
    assert md.index("## Verdicts") < md.index("## Build pairs") < md.index("## Failures") < md.index("## Cells")
    assert "| model | p1d1 fixed | p1d1 unfixed | p2d1 fixed | p2d1 unfixed | ref-tp1 fixed | ref-tp1 unfixed |" in md
    assert "| kimi-linear | PASS | PASS | PASS | FAIL | PASS | PASS |" in md
    cause = "accuracy.json: pdsweep_arith: exact_match 0.3100 outside expected 0.8 +/- 0.05 (fixture)"
    assert f"| kimi-linear.p2d1.b16-16 | PASS |  | FAIL | {cause}" in md  # the pair side by side, its own id cut
    assert f"| kimi-linear.p2d1.b16-16.unfixed | FAIL | {cause}" in md
    assert page.index("<h2>Verdicts</h2>") < page.index("<h2>Build pairs</h2>") < page.index("<h2>Cells</h2>")
    assert "<td class='FAIL' title='kimi-linear.p2d1.b16-16.unfixed: accuracy.json" in page


def test_long_reasons_fold_behind_their_first_line(mixed_report: dict[str, Path]) -> None:
    page = mixed_report["html"].read_text()
    folded = re.findall(r"<details><summary>(.*?)</summary>(.*?)</details>", page)
    long_reason = "decode did 150 KV transfers for 200 PD requests whose prompt spans &gt;= 1 block"
    assert any(long_reason in full and full.endswith("(silent recompute)") for _, full in folded)
    assert folded and all(len(html.unescape(summary)) <= 160 for summary, _ in folded)
    short = "qwen3-0.6b.p2d1.b16-16.fixed/transfer.json: totals.failed_transfers is null (metric missing)"
    assert f'<td class="reason">{short}</td>' in page  # one short line stays as it is


def test_report_renders_in_headless_chromium(runs: dict[str, Path], tmp_path: Path) -> None:
    need_chromium()
    paths = write_report(runs["mixed"], tmp_path / "r")
    dom, log = render(paths["html"], tmp_path)
    assert console_errors(log) == []
    assert (
        dom.count('<table class="matrix">') == 1
        and dom.count("<details>") == paths["html"].read_text().count("<details>") > 0
    )
    assert dom.count("<img ") == 3  # accuracy and the two heatmaps, decoded in the page


# ---------------------------------------------------------------- click through (issue 37)
def test_each_cell_links_its_files_and_reproduce_command(runs: dict[str, Path], tmp_path: Path) -> None:
    import shutil

    from pdsweep.report.html import reproduce_command

    run = Path(shutil.copytree(runs["mixed"], tmp_path / "mixed"))
    crashed = ids(MIXED)["crashed"]
    (run / crashed / "logs").mkdir()
    (run / crashed / "logs" / "decode-0.log").write_text("Traceback ...\n")
    (run / crashed / "logs" / "prefill-0.log").write_text("ok\n")
    for out in (run, tmp_path / "elsewhere"):  # links are relative to where the report is written
        paths = write_report(run, out)
        page, md = paths["html"].read_text(), paths["markdown"].read_text()
        base = "" if out == run else "../mixed/"
        row = re.search(rf"<tr id='{re.escape(crashed)}'>(.*?)</tr>", page).group(1)
        hrefs = re.findall(r"href='([^']*)'", row)
        assert hrefs == [
            f"{base}{crashed}/",
            f"{base}{crashed}/logs/decode-0.log",
            f"{base}{crashed}/logs/prefill-0.log",
            f"{base}{crashed}/cell.json",
            f"{base}{crashed}/status.json",
        ]
        assert all((out / h).exists() for h in hrefs)
        cmd = f".venv/bin/pdsweep run sweeps/mixed.yaml --cells {crashed} --out results/repro-{crashed}"  # README's
        assert reproduce_command("sweeps/mixed.yaml", crashed) == cmd
        assert f"<code>{cmd}</code>" in row and f"`{cmd}`" in md
        assert f"[cell.json]({base}{crashed}/cell.json)" in md
        for cid in ids(MIXED).values():  # every cell that ran: its directory and cell.json
            assert f"<a href='{base}{cid}/'>{cid}</a>" in page and f"href='{base}{cid}/cell.json'" in page


def test_a_rejected_cell_gets_no_reproduce_command(runs: dict[str, Path], tmp_path: Path) -> None:
    """The plan rejected it (SKIPPED): `run` would reject it again, so its row says so instead."""
    paths = write_report(runs["mixed"], tmp_path / "r")
    page, md = paths["html"].read_text(), paths["markdown"].read_text()
    rejected = MIXED_REJECTED[0][0].id  # never ran: no directory to link
    assert f"<tr id='{rejected}'><td>{rejected}</td>" in page and f"--cells {rejected} " not in page + md
    row = next(x for x in md.splitlines() if x.startswith(f"| {rejected} |"))
    assert row.endswith("|  | none: rejected by the plan (rule platform-limit) |")
    assert "<td></td><td>none: rejected by the plan (rule platform-limit)</td></tr>" in page


def test_matrix_sorts_numerically(tmp_path: Path) -> None:
    from pdsweep.report.overview import matrix_rows, natural_key

    cells = [case(pd("tiny-llama", 1, 1, block=b)) for b in (128, 16, 64, 32)]
    cells += [case(pd("tiny-llama", p, 1)) for p in (16, 2)]
    from pdsweep.judge.gate import gate_run

    cols, rows = matrix_rows(gate_run(write_run(tmp_path, "r", cells)))
    assert list(cols) == ["model", "p1d1 fixed", "p2d1 fixed", "p16d1 fixed"]  # p16d1 sorted as text came first
    assert [r[0] for r in rows] == [
        "tiny-llama",
        "tiny-llama b16-16",
        "tiny-llama b32-32",
        "tiny-llama b64-64",
        "tiny-llama b128-128",
    ]
    assert sorted(["b128", "b16", "b32"], key=natural_key) == ["b16", "b32", "b128"]


def test_cause_is_the_instance_error_not_the_http_wrapper(tmp_path: Path) -> None:
    from pdsweep.judge.gate import gate_run
    from pdsweep.report.overview import one_line

    wrapper = 'streaming request: HTTP 500: {"error": {"message": "upstream decode failed", "stage": "decode"}}'
    culprit = (
        "decode-0 (still running): AssertionError: 1 != 2 at vllm/distributed/kv_transfer/kv_connector/v1/"
        "nixl/base_worker.py:812 _read_blocks (assert len(local) == len(remote)) in Worker_TP0"
    )
    c = pd("tiny-llama", 2, 1)
    run = write_run(tmp_path, "r", [case(c, crashed("eval", f"{wrapper}; {culprit}", ["x"]))])
    cause = one_line(gate_run(run).cell(c.id))
    assert cause.startswith("decode-0: AssertionError: 1 != 2 at vllm/distributed/")
    assert "HTTP 500" not in cause and len(cause) <= 160
    plain = pd("tiny-llama", 1, 2)
    run2 = write_run(tmp_path, "r2", [case(plain, crashed("eval", "decode-0 exited with code -11", ["x"]))])
    assert (
        one_line(gate_run(run2).cell(plain.id))
        == "status.json: failed in phase eval: decode-0 exited with code -11 — last log line: x"
    )


def test_report_of_the_maintainer_sweep_is_small(maintainer_run: Path, tmp_path: Path) -> None:
    """Its time is bench/test_scale_1000.py's (a timed unit test failed a slow host: 10.8 CPU s)."""
    paths = write_report(maintainer_run, tmp_path)
    size = paths["html"].stat().st_size
    assert size < 2_000_000, size  # was 5.7 MB: per-cell plots of every PASS cell, embedded
    assert paths["html"].read_text().count("<tr id='") == 808


def test_links_work_in_headless_chromium(runs: dict[str, Path], tmp_path: Path) -> None:
    from urllib.parse import unquote, urljoin, urlparse

    need_chromium()
    paths = write_report(runs["mixed"], tmp_path / "r")  # written outside the run: links go back into it
    dom, log = render(paths["html"], tmp_path)
    assert console_errors(log) == []
    rows = dict(re.findall(r'<tr id="([^"]+)">(.*?)</tr>', dom))
    assert set(rows) == {*ids(MIXED).values(), MIXED_REJECTED[0][0].id}
    for cid in ids(MIXED).values():  # every link the browser would follow lands on the cell's file
        targets = [
            Path(unquote(urlparse(urljoin(paths["html"].as_uri(), h)).path))
            for h in re.findall(r'href="([^"]+)"', rows[cid])
        ]
        assert targets[0] == runs["mixed"] / cid and (runs["mixed"] / cid / "cell.json") in targets
        assert all(t.exists() for t in targets)
        assert (
            f"<code>.venv/bin/pdsweep run sweeps/mixed.yaml --cells {cid} --out results/repro-{cid}</code>" in rows[cid]
        )
    crashed = ids(MIXED)["crashed"]
    assert f'<td class="FAIL" title="{crashed}: ' in dom and f'<a href="#{crashed}">FAIL</a>' in dom


def test_heatmap_says_what_min_of_n_folds(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A base cell and two fault drills at one TP position fold into one 'min of 3' square: the
    plot says what folding means, the report lists the folded block sizes and variants."""
    from pdsweep.report import plots

    supx: dict[str, str] = {}  # plot file -> its figure-level x label
    save = plots._save

    def spy(fig, path: Path) -> Path:
        supx[path.name] = fig.get_supxlabel()
        return save(fig, path)

    monkeypatch.setattr(plots, "_save", spy)
    cells = [case(pd("tiny-llama", 1, 1, block=32)), case(pd("tiny-llama", 2, 1, block=32))]
    cells += [
        case(pd("tiny-llama", 1, 1, block=32, fault=f), crashed("eval", "prefill-0 killed", []))
        for f in ("kill-prefill-during-eval", "fail-read-1-in-4")
    ]
    paths = write_report(write_run(tmp_path, "r", cells))
    md, page = paths["markdown"].read_text(), paths["html"].read_text()
    note = "A square marked 'min of N' folds the N cells at one prefill TP x decode TP position of a model and build"
    line = (
        "tiny-llama (fixed) P TP1 x D TP1: min of 3 cells: blocks b32-32; "
        "variants base, fault-fail-read-1-in-4, fault-kill-prefill-during-eval"
    )
    assert note in md and f"\n- {line}\n" in md and "P TP2 x D TP1" not in md  # one cell there: no fold
    assert html.escape(note) in page and f"<li>{html.escape(line)}</li>" in page
    assert md.count(line) == 1 and "Its 'min of N' squares fold the same cells as the heatmap above." in md
    for name in ("heatmap_accuracy.png", "heatmap_gbps.png"):
        assert supx[name].startswith("min of N: the lowest value of the N cells at this position")


def test_every_p_says_which_test_and_null_hypothesis(runs: dict[str, Path], tmp_path: Path) -> None:
    """The accuracy column's p= (cell vs its reference), the compare table's (B vs A) and the gate
    summary's: each with a legend naming the test and its null hypothesis."""
    from pdsweep.judge.gate import gate_run
    from pdsweep.report.render import summary_markdown

    paths = write_report(runs["mission"], tmp_path)
    md, page = paths["markdown"].read_text(), paths["html"].read_text()
    cells = (
        "p (accuracy column): one-sided pooled two-proportion z-test of a PD cell's task against its reference "
        "cell's, null hypothesis: the PD cell's accuracy is not below the reference's (correct answers = value x n); "
        "the task fails when p < gate.alpha = 0.05; p=— for a reference cell (nothing to test against)."
    )
    pair = "one-sided pooled two-proportion z-test, null hypothesis: B's accuracy is not below A's; p < alpha = 0.05"
    assert "/ p=0.8 |" in md and cells in md and html.escape(cells) in page
    assert "(p=" in md and pair in md and html.escape(pair) in page
    assert md.index(cells) < md.index("| cell | kind | verdict |")  # above the Cells table
    assert cells in summary_markdown(gate_run(runs["mission"]))


def test_a_reference_passing_without_an_expected_score_says_why(tmp_path: Path) -> None:
    """An untrained model (no accuracy/expected.yaml entry): its reference scores 0 % and passes
    with the recorded reason 'reference', its PD cell is judged against that 0 % only; each PASS
    row says so. A reference with an expected score gets no note."""
    from pdsweep.judge.gate import gate_run
    from pdsweep.report.render import summary_markdown

    g1 = pd("tiny-nemotron-h-g1", 1, 1)
    cells = [
        case(ref(g1), acc(0.0, reasons=("reference",), expected=None)),
        case(g1, acc(0.0, expected=None, reference={"value": 0.0}, p_value=0.5)),
        case(ref(pd("tiny-llama", 1, 1))),
    ]
    run = write_run(tmp_path, "r", cells)
    md = write_report(run)["markdown"].read_text()
    row = {x.split(" | ")[0][2:]: x for x in md.splitlines() if x.split(" | ")[1:2] in (["pd"], ["ref"])}  # Cells
    assert " | ref | PASS | pdsweep_arith 0.000 " in row[ref(g1).id]
    floor = (
        "pdsweep_arith: accuracy floor not applied: no expected score for this model in accuracy/expected.yaml "
        "(e.g. an untrained checkpoint); a reference cell is judged against an expected score only, its value "
        "is what its PD cells are tested against"
    )
    assert f"| {floor} |" in row[ref(g1).id]
    pd_note = (
        "pdsweep_arith: no expected score for this model in accuracy/expected.yaml: judged only as not "
        f"significantly below reference {ref(g1).id} (0.000, p=0.5)"
    )
    assert f"| {pd_note} |" in row[g1.id]
    assert (
        "| ref | PASS | " in row[ref(pd("tiny-llama", 1, 1)).id] and "floor" not in row[ref(pd("tiny-llama", 1, 1)).id]
    )
    assert floor in summary_markdown(gate_run(run))


def test_a_pass_with_injected_read_failures_says_why(tmp_path: Path) -> None:
    """A fail-read-1-in-K drill under kv_load_failure_policy recompute passes with failed
    transfers (and fewer transfers than PD requests): its row says the drill injected them, from
    transfer.json read_faults, cell.json's fault and decode's --kv-transfer-config."""
    from pdsweep.judge.gate import gate_run
    from pdsweep.report.render import summary_markdown

    drill = pd("tiny-llama", 1, 1, fault="fail-read-1-in-4")
    argv = [
        "vllm",
        "serve",
        "m",
        "--kv-transfer-config",
        '{"kv_role":"kv_consumer","kv_load_failure_policy":"recompute"}',
    ]
    patch = {
        layout.CELL_FILE: {
            "instances": [
                {"name": "prefill-0", "role": "prefill", "argv": [*argv[:3], "--kv-transfer-config", "{}"]},
                {"name": "decode-0", "role": "decode", "argv": argv},
            ]
        },
        layout.TRANSFER_FILE: {
            "read_faults": {"injected": 50, "failed_loads": 50, "recovered_reqs": 0, "failed_reqs": 0},
            "totals": {"num_transfers": 149, "failed_transfers": 50, "kv_requests": 192},
        },
    }
    run = write_run(tmp_path, "r", [case(drill, patch), case(ref(drill)), case(pd("tiny-llama", 2, 1))])
    result = gate_run(run)
    assert {c.cell_id: c.verdict for c in result.cells}[drill.id] == "PASS"
    note = (
        "50 READ failures injected by the fault drill fail-read-1-in-4 (1 in 4 READs reported failed), expected: "
        "allowed by the transfer gate, vLLM counted 50 failed transfers; kv_load_failure_policy recompute, 50 "
        "request(s) with a failed KV load recomputed on decode, no request failed (149 transfers + 50 failed cover the 192 PD requests)"
    )
    md = write_report(run)["markdown"].read_text()
    assert "| 149 | " in md and f"| 50/0 | {note} |" in md
    assert f"| 50/0 | {note} |" in summary_markdown(result)
    assert md.count("READ failures injected") == 1  # not on the cells without a drill


def test_small_kv_gbps_keeps_three_significant_figures(tmp_path: Path) -> None:
    """A CPU cell's 0.004766 GB/s reads 0.00477 in the Cells table and summary.md (3
    significant figures, as the GB/s heatmap), not 0.00."""
    from pdsweep.judge.gate import gate_run
    from pdsweep.report.render import summary_markdown

    slow, fast = pd("tiny-llama", 1, 1), pd("tiny-llama", 2, 1)
    cells = [case(slow, good={"gbps": 0.004766}), case(fast, good={"gbps": 123.456}), case(ref(slow))]
    run = write_run(tmp_path, "r", cells)
    md, summary = write_report(run)["markdown"].read_text(), summary_markdown(gate_run(run))
    for text in (md, summary):
        rows = {x.split(" | ")[0][2:]: x for x in text.splitlines() if " | pd | " in x}
        assert "| 0.00477 | 0/0 |" in rows[slow.id]
        assert "| 123 | 0/0 |" in rows[fast.id]


def _figures(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, Figure]:
    """The report's figures by file name, of a run with both builds, an XFAIL cell with values
    (hatched in builds.png) and 2 load repeats per PD cell."""
    from pdsweep.measure.repeats import summarize_repeats

    figs: dict[str, Figure] = {}
    save = Figure.savefig

    def spy(fig: Figure, path: Path, **kw: object) -> None:
        figs[Path(path).name] = fig
        save(fig, path, **kw)

    monkeypatch.setattr(Figure, "savefig", spy)
    runs = [
        {
            "concurrency": 2,
            "num_prompts": 8,
            "completed": 8,
            "errors": 0,
            "repeat": i,
            "ttft_ms": {"p50": t},
            "output_tok_s": 100.0,
            "duration_s": 10.0,  # vLLM writes it: the rates are counts over it
        }
        for i, t in enumerate((10.0, 50.0))
    ]
    load = {LOAD: {"runs": runs, "summary": summarize_repeats({"runs": runs}, 0.95), "repeat_plan": {"run": 2}}}
    unfixed = pd("tiny-llama", 1, 1, "unfixed")
    xfail = pd("tiny-llama", 1, 1, expect_fail=True, expect_reason="known", expect_match="no KV transferred")
    cells = [case(unfixed, load), case(xfail, totals(num_transfers=0), load), case(ref(unfixed)), case(ref(xfail))]
    write_report(write_run(tmp_path, "r", cells))
    return figs


def test_accuracy_axis_is_padded_past_0_and_1(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Markers and bands at 1.0 (and 0.0) are drawn whole; the ticks stay 0..1."""
    ax = _figures(tmp_path, monkeypatch)["accuracy.png"].axes[0]
    assert ax.get_xlim() == (-0.05, 1.05)
    assert list(ax.get_xticks()) == [0.0, 0.2, 0.4, 0.6, 0.8, 1.0]


def test_builds_hatch_legend_names_the_verdicts_hatched(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The hatch marks every cell whose checks failed: here an XFAIL cell, and no FAIL."""
    legend = _figures(tmp_path, monkeypatch)["builds.png"].legends[0]
    assert [t.get_text() for t in legend.get_texts()] == ["unfixed", "fixed", "XFAIL cell (checks failed)"]


def test_perf_title_says_the_repeats_behind_each_interval(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fig = _figures(tmp_path, monkeypatch)["perf.png"]
    assert fig.get_suptitle() == "Mean of n=2 load repeats, 95 % Student-t interval, cut at 0"
    from pdsweep.report.perf_section import repeats_title

    assert repeats_title([2, 3]) == "Mean of n (beside each cell) load repeats, 95 % Student-t interval, cut at 0"
    assert repeats_title([1]) == "Mean of n=1 load repeats (no interval)"
