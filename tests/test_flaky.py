"""FLAKY (pdsweep.judge.flaky): a cell that passed only after a ready_retries redeploy is its
own verdict in the gate, summary, JUnit (one <flakyFailure> per attempt) and compare; it
fails `pdsweep gate --nightly` by default and a plain gate (make sweep) only when asked."""

from __future__ import annotations

import xml.etree.ElementTree as ET
from pathlib import Path

from fixtures.make_runs import ST, case, pd, write_run

from pdsweep.cli import main as cli_main
from pdsweep.judge.compare import REGRESSION, compare_results
from pdsweep.judge.flaky import FLAKY
from pdsweep.judge.gate import FAIL, PASS, gate_run
from pdsweep.report.render import summary_markdown, write_junit
from pdsweep.sweepfile.gatespec import GateSpec

HANG = "first request timed out after 120 s with every instance alive (ReadyHang)"
RETRIES = {ST: {"retries": [{"phase": "ready", "reason": HANG, "log_tail": ["decode-0: no shm block"]}]}}
CELL = pd("tiny-llama", 2, 1)


def _run(tmp_path: Path, name: str, *patches) -> Path:
    return write_run(tmp_path, name, [case(CELL, *patches)])


def test_pass_after_a_redeploy_is_flaky_and_fails_only_the_nightly(tmp_path):
    run = _run(tmp_path, "r", RETRIES)
    res = gate_run(run)
    c = res.cell(CELL.id)
    assert c.verdict == FLAKY and c.checks_passed
    assert c.reasons == ("passed on attempt 2 after 1 redeploy", f"attempt 1: ready: {HANG}")
    assert res.passed and res.headline() == "PASSED: 1 FLAKY"  # make sweep: flaky_fails_sweep false
    nightly = gate_run(run, nightly=True)
    assert not nightly.passed and [f.cell_id for f in nightly.failures] == [CELL.id]
    assert gate_run(run, GateSpec(flaky_fails_nightly=False), nightly=True).passed  # the sweep decides
    assert not gate_run(run, GateSpec(flaky_fails_sweep=True)).passed
    assert gate_run(_run(tmp_path, "clean")).cell(CELL.id).verdict == PASS  # no retries: a plain PASS


def test_failure_after_redeploys_stays_fail(tmp_path):
    crash = {ST: {"status": "failed", "phase": "eval", "reason": "decode-0 exited with code -9"}}
    c = gate_run(_run(tmp_path, "r", RETRIES, crash)).cell(CELL.id)
    assert c.verdict == FAIL and len(c.attempts) == 1


def test_junit_has_each_attempt_and_fails_flaky_on_the_nightly(tmp_path):
    run = _run(tmp_path, "r", RETRIES)
    for nightly, failures in ((False, "0"), (True, "1")):
        root = ET.parse(write_junit(gate_run(run, nightly=nightly), tmp_path / f"j{nightly}.xml")).getroot()
        tc = next(root.iter("testcase"))
        flaky = tc.findall("flakyFailure")
        assert [f.get("message") for f in flaky] == [f"attempt 1: ready: {HANG}"]
        assert flaky[0].text == "decode-0: no shm block"
        assert root.find("testsuite").get("failures") == failures
        failure = tc.find("failure")
        if nightly:
            assert failure.get("type") == FLAKY and failure.get("message").startswith("flaky: passed on attempt 2")
        else:
            assert failure is None and tc.find("system-out").text.startswith("flaky: passed on attempt 2")


def test_summary_and_compare_show_flaky(tmp_path):
    a, b = gate_run(_run(tmp_path, "a")), gate_run(_run(tmp_path, "b", RETRIES))
    row = next(line for line in summary_markdown(b).splitlines() if line.startswith(f"| {CELL.id} "))
    assert f"| {FLAKY} |" in row and "flaky: passed on attempt 2 after 1 redeploy" in row
    cmp = compare_results(a, b).cells[0]
    assert cmp.verdict == REGRESSION and cmp.reasons[0].startswith("now FLAKY: passed on attempt 2")
    back = compare_results(b, a).cells[0]
    assert "no longer FLAKY: passed without a redeploy" in back.reasons


def test_cli_gate_nightly_exit_code(tmp_path, capsys):
    run = _run(tmp_path, "r", RETRIES)
    assert cli_main(["gate", str(run)]) == 0
    assert cli_main(["gate", str(run), "--nightly"]) == 1
    assert "FAILED: 1 FLAKY" in capsys.readouterr().err
