"""``pdsweep run`` with instance reuse on GPUs (local launcher).

The cells run as the chains of :func:`pdsweep.plan.chainorder.plan_chains`, started strictly
in its order, each with a lane of ports; the cells of a chain one after the other on the
shared :class:`pdsweep.deploy.instances.InstancePool`. GPUs are handed out per instance,
not per cell: an instance that is still up keeps the GPUs it started on, a new one takes
GPUs of the chain's set that no live instance holds. After each cell, every instance of the
chain the next cell does not need is stopped and waited for (its GPU memory is free before
another instance takes the GPU); then the chain gives back to the pool the GPUs its later
cells do not need (:func:`pdsweep.plan.chainorder.holds`), so other chains start on them.
The next cell's new instances start early (``prestart``) only on the chain's GPUs no live
instance holds. So no two live instances ever share a GPU, each instance starts once per
chain stretch that needs it, and ports stay disjoint (lanes per chain, port blocks per
instance).
"""

from __future__ import annotations

import concurrent.futures as cf
import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from pdsweep.deploy.instances import InstancePool, instance_key
from pdsweep.plan.chainorder import holds, plan_chains, record
from pdsweep.plan.expand import Cell
from pdsweep.plan.instance import InstanceSpec, Slot, instances, model_path
from pdsweep.plan.reusepack import Chain, Need
from pdsweep.plan.schedule import GpuPool
from pdsweep.plan.startup import estimator

log = logging.getLogger(__name__)


def run_chains(
    ctx: Any, todo: list[Cell], pool: GpuPool, specs: dict[str, list[InstanceSpec]], run_cell: Callable
) -> None:
    """Run ``todo`` as the chains of :func:`pdsweep.plan.chainorder.plan_chains`, strictly in
    their planned start order: each chain, in a worker thread, starts when every chain before
    it has started and its peak GPUs and a lane are free, and gives GPUs back as it shrinks
    (:func:`run_chain`). ``specs``: cell id -> its planned instances (identity only);
    ``run_cell(ctx, cell, slot, on_ready)`` runs one cell."""
    keys, sizes = identities(specs)
    pending = plan_chains(todo, keys, sizes, pool.num_gpus, estimator(ctx.ls))
    with cf.ThreadPoolExecutor(max_workers=max(1, pool.num_gpus), thread_name_prefix="chain") as ex:
        running: dict[cf.Future, Held] = {}
        while pending or running:
            if ctx.stop.is_set():
                break
            while pending:  # in order: the next chain waits for its GPUs, later ones wait for it
                h = holds(pending[0], keys, sizes)
                slot = pool.try_acquire(Need(h[0] if h else 0)) if not h or h[0] <= pool.num_gpus else None
                if slot is None:
                    break
                held = Held(slot)
                running[ex.submit(run_chain, ctx, pending.pop(0), held, specs, run_cell, pool)] = held
            if not running:
                break
            done, _ = cf.wait(list(running), timeout=0.5, return_when=cf.FIRST_COMPLETED)
            for fut in done:
                pool.release(running.pop(fut).slot)
                fut.result()


@dataclass
class Held:
    """The slot a running chain holds now (its GPUs shrink as it gives them back)."""

    slot: Slot


def identities(specs: dict[str, list[InstanceSpec]]) -> tuple[dict[str, list[str]], dict[str, int]]:
    """(cell id -> instance keys, instance key -> its GPU count) of planned ``specs``."""
    keys = {cid: [instance_key(s) for s in sp] for cid, sp in specs.items()}
    return keys, {instance_key(s): len(s.gpus) for sp in specs.values() for s in sp}


def run_chain(
    ctx: Any, chain: Chain, held: Held, specs: dict[str, list[InstanceSpec]], run_cell: Callable, pool: GpuPool
) -> None:
    """The cells of ``chain`` one by one on ``held.slot``'s GPUs, stopping after each cell the
    instances its plan says (``chain.stops``: not needed again, or room for the next cell's),
    then giving back to ``pool`` the GPUs its later cells do not need
    (:func:`pdsweep.plan.chainorder.holds`), none that a live instance holds."""
    provider: InstancePool = ctx.provider
    mine = {instance_key(s) for c in chain.cells for s in specs.get(c.id, [])}
    keys, sizes = identities({c.id: specs.get(c.id, []) for c in chain.cells})
    need = holds(chain, keys, sizes)
    try:
        for i, cell in enumerate(chain.cells):
            if ctx.stop.is_set():
                break
            nxt = chain.cells[i + 1] if i + 1 < len(chain.cells) else None
            hook = None
            if nxt is not None and ctx.opts.prestart and specs.get(nxt.id):
                hook = functools.partial(prestart, ctx, nxt, held.slot, specs[nxt.id], mine)
            run_cell(ctx, cell, cell_slot(provider, held.slot, specs.get(cell.id, []), mine), on_ready=hook)
            provider.stop(set(chain.stops[i]) if chain.stops else mine, cell.id)
            if nxt is not None and held.slot.gpus:
                held.slot = give_back(pool, held.slot, provider.gpus_held(mine), need[i + 1], cell.id)
    finally:
        provider.keep_only([], None, among=mine, wait=True)


def give_back(pool: GpuPool, slot: Slot, live: dict[int, str], keep: int, cell: str) -> Slot:
    """``slot`` shrunk to ``keep`` GPUs: the highest ids no ``live`` instance holds (GPU ->
    instance key; their processes have exited) go back to ``pool``. Raises ``RuntimeError``
    when live instances hold more than ``keep`` (the plan's holds are wrong: a pdsweep bug)."""
    spare = [g for g in slot.gpus if g not in live]
    if len(slot.gpus) - len(spare) > keep:
        raise RuntimeError(f"after {cell}: live instances hold {sorted(live)}, the plan keeps {keep} GPUs")
    back = tuple(spare[len(spare) - (len(slot.gpus) - keep) :]) if len(slot.gpus) > keep else ()
    if back:
        log.info("after %s: GPUs %s back to the pool", cell, list(back))
    return pool.shrink(slot, back) if back else slot


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


def cell_slot(provider: InstancePool, slot: Slot, planned: list[InstanceSpec], mine: set[str]) -> Slot:
    """``slot`` with the GPUs :func:`assign` gives the cell's instances. Raises
    ``RuntimeError`` when they do not fit (the chain holds its largest cell's GPUs and stops
    what the next cell does not need first: a pdsweep bug)."""
    if not slot.gpus or not planned:
        return slot
    gpus = assign(provider.gpus_held(mine), slot.gpus, planned)
    if gpus is None:
        raise RuntimeError(f"GPUs {list(slot.gpus)}: no room for {[s.name for s in planned]} beside live instances")
    return replace(slot, gpus=gpus)


def prestart(ctx: Any, cell: Cell, slot: Slot, planned: list[InstanceSpec], mine: set[str]) -> None:
    """Start ``cell``'s instances that are not up, if they fit on GPUs no live instance
    holds (else they start when the cell comes, after the previous cell's are stopped)."""
    provider: InstancePool = ctx.provider
    gpus = assign(provider.gpus_held(mine), slot.gpus, planned)
    build = ctx.builds.get(cell.build) or {}
    if gpus is None or not build.get("python") or build.get("error"):
        return
    model = ctx.ls.catalogue.models[cell.model]
    try:
        real = instances(cell, replace(slot, gpus=gpus), ctx.ls, model_path(model, cell.model), build["python"])
    except Exception as e:  # noqa: BLE001 -- the cell itself reports it when it comes
        log.warning("%s: no prestart: %s", cell.id, e)
        return
    provider.prestart(real, cell.id)


def chain_schedule(
    todo: list[Cell], specs: dict[str, list[InstanceSpec]], num_gpus: int, port_base: int, estimate: Callable
) -> dict[str, Any]:
    """plan.json ``reuse.schedule`` (and ``pdsweep plan``'s): the chains of ``todo`` as
    :func:`run_chains` runs them on ``num_gpus`` GPUs (:func:`pdsweep.plan.chainorder.record`)."""
    keys, sizes = identities(specs)
    chs = plan_chains(todo, keys, sizes, num_gpus, estimate)
    return record(chs, keys, sizes, estimate, GpuPool(num_gpus, port_base))
