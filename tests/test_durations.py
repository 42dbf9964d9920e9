"""Measured cell durations (``--durations-from RUN_DIR`` of ``plan``/``validate``/``run``, the
nightly's last green run): the budget check, the shard cut and the dispatch take each cell's
wall time in that run where its record gives one, pdsweep's duration model for the rest, and
say how many came from which (pdsweep.results.celltimes, pdsweep.plan.durations)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from _fakerun import make_sweep
from _fakerun import tok as tok
from _sweepfiles import REPO

from pdsweep.cli import main
from pdsweep.plan.dispatch import Inputs, simulate
from pdsweep.plan.durations import CellClock
from pdsweep.plan.expand import Cell
from pdsweep.plan.schedule import pack
from pdsweep.results.celltimes import CellTime, RunDurations, read_durations

CELLS = ("fake-gqa.ref-tp1.b16.fixed", "fake-gqa.p1d1.b16-16.fixed")  # the fake sweep's
PARETO = REPO / "sweeps" / "cpu-pareto.yaml"
SMOKE = REPO / "sweeps" / "cpu-smoke.yaml"
# results/cpu-pareto-int6 (2026-12-07, the shared 2-core box): status.json duration_s and
# timings.healthy_s of its 6 cells; the run took cells_s 305.8 s, pdsweep's model planned 480 s
INT6 = {
    "tiny-llama.ref-tp1.b32.fixed": (50.9, 30.649),
    "tiny-llama.ref-tp2.b32.fixed": (49.8, 17.494),
    "tiny-llama.p2d1.b32-32.fixed": (56.2, 34.731),
    "tiny-llama.p1d1.b32-32.fixed": (36.6, 19.892),
    "tiny-llama.p1d2.b32-32.fixed": (89.2, 34.188),
    "tiny-llama.p1d1.b32-32.fixed.fault-scramble-kv-1-in-2": (19.9, 6.975),
}


def ok(duration: float, healthy: float | None = None, **more: Any) -> dict[str, Any]:
    """A status.json of a cell that passed in ``duration`` s (its instances up after ``healthy`` s)."""
    timings = {} if healthy is None else {"healthy_s": healthy}
    return {"schema": 1, "status": "ok", "expect_fail": False, "duration_s": duration, "timings": timings, **more}


def write_run(root: Path, cells: dict[str, dict[str, Any] | str | None], platform: str = "cpu") -> Path:
    """A previous run at ``root``: run.json listing ``cells``, each with its status.json (a dict
    as JSON, a str as is: damaged, None: none)."""
    root.mkdir(parents=True)
    index = {"schema": 1, "platform": platform, "cells": {c: {"kind": "pd"} for c in cells}}
    (root / "run.json").write_text(json.dumps(index))
    for cid, st in cells.items():
        if st is None:
            continue
        (root / cid).mkdir()
        (root / cid / "status.json").write_text(st if isinstance(st, str) else json.dumps(st))
    return root


def plan(capsys, sweep: Path, *extra: str, rc: int = 0) -> tuple[dict, str]:
    assert main(["plan", str(sweep), "--no-check-argv", "--format", "json", *extra]) == rc
    out = capsys.readouterr()
    return (json.loads(out.out) if rc == 0 else {}), out.err


def test_each_record_gives_its_wall_time_or_says_why_not(tmp_path):
    run = write_run(
        tmp_path / "prev",
        {
            "a": ok(50.0, 20.0),
            "b": {**ok(9.0), "status": "failed"},
            "c": {**ok(5.0), "status": "failed", "expect_fail": True},
            "d": None,
            "e": "{",
            "f": ok("12"),  # type: ignore[arg-type]
            "g": {**ok(3.0), "status": "running"},
            "h": {**ok(0.0)},
            "p": ok(200.0, 150.0, pairing={"partner": "q", "side": "a"}),
            # an int beyond float's range (a damaged file) is no figure: startup falls back to the wall
            # (math.isfinite raised OverflowError: a traceback from plan --durations-from)
            "x": ok(7.0, 10**400),
        },
    )
    d = read_durations(run)
    assert d.platform == "cpu"
    assert d.cells == {
        "a": CellTime(50.0, 20.0),
        "c": CellTime(5.0, 5.0),
        "p": CellTime(200.0, 150.0, "q"),
        "x": CellTime(7.0, 7.0),
    }
    why = dict(d.unusable)
    assert why.pop("e").startswith(f"{run / 'e' / 'status.json'}: unreadable results file")
    assert why.pop("f").startswith("status.json: duration_s: Input should be a valid number")
    assert why == {
        "b": "failed, not expected to (its wall time ends at the failure)",
        "d": "no status.json",
        "g": "status 'running' (not final: ok, failed)",
        "h": "no duration_s > 0 (got 0.0)",
    }


@pytest.mark.parametrize("cmd", ["plan", "validate", "run"])
def test_a_run_dir_that_is_not_a_run_is_exit_2_naming_it(tmp_path, capsys, cmd):
    empty = tmp_path / "empty"
    empty.mkdir()
    listed = tmp_path / "listed"
    listed.mkdir()
    (listed / "run.json").write_text('{"schema": 1, "cells": ["a"]}')
    cases = {
        tmp_path / "gone": f"--durations-from {tmp_path / 'gone'}: no such run directory",
        empty: f"--durations-from {empty}: not a run (no run.json)",
        listed: f"--durations-from {listed / 'run.json'}: cells: expected a mapping of cell id -> status",
    }
    for path, message in cases.items():
        with pytest.raises(SystemExit) as e:
            main([cmd, str(PARETO), "--durations-from", str(path)])
        assert e.value.code == 2
        assert message in capsys.readouterr().err


def test_plan_takes_int6s_measured_walls_and_says_how_many(tmp_path, capsys):
    """cpu-pareto planned on results/cpu-pareto-int6's own durations (305.8 s real): 302.6 s,
    against the model's 480 s; a damaged record there falls back to the model, saying so."""
    model, _ = plan(capsys, PARETO, "--budget", "10")
    assert model["makespan"]["s"] == 480.0 and model["durations"]["from"] is None
    run = write_run(tmp_path / "int6", {c: ok(*t) for c, t in INT6.items()})
    d, _ = plan(capsys, PARETO, "--budget", "10", "--durations-from", str(run))
    assert d["makespan"]["s"] == 302.6
    assert {p["cell"]: round(p["end_s"] - p["start_s"], 1) for p in d["schedule"]["placements"]} == {
        c: t[0] for c, t in INT6.items()
    }
    assert d["durations"]["line"] == f"6 cells measured in {run}, 0 from pdsweep's duration model"
    assert d["budget"]["line"].startswith(
        f"planned makespan 5 min (303 s, the whole sweep; 6 cells measured in {run}, 0 from pdsweep's duration model)"
    )
    bad = "tiny-llama.p1d2.b32-32.fixed"
    part = write_run(tmp_path / "part", {**{c: ok(*t) for c, t in INT6.items()}, bad: "{"})
    d, _ = plan(capsys, PARETO, "--durations-from", str(part))
    assert d["durations"]["measured"] == 5 and d["durations"]["model"] == 1
    assert list(d["durations"]["unusable"]) == [bad]
    assert d["makespan"]["s"] == round(302.6 - 89.2 + 80.0, 1)  # the model's 80 s for the damaged one
    assert main(["plan", str(PARETO), "--no-check-argv", "--durations-from", str(part)]) == 0
    out = capsys.readouterr().out
    assert f"durations: 5 cells measured in {part}, 1 from pdsweep's duration model (1 with an unusable record" in out
    assert f"  {bad}: pdsweep's duration model ({part / bad / 'status.json'}: unreadable results file" in out


def test_validate_fails_the_budget_on_measured_walls(tmp_path, capsys):
    slow = write_run(tmp_path / "slow", {c: ok(t[0] * 3, t[1]) for c, t in INT6.items()})  # 907.8 s
    assert main(["validate", str(PARETO), "--no-check-argv", "--budget", "10"]) == 0  # the model: 480 s
    capsys.readouterr()
    assert main(["validate", str(PARETO), "--no-check-argv", "--budget", "10", "--durations-from", str(slow)]) == 2
    err = capsys.readouterr().err
    assert f"planned makespan 15 min (908 s, the whole sweep; 6 cells measured in {slow}" in err
    assert "exceeds the budget of 10 min (--budget)" in err
    assert main(["validate", str(PARETO), "--no-check-argv", "--durations-from", str(slow)]) == 0
    assert f"--durations-from {slow}: no budget to check (--budget, or the sweep's budget:)" in capsys.readouterr().out


def test_a_build_pair_counts_its_share_of_the_pairs_wall(tmp_path, capsys):
    """cpu-smoke-20261207-080348: tiny-llama p1d1 fixed + unfixed, measured paired, 232.7 s and
    232.5 s from one start; on CPU the plan places them one after the other and adds the pair's
    41 s: each side (232.7 - 41) / 2, so the pair plans at its measured wall."""
    a, b = "tiny-llama.p1d1.b32-32.fixed", "tiny-llama.p1d1.b32-32.unfixed"
    run = write_run(
        tmp_path / "smoke",
        {
            a: ok(232.7, 186.184, pairing={"partner": b, "side": "a"}),
            b: ok(232.5, 189.522, pairing={"partner": a, "side": "b"}),
        },
    )
    d, _ = plan(capsys, SMOKE, "--durations-from", str(run))
    took = {p["cell"]: p["end_s"] - p["start_s"] for p in d["schedule"]["placements"]}
    assert took[a] == pytest.approx(95.85) and took[b] == pytest.approx(95.85)
    assert took[a] + took[b] + d["pairs"]["overhead_s"] == pytest.approx(232.7)
    assert d["durations"]["measured"] == 2 and d["durations"]["model"] == 27


def test_shards_balance_by_the_measured_durations(tmp_path, capsys):
    whole, _ = plan(capsys, SMOKE)
    ids = [c["id"] for c in whole["cells"]]
    # last night tiny-llama's cells took 10x the model's figure, every other cell a tenth of it
    dur = {c: (800.0 if c.startswith("tiny-llama.") else 8.0) for c in ids}
    run = write_run(tmp_path / "night1", {c: ok(dur[c], dur[c] / 2) for c in ids})

    def loads(*extra: str) -> list[float]:
        parts = [plan(capsys, SMOKE, "--shard", f"{i}/2", *extra)[0] for i in (1, 2)]
        own = [{c["id"] for c in p["cells"]} for p in parts]
        assert not own[0] & own[1] and own[0] | own[1] == set(ids)
        return [sum(dur[c] for c in o) for o in own]

    model, measured = loads(), loads("--durations-from", str(run))
    assert max(measured) < max(model)
    assert max(measured) - min(measured) < max(model) - min(model)


def test_clock_units_pairs_on_gpus_work_and_a_foreign_platform():
    cell = Cell("m", 1, 1, 16, 16, 1, 1, "cuda", "fixed")
    other = Cell("m", 1, 1, 16, 16, 1, 1, "cuda", "unfixed")
    run = RunDurations(Path("r"), "cuda", {cell.id: CellTime(300.0, 200.0, other.id), other.id: CellTime(320.0, 250.0)})
    clock = CellClock(lambda c: 1000.0, "cuda", run)
    assert clock.wall(cell) == 320.0  # GPUs: the pair runs at once, each side holds its GPUs for the pair's wall
    assert clock.work(cell) == 120.0 and clock.work(other) == 70.0
    foreign = CellClock(lambda c: 1000.0, "cpu", run)
    assert foreign.wall(cell) == 1000.0 and foreign.why_model(cell) == "r ran on cuda, this sweep on cpu"
    assert (
        foreign.record([cell])["line"]
        == "0 cells measured in r, 1 from pdsweep's duration model (r ran on cuda, this sweep on cpu)"
    )


def test_the_reuse_dispatch_measures_a_cell_for_its_measured_work():
    a = Cell("m", 1, 1, 16, 16, 1, 1, "cuda", "fixed")
    keys, sizes = {a.id: frozenset({"P", "D"})}, {"P": 1, "D": 1}
    clock = CellClock(lambda c: 420.0, "cuda", RunDurations(Path("r"), "cuda", {a.id: CellTime(100.0, 70.0)}))
    placed, _ = simulate([a], Inputs(keys, sizes, 2, clock.wall, {a.id: frozenset()}, work=clock.work))
    assert [(p.start_s, p.ready_s, p.end_s) for p in placed] == [(0.0, 70.0, 100.0)]


def test_make_nightly_takes_the_last_green_runs_durations(tmp_path):
    def dry(baseline: Path) -> str:
        cmd = ["make", "-n", "-f", str(REPO / "Makefile"), "-C", str(REPO), "nightly", f"BASELINE={baseline}"]
        # not STAMP=Makefile: GNU make remakes a makefile that is a target even under -n, and in a fresh
        # clone pyproject.toml is newer than Makefile, so install-env.sh ran for real (a 60 s timeout)
        cmd += [f"PY={sys.executable}"]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=True).stdout

    green = write_run(tmp_path / "last-green", {"x": ok(1.0)})
    out = dry(green)
    assert (
        f"--durations-from {green}" in out and f"nightly: cell durations measured in {green} (--durations-from" in out
    )
    out = dry(tmp_path / "none")
    assert "--durations-from" not in out
    assert f"cell durations from pdsweep's duration model (no run at BASELINE={tmp_path / 'none'}" in out


def test_run_takes_last_nights_durations_and_records_them(tmp_path, tok, capsys):
    """Two nights of the fake vLLM: night 2's `run --durations-from` night 1 plans on night 1's
    measured walls (plan.json ``durations``, said on stderr)."""
    sweep = make_sweep(tmp_path, tok, matrix="  model: [fake-gqa]\n  tp: [p1d1]\n")
    night = ["run", str(sweep), "--quiet", "--skip-eval", "--no-history", "--out"]
    assert main([*night, str(tmp_path / "night1")]) == 0
    capsys.readouterr()
    assert main([*night, str(tmp_path / "night2"), "--durations-from", str(tmp_path / "night1")]) == 0
    line = f"2 cells measured in {tmp_path / 'night1'}, 0 from pdsweep's duration model"
    assert f"durations: {line}" in capsys.readouterr().err
    planned = json.loads((tmp_path / "night2" / "plan.json").read_text())
    assert planned["durations"]["line"] == line
    walls = {c: json.loads((tmp_path / "night1" / c / "status.json").read_text())["duration_s"] for c in CELLS}
    assert {p["cell"]: round(p["end_s"] - p["start_s"], 1) for p in planned["schedule"]["placements"]} == walls
    first = json.loads((tmp_path / "night1" / "plan.json").read_text())["durations"]
    assert first == {
        "from": None,
        "measured": 0,
        "model": 2,
        "unusable": {},
        "line": "2 cells from pdsweep's duration model",
    }


def test_the_mission_on_8_gpus_dispatches_on_measured_walls(tmp_path, capsys):
    """The reuse dispatch on GPUs (plan --gpus 8, no GPU here): every cell of the mission measured
    at 200 s, its instances up after 150 s, measures 50 s once they answer (the model: eval_s 120 s, 30 s
    for a cell that dies at its first PD request);
    a build pair's two cells, measured at once, each count the pair's wall (the longer side's)."""
    mission = REPO / "sweeps" / "hybrid-mla-mamba.yaml"
    model, _ = plan(capsys, mission, "--gpus", "8")
    partner = {p[s]: p[o] for p in model["pairs"]["pairs"] for s, o in (("a", "b"), ("b", "a"))}
    b_side = {p["b"] for p in model["pairs"]["pairs"]}  # 260 s: the pair's wall, its a side's too
    cells = {
        c["id"]: ok(260.0 if c["id"] in b_side else 200.0, 150.0, pairing={"partner": partner[c["id"]]})
        if c["id"] in partner
        else ok(200.0, 150.0)
        for c in model["cells"]
    }
    run = write_run(tmp_path / "gpu-night", cells, platform="cuda")
    d, _ = plan(capsys, mission, "--gpus", "8", "--durations-from", str(run))
    assert d["durations"]["measured"] == len(cells) and d["durations"]["model"] == 0
    placed = [p for p in d["reuse"]["schedule"]["cells"] if p["cell"] not in partner]
    assert placed and {round(p["end_s"] - p["ready_s"], 1) for p in placed} == {50.0}
    assert {round(p["end_s"] - p["ready_s"], 1) for p in model["reuse"]["schedule"]["cells"]} == {30.0, 120.0}
    gpus = {c["id"]: c["num_gpus"] for c in d["cells"]}
    first = sum(260.0 * (gpus[p["a"]] + gpus[p["b"]]) for p in d["pairs"]["pairs"]) / 8
    assert d["pairs"]["first_s"] == round(first, 1)


def test_the_cells_schedule_runs_the_longest_measured_first():
    """LPT by measured walls (pdsweep.plan.schedule.order): three p1d1 cells on 4 GPUs, the
    model's figures equal; last night the third took twice the others. It goes first: 200 s,
    not the 300 s of the model's order."""
    a, b, c = (Cell(m, 1, 1, 16, 16, 1, 1, "cuda", "fixed") for m in ("m1", "m2", "m3"))
    walls = {a.id: CellTime(100.0, 60.0), b.id: CellTime(100.0, 60.0), c.id: CellTime(200.0, 60.0)}
    clock = CellClock(lambda x: 420.0, "cuda", RunDurations(Path("r"), "cuda", walls))
    got = pack([a, b, c], 4, estimate=clock.wall, rank=clock.rank)
    assert [(p.cell.id, p.start_s, p.end_s) for p in got.placements] == [
        (c.id, 0.0, 200.0),
        (a.id, 0.0, 100.0),
        (b.id, 100.0, 200.0),
    ]
    assert pack([a, b, c], 4, estimate=clock.wall).makespan_s == 300.0  # the model's order: a, b, then c
