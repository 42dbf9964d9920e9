"""Accuracy, judged. :func:`judge` writes the ``accuracy.json`` body at the end of a run: a
score must lie within the expected value's tolerance (``accuracy/expected.yaml``,
:func:`load_expected`) and must not be significantly below the same-sweep single-instance
reference (:func:`~pdsweep.core.stats.two_proportion_p` < ``alpha``). Gates fail closed: no
score, nothing to compare against or an unknown sample count is a failure.

The gate's checks: :class:`AccuracyCheck` (each lm-eval task within the expected score's
tolerance and agreeing with the same-sweep reference, accuracy.json) and
:class:`AccuracyRecompute` (the gate recomputes what it judges, issue 23: every task the file
calls ``pass`` is judged again by :func:`judge` from its value, n,
expectation and reference, with the ``gate.alpha`` frozen in run.json; a 0/1 metric outside
[0, 1] is impossible).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, RootModel, ValidationError

from pdsweep.core.errors import UserError
from pdsweep.core.paths import REPO
from pdsweep.core.stats import num, two_proportion_p
from pdsweep.judge.agreement import cell_kind
from pdsweep.judge.facts import (
    CellFiles,
    show,
    task_score,
)
from pdsweep.measure.lmeval import _stderr
from pdsweep.measure.tolerance import tolerance_at
from pdsweep.results import layout

EXPECTED_FILE = REPO / "accuracy" / "expected.yaml"


class Expected(BaseModel):
    """One expected score; pass when ``|measured - value| < tolerance`` (upstream
    ``test_accuracy``: ``measured - RTOL < expected < measured + RTOL``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    value: float = Field(ge=0, le=1)
    tolerance: float = Field(gt=0, le=1)
    # the sample size value and tolerance were calibrated on (pdsweep.measure.tolerance scales the
    # tolerance to a run that scores fewer)
    n: int = Field(ge=1)
    source: str = Field(min_length=1)


class _ExpectedFile(RootModel[dict[str, dict[str, Expected]]]):
    pass


def load_expected(path: Path = EXPECTED_FILE) -> dict[str, dict[str, dict[str, Any]]]:
    """Read ``accuracy/expected.yaml``: ``{model: {task: {value, tolerance, n, source}}}``
    (model = pdsweep catalogue name, task = lm-eval task name; values are fractions).

    Raises ``UserError`` naming the file and the field path (``model.task.field``) on an
    unreadable file, malformed YAML or an invalid entry. An empty file gives ``{}``.
    """
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text())
    except OSError as e:
        raise UserError(f"{path}: cannot read: {e.strerror}") from None
    except yaml.YAMLError as e:
        raise UserError(f"{path}: malformed YAML: {e}") from None
    if data is None:
        return {}
    try:
        parsed = _ExpectedFile.model_validate(data)
    except ValidationError as e:
        lines = []
        for err in e.errors():
            loc = ".".join(str(x) for x in err["loc"]) or "(top level)"
            lines.append(f"{path}: {loc}: {err['msg']} (got {err.get('input')!r})")
        raise UserError("\n".join(lines)) from None
    return {m: {t: x.model_dump() for t, x in tasks.items()} for m, tasks in parsed.root.items()}


def frozen_expected(
    models: list[str], tasks: list[str], table: dict[str, dict[str, dict[str, Any]]] | None = None
) -> dict[str, dict[str, dict[str, Any]]]:
    """run.json ``expected``: the entries of ``table`` (default :func:`load_expected`) for ``models``
    x ``tasks``, ``{model: {task: {value, tolerance, n, source}}}``, models without one left out. The
    gate holds each accuracy.json task to it (:func:`pdsweep.judge.planned.expected_against_plan`)."""
    table = load_expected() if table is None else table
    out = {m: {t: table[m][t] for t in tasks if t in table.get(m, {})} for m in dict.fromkeys(models)}
    return {m: t for m, t in out.items() if t}


def _judge_task(
    task: str,
    r: dict[str, Any],
    expected: dict[str, Any] | None,
    reference: dict[str, Any] | None,
    alpha: float,
    is_reference: bool,
) -> dict[str, Any]:
    metric = r.get("metric")
    value = num(r.get("value"))
    n = r.get("n")
    n = int(n) if isinstance(n, (int, float)) and not isinstance(n, bool) and math.isfinite(n) else None
    exp = expected.get(task) if expected else None
    ref_cell = reference.get("cell_id") if reference else None
    ref_task = ((reference or {}).get("tasks") or {}).get(task) if not is_reference else None
    ref = {"cell_id": ref_cell, "value": num(ref_task.get("value")), "n": ref_task.get("n")} if ref_task else None

    reasons: list[str] = []
    p_value: float | None = None
    if value is None:
        reasons.append(f"{task}: no score ({metric} missing or not a number)")
    else:
        if exp is not None:
            tol, how = tolerance_at(exp, n)
            exp = {**exp, "tolerance_at_n": round(tol, 4), "tolerance_how": how}
            lo, hi = exp["value"] - tol, exp["value"] + tol
            if not (lo < value < hi):
                reasons.append(
                    f"{task}: {metric} {value:.4f} outside expected {exp['value']} "
                    f"+/- {round(tol, 3)} ({exp['source']}{'; ' + how if how else ''})"
                )
        if ref is not None:
            rv, rn = ref["value"], ref["n"]
            if rv is None:
                reasons.append(f"{task}: reference {ref_cell} has no score")
            elif not (isinstance(rn, int) and rn > 0) or not (n and n > 0):
                reasons.append(
                    f"{task}: sample count unknown (cell n={n}, reference n={rn}); cannot test against reference"
                )
            else:
                p_value = two_proportion_p(round(value * n), n, round(rv * rn), rn)
                if p_value < alpha:
                    reasons.append(
                        f"{task}: {metric} {value:.4f} (n={n}) significantly below reference "
                        f"{ref_cell} {rv:.4f} (n={rn}): one-sided p={p_value:.4g} < alpha={alpha}"
                    )
        if exp is None and ref is None and not is_reference:
            reasons.append(f"{task}: nothing to gate against (no expected value, no reference)")
    note = ["reference"] if is_reference and exp is None and not reasons else []
    return {
        "metric": metric,
        "value": value,
        "stderr": _stderr(r.get("stderr")),
        "n": n,
        "expected": dict(exp) if exp else None,
        "reference": ref,
        "p_value": p_value,
        "verdict": "fail" if reasons else "pass",
        "reasons": reasons or note,
    }


def judge(
    cell_id: str,
    task_results: dict[str, dict[str, Any]],
    expected: dict[str, Any] | None,
    reference: dict[str, Any] | None,
    alpha: float,
    is_reference: bool = False,
) -> dict[str, Any]:
    """The ``accuracy.json`` body for one cell (``results/README.md``).

    ``task_results``: ``{task: {metric, value, stderr, n}}`` from :func:`run_lm_eval`.
    ``expected``: this model's entry of :func:`load_expected` (``{task: {value,
    tolerance, source}}``) or None. ``reference``: the reference cell's accuracy.json
    body (``{cell_id, tasks: {task: {value, n, ...}}}``) or None. ``alpha``: the
    ``gate.alpha`` significance level.

    A task passes only if it has a finite score, lies strictly within the expected
    tolerance where one exists (upstream ``test_accuracy``; scaled to the task's ``n`` by
    :func:`pdsweep.measure.tolerance.tolerance_at`, recorded as ``expected.tolerance_at_n``
    and ``expected.tolerance_how``), and is not significantly
    below the reference (:func:`two_proportion_p` >= ``alpha``; correct counts are
    ``round(value * n)``, valid for 0/1 metrics such as exact_match and acc). A PD task
    with neither expected value nor reference fails ("nothing to gate against").
    ``is_reference=True`` (the reference cell itself): only the expected value applies;
    without one the task passes with reason "reference". ``reasons`` lists every failed
    check; the cell verdict is pass only if every task passes (no tasks: fail).
    """
    tasks = {t: _judge_task(t, r, expected, reference, alpha, is_reference) for t, r in task_results.items()}
    ok = bool(tasks) and all(t["verdict"] == "pass" for t in tasks.values())
    return {"cell_id": cell_id, "tasks": tasks, "verdict": "pass" if ok else "fail"}


class AccuracyCheck:
    """accuracy.json: verdict pass, every task pass with a value and a sample count;
    a stated expectation or reference must come with its numbers (and the p-value)."""

    name = "accuracy"

    def applies(self, kind: str) -> bool:
        return True

    def fails(self, files: CellFiles) -> list[str]:
        acc = files.get(layout.ACCURACY_FILE)
        if acc is None:
            return [files.problem(layout.ACCURACY_FILE)]
        w = files.where(layout.ACCURACY_FILE)
        tasks = acc.get("tasks")
        if not isinstance(tasks, dict) or not tasks:
            return [f"{w}: no tasks"]
        out: list[str] = []
        for name, t in tasks.items():
            if not isinstance(t, dict):
                out.append(f"{w}: task {name}: not an object")
                continue
            s = task_score(name, t)
            if s.verdict != "pass":
                why = [str(r) for r in t.get("reasons") or []] or [f"verdict {show(s.verdict)}"]
                out += [f"{w}: {r}" if r.startswith(f"{name}:") else f"{w}: {name}: {r}" for r in why]
                continue
            # the file says pass: the numbers behind that must be there (fail closed)
            if s.value is None:
                out.append(f"{w}: {name}: value is {show(t.get('value'))} (metric missing)")
            if s.n is None or s.n <= 0:
                out.append(f"{w}: {name}: sample count n is {show(t.get('n'))}")
            if t.get("expected") is not None and (s.expected is None or s.tolerance is None):
                out.append(f"{w}: {name}: expected value or tolerance missing")
            if t.get("reference") is not None and (s.reference is None or s.p_value is None):
                out.append(f"{w}: {name}: reference value or p_value missing")
        if acc.get("verdict") != "pass" and not out:
            out.append(f"{w}: verdict {show(acc.get('verdict'))}")
        return out


RATE_METRICS = ("exact_match", "acc", "acc_norm")  # 0/1 per sample: the score is a rate in [0, 1]


@dataclass(frozen=True)
class AccuracyRecompute:
    """accuracy.json: a task recorded ``pass`` must still pass when judged again."""

    alpha: float = 0.05
    name: str = "accuracy-recompute"

    def applies(self, kind: str) -> bool:
        return True

    def fails(self, files: CellFiles) -> list[str]:
        acc = files.get(layout.ACCURACY_FILE)
        tasks = acc.get("tasks") if acc else None
        if not isinstance(tasks, dict):
            return []  # AccuracyCheck fails the missing file
        w = files.where(layout.ACCURACY_FILE)
        is_ref = cell_kind(files) == "ref"
        out: list[str] = []
        for name, t in tasks.items():
            if not isinstance(t, dict):
                continue
            value = num(t.get("value"))
            impossible = value is not None and t.get("metric") in RATE_METRICS and not 0 <= value <= 1
            if impossible:
                out.append(f"{w}: {name}: value {value:g} is outside [0, 1] ({t.get('metric')} is a rate)")
            exp = t.get("expected") if isinstance(t.get("expected"), dict) else None
            if exp is not None and not (num(exp.get("tolerance")) or -1) > 0:
                out.append(f"{w}: {name}: expected.tolerance is {show(exp.get('tolerance'))} (allowed: > 0)")
                continue
            if t.get("verdict") != "pass" or value is None:
                continue  # AccuracyCheck already fails it
            ref = t.get("reference") if isinstance(t.get("reference"), dict) else None
            rv = num(ref.get("value")) if ref else None
            if impossible or (rv is not None and not 0 <= rv <= 1):
                ref = None  # no two-proportion test on a rate that cannot be (already reported)
            try:
                again = judge(
                    files.cell_id,
                    {name: t},
                    {name: {"source": "recorded", **exp}} if exp and num(exp.get("value")) is not None else None,
                    {"cell_id": ref.get("cell_id"), "tasks": {name: ref}} if ref else None,
                    self.alpha,
                    is_reference=is_ref,
                )["tasks"][name]
            except (OverflowError, ValueError, TypeError) as e:  # e.g. a sample count too large for a float
                out.append(f"{w}: {name}: recorded verdict pass cannot be recomputed from its values: {e}")
                continue
            if again["verdict"] != "pass":
                out.append(
                    f"{w}: {name}: recorded verdict pass, recomputed fail: " + "; ".join(map(str, again["reasons"]))
                )
        return out
