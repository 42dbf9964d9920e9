"""Gate check on the load answers (``load_check.json``, :mod:`pdsweep.measure.loadcheck`): a PD
cell fails when any answer under load differs from the reference's, is stale, failed, or has
no reference answer; each reason gives the count, concurrency, first example and triage."""

from __future__ import annotations

from dataclasses import dataclass

from pdsweep.judge.facts import CellFiles
from pdsweep.results import layout


@dataclass(frozen=True)
class LoadAnswersCheck:
    """``required``: the run's ``bench.enabled`` and ``bench.check`` (frozen in run.json): then
    a missing load_check.json fails the PD cell (fail closed); otherwise one present is
    still checked."""

    required: bool = False
    name: str = "load_answers"

    def applies(self, kind: str) -> bool:
        return kind == "pd"

    def fails(self, files: CellFiles) -> list[str]:
        body = files.get(layout.LOAD_CHECK_FILE)
        if body is None:
            missing = files.problems.get(layout.LOAD_CHECK_FILE, "missing") == "missing"
            return [files.problem(layout.LOAD_CHECK_FILE)] if self.required or not missing else []
        w = files.where(layout.LOAD_CHECK_FILE)
        if body.get("verdict") == "pass" and not body.get("reasons"):
            return []
        return [f"{w}: {r}" for r in body.get("reasons") or []] or [f"{w}: verdict {body.get('verdict')!r}"]
