"""The chain planner's fast paths give the plans their plain definitions give (issue 40 item 3:
a 1000-cell plan in seconds): the greedy order with incrementally updated costs, the search's
makespan-only simulation and the scheduler's one pass over waiting cells, each against the
rule it implements, recomputed from scratch on random sweeps."""

from __future__ import annotations

import heapq

from hypothesis import given, settings
from hypothesis import strategies as st

from pdsweep.plan.chainorder import best_variant, holds, makespan, simulate
from pdsweep.plan.expand import Cell
from pdsweep.plan.reusepack import _greedy, chains
from pdsweep.plan.schedule import GpuPool, order, pack

# a cell: (prefill TP, decode TP, instances: (key, GPUs) pairs from a small pool so cells share)
KEYS = st.lists(
    st.tuples(st.sampled_from("ABCDEFGH"), st.integers(1, 4)), min_size=1, max_size=3, unique_by=lambda x: x[0]
)
SHAPES = st.lists(st.tuples(st.integers(1, 4), st.integers(1, 4), KEYS), min_size=1, max_size=14)


def _sweep(shapes) -> tuple[list[Cell], dict[str, list[str]], dict[str, int]]:
    cells = [Cell(f"m{i}", p, d, 16, 16, 1, 1, "cuda", "fixed") for i, (p, d, _) in enumerate(shapes)]
    keys = {c.id: [k for k, _ in ks] for c, (_, _, ks) in zip(cells, shapes)}
    sizes = {k: n for _, _, ks in shapes for k, n in ks}  # a key's size: the last one drawn
    return cells, keys, sizes


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


@settings(max_examples=100, deadline=None)
@given(SHAPES, st.integers(4, 12), st.randoms(use_true_random=False))
def test_search_makespan_is_the_full_simulations(shapes, gpus, rnd) -> None:
    cells, keys, sizes = _sweep(shapes)
    estimate = {c.id: 60.0 + 7.3 * (i % 5) for i, c in enumerate(cells)}.__getitem__
    chs = [best_variant(c, keys, sizes, gpus, lambda c: estimate(c.id)) for c in chains(cells, keys, sizes, gpus)]
    chs = [c for c in chs if holds(c, keys, sizes)[0] <= gpus]  # as ordered(): larger ones never start
    for _ in range(3):
        rnd.shuffle(chs)
        full = simulate(chs, keys, sizes, lambda c: estimate(c.id), GpuPool(gpus, 20000))
        lean = simulate(chs, keys, sizes, lambda c: estimate(c.id), GpuPool(gpus, 20000), steps=False)
        assert makespan(lean) == makespan(full) and (makespan(full) > 0) == bool(chs)
        assert [len(x) for x in lean] == [min(len(x), 1) for x in full]
        for row in full:  # the slot a step holds is the chain's hold at that cell
            assert all(len(s.slot.gpus) >= s.cell.num_gpus for s in row)
            assert [len(s.slot.gpus) for s in row] == sorted((len(s.slot.gpus) for s in row), reverse=True)


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
