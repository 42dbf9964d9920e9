"""Wall-clock budgets of a cell's measured phases, derived from the sweep, so a hung
lm-eval or ``vllm bench serve`` fails its cell (phase named) instead of hanging the sweep.

Each budget is the worst case the sweep itself allows, plus a fixed allowance for start-up:
requests run in waves of the phase's concurrency, and one request may take its timeout
once per try. A sweep may set ``eval.budget_s`` / ``bench.budget_s`` instead.
"""

from __future__ import annotations

import math

from .spec import BenchSpec, Defaults, EvalSpec

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
