"""Ceilings on derived budgets (pdsweep.plan.budgets.ceiling_errors): a sweep whose eval, load,
startup or readiness budget is above its ceiling is refused at validate, with the arithmetic; the
phase budgets themselves derive from the sweep (issue 11)."""

from __future__ import annotations

from pathlib import Path

import pytest

from pdsweep.core.errors import UserError
from pdsweep.plan import budgets
from pdsweep.plan.expand import expand
from pdsweep.sweepfile.sweep import load_sweep

REPO = Path(__file__).resolve().parent.parent
SMOKE = load_sweep(Path(__file__).resolve().parent.parent / "sweeps" / "cpu-smoke.yaml")


def _with(**parts):
    s = SMOKE.sweep
    upd = {k: getattr(s, k).model_copy(update=v) for k, v in parts.items()}
    return SMOKE.model_copy(update={"sweep": s.model_copy(update=upd)})


def test_shipped_sweeps_are_under_every_ceiling():
    root = Path(__file__).resolve().parent.parent / "sweeps"
    for f in sorted(root.glob("*.yaml")):
        if f.name != "models.yaml":
            assert budgets.ceiling_errors(load_sweep(f).sweep, f) == [], f


def test_derived_eval_budget_above_the_ceiling_is_refused_with_the_arithmetic():
    ls = _with(eval={"timeout_s": 800.0, "limit": 250, "num_concurrent": 2, "max_retries": 3, "tasks": ["t"]})
    with pytest.raises(UserError) as e:
        expand(ls)
    assert str(e.value) == (
        f"{ls.path}: eval: derived budget 400,120 s = 120 + 125 waves (ceil(1 tasks x 250 docs / num_concurrent 2))"
        " x timeout_s 800 x (max_retries 3 + 1) is above the ceiling 86,400 s; set eval.budget_s, or lower "
        "eval.timeout_s / eval.max_retries / eval.limit"
    )
    explicit = _with(eval={"timeout_s": 4000.0, "budget_s": 600.0})  # the user's own budget stands
    assert budgets.ceiling_errors(explicit.sweep, "s") == []
    assert budgets.ceiling_errors(_with(eval={"timeout_s": 1000.0, "limit": None}).sweep, "s") == [
        "s: eval: one request may take timeout_s 1000 x (max_retries 3 + 1) = 4,000 s, above the ceiling "
        "3,600 s; lower eval.timeout_s or eval.max_retries"
    ]
    assert budgets.ceiling_errors(_with(eval={"limit": None}).sweep, "s") == []  # the defaults pass


def test_load_startup_and_request_ceilings():
    ls = _with(
        bench={"enabled": True, "concurrencies": [1, 64], "num_prompts": 64},
        defaults={"request_timeout_s": 3000.0, "startup_timeout_s": 9000.0},
    )
    assert budgets.ceiling_errors(ls.sweep, "s.yaml") == [
        "s.yaml: bench: concurrency 1: derived budget 192,120 s = 120 + ceil(num_prompts 64 / 1) x "
        "defaults.request_timeout_s 3000 is above the ceiling 14,400 s; set bench.budget_s or lower num_prompts",
        "s.yaml: defaults.startup_timeout_s: 9,000 s is above the ceiling 7,200 s",
    ]
    slow = _with(defaults={"request_timeout_s": 4000.0})
    assert budgets.ceiling_errors(slow.sweep, "s.yaml")[-1] == (
        "s.yaml: defaults.request_timeout_s: 4,000 s is above the ceiling 3,600 s"
    )


def test_phase_budgets_derive_from_the_sweep():
    from pdsweep.plan.budgets import bench_budget_s, eval_budget_s
    from pdsweep.sweepfile.phases import BenchSpec, EvalSpec
    from pdsweep.sweepfile.serve import Defaults

    ls = load_sweep(REPO / "sweeps" / "cpu-smoke.yaml")  # 20 docs, 2 at a time, 300 s timeout, 3 retries
    assert eval_budget_s(ls.sweep.eval) == 120 + 10 * 300 * 4
    assert eval_budget_s(EvalSpec(tasks=["gsm8k"], num_concurrent=64, timeout_s=60, max_retries=0)) == 120 + 32 * 60
    assert eval_budget_s(EvalSpec(budget_s=99)) == 99
    assert bench_budget_s(BenchSpec(num_prompts=16), Defaults(request_timeout_s=30), 4) == 120 + 4 * 30
    assert bench_budget_s(BenchSpec(budget_s=5), Defaults(), 1) == 5
