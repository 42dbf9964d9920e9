"""The scrambled-KV drill fails on integrity, not only on answers (issue 58): the PD proxy reverses every
decode leg's ``remote_block_ids`` (``ProxyFaults.scramble_kv_block_ids``), decode reads prefill's bytes in
the wrong order, and the gate names the misplaced block next to the consistency failure. Fake vLLM
(tests/fake_vllm.py speaks pdsweep.engine.kvdigest's lines, the READ's order included); the real cell is
tests/test_integration_cpu.py ``test_scrambled_kv_fails_the_accuracy_gate`` (nightly)."""

from __future__ import annotations

import re
import sys

from _fakerun import make_sweep, ours
from _fakerun import tok as tok

from pdsweep.core.faults import PROXY_OPTIONS
from pdsweep.judge.gate import FAIL, gate_run
from pdsweep.results import layout
from pdsweep.run.context import RunOptions
from pdsweep.run.sweep import run_sweep

PD = "fake-gqa.p1d1.b16-16.fixed"


def test_scrambled_kv_fails_on_integrity_naming_the_misplaced_block(tmp_path, tok, monkeypatch):
    monkeypatch.setenv("PDSWEEP_REAL_PYTHON", sys.executable)
    sweep = make_sweep(tmp_path, tok, matrix="  model: [fake-gqa]\n  tp: [p1d1]\n")
    run = run_sweep(sweep, RunOptions(out=tmp_path / "run", quiet=True, skip_eval=True, scramble_kv_block_ids=True))
    integ = layout.read_json(run / PD / "transfer.json")["integrity"]
    # every transferred request (4 in the probe's phase) had its two blocks swapped: 8 blocks, none matched
    assert (integ["requests"], integ["compared"], integ["matched"], integ["mismatched"], integ["misplaced"]) == (
        4,
        8,
        0,
        8,
        8,
    ), integ
    first = integ["first"]["misplaced"]
    assert (first["group"], first["prefill_rank"], first["block"], first["read_instead"], first["position"]) == (
        "0:kv",
        0,
        1,
        2,
        0,
    )
    g = gate_run(run).cell(PD)
    assert g.verdict == FAIL
    joined = "; ".join(g.reasons)
    assert re.search(PROXY_OPTIONS["scramble_kv_block_ids"].expects, joined), g.reasons  # answers and integrity
    assert not ours(tmp_path)
