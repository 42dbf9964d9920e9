"""What the plan asked the eval phase for, checked in the results (issue 59): accuracy.json
holds every lm-eval task of ``eval.tasks`` and consistency.json every probe prompt of
``eval.consistency.lengths``, as frozen in run.json ``eval`` when the run started, never as the
files list them. A run.json without ``eval`` (runs before it was frozen) is held to the sweep
defaults (:class:`~pdsweep.sweepfile.phases.EvalSpec`), and each reason says so."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from pdsweep.core.errors import UserError
from pdsweep.judge.facts import CellFiles, cell_from_dict, show
from pdsweep.results import layout
from pdsweep.sweepfile.phases import EvalSpec, resolve_lengths

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
    :func:`pdsweep.sweepfile.phases.resolve_lengths` gives (``short``, ``blocks``, ``long``,
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
    # names only: a cap large enough that no int length is refused (the run refused those already)
    big = max([1 << 20, *(x + c.max_tokens + 2 for x in c.lengths if isinstance(x, int))])
    names = tuple(n for n, _ in resolve_lengths(16, big, c.lengths, c.max_tokens)) if c.enabled else ()
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
