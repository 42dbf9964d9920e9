"""Issue 59 ("fail closed, round three"): what a results file must hold comes from the plan
(run.json's frozen bench and eval), never from the file; an expectation explains only what its
signature names."""

from __future__ import annotations

from pathlib import Path

import pytest
from _sweepfiles import bad
from fixtures.make_runs import ACC, CON, HYBRID, LOAD, TASK, case, edit, good_prompts, pd, write_run

from pdsweep.judge.accuracy import frozen_expected
from pdsweep.judge.gate import FAIL, PASS, XFAIL, gate_run
from pdsweep.results import layout
from pdsweep.sweepfile.gatespec import GateSpec
from pdsweep.sweepfile.phases import EvalSpec

BENCH = {"enabled": True, "check": False, "workloads": [{"name": "random"}], "concurrencies": [2, 8], "num_prompts": 16}
BENCH["repeats"] = 1  # one vllm bench serve run per concurrency
EVAL = EvalSpec(tasks=[TASK], consistency={"lengths": ["short", "blocks", "long"]}).model_dump()
NO_BENCH = {"enabled": False}


def load_run(c: int, n: int = 16) -> dict:
    return {"concurrency": c, "num_prompts": n, "completed": n, "errors": 0, "output_tokens": 4 * n}


def judged(tmp_path: Path, *patches, cell=HYBRID, bench=BENCH, eval_=EVAL):
    run = write_run(tmp_path, "run", [case(cell, *patches)])

    def freeze(index: dict) -> None:  # None: the section left out of run.json
        for key, value in (("bench", bench), ("eval", eval_)):
            index.pop(key) if value is None else index.update({key: value})

    edit(run / layout.RUN_FILE, freeze)
    return gate_run(run).cell(cell.id)


W = f"{HYBRID.id}/{LOAD}"


@pytest.mark.parametrize(
    "runs, why",
    [
        ([load_run(2), load_run(8)], None),
        ([load_run(2)], f"{W}: no load run at concurrency 8 (bench.concurrencies [2, 8] in run.json)"),
        (
            [load_run(2), load_run(8), load_run(4)],
            f"{W}: a load run at concurrency 4, which bench.concurrencies [2, 8] does not plan",
        ),
        ([load_run(2), load_run(8, 1)], f"{W}: concurrency 8: num_prompts 1, bench.num_prompts 16 in run.json"),
    ],
    ids=["planned", "concurrency-lost", "unplanned-concurrency", "one-prompt-of-16"],
)
def test_load_runs_are_checked_against_the_planned_bench(tmp_path: Path, runs: list, why: str | None) -> None:
    r = judged(tmp_path, {LOAD: {"runs": runs}})
    assert (r.verdict, list(r.reasons)) == ((PASS, []) if why is None else (FAIL, [why]))


def test_a_planned_probe_prompt_missing_from_consistency_json_fails(tmp_path: Path) -> None:
    r = judged(tmp_path, {CON: {"prompts": good_prompts(("short",))}}, bench=NO_BENCH)
    assert r.verdict == FAIL and list(r.reasons) == [
        f"{HYBRID.id}/{CON}: prompt '{n}' missing (eval.consistency.lengths gives ['short', 'blocks', 'long'] "
        "in run.json)"
        for n in ("blocks", "long")
    ]


def test_a_planned_task_missing_from_accuracy_json_fails(tmp_path: Path) -> None:
    r = judged(tmp_path, bench=NO_BENCH, eval_={**EVAL, "tasks": [TASK, "gsm8k"]})
    assert r.verdict == FAIL and list(r.reasons) == [
        f"{HYBRID.id}/{ACC}: task gsm8k missing (eval.tasks ['{TASK}', 'gsm8k'] in run.json)"
    ]
    r = judged(
        tmp_path / "old", bench=NO_BENCH, eval_=None
    )  # no default stands in for the plan (judge.planned.frozen_problems)
    assert r.verdict == FAIL and r.reasons == (
        "the plan is damaged: run.json: eval missing (the lm-eval tasks and probe prompts)",
    )


@pytest.mark.parametrize(
    "pattern, text", [(".", "\x00"), ("|", ""), ("x*", ""), ("(?:)", ""), ("^", ""), ("\\s", " "), ("[^a]", "\x00")]
)
def test_a_match_that_matches_any_text_is_refused(tmp_path: Path, capsys, pattern: str, text: str) -> None:
    body = (
        "name: x\nplatform: cpu\nmatrix:\n  model: [tiny-llama]\n  tp: [p1d1]\n  block_size: [32]\n"
        f"  include:\n    - {{model: tiny-llama, tp: p1d1, block_size: 32, expect: fail, reason: r, match: '{pattern}'}}\n"
    )
    err = bad(tmp_path, body, capsys)
    assert f"{pattern!r} matches {text!r}, so it explains any failure" in err and "s.yaml" in err


UCX = "KV READ over UCX transport\\(s\\) tcp/.* \\(fell back to tcp\\); expected: cma"


def test_an_expected_failure_does_not_hide_a_lost_result(tmp_path: Path) -> None:
    """The CPU default's UCX-TCP drill (sweeps/cpu-smoke.yaml): its signature names the transport;
    with its accuracy.json deleted it is FAIL listing the loss, not XFAIL."""
    from pdsweep.judge.gate import checks_for

    assert any(c.name == "transport" for c in checks_for(GateSpec(transports=["cma"])))
    cell = pd("tiny-llama", 1, 1, expect_fail=True, expect_reason="ucx-tcp drill", expect_match=UCX)
    tcp = {layout.TRANSFER_FILE: {"ucx_transports": ["tcp/lo"]}}

    def gate(name: str, *patches):
        run = write_run(tmp_path / name, "run", [case(cell, tcp, *patches)])
        edit(run / layout.RUN_FILE, lambda d: d.update(gate=GateSpec(transports=["cma"]).model_dump()))
        return gate_run(run).cell(cell.id)

    assert gate("drill").verdict == XFAIL
    r = gate("lost", {ACC: None})
    assert r.verdict == FAIL and r.reasons[-1] == (
        f"expected to fail with a signature matching /{UCX}/ (ucx-tcp drill), which does not name these lost "
        f"results: {cell.id}/{ACC}: missing"
    )


def test_a_run_json_without_its_frozen_bench_fails_naming_it(tmp_path: Path) -> None:
    """Was fail-open: without run.json ``bench`` the load checks were off (load.json and load_check.json not required)."""
    r = judged(tmp_path, bench=None)
    assert r.verdict == FAIL and r.reasons == (
        "the plan is damaged: run.json: bench missing (the load phase load.json and load_check.json must hold)",
    )


def test_a_plan_json_missing_a_cell_run_json_lists_fails_naming_both(tmp_path: Path) -> None:
    run = write_run(tmp_path, "run", [case(HYBRID)])
    edit(run / layout.PLAN_FILE, lambda d: d.update(cells=[]))
    assert gate_run(run).cell(HYBRID.id).reasons == (
        f"the plan is damaged: plan.json: cells: {HYBRID.id} missing (run.json cells lists it)",
    )


EXPECTED = {"value": 0.8, "tolerance": 0.05, "n": 200, "source": "accuracy/expected.yaml"}


@pytest.mark.parametrize(
    "recorded, why",
    [
        (EXPECTED, None),
        (None, "pdsweep_arith: expected missing (run.json expected.kimi-linear.pdsweep_arith is 0.8 +/- 0.05)"),
        (
            {**EXPECTED, "tolerance": 0.5},
            "pdsweep_arith: expected.tolerance is 0.5, run.json expected.kimi-linear.pdsweep_arith.tolerance is 0.05",
        ),
    ],
    ids=["as-planned", "dropped", "widened"],
)
def test_each_task_records_the_expected_score_the_plan_gives(tmp_path: Path, recorded, why) -> None:
    """Was OPTIONAL in the damage sample: a task whose ``expected`` was dropped passed on its reference alone;
    the expected score now comes from run.json ``expected`` (accuracy/expected.yaml when the run started)."""
    run = write_run(tmp_path, "run", [case(HYBRID, {ACC: {"tasks": {TASK: {"expected": recorded}}}})])
    edit(run / layout.RUN_FILE, lambda d: d.update(expected={HYBRID.model: {TASK: EXPECTED}}))
    r = gate_run(run).cell(HYBRID.id)
    assert (r.verdict, r.reasons) == ((PASS, ()) if why is None else (FAIL, (f"{HYBRID.id}/{ACC}: {why}",)))


def test_run_json_freezes_the_expected_scores_of_its_models() -> None:
    table = {"tiny-llama": {TASK: EXPECTED, "gsm8k": EXPECTED}, "tiny-mla": {"gsm8k": EXPECTED}}
    assert frozen_expected(["tiny-llama", "tiny-mla", "tiny-llama", "x"], [TASK], table) == {
        "tiny-llama": {TASK: EXPECTED}
    }
