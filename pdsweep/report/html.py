"""Report of one run: ``report.md`` plus a self-contained ``report.html`` (PNG plots
embedded as base64 data URIs, no external assets), plots under ``plots/``.

Plots: :mod:`pdsweep.report.plots` (accuracy, heatmaps, builds) and ``perf.png``
(:mod:`pdsweep.report.perf_section`).

Every cell of run.json, failed and rejected ones included, gets a table row.
"""

from __future__ import annotations

import base64
import html
import os
import shlex
from pathlib import Path

from pdsweep.core.errors import UserError
from pdsweep.core.stats import obj
from pdsweep.judge.compare import CompareResult, compare_cells, compare_results
from pdsweep.judge.gate import SKIPPED, CellResult, GateResult, gate_run
from pdsweep.report.integrity_section import INTEGRITY_COLUMNS, INTEGRITY_NOTE, integrity_rows
from pdsweep.report.load_section import LOAD_COLUMNS, LOAD_NOTE, load_rows
from pdsweep.report.overview import (
    CAUSE_CHARS,
    PERF_COL,
    failure_rows,
    failures_first,
    matrix_rows,
    one_line,
    pair_rows,
    verdict_matrix,
)
from pdsweep.report.pareto_section import FRONT_COLUMNS, front_section
from pdsweep.report.perf_compare import PERF_COLUMNS, perf_headline, perf_legend, perf_rows
from pdsweep.report.perf_section import PERF_CELL_COLUMNS, PERF_NOTE, perf_cell_rows, plot_perf
from pdsweep.report.plots import (
    FOLD_NOTE,
    build_series,
    compare_series,
    first_value,
    heatmap_folds,
    plot_accuracy,
    plot_heatmap,
    plot_side_by_side,
    ran_cells,
    tasks_of,
)
from pdsweep.report.render import (
    COMPARE_COLUMNS,
    GBPS_CELL,
    GBPS_CELL_NOTE,
    READ_COLUMNS,
    SUMMARY_COLUMNS,
    accuracy_p_note,
    compare_p_note,
    compare_rows,
    md_escape,
    md_table,
    read_rows,
    summary_rows,
)
from pdsweep.results import layout


def _comparisons(result: GateResult, other: GateResult | None) -> list[CompareResult]:
    if other is not None:
        return [compare_results(other, result)]
    series = build_series(result)
    if series is None:
        return []
    base, *rest = series[0]
    by_build = {b: [c for c in ran_cells(result) if c.facts.build == b] for b in series[0]}
    return [
        CompareResult(
            result.run_dir,
            result.run_dir,
            f"{result.run_name} [{base}]",
            f"{result.run_name} [{b}]",
            result.gate.alpha,
            tuple(compare_cells(by_build[base], by_build[b], result.gate.alpha, result.gate)),
            noisy_fails=result.gate.perf_noisy_fails,
        )
        for b in rest
    ]


def _run_facts(run_dir: Path) -> list[tuple[str, str]]:
    index = layout.read_json(run_dir / layout.RUN_FILE)
    host = obj(index.get("host"))
    keys = (
        ("sweep", index.get("sweep")),
        ("platform", index.get("platform")),
        ("host", host.get("hostname")),
        ("started", index.get("started")),
        ("finished", index.get("finished")),
        ("git", index.get("git_sha")),
        ("pdsweep", index.get("pdsweep_version")),
    )
    return [(k, str(v)) for k, v in keys if v is not None]


TITLES = {
    "accuracy": "Accuracy per cell",
    "heatmap_accuracy": "Accuracy: prefill TP x decode TP",
    "heatmap_gbps": f"{GBPS_CELL}: prefill TP x decode TP",
    "builds": "Side by side per cell",
    "perf": "Performance per cell (mean and 95 % interval over load repeats)",
}


def _title(plot: str) -> str:
    return TITLES.get(plot) or f"Which P/D configuration: {plot.removeprefix('front_')}"


def plot_captions(result: GateResult, plots: dict[str, Path]) -> dict[str, tuple[str, list[str]]]:
    """Text under a plot, ``{plot: (paragraph, list items)}``: what the heatmaps' ``min of N``
    squares fold (:data:`~pdsweep.report.plots.FOLD_NOTE`), listed under the first heatmap
    drawn (:func:`~pdsweep.report.plots.heatmap_folds`); empty when no square folds."""
    folds = heatmap_folds(result)
    heatmaps = [k for k in plots if k.startswith("heatmap_")]
    if not folds or not heatmaps:
        return {}
    same = "Its 'min of N' squares fold the same cells as the heatmap above."
    return {heatmaps[0]: (FOLD_NOTE + ":", folds), **{k: (same, []) for k in heatmaps[1:]}}


READS_NOTE = (
    "Completed READs decode posted to each prefill TP rank over the whole cell, with NIXL's byte "
    "count (transfer.json reads_by_prefill_rank). At tp_ratio < 0 on a hybrid MLA + SSM model the "
    "MLA latent is read from one rank and the SSM state shards from every rank (vLLM PR #49297)."
)


def _markdown(
    result: GateResult,
    facts: list[tuple[str, str]],
    plots: dict[str, Path],
    out: Path,
    cmps: list[CompareResult],
    cells_table: str,
) -> str:
    lines = [
        f"# Report: {result.run_name}",
        "",
        *(f"- {k}: `{v}`" for k, v in facts),
        "",
        f"**Gate {result.headline()}**",
        "",
        *_overview_markdown(result),
        "## Cells",
        "",
        GBPS_CELL_NOTE,
        "",
        accuracy_p_note(result.gate.alpha),
        "",
        cells_table,
        "",
    ]
    lines += [f"- run problem: {md_escape(p)}" for p in result.problems]
    if reads := read_rows(result):
        lines += ["## NIXL READs per prefill rank", "", READS_NOTE, "", md_table(READ_COLUMNS, reads), ""]
    if loads := load_rows(result):
        lines += [
            "## Load: correctness and performance per workload",
            "",
            LOAD_NOTE,
            "",
            md_table(LOAD_COLUMNS, loads),
            "",
        ]
    if integ := integrity_rows(result):  # pdsweep.report.integrity_section
        lines += ["## KV integrity", "", INTEGRITY_NOTE, "", md_table(INTEGRITY_COLUMNS, integ), ""]
    if perf := perf_cell_rows(result):  # pdsweep.report.perf_section
        lines += ["## Performance", "", PERF_NOTE, "", md_table(PERF_CELL_COLUMNS, perf), ""]
    if plots:
        lines += ["## Plots", ""]
        captions = plot_captions(result, plots)
        for k, p in plots.items():
            lines += [f"### {_title(k)}\n\n![{k}]({p.relative_to(out).as_posix()})\n"]
            if k in captions:
                text, items = captions[k]
                lines += [md_escape(text), "", *(f"- {md_escape(x)}" for x in items), *([""] if items else [])]
    for cmp in cmps:
        lines += [
            f"## {cmp.a_name} (A, baseline) vs {cmp.b_name} (B, candidate)",
            "",
            f"{'REGRESSED' if cmp.regressed else 'No regression'}; ratios are B/A. {compare_p_note(cmp.alpha)}",
            "",
            md_table(COMPARE_COLUMNS, compare_rows(cmp)),
            "",
        ]
        if rows := perf_rows(cmp):
            lines += [f"**{perf_headline(cmp)}**", "", perf_legend(cmp), "", md_table(PERF_COLUMNS, rows), ""]
    return "\n".join(lines)


def _overview_markdown(result: GateResult) -> list[str]:
    """Verdict matrix, build pairs and failures, one-line causes (pdsweep.report.overview); a
    table longer than LONG_TABLE rows goes after the failures (:func:`failures_first`)."""
    cols, rows = matrix_rows(result)
    sections = [(len(rows), ["## Verdicts", "", md_table(cols, rows), ""])]
    pcols, prows = pair_rows(result)
    if prows:
        sections.append((len(prows), ["## Build pairs", "", md_table(pcols, prows), ""]))
    failures: list[str] = []
    if fails := failure_rows(result):
        failures = [
            "## Failures",
            "",
            md_table(("cell", "verdict", "cause"), [(c.cell_id, c.verdict, one_line(c)) for c in fails]),
            "",
        ]
    return failures_first(sections, failures)


def _fold(text: str) -> str:
    """Escaped ``text``; past :data:`CAUSE_CHARS` characters (or one line), the rest folds."""
    first = text.splitlines()[0] if text else ""
    if len(text) <= CAUSE_CHARS and first == text:
        return html.escape(text)
    head = first if len(first) <= CAUSE_CHARS else first[: CAUSE_CHARS - 1] + "…"
    return f"<details><summary>{html.escape(head)}</summary>{html.escape(text)}</details>"


def _verdict_td(c: CellResult | None) -> str:
    if c is None:
        return "<td class='none'>—</td>"
    title = html.escape(f"{c.cell_id}: {one_line(c)}" if one_line(c) else c.cell_id, quote=True)
    href = html.escape("#" + c.cell_id, quote=True)
    return f"<td class='{c.verdict}' title='{title}'><a href='{href}'>{html.escape(c.verdict)}</a></td>"


def _overview_html(result: GateResult) -> list[str]:
    """The part of the page read first: verdict matrix, build pairs, failures (a table longer
    than LONG_TABLE rows after the failures, :func:`failures_first`)."""
    e = html.escape
    cols, rows = verdict_matrix(result)
    head = "".join(f"<th>{e(c)}</th>" for c in ("model", *cols))
    body = "".join(f"<tr><th>{e(label)}</th>{''.join(map(_verdict_td, cells))}</tr>" for label, cells in rows)
    matrix = f"<table class='matrix'><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"
    sections = [(len(rows), ["<h2>Verdicts</h2>", matrix])]
    pcols, prows = pair_rows(result)
    if prows:
        verdicts = tuple(range(1, len(pcols) - (pcols[-1] == PERF_COL), 2))  # not the load B/A column
        sections.append((len(prows), ["<h2>Build pairs</h2>", _html_table(pcols, prows, verdict_cols=verdicts)]))
    failures: list[str] = []
    if fails := failure_rows(result):
        frows: list[tuple[str, ...]] = [
            (c.cell_id, c.verdict, "\n".join(r.replace(c.cell_id + "/", "") for r in c.reasons) or c.message)
            for c in fails
        ]
        failures = ["<h2>Failures</h2>", _html_table(("cell", "verdict", "cause"), frows, verdict_cols=(1,))]
    return failures_first(sections, failures)


CSS = """body{font-family:system-ui,sans-serif;margin:2em;color:#222}table{border-collapse:collapse;font-size:13px;
margin:1em 0}th,td{border:1px solid #ccc;padding:3px 6px;vertical-align:top;text-align:left}th{background:#f3f3f3}
td.PASS{color:#2a7d2a;font-weight:bold}td.FAIL,td.XPASS{color:#c62828;font-weight:bold}td.XFAIL{color:#e08a00;
font-weight:bold}td.FLAKY{color:#8e24aa;font-weight:bold}td.SKIPPED{color:#777}td.reason{max-width:40em;word-break:break-word}
table.matrix td{text-align:center}summary{cursor:pointer}
img{max-width:100%;border:1px solid #ddd;margin:0.5em 0}code{background:#f6f6f6}"""


PDSWEEP = ".venv/bin/pdsweep"  # the README's spelling: works from the checkout without activating the venv


def reproduce_command(sweep: str, cell_id: str) -> str:
    """The command that runs one cell again (its reference cell comes with it), from the
    checkout: ``.venv/bin/pdsweep run SWEEP --cells ID --out results/repro-ID`` (``--cells`` is
    a glob over cell ids; an id has no glob characters)."""
    q = shlex.quote
    return f"{PDSWEEP} run {q(sweep)} --cells {q(cell_id)} --out {q('results/repro-' + cell_id)}"


def not_reproducible(c: CellResult) -> str | None:
    """Why a cell has no reproduce command (the plan rejected it: ``run`` would reject it
    again), else None."""
    return f"none: rejected by the plan (rule {c.rule})" if c.verdict == SKIPPED else None


def cell_links(run_dir: Path, out: Path, cell_id: str) -> list[tuple[str, str]]:
    """(label, href relative to ``out``) for a cell's files that exist: its directory, each
    log under ``logs/`` (sorted), ``cell.json`` (argv, env), ``status.json``. Empty for a cell
    that never ran (rejected: no directory). Raises ``UserError`` naming a directory of the run
    that cannot be read (never mistaken for the report's own output failing)."""
    cell_dir = run_dir / cell_id
    if not cell_dir.is_dir():
        return []
    base = Path(os.path.relpath(cell_dir, out)).as_posix()
    links = [("dir", base + "/")]
    logs = cell_dir / layout.LOGS_DIR
    try:
        names = sorted(f.name for f in logs.iterdir()) if logs.is_dir() else []
    except OSError as e:
        raise UserError(f"{logs}: cannot read the run's cell directory: {e.strerror or e}") from None
    links += [(n, f"{base}/{layout.LOGS_DIR}/{n}") for n in names]
    for name in (layout.CELL_FILE, layout.STATUS_FILE):
        if (cell_dir / name).is_file():
            links.append((name, f"{base}/{name}"))
    return links


def _cells_html(result: GateResult, sweep: str, run_dir: Path, out: Path) -> str:
    """The Cells table: the id links the cell's directory; a column of links to its logs and
    cell.json, and its reproduce command (:func:`reproduce_command`; none for a rejected cell)."""
    e = html.escape
    head = "".join(f"<th>{e(c)}</th>" for c in (*SUMMARY_COLUMNS, "files", "reproduce"))
    body = []
    for c, row in zip(result.cells, summary_rows(result)):
        links = cell_links(run_dir, out, c.cell_id)
        href = dict(links).get("dir")
        tds = [f"<td><a href='{e(href, quote=True)}'>{e(row[0])}</a></td>" if href else f"<td>{e(row[0])}</td>"]
        tds += [f'<td class="{e(x)}">{e(x)}</td>' if i == 2 else f"<td>{e(x)}</td>" for i, x in enumerate(row[1:-1], 1)]
        tds.append(f'<td class="reason">{_fold(row[-1])}</td>')
        tds.append("<td>" + " ".join(f"<a href='{e(h, quote=True)}'>{e(n)}</a>" for n, h in links[1:]) + "</td>")
        why = not_reproducible(c)
        tds.append(f"<td>{e(why)}</td>" if why else f"<td><code>{e(reproduce_command(sweep, c.cell_id))}</code></td>")
        body.append("<tr id='" + e(c.cell_id, quote=True) + "'>" + "".join(tds) + "</tr>")
    return f"<table class='cells'><thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>"


def _cells_markdown(result: GateResult, sweep: str, run_dir: Path, out: Path) -> str:
    """The Cells table in markdown: :data:`SUMMARY_COLUMNS`, then links and reproduce command."""
    lines = [
        "| " + " | ".join((*SUMMARY_COLUMNS, "files", "reproduce")) + " |",
        "|" + "---|" * (len(SUMMARY_COLUMNS) + 2),
    ]
    for c, row in zip(result.cells, summary_rows(result)):
        links = " ".join(f"[{n}]({h})" for n, h in cell_links(run_dir, out, c.cell_id))
        cmd = md_escape(why) if (why := not_reproducible(c)) else "`" + reproduce_command(sweep, c.cell_id) + "`"
        lines.append("| " + " | ".join([*(md_escape(x) for x in row), links, cmd]) + " |")
    return "\n".join(lines)


def _html_table(columns: tuple[str, ...], rows: list[tuple[str, ...]], verdict_cols: tuple[int, ...] = ()) -> str:
    """A table of plain-text rows: ``verdict_cols`` coloured by verdict; the last column is a
    reason, folded past its first line (:func:`_fold`)."""
    head = "".join(f"<th>{html.escape(c)}</th>" for c in columns)
    body = []
    for row in rows:
        tds = []
        for i, x in enumerate(row):
            if i in verdict_cols:
                tds.append(f'<td class="{x}">{html.escape(x)}</td>')
            elif i == len(row) - 1:
                tds.append(f'<td class="reason">{_fold(x)}</td>')
            else:
                tds.append(f"<td>{html.escape(x)}</td>")
        body.append("<tr>" + "".join(tds) + "</tr>")
    return f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>"


def _html(
    result: GateResult,
    facts: list[tuple[str, str]],
    plots: dict[str, Path],
    cmps: list[CompareResult],
    cells_table: str,
) -> str:
    e = html.escape
    parts = [
        f"<!doctype html><html><head><meta charset='utf-8'><title>pdsweep report: {e(result.run_name)}</title>",
        f"<style>{CSS}</style></head><body><h1>Report: {e(result.run_name)}</h1><ul>",
        *(f"<li>{e(k)}: <code>{e(v)}</code></li>" for k, v in facts),
        "</ul>",
        f"<p><strong>Gate {e(result.headline())}</strong></p>",
        *(f"<p>run problem: {e(p)}</p>" for p in result.problems),
        *_overview_html(result),
        "<h2>Cells</h2>",
        f"<p>{e(GBPS_CELL_NOTE)}</p><p>{e(accuracy_p_note(result.gate.alpha))}</p>",
        cells_table,
    ]
    if reads := read_rows(result):
        parts += ["<h2>NIXL READs per prefill rank</h2>", f"<p>{e(READS_NOTE)}</p>", _html_table(READ_COLUMNS, reads)]
    if loads := load_rows(result):
        parts += ["<h2>Load: correctness and performance per workload</h2>", f"<p>{e(LOAD_NOTE)}</p>"]
        parts.append(_html_table(LOAD_COLUMNS, loads))
    if integ := integrity_rows(result):
        parts += ["<h2>KV integrity</h2>", f"<p>{e(INTEGRITY_NOTE)}</p>", _html_table(INTEGRITY_COLUMNS, integ)]
    if perf := perf_cell_rows(result):
        parts += ["<h2>Performance</h2>", f"<p>{e(PERF_NOTE)}</p>", _html_table(PERF_CELL_COLUMNS, perf)]
    if plots:
        parts.append("<h2>Plots</h2>")
    captions = plot_captions(result, plots)
    for k, p in plots.items():
        data = base64.b64encode(p.read_bytes()).decode("ascii")
        parts.append(f"<h3>{e(_title(k))}</h3><img alt='{e(k)}' src='data:image/png;base64,{data}'>")
        if k in captions:
            text, items = captions[k]
            parts.append(
                f"<p>{e(text)}</p>" + ("<ul>" + "".join(f"<li>{e(x)}</li>" for x in items) + "</ul>" if items else "")
            )
    for cmp in cmps:
        parts += [
            f"<h2>{e(cmp.a_name)} (A, baseline) vs {e(cmp.b_name)} (B, candidate)</h2>",
            f"<p>{'REGRESSED' if cmp.regressed else 'No regression'}; ratios are B/A.",
            f"{e(compare_p_note(cmp.alpha))}</p>",
            _html_table(COMPARE_COLUMNS, compare_rows(cmp)),
        ]
        if rows := perf_rows(cmp):
            parts += [f"<p><strong>{e(perf_headline(cmp))}</strong></p>", f"<p>{e(perf_legend(cmp))}</p>"]
            parts.append(
                _html_table(
                    PERF_COLUMNS,
                    [tuple(x.strip("*") for x in r) for r in rows],
                    verdict_cols=(PERF_COLUMNS.index("verdict"),),
                )
            )
    parts.append("</body></html>\n")
    return "\n".join(parts)


def write_report(run_dir: Path, out_dir: Path | None = None, compare_with: Path | None = None) -> dict[str, Path]:
    """Gate ``run_dir`` and write ``report.md``, ``report.html`` and ``plots/*.png`` into
    ``out_dir`` (default ``run_dir``). ``compare_with``: a baseline run (A) to put this
    run (B) beside. Returns ``{"markdown": path, "html": path, <plot name>: path, ...}``
    (plots without data are left out). Raises ``UserError`` when a run has no run.json or
    ``out_dir`` cannot be written. Everything is made in a hidden directory inside
    ``out_dir`` first and moved into place at the end: a failed report leaves nothing
    half-written.
    """
    import os
    import shutil
    import tempfile

    run_dir = Path(run_dir)
    out = Path(out_dir or run_dir)
    layout.check_writable(out / layout.REPORT_MD)  # before any work
    result = gate_run(run_dir)
    other = gate_run(Path(compare_with)) if compare_with else None
    tmp = None
    try:
        out.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=out, prefix=".report-"))
        made = _write_report_files(result, _comparisons(result, other), run_dir, tmp, compare_with is not None, out)
        for p in made.values():  # every destination first: a failed move must not leave half a report
            layout.check_writable(out / p.relative_to(tmp))
        final = {}
        for kind, p in made.items():
            dest = out / p.relative_to(tmp)
            dest.parent.mkdir(parents=True, exist_ok=True)
            os.replace(p, dest)
            final[kind] = dest
        return final
    except OSError as e:  # matplotlib's savefig included: the out directory, not pdsweep
        raise UserError(f"{out}: cannot write the report: {e.strerror or e}") from None
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)


def _write_report_files(
    result: GateResult, cmps: list[CompareResult], run_dir: Path, out: Path, against_other: bool, final: Path
) -> dict[str, Path]:
    """Write the report into ``out`` (a hidden directory); links are relative to ``final``,
    where its files are moved."""
    pdir = out / layout.PLOTS_DIR
    first_task = next(iter(tasks_of(ran_cells(result))), None)
    series = (compare_series(cmps[0]) if against_other else build_series(result)) if cmps else None
    made = {
        "accuracy": plot_accuracy(result, pdir / "accuracy.png"),
        "heatmap_accuracy": plot_heatmap(
            result,
            lambda c: first_value(c, first_task),
            f"accuracy ({first_task})",
            pdir / "heatmap_accuracy.png",
            vmax=1.0,
        ),
        "heatmap_gbps": plot_heatmap(
            result, lambda c: c.facts.total("gbps_xfer"), GBPS_CELL, pdir / "heatmap_gbps.png", fmt=".3g"
        ),
        "builds": plot_side_by_side(series, pdir / "builds.png") if series else None,
        "perf": plot_perf(result, pdir / "perf.png"),
    }
    fronts = front_section(run_dir, result, pdir)  # pdsweep.report.pareto_section
    plots = {k: p for k, p in {**made, **fronts.plots}.items() if p is not None}
    facts = _run_facts(run_dir)
    sweep = dict(facts).get("sweep", "SWEEP.yaml")
    md_cells, html_cells = _cells_markdown(result, sweep, run_dir, final), _cells_html(result, sweep, run_dir, final)
    md_text = _markdown(result, facts, plots, out, cmps, md_cells) + fronts.markdown()
    md = layout.write_text(out / layout.REPORT_MD, md_text)
    page_text = _html(result, facts, plots, cmps, html_cells)
    page_text = page_text.replace(
        "</body></html>", fronts.html(_html_table(FRONT_COLUMNS, fronts.rows)) + "</body></html>"
    )
    page = layout.write_text(out / layout.REPORT_HTML, page_text)
    return {"markdown": md, "html": page, **plots}
