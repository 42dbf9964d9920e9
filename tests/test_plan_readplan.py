"""pdsweep.plan.readplan: the READs per request vLLM's read plan makes per prefill rank, the one
function ``pdsweep bench transfer`` and the gate's read-pattern check both use (issue 23)."""

from __future__ import annotations

from pdsweep.plan import readplan
from pdsweep.xfer import bench


def test_expected_read_split_is_the_bench_read_plan() -> None:
    assert bench.plans_for is readplan.plans_for  # one function for the bench and the gate
    split = readplan.expected_read_split
    assert split("mla", True, 2, 1) == {0: 1, 1: 1}  # hybrid MLA + SSM: every rank (the #49297 fix)
    assert split("mla", False, 2, 1) == {0: 1}  # pure MLA: one rank
    assert split("mla", False, 4, 2) == {0: 1, 2: 1}
    assert split("gqa", False, 4, 2) == {0: 1, 1: 1, 2: 1, 3: 1}
    assert split("gqa", True, 1, 2) == {0: 2}  # tp_ratio > 0: the plan's rank
