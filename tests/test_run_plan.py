"""One plan of a run (pdsweep.run.runplan): the schedule ``pdsweep run`` follows is the one
``pdsweep plan`` prints. Each test bends the plan (a run order no derivation of its own would
give) and runs the sweep with a ``run_cell`` that records instead of deploying (no instance
starts): a run that took its order anywhere but from the RunPlan would not follow the bend."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pdsweep.plan.dispatch import simulate
from pdsweep.plan.shards import Shard
from pdsweep.run import pairs as pairs_mod
from pdsweep.run import runplan
from pdsweep.run import sweep as run_sweep_mod
from pdsweep.run.context import RunOptions
from pdsweep.run.dryrun import plan_dict
from pdsweep.run.gpureuse import record
from pdsweep.run.runplan import EXECUTORS

REPO = Path(__file__).resolve().parents[1]
SMOKE, MISSION = REPO / "sweeps" / "cpu-smoke.yaml", REPO / "sweeps" / "hybrid-mla-mamba.yaml"


@pytest.fixture
def no_side_effects(monkeypatch):
    """No checkpoint built, no judge pass: the run plans and executes only."""
    monkeypatch.setattr(run_sweep_mod, "prebuild_checkpoints", lambda ls, cells: ({}, {}))
    monkeypatch.setattr(run_sweep_mod, "judge_run", lambda *a: None)


def test_run_follows_the_reuse_order_plan_printed_on_cpu(tmp_path, monkeypatch, no_side_effects):
    real, unbent = runplan.reuse_order, []

    def bent(cells, keys):  # references first, then the PD cells backwards
        got = real(cells, keys)
        unbent.append([c.id for c in got])
        return [c for c in got if c.kind == "ref"] + [c for c in reversed(got) if c.kind != "ref"]

    monkeypatch.setattr(runplan, "reuse_order", bent)
    printed = plan_dict(str(SMOKE), 0)
    ran: list[str] = []
    monkeypatch.setattr(run_sweep_mod, "run_cell", lambda ctx, cell, slot, on_ready=None: ran.append(cell.id))
    paired: list[str] = []  # the build pair runs first, both cells at once (pdsweep.run.pairs)
    monkeypatch.setattr(pairs_mod, "run_cell", lambda ctx, cell, slot, on_ready, side: paired.append(cell.id))
    run = run_sweep_mod.run_sweep(SMOKE, RunOptions(out=tmp_path / "run", quiet=True, skip_eval=True))
    plan_json = json.loads((run / "plan.json").read_text())
    order = printed["reuse"]["order"]
    assert sorted(paired) == sorted(order[:2]) == ["tiny-llama.p1d1.b32-32.fixed", "tiny-llama.p1d1.b32-32.unfixed"]
    assert unbent[0] != order[2:] and sorted(unbent[0]) == sorted(ran)  # the bend shows
    assert ran == order[2:] and order == plan_json["reuse"]["order"] and len(ran) > 20
    assert plan_json["reuse"] == printed["reuse"] and plan_json["schedule"] == printed["schedule"]


def test_run_dispatches_in_the_order_plan_printed_on_gpus(tmp_path, monkeypatch, no_side_effects):
    """The mission on 8 GPUs: the reuse dispatch ``run`` hands the dispatcher simulates to the
    schedule ``plan`` printed (the run's own cells run in real time: they are not started here)."""
    real = runplan.plan_order

    def bent(todo, specs, num_gpus, estimate, prestart=True, work=None):  # the planned priority order, backwards
        order, _, inp = real(todo, specs, num_gpus, estimate, prestart, work)
        order = order[::-1]
        return order, simulate(order, inp)[0], inp

    monkeypatch.setattr(runplan, "plan_order", bent)
    printed = plan_dict(str(MISSION), 8)
    seen: list[tuple] = []
    monkeypatch.setattr(run_sweep_mod, "run_dispatch", lambda ctx, planned, pool, specs, run_cell: seen.append(planned))
    paired: list[str] = []  # the build pairs that fit the 8 GPUs run first (pdsweep.run.pairs), not started here
    monkeypatch.setattr(pairs_mod, "run_cell", lambda ctx, cell, slot, on_ready, side: paired.append(cell.id))
    opts = RunOptions(out=tmp_path / "run", gpus=8, quiet=True, skip_eval=True, preflight=False)
    run = run_sweep_mod.run_sweep(MISSION, opts)
    ((order, inp),) = seen
    est = inp.estimate
    planned = printed["reuse"]["schedule"]
    pair_ids = {c for p in printed["pairs"]["pairs"] for c in (p["a"], p["b"])}
    pair_starts = sum(len(c["instances"]) for c in printed["cells"] if c["id"] in pair_ids)  # each pair starts its own
    assert record(simulate(order, inp)[0], est) == {
        **planned,
        "instance_starts": planned["instance_starts"] - pair_starts,
    }
    assert printed["makespan"]["follows"] == "reuse dispatch" and EXECUTORS[(True, True)] == "reuse dispatch"
    assert json.loads((run / "plan.json").read_text())["reuse"] == printed["reuse"]
    assert sorted(paired) == sorted(c for p in printed["pairs"]["pairs"] for c in (p["a"], p["b"]))
    assert not {c.id for c in order} & set(paired)  # the dispatch holds only the cells the pairs leave


def test_run_takes_its_job_from_the_plan(tmp_path, monkeypatch, no_side_effects):
    """Folding and sharding are the RunPlan's (pdsweep.run.runplan.plan_cells): bend the plan's job
    (shard 1/2, which nobody asked for) and the run runs and records the job ``plan`` printed; a run
    that folded and sharded the cells itself would run the whole sweep."""
    real = runplan.job_cells
    monkeypatch.setattr(runplan, "job_cells", lambda ls, cells, shard, *est: real(ls, cells, Shard(1, 2), *est))
    printed = plan_dict(str(SMOKE), 0)
    ran: list[str] = []
    monkeypatch.setattr(run_sweep_mod, "run_cell", lambda ctx, cell, slot, on_ready=None: ran.append(cell.id))
    monkeypatch.setattr(pairs_mod, "run_cell", lambda ctx, cell, slot, on_ready, side: ran.append(cell.id))
    run = run_sweep_mod.run_sweep(SMOKE, RunOptions(out=tmp_path / "run", quiet=True, skip_eval=True))
    index = json.loads((run / "run.json").read_text())
    assert printed["shard"]["index"] == 1 and printed["shard"]["count"] == 2
    assert 0 < printed["shard"]["cells"] < printed["shard"]["of"]  # the bend shows: half the sweep
    assert index["shard"] == printed["shard"]
    assert index["folded"] == {a: f["runs_as"] for a, f in printed["folded"].items()}
    pair = sorted(ran[:2]) == sorted(printed["reuse"]["order"][:2])  # the build pair runs both cells at once
    assert (
        pair and ran[2:] == printed["reuse"]["order"][2:] and sorted(ran) == sorted(c["id"] for c in printed["cells"])
    )
