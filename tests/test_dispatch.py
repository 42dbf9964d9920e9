"""The dispatch rule of instance reuse on GPUs (pdsweep.plan.dispatch, docs/gpu-reuse.md): on
random sweeps every cell runs once, live instances never need more GPUs than the node has, no
instance serves two running cells, and the rule never stalls; prestart overlaps a waiting cell's
startup with the running cells; a cell dying on pre-#49297's assert ends only its decode; the
mission's plan on 8 GPUs."""

from __future__ import annotations

import heapq
from types import SimpleNamespace

from fixtures.shapes import SHAPES, sweep_of
from hypothesis import given, settings
from hypothesis import strategies as st

from pdsweep.plan.dispatch import (
    Dispatcher,
    Inputs,
    Prestart,
    Release,
    Run,
    Stop,
    ended,
    first_order,
    makespan,
    ordered,
    simulate,
)
from pdsweep.plan.expand import Cell, expand
from pdsweep.plan.schedule import EVAL_S, FIRST_REQUEST_S
from pdsweep.run.gpureuse import record
from pdsweep.sweepfile.sweep import load_sweep


def _run_checked(order, keys, sizes, gpus, ends, dur) -> list[str]:
    """Drive a :class:`Dispatcher` with durations ``dur`` (cell id -> s), checking its invariants
    after every decision from its actions alone; returns the cells in the order they ran."""
    d = Dispatcher(order, keys, sizes, gpus)
    live: set[str] = set()
    busy: dict[str, str] = {}  # key -> running cell
    mine: dict[str, str] = {}  # key -> the waiting cell it was prestarted for
    events: list[tuple[float, int, str]] = []
    ran: list[str] = []
    t = 0.0
    while True:
        for a in d.decide():
            if isinstance(a, Release):  # rule 4: only when no cell runs, of instances prestarted for waiting ones
                assert not busy and a.keys and all(mine.get(k) in d.pos for k in a.keys)
                for k in a.keys:
                    del mine[k]
            elif isinstance(a, Stop):
                assert not a.keys & busy.keys(), "stopped an instance a running cell uses"
                live -= a.keys
                for k in a.keys:
                    mine.pop(k, None)
            elif isinstance(a, Prestart):
                rest = keys[a.cell.id] - a.keys  # up: busy in running cells (one at least), idle, or its own
                assert not a.keys & live and rest <= live and any(k in busy for k in rest)
                assert all(mine.get(k, a.cell.id) == a.cell.id for k in rest), "another waiting cell's instance"
                live |= a.keys
                mine.update(dict.fromkeys(a.keys, a.cell.id))
            else:
                assert isinstance(a, Run) and a.cell.id not in ran
                ks = keys[a.cell.id]
                assert not ks & busy.keys(), "an instance serves two running cells"
                assert not a.new & live and ks - a.new <= live
                assert all(mine.get(k, a.cell.id) == a.cell.id for k in ks), "took another cell's prestarted instance"
                live |= a.new
                busy.update(dict.fromkeys(ks, a.cell.id))
                for k in ks:
                    mine.pop(k, None)
                ran.append(a.cell.id)
                heapq.heappush(events, (t + dur[a.cell.id], len(ran), a.cell.id))
            assert sum(sizes[k] for k in live) <= gpus, "live instances need more GPUs than the node has"
        if not events:
            return ran
        t, _, cid = heapq.heappop(events)
        for k in keys[cid]:
            del busy[k]
        live -= ends[cid]
        d.finish(next(c for c in order if c.id == cid), ends[cid])


@settings(max_examples=200, deadline=None)
@given(SHAPES, st.integers(4, 12), st.randoms(use_true_random=False))
def test_every_cell_runs_once_within_the_gpus_and_never_on_a_busy_instance(shapes, gpus, rnd) -> None:
    cells, lists, sizes = sweep_of(shapes)
    keys = {k: frozenset(v) for k, v in lists.items()}
    cells = [c for c in cells if sum(sizes[k] for k in keys[c.id]) <= gpus]  # larger: NOT-RUNNABLE before
    ends = {c.id: frozenset(keys[c.id]) if rnd.random() < 0.3 else frozenset() for c in cells}
    dur = {c.id: rnd.choice([5.0, 30.0, 120.0, 300.0]) for c in cells}
    rnd.shuffle(cells)
    ran = _run_checked(cells, keys, sizes, gpus, ends, dur)
    assert sorted(ran) == sorted(c.id for c in cells)


def test_a_cell_waiting_for_a_busy_instance_prestarts_its_new_ones_when_they_fit() -> None:
    a, b = Cell("m", 1, 1, 16, 16, 1, 1, "cuda", "fixed"), Cell("m", 2, 1, 16, 16, 1, 1, "cuda", "fixed")
    keys = {a.id: frozenset({"P1", "D1"}), b.id: frozenset({"P2", "D1"})}  # b waits for D1, busy in a
    sizes = {"P1": 1, "D1": 1, "P2": 2}

    def est(c: Cell) -> float:
        return 300.0 + EVAL_S["cuda"]  # startup 300 s

    ends = dict.fromkeys(keys, frozenset())
    roomy, _ = simulate([a, b], Inputs(keys, sizes, 4, est, ends))
    # P2 starts at 0 beside a's P1 and D1: up at 300 s, before a ends (420 s); b begins then
    assert [(p.cell.id, p.start_s, p.ready_s, p.end_s) for p in roomy] == [(a.id, 0, 300, 420), (b.id, 420, 420, 540)]
    assert roomy[1].prestarted == {"P2"} and roomy[1].started == {"P2"}
    tight, _ = simulate([a, b], Inputs(keys, sizes, 3, est, ends))  # no room for P2 until a's P1 stops
    assert [(p.start_s, p.ready_s, p.end_s) for p in tight] == [(0, 300, 420), (420, 720, 840)]
    assert not tight[1].prestarted
    off, _ = simulate([a, b], Inputs(keys, sizes, 4, est, ends, prestart=False))  # RunOptions.prestart off: as tight
    assert [(p.start_s, p.ready_s, p.end_s) for p in off] == [(0, 300, 420), (420, 720, 840)] and not off[1].prestarted


def test_a_cell_stops_idle_instances_furthest_needed_first_but_never_overtakes_a_waiting_one() -> None:
    c = {n: SimpleNamespace(id=n) for n in "abcdef"}
    keys = {n: frozenset(k) for n, k in {"a": "A", "b": "B", "c": "C", "d": "X", "e": "B", "f": "A"}.items()}
    d = Dispatcher([c[n] for n in "abcdef"], keys, {"A": 2, "B": 2, "C": 2, "X": 4}, 6)
    assert d.decide() == [Run(c[n], keys[n]) for n in "abc"]
    for n in "abc":
        d.finish(c[n])
    # C: needed by nobody, stops at once; d needs 4 GPUs of idle A (f needs it, last) and B (e, next): A goes
    assert d.decide() == [Stop(frozenset("C")), Stop(frozenset("A")), Run(c["d"], keys["d"]), Run(c["e"], frozenset())]
    # p waits for GPUs (6 > 2 free + idle Y): r fits on the free 2 and runs, s would have to stop Y
    # (t needs it): it waits, behind p; t runs on Y, which is up
    w = {n: SimpleNamespace(id=n) for n in "prst"}
    keys = {n: frozenset(k) for n, k in {"p": "Q", "r": "Z", "s": "W", "t": "Y"}.items()}
    d = Dispatcher([w[n] for n in "prst"], keys, {"Q": 6, "Z": 2, "W": 2, "X": 4, "Y": 2}, 8)
    d.live, d.owner, d.running = {"X", "Y"}, {"X": "x"}, {"x"}  # X busy in a running cell x
    assert d.decide() == [Run(w["r"], keys["r"]), Run(w["t"], frozenset())]
    assert [c.id for c in d.waiting] == ["p", "s"] and "Y" in d.live


def test_gpus_held_for_waiting_cells_are_released_when_nothing_else_can_run() -> None:
    # rule 4: no cell runs; c and d each hold a prestarted instance and wait for 3 GPUs that only
    # the other's prestart could give: both prestarts become idle, and c stops d's Y to run
    c, d = SimpleNamespace(id="c"), SimpleNamespace(id="d")
    keys = {"c": frozenset("XJ"), "d": frozenset("YK")}
    disp = Dispatcher([c, d], keys, {"X": 1, "Y": 2, "J": 3, "K": 3}, 4)
    disp.live, disp.owner = {"X", "Y"}, {"X": "c", "Y": "d"}
    assert disp.decide() == [Release(frozenset("XY")), Stop(frozenset("Y")), Run(c, frozenset("J"))]


def test_instance_starts_count_a_prestart_released_and_started_again() -> None:
    # 4 GPUs. m3 prestarts A beside m0; m1 (D, 3 GPUs) then needs B and C stopped; when m1 ends
    # m2 waits for 1 GPU that only m3's idle-held A gives and m3 may not overtake it: rule 4
    # releases A, m2 stops it, and m3 starts A again. 7 starts in all, 3 of them for m3.
    cells, lists, sizes = sweep_of([(1, 1, [("B", 1), ("C", 1)]), (1, 1, [("D", 3)]), (1, 1, [("C", 1), ("D", 3)])])
    cells.append(Cell("m3", 1, 1, 16, 16, 1, 1, "cuda", "fixed"))
    keys = {**{k: frozenset(v) for k, v in lists.items()}, cells[3].id: frozenset("AB")}
    est = dict(zip((c.id for c in cells), (10.0, 100.0, 10.0, 300.0)))
    inp = Inputs(keys, {**sizes, "A": 1}, 4, lambda c: est[c.id] + EVAL_S["cuda"], dict.fromkeys(keys, frozenset()))
    placed, _ = simulate(cells, inp)
    assert [(p.cell.id[:2], p.launches) for p in placed] == [("m0", 2), ("m1", 1), ("m2", 1), ("m3", 3)]
    assert placed[3].started == {"A", "B"} and placed[3].prestarted == {"A"}
    assert record(placed, inp.estimate)["instance_starts"] == 7


def test_an_expected_failure_ends_its_instances_and_a_dying_cell_costs_its_first_request() -> None:
    cells = {c.id: c for c in expand(load_sweep(_mission())).cells}
    twin, crash = cells["kimi-linear.p4d4.b128-128.unfixed"], cells["kimi-linear.p4d2.b128-128.unfixed"]
    after = cells["kimi-linear.p4d4.b128-128.fixed"]  # stands in for a later user of the same prefill
    assert ended(crash, frozenset({"P", "D"})) == {"P", "D"} and ended(after, frozenset({"P"})) == set()
    keys = {twin.id: frozenset({"P", "D4"}), crash.id: frozenset({"P", "D2"}), after.id: frozenset({"P", "D1"})}
    sizes = {"P": 4, "D4": 4, "D2": 2, "D1": 1}
    ends = {c: ended(cells[c], k) for c, k in keys.items()}
    placed, _ = simulate([twin, crash, after], Inputs(keys, sizes, 8, lambda c: 200.0 + EVAL_S["cuda"], ends))
    got = {p.cell.id: p for p in placed}
    # no room to prestart D2 beside twin's 8 GPUs; then the crash reuses P (up), starts D2 and pays its first
    # request only (pre-#49297 decode dies there); it ends P, so the later cell starts P again
    assert got[crash.id].started == {"D2"} and got[crash.id].end_s - got[crash.id].ready_s == FIRST_REQUEST_S["cuda"]
    assert got[after.id].started == {"P", "D1"}


def test_the_mission_plan_on_8_gpus() -> None:
    from pdsweep.run.dryrun import plan_dict

    d = plan_dict(str(_mission()), 8)
    r, sched = d["reuse"], d["reuse"]["schedule"]
    assert (r["distinct"], r["per_cell"]) == (49, 71)
    paired = {c for p in d["pairs"]["pairs"] for c in (p["a"], p["b"])}  # build pairs run before the dispatch
    assert (
        len(r["order"]) == 40 and len(paired) == 16 and {p["cell"] for p in sched["cells"]} == set(r["order"]) - paired
    )
    assert r["distinct"] <= sched["instance_starts"] < r["per_cell"]  # reuse: fewer starts than uses
    assert d["makespan"] == {
        "s": round(sched["makespan_s"] + d["makespan"]["pairs_s"], 1),
        "follows": "reuse dispatch",
        "pairs_s": d["makespan"]["pairs_s"],
    }
    assert sched["makespan_s"] == max(p["end_s"] for p in sched["cells"]) < sched["sequential_s"] / 2
    # cells run at once: at the busiest moment more than one
    starts = sorted(p["start_s"] for p in sched["cells"])
    assert max(sum(p["start_s"] <= t < p["end_s"] for p in sched["cells"]) for t in starts) >= 3


def test_the_search_never_lengthens_the_first_order() -> None:
    cells, keys, sizes = sweep_of([(1, 1, [("A", 2), ("B", 2)]), (2, 1, [("A", 2), ("C", 4)]), (1, 2, [("D", 4)])] * 2)
    keys = {k: frozenset(v) for k, v in keys.items()}
    ends = dict.fromkeys(keys, frozenset())
    est = {c.id: 100.0 + 50 * i for i, c in enumerate(cells)}

    inp = Inputs(keys, sizes, 8, lambda c: est[c.id], ends)

    def span(order) -> float:
        return makespan(simulate(order, inp)[0])

    first = first_order(cells, inp)
    best, placed = ordered(first, inp)
    assert makespan(placed) == span(best)
    assert sorted(c.id for c in best) == sorted(c.id for c in cells) and span(best) <= span(first)


def test_no_search_when_the_budget_holds_too_few_trials(monkeypatch) -> None:
    from pdsweep.plan import dispatch

    cells, keys, sizes = sweep_of([(1, 1, [("A", 2), ("B", 2)]), (2, 1, [("A", 2), ("C", 4)]), (1, 2, [("D", 4)])] * 2)
    inp = Inputs(
        {k: frozenset(v) for k, v in keys.items()}, sizes, 8, lambda c: 200.0, dict.fromkeys(keys, frozenset())
    )
    first = first_order(cells, inp)
    work = simulate(first, inp)[1]
    calls = []
    monkeypatch.setattr(dispatch, "simulate", lambda *a: calls.append(a) or simulate(*a))
    monkeypatch.setattr(dispatch, "SEARCH_WORK", work * dispatch.SEARCH_MIN_TRIALS)  # room for 9 trials: none run
    assert ordered(first, inp)[0] == first and len(calls) == 1
    monkeypatch.setattr(dispatch, "SEARCH_WORK", work * (dispatch.SEARCH_MIN_TRIALS + 1))  # 10 trials: searched
    calls.clear()
    ordered(first, inp)
    assert len(calls) == dispatch.SEARCH_MIN_TRIALS + 1


def _mission():
    from pathlib import Path

    return Path(__file__).resolve().parents[1] / "sweeps" / "hybrid-mla-mamba.yaml"
