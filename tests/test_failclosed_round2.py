"""Issue 23, "fail closed, round two": each case of the issue's "Found" list as an input
(a fixture run altered, a sweep, a command line) with its exit code and message, plus a
hypothesis property: no mutation of a failing run's results files turns it PASSED."""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import pytest
from fixtures.make_runs import (
    ACC,
    CON,
    LOAD,
    MIXED,
    ST,
    TR,
    acc,
    case,
    crashed,
    pd,
    reads_split,
    ref,
    totals,
    write_run,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdsweep.cli import main
from pdsweep.judge.compare import compare_runs
from pdsweep.judge.gate import FAIL, PASS, XFAIL, gate_run
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


# ---------------------------------------------------------------- Want 1: files agree, verdicts recomputed
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


# ---------------------------------------------------------------- Want 5: compare
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
    assert {c.key: c.verdict for c in res.cells} == {fixed.compare_key: "same", ref(fixed).compare_key: "same"}


# ---------------------------------------------------------------- Want 6: outputs never on the run's own files
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


# ---------------------------------------------------------------- Want 7: cluster plans, --cells
SMALL = "name: x\nplatform: cpu\nmatrix: {model: [tiny-llama], tp: [p1d1], block_size: [32]}\n"


@pytest.mark.parametrize(
    "flags, why",
    [
        (["--cells", "nonexistent*"], "--cells 'nonexistent*' selects no cell"),
        (
            ["--nodes", "200000", "--gpus-per-node", "8"],
            "--nodes 200000: allowed 1..4096",  # not "give --gpus-per-node": it was given
        ),
        (["--launcher", "slurm", "--gpus-per-node", "-4"], "--gpus-per-node -4: allowed 0..64"),
    ],
)
def test_plan_flags_out_of_bounds_are_exit_2(tmp_path: Path, capsys, flags: list[str], why: str) -> None:
    (tmp_path / "models.yaml").write_text((REPO / "sweeps" / "models.yaml").read_text())
    (tmp_path / "s.yaml").write_text(SMALL)
    assert main(["plan", str(tmp_path / "s.yaml"), "--no-check-argv", *flags]) == 2
    err = capsys.readouterr().err
    assert why in err and "Traceback" not in err


def test_plan_port_check_counts_the_schedules_lanes(tmp_path: Path) -> None:
    from pdsweep.core.errors import UserError
    from pdsweep.plan.instance import Slot
    from pdsweep.run.dryrun import _check_slot_ports

    _check_slot_ports({"a": Slot(0, (0,), 65000)}, 20000)  # one lane of 200 ports from 65000: 65199 fits
    _check_slot_ports({"a": Slot(0, (0,), 65000), "b": Slot(1, (1,), 65336)}, 20000)  # ends at 65535: fits
    with pytest.raises(UserError, match="runs 2 lanes of 200 ports .*reach port 65536, past 65535"):
        _check_slot_ports({"a": Slot(0, (0,), 65000), "b": Slot(1, (1,), 65337)}, 20000)
    with pytest.raises(UserError, match="reach port 102602"):
        _check_slot_ports({"a": Slot(0, (0,), 102403)}, 20000)


# ---------------------------------------------------------------- Want 8: connector settings
@pytest.mark.parametrize(
    "extra, why",
    [
        ("{engine_id: same}", "kv_transfer_extra: key(s) ['engine_id'] not allowed"),
        ("{kv_connector_extra_config: {kv_lease_duration: -5}}", "kv_connector_extra_config.kv_lease_duration"),
        ("{kv_connector_extra_config: {nonsense: 1}}", "key(s) ['nonsense'] unknown (allowed: kv_lease_duration"),
        ("{kv_port: 80}", "kv_transfer_extra.kv_port: Input should be greater than or equal to 1024"),
        ("{kv_load_failure_policy: maybe}", "kv_transfer_extra.kv_load_failure_policy"),
    ],
)
def test_connector_settings_known_and_bounded(tmp_path: Path, capsys, extra: str, why: str) -> None:
    (tmp_path / "models.yaml").write_text((REPO / "sweeps" / "models.yaml").read_text())
    body = SMALL.replace("matrix: {", f"serve_args:\n  base: []\n  x: {{kv_transfer_extra: {extra}}}\nmatrix: {{")
    (tmp_path / "s.yaml").write_text(body.replace("block_size: [32]}", "block_size: [32], serve_args: [x]}"))
    assert main(["validate", str(tmp_path / "s.yaml"), "--no-check-argv"]) == 2
    err = capsys.readouterr().err
    assert why in err and "Traceback" not in err, err


# ---------------------------------------------------------------- Want 4: expect: fail needs match:
def test_validate_refuses_expect_fail_without_match(tmp_path: Path, capsys) -> None:
    (tmp_path / "models.yaml").write_text((REPO / "sweeps" / "models.yaml").read_text())
    body = (
        "name: x\nplatform: cpu\nmatrix:\n  model: [tiny-llama]\n  tp: [p1d1]\n  block_size: [32]\n"
        "  include:\n    - {model: tiny-llama, tp: p1d1, block_size: 32, expect: fail, reason: r}\n"
    )
    (tmp_path / "s.yaml").write_text(body)
    assert main(["validate", str(tmp_path / "s.yaml"), "--no-check-argv"]) == 2
    assert "'expect: fail' needs 'match:'" in capsys.readouterr().err
    (tmp_path / "s.yaml").write_text(body.replace("reason: r}", "reason: r, match: any}"))
    assert main(["validate", str(tmp_path / "s.yaml"), "--no-check-argv"]) == 0, capsys.readouterr().err


def test_every_shipped_expected_failure_names_its_signature() -> None:
    import yaml

    for path in sorted((REPO / "sweeps").glob("*.yaml")):
        inc = ((yaml.safe_load(path.read_text()) or {}).get("matrix") or {}).get("include") or []
        for e in inc:
            if isinstance(e, dict) and e.get("expect") == "fail":
                assert e.get("match"), (path.name, e)


# ---------------------------------------------------------------- the property
FAILING = {
    "no_kv": case(HYBRID, totals(num_transfers=0, bytes=0)),
    "acc": case(pd("tiny-mla", 1, 1), acc(0.62, "fail", ("pdsweep_arith: low",))),
    "crashed": case(pd("tiny-qwen3-next", 1, 1), crashed("eval", "decode-0 exited with code -11", ["boom"])),
    "reads": case(pd("qwen3-0.6b", 2, 1), {TR: {"reads_by_prefill_rank": {"1": {"reads": 0, "bytes": 0}}}}),
    "incons": case(pd("qwen3-0.6b", 4, 1), {CON: {"prompts": [{"name": "p", "pd_tokens": [1], "ref_tokens": [2]}]}}),
}
FILES = (layout.CELL_FILE, ST, ACC, CON, TR, LOAD, layout.RUN_FILE, layout.PLAN_FILE)


def _paths(data, prefix=()):
    """Every (path, value) in a JSON document."""
    yield prefix, data
    if isinstance(data, dict):
        for k, v in data.items():
            yield from _paths(v, (*prefix, k))
    elif isinstance(data, list):
        for i, v in enumerate(data):
            yield from _paths(v, (*prefix, i))


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
        paths = [p for p, _ in _paths(data) if p]
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


# ---------------------------------------------------------------- Want 6: no traceback on bad input
def test_a_build_python_that_prints_nothing_is_a_user_error() -> None:
    from pdsweep.builds import unfix
    from pdsweep.core.errors import UserError

    with pytest.raises(UserError, match=r"'/bin/true' is not a Python interpreter pdsweep can probe .*no output"):
        unfix.vllm_version("/bin/true")


def test_a_cell_directory_that_is_a_symlink_loop_fails_the_cell(tmp_path: Path, capsys) -> None:
    run = write_run(tmp_path, "run", [case(HYBRID), MIXED["pass"]])
    shutil.rmtree(run / HYBRID.id)
    (run / HYBRID.id).symlink_to(run / HYBRID.id)  # ELOOP on every access
    r = gate_run(run).cell(HYBRID.id)
    assert r.verdict == FAIL and any(x.startswith(f"{HYBRID.id}/status.json: ") for x in r.reasons), r.reasons
    assert main(["gate", str(run), "--junit", str(tmp_path / "j.xml"), "--summary", str(tmp_path / "s.md")]) == 1
    assert "Traceback" not in capsys.readouterr().err


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


def test_a_models_file_that_is_a_symlink_loop_is_bad_input(tmp_path: Path, capsys) -> None:
    (tmp_path / "a").symlink_to(tmp_path / "b")
    (tmp_path / "b").symlink_to(tmp_path / "a")
    (tmp_path / "s.yaml").write_text(
        "name: x\nplatform: cpu\nmodels_file: a\nmatrix: {model: [tiny-llama], tp: [p1d1]}\n"
    )
    assert main(["validate", str(tmp_path / "s.yaml"), "--no-check-argv"]) == 2
    err = capsys.readouterr().err
    assert "models_file 'a': cannot resolve" in err and "Traceback" not in err, err
