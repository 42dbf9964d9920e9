"""The fake-vLLM ``pdsweep run`` harness shared by tests/test_run_fake*.py: a sweep of the fake
model on the fake build interpreter (tests/fake_build/python runs tests/fake_vllm.py for
``vllm serve``), the per-test tokenizer, and the processes a test started."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from _fakes import build_tokenizer

from pdsweep.results import layout

HERE = Path(__file__).resolve().parent
FAKE_PY = HERE / "fake_build" / "python"


@pytest.fixture
def tok(tmp_path) -> Path:
    """Per test, under ``tmp_path``: the model path is in every instance's argv, so
    :func:`ours` finds exactly this test's processes."""
    return build_tokenizer(tmp_path / "tok")


# per test process, so concurrent runs of this file (other checkouts on the host) do not
# answer each other's requests on the same ports; 10000-17999: below the kernel's ephemeral
# ports (32768+) and clear of the fixed bases tests pick (24400-32400; 31000+ made
# test_taken_port_moves_cell_to_free_block's own port 32216 busy in another xdist worker)
PORT_BASE = 10000 + (os.getpid() % 40) * 200


def held_port_claims() -> list[str]:
    """The port-block claims this process still holds (lock files open under
    :func:`pdsweep.deploy.portlocks.lock_dir`): a finished run must hold none."""
    from pdsweep.deploy.portlocks import lock_dir

    d, out = str(lock_dir()), []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith(d + "/"):
            out.append(os.path.basename(target))
    return sorted(out)


def write_models(tmp_path: Path, tok: Path) -> None:
    """``tmp_path/models.yaml``: the fake model ``fake-gqa`` (tests/fake_vllm.py) on ``tok``."""
    (tmp_path / "models.yaml").write_text(f"""models:
  fake-gqa:
    path: {tok}
    architecture: FakeForCausalLM
    attention: gqa
    num_layers: 2
    max_model_len: 256
    serve_args: [--attention-backend, FAKE]  # any block size (CPU_ATTN would refuse 16)
    platforms: {{cpu: {{}}}}
""")


def make_sweep(
    tmp_path: Path,
    tok: Path,
    *,
    matrix: str,
    env: str = "  base: {}",
    port_base: int = PORT_BASE,
    extra: str = "",
    builds: str = "",
) -> Path:
    """A fake-vLLM sweep under ``tmp_path``: model fake-gqa on ``tok``; ``builds``: the
    ``builds:`` body (default: fixed on the fake build interpreter)."""
    write_models(tmp_path, tok)
    consistency = "{max_tokens: 4, lengths: [short, 40]}"
    if "reference: false" in extra:  # no reference: nothing to gate against (pdsweep.run.feasible)
        if "gate:" not in extra:
            extra += "gate: {require_consistency: false, require_accuracy: false}\n"
    p = tmp_path / "sweep.yaml"
    p.write_text(f"""name: fake
platform: cpu
builds:
{builds or f"  fixed: {{python: {FAKE_PY}}}"}
defaults:
  startup_timeout_s: 30
  request_timeout_s: 10
  port_base: {port_base}
env:
{env}
matrix:
{matrix}
eval:
  tasks: [pdsweep_arith]
  limit: 8
  num_concurrent: 2
  max_retries: 0
  timeout_s: 10
  max_gen_toks: 8
  consistency: {consistency}
{extra}""")
    return p


def ours(tmp_path: Path) -> list[psutil.Process]:
    """Fake vLLM processes started for this test (matched on our tmp tokenizer path)."""
    out = []
    for p in psutil.process_iter(["cmdline"]):
        cmd = " ".join(p.info["cmdline"] or [])
        if "fake_vllm.py" in cmd and str(tmp_path) in cmd:
            out.append(p)
    return out


def wait_started(tmp_path: Path, timeout_s: float = 60) -> None:
    """Wait until a fake vLLM process of this test runs (:func:`ours`); fails the test past ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and not ours(tmp_path):
        time.sleep(0.1)
    assert ours(tmp_path), "no fake instance started"


def start_run(sweep: Path, out: Path, *extra: str) -> subprocess.Popen:
    """``python -m pdsweep run SWEEP --out OUT --quiet --skip-eval EXTRA...`` as a process of its
    own (stdout and stderr in one pipe), for tests that signal it."""
    argv = [sys.executable, "-m", "pdsweep", "run", str(sweep), "--out", str(out), "--quiet", "--skip-eval", *extra]
    env = {**os.environ, "PDSWEEP_REAL_PYTHON": sys.executable}
    return subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def status(run: Path, cell: str) -> dict:
    return layout.read_json(run / cell / "status.json")
