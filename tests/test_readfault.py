"""The READ-failure drill (fault ``fail-read-1-in-K``): the engine wrapper that reports every
K-th completed NIXL READ as failed, the log counts, the sweep axis and the transfer gate's
accounting of injected failures."""

from __future__ import annotations

import logging

import pytest
from fixtures.make_runs import case, pd, write_run

from pdsweep.builds.fixprobes import accounting
from pdsweep.core.errors import UserError
from pdsweep.core.faults import read_fault_every
from pdsweep.core.logscan import read_fault_counts
from pdsweep.engine.readfault import wrap_check_xfer_state
from pdsweep.judge.gate import FAIL, PASS, XFAIL, XPASS, gate_run

# vLLM's own log lines (v1/core/sched/scheduler.py _handle_invalid_blocks), as printed
RECOVERED = "WARNING 12-03 08:01:02 [scheduler.py:3394] Recovered from KV load failure: 2 request(s) rescheduled (64 tokens affected)."
FAILED = (
    "ERROR 12-03 08:01:02 [scheduler.py:3384] Failing 1 request(s) due to KV load failure "
    "(failure_policy=fail, 32 tokens affected). Request IDs: {'cmpl-1'}"
)


def test_every_kth_done_read_is_reported_err_and_logged(caplog: pytest.LogCaptureFixture) -> None:
    states = iter(["PROC", "DONE", "DONE", "PROC", "DONE", "DONE", "DONE", "DONE", "ERR"])
    check = wrap_check_xfer_state(lambda self, handle: next(states), every=3)
    with caplog.at_level(logging.WARNING, logger="vllm.pdsweep.engine.readfault"):
        seen = [check(None, h) for h in range(9)]
    # DONE number 3 and 6 become ERR; PROC and NIXL's own ERR pass through
    assert seen == ["PROC", "DONE", "DONE", "PROC", "ERR", "DONE", "DONE", "ERR", "ERR"]
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert read_fault_counts(text) == {"injected": 2, "failed_loads": 0, "recovered_reqs": 0, "failed_reqs": 0}
    with pytest.raises(ValueError, match="every must be >= 1"):
        wrap_check_xfer_state(lambda self, handle: "DONE", every=0)


def test_read_fault_counts_reads_vllm_scheduler_lines() -> None:
    text = "\n".join([RECOVERED, RECOVERED, FAILED, "PDSWEEP_INJECTED_READ_FAILURE read=4 every=4"])
    assert read_fault_counts(text) == {"injected": 1, "failed_loads": 0, "recovered_reqs": 4, "failed_reqs": 1}
    assert read_fault_counts("") == {"injected": 0, "failed_loads": 0, "recovered_reqs": 0, "failed_reqs": 0}


def test_failed_loads_count_the_requests_vllm_recomputes_without_a_log_line() -> None:
    """vLLM 0.32's NIXL worker logs each failed READ's request once per failed transfer
    (nixl/base_worker.py); the scheduler's failed_recving path recomputes it silently, so
    "Recovered from KV load failure" never shows: the distinct request ids are the count."""
    skip = "WARNING base_worker.py:2916] Skipping KV post-processing for failed request cmpl-{}-0"
    text = "\n".join([skip.format("a"), skip.format("b"), skip.format("a")])
    assert read_fault_counts(text)["failed_loads"] == 2
    assert read_fault_counts(text)["recovered_reqs"] == 0


def test_fault_axis_takes_fail_read_1_in_k_and_refuses_k_0(tmp_path) -> None:
    from pdsweep.sweepfile.sweep import load_sweep

    assert [read_fault_every(f) for f in ("fail-read-1-in-4", "none", "fail-read-1-in-0", None)] == [
        4,
        None,
        None,
        None,
    ]
    (tmp_path / "models.yaml").write_text(open("sweeps/models.yaml").read())
    good = tmp_path / "good.yaml"
    good.write_text(
        "name: d\nplatform: cpu\nmatrix:\n  model: [tiny-llama]\n  tp: [p1d1]\n  fault: [fail-read-1-in-4]\n"
    )
    assert load_sweep(good).sweep.matrix.fault == ["fail-read-1-in-4"]
    bad = tmp_path / "bad.yaml"
    bad.write_text(good.read_text().replace("1-in-4", "1-in-0"))
    with pytest.raises(UserError, match=r"bad\.yaml.*matrix\.fault.*fail-read-1-in-0"):
        load_sweep(bad)


def test_decode_alone_gets_the_fault_env() -> None:
    from pdsweep.plan.expand import expand
    from pdsweep.plan.instance import Slot, instances
    from pdsweep.sweepfile.sweep import load_sweep

    ls = load_sweep("sweeps/cpu-smoke.yaml")
    cells = {c.id: c for c in expand(ls).cells}

    def envs(cid: str) -> dict[str, dict[str, str]]:
        return {s.name: s.env for s in instances(cells[cid], Slot(0, (), 20000), ls, "/m", "python")}

    drill = envs("tiny-llama.p1d1.b32-32.fixed.kv-recompute.fault-fail-read-1-in-4")
    assert drill["decode-0"]["PDSWEEP_FAIL_READ_EVERY"] == "4"
    assert "PDSWEEP_FAIL_READ_EVERY" not in drill["prefill-0"]
    assert all("PDSWEEP_FAIL_READ_EVERY" not in e for e in envs("tiny-llama.p1d1.b32-32.fixed").values())


def _faults(injected: int, failed: int, recovered: int = 0, failed_reqs: int = 0) -> dict:
    return {
        "transfer.json": {
            "totals": {"failed_transfers": failed, "num_transfers": 200 - failed, "kv_requests": 200},
            "read_faults": {"injected": injected, "recovered_reqs": recovered, "failed_reqs": failed_reqs},
        }
    }


UNPROBED = accounting(None)  # the fixture's cell.json build has no fix probes


def test_transfer_gate_holds_vllm_to_the_injected_failures(tmp_path) -> None:
    drill = pd("tiny-llama", 1, 1, fault="fail-read-1-in-4")
    ok = case(drill, _faults(injected=50, failed=50, recovered=50))
    run = write_run(tmp_path, "ok", [ok])
    assert gate_run(run).cell(drill.id).verdict == PASS  # counted, recomputed, not silent

    def reasons(name: str, patch: dict, cell=drill) -> list[str]:
        g = gate_run(write_run(tmp_path, name, [case(cell, patch)])).cell(cell.id)
        assert g.verdict == FAIL
        return [r for r in g.reasons if "transfer.json" in r]

    assert reasons("unseen", _faults(injected=50, failed=49)) == [
        f"{drill.id}/transfer.json: vLLM counted 49 failed transfers for 50 injected READ failures "
        f"(vllm:nixl_num_failed_transfers; {UNPROBED}): a failed READ went unseen"
    ]
    assert reasons("extra", _faults(injected=50, failed=51)) == [
        f"{drill.id}/transfer.json: totals.failed_transfers = 51 (allowed: 50; {UNPROBED})"
    ]
    (none,) = reasons("none", _faults(injected=0, failed=0))
    assert "fault drill fail-read-1-in-4 injected no READ failure" in none
    assert reasons("fail", _faults(injected=50, failed=50, failed_reqs=3)) == [
        f"{drill.id}/transfer.json: decode failed 3 request(s) after a KV load failure "
        "(kv_load_failure_policy: fail; vLLM v1/core/sched/scheduler.py _handle_invalid_blocks)"
    ]
    # outside a drill nothing is injected: any failed transfer still fails (gate.max_failed_transfers 0)
    plain = pd("tiny-llama", 2, 2)
    assert reasons("plain", _faults(injected=0, failed=1), plain) == [
        f"{plain.id}/transfer.json: totals.failed_transfers = 1 (allowed: 0; {UNPROBED})"
    ]


def test_fail_policy_drill_is_xfail_when_the_gate_names_the_failed_requests(tmp_path) -> None:
    drill = pd(
        "tiny-llama",
        1,
        1,
        fault="fail-read-1-in-4",
        expect_fail=True,
        expect_reason="fault drill",
        expect_ref="pdsweep/engine/readfault.py",
        expect_match=r"failed \d+ request\(s\) after a KV load failure",
    )
    run = write_run(tmp_path, "x", [case(drill, _faults(injected=50, failed=50, failed_reqs=50))])
    assert gate_run(run).cell(drill.id).verdict == XFAIL
    run = write_run(tmp_path, "y", [case(drill, _faults(injected=50, failed=50, recovered=50))])
    res = gate_run(run)  # it passed: an expected failure that did not happen fails the gate
    assert res.cell(drill.id).verdict == XPASS and not res.passed


def test_a_phase_error_names_decode_requests_failed_after_a_kv_load_failure(tmp_path) -> None:
    """Nothing died, so the error alone would stand (``lm-eval: 500``); the cause is in decode's log."""
    from pdsweep.deploy.deployment import blame
    from pdsweep.deploy.launchers import Handle

    log = tmp_path / "decode-0.log"
    log.write_text(FAILED.replace("Failing 1", "Failing 5") + "\n")  # an earlier process, before log_start
    start = log.stat().st_size
    with log.open("a") as f:
        f.write(f"{FAILED}\n{FAILED}\n")
    handles = [Handle("prefill-0", 11, 1, tmp_path / "p.log"), Handle("decode-0", 12, 2, log, log_start=start)]
    err = blame("eval", RuntimeError("lm-eval: 500 Internal Server Error"), handles)
    assert err is not None and err.reason == (
        "decode-0 (pid 12) failed 2 request(s) after a KV load failure (kv_load_failure_policy: fail) "
        "during eval; RuntimeError: lm-eval: 500 Internal Server Error"
    )
    log.write_text("")
    assert blame("eval", RuntimeError("x"), handles) is None
