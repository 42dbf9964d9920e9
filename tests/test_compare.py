"""compare_runs on hand-made fixed / unfixed runs (A = baseline, B = candidate)."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
from fixtures.make_runs import MIXED, OUTSIDE, TASK, acc, case, pd, totals, write_run
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdsweep.core.errors import GateFailed, UserError
from pdsweep.judge.compare import IMPROVEMENT, NOT_COMPARABLE, ONLY_A, ONLY_B, REGRESSION, SAME, compare_runs
from pdsweep.report.render import compare_markdown as markdown
from pdsweep.report.render import write_compare_json as write_json
from pdsweep.report.render import write_compare_markdown as write_markdown
from pdsweep.results import layout
from pdsweep.sweepfile.gatespec import GateSpec

KIMI = "kimi-linear.p2d1.b16-16"
FORWARD = {  # compare_runs(fixed, unfixed): the unfixed build regresses
    "kimi-linear.p1d1.b16-16": SAME,
    KIMI: REGRESSION,
    "kimi-linear.ref-tp1.b16": SAME,
    "qwen3-0.6b.p1d1.b16-16": NOT_COMPARABLE,
    "qwen3-0.6b.p2d1.b16-16": REGRESSION,
    "deepseek-v2-lite-chat.p1d1.b16-16": SAME,
    "tiny-mla.p1d1.b16-16": ONLY_A,
    "tiny-llama.p1d1.b16-16": ONLY_B,
}
MIRROR = {REGRESSION: IMPROVEMENT, ONLY_A: ONLY_B, ONLY_B: ONLY_A}


def test_fixed_vs_unfixed_verdicts(runs: dict[str, Path]) -> None:
    res = compare_runs(runs["fixed"], runs["unfixed"])
    assert {c.key: c.verdict for c in res.cells} == FORWARD
    assert [c.key for c in res.regressions] == [KIMI, "qwen3-0.6b.p2d1.b16-16"]
    assert res.regressed
    kimi = res.cell(KIMI)
    assert (kimi.mark, kimi.a.cell_id, kimi.b.cell_id) == ("-", f"{KIMI}.fixed", f"{KIMI}.unfixed")
    assert kimi.reasons[0] == f"was passing, now FAIL: {KIMI}.unfixed/accuracy.json: {TASK}: {OUTSIDE % 0.31}"
    assert kimi.reasons[1].startswith(f"{TASK}: 0.800 -> 0.310, significantly lower (p=")
    assert kimi.reasons[2] == "consistency pass -> fail"
    (delta,) = kimi.tasks
    assert delta.delta == pytest.approx(-0.49) and delta.p_lower < 1e-10 and delta.p_higher > 0.99


def test_reverse_direction_mirrors(runs: dict[str, Path]) -> None:
    res = compare_runs(runs["unfixed"], runs["fixed"], allow_missing=True)
    assert {c.key: c.verdict for c in res.cells} == {k: MIRROR.get(v, v) for k, v in FORWARD.items()}
    assert not res.regressed
    res.raise_for_verdict()
    kimi = res.cell(KIMI)
    assert kimi.mark == "+" and kimi.reasons[0] == "was FAIL, now passes"


def test_marks(runs: dict[str, Path]) -> None:
    res = compare_runs(runs["fixed"], runs["unfixed"])
    marks = {c.key: c.mark for c in res.cells}
    assert (marks[KIMI], marks["kimi-linear.p1d1.b16-16"], marks["qwen3-0.6b.p1d1.b16-16"]) == ("-", " ", "x")
    assert (marks["tiny-mla.p1d1.b16-16"], marks["tiny-llama.p1d1.b16-16"]) == ("<", ">")


def test_ratios_are_b_over_a(runs: dict[str, Path]) -> None:
    c = compare_runs(runs["fixed"], runs["unfixed"]).cell("deepseek-v2-lite-chat.p1d1.b16-16")
    assert (c.gbps_ratio, c.ttft_ratio, c.tpot_ratio) == (pytest.approx(0.5), pytest.approx(1.0), pytest.approx(1.0))
    assert c.verdict == SAME  # performance is reported, not judged


def test_new_failed_transfer_is_a_regression_even_within_the_gate_budget(runs: dict[str, Path]) -> None:
    res = compare_runs(runs["fixed"], runs["unfixed"], GateSpec(max_failed_transfers=5))
    c = res.cell("qwen3-0.6b.p2d1.b16-16")
    assert (c.a.verdict, c.b.verdict, c.verdict) == ("PASS", "PASS", REGRESSION)
    assert c.reasons == ("new failed transfers: 0 -> 1",)


def test_accuracy_drop_within_noise_is_same(tmp_path: Path) -> None:
    a = write_run(tmp_path, "a", [case(pd("tiny-llama", 1, 1, "fixed"))])
    b = write_run(tmp_path, "b", [case(pd("tiny-llama", 1, 1, "unfixed"), acc(0.76))])
    (c,) = compare_runs(a, b).cells
    assert c.verdict == SAME and c.tasks[0].p_lower > 0.05


def test_significant_drop_while_both_pass_is_a_regression(tmp_path: Path) -> None:
    a = write_run(tmp_path, "a", [case(pd("tiny-llama", 1, 1, "fixed"), acc(0.84), good={"n": 2000})])
    # B's own reference scored 0.76 too, so B passes on its own (the gate recomputes that)
    b = write_run(
        tmp_path, "b", [case(pd("tiny-llama", 1, 1, "unfixed"), acc(0.76), good={"n": 2000, "ref_value": 0.76})]
    )
    (c,) = compare_runs(a, b).cells
    assert (c.a.verdict, c.b.verdict, c.verdict) == ("PASS", "PASS", REGRESSION)
    assert c.reasons[0].startswith(f"{TASK}: 0.840 -> 0.760, significantly lower")


def test_lower_without_sample_count_is_a_regression(tmp_path: Path) -> None:
    a = write_run(tmp_path, "a", [case(pd("tiny-llama", 1, 1, "fixed"))])
    b = write_run(tmp_path, "b", [case(pd("tiny-llama", 1, 1, "unfixed"), acc(0.79, "fail", ("n unknown",), n=None))])
    (c,) = compare_runs(a, b).cells
    assert c.verdict == REGRESSION
    assert c.reasons[1] == f"{TASK}: 0.800 -> 0.790, lower and untestable (sample count missing)"


def test_rejected_cells(tmp_path: Path) -> None:
    cell = pd("tiny-kimi-linear", 4, 1)
    rej = [(cell, "platform-limit", "too wide")]
    a = write_run(tmp_path, "a", [MIXED["pass"]], rej)
    b = write_run(tmp_path, "b", [MIXED["pass"], case(cell)])
    c = compare_runs(a, b).cell(cell.compare_key)
    assert (c.verdict, c.reasons) == (ONLY_B, ("rejected in A: rejected by rule platform-limit: too wide",))
    assert compare_runs(a, a).cell(cell.compare_key).verdict == SAME


def test_same_run_twice_pairs_identical_ids(runs: dict[str, Path]) -> None:
    res = compare_runs(runs["mission"], runs["mission"])  # both builds in one run: keys repeat
    assert [(c.a.cell_id, c.verdict) for c in res.cells] == [(c.b.cell_id, SAME) for c in res.cells]
    assert len(res.cells) == 6


def test_new_failed_counter_with_a_missing_baseline(tmp_path: Path) -> None:
    a = write_run(tmp_path, "a", [case(pd("tiny-llama", 1, 1, "fixed"), totals(failed_notifications=None))])
    b = write_run(tmp_path, "b", [case(pd("tiny-llama", 1, 1, "unfixed"), totals(failed_notifications=2))])
    (c,) = compare_runs(a, b).cells
    assert "new failed notifications: null -> 2" in c.reasons


def test_outputs(runs: dict[str, Path], tmp_path: Path) -> None:
    res = compare_runs(runs["fixed"], runs["unfixed"])
    md = write_markdown(res, tmp_path / "compare.md").read_text()
    assert md == markdown(res)
    assert md.startswith("# Compare: fixed (A, baseline) vs unfixed (B, candidate)")
    assert "**REGRESSED**: 2 regression, 3 same, 1 not-comparable, 1 only-in-A, 1 only-in-B" in md
    assert "1 cell(s) of A are missing in B: that fails the comparison" in md
    assert f"## Regressions\n\n- `{KIMI} (fixed -> unfixed)`: was passing, now FAIL" in md
    row = next(line for line in md.splitlines() if line.startswith(f"| - | {KIMI} (fixed -> unfixed) |"))
    assert "| PASS | FAIL | pdsweep_arith 0.800 -> 0.310 (p=" in row and "| pass -> fail | 1.00x |" in row
    data = layout.read_json(write_json(res, tmp_path / "compare.json"))
    assert data["direction"] == "A = baseline, B = candidate; ratios are B/A"
    assert data["regressed"] is True and data["counts"]["regression"] == 2
    assert (data["sweeps"], data["other_sweep"], data["allow_missing"]) == (["fixture", "fixture"], False, False)
    kimi = next(c for c in data["cells"] if c["key"] == KIMI)
    assert (kimi["verdict"], kimi["mark"], kimi["a"]["cell_id"], kimi["b"]["verdict"]) == (
        REGRESSION,
        "-",
        f"{KIMI}.fixed",
        "FAIL",
    )
    with pytest.raises(GateFailed, match=f"- {KIMI}: was passing"):
        res.raise_for_verdict()


def test_one_run_with_both_builds_compares_fixed_against_unfixed(tmp_path: Path) -> None:
    """`pdsweep compare RUN RUN --a-build fixed --b-build unfixed`: the unfixed build's failure
    (here an accuracy drop) is a regression of B against A and the CLI exits 1."""
    from pdsweep.cli import main
    from pdsweep.core.errors import UserError

    run = write_run(
        tmp_path,
        "both",
        [
            case(pd("tiny-llama", 2, 1, "fixed")),
            case(pd("tiny-llama", 2, 1, "unfixed"), acc(0.05, "fail", (f"{TASK}: {OUTSIDE % 0.05}",))),
        ],
    )
    plain = compare_runs(run, run)  # without filters every cell pairs with itself
    assert {c.verdict for c in plain.cells} == {SAME}
    res = compare_runs(run, run, a_build="fixed", b_build="unfixed")
    (c,) = res.cells
    assert (c.a.cell_id, c.b.cell_id, c.verdict) == (
        "tiny-llama.p2d1.b16-16.fixed",
        "tiny-llama.p2d1.b16-16.unfixed",
        REGRESSION,
    )
    assert (
        c.reasons[0] == f"was passing, now FAIL: tiny-llama.p2d1.b16-16.unfixed/accuracy.json: {TASK}: {OUTSIDE % 0.05}"
    )
    builds = lambda a, b, out: main(["compare", str(run), str(run), "--a-build", a, "--b-build", b, "--out", str(out)])  # noqa: E731
    assert builds("fixed", "unfixed", tmp_path / "cmp") == 1
    assert "REGRESSED" in (tmp_path / "cmp" / "compare.md").read_text()
    with pytest.raises(UserError, match=r"no cell of build 'nightly' \(builds in this run: fixed, unfixed\)"):
        compare_runs(run, run, a_build="nightly")
    # make compare-builds' direction: the build without the fix is the baseline, the fix an improvement, exit 0
    rev = compare_runs(run, run, a_build="unfixed", b_build="fixed")
    assert [(c.a.cell_id, c.verdict) for c in rev.cells] == [("tiny-llama.p2d1.b16-16.unfixed", IMPROVEMENT)]
    assert builds("unfixed", "fixed", tmp_path / "rev") == 0


# ---------------------------------------------------------------- fail closed (issue 15, kind 1)
def test_cells_lost_in_b_fail_the_comparison(runs: dict[str, Path]) -> None:
    res = compare_runs(runs["unfixed"], runs["fixed"])  # tiny-llama only in A (the unfixed run)
    assert res.regressions == [] and [c.key for c in res.missing] == ["tiny-llama.p1d1.b16-16"]
    assert res.regressed
    with pytest.raises(
        GateFailed,
        match=r"0 regression\(s\), 1 cell\(s\) missing .*\n- tiny-llama.p1d1.b16-16: "
        r"only in A \(no match in B\); pass --allow-missing",
    ):
        res.raise_for_verdict()


def test_a_run_that_lost_most_cells_is_not_green(tmp_path: Path) -> None:
    cells = [case(pd(m, p, d)) for m in ("tiny-llama", "tiny-mla", "tiny-nemotron-h") for p, d in ((1, 1), (2, 1))]
    a = write_run(tmp_path, "a", cells)
    b = write_run(tmp_path, "b", cells[:1])
    res = compare_runs(a, b)
    assert (len(res.missing), res.regressed) == (5, True)
    assert not compare_runs(a, b, allow_missing=True).regressed


def test_runs_of_different_sweeps_are_refused(tmp_path: Path) -> None:
    a = write_run(tmp_path, "a", [MIXED["pass"]], sweep_name="cpu-smoke")
    b = write_run(tmp_path, "b", [MIXED["pass"]], sweep_name="upstream-config-sweep")
    with pytest.raises(UserError, match="a run of sweep cpu-smoke and .* of sweep upstream-config-sweep"):
        compare_runs(a, b)
    res = compare_runs(a, b, allow_other_sweep=True)
    assert res.other_sweep and "**Different sweeps**: A is `cpu-smoke`, B is `upstream-config-sweep`" in markdown(res)
    unnamed = write_run(tmp_path, "c", [MIXED["pass"]], sweep_name="")
    with pytest.raises(UserError, match=r"of sweep \(unnamed\)"):
        compare_runs(unnamed, unnamed)


@given(st.sets(st.integers(0, 5), min_size=1), st.sets(st.integers(0, 5)))
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_property_lost_cells_always_fail(tmp_path: Path, in_a: set[int], in_b: set[int]) -> None:
    """Any subset B of A's cells: the comparison fails exactly when B lost one of A's cells."""
    grid = [pd(m, p, 1) for m in ("tiny-llama", "tiny-mla", "tiny-nemotron-h") for p in (1, 2)]
    root = Path(tempfile.mkdtemp(dir=tmp_path))
    a = write_run(root, "a", [case(grid[i]) for i in sorted(in_a)])
    b = write_run(root, "b", [case(grid[i]) for i in sorted(in_b)])
    res = compare_runs(a, b)
    assert {c.a.cell_id for c in res.missing} == {grid[i].id for i in in_a - in_b}
    assert res.regressed == bool(in_a - in_b)
