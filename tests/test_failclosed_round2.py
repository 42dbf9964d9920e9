"""Issue 23, "fail closed, round two", the cases of modules whose test files are still to be
named: the read pattern (pdsweep.judge.transfer against pdsweep.plan.readplan), a build
python that prints nothing (pdsweep.builds.unfix) and a ref expectation with references off
(pdsweep.plan.expand). The issue's other cases are in the test file of their module
(test_judge_gate, test_judge_compare, test_results_outputs, test_run_dryrun, test_spec_serve,
test_spec_matrix, test_spec_sweep)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from fixtures.make_runs import (
    TR,
    case,
    pd,
    reads_split,
    write_run,
)

from pdsweep.cli import main
from pdsweep.judge.gate import FAIL, PASS, gate_run
from pdsweep.plan import readplan
from pdsweep.results import layout
from pdsweep.xfer import bench

REPO = Path(__file__).resolve().parent.parent
HYBRID = pd("kimi-linear", 2, 1)  # the fixture's cell.json model is MLA + KDA: a hybrid MLA + SSM cell


def edit(path: Path, fn) -> None:
    data = json.loads(path.read_text())
    fn(data)
    path.write_text(json.dumps(data))


def one(tmp_path: Path, *patches, cell=HYBRID, **kw):
    run = write_run(tmp_path, "run", [case(cell, *patches, **kw)])
    return run, gate_run(run).cell(cell.id)


# ---------------------------------------------------------------- Want 2: the read pattern
def test_expected_read_split_is_the_bench_read_plan() -> None:
    assert bench.plans_for is readplan.plans_for  # one function for the bench and the gate
    split = readplan.expected_read_split
    assert split("mla", True, 2, 1) == {0: 1, 1: 1}  # hybrid MLA + SSM: every rank (the #49297 fix)
    assert split("mla", False, 2, 1) == {0: 1}  # pure MLA: one rank
    assert split("mla", False, 4, 2) == {0: 1, 2: 1}
    assert split("gqa", False, 4, 2) == {0: 1, 1: 1, 2: 1, 3: 1}
    assert split("gqa", True, 1, 2) == {0: 2}  # tp_ratio > 0: the plan's rank


def drop_rank(run: Path, cell, rank: str) -> None:
    edit(run / cell.id / TR, lambda d: d["reads_by_prefill_rank"].pop(rank))


def test_hybrid_p2d1_with_one_prefill_ranks_reads_removed_fails_naming_the_read_pattern(tmp_path: Path) -> None:
    run, r = one(tmp_path)
    assert r.verdict == PASS
    drop_rank(run, HYBRID, "1")  # decode read prefill rank 0 only: the signature of the bug #49297 fixed
    r = gate_run(run).cell(HYBRID.id)
    assert r.verdict == FAIL
    assert r.reasons == (
        f"{HYBRID.id}/{TR}: read pattern of p2d1 mla+kda (tp_ratio -2): vLLM's read plan reads prefill ranks "
        "{0: 1, 1: 1} READs per request, seen {0: 100} READs (reads_by_prefill_rank): decode did not read every "
        "rank it must (the split vLLM PR #49297 fixed)",
    )
    assert main(["gate", str(run)]) == 1


def test_read_pattern_proportions_and_missing_split(tmp_path: Path) -> None:
    run, r = one(tmp_path / "a")
    edit(run / HYBRID.id / TR, lambda d: d["reads_by_prefill_rank"]["1"].update(reads=3))  # 3 of 100 requests
    assert "read pattern of p2d1" in gate_run(run).cell(HYBRID.id).reasons[0]
    r = one(tmp_path / "b", {TR: {"reads_by_prefill_rank": None}})[1]
    assert r.verdict == FAIL and "reads_by_prefill_rank is null (metric missing" in r.reasons[0]
    run, r = one(tmp_path / "c", {layout.CELL_FILE: {"model": {"ssm": "none"}}})  # pure MLA
    assert r.verdict == FAIL and "vLLM's read plan reads prefill ranks {0: 1} READs per request" in r.reasons[0]
    drop_rank(run, HYBRID, "1")
    assert gate_run(run).cell(HYBRID.id).verdict == PASS  # pure MLA at tp_ratio < 0 reads one rank


def test_negative_read_counts_fail_and_the_report_does_not_print_them(tmp_path: Path) -> None:
    from pdsweep.report.html import write_report

    neg = {"0": {"reads": -100, "bytes": -100, "descriptors": 1, "engines": 1}, "1": reads_split(HYBRID)["1"]}
    run, r = one(tmp_path, {TR: {"reads_by_prefill_rank": neg}})
    assert r.verdict == FAIL
    assert (
        f"{HYBRID.id}/{TR}: unreadable: reads_by_prefill_rank.0.reads: Input should be greater than or equal to 0"
        in (r.reasons[0])
    )
    md = write_report(run)["markdown"].read_text()
    assert "-100 B" not in md and "111.1%" not in md


# ---------------------------------------------------------------- Want 6: no traceback on bad input
def test_a_build_python_that_prints_nothing_is_a_user_error() -> None:
    from pdsweep.builds import vllmsite
    from pdsweep.core.errors import UserError

    with pytest.raises(UserError, match=r"'/bin/true' is not a Python interpreter pdsweep can probe .*no output"):
        vllmsite.vllm_version("/bin/true")


# ---------------------------------------------------------------- the last two cases of "Found"
def test_a_ref_expectation_with_references_off_is_refused(tmp_path: Path, capsys) -> None:
    (tmp_path / "models.yaml").write_text((REPO / "sweeps" / "models.yaml").read_text())
    body = (
        "name: x\nplatform: cpu\neval: {reference: false}\n"
        "gate: {require_accuracy: false, require_consistency: false}\n"
        "matrix:\n  model: [tiny-llama]\n  tp: [p1d1]\n  block_size: [32]\n"
        "  include:\n    - {kind: ref, model: tiny-llama, expect: fail, match: x, reason: r}\n"
    )
    (tmp_path / "s.yaml").write_text(body)
    assert main(["validate", str(tmp_path / "s.yaml"), "--no-check-argv"]) == 2
    err = capsys.readouterr().err
    assert "matrix.include[0] (kind: ref)" in err and "eval.reference is false" in err, err
