"""The run's records agree: run.json, plan.json, cell.json and status.json say the same of a cell's
kind, state and expectation (:func:`disagreements`), and every cell directory is listed
(:func:`unlisted_cells`). A results file's own claim is not evidence: where they differ the cell fails.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from pdsweep.judge.facts import CellFiles, cell_from_dict, show
from pdsweep.plan.cell import Cell
from pdsweep.results import layout

# compared by :func:`disagreements` across all four files
_SHARED = ("kind", "expect_fail")


def cell_kind(files: CellFiles) -> str | None:
    """The cell's kind (``pd`` / ``ref``) as its cell.json says; ``None`` when unreadable."""
    cell = cell_from_dict((files.get(layout.CELL_FILE) or {}).get("cell"))
    return cell.kind if cell else None


def disagreements(
    cell_id: str, run_entry: dict[str, Any], planned: Any, files: CellFiles, rejected: str | None
) -> list[str]:
    """Where run.json (``run_entry``), plan.json (``planned``: a Cell or None), cell.json and
    status.json of ``cell_id`` disagree on its kind, expectation or state; ``rejected``: the
    rule that rejected it (run.json/plan.json ``rejected``), or None."""
    cell = cell_from_dict((files.get(layout.CELL_FILE) or {}).get("cell"))
    st = files.get(layout.STATUS_FILE) or {}
    out: list[str] = []
    sources = {
        layout.RUN_FILE: run_entry,
        layout.PLAN_FILE: {"kind": planned.kind, "expect_fail": planned.expect_fail} if planned else {},
        layout.CELL_FILE: {"kind": cell.kind, "expect_fail": cell.expect_fail} if cell else {},
        layout.STATUS_FILE: st,
    }
    for key in ("kind", "expect_fail"):
        said = {f: d.get(key) for f, d in sources.items() if d.get(key) is not None}
        if key == "expect_fail":  # false and absent mean the same
            said = {f: bool(v) for f, v in said.items()}
        if len(set(map(str, said.values()))) > 1:
            out.append(f"{cell_id}: files disagree on {key}: " + ", ".join(f"{f} {show(v)}" for f, v in said.items()))
    terminal = ("ok", "failed")
    if run_entry.get("status") in terminal and st.get("status") in terminal and run_entry["status"] != st["status"]:
        out.append(
            f"{cell_id}: files disagree on state: {layout.RUN_FILE} {show(run_entry['status'])}, "
            f"{layout.STATUS_FILE} {show(st['status'])}"
        )
    problem = files.problems.get(layout.STATUS_FILE, "missing")
    ran = layout.STATUS_FILE in files.data or not problem.startswith("missing")
    if rejected is not None and ran:
        out.append(
            f"{cell_id}: listed as rejected (rule {rejected}) but {layout.STATUS_FILE} says it ran "
            f"(status {show(st.get('status'))}, phase {show(st.get('phase'))}): the run is not what was planned"
        )
    return out


def record_disagreements(planned: Cell | None, files: CellFiles) -> list[str]:
    """Where cell.json's cell record is not the cell plan.json planned (``planned``): every field (platform,
    TP, blocks, build, serve args, expectation, ...) naming both values, e.g. ``cell.json: cell.platform is
    "cuda", plan.json plans "cpu"``. What a results file must hold comes from the plan: a record claiming
    another platform turns off the checks the plan's platform asks for (the CPU cells' KV integrity,
    :func:`pdsweep.judge.integrity.planned`). Empty when either record is missing (CellFileCheck and
    :func:`pdsweep.judge.planned.plan_problems` fail those)."""
    cell = cell_from_dict((files.get(layout.CELL_FILE) or {}).get("cell"))
    if cell is None or planned is None:
        return []
    w = files.where(layout.CELL_FILE)
    return [
        f"{w}: cell.{f.name} is {show(a)}, {layout.PLAN_FILE} plans {show(b)}"
        for f in dataclasses.fields(Cell)
        if f.name not in _SHARED and (a := getattr(cell, f.name)) != (b := getattr(planned, f.name))
    ]


def strictest_kind(*kinds: Any) -> str:
    """``pd`` when any source says pd (transfer and consistency checks apply) or none says
    anything; ``ref`` only when every source that names a kind says ref."""
    named = [k for k in kinds if k is not None]
    return "ref" if named and all(k == "ref" for k in named) else "pd"


def unlisted_cells(run_dir: Path, listed: set[str]) -> list[str]:
    """Cell directories of ``run_dir`` (holding a cell.json or status.json) that neither
    run.json nor plan.json lists: results the gate would otherwise never judge."""
    out = []
    try:
        entries = sorted(Path(run_dir).iterdir())
    except OSError:
        return []
    for d in entries:
        try:
            is_cell = d.is_dir() and any((d / n).exists() for n in (layout.CELL_FILE, layout.STATUS_FILE))
        except OSError:  # a symlink loop, permissions: not a cell directory this gate can read
            continue
        if is_cell and d.name not in listed:
            out.append(d.name)
    return out
