"""FLAKY: a cell whose checks passed only after ``defaults.ready_retries`` redeployed it.

The run redeploys a cell whose first request hung (:class:`pdsweep.deploy.deployment.ReadyHang`)
and records each failed attempt in status.json ``retries`` (``{phase, reason, log_tail}``,
pdsweep/run/cell.py ``_attempts``). A PASS with a non-empty ``retries`` is not a PASS: it is
FLAKY, with one reason per attempt. Whether FLAKY fails the gate is the sweep's choice
(``gate.flaky_fails_nightly``, default true, for ``pdsweep gate --nightly``;
``gate.flaky_fails_sweep``, default false, for ``make sweep``).
"""

from __future__ import annotations

from typing import Any

FLAKY = "FLAKY"


def retried(status: dict[str, Any]) -> list[dict[str, Any]]:
    """The failed attempts of status.json ``retries`` (dicts only; anything else is dropped)."""
    retries = status.get("retries")
    return [r for r in retries if isinstance(r, dict)] if isinstance(retries, list) else []


def attempt_reason(i: int, attempt: dict[str, Any]) -> str:
    """``attempt <i>: <phase>: <reason>`` (1-based ``i``)."""
    return f"attempt {i}: {attempt.get('phase') or 'unknown phase'}: {attempt.get('reason') or 'no reason recorded'}"


def flaky_reasons(status: dict[str, Any]) -> list[str]:
    """Reasons of a passing cell that needed redeploys (empty: it passed at once)."""
    done = retried(status)
    if not done:
        return []
    n = len(done)
    head = f"passed on attempt {n + 1} after {n} redeploy{'s' if n > 1 else ''}"
    return [head, *(attempt_reason(i, a) for i, a in enumerate(done, 1))]
