"""``bench.pair_builds``: ``pdsweep run`` measures the two PD cells of one ``compare_key`` (the
cell id without its build: fixed and unfixed, candidate and baseline venv) as a pair.

Both deployments are up at once (each cell on a lane of its own; on GPUs the pair needs the
GPUs of both cells free together), each cell runs its phases in a thread of its own
(:func:`pdsweep.run.cell.run_cell`) and their load repeats take turns in ABBA order
(:mod:`pdsweep.measure.paired`). Side ``a`` is the build listed first in the sweep's
``builds:``. Pairs run before the other cells; with instance reuse every instance of a pair
stops once the pair is done.

On by default where a sweep has such cells (:func:`pdsweep.plan.pairing.pairing`; opt-out:
``bench.pair_builds: false``). Never a refusal: a cell with no partner (one build only, a key
with more than two builds, a partner that cannot run here or has no load phase, a partner
already final under ``--resume``) and a pair that does not fit the pool run alone, their
load.json and status.json saying why (``unpaired``); by default a cell with no other build of
its key is simply a single cell (nothing said).
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import uuid
from dataclasses import dataclass
from typing import Any

from pdsweep.core.stats import planned_repeats
from pdsweep.deploy.instances import InstancePool
from pdsweep.measure.paired import PairTurns
from pdsweep.plan.expand import Cell
from pdsweep.plan.instance import PORTS_PER_SLOT, Slot, ports_fit
from pdsweep.plan.pairing import no_load_phase
from pdsweep.run.cell import run_cell
from pdsweep.run.context import RunContext

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Pair:
    """Two PD cells of one compare key: ``a`` of the earlier build in ``builds:``, ``b`` the other."""

    a: Cell
    b: Cell

    @property
    def num_gpus(self) -> int:
        return self.a.num_gpus + self.b.num_gpus


def lanes(paired: bool, num_gpus: int) -> int:
    """Port lanes the run's cells may hold at once: one per GPU (at least one); on CPU two when
    the run has a build pair (``paired``: both cells of a pair). Instance pools take their ports above them."""
    return max(2 if paired else 1, num_gpus)


def plan_pairs(
    builds: list[str], todo: list[Cell], runnable: list[Cell], explicit: bool = True
) -> tuple[list[Pair], dict[str, str]]:
    """The pairs among ``todo`` (in ``todo``'s order) and, per PD cell of ``todo`` left alone,
    why (cell id -> reason). ``builds``: the sweep's ``builds:`` in order (side ``a`` is the
    earlier); ``runnable``: every cell this run can run (with the final ones of a resumed
    run), to tell "partner already done" from "no partner"; ``explicit``: ``bench.pair_builds:
    true`` (a cell with no other build of its key is then said to run alone; by default it is
    a single cell, nothing said). A cell with no load phase (:func:`pdsweep.plan.pairing.no_load_phase`)
    and its partner run alone."""
    rank = {b: i for i, b in enumerate(builds)}
    left = {c.id for c in todo}
    groups: dict[str, list[Cell]] = {}
    for c in runnable:
        if c.kind == "pd":
            groups.setdefault(c.compare_key, []).append(c)
    pairs: list[Pair] = []
    why: dict[str, str] = {}
    for c in todo:
        if c.kind != "pd" or c.id in why or any(c in (p.a, p.b) for p in pairs):
            continue
        group = sorted(groups.get(c.compare_key, [c]), key=lambda x: rank.get(x.build, len(rank)))
        others = [x for x in group if x.id != c.id]
        if not others:
            if explicit:
                why[c.id] = "no cell of another build with this compare key in the sweep (or it cannot run here)"
        elif len(group) > 2:
            for x in group:
                why[x.id] = f"{len(group)} builds share compare key {c.compare_key}: pairs take two"
        elif dead := [(x, w) for x in group if (w := no_load_phase(x))]:
            for x in group:
                why[x.id] = dead[0][1] if x is dead[0][0] else f"partner {dead[0][0].id} {dead[0][1]}"
        elif others[0].id not in left:
            why[c.id] = f"partner {others[0].id} is already final (--resume): measured alone"
        else:
            pairs.append(Pair(group[0], group[1]))
    return pairs, {k: v for k, v in why.items() if k in left}


def run_pair(ctx: RunContext, pair: Pair, slots: tuple[Slot, Slot]) -> None:
    """Both cells of ``pair`` at once, their load repeats interleaved; each cell's status is
    written by :func:`run_cell` whatever the other does. With reuse, the pair's instances stop after."""
    b = ctx.ls.sweep.bench
    repeats = planned_repeats(b, ctx.ls.sweep.platform)[1]
    pair_id = f"{pair.a.compare_key}.{pair.a.build}+{pair.b.build}.{uuid.uuid4().hex[:8]}"
    turns = PairTurns(pair_id, {"a": pair.a.id, "b": pair.b.id}, repeats, ctx.stop.is_set)
    log.info(
        "pair %s: %s (a) and %s (b), %d repeats each in order %s",
        pair_id,
        pair.a.id,
        pair.b.id,
        repeats,
        "".join(turns.order),
    )
    with cf.ThreadPoolExecutor(max_workers=2, thread_name_prefix="pair") as ex:
        futs = [
            ex.submit(run_cell, ctx, cell, slot, None, turns.side(side))
            for side, cell, slot in (("a", pair.a, slots[0]), ("b", pair.b, slots[1]))
        ]
        for f in futs:
            f.result()
    if isinstance(ctx.provider, InstancePool) and not ctx.stop.is_set():
        ctx.provider.keep_only([], pair.b.id, wait=bool(slots[0].gpus))  # GPUs free before the next cells


def too_big(pair: Pair, num_gpus: int) -> str | None:
    """Why ``pair`` can never run as a pair on ``num_gpus`` GPUs (None: it fits; CPU pairs always do)."""
    if pair.num_gpus > num_gpus and pair.num_gpus:
        n = f"{pair.num_gpus} GPUs at once ({pair.a.num_gpus} + {pair.b.num_gpus})"
        return f"the pair needs {n}, the pool has {num_gpus}"
    return None


def fitting(planned: tuple[list[Pair], dict[str, str]], num_gpus: int) -> tuple[list[Pair], dict[str, str]]:
    """``planned`` (:func:`plan_pairs`) with the pairs that can never fit ``num_gpus`` GPUs moved to
    the cells run alone, each with its reason: what the plan dispatches and what :func:`run_pairs` runs."""
    pairs, why = planned
    keep = [p for p in pairs if too_big(p, num_gpus) is None]
    alone = {
        c.id: f"not paired with {o.id}: {r}"
        for p in pairs
        if (r := too_big(p, num_gpus))
        for c, o in ((p.a, p.b), (p.b, p.a))
    }
    return keep, {**why, **alone}


def _unfit(pool: Any, pair: Pair, slots: tuple[Slot, Slot] | None, busy: bool) -> str | None:
    """Why ``pair`` cannot run as a pair on ``pool`` (None: it can, or must wait for ``busy`` ones)."""
    if reason := too_big(pair, pool.num_gpus):
        return reason
    if slots is None:
        return None if busy else "the pair's two cells do not fit the pool together"
    if not ports_fit(slots[1].port_base, PORTS_PER_SLOT):
        base = slots[1].port_base
        return f"no second port lane: {base} + {PORTS_PER_SLOT} ports pass 65535 (lower defaults.port_base)"
    return None


def run_pairs(
    ctx: RunContext, todo: list[Cell], pool: Any, planned: tuple[list[Pair], dict[str, str]] | None
) -> list[Cell]:
    """With ``bench.pair_builds``: run every pair ``planned`` (:func:`plan_pairs` of the run's
    plan: pairs, why each other PD cell runs alone) concurrently while GPUs allow, one pair at a
    time on CPU, and return the cells of ``todo`` left to the plain path: singles and the cells
    of pairs that do not fit (their reason in ``ctx.unpaired``). Without it (None): ``todo``."""
    if planned is None:
        return todo
    pairs, why = planned
    ctx.unpaired.update(why)
    ran: set[str] = set()
    pending = list(pairs)
    with cf.ThreadPoolExecutor(max_workers=max(1, pool.num_gpus), thread_name_prefix="pairs") as ex:
        running: dict[cf.Future, tuple[Slot, Slot]] = {}
        while pending or running:
            if ctx.stop.is_set():
                pending.clear()
            for p in list(pending):
                slots = pool.try_acquire_both(p.a, p.b) if p.num_gpus <= pool.num_gpus or not p.num_gpus else None
                reason = _unfit(pool, p, slots, bool(running))
                if reason is not None:
                    for s in slots or ():
                        pool.release(s)
                    pending.remove(p)
                    for c in (p.a, p.b):
                        ctx.unpaired[c.id] = f"not paired with {(p.b if c is p.a else p.a).id}: {reason}"
                    log.warning("pair %s / %s runs unpaired: %s", p.a.id, p.b.id, reason)
                elif slots is not None:
                    pending.remove(p)
                    ran |= {p.a.id, p.b.id}
                    running[ex.submit(run_pair, ctx, p, slots)] = slots
            if not running:
                break
            done, _ = cf.wait(list(running), timeout=0.5, return_when=cf.FIRST_COMPLETED)
            for fut in done:
                for s in running.pop(fut):
                    pool.release(s)
                fut.result()
    return [c for c in todo if c.id not in ran]
