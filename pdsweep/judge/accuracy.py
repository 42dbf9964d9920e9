"""Accuracy, judged: :class:`AccuracyCheck` (each lm-eval task within the expected score's
tolerance and agreeing with the same-sweep reference, accuracy.json) and
:class:`AccuracyRecompute` (the gate recomputes what it judges, issue 23: every task the file
calls ``pass`` is judged again by :func:`pdsweep.measure.accuracy.judge` from its value, n,
expectation and reference, with the ``gate.alpha`` frozen in run.json; a 0/1 metric outside
[0, 1] is impossible).
"""

from __future__ import annotations

from dataclasses import dataclass

from pdsweep.core.stats import num
from pdsweep.judge.agreement import cell_kind
from pdsweep.judge.facts import (
    CellFiles,
    show,
    task_score,
)
from pdsweep.measure.accuracy import judge as judge_accuracy
from pdsweep.results import layout


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
                again = judge_accuracy(
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
