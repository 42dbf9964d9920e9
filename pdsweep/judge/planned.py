"""What the run's plan says a cell's results must hold, never what the files list (issue 59):
run.json as frozen when the run started (``eval``, ``bench``, ``folded``; a run.json without
``eval`` is held to the sweep defaults, :class:`~pdsweep.sweepfile.phases.EvalSpec`, and each
reason says so), plan.json ``references`` and the cell's expectation. Eval: every task of
``eval.tasks`` and probe prompt of ``eval.consistency.lengths`` (:func:`planned_eval`); load: the
runs and checked answers of ``bench`` (:func:`load_plan`, :func:`planned_answers`); an expected
failure explains only what its ``match:`` signature names (:func:`unexplained_losses`: a UCX drill
does not hide a deleted accuracy.json); a folded cell (:mod:`pdsweep.plan.fold`) gets the verdict
of the cell that ran for it, or fails when that one has none (:func:`fold_in`)."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from pydantic import ValidationError

from pdsweep.core.errors import UserError
from pdsweep.judge.facts import CellFiles, cell_from_dict, show
from pdsweep.results import layout
from pdsweep.sweepfile.matrix import TRIVIAL_TEXTS
from pdsweep.sweepfile.phases import EvalSpec

R = TypeVar("R")
LOST_MARK = "(metric missing"  # TransferCheck, ReadPatternCheck: a value the file should hold
FOLDED_REASON = "judged as {}, which ran for it (folded: the same deployment after vLLM's block arithmetic)"
NO_EVAL = " (run.json records no eval: the sweep defaults)"


@dataclass(frozen=True)
class PlannedEval:
    """The lm-eval tasks and probe prompt names a cell's results must hold."""

    tasks: tuple[str, ...]
    prompts: tuple[str, ...]  # empty: consistency disabled
    reference: bool = True  # eval.reference: each PD task is compared with its reference cell's
    source: str = ""  # NO_EVAL when the defaults stand in for run.json's eval
    # plan.json ``references``: PD cell id -> the reference cell the run compared it with
    # (pdsweep.plan.expand.reference_of: the sweep's default build, the variant's `reference:`)
    references: tuple[tuple[str, str], ...] = ()


def planned_eval(index: dict[str, Any], plan: dict[str, Any] | None = None) -> PlannedEval:
    """The :class:`PlannedEval` of run.json ``index``. Prompt names are those
    :func:`pdsweep.results.layout.probe_prompt_name` gives (``short``, ``blocks``, ``long``,
    ``len<N>``). Raises ``UserError`` naming the field for an invalid frozen ``eval``."""
    raw = index.get("eval")
    try:
        spec = EvalSpec() if raw is None else EvalSpec.model_validate(raw)
    except ValidationError as e:
        err = e.errors()[0]
        raise UserError(
            f"{layout.RUN_FILE}: eval.{'.'.join(map(str, err['loc']))}: {err['msg']}: "
            "the frozen eval settings are invalid"
        ) from None
    c = spec.consistency
    names = tuple(dict.fromkeys(map(layout.probe_prompt_name, c.lengths))) if c.enabled else ()
    refs = (plan or {}).get("references")
    pairs = tuple((k, v) for k, v in refs.items() if isinstance(v, str)) if isinstance(refs, dict) else ()
    return PlannedEval(tuple(spec.tasks), names, spec.reference, NO_EVAL if raw is None else "", pairs)


@dataclass(frozen=True)
class PlannedTasksCheck:
    """accuracy.json holds a result for every task of the planned ``eval.tasks``; with
    ``eval.reference`` a PD cell's task records its reference cell's score."""

    plan: PlannedEval
    name: str = "planned-tasks"

    def applies(self, kind: str) -> bool:
        return True

    def fails(self, files: CellFiles) -> list[str]:
        tasks = (files.get(layout.ACCURACY_FILE) or {}).get("tasks")
        if not isinstance(tasks, dict) or not tasks:
            return []  # AccuracyCheck fails the file ("no tasks")
        w = files.where(layout.ACCURACY_FILE)
        out = [
            f"{w}: task {t} missing (eval.tasks {list(self.plan.tasks)} in run.json{self.plan.source})"
            for t in self.plan.tasks
            if t not in tasks
        ]
        cell = cell_from_dict((files.get(layout.CELL_FILE) or {}).get("cell"))
        if self.plan.reference and cell is not None and cell.kind == "pd":
            # a run before plan.json recorded references: the cell's own build and variant
            want = dict(self.plan.references).get(cell.id) or cell.reference().id
            for t in (t for t in self.plan.tasks if isinstance(tasks.get(t), dict)):
                got = tasks[t].get("reference")
                if not isinstance(got, dict):
                    out.append(
                        f"{w}: {t}: no reference score recorded (eval.reference is true in run.json{self.plan.source})"
                    )
                elif got.get("cell_id") != want:
                    out.append(
                        f"{w}: {t}: reference.cell_id is {show(got.get('cell_id'))}, the cell's reference is {want}"
                    )
        return out


@dataclass(frozen=True)
class PlannedPromptsCheck:
    """consistency.json (PD cells) compared every planned probe prompt."""

    plan: PlannedEval
    name: str = "planned-prompts"

    def applies(self, kind: str) -> bool:
        return kind != "ref"

    def fails(self, files: CellFiles) -> list[str]:
        prompts = (files.get(layout.CONSISTENCY_FILE) or {}).get("prompts")
        if not isinstance(prompts, list) or not prompts:
            return []  # ConsistencyCheck fails the file ("no prompts compared")
        seen = {p.get("name") for p in prompts if isinstance(p, dict)}
        w = files.where(layout.CONSISTENCY_FILE)
        return [
            f"{w}: prompt '{n}' missing (eval.consistency.lengths gives {list(self.plan.prompts)} in "
            f"run.json{self.plan.source})"
            for n in self.plan.prompts
            if n not in seen
        ]


def planned_answers(bench: dict[str, Any]) -> tuple[tuple[str, int], ...]:
    """(workload, concurrency) pairs a PD cell's load_check.json must hold: every ``bench.workloads``
    entry at every ``bench.concurrencies`` point (:func:`pdsweep.measure.phases.run_checked`)."""
    works, concs = bench.get("workloads"), bench.get("concurrencies")
    if not isinstance(works, list) or not isinstance(concs, list):
        return ()
    names = [x.get("name") if isinstance(x, dict) else x for x in works]
    return tuple((str(n), c) for n in names for c in concs if isinstance(c, int))


def load_plan(bench: dict[str, Any]) -> dict[str, Any]:
    """:class:`~pdsweep.judge.load.LoadCheck`'s ``concurrencies`` and ``num_prompts`` from run.json ``bench`` (the
    sweep's :class:`~pdsweep.sweepfile.phases.BenchSpec`, frozen): ``vllm bench serve`` runs once per
    concurrency when a ``random`` workload is planned (:func:`pdsweep.measure.phases.run_load`);
    a run.json without ``bench.workloads`` predates them and planned ``random``."""
    works = bench.get("workloads")
    names = [x.get("name") if isinstance(x, dict) else x for x in works] if isinstance(works, list) else ["random"]
    if bench.get("enabled") is not True or "random" not in names:
        return {}
    concs = bench.get("concurrencies")
    n = bench.get("num_prompts")
    return {
        "concurrencies": tuple(c for c in concs if isinstance(c, int)) if isinstance(concs, list) else (),
        "num_prompts": n if isinstance(n, int) and not isinstance(n, bool) else None,
    }


def signature_matches(pattern: str, reasons: list[str], status: dict[str, Any]) -> bool:
    """``pattern`` (a ``match:`` regex) found in the reasons, status reason or log tail; an
    unusable pattern, or one that matches a trivial text such as the empty string
    (:data:`~pdsweep.sweepfile.matrix.TRIVIAL_TEXTS`, refused by validate), never matches (fail closed)."""
    text = "\n".join([*reasons, str(status.get("reason") or ""), *map(str, status.get("log_tail") or [])])
    try:
        rx = re.compile(pattern)
    except re.error:
        return False
    return not any(rx.search(t) for t in TRIVIAL_TEXTS) and rx.search(text) is not None


def unexplained_losses(pattern: str, reasons: list[str], files: CellFiles) -> list[str]:
    """The reasons that report a lost result (:meth:`CellFiles.problem` of a file, or a
    missing metric) and that ``pattern`` does not match on their own."""
    lost = {files.problem(name) for name in files.problems}
    return [r for r in reasons if (r in lost or LOST_MARK in r) and not signature_matches(pattern, [r], {})]


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
                why = FOLDED_REASON.format(runner)
                out.append(dataclasses.replace(r, cell_id=alias, reasons=(why, *r.reasons)))  # type: ignore
    ran = {r.cell_id for r in out}  # type: ignore[attr-defined]
    out += [missing(str(a), str(runner)) for a, runner in folded.items() if a not in ran]
    return out
