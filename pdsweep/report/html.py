"""Report of one run: ``report.md`` plus a self-contained ``report.html`` (PNG plots
embedded as base64 data URIs, no external assets), plots under ``plots/``.

Plots (matplotlib, Agg through the object API: no pyplot state):

* ``accuracy.png``: accuracy per cell and task, with the expected band (value ±
  tolerance), the reference value and the cell's stderr; failed cells in red.
* ``heatmap_accuracy.png`` / ``heatmap_gbps.png``: prefill TP x decode TP per model (and
  build) for the first task's accuracy and for KV transfer GB/s; positions without a
  value (not run, rejected, crashed) are hatched and say ``n/a``.
* ``perf.png``: headline load metrics per cell with their intervals over repeats
  (:mod:`pdsweep.report.perf_section`).
* ``builds.png``: per compare key, one bar per build (a run with several builds) or per
  run (``compare_with``: A = that run, baseline; B = this run, candidate).

Every cell of run.json, failed and rejected ones included, gets a table row.
"""

from __future__ import annotations

import base64
import html
import math
from collections.abc import Callable
from pathlib import Path

from matplotlib.colors import Normalize
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch, Rectangle

from pdsweep.core.errors import UserError
from pdsweep.core.stats import obj
from pdsweep.judge.compare import SAME, CompareResult, compare_cells, compare_results
from pdsweep.judge.flaky import FLAKY
from pdsweep.judge.gate import FAIL, NOT_RUNNABLE, PASS, SKIPPED, XFAIL, XPASS, CellResult, GateResult, gate_run
from pdsweep.report.load_section import LOAD_COLUMNS, LOAD_NOTE, load_rows
from pdsweep.report.overview import CAUSE_CHARS, failure_rows, matrix_rows, one_line, pair_rows, verdict_matrix
from pdsweep.report.perf_compare import PERF_COLUMNS, PERF_LEGEND, perf_headline, perf_rows
from pdsweep.report.perf_section import PERF_CELL_COLUMNS, PERF_NOTE, perf_cell_rows, plot_perf
from pdsweep.report.render import (
    COMPARE_COLUMNS,
    READ_COLUMNS,
    SUMMARY_COLUMNS,
    compare_rows,
    md_escape,
    md_table,
    read_rows,
    summary_rows,
)
from pdsweep.results import layout

COLORS = {
    PASS: "#2a7d2a",
    FAIL: "#c62828",
    XPASS: "#c62828",
    XFAIL: "#e08a00",
    SKIPPED: "#777777",
    NOT_RUNNABLE: "#777777",
    FLAKY: "#8e24aa",
}
BASELINE_BUILDS = ("unfixed", "baseline")  # in a run with several builds, the first of these is A
DPI = 110


# ---------------------------------------------------------------- helpers
def _first_value(c: CellResult, task: str | None = None) -> float | None:
    tasks = [t for t in c.facts.tasks if task is None or t.task == task]
    return tasks[0].value if tasks else None


def _ran(result: GateResult) -> list[CellResult]:
    return [c for c in result.cells if c.verdict not in (SKIPPED, NOT_RUNNABLE)]


def _tasks(cells: list[CellResult]) -> list[str]:
    return list(dict.fromkeys(t.task for c in cells for t in c.facts.tasks))


def _save(fig: Figure, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=DPI)
    return path


# ---------------------------------------------------------------- (a) accuracy per cell
def plot_accuracy(result: GateResult, path: Path) -> Path | None:
    """Dot plot per task: cells on y, accuracy on x (0-1). Returns None if no cell has a task."""
    cells = _ran(result)
    tasks = _tasks(cells)
    if not tasks:
        return None
    height = 1.6 + 0.3 * len(cells)
    fig = Figure(figsize=(11, height * len(tasks)), layout="constrained")
    for ax, task in zip(fig.subplots(len(tasks), 1, squeeze=False)[:, 0], tasks):
        ys = range(len(cells))[::-1]  # first cell on top
        for y, c in zip(ys, cells):
            s = next((t for t in c.facts.tasks if t.task == task), None)
            color = COLORS[c.verdict]
            if s and s.expected is not None and s.tolerance is not None:
                ax.barh(
                    y, 2 * s.tolerance, left=s.expected - s.tolerance, height=0.7, color="#4caf50", alpha=0.22, lw=0
                )
            if s and s.reference is not None:
                ax.plot(s.reference, y, marker="D", ms=6, mfc="none", mec="black", ls="none")
            if s is None or s.value is None:
                ax.text(0.01, y, "n/a", va="center", fontsize=8, color=color)
            else:  # the marker says whether the task passed; the label, whether the cell did
                err = s.stderr if isinstance(s.stderr, float) else None
                ok = s.verdict == "pass"
                ax.errorbar(
                    s.value,
                    y,
                    xerr=err,
                    fmt="o" if ok else "X",
                    ms=7,
                    capsize=3,
                    color=COLORS[PASS] if ok else COLORS[FAIL],
                )
            ax.text(
                1.01,
                y,
                c.verdict,
                transform=ax.get_yaxis_transform(),
                va="center",
                fontsize=8,
                color=color,
                fontweight="bold",
            )
        ax.set_yticks(list(ys), [c.cell_id for c in cells], fontsize=8)
        for label, c in zip(ax.get_yticklabels(), cells):
            label.set_color(COLORS[c.verdict] if c.verdict != PASS else "black")
        ax.set_xlim(0, 1)
        ax.set_ylim(-0.7, len(cells) - 0.3)
        ax.set_xlabel(f"{task} accuracy")
        ax.grid(axis="x", alpha=0.3)
        ax.set_title(f"Accuracy per cell: {task} (label colour: cell verdict)", fontsize=10, loc="left")
    fig.legend(
        handles=[
            Patch(color="#4caf50", alpha=0.3, label="expected ± tolerance"),
            Line2D([], [], ls="none", marker="D", mfc="none", mec="black", label="reference"),
            Line2D([], [], ls="none", marker="o", color=COLORS[PASS], label="value ± stderr, task passed"),
            Line2D([], [], ls="none", marker="X", color=COLORS[FAIL], label="task failed"),
        ],
        loc="outside upper center",
        ncol=4,
        fontsize=8,
        frameon=False,
    )
    return _save(fig, path)


# ---------------------------------------------------------------- (b) heatmaps
def _heatmap_panels(
    result: GateResult, value: Callable[[CellResult], float | None]
) -> dict[str, list[tuple[CellResult, float | None]]]:
    panels: dict[str, list[tuple[CellResult, float | None]]] = {}
    for c in result.cells:
        f = c.facts
        if c.kind == "ref" or f.model is None or f.prefill_tp is None or f.decode_tp is None:
            continue
        panels.setdefault(f"{f.model} ({f.build})", []).append((c, None if c.verdict == SKIPPED else value(c)))
    return panels


def plot_heatmap(
    result: GateResult,
    value: Callable[[CellResult], float | None],
    label: str,
    path: Path,
    vmax: float | None = None,
    fmt: str = ".2f",
) -> Path | None:
    """Prefill TP (rows) x decode TP (columns), one panel per model and build; PD cells only.

    Several cells at one position (block sizes, variants) show the lowest value and
    ``min of N``. Returns None when the run has no PD cell.
    """
    panels = _heatmap_panels(result, value)
    if not panels:
        return None
    values = [v for cells in panels.values() for _, v in cells if v is not None]
    norm = Normalize(0, vmax if vmax is not None else max(values, default=1.0) or 1.0)
    ncols = min(3, len(panels))
    nrows = math.ceil(len(panels) / ncols)
    fig = Figure(figsize=(3.6 * ncols + 1.2, 3.0 * nrows + 0.4), layout="constrained")
    axes = fig.subplots(nrows, ncols, squeeze=False).ravel()
    cmap = None
    for ax, (title, cells) in zip(axes, panels.items()):
        ps = sorted({c.facts.prefill_tp or 0 for c, _ in cells})  # `or 0` for mypy: _heatmap_panels keeps set TPs
        ds = sorted({c.facts.decode_tp or 0 for c, _ in cells})
        grid: dict[tuple[int, int], list[tuple[CellResult, float | None]]] = {}
        for c, v in cells:
            grid.setdefault((ps.index(c.facts.prefill_tp or 0), ds.index(c.facts.decode_tp or 0)), []).append((c, v))
        image = [[math.nan] * len(ds) for _ in ps]
        for (i, j), here in grid.items():
            vals = [v for _, v in here if v is not None]
            image[i][j] = min(vals) if vals else math.nan
        im = ax.imshow(image, cmap="viridis", norm=norm, aspect="auto")
        cmap = im.cmap
        for i in range(len(ps)):
            for j in range(len(ds)):
                here = grid.get((i, j), [])
                v = image[i][j]
                bad = sorted({c.verdict for c, _ in here} - {PASS})
                if math.isnan(v):
                    ax.add_patch(
                        Rectangle((j - 0.5, i - 0.5), 1, 1, facecolor="#eeeeee", edgecolor="#9e9e9e", hatch="///", lw=0)
                    )
                    text, color = "n/a", "#444444"
                else:
                    r, g, b, _ = cmap(norm(v))
                    text, color = format(v, fmt), "black" if 0.299 * r + 0.587 * g + 0.114 * b > 0.5 else "white"
                if len(here) > 1:
                    text += f"\nmin of {len(here)}"
                if bad:
                    text += "\n" + "/".join(bad)
                ax.text(
                    j,
                    i,
                    text,
                    ha="center",
                    va="center",
                    fontsize=9,
                    color=color,
                    fontweight="bold" if bad else "normal",
                )
        ax.set_xticks(range(len(ds)), [f"D TP{d}" for d in ds])
        ax.set_yticks(range(len(ps)), [f"P TP{p}" for p in ps])
        ax.set_title(title, fontsize=10)
    for ax in axes[len(panels) :]:
        ax.set_visible(False)
    fig.colorbar(im, ax=axes[: len(panels)].tolist(), label=label, shrink=0.9)
    fig.suptitle(f"{label}: prefill TP x decode TP", fontsize=11)
    return _save(fig, path)


# ---------------------------------------------------------------- (c) side by side
Series = tuple[list[str], list[tuple[str, list[CellResult | None]]]]


def build_series(result: GateResult) -> Series | None:
    """Names of the builds in ``result`` (baseline first) and, per compare key, each
    build's cell; None when the run has fewer than two builds."""
    cells = _ran(result)
    builds = list(dict.fromkeys(c.facts.build for c in cells if c.facts.build))
    if len(builds) < 2:
        return None
    base = next((b for b in BASELINE_BUILDS if b in builds), builds[0])
    builds = [base] + [b for b in builds if b != base]
    keys = list(dict.fromkeys(c.facts.compare_key or c.cell_id for c in cells))
    pick = {(c.facts.compare_key or c.cell_id, c.facts.build): c for c in cells}
    return builds, [(k, [pick.get((k, b)) for b in builds]) for k in keys]


def compare_series(cmp: CompareResult) -> Series:
    """A and B of a comparison as two series, one row per compare key."""
    return (
        [f"A: {cmp.a_name} (baseline)", f"B: {cmp.b_name} (candidate)"],
        [(c.key if c.verdict == SAME else f"{c.key} [{c.verdict}]", [c.a, c.b]) for c in cmp.cells],
    )


def plot_side_by_side(series: Series, path: Path) -> Path:
    """Grouped horizontal bars per compare key: accuracy (the first task) and GB/s, one bar
    per series; failed cells hatched with their verdict, absent ones ``n/a``."""
    names, rows = series
    nb = len(names)
    fig = Figure(figsize=(12, 1.4 + 0.28 * nb * len(rows) + 0.15 * len(rows)), layout="constrained")
    axes = fig.subplots(1, 2, sharey=True)
    palette = ["#90a4ae", "#1e88e5", "#8e24aa", "#00897b"]
    bar = 0.8 / nb
    task = next(iter(_tasks([c for _, cs in rows for c in cs if c])), None)
    metrics = (
        (f"accuracy ({task})", lambda c: _first_value(c, task), "{:.3f}"),
        ("KV transfer GB/s", lambda c: c.facts.total("gbps_xfer"), "{:.3g}"),
    )
    for ax, (label, get, fmt) in zip(axes, metrics):
        top = max((get(c) or 0 for _, cs in rows for c in cs if c), default=0) or 1.0
        for r, (_, cs) in enumerate(rows):
            y0 = len(rows) - 1 - r
            for k, c in enumerate(cs):
                y = y0 + 0.4 - bar * (k + 0.5)
                v = get(c) if c else None
                if c is None or v is None:
                    why = "" if c is None else " (reference)" if c.kind == "ref" else f" ({c.verdict})"
                    ax.text(top * 0.01, y, f"n/a{why}", va="center", fontsize=7, color="#555555")
                    continue
                failed = not c.checks_passed
                ax.barh(
                    y,
                    v,
                    height=bar * 0.9,
                    color=palette[k % len(palette)],
                    hatch="///" if failed else None,
                    edgecolor=COLORS[FAIL] if failed else "none",
                    lw=1 if failed else 0,
                )
                ax.text(
                    v + top * 0.01,
                    y,
                    fmt.format(v) + (f" {c.verdict}" if c.verdict != PASS else ""),
                    va="center",
                    fontsize=7,
                    color=COLORS[c.verdict] if failed else "black",
                )
        ax.set_xlim(0, top * 1.3)
        ax.set_xlabel(label)
        ax.grid(axis="x", alpha=0.3)
    axes[0].set_yticks(range(len(rows))[::-1], [k for k, _ in rows], fontsize=8)
    axes[0].set_ylim(-0.6, len(rows) - 0.4)
    fig.legend(
        handles=[Patch(color=palette[k % len(palette)], label=n) for k, n in enumerate(names)]
        + [Patch(facecolor="white", edgecolor=COLORS[FAIL], hatch="///", label="failed cell")],
        loc="outside upper center",
        ncol=nb + 1,
        fontsize=8,
        frameon=False,
    )
    return _save(fig, path)


# ---------------------------------------------------------------- report
def _comparisons(result: GateResult, other: GateResult | None) -> list[CompareResult]:
    if other is not None:
        return [compare_results(other, result)]
    series = build_series(result)
    if series is None:
        return []
    base, *rest = series[0]
    by_build = {b: [c for c in _ran(result) if c.facts.build == b] for b in series[0]}
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
    "heatmap_gbps": "KV transfer GB/s: prefill TP x decode TP",
    "builds": "Side by side per cell",
    "perf": "Performance per cell (mean and 95 % interval over load repeats)",
}


READS_NOTE = (
    "Completed READs decode posted to each prefill TP rank over the whole cell, with NIXL's byte "
    "count (transfer.json reads_by_prefill_rank). At tp_ratio < 0 on a hybrid MLA + SSM model the "
    "MLA latent is read from one rank and the SSM state shards from every rank (vLLM PR #49297)."
)


def _markdown(
    result: GateResult, facts: list[tuple[str, str]], plots: dict[str, Path], out: Path, cmps: list[CompareResult]
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
        md_table(SUMMARY_COLUMNS, summary_rows(result)),
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
    if perf := perf_cell_rows(result):  # pdsweep.report.perf_section
        lines += ["## Performance", "", PERF_NOTE, "", md_table(PERF_CELL_COLUMNS, perf), ""]
    if plots:
        lines += ["## Plots", ""]
        lines += [f"### {TITLES[k]}\n\n![{k}]({p.relative_to(out).as_posix()})\n" for k, p in plots.items()]
    for cmp in cmps:
        lines += [
            f"## {cmp.a_name} (A, baseline) vs {cmp.b_name} (B, candidate)",
            "",
            f"{'REGRESSED' if cmp.regressed else 'No regression'}; ratios are B/A.",
            "",
            md_table(COMPARE_COLUMNS, compare_rows(cmp)),
            "",
        ]
        if rows := perf_rows(cmp):
            lines += [f"**{perf_headline(cmp)}**", "", PERF_LEGEND, "", md_table(PERF_COLUMNS, rows), ""]
    return "\n".join(lines)


def _overview_markdown(result: GateResult) -> list[str]:
    """Verdict matrix, build pairs and failures, one-line causes (pdsweep.report.overview)."""
    cols, rows = matrix_rows(result)
    lines = ["## Verdicts", "", md_table(cols, rows), ""]
    pcols, prows = pair_rows(result)
    if prows:
        lines += ["## Build pairs", "", md_table(pcols, prows), ""]
    if fails := failure_rows(result):
        lines += [
            "## Failures",
            "",
            md_table(("cell", "verdict", "cause"), [(c.cell_id, c.verdict, one_line(c)) for c in fails]),
            "",
        ]
    return lines


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
    return f"<td class='{c.verdict}' title='{title}'>{html.escape(c.verdict)}</td>"


def _overview_html(result: GateResult) -> list[str]:
    """The part of the page read first: verdict matrix, build pairs, failures."""
    e = html.escape
    cols, rows = verdict_matrix(result)
    head = "".join(f"<th>{e(c)}</th>" for c in ("model", *cols))
    body = "".join(f"<tr><th>{e(label)}</th>{''.join(map(_verdict_td, cells))}</tr>" for label, cells in rows)
    parts = ["<h2>Verdicts</h2>", f"<table class='matrix'><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"]
    pcols, prows = pair_rows(result)
    if prows:
        parts += ["<h2>Build pairs</h2>", _html_table(pcols, prows, verdict_cols=tuple(range(1, len(pcols), 2)))]
    if fails := failure_rows(result):
        frows: list[tuple[str, ...]] = [
            (c.cell_id, c.verdict, "\n".join(r.replace(c.cell_id + "/", "") for r in c.reasons) or c.message)
            for c in fails
        ]
        parts += ["<h2>Failures</h2>", _html_table(("cell", "verdict", "cause"), frows, verdict_cols=(1,))]
    return parts


CSS = """body{font-family:system-ui,sans-serif;margin:2em;color:#222}table{border-collapse:collapse;font-size:13px;
margin:1em 0}th,td{border:1px solid #ccc;padding:3px 6px;vertical-align:top;text-align:left}th{background:#f3f3f3}
td.PASS{color:#2a7d2a;font-weight:bold}td.FAIL,td.XPASS{color:#c62828;font-weight:bold}td.XFAIL{color:#e08a00;
font-weight:bold}td.FLAKY{color:#8e24aa;font-weight:bold}td.SKIPPED{color:#777}td.reason{max-width:40em;word-break:break-word}
table.matrix td{text-align:center}summary{cursor:pointer}
img{max-width:100%;border:1px solid #ddd;margin:0.5em 0}code{background:#f6f6f6}"""


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


def _html(result: GateResult, facts: list[tuple[str, str]], plots: dict[str, Path], cmps: list[CompareResult]) -> str:
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
        _html_table(SUMMARY_COLUMNS, summary_rows(result), verdict_cols=(2,)),
    ]
    if reads := read_rows(result):
        parts += ["<h2>NIXL READs per prefill rank</h2>", f"<p>{e(READS_NOTE)}</p>", _html_table(READ_COLUMNS, reads)]
    if loads := load_rows(result):
        parts += ["<h2>Load: correctness and performance per workload</h2>", f"<p>{e(LOAD_NOTE)}</p>"]
        parts.append(_html_table(LOAD_COLUMNS, loads))
    if perf := perf_cell_rows(result):
        parts += ["<h2>Performance</h2>", f"<p>{e(PERF_NOTE)}</p>", _html_table(PERF_CELL_COLUMNS, perf)]
    if plots:
        parts.append("<h2>Plots</h2>")
    for k, p in plots.items():
        data = base64.b64encode(p.read_bytes()).decode("ascii")
        parts.append(f"<h3>{e(TITLES[k])}</h3><img alt='{e(k)}' src='data:image/png;base64,{data}'>")
    for cmp in cmps:
        parts += [
            f"<h2>{e(cmp.a_name)} (A, baseline) vs {e(cmp.b_name)} (B, candidate)</h2>",
            f"<p>{'REGRESSED' if cmp.regressed else 'No regression'}; ratios are B/A.</p>",
            _html_table(COMPARE_COLUMNS, compare_rows(cmp)),
        ]
        if rows := perf_rows(cmp):
            parts += [f"<p><strong>{e(perf_headline(cmp))}</strong></p>", f"<p>{e(PERF_LEGEND)}</p>"]
            parts.append(_html_table(PERF_COLUMNS, [tuple(x.strip("*") for x in r) for r in rows], verdict_cols=(9,)))
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
        made = _write_report_files(result, _comparisons(result, other), run_dir, tmp, compare_with is not None)
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
    result: GateResult, cmps: list[CompareResult], run_dir: Path, out: Path, against_other: bool
) -> dict[str, Path]:
    pdir = out / layout.PLOTS_DIR
    first_task = next(iter(_tasks(_ran(result))), None)
    series = (compare_series(cmps[0]) if against_other else build_series(result)) if cmps else None
    made = {
        "accuracy": plot_accuracy(result, pdir / "accuracy.png"),
        "heatmap_accuracy": plot_heatmap(
            result,
            lambda c: _first_value(c, first_task),
            f"accuracy ({first_task})",
            pdir / "heatmap_accuracy.png",
            vmax=1.0,
        ),
        "heatmap_gbps": plot_heatmap(
            result, lambda c: c.facts.total("gbps_xfer"), "KV transfer GB/s", pdir / "heatmap_gbps.png", fmt=".3g"
        ),
        "builds": plot_side_by_side(series, pdir / "builds.png") if series else None,
        "perf": plot_perf(result, pdir / "perf.png"),
    }
    plots = {k: p for k, p in made.items() if p is not None}
    facts = _run_facts(run_dir)
    md = layout.write_text(out / layout.REPORT_MD, _markdown(result, facts, plots, out, cmps))
    page = layout.write_text(out / layout.REPORT_HTML, _html(result, facts, plots, cmps))
    return {"markdown": md, "html": page, **plots}
