"""Text views of the history: ``pdsweep history show`` (series and changes per cell and
metric) and what a newly added run changed (``pdsweep history add``, ``make nightly``)."""

from __future__ import annotations

import fnmatch
import sqlite3
from dataclasses import dataclass
from pathlib import Path

from pdsweep.history import store, trends
from pdsweep.results import layout

DEFAULT_METRICS = ("verdict", "accuracy.*", "gbps_wall", "ttft_p50_s", "tpot_mean_s")


def changes_of(
    conn: sqlite3.Connection, cell_id: str, metric_globs: tuple[str, ...] = ("*",), sweep: str | None = None
) -> list[trends.Change]:
    """Every sustained change of one cell: its verdict and each metric matching a glob."""
    out: list[trends.Change] = []
    if any(fnmatch.fnmatchcase("verdict", g) for g in metric_globs):
        out += trends.verdict_changes(cell_id, store.metric_series(conn, cell_id, None, sweep))
    for m in store.metrics_of(conn, cell_id):
        if any(fnmatch.fnmatchcase(m, g) for g in metric_globs):
            out += trends.metric_changes(cell_id, m, store.metric_series(conn, cell_id, m, sweep))
    return out


def show_lines(
    db: Path, cell_glob: str = "*", metric_globs: tuple[str, ...] = DEFAULT_METRICS, sweep: str | None = None
) -> list[str]:
    """Per matching cell and metric: the series (one ``value`` per run, ``[lo, hi]`` where
    recorded) and each sustained change with its build difference. Raises ``UserError``
    for a missing store."""
    lines: list[str] = []
    with store.connect(db, create=False) as conn:
        cells = [c for c in store.cell_ids(conn, sweep) if fnmatch.fnmatchcase(c, cell_glob)]
        if not cells:
            return [f"no cell matches {cell_glob!r} in {db}"]
        for cell_id in cells:
            lines.append(cell_id)
            metrics = ["verdict"] if any(fnmatch.fnmatchcase("verdict", g) for g in metric_globs) else []
            metrics += [
                m for m in store.metrics_of(conn, cell_id) if any(fnmatch.fnmatchcase(m, g) for g in metric_globs)
            ]
            for m in metrics:
                pts = store.metric_series(conn, cell_id, None if m == "verdict" else m, sweep)
                vals = "  ".join(_point(p, m) for p in pts)
                lines.append(f"  {m}: {vals}")
            for c in changes_of(conn, cell_id, tuple(metric_globs), sweep):
                lines.append(f"  CHANGE {c.describe()}")
    return lines


def _point(p: store.Point, metric: str) -> str:
    tag = (p.run_name or p.run_key)[-15:]
    if metric == "verdict":
        return f"{tag}={p.verdict}"
    iv = f" [{p.lo:.4g}, {p.hi:.4g}]" if p.lo is not None and p.hi is not None else ""
    return f"{tag}={p.value:.4g}{iv}"


@dataclass(frozen=True)
class RunNews:
    """What the history says of one run: changes that began with it (new) and changes
    that began earlier and still hold at it (lasting)."""

    new: tuple[trends.Change, ...]
    lasting: tuple[trends.Change, ...]

    def lines(self) -> list[str]:
        if not self.new and not self.lasting:
            return ["history: no sustained change in any cell's verdict or figures at this run"]
        out = [f"history: NEW {c.describe()}" for c in self.new]
        return out + [f"history: LASTING {c.describe()}" for c in self.lasting]


def run_news(db: Path, run_dir: Path) -> RunNews:
    """Changes that start at, or last until, the run ``run_dir`` (already added)."""
    index = layout.read_json(Path(run_dir) / layout.RUN_FILE)
    key = store.run_key(index)
    new, lasting = [], []
    with store.connect(db, create=False) as conn:
        for cell_id in store.cell_ids(conn, index.get("sweep_name")):
            for c in changes_of(conn, cell_id, ("*",), index.get("sweep_name")):
                pts = store.metric_series(
                    conn, cell_id, None if c.metric == "verdict" else c.metric, index.get("sweep_name")
                )
                keys = [p.run_key for p in pts]
                if key not in keys:
                    continue
                first, here = keys.index(c.first.run_key), keys.index(key)
                if first == here:
                    new.append(c)
                elif first < here < first + c.runs_since:
                    lasting.append(c)
    return RunNews(tuple(new), tuple(lasting))


def append_to_summary(run_dir: Path, news: RunNews) -> Path:
    """Write ``history.md`` into the run and append it to ``summary.md`` when the gate
    wrote one (atomically)."""
    text = "## History\n\n" + "\n".join(f"- {line.removeprefix('history: ')}" for line in news.lines()) + "\n"
    path = layout.write_text(Path(run_dir) / "history.md", text)
    summary = Path(run_dir) / "summary.md"
    if summary.is_file():
        old = summary.read_text()
        cut = old.split("\n## History\n")[0].rstrip("\n")
        layout.write_text(summary, cut + "\n\n" + text)
    return path
