"""Every failure names the instance and how it ended (pdsweep.deploy.deployment.ended/blame): an
instance killed mid-phase fails its cell with ``<role>-0 (pid N) killed by signal 9 (SIGKILL)
during <phase>; <the phase's own error>``, against the fake vllm serve (tests/fake_vllm.py)."""

from __future__ import annotations

import re

import pytest
from test_run_fake import make_sweep, ours, status, tok  # noqa: F401  (tok: the fixture)

from pdsweep.run.context import RunOptions
from pdsweep.run.sweep import run_sweep


@pytest.mark.parametrize(("role", "name"), [("kv_producer", "prefill-0"), ("kv_consumer", "decode-0")])
def test_instance_killed_during_eval_is_named_with_pid_and_signal(tmp_path, tok, role, name):  # noqa: F811
    sweep = make_sweep(
        tmp_path,
        tok,
        env=f"  base: {{}}\n  kill: {{FAKE_SIGKILL_AFTER: '3', FAKE_SIGKILL_ROLE: {role}}}",
        matrix="  model: [fake-gqa]\n  tp: [p1d1]\n  env: [kill]\n",
        extra="  reference: false\ngate: {require_consistency: false, require_accuracy: false}\n",
    )
    run = run_sweep(sweep, RunOptions(out=tmp_path / "run", quiet=True))
    st = status(run, "fake-gqa.p1d1.b16-16.fixed.env-kill")
    assert st["status"] == "failed" and st["phase"] == "eval", st
    assert re.match(rf"{name} \(pid \d+\) killed by signal 9 \(SIGKILL\) during eval; \S", st["reason"]), st["reason"]
    assert not ours(tmp_path)


def test_kill_prefill_drill_cell_is_xfail_naming_the_instance(tmp_path, tok, monkeypatch):  # noqa: F811
    # issue 27: a fault drill is a cell the user writes (the `fault` axis), on instances of its own
    from pdsweep.judge.gate import XFAIL, gate_run

    match = r"prefill-0 \(pid \d+\) killed by signal 9 \(SIGKILL\) during eval; "
    sweep = make_sweep(
        tmp_path,
        tok,
        matrix=(
            "  model: [fake-gqa]\n  tp: [p1d1]\n  fault: [none]\n  include:\n"
            f"    - {{model: fake-gqa, tp: p1d1, fault: kill-prefill-during-eval, expect: fail, match: '{match}', reason: drill}}\n"
        ),
        extra="  reference: false\ngate: {require_consistency: false, require_accuracy: false}\n",
    )
    run = run_sweep(sweep, RunOptions(out=tmp_path / "run", quiet=True))
    drill, plain = "fake-gqa.p1d1.b16-16.fixed.fault-kill-prefill-during-eval", "fake-gqa.p1d1.b16-16.fixed"
    st = status(run, drill)
    assert st["status"] == "failed" and st["phase"] == "eval" and re.match(match, st["reason"]), st
    assert status(run, plain)["status"] == "ok"  # the plain cell's prefill is another process
    res = gate_run(run)
    assert res.cell(drill).verdict == XFAIL and res.cell(plain).verdict == "PASS", res.cells
    assert not ours(tmp_path)
