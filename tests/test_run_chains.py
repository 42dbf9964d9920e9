"""``run`` follows the chain plan (pdsweep.run.gpureuse.run_chains, pdsweep.plan.chainorder):
the mission sweep's chains on 8 GPUs with a stub instance pool and a ``run_cell`` that sleeps
the cell's estimate (1 ms per model second). Chains start in the plan's order, every cell runs
once, no GPU is held by two instances at once, and a chain's given-back GPUs serve another
chain while it still runs."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from types import SimpleNamespace

from pdsweep.deploy.instances import instance_key
from pdsweep.plan.chainorder import plan_chains
from pdsweep.plan.expand import expand
from pdsweep.plan.instance import Slot, instances, model_path
from pdsweep.plan.schedule import GpuPool
from pdsweep.plan.startup import estimator
from pdsweep.run.dryrun import plan_dict
from pdsweep.run.gpureuse import identities, run_chains
from pdsweep.spec.sweep import load_sweep

MISSION = Path(__file__).resolve().parents[1] / "sweeps" / "hybrid-mla-mamba.yaml"
SCALE = 0.001  # wall seconds per model second


class StubPool:
    """What run_chain asks of an InstancePool; fails a test when two instances hold one GPU."""

    def __init__(self) -> None:
        self.live: dict[str, tuple[int, ...]] = {}
        self.lock = threading.Lock()
        self.errors: list[str] = []

    def start(self, key: str, gpus: tuple[int, ...], cell: str) -> None:
        with self.lock:
            if key in self.live:
                return
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
        self.stop(set(among or ()))

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
        specs[c.id] = instances(c, slot, ls, model_path(m, c.model, create=False), "python")
    return ls, todo, specs


def test_run_chains_follows_the_plan_order_and_hands_given_back_gpus_on():
    ls, todo, specs = mission()
    est, stub = estimator(ls), StubPool()
    ran: list[tuple[float, str, tuple[int, ...]]] = []
    t0 = time.monotonic()

    def run_cell(ctx, cell, slot, on_ready=None):
        gpus = iter(slot.gpus)
        for s in specs[cell.id]:  # instance order, as assign hands the slot's GPUs out
            stub.start(instance_key(s), tuple(next(gpus) for _ in s.gpus), cell.id)
        ran.append((time.monotonic() - t0, cell.id, slot.gpus))
        time.sleep(SCALE * est(cell))

    ctx = SimpleNamespace(ls=ls, stop=threading.Event(), provider=stub, opts=SimpleNamespace(prestart=False))
    run_chains(ctx, todo, GpuPool(8, 20000), specs, run_cell)

    assert not stub.errors, stub.errors[:3]
    assert sorted(c for _, c, _ in ran) == sorted(c.id for c in todo)  # every cell once
    keys, sizes = identities(specs)
    planned = plan_chains(todo, keys, sizes, 8, est)
    chain_of = {c.id: i for i, ch in enumerate(planned) for c in ch.cells}
    first: dict[int, float] = {}
    for t, cid, _ in ran:
        first.setdefault(chain_of[cid], t)
    # chains start in the planned order (threads submitted one after the other may race by a hair)
    assert all(first[k] >= first[k - 1] - 0.2 for k in range(1, len(planned))), sorted(first, key=first.get)
    # a GPU a chain ran a cell on serves another chain's cell while the first chain runs later cells
    last = {k: max(t for t, cid, _ in ran if chain_of[cid] == k) for k in first}
    handed = [
        (a, b)
        for ta, a, ga in ran
        for tb, b, gb in ran
        if chain_of[a] != chain_of[b] and ta < tb < last[chain_of[a]] and set(ga) & set(gb)
    ]
    assert handed, "no GPU went from a running chain to another"
