"""pdsweep.plan.cell: a cell's id and its compare key, the id less the build part (issue 15)."""

from __future__ import annotations

import dataclasses

from fixtures.make_runs import pd


def test_compare_key_drops_only_the_build_part() -> None:
    c = dataclasses.replace(pd("m.fixed", 1, 1, "fixed"), serve_args="fixed")
    assert (c.id, c.compare_key) == ("m.fixed.p1d1.b16-16.fixed.fixed", "m.fixed.p1d1.b16-16.fixed")
