"""``pdsweep run`` with instance reuse on GPUs (local launcher).

The cells run as :class:`pdsweep.plan.dispatch.Dispatcher` decides, in the priority order
:func:`plan_order` picks (the one ``pdsweep plan`` simulates): a cell runs when no running cell
uses its instances and its new ones fit on GPUs no live instance holds; idle instances stay
up while a waiting cell needs them and GPUs allow. GPUs are handed out per instance, not per
cell: an instance that is up keeps the GPUs it started on, a new one takes free GPUs
(:func:`assign`). A stopped instance is waited for until its process has exited (its GPU
memory is free) before another instance takes its GPUs. So no two live instances ever share
a GPU, and ports stay disjoint (a lane per running cell, a port block per instance).
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from pdsweep.deploy.instances import InstancePool, instance_key
from pdsweep.plan.dispatch import Inputs, Placed, Prestart, Release, Stop, ended, first_order, makespan, ordered
from pdsweep.plan.expand import Cell
from pdsweep.plan.instance import InstanceSpec, Slot, instances
from pdsweep.plan.schedule import GpuPool, eval_s
from pdsweep.run.prebuild import checkpoint_path

log = logging.getLogger(__name__)


def identities(specs: dict[str, list[InstanceSpec]]) -> tuple[dict[str, frozenset[str]], dict[str, int]]:
    """(cell id -> instance keys, instance key -> its GPU count) of planned ``specs``."""
    keys = {cid: frozenset(instance_key(s) for s in sp) for cid, sp in specs.items()}
    return keys, {instance_key(s): len(s.gpus) for sp in specs.values() for s in sp}


def plan_order(
    todo: list[Cell],
    specs: dict[str, list[InstanceSpec]],
    num_gpus: int,
    estimate: Callable[[Cell], float],
    prestart: bool = True,
    work: Callable[[Cell], float] | None = None,
) -> tuple[list[Cell], list[Placed], Inputs]:
    """The priority order ``run`` dispatches ``todo`` in and ``plan`` simulates
    (:func:`pdsweep.plan.dispatch.ordered` from :func:`pdsweep.plan.dispatch.first_order`, the
    instances a cell expected to fail ends: :func:`pdsweep.plan.dispatch.ended`), its simulation,
    and the inputs it was planned on. ``estimate``/``work``: a cell's wall and measured-phase
    seconds (:class:`pdsweep.plan.durations.CellClock`; ``work`` None: the model's ``eval_s``)."""
    planned, sizes = identities(specs)
    keys = {c.id: planned.get(c.id, frozenset()) for c in todo}
    ends = {c.id: ended(c, keys[c.id]) for c in todo}
    inp = Inputs(keys, sizes, num_gpus, estimate, ends, prestart, work or eval_s)
    order, placed = ordered(first_order(todo, inp), inp)
    return order, placed, inp


def run_dispatch(
    ctx: Any,
    planned: tuple[list[Cell], Inputs],
    pool: GpuPool,
    specs: dict[str, list[InstanceSpec]],
    run_cell: Callable,
) -> None:
    """Run the cells of ``planned`` (the priority order and inputs of :func:`plan_order`, as the
    run's :class:`pdsweep.run.runplan.RunPlan` holds them) as the
    :class:`pdsweep.plan.dispatch.Dispatcher` decides, each cell in a worker thread with a lane
    of ports and its instances' GPUs. ``specs``: cell id -> its planned instances (identity
    only); ``run_cell(ctx, cell, slot)`` runs one cell. Instances a failed cell leaves stopped
    (or dead) are taken as gone; every instance is stopped at the end."""
    order, inp = planned
    keys = inp.keys
    provider: InstancePool = ctx.provider
    d = inp.dispatcher(order)
    reserved: dict[str, tuple[int, ...]] = {}  # running cell -> GPUs of its instances not launched yet
    running: dict[cf.Future, tuple[Cell, Slot]] = {}
    try:
        with cf.ThreadPoolExecutor(max_workers=max(1, pool.num_gpus), thread_name_prefix="cell") as ex:
            while not ctx.stop.is_set():
                for a in d.decide():
                    if isinstance(a, Stop):
                        provider.stop(set(a.keys))
                    elif isinstance(a, Release):
                        log.info("instances %s: prestarted for waiting cells, now idle", sorted(a.keys))
                    elif isinstance(a, Prestart):
                        free = free_gpus(pool, provider, reserved)
                        prestart(ctx, a.cell, specs.get(a.cell.id, []), a.keys, free, pool)
                    else:
                        lane = pool.take_lane()
                        slot = cell_slot(provider, lane, specs.get(a.cell.id, []), free_gpus(pool, provider, reserved))
                        reserved[a.cell.id] = tuple(g for g in slot.gpus if g not in provider.gpus_held())
                        running[ex.submit(run_cell, ctx, a.cell, slot)] = (a.cell, lane)
                if not running:
                    break
                done, _ = cf.wait(list(running), timeout=0.5, return_when=cf.FIRST_COMPLETED)
                for fut in done:
                    cell, lane = running.pop(fut)
                    reserved.pop(cell.id, None)
                    pool.release(lane)
                    fut.result()
                    d.finish(cell, {k for k in keys[cell.id] if k not in provider.live})
    finally:
        provider.keep_only([], None, wait=True)


def free_gpus(pool: GpuPool, provider: InstancePool, reserved: dict[str, tuple[int, ...]]) -> tuple[int, ...]:
    """The pool's GPU ids that no live instance holds and no running cell has reserved."""
    held = set(provider.gpus_held()) | {g for gs in reserved.values() for g in gs}
    return tuple(g for g in pool.ids if g not in held)


def assign(held: dict[int, str], gpus: tuple[int, ...], planned: list[InstanceSpec]) -> tuple[int, ...] | None:
    """GPU ids for ``planned`` in instance order (as :func:`pdsweep.plan.instance.instances`
    hands out ``slot.gpus``): a live instance's own (``held``: GPU -> instance key), a new
    one the next ``len(spec.gpus)`` of ``gpus`` that no live instance holds; None when those
    do not suffice."""
    live: dict[str, list[int]] = {}
    for g, k in sorted(held.items()):
        live.setdefault(k, []).append(g)
    free = [g for g in gpus if g not in held]
    out: list[int] = []
    for s in planned:
        k = instance_key(s)
        if k in live:
            out += live[k]
        elif len(free) >= len(s.gpus):
            out += free[: len(s.gpus)]
            free = free[len(s.gpus) :]
        else:
            return None
    return tuple(out)


def cell_slot(provider: InstancePool, lane: Slot, planned: list[InstanceSpec], free: tuple[int, ...]) -> Slot:
    """``lane`` with the GPUs :func:`assign` gives the cell's instances (live ones their own,
    new ones of ``free``). Raises ``RuntimeError`` when they do not fit (the dispatcher runs a
    cell only when they do: a pdsweep bug)."""
    if not planned:
        return lane
    gpus = assign(provider.gpus_held({instance_key(s) for s in planned}), free, planned)
    if gpus is None:
        raise RuntimeError(f"GPUs {list(free)}: no room for {[s.name for s in planned]} beside live instances")
    return replace(lane, gpus=gpus)


def prestart(
    ctx: Any, cell: Cell, planned: list[InstanceSpec], keys: frozenset[str], free: tuple[int, ...], pool: GpuPool
) -> None:
    """Start ``cell``'s instances of ``keys`` on ``free`` GPUs, now (the cell waits for its
    other instances, which running cells use; one of those may not have started yet, so only
    ``keys`` start here); if that fails, the cell starts them when it runs and reports why."""
    want = [s for s in planned if instance_key(s) in keys]
    build = ctx.builds.get(cell.build) or {}
    if sum(len(s.gpus) for s in want) > len(free) or not build.get("python") or build.get("error"):
        return
    spare, gpus = iter(free), []
    for s in planned:  # instance order; the others keep their planned ids (they are not started here)
        gpus += [next(spare) for _ in s.gpus] if instance_key(s) in keys else list(s.gpus)
    model = ctx.ls.catalogue.models[cell.model]
    slot = Slot(0, tuple(gpus), pool.port_base)  # the instances' ports are their pool blocks'
    try:
        real = instances(cell, slot, ctx.ls, checkpoint_path(model, cell.model), build["python"])
    except Exception as e:  # noqa: BLE001 -- the cell itself reports it when it comes
        log.warning("%s: no prestart: %s", cell.id, e)
        return
    ctx.provider.prestart([r for r in real if instance_key(r) in keys], cell.id)


def record(placed: list[Placed], estimate: Callable[[Cell], float]) -> dict[str, Any]:
    """plan.json ``reuse.schedule`` (and ``pdsweep plan``'s) of ``placed``, the simulation of
    :func:`plan_order` (:func:`pdsweep.plan.dispatch.simulate`): per cell (start order) when it
    starts, when its instances are up, when it ends, its GPUs and the instances started for it
    (``prestarted``: while it waited); the makespan against running every cell alone, one after the other."""
    return {
        "cells": [
            {
                "cell": p.cell.id,
                "start_s": round(p.start_s, 1),
                "ready_s": round(p.ready_s, 1),
                "end_s": round(p.end_s, 1),
                "gpus": p.cell.num_gpus,
                "instance_starts": p.launches,
                "prestarted": len(p.prestarted),
            }
            for p in placed
        ],
        "instance_starts": sum(p.launches for p in placed),
        "makespan_s": round(makespan(placed), 1),
        "sequential_s": round(sum(estimate(p.cell) for p in placed), 1),
    }
