"""Rendering of gate and compare results: JUnit XML for CI, the gate summary and the
compare tables in markdown (also used by ``report``). Text only; the plots and the HTML
page are :mod:`pdsweep.report.html`'s."""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET
from pathlib import Path

from pdsweep.core.faults import read_fault_every
from pdsweep.core.stats import num
from pdsweep.judge.compare import IMPROVEMENT, MARKS, REGRESSION, CompareResult, TaskDelta
from pdsweep.judge.facts import TaskScore
from pdsweep.judge.flaky import FLAKY, attempt_reason
from pdsweep.judge.gate import FAIL, NOT_RUNNABLE, PASS, SKIPPED, XFAIL, XPASS, CellResult, GateResult
from pdsweep.report.perf_compare import PERF_COLUMNS, perf_headline, perf_legend, perf_rows
from pdsweep.results import layout

_ANSI = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]")
_XML_ILLEGAL = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\ud800-\udfff\ufffe\uffff]")


def xml_safe(text: str) -> str:
    """``text`` without ANSI colour codes and characters XML 1.0 cannot hold."""
    return _XML_ILLEGAL.sub("?", _ANSI.sub("", text))


def write_junit(result: GateResult, path: Path) -> Path:
    """Write JUnit XML: one ``<testcase classname="pdsweep.<run>" name="<cell id>">`` per
    cell; FAIL/XPASS get ``<failure>``, XFAIL/SKIPPED get ``<skipped>`` (message
    ``xfail: ...`` / ``rejected by rule ...``). A cell with redeploys (status.json ``retries``)
    gets one ``<flakyFailure>`` per failed attempt (Maven Surefire's element for a test that
    passed on a rerun; Jenkins and GitLab read it) and FLAKY a ``<failure type="FLAKY">`` when
    the gate's flaky policy fails it, else ``<system-out>``. Run-level problems add a testcase
    named ``(run)``. Returns ``path``."""
    classname = f"pdsweep.{result.run_name}"
    counts = result.counts
    suite = ET.Element(
        "testsuite",
        name=xml_safe(classname),
        tests=str(len(result.cells) + bool(result.problems)),
        failures=str(counts[FAIL] + counts[XPASS] + counts[FLAKY] * result.flaky_fails + bool(result.problems)),
        errors="0",
        skipped=str(counts[XFAIL] + counts[SKIPPED] + counts[NOT_RUNNABLE]),
    )
    for c in result.cells:
        case = ET.SubElement(suite, "testcase", classname=xml_safe(classname), name=xml_safe(c.cell_id))
        if c.facts.duration_s is not None:
            case.set("time", f"{c.facts.duration_s:.1f}")
        body = "\n".join([*c.reasons, *(["", "log tail:", *c.log_tail] if c.log_tail else [])])
        for i, a in enumerate(c.attempts, 1):
            el = ET.SubElement(case, "flakyFailure", message=xml_safe(attempt_reason(i, a)), type="ReadyHang")
            el.text = xml_safe("\n".join(map(str, a.get("log_tail") or [])))
        if c.verdict in (FAIL, XPASS) or (c.verdict == FLAKY and result.flaky_fails):
            el = ET.SubElement(case, "failure", message=xml_safe(c.message), type=c.verdict)
            el.text = xml_safe(body)
        elif c.verdict in (XFAIL, SKIPPED, NOT_RUNNABLE):
            el = ET.SubElement(case, "skipped", message=xml_safe(c.message))
            el.text = xml_safe(body)
        elif c.verdict == FLAKY:
            ET.SubElement(case, "system-out").text = xml_safe(c.message)
    if result.problems:
        case = ET.SubElement(suite, "testcase", classname=xml_safe(classname), name="(run)")
        ET.SubElement(case, "failure", message=xml_safe("; ".join(result.problems)), type="RUN")
    root = ET.Element("testsuites")
    root.append(suite)
    ET.indent(root)
    return layout.write_text(
        path, '<?xml version="1.0" encoding="utf-8"?>\n' + ET.tostring(root, encoding="unicode") + "\n"
    )


def _f(x: float | None, fmt: str = ".3f") -> str:
    return "—" if x is None else format(x, fmt)


def fmt_bytes(b: float | None) -> str:
    if b is None:
        return "—"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(b) < 1024 or unit == "GiB":
            return f"{b:.0f} {unit}" if unit == "B" else f"{b:.1f} {unit}"
        b /= 1024
    return ""  # unreachable


def fmt_task(s: TaskScore) -> str:
    """``task value ±stderr / expected±tol / ref value / p=…``."""
    se = f" ±{s.stderr}" if isinstance(s.stderr, str) else (f" ±{s.stderr:.3f}" if s.stderr is not None else "")
    exp = f"{s.expected:.3f}±{s.tolerance:.3f}" if s.expected is not None and s.tolerance is not None else "—"
    p = f"p={s.p_value:.2g}" if s.p_value is not None else "p=—"
    return f"{s.task} {_f(s.value)}{se} / {exp} / {_f(s.reference)} / {p}"


# transfer.json totals.gbps_xfer (pdsweep.measure.metrics.cell_transfer); the Performance table's
# KV GB/s are the load repeats' (pdsweep.measure.kvtiming). No "*" here: markdown would italicise.
GBPS_CELL = "KV GB/s (whole cell, vLLM NIXL metrics)"
GBPS_CELL_NOTE = (
    f"{GBPS_CELL} (Cells table, GB/s heatmap, builds.png): vllm:nixl_bytes_transferred / the summed "
    "vllm:nixl_xfer_time_seconds of the instances posting the READs (decode; prefill in push mode), over the "
    "cell's eval, consistency and bench phases together (transfer.json totals.gbps_xfer). The Performance "
    "table's KV GB/s cover the load repeats only, from decode's READ log lines (union: overlapping READs count "
    "once), so the numbers differ."
)


def accuracy_p_note(alpha: float) -> str:
    """The legend of the accuracy column's ``p=`` (:func:`pdsweep.core.stats.two_proportion_p`)."""
    return (
        "p (accuracy column): one-sided pooled two-proportion z-test of a PD cell's task against its reference "
        "cell's, null hypothesis: the PD cell's accuracy is not below the reference's (correct answers = value x n); "
        f"the task fails when p < gate.alpha = {alpha:g}; p=— for a reference cell (nothing to test against)."
    )


def compare_p_note(alpha: float) -> str:
    """The legend of the compare table's accuracy ``(p=...)``: ``p_lower`` of
    :func:`pdsweep.judge.compare.task_deltas`."""
    return (
        "p (accuracy column): one-sided pooled two-proportion z-test, null hypothesis: B's accuracy is not below "
        f"A's; p < alpha = {alpha:g} is a regression."
    )


def pass_note(c: CellResult) -> str:
    """Why a PASS cell passed what looks like a failure ('' otherwise): failed transfers a
    fault drill injected (:func:`read_fault_note`), or accuracy no expected score bounded, from
    what accuracy.json recorded: a reference task without an expected score passes with reason
    ``reference`` (nothing to judge it by; its PD cells are tested against it), a PD task
    without one is judged against its reference cell only (:func:`pdsweep.judge.accuracy.judge`)."""
    if c.verdict != PASS:
        return ""
    notes = []
    for s in c.facts.tasks:
        if s.verdict != "pass" or s.expected is not None:
            continue
        if c.kind == "ref" and "reference" in s.reasons:
            notes.append(
                f"{s.task}: accuracy floor not applied: no expected score for this model in accuracy/expected.yaml "
                "(e.g. an untrained checkpoint); a reference cell is judged against an expected score only, "
                "its value is what its PD cells are tested against"
            )
        elif c.kind != "ref" and s.reference is not None:
            notes.append(
                f"{s.task}: no expected score for this model in accuracy/expected.yaml: judged only as not "
                f"significantly below reference {s.reference_cell or '?'} ({_f(s.reference)}, p={_f(s.p_value, '.2g')})"
            )
    return "; ".join(n for n in (*notes, read_fault_note(c)) if n)


def read_fault_note(c: CellResult) -> str:
    """Why a PD cell's failed transfers passed the transfer gate ('' without any): the READ
    failures a ``fail-read-1-in-K`` drill injected (transfer.json ``read_faults.injected``) are
    allowed on top of ``gate.max_failed_transfers`` and count as transfers against the PD
    requests (:class:`pdsweep.judge.transfer.TransferCheck`); what decode did with them is
    ``kv_load_failure_policy`` (cell.json decode argv)."""
    f = c.facts
    injected, failed = num(f.read_faults.get("injected")), f.total("failed_transfers")
    every = read_fault_every(f.fault)
    if c.kind == "ref" or not injected or not failed or every is None:
        return ""
    policy = f.kv_load_failure_policy
    recovered = num(f.read_faults.get("recovered_reqs"))
    text = (
        f"{injected:g} READ failures injected by the fault drill {f.fault} (1 in {every} READs reported failed), "
        f"expected: allowed by the transfer gate, vLLM counted {failed:g} failed transfers"
    )
    if policy:  # the policy as configured; what vLLM did is in its log lines (counted below)
        text += f"; kv_load_failure_policy {policy}"
    loads, failed_reqs = num(f.read_faults.get("failed_loads")), num(f.read_faults.get("failed_reqs"))
    if loads and policy == "recompute" and not failed_reqs:  # failed_recving: recomputed, no log line of vLLM's
        text += f", {loads:g} request(s) with a failed KV load recomputed on decode"
    if recovered:
        text += f" ({recovered:g} request(s) recovered)"
    if not failed_reqs:
        text += ", no request failed"
    done, kv = f.total("num_transfers"), f.total("kv_requests")
    if done is not None and kv is not None and done < kv:
        text += f" ({done:g} transfers + {failed:g} failed cover the {kv:g} PD requests)"
    return text


SUMMARY_COLUMNS = (
    "cell",
    "kind",
    "verdict",
    "accuracy (value / expected / reference / p)",
    "consistency (worst prompt)",
    "transfers",
    "bytes",
    GBPS_CELL,
    "failed (xfer/notif)",
    "reason",
)


def summary_rows(result: GateResult, cells: list[CellResult] | None = None) -> list[tuple[str, ...]]:
    """One tuple of plain-text fields per cell (``cells``, default every cell of ``result``),
    in :data:`SUMMARY_COLUMNS` order."""
    rows: list[tuple[str, ...]] = []
    for c in result.cells if cells is None else cells:
        f = c.facts
        con = (
            "—"
            if c.kind == "ref"
            else " ".join(x for x in (f.consistency or "—", f"({f.worst_prompt})" if f.worst_prompt else "") if x)
        )
        failed = "/".join(
            "—" if f.total(k) is None else f"{f.total(k):g}" for k in ("failed_transfers", "failed_notifications")
        )
        rows.append(
            (
                c.cell_id,
                c.kind,
                c.verdict,
                "; ".join(map(fmt_task, f.tasks)) or "—",
                con,
                _f(f.total("num_transfers"), "g"),
                fmt_bytes(f.total("bytes")),
                _f(f.total("gbps_xfer"), ".3g"),  # as the GB/s heatmap and builds.png: 0.00477, not 0.00
                failed if c.kind != "ref" else "—",
                pass_note(c) if c.verdict == PASS else c.message,
            )
        )
    return rows


READ_COLUMNS = ("cell", "tp_ratio", "prefill rank", "READs", "bytes", "share of bytes")


def read_rows(result: GateResult) -> list[tuple[str, ...]]:
    """One row per (PD cell, prefill TP rank) with READs recorded in transfer.json
    ``reads_by_prefill_rank`` (:mod:`pdsweep.engine.readlog`), in :data:`READ_COLUMNS` order:
    with prefill TP > decode TP, which ranks decode read from and how many bytes each."""
    rows: list[tuple[str, ...]] = []
    for c in result.cells:
        ranks = c.facts.reads_by_rank
        total = sum(num(r.get("bytes")) or 0 for r in ranks.values() if isinstance(r, dict))
        ratio = ",".join(dict.fromkeys(str(p.get("tp_ratio")) for p in c.facts.transfer_plans)) or "—"
        for rank, r in ranks.items():
            if not isinstance(r, dict):
                continue
            b = num(r.get("bytes"))
            rows.append(
                (
                    c.cell_id,
                    ratio,
                    str(rank),
                    _f(num(r.get("reads")), "g"),
                    fmt_bytes(b),
                    f"{b / total:.1%}" if b is not None and total else "—",
                )
            )
    return rows


_TAG_LIKE = re.compile(r"<(?=[A-Za-z/!?])|&(?=#?\w+;)")


def md_escape(text: str) -> str:
    """Text safe inside a markdown table cell: no pipes, newlines or HTML-tag look-alikes
    (``<nixl>``); a plain ``p < 0.05`` stays readable in a terminal."""
    text = _TAG_LIKE.sub(lambda m: "&lt;" if m.group() == "<" else "&amp;", text)
    return text.replace("|", "\\|").replace("\n", "<br>")


def md_table(columns: tuple[str, ...], rows: list[tuple[str, ...]]) -> str:
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(md_escape(x) for x in row) + " |" for row in rows]
    return "\n".join(lines)


FAILING_FIRST = (FAIL, FLAKY, XPASS)  # the summary's first table, in this order
SUMMARY_REST_ROWS = 40  # rows of the other cells' table before it folds into a count
_EXAMPLE_CHARS = 160


def _clip(text: str, n: int = _EXAMPLE_CHARS) -> str:
    line = text.splitlines()[0] if text else ""
    return line if len(line) <= n else line[: n - 1] + "…"


def summary_markdown(result: GateResult) -> str:
    """The gate summary as markdown (summary.md, the CI annotation; ``pdsweep gate`` prints
    it), failures first: the headline line, the FAIL, FLAKY and XPASS rows (every one, in that
    order), one line per plan rule with its count of rejected cells, the NOT-RUNNABLE cells,
    then the other cells, non-PASS first, at most :data:`SUMMARY_REST_ROWS` rows (the rest
    counted; junit.xml and report.md list every cell); the first table is followed by the legend
    of its accuracy p (:func:`accuracy_p_note`). Bounded by the failures, not by the sweep: a
    768-cell sweep with a dozen failures stays well under 100 lines."""
    by_verdict = {v: [c for c in result.cells if c.verdict == v] for v in FAILING_FIRST}
    failing = [c for v in FAILING_FIRST for c in by_verdict[v]]
    lines = [f"# Gate: {result.run_name}: **{result.headline()}**", ""]
    lines += [f"- run problem: {md_escape(p)}" for p in result.problems] + ([""] if result.problems else [])
    legend = [accuracy_p_note(result.gate.alpha), ""]  # under the first table
    if failing:
        lines += [f"**{len(failing)} failing cell(s)** ({', '.join(FAILING_FIRST)}):", ""]
        lines += [md_table(SUMMARY_COLUMNS, summary_rows(result, failing)), "", *legend]
        legend = []
    lines += rejected_lines(result) + not_runnable_lines(result)
    rest = [c for c in result.cells if c.verdict not in (*FAILING_FIRST, SKIPPED, NOT_RUNNABLE)]
    rest.sort(key=lambda c: c.verdict == PASS)  # XFAIL (known bugs) before PASS; stable otherwise
    if rest:
        counts = ", ".join(
            f"{n} {v}" for v in sorted({c.verdict for c in rest}) if (n := sum(c.verdict == v for c in rest))
        )
        shown = rest[:SUMMARY_REST_ROWS]
        lines += [f"**{len(rest)} other cell(s)**: {counts}", ""]
        lines += [md_table(SUMMARY_COLUMNS, summary_rows(result, shown)), "", *legend]
        if len(rest) > len(shown):
            left = rest[len(shown) :]
            left_counts = ", ".join(
                f"{n} {v}" for v in sorted({c.verdict for c in left}) if (n := sum(c.verdict == v for c in left))
            )
            lines += [f"… and {len(left)} more ({left_counts}): junit.xml and report.md list every cell.", ""]
    return "\n".join(lines)


def rejected_lines(result: GateResult) -> list[str]:
    """One line per plan rule: how many cells it rejected (SKIPPED), with one example id and
    reason; the per-cell rows are junit.xml's and report.md's."""
    cells = [c for c in result.cells if c.verdict == SKIPPED]
    if not cells:
        return []
    rules: dict[str, list[CellResult]] = {}
    for c in cells:
        rules.setdefault(c.rule or "?", []).append(c)
    out = [f"**{len(cells)} cell(s) rejected by the plan** (not run, not a failure; per rule):"]
    for rule, group in sorted(rules.items(), key=lambda kv: (-len(kv[1]), kv[0])):
        eg = group[0]
        why = md_escape(_clip("; ".join(eg.reasons)))
        out.append(f"- {md_escape(rule)}: {len(group)} (e.g. `{eg.cell_id}`: {why})")
    return [*out, ""]


def not_runnable_lines(result: GateResult) -> list[str]:
    """The loud list of cells this host or allocation has too few GPUs for (NOT-RUNNABLE):
    the first 10 by id and reason, then their count."""
    cells = [c for c in result.cells if c.verdict == NOT_RUNNABLE]
    if not cells:
        return []
    head = (
        f"**{len(cells)} cell(s) NOT RUNNABLE HERE** (more GPUs than this host or allocation; not counted "
        "as pass; `pdsweep gate --require-all-cells` or `gate: {require_all_cells: true}` fails them):"
    )
    listed = [f"- {md_escape(c.cell_id)}: {md_escape(_clip('; '.join(c.reasons)))}" for c in cells[:10]]
    more = [f"- … and {len(cells) - 10} more: junit.xml and report.md list every cell"] if len(cells) > 10 else []
    return [head, *listed, *more, ""]


def write_summary(result: GateResult, path: Path) -> Path:
    """Write :func:`summary_markdown` to ``path``; returns ``path``."""
    return layout.write_text(path, summary_markdown(result))


# ---------------------------------------------------------------- compare
COMPARE_COLUMNS = (
    "",
    "cell",
    "A",
    "B",
    "accuracy A -> B (p lower)",
    "consistency A -> B",
    "KV GB/s B/A (whole cell)",
    "TTFT B/A",
    "TPOT B/A",
    "verdict",
    "reasons",
)


def _x(r: float | None) -> str:
    return "—" if r is None else f"{r:.2f}x"


def _task_text(t: TaskDelta) -> str:
    def v(x: float | None) -> str:
        return "—" if x is None else f"{x:.3f}"

    p = "" if t.p_lower is None else f" (p={t.p_lower:.2g})"
    return f"{t.task} {v(t.a)} -> {v(t.b)}{p}"


def compare_rows(result: CompareResult) -> list[tuple[str, ...]]:
    """One tuple of plain-text fields per comparison, in :data:`COMPARE_COLUMNS` order."""
    out: list[tuple[str, ...]] = []
    for c in result.cells:
        either = c.a or c.b  # a compared cell is in A, in B or in both
        con = (
            "—"
            if either is not None and either.kind == "ref"
            else " -> ".join((x.facts.consistency or "—") if x else "—" for x in (c.a, c.b))
        )
        out.append(
            (
                c.mark,
                c.label,
                c.a.verdict if c.a else "—",
                c.b.verdict if c.b else "—",
                "; ".join(map(_task_text, c.tasks)) or "—",
                con,
                _x(c.gbps_ratio),
                _x(c.ttft_ratio),
                _x(c.tpot_ratio),
                # a verdict over noisy perf metrics says so: "same" would read as "performance the same"
                f"{c.verdict} ({len(c.noisy)} perf metric(s) noisy)" if c.noisy else c.verdict,
                "; ".join(c.reasons),
            )
        )
    return out


def compare_markdown(result: CompareResult) -> str:
    """The comparison as markdown: direction, legend, newly failing / fixed lists, table."""
    counts = ", ".join(f"{len(result.by_verdict(v))} {v}" for v in MARKS if result.by_verdict(v))
    lines = [
        f"# Compare: {result.a_name} (A, baseline) vs {result.b_name} (B, candidate)",
        "",
        f"A = baseline: `{result.a}`; B = candidate: `{result.b}`. Ratios are B/A. {compare_p_note(result.alpha)}",
        "",
        "Marks: `+` improvement, `-` regression, `x` not comparable (config_hash differs), "
        "`<` only in A, `>` only in B, blank: same.",
        "",
        f"**{'REGRESSED' if result.regressed else 'NO REGRESSION'}**: {counts or 'no cells'}",
        "",
    ]
    lines += [f"- compare problem: {md_escape(p)}" for p in result.problems] + ([""] if result.problems else [])
    lines += [f"- note: {md_escape(n)}" for n in result.notes] + ([""] if result.notes else [])
    if result.missing:
        lines += [
            f"{len(result.missing)} cell(s) of A are missing in B: that fails the comparison "
            "(`--allow-missing` if intended).",
            "",
        ]
    if result.other_sweep:
        lines += [
            f"**Different sweeps**: A is `{result.sweeps[0]}`, B is `{result.sweeps[1]}` "
            "(compared on request: `--allow-other-sweep`).",
            "",
        ]
    for title, verdict in (("Regressions", REGRESSION), ("Improvements", IMPROVEMENT)):
        if result.by_verdict(verdict):
            lines += [f"## {title}", ""]
            lines += [f"- `{c.label}`: {md_escape('; '.join(c.reasons))}" for c in result.by_verdict(verdict)]
            lines.append("")

    if rows := perf_rows(result):
        lines += ["## Performance (load repeats)", "", f"**{perf_headline(result)}**", "", perf_legend(result), ""]
        lines += [md_table(PERF_COLUMNS, rows), ""]
    lines += ["## All cells", "", md_table(COMPARE_COLUMNS, compare_rows(result)), ""]
    return "\n".join(lines)


def write_compare_markdown(result: CompareResult, path: Path) -> Path:
    """Write :func:`compare_markdown` to ``path``; returns ``path``."""
    return layout.write_text(path, compare_markdown(result))


def write_compare_json(result: CompareResult, path: Path) -> Path:
    """Write ``result.to_dict()`` (schema-versioned, NaN -> null) to ``path``; returns ``path``."""
    return layout.write_json(path, result.to_dict())
