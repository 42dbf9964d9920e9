"""``pdsweep run --shard i/n`` against the fake vLLM (tests/fake_vllm.py): two shard jobs run
disjoint cells, and ``gate`` of the two shard directories judges the run as ``gate`` of the
whole sweep run at once; a folded cell (run.json ``folded``) gets its runner's verdict."""

from __future__ import annotations

import sys

import pytest
from _fakerun import make_sweep
from _fakerun import tok as tok

from pdsweep.cli import main
from pdsweep.core.errors import UserError
from pdsweep.judge.gate import FAIL, gate_run
from pdsweep.plan.shards import Shard
from pdsweep.results import layout
from pdsweep.results.shards import merged_view
from pdsweep.run.context import RunOptions
from pdsweep.run.sweep import run_sweep


@pytest.fixture(autouse=True)
def _real_python(monkeypatch):
    monkeypatch.setenv("PDSWEEP_REAL_PYTHON", sys.executable)


def verdicts(result) -> dict[str, tuple[str, tuple[str, ...]]]:
    return {c.cell_id: (c.verdict, c.reasons) for c in result.cells}


def test_gate_of_two_shards_equals_gate_of_the_whole(tmp_path, tok, capsys):
    # two groups: instances of env a and env b differ, each PD cell with its own reference
    sweep = make_sweep(
        tmp_path,
        tok,
        env="  base: {}\n  a: {PDSWEEP_TEST_GROUP: a}\n  b: {PDSWEEP_TEST_GROUP: b}",
        matrix="  model: [fake-gqa]\n  tp: [p1d1]\n  env: [a, b]\n",
        extra="gate: {require_accuracy: false}\n",  # --skip-eval: no lm-eval
    )
    opts = {"quiet": True, "skip_eval": True}
    whole = run_sweep(sweep, RunOptions(out=tmp_path / "whole", **opts))
    shards = [run_sweep(sweep, RunOptions(out=tmp_path / f"s{i}", shard=Shard(i, 2), **opts)) for i in (1, 2)]
    cells = [set(layout.read_json(s / layout.RUN_FILE)["cells"]) for s in shards]
    assert cells[0] and cells[1] and not cells[0] & cells[1]
    assert cells[0] | cells[1] == set(layout.read_json(whole / layout.RUN_FILE)["cells"])
    assert layout.read_json(shards[1] / layout.RUN_FILE)["shard"] == {"index": 2, "count": 2, "cells": 2, "of": 4}
    want = gate_run(whole)
    got = gate_run(merged_view(shards[::-1]))  # in any order
    assert want.passed, [c.message for c in want.failures]
    assert got.passed and want.counts == got.counts == {**want.counts, "PASS": 4}
    assert verdicts(got) == verdicts(want)
    assert main(["gate", str(shards[0]), str(shards[1])]) == 0
    assert "gate: PASSED: 4 PASS" in capsys.readouterr().out
    view = shards[0].with_name("s1.shards")  # named after shard 1, in whatever order they come
    assert main(["compare", str(whole), f"{shards[1]},{shards[0]}"]) == 0
    assert "**NO REGRESSION**: 4 same" in (view / layout.COMPARE_MD).read_text()
    assert main(["report", str(shards[1]), str(shards[0])]) == 0
    assert "| fake-gqa.p1d1.b16-16.fixed.env-b | pd | PASS |" in (view / layout.REPORT_MD).read_text()
    # fail closed: a shard missing or given twice is not the run
    with pytest.raises(UserError, match=r"expected 1\.\.2 once each; missing \[2\], repeated \[1\]"):
        merged_view([shards[0], shards[0]])
    with pytest.raises(UserError, match="shard: missing"):
        merged_view([shards[0], whole])


def test_folded_cell_gets_its_runners_verdict(tmp_path, tok):
    sweep = make_sweep(
        tmp_path, tok, matrix="  model: [fake-gqa]\n  tp: [p1d1]\n", extra="gate: {require_accuracy: false}\n"
    )
    run = run_sweep(sweep, RunOptions(out=tmp_path / "run", quiet=True, skip_eval=True))
    index = layout.read_json(run / layout.RUN_FILE)
    assert index["folded"] == {}
    runner, alias = "fake-gqa.p1d1.b16-16.fixed", "fake-gqa.p1d1.b32-32.fixed"
    layout.write_json(run / layout.RUN_FILE, {**index, "folded": {alias: runner}})
    res = gate_run(run)
    assert res.cell(alias).verdict == res.cell(runner).verdict == "PASS"
    assert res.cell(alias).reasons == (
        f"judged as {runner}, which ran for it (folded: the same deployment after vLLM's block arithmetic)",
    )
    assert [c.cell_id for c in res.cells].index(alias) == [c.cell_id for c in res.cells].index(runner) + 1
    layout.write_json(run / layout.RUN_FILE, {**index, "folded": {alias: "fake-gqa.p1d1.b8-8.fixed"}})
    res = gate_run(run)
    assert res.cell(alias).verdict == FAIL and not res.passed
    assert res.cell(alias).reasons == ("folded into fake-gqa.p1d1.b8-8.fixed, which has no result in this run",)
