"""Issue 59 case 6: damaged run directories and inputs give an error naming the path and the real
cause (exit 2), never a traceback (exit 3); caches go under the working directory."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
from fixtures.make_runs import HYBRID, case, write_run

from pdsweep.cli import main


def _run_dir_loop(run: Path) -> str:
    shutil.rmtree(run)
    os.symlink(run, run)
    return rf"{run}(/junit\.xml)?: cannot resolve: Symlink loop"


def _summary_loop(run: Path) -> str:
    os.symlink(run / "summary.md", run / "summary.md")
    return rf"{run}/summary\.md: cannot resolve: Symlink loop"


def _run_json_loop(run: Path) -> str:
    (run / "run.json").unlink()
    os.symlink(run / "run.json", run / "run.json")
    return rf"{run}/run\.json: unreadable results file: \[Errno 40\] Too many levels of symbolic links"


@pytest.mark.parametrize(
    "damage, commands",
    [
        (_run_dir_loop, ("gate", "report", "compare")),
        (_summary_loop, ("gate",)),
        (_run_json_loop, ("gate", "report", "compare")),
    ],
    ids=["run-dir-is-a-symlink-loop", "summary-is-a-symlink-loop", "run-json-is-a-symlink-loop"],
)
def test_a_damaged_run_directory_is_an_error_naming_it(tmp_path: Path, capsys, damage, commands) -> None:
    import re

    run = write_run(tmp_path, "run", [case(HYBRID)])
    why = damage(run)
    for cmd in commands:
        argv = {"gate": [str(run)], "report": [str(run), "--out", str(tmp_path / "rep")], "compare": [str(run)] * 2}
        assert main([cmd, *argv[cmd]]) == 2, cmd
        err = capsys.readouterr().err
        assert "Traceback" not in err and re.search(why, err), (cmd, err)


def test_report_renders_a_cell_directory_that_is_a_symlink_loop_as_failed(tmp_path: Path, capsys) -> None:
    """The gate fails such a cell naming the loop; the report shows it so and is still written (was exit 2:
    the load section resolved every cell's directory outside its guard)."""
    run = write_run(tmp_path, "run", [case(HYBRID), case(HYBRID.reference())])
    shutil.rmtree(run / HYBRID.id)
    (run / HYBRID.id).symlink_to(run / HYBRID.id)  # ELOOP on every access
    assert main(["report", str(run), "--out", str(tmp_path / "rep")]) == 0
    assert "Traceback" not in capsys.readouterr().err
    row = next(x for x in (tmp_path / "rep" / "report.md").read_text().splitlines() if x.startswith(f"| {HYBRID.id} |"))
    # the reason cell is cut to the report's width, so a longer tmp path (xdist's popen-gwN) may cut the cause
    assert f"| FAIL | status.json: unreadable: {run / HYBRID.id}: cannot re" in row


def test_report_on_an_unreadable_cell_directory_names_it_not_the_report(tmp_path: Path, capsys, monkeypatch) -> None:
    """As root a chmod 000 directory stays readable: the OS's refusal is simulated on the cell's logs/."""
    run = write_run(tmp_path, "run", [case(HYBRID)])
    logs = run / HYBRID.id / "logs"
    logs.mkdir()
    real = Path.iterdir

    def iterdir(self: Path):
        if self == logs:
            raise PermissionError(13, "Permission denied", str(self))
        return real(self)

    monkeypatch.setattr(Path, "iterdir", iterdir)
    assert main(["report", str(run), "--out", str(tmp_path / "rep")]) == 2
    err = capsys.readouterr().err
    assert err == f"error: {logs}: cannot read the run's cell directory: Permission denied\n"


def test_the_probe_cache_is_under_the_working_directory_unless_configured(tmp_path: Path, monkeypatch) -> None:
    from pdsweep.builds.answers import CACHE_ENV, cache_dir

    monkeypatch.delenv(CACHE_ENV, raising=False)
    monkeypatch.chdir(tmp_path)
    assert cache_dir() == tmp_path / ".cache" / "pdsweep" / "probes"
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "elsewhere"))
    assert cache_dir() == tmp_path / "elsewhere"
