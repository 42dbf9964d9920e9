"""The CI clock: a job's time limit (``plan --budget MINUTES``, ``validate --budget``, or the
sweep's own ``budget:``) against the planned makespan of what the job runs (the whole sweep,
or its ``--shard i/n``). A plan that cannot fit is refused naming both figures; the figure
is pdsweep's duration model (:mod:`pdsweep.plan.startup`, :mod:`pdsweep.plan.dispatch`), an
estimate, and says so, or with ``--durations-from RUN_DIR`` each cell's measured wall time there
where it has one (:mod:`pdsweep.plan.durations`), saying how many cells came from which."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Budget:
    """``minutes`` a job may take; ``source``: ``--budget`` or ``<sweep>: budget``."""

    minutes: float
    source: str


def pick(flag: float | None, sweep_budget: float | None, sweep_path: Any) -> Budget | None:
    """The flag's budget over the sweep's; None when neither is given."""
    if flag is not None:
        return Budget(flag, "--budget")
    if sweep_budget is not None:
        return Budget(sweep_budget, f"{sweep_path}: budget")
    return None


def verdict(
    makespan_s: float, budget: Budget, what: str, shards: int = 1, basis: str = "pdsweep's duration estimate"
) -> dict[str, Any]:
    """plan.json ``budget``: the figures and whether the job fits; ``line`` says it in words,
    with ``basis``, where the cells' seconds come from (``--durations-from``: how many were
    measured, :meth:`pdsweep.plan.durations.CellClock.record`); over budget, ``shards_hint`` is
    the fewest shards whose even split would fit (a lower bound: whole chains may not split evenly)."""
    minutes = makespan_s / 60
    fits = minutes <= budget.minutes
    line = (
        f"planned makespan {minutes:.0f} min ({makespan_s:.0f} s, {what}; {basis}) "
        f"{'fits' if fits else 'exceeds'} the budget of {budget.minutes:g} min ({budget.source})"
    )
    hint = None if fits else math.ceil(minutes * shards / budget.minutes)
    if hint:
        line += f"; split it: at least --shard i/{hint}"
    return {
        "minutes": budget.minutes,
        "source": budget.source,
        "makespan_min": round(minutes, 1),
        "fits": fits,
        "shards_hint": hint,
        "line": line,
    }
