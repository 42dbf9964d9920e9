"""``pdsweep dashboard``: one static HTML file (no server, no external assets) with, per
cell, its verdict per run (coloured, linked to that run's report) and its accuracy and
headline performance figures over time with their intervals, each sustained change
marked at its first run (:mod:`pdsweep.history.trends`). Plots are matplotlib PNGs
inlined as data URIs; a filter box (a few lines of inline JS) narrows the cells shown."""

from __future__ import annotations

import base64
import html
import io
from pathlib import Path
from typing import Any

from pdsweep.history import store, trends
from pdsweep.results import layout

HEADLINE = ("gbps_wall", "ttft_p50_s", "tpot_mean_s")
COLOURS = {"PASS": "#2e7d32", "XFAIL": "#7cb342", "SKIPPED": "#9e9e9e", "FAIL": "#c62828", "XPASS": "#ef6c00"}

_JS = """
document.getElementById('filter').addEventListener('input', function (e) {
  var q = e.target.value.toLowerCase();
  document.querySelectorAll('section.cell').forEach(function (s) {
    s.style.display = s.dataset.cell.toLowerCase().indexOf(q) >= 0 ? '' : 'none';
  });
});
"""
_CSS = """
body{font-family:sans-serif;margin:1.5em;max-width:1100px}
.v{display:inline-block;width:1.1em;height:1.1em;margin-right:2px;border-radius:2px}
section.cell{border-top:1px solid #ddd;padding-top:.5em}
table{border-collapse:collapse} td,th{padding:2px 8px;text-align:left}
.change{color:#c62828}
"""


def _png(fig: Any) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=80, bbox_inches="tight")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def _metrics_to_plot(conn: Any, cell_id: str) -> list[str]:
    have = store.metrics_of(conn, cell_id)
    return [m for m in have if m.startswith("accuracy.")] + [m for m in HEADLINE if m in have]


def cell_plot(conn: Any, cell_id: str, changes: list[trends.Change]) -> str | None:
    """One PNG (data URI) with a panel per metric: values with error bars, the first run
    of each change as a dashed line; None when the cell has no figures."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metrics = _metrics_to_plot(conn, cell_id)
    if not metrics:
        return None
    fig, axes = plt.subplots(1, len(metrics), figsize=(3.6 * len(metrics), 2.4), squeeze=False)
    for ax, m in zip(axes[0], metrics):
        pts = store.metric_series(conn, cell_id, m)
        xs = [p.started[:10] + " " + (p.run_name or "")[:24] for p in pts]
        ys = [p.value for p in pts]
        err = [
            [(p.value - p.lo) if p.lo is not None and p.value is not None else 0 for p in pts],
            [(p.hi - p.value) if p.hi is not None and p.value is not None else 0 for p in pts],
        ]
        ax.errorbar(range(len(pts)), ys, yerr=err, marker="o", capsize=3)
        for i, p in enumerate(pts):
            ax.plot(i, p.value, "o", color=COLOURS.get(p.verdict, "#000"))
        for c in changes:
            if c.metric == m:
                i = next(i for i, p in enumerate(pts) if p.run_key == c.first.run_key)
                ax.axvline(i - 0.5, color="#c62828", linestyle="--")
        ax.set_title(f"{m} ({pts[0].unit})" if pts and pts[0].unit else m, fontsize=9)
        ax.set_xticks(range(len(pts)), xs, fontsize=6, rotation=30, ha="right")
    out = _png(fig)
    plt.close(fig)
    return out


def _report_link(db: Path, run_path: str | None, started: str | None, out: Path) -> str | None:
    """A link to the run's report.html, else its gate summary.md, else its directory (a
    run gated but never reported still opens); None when the run is no longer on disk or its
    directory now holds another run (:func:`pdsweep.history.store.resolve_run_path`)."""
    d = store.resolve_run_path(db, run_path, started)
    if d is None:
        return None
    rep = next((d / n for n in ("report.html", "summary.md") if (d / n).exists()), d)
    try:
        return str(rep.resolve().relative_to(out.parent.resolve()))
    except ValueError:
        return rep.resolve().as_uri()


def render(db: Path, out: Path, sweep: str | None = None) -> Path:
    """Write the dashboard of ``db`` (optionally one sweep) to ``out`` atomically.
    Raises ``UserError`` for a missing or foreign store."""
    with store.connect(db, create=False) as conn:
        all_runs = store.runs(conn, sweep)
        parts = [
            f"<h1>pdsweep history{': ' + html.escape(sweep) if sweep else ''}</h1>",
            f"<p>{len(all_runs)} runs. Filter cells: <input id='filter' placeholder='cell id'></p>",
            "<table><tr><th>run</th><th>started</th><th>gate</th><th>pdsweep</th></tr>",
        ]
        for r in all_runs:
            link = _report_link(db, r["path"], r["started"], out)
            name = html.escape(r["name"] or r["run_key"])
            cell = f"<a href='{html.escape(link)}'>{name}</a>" if link else name
            parts.append(
                f"<tr><td>{cell}</td><td>{html.escape(r['started'])}</td><td>{html.escape(r['headline'])}</td>"
                f"<td>{html.escape((r['pdsweep_commit'] or '')[:10])}</td></tr>"
            )
        parts.append("</table>")
        for cell_id in store.cell_ids(conn, sweep):
            verdicts = store.metric_series(conn, cell_id, None, sweep)
            changes = trends.verdict_changes(cell_id, verdicts)
            for m in store.metrics_of(conn, cell_id):
                changes += trends.metric_changes(cell_id, m, store.metric_series(conn, cell_id, m, sweep))
            strip = "".join(
                f"<a href='{html.escape(_report_link(db, p.run_path, p.started, out) or '#')}' "
                f"title='{html.escape(p.started)}: "
                f"{p.verdict}'><span class='v' style='background:{COLOURS.get(p.verdict, '#000')}'></span></a>"
                for p in verdicts
            )
            img = cell_plot(conn, cell_id, changes)
            parts.append(f"<section class='cell' data-cell='{html.escape(cell_id)}'><h3>{html.escape(cell_id)}</h3>")
            parts.append(f"<p>{strip}</p>")
            parts += [f"<p class='change'>{html.escape(c.describe())}</p>" for c in changes]
            if img:
                parts.append(f"<img class='plot' alt='{html.escape(cell_id)}' src='{img}'>")
            parts.append("</section>")
    page = (
        "<!doctype html><html><head><meta charset='utf-8'><title>pdsweep history</title>"
        f"<style>{_CSS}</style></head><body>{''.join(parts)}<script>{_JS}</script></body></html>"
    )
    return layout.write_text(out, page)
