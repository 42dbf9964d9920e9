"""Measured cell durations of a finished run (``--durations-from RUN_DIR`` of ``plan``,
``validate`` and ``run``; the nightly's last green run): what each cell really took, read
from its status.json, for the plan's budget check and shard cut (:mod:`pdsweep.plan.durations`).

Per cell the figure is status.json ``duration_s`` (seconds from the cell's start, its new
instances launching, to its end after teardown: :func:`pdsweep.run.cell.run_cell`), what the
schedule simulates a cell to take (:func:`pdsweep.plan.schedule.pack`), and ``timings.healthy_s``
(seconds until its instances answered /health: the startup part of the reuse dispatch,
:func:`pdsweep.plan.dispatch.simulate`). A record that gives no such figure is listed with why
(``unusable``), and the plan takes pdsweep's duration model for that cell: no status.json, an
unreadable or mistyped one, a status that is not final, a cell that failed although it was not
expected to (its wall time ends at the failure), a missing or non-positive ``duration_s``. A cell
expected to fail that failed counts: the failure is what the plan expects of it again.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pdsweep.core.errors import UserError
from pdsweep.core.stats import num
from pdsweep.results import layout
from pdsweep.results.schema import type_problem


@dataclass(frozen=True)
class CellTime:
    """One cell's measured seconds: ``wall_s`` (status.json ``duration_s``), ``startup_s``
    (``timings.healthy_s``, at most ``wall_s``; the whole wall when the cell never got its
    instances up) and ``partner``: the cell measured paired with it (status.json
    ``pairing.partner``, both deployed at once: :mod:`pdsweep.run.pairs`), else None."""

    wall_s: float
    startup_s: float
    partner: str | None = None


@dataclass(frozen=True)
class RunDurations:
    """The durations of the run at ``run_dir`` (``platform``: its run.json's): ``cells``: cell
    id -> :class:`CellTime` of each usable record; ``unusable``: cell id -> why its record gives
    no duration."""

    run_dir: Path
    platform: str | None
    cells: dict[str, CellTime] = field(default_factory=dict)
    unusable: dict[str, str] = field(default_factory=dict)


def _seconds(x: Any) -> float | None:
    """A finite number >= 0 (:func:`pdsweep.core.stats.num`), else None (bool, text, NaN, an int beyond
    float's range are no figure)."""
    v = num(x)
    return v if v is not None and v >= 0 else None


def cell_time(status: dict[str, Any] | None) -> CellTime | str:
    """The :class:`CellTime` of one status.json (None: absent), or why it gives none."""
    if status is None:
        return f"no {layout.STATUS_FILE}"
    if problem := type_problem(layout.STATUS_FILE, status):
        return f"{layout.STATUS_FILE}: {problem}"
    st = status.get("status")
    if st not in layout.FINAL_STATUSES:
        return f"status {st!r} (not final: {', '.join(layout.FINAL_STATUSES)})"
    if st == "failed" and not status.get("expect_fail"):
        return "failed, not expected to (its wall time ends at the failure)"
    wall = _seconds(status.get("duration_s"))
    if not wall:
        return f"no duration_s > 0 (got {status.get('duration_s')!r})"
    timings = status.get("timings")
    healthy = _seconds(timings.get("healthy_s")) if isinstance(timings, dict) else None
    pairing = status.get("pairing")
    partner = pairing.get("partner") if isinstance(pairing, dict) else None
    startup = wall if healthy is None else min(healthy, wall)
    return CellTime(wall, startup, partner if isinstance(partner, str) else None)


def read_durations(run_dir: Path) -> RunDurations:
    """The measured durations of every cell run.json ``cells`` lists. Raises ``UserError``
    naming ``run_dir`` when it does not exist or is not a run (no readable run.json with a
    ``cells`` mapping); a cell's missing or damaged record is only ``unusable``."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise UserError(f"--durations-from {run_dir}: no such run directory")
    try:
        index = layout.read_json(run_dir / layout.RUN_FILE)
    except FileNotFoundError:
        raise UserError(f"--durations-from {run_dir}: not a run (no {layout.RUN_FILE})") from None
    except UserError as e:
        raise UserError(f"--durations-from {run_dir}: not a run: {e}") from None
    cells = index.get("cells")
    if not isinstance(cells, dict):
        raise UserError(f"--durations-from {run_dir / layout.RUN_FILE}: cells: expected a mapping of cell id -> status")
    platform = index.get("platform")
    out = RunDurations(run_dir, platform if isinstance(platform, str) else None)
    for cid in cells:
        try:
            got = cell_time(layout.read_json_or_none(layout.cell_dir(run_dir, cid) / layout.STATUS_FILE))
        except UserError as e:  # an unsafe id, an unreadable or newer-schema status.json
            got = str(e)
        if isinstance(got, CellTime):
            out.cells[cid] = got
        else:
            out.unusable[cid] = got
    return out
