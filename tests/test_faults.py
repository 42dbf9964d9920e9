"""pdsweep.core.faults: one vocabulary for every fault pdsweep injects. The sweep schema's
``fault`` axis takes exactly its sweep faults, the kill drills take their phase and target from
it, and every sweep's kill-drill cell declares the failure signature it names."""

from __future__ import annotations

import re
import subprocess
import time
from dataclasses import replace
from pathlib import Path

import pytest

from pdsweep.core.errors import UserError
from pdsweep.core.faults import (
    FAKE_FAULTS,
    KILL_DECODE_DURING_LOAD,
    KILL_PREFILL_DURING_EVAL,
    LEASE_EXPIRY,
    PROXY_OPTIONS,
    SWEEP_FAULTS,
    WHERE,
    ProxyFaults,
    sweep_fault,
)
from pdsweep.deploy.launchers import Handle
from pdsweep.plan.expand import expand
from pdsweep.run.drills import armed
from pdsweep.sweepfile.sweep import load_sweep

REPO = Path(__file__).resolve().parent.parent


def _sweep(tmp_path: Path, fault: str) -> Path:
    (tmp_path / "models.yaml").write_text((REPO / "sweeps" / "models.yaml").read_text())
    p = tmp_path / "s.yaml"
    p.write_text(f"name: s\nplatform: cpu\nmatrix:\n  model: [tiny-llama]\n  tp: [p1d1]\n  fault: [{fault}]\n")
    return p


def test_every_fault_says_where_it_acts_and_the_schema_takes_exactly_the_sweep_faults(tmp_path: Path) -> None:
    assert {k.where for k in SWEEP_FAULTS.values()} == set(WHERE) - {"fake"}  # pdsweep injects in each place
    assert {k.where for k in FAKE_FAULTS.values()} == {"fake"}
    assert {k.where for k in PROXY_OPTIONS.values()} == {"proxy"}
    assert set(PROXY_OPTIONS) == {f for f in ProxyFaults.__dataclass_fields__ if f != "decode_delay_every"}
    names = [KILL_PREFILL_DURING_EVAL, KILL_DECODE_DURING_LOAD, LEASE_EXPIRY, "fail-read-1-in-7", "none"]
    assert [load_sweep(_sweep(tmp_path, n)).sweep.matrix.fault for n in names] == [[n] for n in names]
    assert sweep_fault("fail-read-1-in-7") is SWEEP_FAULTS["fail-read-1-in-K"]
    for bad in ("kill-everything", "fail-read-1-in-0", "drop_kv_transfer_params"):
        with pytest.raises(UserError, match=rf"matrix\.fault\[0\]: .*unknown fault '{bad}' \(allowed: none, kill-"):
            load_sweep(_sweep(tmp_path, bad))


def _dies_within(proc: subprocess.Popen, seconds: float) -> bool:
    end = time.monotonic() + seconds
    while time.monotonic() < end and proc.poll() is None:
        time.sleep(0.05)
    return proc.poll() is not None


def test_kill_drill_takes_its_phase_and_target_from_the_vocabulary(tmp_path: Path, monkeypatch) -> None:
    kind = SWEEP_FAULTS[KILL_PREFILL_DURING_EVAL]
    monkeypatch.setitem(SWEEP_FAULTS, KILL_PREFILL_DURING_EVAL, replace(kind, phase="consistency", target="decode-0"))
    decode = subprocess.Popen(["sleep", "60"])
    prefill = subprocess.Popen(["sleep", "60"])
    try:
        handles = [
            Handle(n, p.pid, 1, tmp_path / f"{n}.log", proc=p)
            for n, p in (("prefill-0", prefill), ("decode-0", decode))
        ]
        hook = armed(KILL_PREFILL_DURING_EVAL, handles, lambda p: None)
        hook("eval")  # no longer this drill's phase
        assert not _dies_within(decode, 1.5) and prefill.poll() is None
        hook("consistency")
        assert _dies_within(decode, 3.0) and decode.returncode == -9
        assert prefill.poll() is None  # the vocabulary's target, not the name's
    finally:
        for p in (decode, prefill):
            p.kill()
            p.wait()
    for name in (LEASE_EXPIRY, "fail-read-1-in-4", "none"):  # injected by the proxy / decode's vLLM
        on_phase = print
        assert armed(name, [], on_phase) is on_phase


def test_sweeps_declare_the_vocabulary_signature_of_each_kill_drill() -> None:
    seen = set()
    for path in sorted((REPO / "sweeps").glob("*.yaml")):
        if path.name == "models.yaml":
            continue
        for cell in expand(load_sweep(path)).cells:
            kind = sweep_fault(cell.fault)
            if kind is not None and kind.where == "drill":
                assert cell.expect_fail and cell.expect_match == kind.expects, (path.name, cell.id)
                seen.add(cell.fault)
    assert seen == {KILL_PREFILL_DURING_EVAL, KILL_DECODE_DURING_LOAD}


def test_the_fake_vllm_knobs_that_misbehave_are_the_vocabularys_fake_faults() -> None:
    src = (REPO / "tests" / "fake_vllm.py").read_text()
    read = set(re.findall(r"""environ(?:\.get\(|\[)["'](FAKE_[A-Z_]+)["']""", src))  # the knobs the fake reads
    not_faults = {
        "FAKE_STARTUP_S",
        "FAKE_BIND_AFTER_S",
        "FAKE_READY_FILE",
        "FAKE_LIFE_LOG",
        "FAKE_SIGKILL_ROLE",
        "FAKE_MODEL_KINDS",
    }
    assert read - not_faults == set(FAKE_FAULTS)
    documented = set(re.findall(r"\b(FAKE_[A-Z_]+[A-Z])\b", src.split('"""')[1]))  # its docstring's list
    assert set(FAKE_FAULTS) <= documented


def test_pdsweep_run_options_carry_every_proxy_option_to_the_proxy() -> None:
    from pdsweep.run.sweep import RunOptions

    on = {
        "drop_kv_transfer_params": True,
        "scramble_kv_block_ids": True,
        "scramble_every": 3,
        "stale_kv_transfer_params": True,
        "decode_delay_s": 0.5,
    }
    assert set(on) == set(PROXY_OPTIONS)
    f = RunOptions(**on).faults
    assert {k: getattr(f, k) for k in on} == on and f.active
    assert not RunOptions().faults.active
