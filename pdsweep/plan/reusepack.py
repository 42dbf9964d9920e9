"""Cells that share instances, grouped and ordered for the fewest instance starts.

A chain is a connected group of the sharing graph (two cells adjacent when they need an
identical instance, :func:`pdsweep.deploy.instances.instance_key`), ordered so that
consecutive cells keep what they share up (:func:`plan_chain`), as if its cells ran one after
the other on its largest cell's GPUs. The chains, longest first, are the start of the
dispatch order search (:func:`pdsweep.plan.dispatch.first_order`).
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from pdsweep.plan.expand import Cell
from pdsweep.plan.schedule import reuse_order


@dataclass(frozen=True)
class Chain:
    cells: tuple[Cell, ...]
    # per cell: the instance keys to stop after it (never needed again, or room for the next)
    stops: tuple[frozenset[str], ...] = ()
    gpus: int = 0  # GPUs it may hold at once: its largest cell's, or more where that saves restarts


def chains(
    cells: list[Cell], keys: dict[str, list[str]], sizes: dict[str, int] | None = None, max_gpus: int = 0
) -> list[Chain]:
    """``cells`` cut into chains (connected groups of shared instance ``keys``: cell id ->
    instance keys), each ordered and given its stops by :func:`plan_chain` (``sizes``:
    instance key -> GPUs, None: one each; ``max_gpus``: the host's); chains in
    :func:`reuse_order` of their first cell."""
    ordered = reuse_order(cells, {cid: set(v) for cid, v in keys.items()})
    return [plan_chain(g, keys, sizes or {}, max_gpus) for g in groups(ordered, keys)]


def groups(
    cells: list[Cell], keys: Mapping[str, Iterable[str]], links: Iterable[tuple[str, str]] = ()
) -> list[list[Cell]]:
    """``cells`` joined by shared instance ``keys`` (cell id -> instance keys) and ``links``
    (pairs of cell ids), each group in the cells' order, groups in order of their first cell
    (union-find; the chains of :func:`chains`, the shards' groups of :func:`pdsweep.plan.shards.cut`)."""
    parent: dict[str, str] = {}

    def find(x: str) -> str:
        while parent.setdefault(x, x) != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for c in cells:
        find("c:" + c.id)
        for k in keys.get(c.id, ()):
            parent[find("c:" + c.id)] = find("k:" + k)
    ids = {c.id for c in cells}
    for a, b in links:
        if a in ids and b in ids:
            parent[find("c:" + a)] = find("c:" + b)
    out: dict[str, list[Cell]] = {}
    for c in cells:
        out.setdefault(find("c:" + c.id), []).append(c)
    return list(out.values())


def simulate(
    order: list[Cell], keys: dict[str, list[str]], sizes: dict[str, int], capacity: int
) -> tuple[int, list[set[str]], list[bool]]:
    """Run ``order`` on ``capacity`` GPUs keeping instances up while a later cell needs them
    and they leave room: before each cell, live instances it does not need are stopped,
    the one needed again furthest ahead first (Belady), until its instances fit. A cell
    expected to fail (``expect_fail``) ends its instances: ``run`` stops every instance of a
    failed cell (:func:`pdsweep.deploy.deployment.deploy`; pre-#49297 decode dies on its
    assert), so a later cell starts them again. Returns (instance starts, per cell the keys
    stopped after it, per cell whether it starts any)."""
    live: set[str] = set()
    stops: list[set[str]] = [set() for _ in order]
    starts, fresh = 0, []
    need = [set(keys.get(c.id, [])) for c in order]
    uses: dict[str, list[int]] = {}  # key -> the positions of the cells needing it, ascending
    for j, ks in enumerate(need):
        for k in ks:
            uses.setdefault(k, []).append(j)

    def next_use(k: str, i: int) -> int:
        at = uses[k]
        x = bisect.bisect_left(at, i)
        return at[x] if x < len(at) else len(order)

    for i in range(len(order)):
        if i:
            gone = {k for k in live if uses[k][-1] < i}
            stops[i - 1] |= gone
            live -= gone
            used = sum(sizes.get(k, 1) for k in live | need[i])
            while used > capacity and (idle := live - need[i]):
                k = max(sorted(idle), key=lambda k: next_use(k, i))
                stops[i - 1].add(k)
                live.discard(k)
                used -= sizes.get(k, 1)
        new = need[i] - live
        starts += len(new)
        fresh.append(bool(new))
        live |= need[i]
        if order[i].expect_fail:
            stops[i] |= need[i]
            live -= need[i]
    if order:
        stops[-1] |= live
    return starts, stops, fresh


def plan_chain(cells: list[Cell], keys: dict[str, list[str]], sizes: dict[str, int], max_gpus: int = 0) -> Chain:
    """The order of one chain's ``cells`` with the fewest instance starts on its GPU set (its
    largest cell's): greedily from each first cell, the next the one starting fewest new
    instances (ties: most kept, then fewest later uses of its instances, so an instance's last
    use comes early and its GPUs free up, then :func:`reuse_order`'s position); stops by
    :func:`simulate`."""
    least = max((c.num_gpus for c in cells), default=0)
    distinct = len({k for c in cells for k in keys.get(c.id, [])})
    orders = _greedy(cells, keys)  # the same on every GPU count: only the stops depend on it
    if not least:  # CPU: no GPUs, nothing to make room for
        return _order(cells, orders, keys, sizes, distinct)
    chain = _order(cells, orders, keys, sizes, least)
    for cap in range(least + 1, max_gpus + 1):  # more GPUs while that saves restarts
        if sum(starts(chain, keys).values()) == distinct:
            break
        chain = _order(cells, orders, keys, sizes, cap)
    return chain


def _greedy(cells: list[Cell], keys: dict[str, list[str]]) -> list[list[int]]:
    """Per first cell (by position), the greedy order of ``cells``' positions: the next is the
    one with the least cost ``(new instances + later restarts, -kept instances, later uses of
    its instances by the cells left, position)``; a cell expected to fail ends its instances
    (:func:`simulate`), so it costs one restart per instance of it a cell left still needs,
    and what it used is not kept for the next. A cell's cost changes only when a cell sharing
    one of its keys is chosen, so costs are updated through a key -> cells index: one pass is
    O(cells^2 + cells x keys x sharers)."""
    need = [frozenset(keys.get(c.id, [])) for c in cells]
    ends = [c.expect_fail for c in cells]
    sharers: dict[str, list[int]] = {}
    for i, ks in enumerate(need):
        for k in ks:
            sharers.setdefault(k, []).append(i)
    out = []
    for first in range(len(cells)):
        left = {k: len(v) - (k in need[first]) for k, v in sharers.items()}  # cells left needing k
        live = set() if ends[first] else set(need[first])
        cost = {
            i: (
                len(need[i] - live) + ends[i] * sum(left[k] > 1 for k in need[i]),
                -len(need[i] & live),
                sum(left[k] - 1 for k in need[i]),
                i,
            )
            for i in range(len(cells))
            if i != first
        }
        order = [first]
        while cost:
            nxt = min(cost, key=cost.__getitem__)
            del cost[nxt]
            order.append(nxt)
            for k in need[nxt]:  # k: one fewer cell left; live after it unless it ends it (new <-> kept)
                left[k] -= 1
                was, now = k in live, not ends[nxt]
                for i in sharers[k]:
                    if i in cost:
                        n, kept, later, pos = cost[i]
                        n += was - now - (ends[i] and left[k] == 1)  # i alone left: ending k restarts none
                        cost[i] = (n, kept + was - now, later - 1, pos)
                if now:
                    live.add(k)
                else:
                    live.discard(k)
        out.append(order)
    return out


def _order(
    cells: list[Cell], orders: list[list[int]], keys: dict[str, list[str]], sizes: dict[str, int], capacity: int
) -> Chain:
    """Of the :func:`_greedy` ``orders``, the one with the fewest starts on ``capacity`` GPUs
    (then fewest cells starting any, then earliest first cell), with its :func:`simulate` stops."""
    best: tuple[tuple[int, int, int], list[int], list[set[str]]] | None = None
    for order in orders:
        n, stops, fresh = simulate([cells[i] for i in order], keys, sizes, capacity)
        score = (n, sum(fresh), order[0])
        if best is None or score < best[0]:
            best = (score, order, stops)
    assert best is not None
    return Chain(tuple(cells[i] for i in best[1]), tuple(frozenset(s) for s in best[2]), capacity)


def starts(chain: Chain, keys: dict[str, list[str]]) -> dict[str, int]:
    """How often each instance key starts with the chain's stops."""
    out: dict[str, int] = {}
    live: set[str] = set()
    for c, stop in zip(chain.cells, chain.stops or [frozenset()] * len(chain.cells)):
        need = set(keys.get(c.id, []))
        for k in need - live:
            out[k] = out.get(k, 0) + 1
        live = (live | need) - stop
    return out
