"""``run`` dispatches as the plan's rule says (pdsweep.run.gpureuse.run_dispatch,
pdsweep.plan.dispatch): the mission sweep on 8 GPUs with a stub instance pool and a ``run_cell``
that sleeps the cell's estimate (1 ms per model second). Every cell runs once, cells run at
once, instances start while their cell waits (prestart), no GPU is held by two instances at
once, and every instance is stopped at the end."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from types import SimpleNamespace

from pdsweep.deploy.instances import instance_key
from pdsweep.plan.expand import expand
from pdsweep.plan.instance import Slot, instances, model_path
from pdsweep.plan.schedule import GpuPool
from pdsweep.plan.startup import estimator
from pdsweep.run.dryrun import plan_dict
from pdsweep.run.gpureuse import plan_order, run_dispatch
from pdsweep.sweepfile.sweep import load_sweep

MISSION = Path(__file__).resolve().parents[1] / "sweeps" / "hybrid-mla-mamba.yaml"
SCALE = 0.001  # wall seconds per model second


class StubPool:
    """What run_dispatch asks of an InstancePool; fails a test when two instances hold one GPU."""

    def __init__(self) -> None:
        self.live: dict[str, tuple[int, ...]] = {}
        self.lock = threading.Lock()
        self.errors: list[str] = []
        self.started: list[tuple[str, str]] = []  # (key, cell)
        self.prestarted: list[str] = []
        self.restarts = 0

    def prestart(self, specs, cell: str) -> None:
        for s in specs:
            if instance_key(s) not in self.live:
                self.prestarted.append(cell)
                self.start(instance_key(s), s.gpus, cell)

    def start(self, key: str, gpus: tuple[int, ...], cell: str) -> None:
        with self.lock:
            if key in self.live:
                return
            self.restarts += any(k == key for k, _ in self.started)
            self.started.append((key, cell))
            taken = {g: k for k, gs in self.live.items() for g in gs}
            if any(g in taken for g in gpus):
                self.errors.append(
                    f"{cell}: GPUs {gpus} of {key[:40]} held by {[taken[g][:40] for g in gpus if g in taken]}"
                )
            self.live[key] = gpus

    def stop(self, keys: set[str], cell: str | None = None) -> None:
        with self.lock:
            for k in keys:
                self.live.pop(k, None)

    def keep_only(self, specs, cell=None, among=None, wait=False) -> None:
        self.stop(set(self.live) if among is None else set(among))

    def gpus_held(self, keys: set[str] | None = None) -> dict[int, str]:
        with self.lock:
            return {g: k for k, gs in self.live.items() if keys is None or k in keys for g in gs}


def mission():
    ls = load_sweep(MISSION)
    cells = {c.id: c for c in expand(ls).cells}
    todo = [cells[cid] for cid in plan_dict(str(MISSION), 8)["reuse"]["order"]]
    specs = {}
    for c in todo:
        m = ls.catalogue.models[c.model]
        slot = Slot(0, tuple(range(c.num_gpus)), 20000)
        specs[c.id] = instances(c, slot, ls, model_path(m, c.model), "python")
    return ls, todo, specs


def test_run_dispatch_runs_every_cell_once_at_once_where_gpus_allow_and_prestarts():
    ls, todo, specs = mission()
    est, stub = estimator(ls), StubPool()
    ran: list[tuple[float, float, str]] = []
    t0 = time.monotonic()

    def run_cell(ctx, cell, slot, on_ready=None):
        gpus = iter(slot.gpus)
        for s in specs[cell.id]:  # instance order, as assign hands the slot's GPUs out
            stub.start(instance_key(s), tuple(next(gpus) for _ in s.gpus), cell.id)
        start = time.monotonic() - t0
        time.sleep(SCALE * est(cell))
        ran.append((start, time.monotonic() - t0, cell.id))

    builds = {b: {"python": "python"} for b in ("fixed", "unfixed")}
    opts = SimpleNamespace(prestart=True)
    ctx = SimpleNamespace(ls=ls, stop=threading.Event(), provider=stub, builds=builds, opts=opts)
    order, _, inp = plan_order(todo, specs, 8, est, prestart=True)
    run_dispatch(ctx, (order, inp), GpuPool(8, 20000), specs, run_cell)

    assert not stub.errors, stub.errors[:3]
    assert sorted(c for _, _, c in ran) == sorted(c.id for c in todo)  # every cell once
    assert max(sum(a <= t < b for a, b, _ in ran) for t, _, _ in ran) >= 3  # cells at once
    assert stub.prestarted, "no instance started while its cell waited"
    uses = sum(len(specs[c.id]) for c in todo)
    assert len({k for k, _ in stub.started}) == len(stub.started) - stub.restarts < uses
    assert not stub.live  # every instance stopped at the end
