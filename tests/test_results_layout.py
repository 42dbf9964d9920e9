"""pdsweep.results.layout: result files are readable by others (0666 less the umask, never
mkstemp's 0600, kept through ``make nightly``'s ``cp -a`` into the baseline); cell ids outside the
run are refused (issue 15)."""

from __future__ import annotations

import os
import stat
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from fixtures.make_runs import MIXED, MIXED_REJECTED, write_run

from pdsweep.core.errors import UserError
from pdsweep.judge.gate import gate_run
from pdsweep.report.html import write_report
from pdsweep.report.render import write_junit, write_summary
from pdsweep.results import layout


@pytest.fixture
def umask() -> Iterator[None]:
    old = os.umask(0o022)
    try:
        yield
    finally:
        os.umask(old)


def modes(root: Path) -> dict[str, int]:
    return {str(p.relative_to(root)): stat.S_IMODE(p.stat().st_mode) for p in root.rglob("*") if p.is_file()}


@pytest.mark.parametrize(("mask", "want"), [(0o022, 0o644), (0o027, 0o640), (0o002, 0o664)])
def test_result_files_follow_the_umask(tmp_path: Path, umask: None, mask: int, want: int) -> None:
    os.umask(mask)
    run = write_run(tmp_path, "run", list(MIXED.values()), MIXED_REJECTED)
    result = gate_run(run)
    write_junit(result, run / layout.JUNIT_FILE)
    write_summary(result, run / layout.SUMMARY_FILE)
    write_report(run)
    got = modes(run)
    assert {"run.json", "plan.json", "junit.xml", "summary.md", "report.html", "report.md"} <= set(got)
    assert any(name.endswith("/cell.json") for name in got)
    assert {name: m for name, m in got.items() if m != want} == {}


def test_nightly_copy_keeps_them_readable(tmp_path: Path, umask: None) -> None:
    run = write_run(tmp_path, "run", list(MIXED.values())[:3])
    subprocess.run(["cp", "-a", str(run), str(tmp_path / "baseline")], check=True)  # the Makefile's nightly copy
    got = modes(tmp_path / "baseline")
    assert got and set(got.values()) == {0o644}


def test_explicit_mode_still_wins(tmp_path: Path, umask: None) -> None:
    path = layout.write_text(tmp_path / "x.sh", "#!/bin/sh\n", mode=0o755)
    assert stat.S_IMODE(path.stat().st_mode) == 0o755
    assert layout.current_umask() == 0o022


def test_cell_dir_refuses_ids_outside_the_run(tmp_path: Path) -> None:
    from pdsweep.results import layout

    assert layout.cell_dir(tmp_path, "m.p1d1.b16-16.fixed") == tmp_path / "m.p1d1.b16-16.fixed"
    for cid in ("../x", "a/b", "..", "", "a..b", 7):
        with pytest.raises(UserError, match="not a safe directory name"):
            layout.cell_dir(tmp_path, cid)
    (tmp_path / "link").symlink_to(tmp_path.parent)
    with pytest.raises(UserError, match="outside the run directory"):
        layout.inside(tmp_path, tmp_path / "link" / "x")
