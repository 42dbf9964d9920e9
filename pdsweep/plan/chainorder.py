"""Chains that give GPUs back as they shrink, started in one planned order.

A chain (:mod:`pdsweep.plan.reusepack`) starts holding its peak GPUs. After each cell it
keeps only what its remaining cells can need at once (:func:`holds`: the instances live
during a later cell, plus the next cell's instances ``run`` prestarts beside them) and gives
the rest back, so other chains start on them while it runs its smaller cells. A chain never
grows, so no chain waits on GPUs another chain waits to get (no deadlock). Chains start
strictly in the order :func:`ordered` picks on the duration model (a chain waits until
every chain before it has started), the order ``pdsweep run`` follows
(:func:`pdsweep.run.gpureuse.run_chains`) and ``pdsweep plan`` states (:func:`simulate`).
"""

from __future__ import annotations

import heapq
import itertools
import random
from collections.abc import Callable
from dataclasses import dataclass

from pdsweep.plan.expand import Cell
from pdsweep.plan.instance import Slot
from pdsweep.plan.reusepack import Chain, Need, cell_times, chains, starts
from pdsweep.plan.reusepack import simulate as belady
from pdsweep.plan.schedule import GpuPool

# order evaluations x cells of the sweep per planned order (the 1152-combination plan's
# search: ~360 orders, 0.3 s on 2 cores; the mission sweep's 20 chains: ~4900 orders)
SEARCH_WORK = 200_000


def holds(chain: Chain, keys: dict[str, list[str]], sizes: dict[str, int]) -> list[int]:
    """Per cell of ``chain``, the GPUs it holds while that cell runs: the most its live
    instances (kept ones, the cell's own, and the next cell's new ones when ``run``
    prestarts them: they fit in ``chain.gpus`` beside the rest) need during this or any
    later cell, at least the cell's own GPU count. Non-increasing; the first is the chain's peak."""
    foot, live = [], set[str]()
    cells, stops = chain.cells, chain.stops or tuple(frozenset() for _ in chain.cells)
    for i, (c, stop) in enumerate(zip(cells, stops)):
        during = live | set(keys.get(c.id, []))
        n = sum(sizes.get(k, 1) for k in during)
        if i + 1 < len(cells):
            new = set(keys.get(cells[i + 1].id, [])) - (during - stop)
            if new and sum(sizes.get(k, 1) for k in during | new) <= chain.gpus:
                n = sum(sizes.get(k, 1) for k in during | new)
        foot.append(max(n, c.num_gpus))  # a cell without planned instances holds its own count
        live = during - stop
    out, peak = [], 0
    for n in reversed(foot):
        peak = max(peak, n)
        out.append(peak)
    return out[::-1]


@dataclass(frozen=True)
class Step:
    """One cell of a placed chain: when it runs and the GPUs the chain holds then."""

    cell: Cell
    start_s: float
    end_s: float
    slot: Slot  # the chain's lane and the GPUs it holds while the cell runs


def durations(
    chain: Chain, keys: dict[str, list[str]], estimate: Callable[[Cell], float], sizes: dict[str, int]
) -> list[float]:
    """Per cell, its estimated seconds in the chain, prestart counted
    (:func:`pdsweep.plan.reusepack.cell_times` with ``sizes``)."""
    return cell_times(chain, keys, estimate, sizes)


def variants(chain: Chain, keys: dict[str, list[str]], sizes: dict[str, int], max_gpus: int) -> list[Chain]:
    """``chain`` and its cells largest first (so it shrinks early), each with Belady stops
    (:func:`pdsweep.plan.reusepack.simulate`) on every GPU count from its largest cell's to
    ``max_gpus`` (more GPUs keep more instances up and prestart more)."""
    least = max((c.num_gpus for c in chain.cells), default=0)
    if not least:
        return [chain]
    out = [chain]
    for cap in range(least, max(least, max_gpus) + 1):
        for order in (list(chain.cells), sorted(chain.cells, key=lambda c: -c.num_gpus)):
            _, stops, _ = belady(order, keys, sizes, cap)
            out.append(Chain(tuple(order), tuple(frozenset(s) for s in stops), cap))
    return out


def best_variant(
    chain: Chain, keys: dict[str, list[str]], sizes: dict[str, int], max_gpus: int, estimate: Callable[[Cell], float]
) -> Chain:
    """Of :func:`variants`, the one with the fewest instance starts, then the fewest
    GPU-seconds held (durations x :func:`holds`), then the shortest, then the first."""

    def cost(v: Chain) -> tuple[int, float, float]:
        d = durations(v, keys, estimate, sizes)
        return (sum(starts(v, keys).values()), sum(x * h for x, h in zip(d, holds(v, keys, sizes))), sum(d))

    return min(variants(chain, keys, sizes, max_gpus), key=cost)


def _changes(h: list[int]) -> frozenset[int]:
    """The cells after which a chain's hold changes: ``h`` falls after them, or the last one,
    after which it releases all."""
    return frozenset(i for i in range(len(h)) if i + 1 == len(h) or h[i + 1] < h[i])


def _place(
    chs: list[Chain], plan: list[tuple[list[float], list[int], frozenset[int]]], pool: GpuPool
) -> dict[int, tuple[float, dict[int, Slot]]]:
    """The event loop of :func:`simulate`: per placed chain (by position) its start and its slot
    from each cell on where the slot changes (cell index -> slot; cell 0: the one acquired)."""
    t, k, seq = 0.0, 0, itertools.count()
    events: list[tuple[float, int, int, int]] = []  # (time, seq, chain, cell after which its hold changes)
    out: dict[int, tuple[float, dict[int, Slot]]] = {}
    while True:  # every event gives GPUs back, so the next chain may fit after each
        while k < len(chs) and plan[k][1] and (slot := pool.try_acquire(Need(plan[k][1][0]))) is not None:
            out[k], at = (t, {0: slot}), t
            for i, x in enumerate(plan[k][0]):  # ends summed as run's clock does: cell after cell
                at += x
                if i in plan[k][2]:
                    heapq.heappush(events, (at, next(seq), k, i))
            k += 1
        if not events:
            return out
        t, _, j, i = heapq.heappop(events)
        h, slots = plan[j][1], out[j][1]
        last = slots[max(slots)]
        if i + 1 < len(h):
            slots[i + 1] = pool.shrink(last, last.gpus[h[i + 1] :])
        else:
            pool.release(last)


def simulate(
    chs: list[Chain],
    keys: dict[str, list[str]],
    sizes: dict[str, int],
    estimate: Callable[[Cell], float],
    pool: GpuPool,
    memo: dict[int, tuple[list[float], list[int], frozenset[int]]] | None = None,
    steps: bool = True,
) -> list[list[Step]]:
    """The run of ``chs`` in this order on ``pool``: each chain starts when every chain before
    it has started and its peak GPUs are free (:meth:`GpuPool.try_acquire`), and after each
    cell gives back what :func:`holds` no longer needs (:meth:`GpuPool.shrink`; here its
    highest GPU ids, ``run`` those no live instance holds). Per chain (same order) its steps;
    a chain that never fits, and every chain after it, gets none. ``memo``: the chains' durations,
    holds and hold changes by ``id``, kept across calls on the same chains. ``steps=False``: per
    placed chain only its last step (what :func:`makespan` reads; the search's many trials)."""
    memo = {} if memo is None else memo
    for ch in chs:
        if id(ch) not in memo:
            d, h = durations(ch, keys, estimate, sizes), holds(ch, keys, sizes)
            memo[id(ch)] = (d, h, _changes(h))
    plan = [memo[id(ch)] for ch in chs]
    out: list[list[Step]] = []
    placed = _place(chs, plan, pool)
    for j, (ch, (d, _, _)) in enumerate(zip(chs, plan)):
        if j not in placed:
            out.append([])
            continue
        at, slots = placed[j]
        if not steps:
            for x in d[:-1]:
                at += x
            out.append([Step(ch.cells[-1], at, at + d[-1], slots[max(slots)])])
            continue
        row, slot = [], slots[0]
        for i, c in enumerate(ch.cells):
            slot = slots.get(i, slot)
            row.append(Step(c, at, at + d[i], slot))
            at += d[i]
        out.append(row)
    return out


def makespan(steps: list[list[Step]]) -> float:
    """The end of the last step of ``steps`` (0 when none)."""
    return max((s[-1].end_s for s in steps if s), default=0.0)


def ordered(
    chs: list[Chain],
    keys: dict[str, list[str]],
    sizes: dict[str, int],
    num_gpus: int,
    estimate: Callable[[Cell], float],
) -> list[Chain]:
    """``chs`` in the start order with the shortest :func:`simulate` makespan found on
    ``num_gpus`` GPUs: longest first, then pairwise swaps that shorten it, pass after pass,
    then seeded random swaps that do not lengthen it, within :data:`SEARCH_WORK`; chains
    larger than the host last. Deterministic: the same sweep gives the same order in
    ``plan`` and ``run``."""
    total = {id(c): sum(durations(c, keys, estimate, sizes)) for c in chs}
    big = [c for c in chs if (holds(c, keys, sizes) or [0])[0] > num_gpus]
    cur = sorted((c for c in chs if c not in big), key=lambda c: -total[id(c)])

    def span(order: list[Chain]) -> float:
        return makespan(simulate(order, keys, sizes, estimate, GpuPool(num_gpus, 20000), memo, steps=False))

    memo: dict[int, tuple[list[float], list[int], frozenset[int]]] = {}

    best, budget, improved = span(cur), SEARCH_WORK // max(1, sum(len(c.cells) for c in chs)), True
    while improved and budget > 0:  # every pair, pass after pass, while a swap shortens it
        improved = False
        for a, b in itertools.combinations(range(len(cur)), 2):
            if budget <= 0:
                break
            budget, trial = budget - 1, swap(cur, a, b)
            if (m := span(trial)) < best:
                cur, best, improved = trial, m, True
    rnd = random.Random(0)  # then random pairs (seeded): a swap that does not lengthen it is kept
    while budget > 0 and len(cur) > 1:
        budget, trial = budget - 1, swap(cur, *rnd.sample(range(len(cur)), 2))
        if (m := span(trial)) <= best:
            cur, best = trial, m
    return cur + big


def swap(order: list[Chain], a: int, b: int) -> list[Chain]:
    """``order`` with its ``a``-th and ``b``-th chains swapped."""
    out = list(order)
    out[a], out[b] = out[b], out[a]
    return out


def plan_chains(
    cells: list[Cell],
    keys: dict[str, list[str]],
    sizes: dict[str, int],
    num_gpus: int,
    estimate: Callable[[Cell], float],
) -> list[Chain]:
    """The chains ``run`` runs and ``plan`` shows, in their start order: :func:`pdsweep.plan.reusepack.chains`
    of ``cells`` (``keys``: cell id -> instance keys; ``sizes``: key -> GPUs), each its
    :func:`best_variant`, then :func:`ordered`."""
    chs = [best_variant(c, keys, sizes, num_gpus, estimate) for c in chains(cells, keys, sizes, num_gpus)]
    return ordered(chs, keys, sizes, num_gpus, estimate)


def record(
    chs: list[Chain],
    keys: dict[str, list[str]],
    sizes: dict[str, int],
    estimate: Callable[[Cell], float],
    pool: GpuPool,
) -> dict:
    """plan.json ``reuse.schedule``: per chain (start order) its first GPUs, lane, cells,
    times and ``releases`` (after which cell, when, which GPUs it gives back); the makespan
    against running every cell alone, one after the other (upstream's way)."""
    placed = [(ch, st) for ch, st in zip(chs, simulate(chs, keys, sizes, estimate, pool)) if st]
    rows = []
    for ch, st in placed:
        n = starts(ch, keys)
        gone = [
            {"after": a.cell.id, "at_s": round(a.end_s, 1), "gpus": sorted(set(a.slot.gpus) - set(b.slot.gpus))}
            for a, b in zip(st, st[1:])
            if len(b.slot.gpus) < len(a.slot.gpus)
        ]
        rows.append(
            {
                "cells": [s.cell.id for s in st],
                "gpus": list(st[0].slot.gpus),
                "lane": st[0].slot.index,
                "port_base": st[0].slot.port_base,
                "start_s": round(st[0].start_s, 1),
                "end_s": round(st[-1].end_s, 1),
                "releases": gone,
                "instance_starts": sum(n.values()),
                "distinct_instances": len(n),
            }
        )
    return {
        "chains": rows,
        "makespan_s": round(makespan([st for _, st in placed]), 1),
        "sequential_s": round(sum(estimate(c) for ch, _ in placed for c in ch.cells), 1),
    }
