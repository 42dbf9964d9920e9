"""Each cell's seconds for the schedule, the budget check and the shard cut: measured in a
previous run where it has a usable record (``--durations-from RUN_DIR``,
:mod:`pdsweep.results.celltimes`), else pdsweep's duration model
(:func:`pdsweep.plan.startup.estimator`: startup by model size + :func:`pdsweep.plan.schedule.eval_s`).

The figures mean what the schedule simulates. ``wall``: a cell from its start to its end
(:func:`pdsweep.plan.schedule.pack`, the shard cut :func:`pdsweep.plan.shards.cut`); ``work``: its
measured phases once its instances answer (the reuse dispatch, :func:`pdsweep.plan.dispatch.simulate`,
starts a cell's new instances ``wall - work`` before them). A cell measured paired with its other
build (:mod:`pdsweep.run.pairs`: both deployed at once, ``wall_s`` the pair's) counts its share: on CPU
the schedule places the two one after the other and adds the pair overhead
(:func:`pdsweep.plan.pairing.overhead_s`, :mod:`pdsweep.run.pairplan`), so each side is half of the
pair's wall less that overhead; on GPUs the pair runs at once before the dispatch, so each side is
the pair's wall.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pdsweep.plan.cell import Cell
from pdsweep.plan.pairing import overhead_s
from pdsweep.plan.schedule import estimate_s, eval_s
from pdsweep.results.celltimes import CellTime, RunDurations

MODEL_WORDS = "pdsweep's duration model"


@dataclass(frozen=True)
class CellClock:
    """Seconds per cell: ``model`` (cell -> seconds, :func:`pdsweep.plan.startup.estimator`),
    ``platform`` of the sweep, ``run``: the measured durations (None: the model alone)."""

    model: Callable[[Cell], float]
    platform: str
    run: RunDurations | None = None

    def measured(self, cell: Cell) -> CellTime | None:
        """``cell``'s usable record in :attr:`run` (None: the model's figure counts)."""
        if self.run is None or self.run.platform != self.platform:
            return None
        return self.run.cells.get(cell.id)

    def wall(self, cell: Cell) -> float:
        """Seconds from ``cell``'s start to its end (measured, or the model's)."""
        t = self.measured(cell)
        if t is None:
            return self.model(cell)
        other = self.run.cells.get(t.partner) if self.run is not None and t.partner else None
        if other is None:
            return t.wall_s
        pair = max(t.wall_s, other.wall_s)
        per = overhead_s(self.platform, 1)  # None (GPUs): the pair runs at once before the dispatch
        return pair if per is None else max(pair - per, 0.0) / 2

    def rank(self, cell: Cell) -> float:
        """Seconds the run order sorts ``cell`` by (:func:`pdsweep.plan.schedule.order`, longest
        first): its measured wall, else :func:`pdsweep.plan.schedule.estimate_s` (the order without
        durations, unchanged)."""
        return estimate_s(cell) if self.measured(cell) is None else self.wall(cell)

    def work(self, cell: Cell) -> float:
        """Seconds of ``cell``'s measured phases once its instances answer (measured: its wall
        less its startup; else :func:`pdsweep.plan.schedule.eval_s`)."""
        t = self.measured(cell)
        if t is None:
            return eval_s(cell)
        return max(self.wall(cell) - t.startup_s, 0.0)

    def why_model(self, cell: Cell) -> str | None:
        """Why ``cell`` takes the model's figure though durations were given (None: measured,
        or no durations given)."""
        if self.run is None or self.measured(cell) is not None:
            return None
        if self.run.platform != self.platform:
            return f"{self.run.run_dir} ran on {self.run.platform}, this sweep on {self.platform}"
        return self.run.unusable.get(cell.id, f"not in {self.run.run_dir}")

    def record(self, cells: list[Cell]) -> dict[str, Any]:
        """plan.json ``durations``: where the figures of ``cells`` come from. ``from``: the run
        directory (None: the model alone); ``measured``/``model``: how many cells each;
        ``unusable``: cell id -> why a record there gave no figure; ``line``: it in words."""
        measured = [c for c in cells if self.measured(c) is not None]
        model = len(cells) - len(measured)
        if self.run is None:
            line = f"{model} cells from {MODEL_WORDS}"
            return {"from": None, "measured": 0, "model": model, "unusable": {}, "line": line}
        bad = {c.id: why for c in cells if (why := self.why_model(c)) and c.id in self.run.unusable}
        line = f"{len(measured)} cells measured in {self.run.run_dir}, {model} from {MODEL_WORDS}"
        if bad:
            line += f" ({len(bad)} with an unusable record there)"
        if self.run.platform != self.platform:
            line += f" ({self.run.run_dir} ran on {self.run.platform}, this sweep on {self.platform})"
        return {"from": str(self.run.run_dir), "measured": len(measured), "model": model, "unusable": bad, "line": line}
