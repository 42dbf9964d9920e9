"""Issue 59 leftovers: cell.json's cell record is held to the cell plan.json planned, field by field, and
plan.json's cells to run.json's platform. Before: a CPU PD cell whose cell.json claimed ``platform: cuda``
PASSED without its KV integrity (the gate asks a CPU PD cell for it by its platform), and a record of
another TP or build passed as this cell's."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
from fixtures.make_runs import case, edit, pd, ref, write_run

from pdsweep.judge.gate import FAIL, PASS, gate_run
from pdsweep.results import layout

CPU = dataclasses.replace(pd("tiny-mla-mamba2", 2, 1), platform="cpu", kv_buffer_device="cpu")
MATCHED = {"compared": 6, "matched": 6, "mismatched": 0, "missing": 0, "stale": 0, "first": {}}
W = f"{CPU.id}/{layout.CELL_FILE}"


def _gate(
    tmp_path: Path, cell_json: dict[str, Any] | None = None, run_json: dict[str, Any] | None = None, integrity=MATCHED
):
    """A CPU run (its PD cell's transfer.json ``integrity``: ``integrity``), with cell.json's cell record and
    run.json changed by ``cell_json`` / ``run_json`` (a value None: dropped)."""
    run = write_run(tmp_path, "r", [case(CPU, {layout.TRANSFER_FILE: {"integrity": integrity}}), case(ref(CPU))])
    for path, change in ((run / CPU.id / layout.CELL_FILE, cell_json), (run / layout.RUN_FILE, run_json)):
        for k, v in (change or {}).items():
            if path.name == layout.CELL_FILE:
                edit(path, lambda d, k=k, v=v: d["cell"].update({k: v}))
            else:
                edit(path, lambda d, k=k, v=v: d.pop(k) if v is None else d.update({k: v}))
    g = gate_run(run).cell(CPU.id)
    return g.verdict, [r for r in g.reasons if "platform" in r or "plans" in r]


def test_the_cpu_run_as_planned_passes(tmp_path):
    assert _gate(tmp_path) == (PASS, [])


def test_a_cpu_cell_claiming_cuda_fails_naming_both_platforms(tmp_path):
    """The record says cuda (its kv buffer too, so its id is the planned one) and transfer.json holds no
    integrity, which the plan's CPU PD cell must have: this PASSED."""
    claim = {"platform": "cuda", "kv_buffer_device": "cuda"}
    assert _gate(tmp_path, cell_json=claim, integrity=None) == (
        FAIL,
        [
            f'{W}: cell.kv_buffer_device is "cuda", plan.json plans "cpu"',
            f'{W}: cell.platform is "cuda", plan.json plans "cpu"',
        ],
    )


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({"decode_tp": 2}, f"{W}: cell.decode_tp is 2, plan.json plans 1"),
        ({"build": "unfixed"}, f'{W}: cell.build is "unfixed", plan.json plans "fixed"'),
        ({"expect_match": "."}, f'{W}: cell.expect_match is ".", plan.json plans null'),
    ],
)
def test_a_cell_record_that_is_not_the_planned_cell_fails_naming_both(tmp_path, change, reason):
    verdict, reasons = _gate(tmp_path, cell_json=change)
    assert (verdict, reasons) == (FAIL, [reason])


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({"platform": "cuda"}, 'the plan is damaged: plan.json: cells.0: platform "cpu", run.json platform "cuda"'),
        ({"platform": None}, "the plan is damaged: run.json: platform missing (the sweep's platform, cuda or cpu"),
    ],
)
def test_run_jsons_platform_is_every_planned_cells(tmp_path, change, reason):
    verdict, reasons = _gate(tmp_path, run_json=change)
    assert verdict == FAIL and reasons[0].startswith(reason), reasons
