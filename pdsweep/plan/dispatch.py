"""Cells dispatched onto shared instances that hold their own GPUs (instance reuse on GPUs).

Identical instances (:func:`pdsweep.deploy.instances.instance_key`) are shared across cells.
An instance holds its GPUs from its start until it stops, and serves one cell at a time. One
rule (:class:`Dispatcher`) decides what starts and stops, the same in ``pdsweep plan``
(:func:`simulate`, on the duration model) and in ``pdsweep run``
(:func:`pdsweep.run.gpureuse.run_dispatch`, on real times). At every event (the start, a
cell's end) it walks the waiting cells in the planned priority order (:func:`ordered`):

1. an idle instance that no waiting cell needs stops;
2. a cell whose instances no running cell uses runs, when its new instances fit on the free
   GPUs, or after stopping idle instances it does not need (the one needed furthest ahead
   first, Belady); a cell may stop instances only while no cell before it in the order waits
   for GPUs, so smaller cells cannot starve a larger one by taking what it waits for;
3. a cell waiting only for instances that running cells use starts its new instances now,
   when they fit on free GPUs (prestart: their startup overlaps the running cells' work);
4. when no cell runs and none can start, instances prestarted for waiting cells become idle
   (rule 2 may stop them), so GPUs held for a waiting cell never stall the sweep.

No deadlock: in case 4 every live instance is idle, and the first waiting cell fits on the
node (cells that do not fit are NOT-RUNNABLE before this), so it runs.

A cell expected to fail ends its instances (:func:`ended`).
"""

from __future__ import annotations

import heapq
import random
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from pdsweep.plan.expand import Cell
from pdsweep.plan.reusepack import chains
from pdsweep.plan.schedule import eval_s

# Order search budget: waiting-cell visits of the simulation summed over trials (the mission
# sweep's 41 cells: ~870 visits a trial, ~800 trials in ~2 s on 2 cores; the 1152-combination
# plan's 552 cells: ~213,000, three trials), and at most SEARCH_TRIALS trials (a small sweep needs
# no more)
SEARCH_WORK = 700_000
SEARCH_TRIALS = 1000
# Fewer trials than this within the budget: no search (random swaps of two cells among hundreds
# rarely shorten anything in a few trials; the 552 cells above: the same makespan after 0.9 s)
SEARCH_MIN_TRIALS = 10


def ended(cell: Cell, keys: frozenset[str]) -> frozenset[str]:
    """The instance ``keys`` that ``cell`` leaves stopped: all of them when it is expected to
    fail (``run`` stops every instance of a failed cell, :func:`pdsweep.deploy.deployment.deploy`:
    one may be dead, as pre-#49297 decode after its assert, or in a bad state), else none."""
    return keys if cell.expect_fail else frozenset()


@dataclass(frozen=True)
class Run:
    """Run ``cell``; ``new``: its instances to start (the others are up, idle)."""

    cell: Cell
    new: frozenset[str]


@dataclass(frozen=True)
class Prestart:
    """Start ``keys`` now, for ``cell`` (it waits for instances running cells use)."""

    cell: Cell
    keys: frozenset[str]


@dataclass(frozen=True)
class Stop:
    """Stop the idle instances ``keys`` (wait until each has exited: its GPUs are then free)."""

    keys: frozenset[str]


@dataclass(frozen=True)
class Release:
    """Rule 4: ``keys``, started for waiting cells (:class:`Prestart`), are idle now, anyone's
    to use or stop; bookkeeping only (nothing starts or stops)."""

    keys: frozenset[str]


Action = Run | Prestart | Stop | Release


@dataclass
class Dispatcher:
    """The dispatch rule's state (module docstring). ``order``: the cells, in priority order;
    ``keys``: cell id -> its instance keys; ``sizes``: key -> GPUs; ``num_gpus``: the node's;
    ``prestart``: rule 3 on (``RunOptions.prestart``).
    :meth:`decide` returns what to do now (and assumes it done); :meth:`finish` takes a cell's
    end and the instances gone with it."""

    order: list[Cell]
    keys: dict[str, frozenset[str]]
    sizes: dict[str, int]
    num_gpus: int
    prestart: bool = True
    live: set[str] = field(default_factory=set)
    owner: dict[str, str] = field(default_factory=dict)  # key -> the cell running on it or prestarting it
    running: set[str] = field(default_factory=set)
    visits: int = 0  # waiting cells looked at (the search's work unit)

    def __post_init__(self) -> None:
        self.waiting = list(self.order)
        self.uses: dict[str, list[int]] = {}  # key -> positions of the waiting cells needing it
        for i, c in enumerate(self.order):
            for k in self.keys[c.id]:
                self.uses.setdefault(k, []).append(i)
        self.pos = {c.id: i for i, c in enumerate(self.order)}
        self.left = {k: len(v) for k, v in self.uses.items()}  # waiting cells still needing k
        self.at = set(range(len(self.order)))  # positions of the waiting cells

    def free(self) -> int:
        return self.num_gpus - sum(self.sizes[k] for k in self.live)

    def _next_use(self, k: str) -> int:
        return next((i for i in self.uses.get(k, ()) if i in self.at), len(self.order))

    def decide(self) -> list[Action]:
        """Every action the rule takes now, in order (module docstring, rules 1-4): passes over
        the waiting cells while one stops instances (only a stop makes room for a cell passed
        before it; a run or prestart only takes GPUs and instances)."""
        out: list[Action] = []
        while True:
            unused = frozenset(k for k in self.live if k not in self.owner and not self.left.get(k))
            if unused:  # rule 1
                self.live -= unused
                out.append(Stop(unused))
            acts = self._pass()
            if not acts and not self.running and self.waiting:
                held = [k for k, c in self.owner.items() if c not in self.running]
                if not held:
                    raise RuntimeError(f"no cell can run: {self.waiting[0].id} needs more than {self.num_gpus} GPUs")
                for k in held:  # rule 4
                    del self.owner[k]
                out.append(Release(frozenset(held)))
                continue
            out += acts
            # only a stop (room) can let a cell passed before act: else this pass was the last
            if not any(isinstance(a, Stop) for a in acts):
                return out

    def _pass(self) -> list[Action]:
        """One pass of rules 2-3 over the waiting cells in priority order: its actions."""
        out: list[Action] = []
        waits_for_gpus, free = False, self.free()
        for c in list(self.waiting):
            self.visits += 1
            ks = self.keys[c.id]
            others: set[str] = set()
            if not ks.isdisjoint(self.owner):
                others = {self.owner[k] for k in ks if k in self.owner} - {c.id}
                if others and not others <= self.running:
                    continue
            new = ks - self.live
            need = sum(self.sizes[k] for k in new)
            if others:  # rule 3: prestart beside running cells only (a waiting owner could wait on it)
                if self.prestart and new and need <= free:
                    self.live |= new
                    self.owner.update(dict.fromkeys(new, c.id))
                    free -= need
                    out.append(Prestart(c, new))
                continue
            if need > free:
                if waits_for_gpus:
                    continue
                idle = [k for k in self.live if k not in self.owner and k not in ks]
                if need > free + sum(self.sizes[k] for k in idle):
                    waits_for_gpus = True
                    continue
                gone: set[str] = set()
                for k in sorted(idle, key=lambda k: (-self._next_use(k), k)):
                    if need <= free:
                        break
                    self.live.discard(k)
                    gone.add(k)
                    free += self.sizes[k]
                out.append(Stop(frozenset(gone)))
            self.live |= new
            free -= need
            self.owner.update(dict.fromkeys(ks, c.id))
            self.running.add(c.id)
            self.waiting.remove(c)
            self.at.discard(self.pos[c.id])
            for k in ks:
                self.left[k] -= 1
            out.append(Run(c, new))
        return out

    def finish(self, cell: Cell, gone: Iterable[str] = ()) -> None:
        """``cell`` has ended; ``gone``: the instances that stopped with it (a failed cell's)."""
        self.running.discard(cell.id)
        for k in self.keys[cell.id]:
            if self.owner.get(k) == cell.id:
                del self.owner[k]
        self.live -= set(gone)


@dataclass(frozen=True)
class Inputs:
    """What a dispatch is planned on (the same in :func:`simulate`, :func:`ordered` and
    :func:`first_order`): ``keys`` cell id -> its instance keys; ``sizes`` key -> its GPUs;
    ``num_gpus`` the node's; ``estimate(cell)`` its duration (s: its instances' startup, then
    ``work``); ``ends`` cell id -> the keys it leaves stopped (:func:`ended`); ``prestart`` rule 3
    on (``RunOptions.prestart``); ``work(cell)`` its measured phases once its instances answer (s:
    :func:`pdsweep.plan.schedule.eval_s`, or measured: :meth:`pdsweep.plan.durations.CellClock.work`)."""

    keys: dict[str, frozenset[str]]
    sizes: dict[str, int]
    num_gpus: int
    estimate: Callable[[Cell], float]
    ends: dict[str, frozenset[str]]
    prestart: bool = True
    work: Callable[[Cell], float] = eval_s

    def dispatcher(self, order: list[Cell]) -> Dispatcher:
        """A fresh :class:`Dispatcher` of ``order`` on these inputs."""
        return Dispatcher(order, self.keys, self.sizes, self.num_gpus, self.prestart)


@dataclass(frozen=True)
class Placed:
    """One cell of a simulated dispatch: when it starts (its new instances launch), when its
    measured phases begin (every instance up) and end, the instances started for it
    (``prestarted``: while it waited) and ``launches``, how many instance starts were made for
    it (a key prestarted, released by rule 4 and started again for it counts twice)."""

    cell: Cell
    start_s: float
    ready_s: float
    end_s: float
    started: frozenset[str]
    prestarted: frozenset[str]
    launches: int


def simulate(order: list[Cell], inp: Inputs) -> tuple[list[Placed], int]:
    """The :class:`Dispatcher` run of ``order`` on the duration model: an instance started
    for a cell is up its startup (``inp.estimate(cell)`` minus ``inp.work(cell)``) later; a cell's
    measured phases begin when all its instances are up and take ``inp.work(cell)``;
    at its end the instances ``inp.ends`` names stop. Returns the cells in start order and the
    waiting-cell visits spent (the search's work)."""
    d = inp.dispatcher(order)
    keys, estimate, work = inp.keys, inp.estimate, inp.work
    up: dict[str, float] = {}  # key -> when it answers
    pre: dict[str, set[str]] = {}
    launches: dict[str, int] = {}  # cell id -> instance starts made for it
    events: list[tuple[float, int, str]] = []
    by_id = {c.id: c for c in order}
    out: list[Placed] = []
    t = 0.0
    while True:
        for a in d.decide():
            if isinstance(a, Stop):
                for k in a.keys:
                    up.pop(k, None)
            elif isinstance(a, Release):
                pass  # bookkeeping: counted as started for the cells they were prestarted for
            elif isinstance(a, Prestart):
                ready = t + estimate(a.cell) - work(a.cell)
                up.update(dict.fromkeys(a.keys, ready))
                pre.setdefault(a.cell.id, set()).update(a.keys)
                launches[a.cell.id] = launches.get(a.cell.id, 0) + len(a.keys)
            else:
                c = a.cell
                up.update(dict.fromkeys(a.new, t + estimate(c) - work(c)))
                ready = max([t, *(up[k] for k in keys[c.id])])
                mine = frozenset(pre.pop(c.id, set()) & keys[c.id])
                n = launches.pop(c.id, 0) + len(a.new)
                out.append(Placed(c, t, ready, ready + work(c), a.new | mine, mine, n))
                heapq.heappush(events, (ready + work(c), len(out), c.id))
        if not events:
            return out, d.visits
        t, _, cid = heapq.heappop(events)
        gone = inp.ends.get(cid, frozenset())
        for k in gone:
            up.pop(k, None)
        d.finish(by_id[cid], gone)


def makespan(placed: list[Placed]) -> float:
    """The end of the last cell of ``placed`` (0 when none)."""
    return max((p.end_s for p in placed), default=0.0)


def ordered(first: list[Cell], inp: Inputs) -> tuple[list[Cell], list[Placed]]:
    """The priority order with the shortest :func:`simulate` makespan found from ``first``, and
    its simulation: seeded random swaps of two cells, each kept when it does not lengthen the
    makespan, within :data:`SEARCH_WORK` and :data:`SEARCH_TRIALS`; none when the budget holds
    fewer than :data:`SEARCH_MIN_TRIALS` (``first`` then). Deterministic: the same sweep gives
    the same order in ``plan`` and ``run``."""
    cur = list(first)
    placed, work = simulate(cur, inp)
    best, budget = makespan(placed), SEARCH_WORK - work
    if budget < SEARCH_MIN_TRIALS * work:
        return cur, placed
    rnd = random.Random(0)
    for _ in range(SEARCH_TRIALS):
        if budget <= 0 or len(cur) < 2:
            break
        a, b = rnd.sample(range(len(cur)), 2)
        trial = list(cur)
        trial[a], trial[b] = trial[b], trial[a]
        got, work = simulate(trial, inp)
        budget -= work
        if (m := makespan(got)) <= best:
            cur, best, placed = trial, m, got
    return cur, placed


def first_order(cells: list[Cell], inp: Inputs) -> list[Cell]:
    """The search's start: cells sharing instances together (the groups of
    :func:`pdsweep.plan.reusepack.chains`, each in its order of fewest instance starts), the
    group with the most estimated work first."""
    groups = chains(cells, {c.id: sorted(inp.keys[c.id]) for c in cells}, inp.sizes, inp.num_gpus)
    groups.sort(key=lambda g: -sum(inp.estimate(c) for c in g.cells))
    return [c for g in groups for c in g.cells]
