"""The plan a run froze (issue 59): run.json's ``cells``, ``rejected``, ``gate``, ``bench``, ``eval``
and ``expected`` and plan.json's ``cells``, ``rejected`` and ``references`` say what each results
file must hold; the gate reads them, never a results file's own claims. A default cannot stand in
for a missing key of them without judging the results by themselves (a run.json without
``bench`` would turn the load checks off), so :func:`frozen_problems` names every missing or
malformed field, e.g. ``run.json: bench.concurrencies missing``, and the gate FAILs every judged
cell with it (exit 1). Written by :func:`pdsweep.run.sweep.write_index` and
``_write_plan`` (plan.json) of :mod:`pdsweep.run.sweep`; a run recorded by an older pdsweep lacks some of them:
rerun it, or gate it with the pdsweep that ran it.
"""

from __future__ import annotations

from typing import Any

from pdsweep.core.stats import obj
from pdsweep.judge.facts import cell_from_dict, cell_problem, show
from pdsweep.plan.cell import Cell
from pdsweep.results import layout
from pdsweep.sweepfile.gatespec import GateSpec

RUN, PLAN = layout.RUN_FILE, layout.PLAN_FILE
RUN_KEYS = {
    "cells": "the cells the run ran",
    "rejected": "the cells the plan rejected",
    "gate": "the frozen gate settings",
    "bench": "the load phase load.json and load_check.json must hold",
    "eval": "the lm-eval tasks and probe prompts",
    "expected": "each model's expected score per task (accuracy/expected.yaml when the run started)",
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
    return [
        f"{where}.workloads.{i}.name missing" for i, w in enumerate(works) if not isinstance(w, dict) or "name" not in w
    ]


def run_problems(index: dict[str, Any]) -> list[str]:
    """What run.json lacks of the frozen plan (module doc): each ``run.json: FIELD missing``."""
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
    """What plan.json lacks (module doc), each cell record that is no cell (``plan.json: cells.0:
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
