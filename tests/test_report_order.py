"""report.md and report.html put the failures before any overview table longer than
:data:`pdsweep.report.overview.LONG_TABLE` rows, at every scale (issue 57: on the 768-combination
maintainer run the Failures section came after a 385-row build-pairs table)."""

from __future__ import annotations

from pathlib import Path

from fixtures.make_runs import MIXED, MIXED_REJECTED, write_run

from pdsweep.judge.gate import gate_run
from pdsweep.report.html import _overview_html, _overview_markdown
from pdsweep.report.overview import LONG_TABLE, pair_rows


def test_failures_come_before_the_long_build_pairs_table(maintainer_run: Path) -> None:
    result = gate_run(maintainer_run)
    _, prows = pair_rows(result)
    assert len(prows) > LONG_TABLE
    md = "\n".join(_overview_markdown(result))
    assert md.index("## Failures") < md.index("## Build pairs"), md[:300]
    page = "\n".join(_overview_html(result))
    assert page.index("<h2>Failures</h2>") < page.index("<h2>Build pairs</h2>")
    assert page.count("<h2>") == 3  # nothing lost: verdicts, build pairs, failures


def test_a_small_run_keeps_its_order(tmp_path: Path) -> None:
    result = gate_run(write_run(tmp_path, "mixed", list(MIXED.values()), MIXED_REJECTED))
    md = "\n".join(_overview_markdown(result))
    assert md.index("## Verdicts") < md.index("## Failures")
