"""The planners' fast paths give the plans their plain definitions give (issue 40 item 3: a
1000-cell plan in seconds): the greedy order with incrementally updated costs and the
scheduler's one pass over waiting cells, each against the rule it implements, recomputed from
scratch on random sweeps."""

from __future__ import annotations

import heapq

from fixtures.shapes import SHAPES
from fixtures.shapes import sweep_of as _sweep
from hypothesis import given, settings
from hypothesis import strategies as st

from pdsweep.plan.expand import Cell
from pdsweep.plan.reusepack import _greedy
from pdsweep.plan.schedule import GpuPool, order, pack


def _greedy_by_definition(cells: list[Cell], keys: dict[str, list[str]], first: int) -> list[int]:
    """Each next cell: least (new instances, -kept, later uses of its instances by the cells left, position)."""
    need = [set(keys[c.id]) for c in cells]
    order, live, left = [first], set(need[first]), [i for i in range(len(cells)) if i != first]
    while left:
        cost = {
            i: (
                len(need[i] - live),
                -len(need[i] & live),
                sum(k in need[j] for k in need[i] for j in left if j != i),
                i,
            )
            for i in left
        }
        nxt = min(left, key=cost.__getitem__)
        left.remove(nxt)
        order.append(nxt)
        live |= need[nxt]
    return order


@settings(max_examples=150, deadline=None)
@given(SHAPES)
def test_greedy_order_is_the_one_its_cost_defines(shapes) -> None:
    cells, keys, _ = _sweep(shapes)
    assert _greedy(cells, keys) == [_greedy_by_definition(cells, keys, f) for f in range(len(cells))]


def _pack_by_definition(cells: list[Cell], gpus: int) -> list[tuple[str, float, tuple[int, ...]]]:
    """At each moment, start the first waiting cell (in ``order``) that fits; again until none does."""
    pool, t, running, out, pending = GpuPool(gpus, 20000), 0.0, [], [], [c for c in order(cells) if c.num_gpus <= gpus]
    while pending or running:
        while slot_cell := next(((s, c) for c in pending if (s := pool.try_acquire(c))), None):
            slot, c = slot_cell
            heapq.heappush(running, (t + 100.0 + c.num_gpus, len(out), slot))
            out.append((c.id, t, slot.gpus))
            pending.remove(c)
        if running:
            t, _, slot = heapq.heappop(running)
            pool.release(slot)
    return out


@settings(max_examples=150, deadline=None)
@given(SHAPES, st.integers(1, 12))
def test_pack_places_as_first_fit_in_order_at_each_moment(shapes, gpus) -> None:
    cells, _, _ = _sweep(shapes)
    s = pack(cells, gpus, estimate=lambda c: 100.0 + c.num_gpus)
    assert [(p.cell.id, p.start_s, p.slot.gpus) for p in s.placements] == _pack_by_definition(cells, gpus)
