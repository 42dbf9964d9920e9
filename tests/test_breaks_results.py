"""Issue 59, the break hunt on damaged results (the real runs under results/, copied and damaged one field at
a time; each case below is one that broke, rebuilt on a fixture run): ``gate`` fails the cell naming the file
and field, ``report``, ``compare`` and ``best`` answer without a traceback (exit 3)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from fixtures.make_runs import LOAD, case, edit, pd, ref, write_run

from pdsweep.cli import main
from pdsweep.judge.gate import FAIL, PASS, gate_run
from pdsweep.results import layout

CELL = pd("tiny-llama", 1, 1)
RUN = {"concurrency": 1, "num_prompts": 16, "completed": 16, "errors": 0, "output_tokens": 256, "duration_s": 4.0}
RUN |= {"output_tok_s": 64.0, "ttft_ms": {"p50": 91.2, "p90": 118.9, "p99": 122.0}, "repeat": 0}
ANSWERS = {"workload": "random", "concurrency": 1, "checked": 8, "wrong": 0, "stale": 0, "errors": 0, "unmatched": 0}
FILES = {
    LOAD: {
        "runs": [RUN, {**RUN, "repeat": 1}],
        "repeat_plan": {"run": 2, "stop_reason": "planned", "confidence": 0.95},
        "summary": {"c1": {"output_tok_s": {"mean": 64.0, "lo": 64.0, "hi": 64.0, "n": 2}}},
        "workloads": [{"workload": "random", "concurrency": 1, "requests": []}],
    },
    layout.LOAD_CHECK_FILE: {"verdict": "pass", "reasons": [], "workloads": [ANSWERS], "reference_cell": ref(CELL).id},
}


def _run(tmp_path: Path, name: str, fname: str = "", key: str = "", value: Any = None) -> Path:
    run = write_run(tmp_path, name, [case(CELL, FILES), case(ref(CELL))])
    if fname:
        edit(run / CELL.id / fname, lambda d: d.update({key: value}))
    return run


BREAKS = [
    # (file, field, damaged value, the gate's reason): report and compare raised AttributeError on the first two;
    # the third passed the gate as PASS (a twice-redeployed cell is FLAKY)
    (LOAD, "repeat_plan", [1], "load.json: unreadable: repeat_plan: Input should be a valid dictionary"),
    (
        layout.LOAD_CHECK_FILE,
        "workloads",
        [1],
        "load_check.json: unreadable: workloads.0: Input should be a valid dict",
    ),
    (layout.STATUS_FILE, "retries", [1, "x"], "status.json: unreadable: retries.0: Input should be a valid dictionary"),
]


def test_the_fixture_run_passes_and_reports(tmp_path, capsys):
    run = _run(tmp_path, "ok")
    assert gate_run(run).cell(CELL.id).verdict == PASS
    assert main(["report", str(run), "--out", str(tmp_path / "rep")]) == 0


@pytest.mark.parametrize(("fname", "key", "value", "reason"), BREAKS)
def test_a_damaged_results_file_fails_the_gate_naming_the_field(tmp_path, fname, key, value, reason):
    g = gate_run(_run(tmp_path, "bad", fname, key, value)).cell(CELL.id)
    assert g.verdict == FAIL
    assert any(r.startswith(f"{CELL.id}/{reason}") for r in g.reasons), g.reasons


@pytest.mark.parametrize(("fname", "key", "value", "reason"), BREAKS)
@pytest.mark.parametrize("command", ["report", "compare", "best"])
def test_no_command_prints_a_traceback_on_a_damaged_results_file(tmp_path, capsys, fname, key, value, reason, command):
    good, bad = _run(tmp_path, "ok"), _run(tmp_path, "bad", fname, key, value)
    argv = {
        "report": ["report", str(bad), "--out", str(tmp_path / "rep")],
        "compare": ["compare", str(good), str(bad), "--out", str(tmp_path / "cmp")],
        "best": ["best", str(bad), "--slo", "ttft_p90=500"],
    }[command]
    rc = main(argv)
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    if command == "best" and fname == LOAD:  # its only load points are damaged: bad input naming the file
        assert (rc, err) == (2, f"error: no load points: {CELL.id}/{reason} (got [1])\n"), err
    else:
        assert rc in (0, 1), (rc, err)


REPEATS = {"enabled": True, "check": False, "workloads": [{"name": "random"}], "concurrencies": [1, 2]}
REPEATS |= {"num_prompts": 16, "repeats": 2, "target_ci": None, "max_repeats": 5}


@pytest.mark.parametrize(
    ("runs", "reasons"),
    [
        ([(1, 0), (2, 0), (1, 1), (2, 1)], []),
        # a repeat's run lost at one concurrency (or moved to another): PASSED
        (
            [(1, 0), (2, 0), (1, 1)],
            [
                "runs per concurrency differ (1: 2, 2: 1): every repeat runs every concurrency once",
                "concurrency 2: 1 run(s), the plan repeats the load phase 2 times (bench.repeats in run.json)",
            ],
        ),
        # the second repeat lost at every concurrency: PASSED
        (
            [(1, 0), (2, 0)],
            [
                "concurrency 1: 1 run(s), the plan repeats the load phase 2 times (bench.repeats in run.json)",
                "concurrency 2: 1 run(s), the plan repeats the load phase 2 times (bench.repeats in run.json)",
            ],
        ),
        ([(1, 0), (2, 0), (1, 0), (2, 1)], ["concurrency 1: repeat indices [0, 0] (allowed: 0..1, each once)"]),
    ],
)
def test_load_runs_are_the_plans_repeats(tmp_path, runs, reasons):
    load = {"runs": [{**RUN, "concurrency": c, "repeat": i} for c, i in runs]}
    run = write_run(tmp_path, "r", [case(CELL, {LOAD: load}), case(ref(CELL))])
    edit(run / layout.RUN_FILE, lambda d: d.update(bench=REPEATS))
    g = gate_run(run).cell(CELL.id)
    got = [r.removeprefix(f"{CELL.id}/load.json: ") for r in g.reasons if "/load.json: " in r]
    assert got == reasons


def test_the_report_recomputes_the_repeat_summary_from_the_runs(tmp_path, capsys):
    """load.json ``summary`` (the load phase's own statistics of its runs) with text and a list for numbers: the
    report printed it and raised TypeError; it recomputes them from the runs, as the gate judges them."""
    bad = {"c1": {"output_tok_s": {"mean": "x", "lo": None, "hi": [1], "n": 2}}}
    run = _run(tmp_path, "bad", LOAD, "summary", bad)
    assert main(["report", str(run), "--out", str(tmp_path / "rep")]) == 0
    assert "Traceback" not in capsys.readouterr().err
    md = (tmp_path / "rep" / "report.md").read_text()
    row = next(line for line in md.splitlines() if line.startswith(f"| {CELL.id} | 2 (planned)"))
    assert "| 64 ±0 |" in row, row  # output tok/s of the two runs, not the summary's "x"


@pytest.mark.parametrize("fname", [layout.CONSISTENCY_FILE, layout.LOAD_CHECK_FILE])
def test_answers_compared_with_another_cell_than_the_plans_reference_fail(tmp_path, fname):
    """consistency.json / load_check.json ``reference_cell`` the PD cell itself (it agrees with itself): PASSED."""
    g = gate_run(_run(tmp_path, "self", fname, "reference_cell", CELL.id)).cell(CELL.id)
    assert (g.verdict, list(g.reasons)) == (
        FAIL,
        [
            f'{CELL.id}/{fname}: reference_cell "{CELL.id}", the plan\'s reference of {CELL.id} is '
            f"{ref(CELL).id} (plan.json references)"
        ],
    )


def test_compare_lines_cells_up_by_the_plans_cell_not_cell_jsons_compare_key(tmp_path, capsys):
    """cell.json ``compare_key`` "zzz" (a file's own claim) put the cell in no pair: compare said it was only in A and
    only in B and exited 1 (a regression) for a run identical to A."""
    good, bad = _run(tmp_path, "ok"), _run(tmp_path, "bad", layout.CELL_FILE, "compare_key", "zzz")
    assert main(["compare", str(good), str(bad), "--out", str(tmp_path / "cmp")]) == 0
    md = (tmp_path / "cmp" / "compare.md").read_text()
    assert "only-in" not in md and "zzz" not in md, md


def test_a_null_reference_cell_fails_only_where_the_plan_compares_with_a_reference(tmp_path):
    """consistency.json ``reference_cell`` null (compared with nothing) is left to the file's own judge ("no
    reference cell") where the plan runs no reference (``eval.reference: false``: the planned-reference check
    first failed every such cell, CI's test_failure_names and test_slurm runs); where the plan runs one, a null or
    missing reference_cell fails naming the plan's (a load_check.json without it PASSED: test_damaged_sample)."""
    planned = "the plan's reference of"
    g = gate_run(_run(tmp_path, "none", layout.CONSISTENCY_FILE, "reference_cell", None)).cell(CELL.id)
    assert [r for r in g.reasons if planned in r] == [
        f"{CELL.id}/{layout.CONSISTENCY_FILE}: reference_cell null, {planned} {CELL.id} is {ref(CELL).id} "
        "(plan.json references)"
    ], g.reasons
    run = _run(tmp_path, "unplanned", layout.CONSISTENCY_FILE, "reference_cell", None)
    edit(run / layout.RUN_FILE, lambda d: d.setdefault("eval", {}).update({"reference": False}))
    g = gate_run(run).cell(CELL.id)
    assert g.reasons and not [r for r in g.reasons if planned in r], g.reasons
    other = gate_run(_run(tmp_path, "other", layout.CONSISTENCY_FILE, "reference_cell", "x.ref")).cell(CELL.id)
    assert f'{CELL.id}/{layout.CONSISTENCY_FILE}: reference_cell "x.ref", {planned}' in other.reasons[0]
