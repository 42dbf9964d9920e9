"""summary.md and the gate's stdout put failures first and stay short on a big sweep: the
768-combination maintainer sweep of issue 37 (tests/fixtures/make_runs.py write_maintainer)."""

from __future__ import annotations

from pathlib import Path

import pytest

from pdsweep.cli import main as cli_main
from pdsweep.judge.gate import FAIL, GateResult, gate_run
from pdsweep.report.render import summary_markdown


@pytest.fixture(scope="module")
def maintainer(maintainer_run: Path) -> Path:
    return maintainer_run


@pytest.fixture(scope="module")
def result(maintainer: Path) -> GateResult:
    return gate_run(maintainer)


def rows(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("| ") and not line.startswith("| cell ")]


def test_the_sweep_is_the_issues(result: GateResult) -> None:
    assert len(result.cells) == 808  # 768 combinations + 40 reference cells
    assert result.headline() == "FAILED: 354 PASS, 14 FAIL, 440 SKIPPED"


def test_failures_come_first_and_summary_is_short(result: GateResult) -> None:
    text = summary_markdown(result)
    lines = text.splitlines()
    assert len(lines) < 100, len(lines)
    assert lines[0] == "# Gate: maintainer: **FAILED: 354 PASS, 14 FAIL, 440 SKIPPED**"
    failing = {c.cell_id for c in result.cells if c.verdict == FAIL}
    first = rows(text)[: len(failing)]
    assert {r.split(" | ")[0].lstrip("| ") for r in first} == failing  # the first rows are the 14 failures
    assert all(" | FAIL | " in r for r in first)
    assert lines.index(first[0]) < 8  # right under the headline
    rules = [line for line in lines if line.startswith("- ") and ": " in line and "(e.g. `" in line]
    assert [r.split(":")[0] for r in rules] == [
        "- attention-backend",
        "- block-ratio",
        "- hybrid-prefix-caching",
        "- hetero-tp-blocks",
    ]
    assert [int(r.split(": ")[1].split(" ")[0]) for r in rules] == [192, 192, 32, 24]
    assert lines.index(rules[0]) > lines.index(first[-1])  # rule counts after the failures
    assert lines[-1] == "… and 314 more (314 PASS): junit.xml and report.md list every cell."


def test_gate_stdout_is_the_same(maintainer: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = cli_main(["gate", str(maintainer), "--junit", str(tmp_path / "j.xml"), "--summary", str(tmp_path / "s.md")])
    out = capsys.readouterr().out
    assert code != 0
    assert out.startswith("# Gate: maintainer: **FAILED")
    assert len(out.splitlines()) < 100
    assert " | FAIL | " in out.splitlines()[6]
