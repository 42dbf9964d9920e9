"""Results layout: one directory per run, one per cell; atomic, versioned JSON.

::

    results/<run>/
      run.json            index: sweep, host, cells -> status        (RUN_FILE)
      plan.json           cells, rejected cells with rule and reason (PLAN_FILE)
      <cell-id>/
        cell.json         resolved cell, instances (argv, env), build, versions, git sha
        status.json       {"status": ok|failed, "phase", "reason", timings}
        accuracy.json     per task: value, stderr, n, expected, reference, p_value, verdict
        consistency.json  per prompt: exact-match rate, first divergence, max |dlogprob|
        transfer.json     vllm:nixl_* deltas per instance and totals, latency figures
        load.json         load phase (TTFT/TPOT/ITL percentiles, throughput; checked workload answers)
        load_check.json   every load answer vs the reference's: checked / wrong / stale per workload
        lm_eval/          lm-eval's own results and samples
        metrics/          raw /metrics text before/after each phase
        logs/             prefill-0.log, decode-0.log, proxy.log, ...

:class:`CellDir` names a cell's files and directories (``logs``, ``metrics``, ``lm_eval``);
the ``*_FILE`` / ``*_DIR`` constants are the only spelling of these names.

Every JSON file carries ``"schema": SCHEMA``; :func:`read_json` refuses newer schemas.
Writes go to a temp file in the same directory, then ``os.replace``: a reader never
sees a half-written file, and a killed run leaves either the old file or the new one.
"""

from __future__ import annotations

import json
import math
import os
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pdsweep.core.errors import UserError

SCHEMA = 1
RUN_FILE = "run.json"
PLAN_FILE = "plan.json"
CELL_FILE = "cell.json"
STATUS_FILE = "status.json"
ACCURACY_FILE = "accuracy.json"
CONSISTENCY_FILE = "consistency.json"
TRANSFER_FILE = "transfer.json"
LOAD_FILE = "load.json"
LOAD_CHECK_FILE = "load_check.json"  # load answers judged against the reference (judge.load)
EVAL_RAW = "eval.json"  # raw lm-eval figures per task (judged into accuracy.json)
PROBE_RAW = "probe.json"  # raw greedy tokens + logprobs (judged into consistency.json)

LOGS_DIR = "logs"  # per cell: one log per instance (prefill-0.log, proxy.log, ...), bench logs
METRICS_DIR = "metrics"  # per cell: raw /metrics text before/after each phase
LM_EVAL_DIR = "lm_eval"  # per cell (or an eval out dir): lm-eval's own results, samples, tasks
# outputs of gate / report / compare, in the run directory (or --out)
JUNIT_FILE, SUMMARY_FILE = "junit.xml", "summary.md"
REPORT_MD, REPORT_HTML, PLOTS_DIR = "report.md", "report.html", "plots"
COMPARE_MD, COMPARE_JSON = "compare.md", "compare.json"

FINAL_STATUSES = ("ok", "failed")  # --resume skips cells with one of these
NEEDS_GPUS = "needs-gpus"  # run.json rejected-cell rule: a valid cell the host had too few GPUs for (gate: FAIL)


def probe_prompt_name(entry: Any) -> str:
    """consistency.json's name of the probe prompt of a ``consistency.lengths`` entry: ``short``,
    ``blocks``, ``long``, or ``len<N>`` for an int N. Raises ``UserError`` naming the allowed entries."""
    if entry in ("short", "blocks", "long"):
        return str(entry)
    if isinstance(entry, int) and not isinstance(entry, bool):
        return f"len{entry}"
    raise UserError(f"consistency.lengths: unknown entry {entry!r} (allowed: short, blocks, long, an int)")


def _clean(obj: Any) -> Any:
    """JSON has no NaN: store NaN/inf as null so a reader fails closed on a missing value."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: _clean(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_clean(v) for v in obj]
    return obj


def current_umask() -> int:
    """The process umask (e.g. ``0o022``), read from ``/proc/self/status`` where Linux
    gives it, else by setting and restoring it (``os.umask`` has no read-only form)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def write_text(path: Path, text: str, fsync: bool = False, mode: int | None = None) -> Path:
    """Atomically write a text file (UTF-8): a temp file in the same directory, then
    ``os.replace`` (``fsync``: flushed to disk first; ``mode``: its permission bits, default
    ``0o666`` less the umask, as ``open()`` would give: ``mkstemp`` alone makes ``0600``,
    which a CI artifact server or a teammate cannot read). The
    file at ``path`` is replaced by a new inode, never opened for writing (so a hardlink
    into another tree is left alone). Returns ``path``. Raises
    ``UserError`` naming ``path`` when it cannot be written (a read-only directory, a
    full disk): the run's environment, not a pdsweep bug."""
    path = Path(path)
    tmp: str | None = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            if fsync:
                f.flush()
                os.fsync(f.fileno())
        os.chmod(tmp, (0o666 & ~current_umask()) if mode is None else mode)
        os.replace(tmp, path)
        tmp = None
    except OSError as e:
        raise UserError(f"{path}: cannot write: {e.strerror or e} ({path.parent})") from None
    finally:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)
    return path


def write_json(path: Path, data: dict[str, Any]) -> Path:
    """Atomically write ``data`` (plus ``schema``; NaN/inf as null) to ``path``, flushed to
    disk; returns ``path``. Raises ``UserError`` as :func:`write_text` does."""
    payload = json.dumps({"schema": SCHEMA, **_clean(data)}, indent=2, sort_keys=False, default=str)
    return write_text(path, payload + "\n", fsync=True)


def check_writable(path: Path) -> Path:
    """Raise ``UserError`` unless ``path`` can be written: not a directory, and its
    directory exists (or can be made) and is writable. Called before work starts, so a
    bad output path is reported by its own name (never a hidden temp file's)."""
    path = Path(path)
    if path.is_dir():
        raise UserError(f"{path}: is a directory, not a file to write")
    parent = path.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
        raise UserError(f"{path}: cannot write: {parent} is not a writable directory")
    if path.exists() and not os.access(path, os.W_OK) and not os.access(path.parent, os.W_OK):
        raise UserError(f"{path}: cannot write: read-only")
    return path


def read_json(path: Path) -> dict[str, Any]:
    """Read a results JSON file. Raises ``FileNotFoundError`` if absent and
    ``UserError`` if unreadable or written by a newer pdsweep (schema > SCHEMA)."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise
    except (OSError, ValueError) as e:  # ValueError: JSONDecodeError and UnicodeDecodeError
        raise UserError(f"{path}: unreadable results file: {e}") from None
    except RecursionError:  # e.g. a 200,000-deep list: no results file nests like that
        raise UserError(f"{path}: unreadable results file: JSON nested too deeply") from None
    if not isinstance(data, dict):
        raise UserError(f"{path}: expected a JSON object")
    schema = data.get("schema", 0)
    if not isinstance(schema, int) or isinstance(schema, bool):
        raise UserError(f"{path}: 'schema' must be an integer, got {schema!r}")
    if schema > SCHEMA:
        raise UserError(f"{path}: schema {schema} is newer than this pdsweep ({SCHEMA}); upgrade pdsweep")
    return data


def not_a_run(run_dir: Path) -> UserError:
    """The error for a ``run_dir`` without run.json: a directory that does not exist (``results/latest``
    before the first ``make sweep``) says what writes one."""
    if not run_dir.exists():
        return UserError(f"{run_dir}: no such run directory (`make sweep` or `pdsweep run SWEEP --out DIR` writes one)")
    return UserError(f"{run_dir}: not a pdsweep run ({RUN_FILE} missing)")


def read_json_or_none(path: Path) -> dict[str, Any] | None:
    try:
        return read_json(path)
    except FileNotFoundError:
        return None


_CELL_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,254}$")


def cell_dir(run_dir: Path, cell_id: str) -> Path:
    """``run_dir/cell_id``. Raises ``UserError`` for an id that is not one path component
    of safe characters (a corrupt run.json, an id with ``/`` or ``..``): nothing pdsweep
    reads or writes for a cell lies outside its run directory."""
    if not isinstance(cell_id, str) or not _CELL_ID.fullmatch(cell_id) or ".." in cell_id:
        raise UserError(f"{run_dir}: cell id {cell_id!r} is not a safe directory name")
    return inside(run_dir, Path(run_dir) / cell_id)


class UnresolvablePath(UserError):
    """A results path that cannot be resolved (a symlink loop): the cell fails, the run does not."""


def resolved(path: Path) -> Path:
    """``path`` resolved (symlinks followed); raises :class:`UnresolvablePath` (a ``UserError``
    naming the path) for a symlink loop or a path the OS cannot resolve."""
    try:
        return Path(path).resolve()
    except (OSError, RuntimeError) as e:  # RuntimeError: pathlib's "Symlink loop" (Python 3.11)
        raise UnresolvablePath(f"{path}: cannot resolve: {e}") from None


def inside(run_dir: Path, path: Path) -> Path:
    """``path``, after checking that it resolves inside ``run_dir`` (symlinks followed);
    raises ``UserError`` otherwise."""
    try:
        root, p = Path(run_dir).resolve(), Path(path).resolve()
    except (OSError, RuntimeError) as e:  # RuntimeError: pathlib's "Symlink loop" (Python 3.11)
        raise UnresolvablePath(f"{path}: cannot resolve: {e}") from None
    if p != root and root not in p.parents:
        raise UserError(f"{path}: outside the run directory {run_dir}")
    return Path(path)


def cell_status(run_dir: Path, cell_id: str) -> str | None:
    """``ok``/``failed``/... from the cell's status.json, or None when it has none."""
    return CellDir.of(run_dir, cell_id).status


@dataclass(frozen=True)
class CellDir:
    """One cell's directory, ``run_dir/<cell id>``, and every name in it: the JSON files
    (:meth:`file`, by the ``*_FILE`` names above) and the ``logs/``, ``metrics/`` and
    ``lm_eval/`` directories. Build it with :meth:`of`, which checks the id
    (:func:`cell_dir`)."""

    run_dir: Path
    cell_id: str

    @classmethod
    def of(cls, run_dir: Path, cell_id: str) -> CellDir:
        """The cell directory of ``cell_id``; raises ``UserError`` for an unsafe id."""
        cell_dir(run_dir, cell_id)
        return cls(Path(run_dir), cell_id)

    @property
    def path(self) -> Path:
        return self.run_dir / self.cell_id

    def file(self, name: str) -> Path:
        """``<cell dir>/<name>`` (``name``: one of the ``*_FILE`` names)."""
        return self.path / name

    def where(self, name: str) -> str:
        """``<cell id>/<name>``: how a reason names a file of this cell."""
        return f"{self.cell_id}/{name}"

    def read(self, name: str) -> dict[str, Any] | None:
        """:func:`read_json_or_none` of :meth:`file` ``(name)``."""
        return read_json_or_none(self.file(name))

    @property
    def logs(self) -> Path:
        return self.path / LOGS_DIR

    @property
    def metrics(self) -> Path:
        return self.path / METRICS_DIR

    @property
    def lm_eval(self) -> Path:
        return self.path / LM_EVAL_DIR

    @property
    def status(self) -> str | None:
        """``ok``/``failed``/... from status.json, or None when it has none."""
        data = self.read(STATUS_FILE)
        return data.get("status") if data else None
