"""pdsweep.results.outputs: gate and report outputs never land on the run's own files, and a
failed report replaces nothing (issue 23)."""

from __future__ import annotations

from pathlib import Path

import pytest
from fixtures.make_runs import (
    MIXED,
    case,
    pd,
    write_run,
)

from pdsweep.cli import main

HYBRID = pd("kimi-linear", 2, 1)  # the fixture's cell.json model is MLA + KDA: a hybrid MLA + SSM cell


@pytest.mark.parametrize("flag, target", [("--summary", "run.json"), ("--junit", "CELL/status.json")])
def test_gate_outputs_inside_the_run_are_refused(tmp_path: Path, capsys, flag: str, target: str) -> None:
    run = write_run(tmp_path, "run", [case(HYBRID)])
    path = run / target.replace("CELL", HYBRID.id)
    before = path.read_text()
    assert main(["gate", str(run), flag, str(path)]) == 2
    err = capsys.readouterr().err
    assert f"{flag} {path}: " in err and ("is the run's own run.json" in err or "inside cell directory" in err)
    assert path.read_text() == before and main(["gate", str(run)]) == 0


def test_report_out_inside_a_cell_directory_is_refused(tmp_path: Path, capsys) -> None:
    run = write_run(tmp_path, "run", [case(HYBRID)])
    assert main(["report", str(run), "--out", str(run / HYBRID.id)]) == 2
    assert "inside cell directory" in capsys.readouterr().err and not (run / HYBRID.id / "report.md").exists()


def test_report_with_an_unwritable_later_file_replaces_nothing(tmp_path: Path, capsys) -> None:
    run = write_run(tmp_path, "run", [MIXED["pass"], MIXED["ref"]])
    out = tmp_path / "out"
    out.mkdir()
    (out / "report.md").write_text("old")
    (out / "report.html").mkdir()  # the second file cannot be written
    assert main(["report", str(run), "--out", str(out)]) == 2
    assert (out / "report.md").read_text() == "old"
