"""What the plan asked the eval phase for, checked in the results (issue 59): accuracy.json
holds every lm-eval task of ``eval.tasks`` and consistency.json every probe prompt of
``eval.consistency.lengths``, as frozen in run.json ``eval`` when the run started, never as the
files list them, and none they do not plan; each task records the expected score run.json ``expected``
gives its model. A run.json without ``eval`` or ``expected`` fails the gate (:func:`frozen_problems`);
its checks here then stand on the sweep defaults (:class:`~pdsweep.sweepfile.phases.EvalSpec`).

The plan itself, :func:`frozen_problems`: run.json's ``cells``, ``rejected``, ``gate``, ``bench``, ``eval``,
``expected`` and ``platform`` (every plan.json cell's) and plan.json's ``cells``, ``rejected`` and
``references`` say what each results
file must hold; the gate reads them, never a results file's own claims. A default cannot stand in
for a missing key of them without judging the results by themselves (a run.json without
``bench`` would turn the load checks off), so every missing or malformed field is named, e.g.
``run.json: bench.concurrencies missing``, and the gate FAILs every judged cell with it (exit 1).
Written by :func:`pdsweep.run.sweep.write_index` and ``_write_plan`` (plan.json) of
:mod:`pdsweep.run.sweep`; a run recorded by an older pdsweep lacks some of them: rerun it, or
gate it with the pdsweep that ran it.

Also here: the load runs and checked answers of ``bench`` (:func:`load_plan`, :func:`planned_answers`); an
expected failure explains only what its ``match:`` signature names (:func:`unexplained_losses`: a UCX
drill does not hide a deleted accuracy.json); a folded cell (:mod:`pdsweep.plan.fold`) gets the verdict
of the cell that ran for it, or fails when that one has none (:func:`fold_in`)."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, TypeVar

from pydantic import ValidationError

from pdsweep.core.errors import UserError
from pdsweep.core.stats import num, obj, planned_repeats
from pdsweep.judge.facts import CellFiles, cell_from_dict, cell_problem, show
from pdsweep.plan.cell import Cell
from pdsweep.results import layout
from pdsweep.sweepfile.gatespec import GateSpec
from pdsweep.sweepfile.matrix import TRIVIAL_TEXTS
from pdsweep.sweepfile.phases import BenchSpec, EvalSpec

R = TypeVar("R")
LOST_MARK = "(metric missing"  # TransferCheck, ReadPatternCheck: a value the file should hold
FOLDED_REASON = "judged as {}, which ran for it (folded: the same deployment after vLLM's block arithmetic)"


@dataclass(frozen=True)
class PlannedEval:
    """The lm-eval tasks and probe prompt names a cell's results must hold."""

    tasks: tuple[str, ...]
    prompts: tuple[str, ...]  # empty: consistency disabled
    reference: bool = True  # eval.reference: each PD task is compared with its reference cell's
    # plan.json ``references``: PD cell id -> the reference cell the run compared it with
    # (pdsweep.plan.expand.reference_of: the sweep's default build, the variant's `reference:`)
    references: tuple[tuple[str, str], ...] = ()
    # run.json ``expected``: model -> task -> {value, tolerance, n, source} (accuracy/expected.yaml when the
    # run started, pdsweep.run.sweep.write_index): the expected score each accuracy.json task must record
    expected: dict[str, Any] = field(default_factory=dict)


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
    names = tuple(dict.fromkeys(map(layout.probe_prompt_name, c.lengths))) if c.enabled else ()
    refs = (plan or {}).get("references")
    pairs = tuple((k, v) for k, v in refs.items() if isinstance(v, str)) if isinstance(refs, dict) else ()
    return PlannedEval(tuple(spec.tasks), names, spec.reference, pairs, obj(index.get("expected")))


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
            f"{w}: task {t} missing (eval.tasks {list(self.plan.tasks)} in run.json)"
            for t in self.plan.tasks
            if t not in tasks
        ]
        out += [
            f"{w}: task {t} not planned (eval.tasks {list(self.plan.tasks)} in run.json)"
            for t in tasks
            if t not in self.plan.tasks
        ]
        cell = cell_from_dict((files.get(layout.CELL_FILE) or {}).get("cell"))
        if cell is not None:
            out += expected_against_plan(tasks, self.plan, cell.model, w)
        if self.plan.reference and cell is not None and cell.kind == "pd":
            # a run before plan.json recorded references: the cell's own build and variant
            want = dict(self.plan.references).get(cell.id) or cell.reference().id
            for t in (t for t in self.plan.tasks if isinstance(tasks.get(t), dict)):
                got = tasks[t].get("reference")
                if not isinstance(got, dict):
                    out.append(f"{w}: {t}: no reference score recorded (eval.reference is true in run.json)")
                elif got.get("cell_id") != want:
                    out.append(
                        f"{w}: {t}: reference.cell_id is {show(got.get('cell_id'))}, the cell's reference is {want}"
                    )
        return out


def expected_against_plan(tasks: dict[str, Any], plan: PlannedEval, model: str, w: str) -> list[str]:
    """Each planned task of accuracy.json ``tasks`` records the expected score run.json ``expected``
    gives ``model`` (value and tolerance equal), and none the plan does not give: an expected score is
    what a reference cell's accuracy is judged by (:func:`pdsweep.judge.accuracy.judge`), so one
    dropped from the file would pass the cell on its reference alone."""
    want = obj(plan.expected.get(model))
    out = []
    for t in (t for t in plan.tasks if isinstance(tasks.get(t), dict)):
        got, exp = tasks[t].get("expected"), want.get(t)
        where = f"run.json expected.{model}.{t}"
        if not isinstance(exp, dict):
            if got is not None:
                out.append(
                    f"{w}: {t}: expected {show(got)[:60]} recorded, but run.json expected gives {model} no {t} score"
                )
        elif not isinstance(got, dict):
            out.append(
                f"{w}: {t}: expected missing ({where} is {show(exp.get('value'))} +/- {show(exp.get('tolerance'))})"
            )
        else:
            out += [
                f"{w}: {t}: expected.{k} is {show(got.get(k))}, {where}.{k} is {show(exp.get(k))}"
                for k in ("value", "tolerance")
                if num(got.get(k)) is None or num(got.get(k)) != num(exp.get(k))
            ]
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
        lengths = f"eval.consistency.lengths gives {list(self.plan.prompts)} in run.json"
        out = [f"{w}: prompt '{n}' missing ({lengths})" for n in self.plan.prompts if n not in seen]
        return out + [
            f"{w}: prompt {show(n)} not planned ({lengths})" for n in sorted(seen - set(self.plan.prompts), key=str)
        ]


@dataclass(frozen=True)
class PlannedReferenceCheck:
    """consistency.json and load_check.json of a PD cell compared it with the reference cell the plan gives it
    (plan.json ``references``; a run before them: the cell's own reference, :meth:`Cell.reference`), never
    another: a PD cell probed against itself agrees with itself."""

    plan: PlannedEval
    name: str = "planned-reference"

    def applies(self, kind: str) -> bool:
        return kind != "ref"

    def fails(self, files: CellFiles) -> list[str]:
        cell = cell_from_dict((files.get(layout.CELL_FILE) or {}).get("cell"))
        if cell is None or cell.kind != "pd":
            return []  # CellFileCheck fails a cell without its record
        want = dict(self.plan.references).get(cell.id) or cell.reference().id
        # null or missing: compared with nothing. Allowed only where the plan runs no reference (eval.reference
        # false: the file's own judge says "no reference cell"); with references planned it fails here too
        # (a load_check.json without reference_cell PASSED: tests/test_damaged_sample.py)
        allowed = (want,) if self.plan.reference else (None, want)
        return [
            f"{files.where(name)}: reference_cell {show(got)}, the plan's reference of "
            f"{cell.id} is {want} (plan.json references)"
            for name in (layout.CONSISTENCY_FILE, layout.LOAD_CHECK_FILE)
            if isinstance(body := files.get(name), dict) and (got := body.get("reference_cell")) not in allowed
        ]


# ---------------------------------------------------------------- the plan itself
RUN, PLAN = layout.RUN_FILE, layout.PLAN_FILE
RUN_KEYS = {
    "cells": "the cells the run ran",
    "rejected": "the cells the plan rejected",
    "gate": "the frozen gate settings",
    "bench": "the load phase load.json and load_check.json must hold",
    "eval": "the lm-eval tasks and probe prompts",
    "expected": "each model's expected score per task (accuracy/expected.yaml when the run started)",
    "platform": "the sweep's platform, cuda or cpu (each planned cell's)",
}
PLAN_KEYS = {
    "cells": "the planned cells",
    "rejected": "the rejected cells",
    "references": "each PD cell's reference cell",
}
BENCH_KEYS = ("check", "workloads", "concurrencies", "num_prompts")  # needed when bench.enabled
EVAL_KEYS = ("tasks", "reference", "consistency")
CONSISTENCY_KEYS = ("enabled", "lengths", "max_tokens")
ENTRY_KEYS = ("kind", "status", "expect_fail")  # run.json cells.<id>
EXPECTED_KEYS = ("value", "tolerance")


def _missing(data: Any, keys: tuple[str, ...], where: str) -> list[str]:
    if not isinstance(data, dict):
        return [f"{where}: not an object (got {show(data)[:40]})"]
    return [f"{where}.{k} missing" for k in keys if k not in data]


def _nonempty(data: dict[str, Any], keys: tuple[str, ...], where: str) -> list[str]:
    return [f"{where}.{k}: empty (allowed: a non-empty list)" for k in keys if data.get(k) in ([], None)]


def _bench_problems(bench: Any) -> list[str]:
    where = f"{RUN}: bench"
    if (out := _missing(bench, ("enabled",), where)) or bench["enabled"] is not True:
        return out
    if out := _missing(bench, BENCH_KEYS, where) or _nonempty(bench, ("workloads", "concurrencies"), where):
        return out
    works = bench["workloads"] if isinstance(bench["workloads"], list) else []
    if bench.get("repeats") is not None and not _whole(bench["repeats"]):
        out.append(f"{where}.repeats: {show(bench['repeats'])} (allowed: null or a whole number >= 1)")
    return out + [
        f"{where}.workloads.{i}.name missing" for i, w in enumerate(works) if not isinstance(w, dict) or "name" not in w
    ]


def run_problems(index: dict[str, Any]) -> list[str]:
    """What run.json lacks of the frozen plan (the module doc): each ``run.json: FIELD missing``."""
    out = [f"{RUN}: {k} missing ({why})" for k, why in RUN_KEYS.items() if k not in index]
    if "gate" in index:
        out += _missing(index["gate"], tuple(GateSpec.model_fields), f"{RUN}: gate")
    if "bench" in index:
        out += _bench_problems(index["bench"])
    if "eval" in index:
        ev = index["eval"]
        out += _missing(ev, EVAL_KEYS, f"{RUN}: eval") or _missing(
            ev["consistency"], CONSISTENCY_KEYS, f"{RUN}: eval.consistency"
        )
    if "expected" in index:
        out += _missing(index["expected"], (), f"{RUN}: expected")
    for model, tasks in obj(index.get("expected")).items():
        out += _missing(tasks, (), f"{RUN}: expected.{model}")
        out += [
            p for task, e in obj(tasks).items() for p in _missing(e, EXPECTED_KEYS, f"{RUN}: expected.{model}.{task}")
        ]
    for cid, entry in obj(index.get("cells")).items():
        out += _missing(entry, ENTRY_KEYS, f"{RUN}: cells.{cid}")
    return out


def plan_problems(index: dict[str, Any], plan: dict[str, Any]) -> list[str]:
    """What plan.json lacks (the module doc), each cell record that is no cell (``plan.json: cells.0:
    model: Field required``), and where run.json and plan.json disagree on the cells that ran."""
    if not plan:
        return [f"{PLAN}: missing or empty (the planned cells)"]
    out = [f"{PLAN}: {k} missing ({why})" for k, why in PLAN_KEYS.items() if k not in plan]
    cells: list[Any] = plan["cells"] if isinstance(plan.get("cells"), list) else []
    planned: dict[str, Cell] = {}
    for i, d in enumerate(cells):
        if (problem := cell_problem(d)) is not None:
            out.append(f"{PLAN}: cells.{i}: {problem}")
        elif (c := cell_from_dict(d)) is not None:
            planned[c.id] = c
            if "platform" in index and c.platform != index["platform"]:
                out.append(f"{PLAN}: cells.{i}: platform {show(c.platform)}, {RUN} platform {show(index['platform'])}")
    rejected = {r.get("cell_id") for r in index.get("rejected") or [] if isinstance(r, dict)}
    ran = set(obj(index.get("cells")))
    out += [f"{PLAN}: cells: {c} missing (run.json cells lists it)" for c in ran if c not in planned]
    out += [f"{RUN}: cells.{c} missing (plan.json cells plans it)" for c in planned if c not in ran | rejected]
    refs = plan.get("references")
    if isinstance(refs, dict) and obj_true(index, "eval", "reference"):
        out += [f"{PLAN}: references.{c} missing" for c, cell in planned.items() if cell.kind == "pd" and c not in refs]
    return out


def obj_true(index: dict[str, Any], section: str, key: str) -> bool:
    """``index[section][key]`` is not false (absent counts as true: the stricter)."""
    sec = index.get(section)
    return not (isinstance(sec, dict) and sec.get(key) is False)


def frozen_problems(index: dict[str, Any], plan: dict[str, Any]) -> list[str]:
    """Every problem of :func:`run_problems` and :func:`plan_problems`; empty: the plan is whole."""
    return run_problems(index) + plan_problems(index, plan)


def planned_answers(bench: dict[str, Any]) -> tuple[tuple[str, int], ...]:
    """(workload, concurrency) pairs a PD cell's load_check.json must hold: every ``bench.workloads``
    entry at every ``bench.concurrencies`` point (:func:`pdsweep.measure.phases.run_checked`)."""
    works, concs = bench.get("workloads"), bench.get("concurrencies")
    if not isinstance(works, list) or not isinstance(concs, list):
        return ()
    names = [x.get("name") if isinstance(x, dict) else x for x in works]
    return tuple((str(n), c) for n in names for c in concs if isinstance(c, int))


def load_plan(bench: dict[str, Any], platform: Any = None) -> dict[str, Any]:
    """:class:`~pdsweep.judge.load.LoadCheck`'s ``concurrencies`` and ``num_prompts`` from run.json ``bench`` (the
    sweep's :class:`~pdsweep.sweepfile.phases.BenchSpec`, frozen): ``vllm bench serve`` runs once per
    concurrency when a ``random`` workload is planned (:func:`pdsweep.measure.phases.run_load`); a
    run.json without ``bench.workloads`` fails the gate (:func:`frozen_problems`)."""
    works = bench.get("workloads")
    names = [x.get("name") if isinstance(x, dict) else x for x in works] if isinstance(works, list) else []
    if bench.get("enabled") is not True or "random" not in names:
        return {}
    concs = bench.get("concurrencies")
    n = bench.get("num_prompts")
    return {
        "concurrencies": tuple(c for c in concs if isinstance(c, int)) if isinstance(concs, list) else (),
        "num_prompts": n if isinstance(n, int) and not isinstance(n, bool) else None,
        "repeats": _repeats(bench, platform),
    }


def _repeats(bench: dict[str, Any], platform: Any) -> tuple[int, int] | None:
    """The fewest and most runs per concurrency the load phase makes (its repeats,
    :func:`pdsweep.core.stats.planned_repeats` over run.json ``bench`` and ``platform``); None for a
    damaged setting (:func:`_bench_problems` names it)."""
    most = bench.get("max_repeats", BenchSpec.model_fields["max_repeats"].default)
    rep, ci = bench.get("repeats"), bench.get("target_ci")
    if not (rep is None or _whole(rep)) or not _whole(most) or (ci is not None and num(ci) is None):
        return None
    lo, _, hi = planned_repeats(SimpleNamespace(repeats=rep, target_ci=ci, max_repeats=most), str(platform))
    return lo, hi


def _whole(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 1


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
