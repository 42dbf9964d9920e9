"""The history store: one SQLite file (standard library, one writer at a time, atomic
transactions) holding, per run, its provenance and gate headline, and per cell its
verdict, build facts and judged figures with their intervals. Raw logs stay in the run
directories; the store keeps their path.

A run is keyed by (sweep name, run name, start time) from run.json: adding a run again
(e.g. after ``--resume``) replaces its entry, never duplicates it. A store written by
another schema version is refused with the version found (:data:`SCHEMA_VERSION`).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import sqlite3
from collections.abc import Iterator
from contextlib import closing, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pdsweep.core.errors import UserError
from pdsweep.core.stats import num
from pdsweep.judge.facts import load_files
from pdsweep.judge.gate import GateResult, gate_run
from pdsweep.results import layout

SCHEMA_VERSION = 1
# transfer.json totals kept per cell (name -> unit); the headline ones are plotted
TOTALS = {
    "gbps_wall": "GB/s",
    "gbps_xfer": "GB/s",
    "xfer_time_p50_s": "s",
    "ttft_p50_s": "s",
    "ttft_mean_s": "s",
    "tpot_mean_s": "s",
    "itl_mean_s": "s",
    "e2e_mean_s": "s",
    "bytes": "B",
    "num_transfers": "",
}
LOAD_STATS = ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms")
Z95 = 1.959963984540054  # two-sided 95 % normal quantile, for accuracy's stderr

_SCHEMA = """
CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE runs (
  run_key TEXT PRIMARY KEY, sweep TEXT NOT NULL, name TEXT, started TEXT NOT NULL, finished TEXT,
  pdsweep_commit TEXT, pdsweep_version TEXT, host TEXT, path TEXT, passed INTEGER NOT NULL,
  headline TEXT NOT NULL, added TEXT NOT NULL);
CREATE TABLE cells (
  run_key TEXT NOT NULL REFERENCES runs(run_key) ON DELETE CASCADE, cell_id TEXT NOT NULL,
  compare_key TEXT, kind TEXT, build TEXT, verdict TEXT NOT NULL, reason TEXT,
  vllm_version TEXT, vllm_commit TEXT, nixl_version TEXT, fixes TEXT, patched_sha TEXT, config_hash TEXT,
  PRIMARY KEY (run_key, cell_id));
CREATE TABLE figures (
  run_key TEXT NOT NULL REFERENCES runs(run_key) ON DELETE CASCADE, cell_id TEXT NOT NULL,
  metric TEXT NOT NULL, value REAL NOT NULL, lo REAL, hi REAL, unit TEXT,
  PRIMARY KEY (run_key, cell_id, metric));
CREATE INDEX figures_series ON figures (cell_id, metric);
"""


@dataclass(frozen=True)
class Figure:
    """One judged number of one cell: ``value`` with an optional interval ``[lo, hi]``."""

    metric: str
    value: float
    lo: float | None = None
    hi: float | None = None
    unit: str = ""


# ---------------------------------------------------------------- opening
@contextmanager
def connect(db: Path, create: bool = True) -> Iterator[sqlite3.Connection]:
    """An open store. Raises ``UserError`` when ``db`` is not a pdsweep history store of
    :data:`SCHEMA_VERSION` (or does not exist and ``create`` is false)."""
    db = Path(db)
    if not db.exists() and not create:
        raise UserError(f"{db}: no history store (add a run first: pdsweep history add RUN --db {db})")
    if db.exists() and not db.is_file():
        raise UserError(f"{db}: history store path is not a file")
    db.parent.mkdir(parents=True, exist_ok=True)
    try:
        conn = sqlite3.connect(db, timeout=30)
    except sqlite3.Error as e:
        raise UserError(f"{db}: cannot open history store: {e}") from None
    with closing(conn):
        try:
            conn.execute("PRAGMA foreign_keys = ON")
            _check_schema(conn, db)
            yield conn
        except sqlite3.Error as e:  # a damaged store (zeroed pages, a dropped table): named, never a traceback
            raise UserError(
                f"{db}: damaged history store (SQLite: {e}); re-create it from the run directories"
            ) from None


def _check_schema(conn: sqlite3.Connection, db: Path) -> None:
    try:
        tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")}
    except sqlite3.DatabaseError as e:
        raise UserError(f"{db}: not a pdsweep history store (SQLite: {e})") from None
    if not tables:
        with conn:
            conn.executescript(_SCHEMA)
            conn.execute("INSERT INTO meta VALUES ('schema_version', ?)", (str(SCHEMA_VERSION),))
        return
    if "meta" not in tables:
        raise UserError(f"{db}: not a pdsweep history store (tables: {', '.join(sorted(tables))})")
    row = conn.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone()
    found = row[0] if row else None
    if found != str(SCHEMA_VERSION):
        raise UserError(
            f"{db}: history store schema version {found}, this pdsweep reads version {SCHEMA_VERSION}; "
            f"re-create it from the run directories (pdsweep history add RUN ... --db NEW)"
        )


# ---------------------------------------------------------------- one run's rows
def run_key(index: dict[str, Any]) -> str:
    """Stable id of a run from run.json's sweep name, run name and start time."""
    ident = [index.get("sweep_name"), index.get("name"), index.get("started")]
    return hashlib.sha256(json.dumps(ident).encode()).hexdigest()[:16]


def vllm_commit(version: str | None) -> str | None:
    """The git commit in a vLLM version's local part (``0.33.1.dev12+g1a2b3c4``), if any."""
    m = re.search(r"\+g([0-9a-f]{7,40})", version or "")
    return m.group(1) if m else None


def cell_figures(run_dir: Path, cell_id: str, files_totals: dict[str, Any]) -> list[Figure]:
    """The figures kept for one cell: accuracy per task (interval value +- 1.96 stderr),
    transfer totals (:data:`TOTALS`) and load-phase statistics per concurrency
    (``load.c<N>.<stat>.<p50|p90|p99|mean>`` in ms, ``load.c<N>.output_tok_s``)."""
    out: list[Figure] = []
    files = load_files(run_dir, cell_id)
    acc = files.get(layout.ACCURACY_FILE) or {}
    for task, t in sorted((acc.get("tasks") or {}).items()):
        v, se = num(t.get("value")), num(t.get("stderr"))
        if v is not None:
            lo, hi = (v - Z95 * se, v + Z95 * se) if se is not None else (None, None)
            out.append(Figure(f"accuracy.{task}", v, lo, hi, "score"))
    for name, unit in TOTALS.items():
        v = num(files_totals.get(name))
        if v is not None:
            out.append(Figure(name, v, unit=unit))
    load = files.get(layout.LOAD_FILE) or {}
    for r in load.get("runs") or []:
        c = r.get("concurrency")
        for stat in LOAD_STATS:
            for q, v in (r.get(stat) or {}).items():
                if (x := num(v)) is not None:
                    out.append(Figure(f"load.c{c}.{stat}.{q}", x, unit="ms"))
        if (x := num(r.get("output_tok_s"))) is not None:
            out.append(Figure(f"load.c{c}.output_tok_s", x, unit="tok/s"))
    return out


def run_path_for(db: Path, run_dir: Path) -> str:
    """The run directory as the store keeps it: relative to the store's own directory, so that a
    store carried between CI runners with its runs beside it (BASELINE) still finds them; the
    dashboard links a path only while the run.json there is the same run (``RUN=results/nightly``
    is reused every night: an old entry's path then holds a newer run)."""
    return os.path.relpath(Path(run_dir).resolve(), Path(db).resolve().parent)


def resolve_run_path(db: Path, run_path: str | None, started: str | None) -> Path | None:
    """The directory of a stored run path (relative to ``db``'s directory; an absolute path of an
    older store as is) when the run.json there is still that run (its ``started`` equals
    ``started``); None otherwise: the run is gone or its directory was reused by a later run."""
    if not run_path:
        return None
    p = Path(db).resolve().parent / run_path
    try:
        index = layout.read_json(p / layout.RUN_FILE)
    except (OSError, ValueError, UserError):
        return None
    return p if isinstance(index, dict) and index.get("started") == started else None


def add_run(db: Path, run_dir: Path, result: GateResult | None = None) -> str:
    """Append (or replace) ``run_dir`` in the store in one transaction; returns its run key.
    The gate is recomputed from the run's files unless ``result`` is given. Raises
    ``UserError`` for a run directory without a readable run.json, and for one shard of a
    sharded run (``pdsweep run --shard i/n``): the night is one run, added once from the merged
    view of all its shards (:func:`pdsweep.results.shards.merged_view`)."""
    run_dir = Path(run_dir)
    index = layout.read_json(run_dir / layout.RUN_FILE)
    if not index.get("sweep_name") or not index.get("started"):
        raise UserError(f"{run_dir / layout.RUN_FILE}: sweep_name and started are required for the history")
    shard = index.get("shard")
    if isinstance(shard, dict) and "index" in shard:
        raise UserError(
            f"{run_dir / layout.RUN_FILE}: shard: {shard.get('index')}/{shard.get('count')}: one shard of a run; "
            "add all its shard directories together (`pdsweep history add DIR,DIR,...`): the history keeps the run once"
        )
    result = result or gate_run(run_dir)
    key = run_key(index)
    rows = []
    for c in result.cells:
        cj = load_files(run_dir, c.cell_id).get(layout.CELL_FILE) or {}
        b = cj.get("build") or {}
        rows.append((c, b, cj, cell_figures(run_dir, c.cell_id, c.facts.totals)))
    with connect(db) as conn, conn:
        conn.execute("DELETE FROM runs WHERE run_key = ?", (key,))
        conn.execute(
            "INSERT INTO runs VALUES (?,?,?,?,?,?,?,?,?,?,?,datetime('now'))",
            (
                key,
                index["sweep_name"],
                index.get("name"),
                index["started"],
                index.get("finished"),
                index.get("git_sha"),
                index.get("pdsweep_version"),
                json.dumps(index.get("host") or {}, sort_keys=True),
                run_path_for(db, run_dir),
                int(result.passed),
                result.headline(),
            ),
        )
        for c, b, cj, figs in rows:
            conn.execute(
                "INSERT INTO cells VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?)",
                (
                    key,
                    c.cell_id,
                    c.facts.compare_key or cj.get("compare_key"),
                    c.kind,
                    c.facts.build or b.get("name"),
                    c.verdict,
                    c.message or None,
                    b.get("vllm_version"),
                    vllm_commit(b.get("vllm_version")),
                    b.get("nixl_version"),
                    json.dumps(b.get("fixes"), sort_keys=True) if b.get("fixes") is not None else None,
                    json.dumps(b.get("patched_files_sha256"), sort_keys=True),
                    c.facts.config_hash or cj.get("config_hash"),
                ),
            )
            conn.executemany(
                "INSERT OR REPLACE INTO figures VALUES (?,?,?,?,?,?,?)",
                [(key, c.cell_id, f.metric, f.value, f.lo, f.hi, f.unit) for f in figs],
            )
    return key


# ---------------------------------------------------------------- reading
@dataclass(frozen=True)
class Point:
    """One run's entry of a series (a cell's metric, or its verdict when ``value`` is None)."""

    run_key: str
    started: str
    run_name: str | None
    run_path: str | None
    verdict: str
    value: float | None
    lo: float | None
    hi: float | None
    unit: str | None
    build: dict[str, Any]


BUILD_FIELDS = ("vllm_version", "vllm_commit", "nixl_version", "fixes", "patched_sha", "config_hash")


def metric_series(conn: sqlite3.Connection, cell_id: str, metric: str | None, sweep: str | None = None) -> list[Point]:
    """A cell's runs in start order with ``metric``'s figure; ``metric=None`` gives the
    verdicts only. A run without that figure is left out of a metric series."""
    cols = ", ".join(f"c.{k}" for k in BUILD_FIELDS)
    sql = (
        f"SELECT r.run_key, r.started, r.name, r.path, c.verdict, r.pdsweep_commit, {cols} "
        "FROM cells c JOIN runs r USING (run_key) WHERE c.cell_id = ?"
        + (" AND r.sweep = ?" if sweep else "")
        + " ORDER BY r.started, r.run_key"
    )
    figs: dict[str, tuple[float, float | None, float | None, str | None]] = {}
    if metric is not None:
        for k, v, lo, hi, unit in conn.execute(
            "SELECT run_key, value, lo, hi, unit FROM figures WHERE cell_id = ? AND metric = ?", (cell_id, metric)
        ):
            if any(x is not None and (isinstance(x, bool) or not isinstance(x, (int, float))) for x in (v, lo, hi)):
                db = conn.execute("PRAGMA database_list").fetchone()[2]
                raise UserError(
                    f"{db}: damaged history store: figures row (run {k}, cell {cell_id}, metric {metric}) holds "
                    f"value/lo/hi {v!r}/{lo!r}/{hi!r}, not numbers"
                )
            figs[k] = (v, lo, hi, unit)
    out = []
    for row in conn.execute(sql, (cell_id, sweep) if sweep else (cell_id,)):
        build = {"pdsweep_commit": row[5], **dict(zip(BUILD_FIELDS, row[6:]))}
        if metric is None:
            out.append(Point(row[0], row[1], row[2], row[3], row[4], None, None, None, None, build))
        elif row[0] in figs:
            out.append(Point(row[0], row[1], row[2], row[3], row[4], *figs[row[0]], build))
    return out


def cell_ids(conn: sqlite3.Connection, sweep: str | None = None) -> list[str]:
    sql = "SELECT DISTINCT c.cell_id FROM cells c JOIN runs r USING (run_key)"
    return [
        r[0]
        for r in conn.execute(sql + (" WHERE r.sweep = ?" if sweep else "") + " ORDER BY 1", (sweep,) if sweep else ())
    ]


def metrics_of(conn: sqlite3.Connection, cell_id: str) -> list[str]:
    return [r[0] for r in conn.execute("SELECT DISTINCT metric FROM figures WHERE cell_id = ? ORDER BY 1", (cell_id,))]


def runs(conn: sqlite3.Connection, sweep: str | None = None) -> list[dict[str, Any]]:
    cur = conn.execute(
        "SELECT run_key, sweep, name, started, path, passed, headline, pdsweep_commit FROM runs"
        + (" WHERE sweep = ?" if sweep else "")
        + " ORDER BY started, run_key",
        (sweep,) if sweep else (),
    )
    cols = [d[0] for d in cur.description]
    return [dict(zip(cols, r)) for r in cur]
