"""The load phase's ``vllm bench serve`` in this process (pdsweep.measure.benchserve), against
the fake vLLM server: vLLM's own parser, benchmark and result file, no fresh interpreter."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from pdsweep.measure import benchserve

REPO = Path(__file__).resolve().parent.parent
FAKE = REPO / "tests" / "fake_vllm.py"


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def server(tmp_path):
    port = _port()
    proc = subprocess.Popen(
        [sys.executable, str(FAKE), "serve", "fake", "--port", str(port)],
        stdout=open(tmp_path / "server.log", "w"),
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            time.sleep(0.2)
    try:
        yield url
    finally:
        proc.terminate()
        proc.wait(10)


def test_which_builds_run_in_process():
    assert benchserve.in_process_ok(sys.executable)  # this venv has vLLM's benchmark module
    assert not benchserve.in_process_ok(str(REPO / "tests" / "fake_build" / "python"))  # a stand-in: subprocess


def test_a_load_run_in_process_writes_vllms_result_file(server, tmp_path, tokenizer):
    load = benchserve.LoadRun(server, "fake", str(tokenizer), False, 16, 4, 6, 2, tmp_path, "load-c2.json")
    rc, secs = benchserve.run(sys.executable, load, tmp_path / "load-c2.log", 120, in_process=True)
    log = (tmp_path / "load-c2.log").read_text()
    assert rc == 0, log[-3000:]
    assert log.startswith("pdsweep: vllm bench serve in-process: --backend openai")
    fig = benchserve.figures(benchserve.read_result(load), load)
    assert (fig["completed"], fig["errors"], fig["concurrency"], fig["num_prompts"]) == (6, 0, 2, 6)
    assert fig["ttft_ms"]["p50"] > 0 and fig["output_tokens"] == 6 * 4
    assert 0 < fig["duration_s"] < secs


def test_failures_in_process_are_what_the_cli_would_report(tmp_path, tokenizer):
    dead = f"http://127.0.0.1:{_port()}"  # nothing listens: vLLM exits 0 and counts the requests failed
    load = benchserve.LoadRun(dead, "fake", str(tokenizer), False, 16, 4, 2, 1, tmp_path, "x.json")
    rc, _ = benchserve.run(sys.executable, load, tmp_path / "x.log", 120, in_process=True)
    assert rc == 0 and benchserve.figures(benchserve.read_result(load), load)["errors"] == 2
    bad = benchserve.LoadRun(dead, "fake", str(tmp_path / "no-tokenizer"), False, 16, 4, 2, 1, tmp_path, "y.json")
    rc, _ = benchserve.run(sys.executable, bad, tmp_path / "y.log", 120, in_process=True)
    assert rc == 1 and "Traceback" in (tmp_path / "y.log").read_text()  # an exception: exit 1, kept in the log
    assert not (tmp_path / "y.json").exists()


def test_vllm_log_records_go_to_the_phase_log_not_stderr(capsys, tmp_path) -> None:
    """In process, vLLM's warnings (e.g. its dataset's re-encoding note) land in the bench log, as
    they did when `vllm bench serve` was a subprocess; pdsweep's stderr keeps one line per phase."""
    import logging

    from pdsweep.measure.benchserve import vllm_logs_to

    root = logging.getLogger()
    stream = logging.StreamHandler()  # pdsweep's own stderr handler, as the CLI sets it up
    root.addHandler(stream)
    try:
        with open(tmp_path / "bench.log", "w") as logf, vllm_logs_to(logf):
            logging.getLogger("vllm.benchmarks.datasets").warning("there were 4 more tokens than expected")
        logging.getLogger("vllm.other").warning("after the phase")
    finally:
        root.removeHandler(stream)
    assert "there were 4 more tokens" in (tmp_path / "bench.log").read_text()
    err = capsys.readouterr().err
    assert "there were 4 more tokens" not in err and "after the phase" in err


def test_the_cli_ends_without_tritons_leak_report_after_an_in_process_load(tmp_path, tokenizer) -> None:
    """After an in-process load run, the interpreter's finalization prints Triton's nanobind leak
    report (~100 lines on stderr); :func:`pdsweep.cli.exit_now` ends the process after the exit
    handlers and flushed output, without it, with the command's exit code."""
    script = f"""
import atexit, sys
from pathlib import Path
from pdsweep.cli import exit_now
from pdsweep.measure import benchserve
out = Path({str(tmp_path)!r})
load = benchserve.LoadRun("http://127.0.0.1:{_port()}", "fake", {str(tokenizer)!r}, False, 16, 4, 2, 1, out, "x.json")
benchserve.run(sys.executable, load, out / "x.log", 120, in_process=True)
atexit.register(lambda: print("exit handlers ran"))
print("done", end="")
exit_now(7)
"""
    got = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert got.returncode == 7 and got.stdout == "doneexit handlers ran\n", got.stderr[-2000:]
    assert "nanobind" not in got.stderr, got.stderr[-2000:]


def test_bench_goodput_is_vllms_request_goodput(server, tmp_path, tokenizer):
    """bench.goodput goes to vLLM as --goodput; load.json's goodput_req_s is vLLM's own
    request_goodput: every request within a generous SLO (= request throughput), none within 1 us."""
    figs = {}
    for name, slo in (("wide", 60_000.0), ("tight", 0.001)):
        load = benchserve.LoadRun(
            server, "fake", str(tokenizer), False, 16, 4, 6, 2, tmp_path, f"{name}.json", (("ttft", slo), ("e2el", slo))
        )
        assert load.argv()[-3:] == ["--goodput", f"ttft:{slo:g}", f"e2el:{slo:g}"]
        rc, _ = benchserve.run(sys.executable, load, tmp_path / f"{name}.log", 120, in_process=True)
        assert rc == 0, (tmp_path / f"{name}.log").read_text()[-3000:]
        figs[name] = benchserve.figures(benchserve.read_result(load), load)
    assert figs["wide"]["goodput_req_s"] == pytest.approx(figs["wide"]["req_s"])
    assert figs["tight"]["goodput_req_s"] == 0
