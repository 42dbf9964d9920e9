"""Wall-clock budgets of a cell's measured phases, derived from the sweep, so a hung
lm-eval or ``vllm bench serve`` fails its cell (phase named) instead of hanging the sweep.

Each budget is the worst case the sweep itself allows, plus a fixed allowance for start-up:
requests run in waves of the phase's concurrency, and one request may take its timeout
once per try. A sweep may set ``eval.budget_s`` / ``bench.budget_s`` instead.
"""

from __future__ import annotations

import math

from pdsweep.sweepfile.phases import BenchSpec, EvalSpec
from pdsweep.sweepfile.serve import Defaults
from pdsweep.sweepfile.sweep import Sweep

STARTUP_ALLOWANCE_S = 120.0  # lm-eval task/tokenizer loading, bench tokenizer and dataset
UNLIMITED_DOCS = 2000  # requests assumed per task without eval.limit (gsm8k test: 1319)


def eval_budget_s(ev: EvalSpec) -> float:
    """Seconds the eval phase may take: ``eval.budget_s``, else ``120 + waves x timeout_s x
    (max_retries + 1)`` with ``waves = ceil(len(tasks) x (limit or 2000) / num_concurrent)``."""
    if ev.budget_s is not None:
        return ev.budget_s
    waves = math.ceil(len(ev.tasks) * (ev.limit or UNLIMITED_DOCS) / ev.num_concurrent)
    return STARTUP_ALLOWANCE_S + waves * ev.timeout_s * (ev.max_retries + 1)


def bench_budget_s(b: BenchSpec, d: Defaults, concurrency: int) -> float:
    """Seconds one ``vllm bench serve`` run may take: ``bench.budget_s``, else ``120 +
    ceil(num_prompts / concurrency) x defaults.request_timeout_s``."""
    if b.budget_s is not None:
        return b.budget_s
    return STARTUP_ALLOWANCE_S + math.ceil(b.num_prompts / concurrency) * d.request_timeout_s


# Ceilings: a budget derived above these is a sweep mistake (an eval budget of 400,120 s came
# from a sweep's timeout_s), refused at validate with its arithmetic instead of letting a hung
# phase hold the machine for days. An explicit eval.budget_s / bench.budget_s is the user's word.
MAX_EVAL_BUDGET_S = 86_400.0  # one eval phase: a day
MAX_LOAD_BUDGET_S = 14_400.0  # one vllm bench serve run: 4 h
MAX_STARTUP_S = 7_200.0  # every instance healthy (defaults.startup_timeout_s): 2 h
MAX_REQUEST_S = 3_600.0  # one request with its retries (defaults.request_timeout_s, eval's tries): 1 h


def ceiling_errors(sweep: Sweep, path: object) -> list[str]:
    """One line per budget of ``sweep`` above its ceiling, with the arithmetic that derived
    it and what to change; empty when every budget is under its ceiling."""
    ev, b, d, out = sweep.eval, sweep.bench, sweep.defaults, []
    if ev.budget_s is None and (tries := ev.timeout_s * (ev.max_retries + 1)) > MAX_REQUEST_S:
        out.append(
            f"{path}: eval: one request may take timeout_s {ev.timeout_s:g} x (max_retries {ev.max_retries} + 1) "
            f"= {tries:,.0f} s, above the ceiling {MAX_REQUEST_S:,.0f} s; lower eval.timeout_s or eval.max_retries"
        )
    # the whole-phase ceiling needs a known doc count (eval.limit); without one the 2000 docs are a guess
    if ev.budget_s is None and ev.limit and (got := eval_budget_s(ev)) > MAX_EVAL_BUDGET_S:
        docs = ev.limit
        waves = math.ceil(len(ev.tasks) * docs / ev.num_concurrent)
        out.append(
            f"{path}: eval: derived budget {got:,.0f} s = {STARTUP_ALLOWANCE_S:g} + {waves} waves "
            f"(ceil({len(ev.tasks)} tasks x {docs} docs / num_concurrent {ev.num_concurrent})) x timeout_s "
            f"{ev.timeout_s:g} x (max_retries {ev.max_retries} + 1) is above the ceiling {MAX_EVAL_BUDGET_S:,.0f} s; "
            "set eval.budget_s, or lower eval.timeout_s / eval.max_retries / eval.limit"
        )
    for conc in b.concurrencies if b.enabled and b.budget_s is None else ():
        if (got := bench_budget_s(b, d, conc)) > MAX_LOAD_BUDGET_S:
            out.append(
                f"{path}: bench: concurrency {conc}: derived budget {got:,.0f} s = {STARTUP_ALLOWANCE_S:g} + "
                f"ceil(num_prompts {b.num_prompts} / {conc}) x defaults.request_timeout_s {d.request_timeout_s:g} "
                f"is above the ceiling {MAX_LOAD_BUDGET_S:,.0f} s; set bench.budget_s or lower num_prompts"
            )
    for field_, got, top in (
        ("startup_timeout_s", d.startup_timeout_s, MAX_STARTUP_S),
        ("request_timeout_s", d.request_timeout_s, MAX_REQUEST_S),
    ):
        if got > top:
            out.append(f"{path}: defaults.{field_}: {got:,.0f} s is above the ceiling {top:,.0f} s")
    return out
