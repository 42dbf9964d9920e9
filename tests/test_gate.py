"""Gate on hand-made results trees (tests/fixtures/make_runs.py): golden verdicts and
reasons per case, fail-closed edge cases, JUnit and summary outputs."""

from __future__ import annotations

import json
import shutil
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
from fixtures.make_runs import CON, MIXED, MIXED_REJECTED, OUTSIDE, SSM_LOST, TASK, case, ids, pd, write_run

from pdsweep.cli import main as cli_main
from pdsweep.core.errors import GateFailed, UserError
from pdsweep.judge.gate import FAIL, FLAKY, PASS, SKIPPED, XFAIL, XPASS, XPASS_REASON, gate_run
from pdsweep.report.render import write_junit, write_summary
from pdsweep.results import layout
from pdsweep.sweepfile.gatespec import GateSpec

ID = ids(MIXED)
REJECTED_ID = MIXED_REJECTED[0][0].id


@pytest.fixture
def copy_of(runs: dict[str, Path], tmp_path: Path):
    def make(name: str) -> Path:
        return Path(shutil.copytree(runs[name], tmp_path / name))

    return make


def w(case_name: str, file: str) -> str:
    return f"{ID[case_name]}/{file}"


GOLDEN = {
    "pass": (PASS, []),
    "within_noise": (PASS, []),
    "stderr_na": (PASS, []),
    "ref": (PASS, []),
    "ref_tp2": (PASS, []),
    "acc_regression": (FAIL, [f"{w('acc_regression', 'accuracy.json')}: {TASK}: {OUTSIDE % 0.62}"]),
    "missing_accuracy": (FAIL, [f"{w('missing_accuracy', 'accuracy.json')}: missing"]),
    "crashed": (
        FAIL,
        [
            f"{w('crashed', 'status.json')}: failed in phase eval: decode-0 exited with code -11"
            " — last log line: Segmentation fault (core dumped)"
        ],
    ),
    "failed_null": (FAIL, [f"{w('failed_null', 'transfer.json')}: totals.failed_transfers is null (metric missing)"]),
    "failed_positive": (
        FAIL,
        [
            f"{w('failed_positive', 'transfer.json')}: totals.failed_transfers = 3 (allowed: 0; failed-transfer "
            "accounting unknown (nixl/stats.py NixlPromMetrics.observe not probed, or of neither shape around "
            "vLLM PR 55854))"
        ],
    ),
    "no_kv": (
        FAIL,
        [
            f"{w('no_kv', 'transfer.json')}: no KV transferred (num_transfers 0, bytes 0): "
            "decode did not receive KV from prefill"
        ],
    ),
    "expired": (FAIL, [f"{w('expired', 'transfer.json')}: totals.expired_reqs = 2 (allowed: 0)"]),
    "recompute": (
        FAIL,
        [
            f"{w('recompute', 'transfer.json')}: decode did 150 KV transfers for 200 PD requests "
            "whose prompt spans >= 1 block: the others were recomputed on decode (silent recompute)"
        ],
    ),
    "kv_requests_null": (
        FAIL,
        [
            f"{w('kv_requests_null', 'transfer.json')}: totals.kv_requests is null (metric "
            "missing: the PD proxy's count of requests spanning >= 1 block)"
        ],
    ),
    "load_lost": (
        FAIL,
        [
            f"{w('load_lost', 'load.json')}: concurrency 8: 16 load requests failed, completed 0 of "
            "num_prompts 16 (vllm bench serve exits 0 regardless)"
        ],
    ),
    "unreadable": (
        FAIL,
        [
            f"{w('unreadable', 'consistency.json')}: unreadable: Expecting property name enclosed in "
            "double quotes: line 1 column 2 (char 1)"
        ],
    ),
    "acc_null": (FAIL, [f"{w('acc_null', 'accuracy.json')}: {TASK}: value is null (metric missing)"]),
    "xfail": (
        XFAIL,
        [
            f"{w('xfail', 'accuracy.json')}: {TASK}: {OUTSIDE % 0.31}",
            f"{w('xfail', 'consistency.json')}: long: diverges at token 0, max |dlogprob| 7.1 > 0.5",
        ],
    ),
    "xpass": (XPASS, [XPASS_REASON]),
}


def test_golden_covers_every_case() -> None:
    assert set(GOLDEN) == set(MIXED)


@pytest.mark.parametrize("name", list(GOLDEN))
def test_mixed_run_golden(runs: dict[str, Path], name: str) -> None:
    verdict, reasons = GOLDEN[name]
    res = gate_run(runs["mixed"]).cell(ID[name])
    assert (res.verdict, list(res.reasons)) == (verdict, reasons)


def test_mixed_run_fails_on_fail_and_xpass_only(runs: dict[str, Path]) -> None:
    result = gate_run(runs["mixed"])
    assert not result.passed
    assert result.counts == {PASS: 5, FAIL: 12, XFAIL: 1, XPASS: 1, SKIPPED: 1, "NOT-RUNNABLE": 0, FLAKY: 0}
    assert {c.cell_id for c in result.failures} == {ID[k] for k, (v, _) in GOLDEN.items() if v in (FAIL, XPASS)}
    with pytest.raises(GateFailed) as e:
        result.raise_for_verdict()
    expected = f"XPASS {ID['xpass']}: xpass: {XPASS_REASON} [expected: MLA hetero-TP read plan (vllm#43523)]"
    assert expected in str(e.value)


def test_every_cell_of_run_json_and_rejected_is_listed(runs: dict[str, Path]) -> None:
    result = gate_run(runs["mixed"])
    index = layout.read_json(runs["mixed"] / layout.RUN_FILE)
    assert [c.cell_id for c in result.cells] == [*index["cells"], REJECTED_ID]
    skipped = result.cell(REJECTED_ID)
    assert (skipped.verdict, skipped.rule, skipped.reasons) == (
        SKIPPED,
        "platform-limit",
        ("prefill TP > 2 on cuda: fixture limit",),
    )
    assert skipped.ok and skipped.facts.prefill_tp == 4  # placed from plan.json for the heatmaps


def test_all_pass_run(runs: dict[str, Path]) -> None:
    result = gate_run(runs["all-pass"])
    assert result.passed
    assert result.headline() == "PASSED: 5 PASS, 1 SKIPPED"
    result.raise_for_verdict()


def test_deleting_one_accuracy_json_fails_naming_the_cell(copy_of) -> None:
    run = copy_of("all-pass")
    victim = ID["within_noise"]
    (run / victim / layout.ACCURACY_FILE).unlink()
    result = gate_run(run)
    assert [c.cell_id for c in result.failures] == [victim]
    assert result.cell(victim).reasons == (f"{victim}/accuracy.json: missing",)
    with pytest.raises(GateFailed, match=f"FAIL {victim}: {victim}/accuracy.json: missing"):
        result.raise_for_verdict()


def test_expected_failure_that_fails_is_ok(tmp_path: Path) -> None:
    run = write_run(tmp_path, "xf", [MIXED["pass"], MIXED["xfail"]])
    result = gate_run(run)
    assert result.passed
    xf = result.cell(ID["xfail"])
    assert xf.message.endswith(f"[expected: {SSM_LOST} (vllm#49297)]") and xf.message.startswith("xfail: ")


@pytest.mark.parametrize(
    "spec, name, verdict",
    [
        (GateSpec(require_accuracy=False), "missing_accuracy", PASS),
        (GateSpec(require_accuracy=False), "acc_regression", PASS),
        (GateSpec(require_consistency=False), "unreadable", PASS),
        (GateSpec(max_failed_transfers=3), "failed_positive", PASS),
        (GateSpec(max_failed_transfers=2), "failed_positive", FAIL),
        (GateSpec(max_failed_transfers=3), "failed_null", FAIL),  # a missing metric is never within budget
        (GateSpec(require_accuracy=False, require_consistency=False), "no_kv", FAIL),
    ],
)
def test_gate_spec_is_honoured(runs: dict[str, Path], spec: GateSpec, name: str, verdict: str) -> None:
    assert gate_run(runs["mixed"], spec).cell(ID[name]).verdict == verdict


# ---------------------------------------------------------------- fail closed
def test_no_run_json_is_a_user_error(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="run.json missing"):
        gate_run(tmp_path)


def test_run_with_no_cells_fails(tmp_path: Path) -> None:
    run = write_run(tmp_path, "empty", [], MIXED_REJECTED)
    result = gate_run(run)
    assert not result.passed and "no cell was meant to run" in result.problems[0]


def test_cell_that_never_ran_fails(copy_of) -> None:
    run = copy_of("all-pass")
    victim = ID["pass"]
    shutil.rmtree(run / victim)
    assert gate_run(run).cell(victim).reasons == (f"{victim}/status.json: missing (no cell directory: never ran?)",)


def test_planned_cell_missing_from_run_json_fails(copy_of) -> None:
    run = copy_of("all-pass")
    index = layout.read_json(run / layout.RUN_FILE)
    del index["cells"][ID["pass"]]
    layout.write_json(run / layout.RUN_FILE, index)
    r = gate_run(run).cell(ID["pass"])  # found through plan.json, and run.json lacks it: no longer a pass
    assert r.verdict == FAIL and r.reasons == (
        f"the plan is damaged: run.json: cells.{ID['pass']} missing (plan.json cells plans it)",
    )
    shutil.rmtree(run / ID["pass"])
    assert gate_run(run).cell(ID["pass"]).verdict == FAIL


@pytest.mark.parametrize("status", ["running", "interrupted"])
def test_unfinished_status_fails(copy_of, status: str) -> None:
    run = copy_of("all-pass")
    path = run / ID["pass"] / layout.STATUS_FILE
    layout.write_json(path, {**layout.read_json(path), "status": status, "phase": "eval", "reason": None})
    assert gate_run(run).cell(ID["pass"]).reasons == (
        f"{ID['pass']}/status.json: {status} in phase eval: no reason recorded",
    )


def test_nan_value_with_pass_verdict_fails(copy_of) -> None:
    run = copy_of("all-pass")
    path = run / ID["pass"] / layout.ACCURACY_FILE
    path.write_text(path.read_text().replace('"value": 0.8,', '"value": NaN,', 1))
    assert json.loads(path.read_text())  # Python's json reads NaN; the gate must not trust it
    assert gate_run(run).cell(ID["pass"]).reasons == (
        f"{ID['pass']}/accuracy.json: {TASK}: value is NaN (metric missing)",
    )


def test_file_of_another_cell_fails(copy_of) -> None:
    run = copy_of("all-pass")
    a, b = ID["pass"], ID["within_noise"]
    shutil.copy(run / b / CON, run / a / CON)
    assert gate_run(run).cell(a).reasons == (f"{a}/consistency.json: belongs to cell '{b}'",)


def test_consistency_without_prompts_fails(tmp_path: Path) -> None:
    run = write_run(tmp_path, "r", [case(pd("tiny-llama", 1, 1), {CON: {"prompts": []}})])
    assert gate_run(run).cell(ID["pass"]).reasons == (f"{ID['pass']}/consistency.json: no prompts compared",)


def test_newer_schema_fails_the_cell(copy_of) -> None:
    run = copy_of("all-pass")
    path = run / ID["pass"] / layout.TRANSFER_FILE
    path.write_text(json.dumps({**json.loads(path.read_text()), "schema": 99}))
    (reason,) = gate_run(run).cell(ID["pass"]).reasons
    assert reason.startswith(f"{ID['pass']}/transfer.json: unreadable: schema 99 is newer")


# ---------------------------------------------------------------- outputs
def test_junit_one_testcase_per_cell(runs: dict[str, Path], tmp_path: Path) -> None:
    result = gate_run(runs["mixed"])
    root = ET.parse(write_junit(result, tmp_path / "junit.xml")).getroot()
    cases = {c.get("name"): c for c in root.iter("testcase")}
    assert len(cases) == len(list(root.iter("testcase"))) == len(MIXED) + len(MIXED_REJECTED)
    assert {c.get("classname") for c in cases.values()} == {"pdsweep.mixed"}
    for name, (verdict, reasons) in GOLDEN.items():
        el = cases[ID[name]]
        failure, skipped = el.find("failure"), el.find("skipped")
        if verdict == PASS:
            assert failure is None and skipped is None
        elif verdict in (FAIL, XPASS):
            assert skipped is None and failure.get("type") == verdict
            assert failure.get("message") == result.cell(ID[name]).message
        else:
            assert failure is None and skipped.get("message").startswith("xfail: " + reasons[0])
    rejected = cases[REJECTED_ID].find("skipped")
    assert rejected.get("message") == "rejected by rule platform-limit: prefill TP > 2 on cuda: fixture limit"
    suite = root.find("testsuite")
    assert (suite.get("tests"), suite.get("failures"), suite.get("skipped")) == ("20", "13", "2")


def test_junit_escapes_log_tail(runs: dict[str, Path], tmp_path: Path) -> None:
    root = ET.parse(write_junit(gate_run(runs["mixed"]), tmp_path / "junit.xml")).getroot()
    crashed = next(c for c in root.iter("testcase") if c.get("name") == ID["crashed"]).find("failure")
    assert 'ERROR <nixl> prepXferDlist: NOT_FOUND & "remote" descriptor' in crashed.text  # ANSI gone, text intact


def test_summary_lists_every_cell(runs: dict[str, Path], tmp_path: Path) -> None:
    result = gate_run(runs["mixed"])
    text = write_summary(result, tmp_path / "summary.md").read_text()
    assert text.startswith("# Gate: mixed: **FAILED: 5 PASS, 12 FAIL, 1 XFAIL, 1 XPASS, 1 SKIPPED**")
    rows = {line.split(" | ")[0].lstrip("| "): line for line in text.splitlines() if line.startswith("| ")}
    assert set(rows) - {"cell"} == set(ID.values())  # every cell that ran; rejected ones are counted per rule
    assert f"{TASK} 0.790 ±N/A / 0.800±0.050 / 0.800 / p=0.99" in rows[ID["stderr_na"]]
    assert "| pass (short: 100% match) | 220 | 286.1 MiB | 10 | 0/0 |" in rows[ID["pass"]]
    assert "| fail (long: 0% match, diverges at token 0) |" in rows[ID["xfail"]]
    assert "| —/0 |" in rows[ID["failed_null"]]
    assert "max \\|dlogprob\\| 7.1" in rows[ID["xfail"]]  # pipes escaped: the table keeps its columns
    assert all(line.count(" | ") == 9 for line in rows.values())
    assert f"- platform-limit: 1 (e.g. `{REJECTED_ID}`: prefill TP > 2 on cuda: fixture limit)" in text


def test_gate_cli_writes_both_files(copy_of, capsys) -> None:
    """`pdsweep gate RUN`: junit.xml and summary.md default into the run directory."""
    run = copy_of("all-pass")
    assert cli_main(["gate", str(run)]) == 0
    assert "gate: PASSED: 5 PASS, 1 SKIPPED" in capsys.readouterr().out
    suite = ET.parse(run / "junit.xml").getroot().find("testsuite")
    assert suite is not None and (suite.get("tests"), suite.get("failures"), suite.get("skipped")) == ("6", "0", "1")
    assert "PASSED: 5 PASS, 1 SKIPPED" in (run / "summary.md").read_text()


# ---------------------------------------------------------------- holes found in review
def test_missing_or_foreign_cell_json_fails(tmp_path):
    c = pd("tiny-llama", 1, 1)
    run = write_run(tmp_path, "r", [case(c)])
    assert gate_run(run).cell(c.id).verdict == PASS
    (run / c.id / "cell.json").unlink()
    res = gate_run(run).cell(c.id)
    assert res.verdict == FAIL and f"{c.id}/cell.json: missing" in res.reasons
    (run / c.id / "cell.json").write_text('{"schema": 1, "cell": {"id": "other"')  # truncated
    assert gate_run(run).cell(c.id).verdict == FAIL


def test_expected_failure_must_be_seen_failing(tmp_path):
    """XFAIL only when the deployment came up and then failed; a startup crash or a
    cell that never ran proves nothing about the expectation: FAIL."""
    from fixtures.make_runs import crashed

    x = dict(expect_fail=True, expect_reason=SSM_LOST, expect_ref="vllm#49297", expect_match="any")
    ran = pd("kimi-linear", 2, 1, **x)
    startup = pd("kimi-linear", 4, 1, **x)
    ready = pd("kimi-linear", 8, 1, **x)
    never = pd("kimi-linear", 4, 2, **x)
    run = write_run(
        tmp_path,
        "r",
        [
            case(ran, {CON: {"verdict": "fail", "reasons": ["prompt 'long': diverges at 0"]}}),
            case(startup, crashed("start", "prefill-0 exited with code 1 during startup", ["SIGSEGV"])),
            case(ready, crashed("ready", "first request: HTTP 500: AssertionError read_specs", ["assert"])),
            case(never),
        ],
    )
    shutil.rmtree(run / never.id)
    res = gate_run(run)
    assert res.cell(ran.id).verdict == XFAIL
    assert res.cell(ready.id).verdict == XFAIL  # the unfixed assert fires at the first PD request
    assert res.cell(startup.id).verdict == FAIL
    assert "never came up" in res.cell(startup.id).reasons[-1]
    assert res.cell(never.id).verdict == FAIL and not res.passed


def test_cells_the_host_could_not_place_are_not_runnable_listed_loudly(tmp_path):
    """One node can be green: a cell needing more GPUs than the host is NOT-RUNNABLE
    (listed in the headline, summary and JUnit <skipped>, never a pass), FAIL with
    require_all_cells; a run of only such cells fails (nothing was meant to run)."""
    import xml.etree.ElementTree as ET

    from pdsweep.judge.gate import NOT_RUNNABLE
    from pdsweep.report.render import summary_markdown, write_junit

    c, big = pd("kimi-linear", 1, 1), pd("kimi-linear", 8, 4)
    run = write_run(tmp_path, "r", [case(c)], rejected=[(big, "needs-gpus", "needs 12 GPUs, host has 8")])
    res = gate_run(run)
    assert res.cell(big.id).verdict == NOT_RUNNABLE and res.passed
    assert res.cell(c.id).verdict == PASS
    assert res.headline() == "PASSED: 1 PASS, 1 NOT-RUNNABLE"
    assert res.cell(big.id).message == "not runnable here: needs 12 GPUs, host has 8"
    md = summary_markdown(res)
    assert "**1 cell(s) NOT RUNNABLE HERE**" in md and f"- {big.id}: needs 12 GPUs, host has 8" in md
    suite = ET.parse(write_junit(res, tmp_path / "junit.xml")).getroot().find("testsuite")
    assert (suite.get("failures"), suite.get("skipped")) == ("0", "1")
    (skip,) = [t.find("skipped") for t in suite.iter("testcase") if t.get("name") == big.id]
    assert skip.get("message") == "not runnable here: needs 12 GPUs, host has 8"
    strict = gate_run(run, require_all_cells=True)
    assert strict.cell(big.id).verdict == FAIL and not strict.passed
    assert "not run: needs 12 GPUs, host has 8 (gate.require_all_cells)" in strict.cell(big.id).reasons[0]
    only_big = write_run(tmp_path, "r3", [], rejected=[(big, "needs-gpus", "needs 12 GPUs, host has 8")])
    assert not gate_run(only_big).passed and "no cell was meant to run" in gate_run(only_big).problems[0]
    run2 = write_run(tmp_path, "r2", [case(c)], rejected=[(big, "platform-limit", "prefill TP > 1 on cpu")])
    assert gate_run(run2).cell(big.id).verdict == SKIPPED and gate_run(run2).passed


def test_gate_settings_come_from_run_json(tmp_path):
    c = pd("tiny-llama", 1, 1)
    run = write_run(tmp_path, "r", [case(c, {"transfer.json": {"totals": {"failed_transfers": 3}}})])
    assert gate_run(run).cell(c.id).verdict == FAIL
    index = layout.read_json(run / layout.RUN_FILE)
    index["gate"] = GateSpec(max_failed_transfers=5).model_dump()
    layout.write_json(run / layout.RUN_FILE, index)
    assert gate_run(run).cell(c.id).verdict == PASS  # the sweep's own budget, frozen at run time


def test_expected_failure_must_match_its_signature(tmp_path):
    """``match:``: XFAIL only when the failure's signature (reasons, status reason, the failing
    instance's log tail) matches; a failure of another kind is FAIL, never XFAIL."""
    from fixtures.make_runs import crashed

    def x(pattern: str) -> dict:
        return dict(expect_fail=True, expect_reason=SSM_LOST, expect_ref="vllm#49297", expect_match=pattern)

    engine = pd("tiny-mla", 1, 1, **x("triage engine"))
    other = pd("tiny-mla", 2, 1, **x("triage engine"))
    in_log = pd("kimi-linear", 2, 1, **x(r"AssertionError.*len\(read_specs\) == 1"))
    bad_re = pd("kimi-linear", 4, 1, **x("(unclosed"))
    run = write_run(
        tmp_path,
        "r",
        [
            case(
                engine,
                {
                    CON: {
                        "verdict": "fail",
                        "reasons": ["prompt 'short': diverge at 0"],
                        "triage": {"verdict": "engine", "explanation": "decode path differs"},
                    }
                },
            ),
            case(
                other,
                {
                    CON: {
                        "verdict": "fail",
                        "reasons": ["prompt 'short': diverge at 0"],
                        "triage": {"verdict": "transfer", "explanation": "only P->D differs"},
                    }
                },
            ),
            case(
                in_log,
                crashed(
                    "ready",
                    "first request: HTTP 500",
                    ["(Worker pid=1) ERROR pull_worker.py:212 AssertionError: assert len(read_specs) == 1"],
                ),
            ),
            case(bad_re, crashed("ready", "first request: HTTP 500", ["(unclosed"])),
        ],
    )
    res = gate_run(run)
    assert res.cell(engine.id).verdict == XFAIL
    assert res.cell(in_log.id).verdict == XFAIL  # found in the failing instance's log tail
    assert res.cell(other.id).verdict == FAIL and "/triage engine/" in res.cell(other.id).reasons[-1]
    assert res.cell(bad_re.id).verdict == FAIL  # an unusable pattern never matches: fail closed
    assert not res.passed


def test_match_needs_expect_and_a_regex(tmp_path):
    from pdsweep.sweepfile.sweep import load_sweep

    base = "name: x\nplatform: cpu\nmatrix:\n  model: [tiny-llama]\n  include:\n"
    for entry, msg in (
        ("{model: tiny-llama, match: boom}", "needs 'expect: fail'"),
        ("{model: tiny-llama, expect: fail, reason: r, match: '(x'}", "not a regular expression"),
    ):
        p = tmp_path / "s.yaml"
        p.write_text(base + f"    - {entry}\n")
        (tmp_path / "models.yaml").write_text((Path(__file__).parent.parent / "sweeps/models.yaml").read_text())
        with pytest.raises(UserError, match=msg):
            load_sweep(p)
