"""Each load point's own answer check (issue 60): a PD cell's load check (``load_check.json``,
:func:`pdsweep.judge.load.judge_load`) judges every ``bench.workloads`` entry at every
``bench.concurrencies`` point, so a point (one concurrency of one cell, :mod:`pdsweep.judge.pareto`)
carries the answers checked at *its* concurrency: a cell that answers wrong at concurrency 4 fails
the gate, its concurrency-4 point is marked failed, and its concurrency-1 point, whose answers
were all right, may still be on the front.

Which gate reasons belong to one concurrency: those of the load answers check (prefixed
``<cell>/load_check.json: ``) that name their pair as :func:`pdsweep.judge.load.answers_where`
writes it (:data:`pdsweep.judge.load.ANSWERS_WHERE`). Every other reason -- a transfer failure, a
crash, the probe, a load_check.json missing or with no reference -- fails every point of the cell,
and so does an expected failure (``expect: fail``: a drill such as the planted scrambled-KV cell of
``sweeps/cpu-pareto.yaml`` is never a configuration to deploy).
"""

from __future__ import annotations

from typing import Any

from pdsweep.core.stats import num
from pdsweep.judge.gate import PASS, XFAIL, XPASS, CellResult
from pdsweep.judge.load import ANSWERS_WHERE
from pdsweep.results import layout

COUNTS = ("checked", "wrong", "stale", "errors", "unmatched")


def answers_at(load_check: dict[str, Any] | None, concurrency: int) -> dict[str, int] | None:
    """The load check's counts (:data:`COUNTS`) summed over the workloads judged at
    ``concurrency``; None when load_check.json holds no pair at that concurrency."""
    rows = [w for w in (load_check or {}).get("workloads") or [] if isinstance(w, dict)]
    rows = [w for w in rows if w.get("concurrency") == concurrency]
    if not rows:
        return None
    return {k: int(sum(num(w.get(k)) or 0 for w in rows)) for k in COUNTS}


def point_failure(judged: CellResult, concurrency: int) -> str | None:
    """Why the point of ``judged`` at ``concurrency`` is off the front (``"<verdict>: <reason>"``),
    or None: the cell passed, or it failed only on load answers at other concurrencies."""
    if judged.verdict == PASS:
        return None
    head = f"{judged.verdict}: "
    prefix = f"{judged.cell_id}/{layout.LOAD_CHECK_FILE}: "
    if judged.verdict in (XFAIL, XPASS):  # a drill: declared to fail, never a configuration to deploy
        return head + (judged.reasons or ("expected to fail",))[0]
    mine = []
    for r in judged.reasons:
        m = ANSWERS_WHERE.match(r.removeprefix(prefix)) if r.startswith(prefix) else None
        if m is None:  # not one pair's: the whole cell's
            return head + r
        if int(m.group("concurrency")) == concurrency:
            mine.append(r)
    return head + mine[0] if mine else None
