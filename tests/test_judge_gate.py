"""pdsweep.judge.gate: files that disagree, recorded verdicts recomputed, results files typed, and no
mutation of a failing run's files turns it PASSED (issue 23, "fail closed, round two"); a hostile cell id is bad input and odd values never crash
gate or compare (issue 15)."""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import pytest
from fixtures.jsondoc import json_paths
from fixtures.make_runs import (
    ACC,
    CON,
    HYBRID,
    LOAD,
    MIXED,
    ST,
    TR,
    acc,
    case,
    crashed,
    edit,
    one,
    pd,
    reads_split,
    totals,
    write_run,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdsweep.cli import main
from pdsweep.core.errors import UserError
from pdsweep.judge.gate import FAIL, PASS, XFAIL, gate_run
from pdsweep.results import layout

FAILING = {
    "no_kv": case(HYBRID, totals(num_transfers=0, bytes=0)),
    "acc": case(pd("tiny-mla", 1, 1), acc(0.62, "fail", ("pdsweep_arith: low",))),
    "crashed": case(pd("tiny-qwen3-next", 1, 1), crashed("eval", "decode-0 exited with code -11", ["boom"])),
    "reads": case(pd("qwen3-0.6b", 2, 1), {TR: {"reads_by_prefill_rank": {"1": {"reads": 0, "bytes": 0}}}}),
    "incons": case(pd("qwen3-0.6b", 4, 1), {CON: {"prompts": [{"name": "p", "pd_tokens": [1], "ref_tokens": [2]}]}}),
}


FILES = (layout.CELL_FILE, ST, ACC, CON, TR, LOAD, layout.RUN_FILE, layout.PLAN_FILE)


def _mutate(data, path, op, swap):
    if not path:
        return data
    parent = data
    for k in path[:-1]:
        parent = parent[k]
    key, old = path[-1], parent[path[-1]]
    if op == "delete":
        if isinstance(parent, dict):
            del parent[key]
        else:
            parent.pop(key)
    elif op == "flip" and isinstance(old, (int, float)) and not isinstance(old, bool):
        parent[key] = -old
    else:
        parent[key] = swap
    return data


SWAPS = st.sampled_from([None, True, False, 0, 1, -1, 0.5, 1e308, "pass", "ok", "pd", "ref", "any", [], {}])


MUTATION = st.tuples(st.sampled_from(FILES), st.integers(0, 10**6), st.sampled_from(["delete", "swap", "flip"]), SWAPS)


def test_run_json_saying_ref_for_a_pd_cell_fails_naming_the_disagreement(tmp_path: Path, capsys) -> None:
    bad = case(HYBRID, totals(num_transfers=0, bytes=0), {CON: {"verdict": "fail", "reasons": ["probe diverged"]}})
    run = write_run(tmp_path, "run", [bad])
    edit(run / layout.RUN_FILE, lambda d: d["cells"][HYBRID.id].update(kind="ref"))
    res = gate_run(run).cell(HYBRID.id)
    assert res.verdict == FAIL
    assert f'{HYBRID.id}: files disagree on kind: run.json "ref", plan.json "pd", cell.json "pd"' in res.reasons[-1]
    assert any("no KV transferred" in r for r in res.reasons)  # the transfer check ran: kind pd, the strictest
    assert main(["gate", str(run)]) == 1


def test_rejected_in_plan_but_ran_fails(tmp_path: Path, capsys) -> None:
    cell = pd("tiny-llama", 1, 1)
    run = write_run(tmp_path, "run", [MIXED["pass"]], rejected=[(HYBRID, "platform-limit", "too wide")])
    layout.write_json(
        run / HYBRID.id / ST, {"cell_id": HYBRID.id, "status": "failed", "phase": "eval", "reason": "decode exit -11"}
    )
    res = gate_run(run)
    assert res.cell(cell.id).verdict == PASS
    r = res.cell(HYBRID.id)
    assert r.verdict == FAIL and not res.passed
    assert r.reasons == (
        f'{HYBRID.id}: listed as rejected (rule platform-limit) but status.json says it ran (status "failed", '
        'phase "eval"): the run is not what was planned',
    )
    assert main(["gate", str(run)]) == 1


def test_expect_fail_without_match_and_no_results_is_not_xfail(tmp_path: Path) -> None:
    cell = pd("kimi-linear", 2, 1, expect_fail=True, expect_reason="lost SSM state")
    _, r = one(tmp_path, {ACC: None, CON: None, TR: None}, cell=cell)
    assert r.verdict == FAIL
    assert "no 'match:' signature was recorded: 'expect: fail' needs 'match:' (or 'match: any')" in r.reasons[-1]


def test_expect_fail_with_match_any_is_counted_in_the_headline(tmp_path: Path) -> None:
    cell = pd("kimi-linear", 2, 1, expect_fail=True, expect_reason="lost SSM state", expect_match="any")
    run = write_run(tmp_path, "run", [case(cell, acc(0.3, "fail", ("pdsweep_arith: low",)))])
    res = gate_run(run)
    assert res.cell(cell.id).verdict == XFAIL
    assert res.headline() == "PASSED: 1 XFAIL (1 XFAIL with 'match: any': any failure accepted)"


@pytest.mark.parametrize("value", [7.5, -0.3])
def test_accuracy_value_outside_expectation_with_verdict_pass_fails(tmp_path: Path, value: float) -> None:
    _, r = one(tmp_path, acc(value))
    w = f"{HYBRID.id}/{ACC}: pdsweep_arith"
    assert r.verdict == FAIL
    assert f"{w}: value {value:g} is outside [0, 1] (exact_match is a rate)" in r.reasons
    assert any(
        x.startswith(f"{w}: recorded verdict pass, recomputed fail: pdsweep_arith: exact_match {value:.4f} outside")
        for x in r.reasons
    ), r.reasons


def test_consistency_pass_with_every_prompt_at_exact_match_zero_fails(tmp_path: Path) -> None:
    run = write_run(tmp_path, "run", [case(HYBRID)])
    edit(run / HYBRID.id / CON, lambda d: [p.update(exact_match_rate=0.0) for p in d["prompts"]])
    r = gate_run(run).cell(HYBRID.id)
    assert r.verdict == FAIL
    assert (
        f"{HYBRID.id}/{CON}: prompt 'short': recorded exact_match_rate 0.0, recomputed 1.0 from its tokens and logprobs"
    ) in r.reasons


def test_consistency_pass_with_diverging_tokens_fails_on_the_recomputed_verdict(tmp_path: Path) -> None:
    run = write_run(tmp_path, "run", [case(HYBRID)])

    def diverge(d):
        p = d["prompts"][0]
        p.update(pd_tokens=[9, 9, 9, 9], exact_match_rate=0.0, first_divergence=0, max_abs_dlogprob=None)

    edit(run / HYBRID.id / CON, diverge)
    r = gate_run(run).cell(HYBRID.id)
    assert r.verdict == FAIL
    assert any(
        "recorded verdict pass, recomputed fail: prompt 'short' (12 tokens): tokens diverge at position 0" in x
        for x in r.reasons
    ), r.reasons


@pytest.mark.parametrize(
    "value, why", [(-200, "totals.kv_requests = -200: negative"), (0.5, "totals.kv_requests = 0.5: a count")]
)
def test_kv_requests_must_be_a_count(tmp_path: Path, value, why: str) -> None:
    _, r = one(tmp_path, totals(kv_requests=value))
    assert r.verdict == FAIL and any(x.startswith(f"{HYBRID.id}/{TR}: {why}") for x in r.reasons), r.reasons


@pytest.mark.parametrize(
    "run0, why",
    [
        ({"errors": -3}, "runs.0.errors: Input should be greater than or equal to 0 (got -3)"),
        ({"num_prompts": 0, "completed": 0}, "runs.0.num_prompts: Input should be greater than or equal to 1"),
        ({"completed": 20}, "completed 20 > num_prompts 16"),
    ],
)
def test_load_json_has_a_schema(tmp_path: Path, run0: dict, why: str) -> None:
    body = {"runs": [{"concurrency": 1, "num_prompts": 16, "completed": 16, "errors": 0, "new_field": 1, **run0}]}
    _, r = one(tmp_path, {LOAD: body})
    assert r.verdict == FAIL and any(x.startswith(f"{HYBRID.id}/{LOAD}: unreadable: ") and why in x for x in r.reasons)


def test_load_json_tolerates_added_fields(tmp_path: Path) -> None:
    run = {"concurrency": 1, "num_prompts": 16, "completed": 16, "errors": 0, "output_tokens": 64, "goodput": {"x": 1}}
    body = {"runs": [run]}
    assert one(tmp_path, {LOAD: body})[1].verdict == PASS


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


def test_invalid_frozen_gate_is_an_error_not_the_defaults(tmp_path: Path, capsys) -> None:
    run = write_run(tmp_path, "run", [case(HYBRID)])
    edit(run / layout.RUN_FILE, lambda d: d.update(gate={"alpha": 7}))
    assert main(["gate", str(run)]) == 2
    assert "run.json: gate.alpha: Input should be less than 1 (got 7)" in capsys.readouterr().err


def test_deeply_nested_results_file_is_no_traceback(tmp_path: Path, capsys) -> None:
    run = write_run(tmp_path, "run", [case(HYBRID)])
    (run / HYBRID.id / ACC).write_text("[" * 200_000 + "]" * 200_000)
    r = gate_run(run).cell(HYBRID.id)
    assert r.verdict == FAIL and f"{HYBRID.id}/{ACC}: unreadable: JSON nested too deeply" in r.reasons
    (run / layout.RUN_FILE).write_text("[" * 200_000 + "]" * 200_000)
    assert main(["gate", str(run)]) == 2
    assert "JSON nested too deeply" in capsys.readouterr().err


@given(name=st.sampled_from(sorted(FAILING)), mutations=st.lists(MUTATION, min_size=1, max_size=4))
@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_property_no_mutation_turns_a_failing_run_into_passed(tmp_path: Path, name: str, mutations) -> None:
    root = Path(tempfile.mkdtemp(dir=tmp_path))
    cell, _ = FAILING[name]
    run = write_run(root, "run", [FAILING[name], MIXED["pass"]])
    assert not gate_run(run).passed
    for fname, pick, op, swap in mutations:
        path = run / fname if fname in (layout.RUN_FILE, layout.PLAN_FILE) else run / cell.id / fname
        if not path.exists():
            continue
        data = json.loads(path.read_text())
        paths = [p for p in json_paths(data) if p]
        if paths:
            path.write_text(json.dumps(_mutate(data, paths[pick % len(paths)], op, swap)))
    try:
        res = gate_run(run)
    except Exception as e:  # noqa: BLE001 - only a clear UserError is allowed (exit 2, never PASSED)
        from pdsweep.core.errors import UserError

        assert isinstance(e, UserError), e
        return
    assert not res.passed, [(c.cell_id, c.verdict, c.reasons) for c in res.cells]
    shutil.rmtree(root, ignore_errors=True)


def test_a_cell_directory_that_is_a_symlink_loop_fails_the_cell(tmp_path: Path, capsys) -> None:
    run = write_run(tmp_path, "run", [case(HYBRID), MIXED["pass"]])
    shutil.rmtree(run / HYBRID.id)
    (run / HYBRID.id).symlink_to(run / HYBRID.id)  # ELOOP on every access
    r = gate_run(run).cell(HYBRID.id)
    assert r.verdict == FAIL and any(x.startswith(f"{HYBRID.id}/status.json: ") for x in r.reasons), r.reasons
    assert main(["gate", str(run), "--junit", str(tmp_path / "j.xml"), "--summary", str(tmp_path / "s.md")]) == 1
    assert "Traceback" not in capsys.readouterr().err


HC = [HealthCheck.function_scoped_fixture]


CELL = pd("tiny-llama", 1, 1)


JSON_ODD = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(10**30), 10**30),
    st.sampled_from([10**400, -(10**400)]),
    st.floats(allow_nan=False),
    st.text(max_size=8),
    st.lists(st.integers(), max_size=2),
    st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
)


def test_gate_of_a_run_json_with_a_hostile_cell_id_is_bad_input(tmp_path: Path) -> None:
    run = write_run(tmp_path, "run", [case(CELL)])
    index = json.loads((run / "run.json").read_text())
    index["cells"]["../../outside"] = {"kind": "pd"}
    (run / "run.json").write_text(json.dumps(index))
    with pytest.raises(UserError, match="'../../outside' is not a safe directory name"):
        gate_run(run)


@given(
    st.sampled_from(["cell.json", "status.json", "accuracy.json", "consistency.json", "transfer.json", "run.json"]),
    st.integers(0, 10**6),
    JSON_ODD,
)
@settings(max_examples=60, deadline=None, suppress_health_check=HC)
def test_property_odd_results_values_never_crash_gate_or_compare(
    tmp_path: Path, capsys, name: str, pick: int, value
) -> None:
    """Any leaf of any results file replaced by an odd JSON value: gate and compare give a
    verdict (0/1) or refuse the input (2), never an internal error."""
    root = Path(tempfile.mkdtemp(dir=tmp_path))
    run = write_run(root, "run", [case(CELL), case(CELL.reference())])
    path = run / name if name == "run.json" else run / CELL.id / name
    data = json.loads(path.read_text())
    leaves = [p for p in json_paths(data) if p and p != ("schema",)]
    target = leaves[pick % len(leaves)]
    cur = data
    for k in target[:-1]:
        cur = cur[k]
    cur[target[-1]] = value
    path.write_text(json.dumps(data))
    assert main(["gate", str(run), "--junit", str(root / "j.xml"), "--summary", str(root / "s.md")]) in (0, 1, 2)
    assert main(["compare", str(run), str(run), "--out", str(root)]) in (0, 1, 2)
    assert "Traceback" not in capsys.readouterr().err


@pytest.mark.parametrize("instances", [7, "decode-0", {"role": "decode"}])
def test_cell_json_instances_not_a_list_never_crash_the_gate(tmp_path: Path, instances) -> None:
    """Found by the property test above (hypothesis, 2026-12-07): cell.json ``instances: 7`` made
    judge.facts.load_failure_policy iterate an int (TypeError, exit 3)."""
    run = write_run(tmp_path, "run", [case(CELL, {layout.CELL_FILE: {"instances": instances}}), case(CELL.reference())])
    assert {c.cell_id: c.verdict for c in gate_run(run).cells}[CELL.id] in (PASS, FAIL)


def test_the_planned_reference_comes_from_plan_json(tmp_path: Path) -> None:
    """An unfixed cell is compared with the reference on the sweep's default build
    (plan.expand.reference_of); the CPU default's first sweep with the planned-reference check
    FAILed every such cell because the gate used Cell.reference() (the cell's own build)."""
    unfixed, fixed_ref = pd("tiny-llama", 1, 1, build="unfixed"), CELL.reference()
    patch = {layout.ACCURACY_FILE: {"tasks": {"pdsweep_arith": {"reference": {"cell_id": fixed_ref.id}}}}}
    patch[layout.CONSISTENCY_FILE] = {"reference_cell": fixed_ref.id}  # the probe compared with it too
    run = write_run(tmp_path, "run", [case(unfixed, patch), case(CELL), case(fixed_ref)])
    before = {c.cell_id: c for c in gate_run(run).cells}[unfixed.id]
    assert before.verdict == FAIL and f"the cell's reference is {unfixed.reference().id}" in " ".join(before.reasons)
    plan = layout.read_json(run / layout.PLAN_FILE)
    layout.write_json(run / layout.PLAN_FILE, {**plan, "references": {unfixed.id: fixed_ref.id, CELL.id: fixed_ref.id}})
    assert {c.cell_id: c.verdict for c in gate_run(run).cells}[unfixed.id] == PASS
