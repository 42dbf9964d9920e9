"""pdsweep.results.outputs: gate and report outputs never land on the run's own files, and a
failed report replaces nothing (issue 23); output paths are checked before gating and a failed
write still prints the verdict (issue 15)."""

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


CELL = pd("tiny-llama", 1, 1)


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    return write_run(tmp_path, "run", [case(CELL), case(CELL.reference())])


def test_junit_and_summary_on_one_file_are_refused(run_dir: Path, tmp_path: Path, capsys) -> None:
    f = tmp_path / "out.txt"
    assert main(["gate", str(run_dir), "--junit", str(f), "--summary", str(f)]) == 2
    assert "--summary" in capsys.readouterr().err and not f.exists()


def test_read_only_output_dir_is_named_before_gating(run_dir: Path, tmp_path: Path, capsys) -> None:
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    try:
        if __import__("os").access(ro, __import__("os").W_OK):
            pytest.skip("running as a user who can write anywhere")
        assert main(["gate", str(run_dir), "--junit", str(ro / "j.xml")]) == 2
        err = capsys.readouterr().err
        assert f"{ro / 'j.xml'}: cannot write" in err and ".tmp" not in err
    finally:
        ro.chmod(0o755)


def test_output_below_a_file_is_named_before_gating(run_dir: Path, tmp_path: Path, capsys) -> None:
    (tmp_path / "file").write_text("x")
    assert main(["gate", str(run_dir), "--summary", str(tmp_path / "file" / "s.md")]) == 2
    err = capsys.readouterr().err
    assert f"error: {tmp_path / 'file' / 's.md'}: cannot write: {tmp_path / 'file'} is not a writable directory" in err
    assert not (run_dir / "junit.xml").exists()  # nothing was written before the check


def test_write_failure_still_prints_the_verdict(run_dir: Path, tmp_path: Path, capsys, monkeypatch) -> None:
    import pdsweep.results.layout

    def fail(*a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(pdsweep.results.layout.os, "replace", fail)
    assert main(["gate", str(run_dir), "--junit", str(tmp_path / "j.xml"), "--summary", str(tmp_path / "s.md")]) == 2
    err = capsys.readouterr().err
    assert "gate: PASSED: 2 PASS" in err and "No space left" in err


def test_a_failed_report_leaves_nothing_half_written(run_dir: Path, tmp_path: Path, monkeypatch) -> None:
    import pdsweep.report.html

    out = tmp_path / "report"
    out.mkdir()

    def fail(*a, **k):
        raise RuntimeError("html failed")

    monkeypatch.setattr(pdsweep.report.html, "_html", fail)
    with pytest.raises(RuntimeError):
        pdsweep.report.html.write_report(run_dir, out)
    assert list(out.iterdir()) == []
    monkeypatch.undo()
    made = pdsweep.report.html.write_report(run_dir, out)
    assert made["markdown"] == out / "report.md" and made["html"].exists()
    assert sorted(p.name for p in out.iterdir()) == ["plots", "report.html", "report.md"]


def test_report_into_a_new_directory_and_below_a_file(run_dir: Path, tmp_path: Path, capsys) -> None:
    assert main(["report", str(run_dir), "--out", str(tmp_path / "new" / "dir")]) == 0
    assert (tmp_path / "new" / "dir" / "report.html").exists()
    (tmp_path / "file").write_text("x")
    assert main(["report", str(run_dir), "--out", str(tmp_path / "file" / "r")]) == 2
    assert "is not a writable directory" in capsys.readouterr().err
