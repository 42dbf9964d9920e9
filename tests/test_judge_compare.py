"""pdsweep.judge.compare: an empty B run is never "no regression"; fixed against unfixed in one
run (issue 23)."""

from __future__ import annotations

from pathlib import Path

from fixtures.make_runs import (
    MIXED,
    case,
    pd,
    ref,
    write_run,
)

from pdsweep.cli import main
from pdsweep.judge.compare import compare_runs


def test_compare_against_an_empty_run_is_never_no_regression(tmp_path: Path, capsys) -> None:
    a = write_run(tmp_path, "a", [MIXED["pass"]])
    b = write_run(tmp_path, "b", [])
    res = compare_runs(a, b, allow_missing=True)
    assert res.regressed and any("B (" in p and "has no cell that was meant to run" in p for p in res.problems)
    assert main(["compare", str(a), str(b), "--allow-missing", "--out", str(tmp_path / "o")]) == 1


def test_compare_fixed_against_unfixed_in_one_run_can_pass(tmp_path: Path, capsys) -> None:
    fixed, unfixed = pd("kimi-linear", 1, 1, "fixed"), pd("kimi-linear", 1, 1, "unfixed")
    run = write_run(tmp_path, "run", [case(fixed), case(unfixed), case(ref(fixed))])
    args = [str(run), str(run), "--a-build", "fixed", "--b-build", "unfixed", "--out", str(tmp_path / "o")]
    assert main(["compare", *args]) == 0, capsys.readouterr()
    res = compare_runs(run, run, a_build="fixed", b_build="unfixed")
    assert {c.key: c.verdict for c in res.cells} == {fixed.compare_key: "same"}  # the reference: one cell
    assert res.notes == (
        "1 reference cell(s) not compared: A and B are one run, so each is the same cell on both sides",
    )
    assert "- note: 1 reference cell(s) not compared" in (tmp_path / "o" / "compare.md").read_text()


def test_a_side_without_consistency_says_why_not_none(tmp_path: Path) -> None:
    """The unfixed cell died in phase ready (no consistency.json): the improvement's reason says
    so instead of printing Python's None ('consistency None -> pass')."""
    from fixtures.make_runs import crashed

    from pdsweep.report.render import compare_markdown

    fixed, unfixed = pd("kimi-linear", 2, 1, "fixed"), pd("kimi-linear", 2, 1, "unfixed")
    died = crashed("ready", "first request: HTTP 500", ["AssertionError"])
    run = write_run(tmp_path, "run", [case(fixed), case(unfixed, died), case(ref(fixed))])
    res = compare_runs(run, run, a_build="unfixed", b_build="fixed")
    pair = next(c for c in res.cells if c.key == fixed.compare_key)
    assert pair.reasons == ("was FAIL, now passes", "consistency — (not measured: failed in phase ready) -> pass")
    assert "None" not in compare_markdown(res)
