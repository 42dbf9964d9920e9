"""Verdicts of folded cells (:mod:`pdsweep.plan.fold`): a cell whose deployment is identical
to another's after vLLM's block arithmetic did not run; run.json ``folded`` maps it to the
cell that ran for it, and the gate reports it under its own id with that cell's verdict,
naming both. Fail closed: a folded cell whose runner has no result fails."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, TypeVar

R = TypeVar("R")


def fold_in(results: list[R], folded: Any, missing: Callable[[str, str], R]) -> list[R]:
    """``results`` (each with ``cell_id`` and ``reasons``) with one result per folded id of
    ``folded`` (run.json ``folded``: id -> the id that ran for it) right after its runner's:
    the runner's verdict, its reasons after ``judged as RUNNER, which ran for it (folded: ...)``; ``missing(id,
    runner)`` where the runner has none. A folded id that has its own result keeps it."""
    if not isinstance(folded, dict) or not folded:
        return results
    have = {r.cell_id for r in results}  # type: ignore[attr-defined]
    out: list[R] = []
    for r in results:
        out.append(r)
        for alias, runner in folded.items():
            if runner == r.cell_id and alias not in have:  # type: ignore[attr-defined]
                why = (
                    f"judged as {runner}, which ran for it (folded: the same deployment after vLLM's block arithmetic)"
                )
                out.append(dataclasses.replace(r, cell_id=alias, reasons=(why, *r.reasons)))  # type: ignore
    ran = {r.cell_id for r in out}  # type: ignore[attr-defined]
    out += [missing(str(a), str(runner)) for a, runner in folded.items() if a not in ran]
    return out
