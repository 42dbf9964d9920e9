"""Pack cells onto disjoint GPU sets so independent cells run at the same time.

List scheduling (longest first, first fit) over a :class:`GpuPool`; the same pool is
used by ``run`` at run time with real durations. Each concurrently running cell gets a
*lane*: a private block of ``PORTS_PER_SLOT`` ports, so no two concurrent cells can
collide on HTTP, ``VLLM_PORT`` or NIXL side-channel ports.
"""

from __future__ import annotations

import heapq
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from pdsweep.core.errors import UserError
from pdsweep.plan.expand import Cell
from pdsweep.plan.gpus import free_gpu_ids, inventory
from pdsweep.plan.instance import PORTS_PER_SLOT, Slot, check_ports
from pdsweep.plan.placement import LanePool, groups
from pdsweep.plan.readplan import UNFIXED_SIGNATURE

# Rough per-cell durations for the makespan estimate (seconds); real runs log real ones. CPU: the
# medians of a cpu-smoke run on a shared 2-core box (40 instance starts 39.6 s, 24 cells' eval +
# consistency + bench 37.2 s; bench/test_duration_model.py), was 90 s and 120 s (0.44x and 0.31x).
STARTUP_S = {"cuda": 300.0, "cpu": 40.0}
EVAL_S = {"cuda": 120.0, "cpu": 40.0}  # a cell's measured phases, per platform
# ... of a cell whose decode dies at its first PD request (dies_at_first_request): CPU measured
# (cpu-smoke's tiny-mla-mamba2 p2d1 unfixed failed 5.1 s after ready, 2026-12-06), CUDA assumed
# (NIXL handshake with every prefill rank, the request, teardown; no GPU measurement yet)
FIRST_REQUEST_S = {"cuda": 30.0, "cpu": 5.0}


def detect_gpus() -> int:
    """Number of GPUs ``nvidia-smi`` lists that no other process holds (busy ones are
    logged and left out: :func:`detect_gpu_ids`); 0 when it is absent or fails."""
    return len(detect_gpu_ids())


def detect_gpu_ids() -> tuple[int, ...]:
    """Indices of this host's free GPUs (:func:`pdsweep.plan.gpus.free_gpu_ids`), the ids
    :class:`GpuPool` hands out; a GPU another user's process holds is never among them."""
    return free_gpu_ids(inventory())


def dies_at_first_request(cell: Cell) -> bool:
    """True for a PD cell expected to fail on pre-#49297 vLLM's single-read assert (its
    ``expect_match`` finds :data:`pdsweep.plan.readplan.UNFIXED_SIGNATURE`): the decode worker
    dies in ``_read_blocks_for_req`` (nixl/pull_worker.py) on the cell's first PD request, so
    the cell ends then (``pdsweep.deploy.deployment.first_request`` raises), without its eval."""
    return bool(
        cell.kind == "pd" and cell.expect_fail and cell.expect_match and re.search(cell.expect_match, UNFIXED_SIGNATURE)
    )


def eval_s(cell: Cell) -> float:
    """Estimated seconds of ``cell``'s measured phases (eval, consistency, bench) once its
    instances answer: :data:`EVAL_S` of its platform, :data:`FIRST_REQUEST_S` for a cell that
    :func:`dies_at_first_request`."""
    return (FIRST_REQUEST_S if dies_at_first_request(cell) else EVAL_S)[cell.platform]


def estimate_s(cell: Cell) -> float:
    """Estimated wall time of one cell: startup (longer for more instances) + :func:`eval_s`."""
    instances = 1 if cell.kind == "ref" else cell.num_prefill + cell.num_decode
    return STARTUP_S[cell.platform] * (1 + 0.1 * (instances - 1)) + eval_s(cell)


def check_port_range(num_gpus: int, port_base: int) -> None:
    """Raise ``UserError`` unless every lane's port block fits below
    :data:`pdsweep.plan.instance.MAX_PORT` (:func:`pdsweep.plan.instance.check_ports`): up to
    ``max(1, num_gpus)`` concurrent cells, ``PORTS_PER_SLOT`` ports each from ``port_base``."""
    if num_gpus < 0:
        raise UserError(f"--gpus {num_gpus}: a GPU count is >= 0")
    lanes = max(1, num_gpus)
    check_ports(
        port_base,
        lanes * PORTS_PER_SLOT,
        f"defaults.port_base {port_base} with {num_gpus} GPUs: up to {lanes} concurrent cells (lower port_base)",
    )


class HasGpus(Protocol):
    """What :class:`GpuPool` reads of a cell: its GPU count (a :class:`Cell`, or a chain's need)."""

    @property
    def num_gpus(self) -> int: ...


class GpuPool(LanePool):
    """Thread-safe pool of GPU ids and port lanes on one host. On CPU (``num_gpus == 0``)
    one cell runs at a time and holds every core. ``ids``: the GPU indices to hand out
    (default ``0..num_gpus-1``; :func:`detect_gpu_ids` leaves busy GPUs out). ``unfit``:
    cell id -> why its instances do not fit these GPUs' memory
    (:func:`pdsweep.run.preflight.memory_fit`); such a cell never fits (NOT-RUNNABLE)."""

    def __init__(
        self,
        num_gpus: int,
        port_base: int,
        cpus: tuple[int, ...] = (),
        ids: tuple[int, ...] | None = None,
        unfit: dict[str, str] | None = None,
    ) -> None:
        check_port_range(num_gpus, port_base)
        super().__init__(port_base, cpus)
        self.ids = tuple(range(num_gpus)) if ids is None else tuple(ids)[:num_gpus]
        self.free = set(self.ids)
        self.num_gpus = num_gpus
        self.unfit = dict(unfit or {})

    def fits(self, cell: HasGpus) -> bool:
        if getattr(cell, "id", None) in self.unfit:
            return False
        return cell.num_gpus <= self.num_gpus if cell.num_gpus else True

    def needs(self, cell: Cell) -> str:
        """Why ``cell`` does not fit (the run.json / plan reason): too few GPUs, or the
        memory arithmetic of its instance that does not fit."""
        if cell.num_gpus > self.num_gpus or cell.id not in self.unfit:
            return f"needs {cell.num_gpus} GPUs, host has {self.num_gpus}"
        return self.unfit[cell.id]

    def try_acquire(self, cell: HasGpus) -> Slot | None:
        """Take GPUs and a lane for ``cell``, or None when they are not free now."""
        with self.lock:
            if cell.num_gpus == 0:
                if not self._take_cpu():
                    return None
                gpus: tuple[int, ...] = ()
            else:
                if len(self.free) < cell.num_gpus:
                    return None
                gpus = tuple(sorted(self.free)[: cell.num_gpus])
                self.free -= set(gpus)
            lane = self._take_lane()
            return Slot(lane, gpus, self.port_base + lane * PORTS_PER_SLOT, self.cpus)

    def take_lane(self) -> Slot:
        """A lane of ports without GPUs (:func:`pdsweep.run.gpureuse.run_dispatch` hands GPUs
        out per instance); :meth:`release` gives it back."""
        with self.lock:
            lane = self._take_lane()
            return Slot(lane, (), self.port_base + lane * PORTS_PER_SLOT, self.cpus)

    def release(self, slot: Slot) -> None:
        with self.lock:
            self.free |= set(slot.gpus)
            self._free_lane(slot)


@dataclass(frozen=True)
class Placement:
    cell: Cell
    slot: Slot
    start_s: float
    end_s: float


@dataclass
class Schedule:
    placements: list[Placement]
    too_big: list[Cell]  # need more GPUs than the host has: listed as "needs N GPUs"
    reasons: dict[str, str] = field(default_factory=dict)  # too_big cell id -> why

    @property
    def makespan_s(self) -> float:
        return max((p.end_s for p in self.placements), default=0.0)

    @property
    def serial_s(self) -> float:
        return sum(p.end_s - p.start_s for p in self.placements)

    @property
    def ratio(self) -> float:
        """Makespan over one-by-one time (1.0 = no overlap; lower is better)."""
        return self.makespan_s / self.serial_s if self.serial_s else 1.0

    def to_dict(self) -> dict:
        return {
            "makespan_s": self.makespan_s,
            "serial_s": self.serial_s,
            "ratio": self.ratio,
            "placements": [
                {
                    "cell": p.cell.id,
                    "gpus": list(p.slot.gpus),
                    "instances": instance_placement(p),
                    "lane": p.slot.index,
                    "port_base": p.slot.port_base,
                    "start_s": p.start_s,
                    "end_s": p.end_s,
                }
                for p in self.placements
            ],
            "needs_more_gpus": [
                {"cell": c.id, "needs": c.num_gpus, "reason": self.reasons.get(c.id)} for c in self.too_big
            ],
        }


def instance_placement(p: Placement) -> list[dict]:
    """Node and GPU ids of each instance of a placement (``prefill-0``, ``decode-0``, ...),
    in the order :func:`pdsweep.plan.instance.instances` hands out ``slot.gpus``."""
    c, slot, out, i = p.cell, p.slot, [], 0
    names = (
        ["single-0"]
        if c.kind == "ref"
        else [f"prefill-{k}" for k in range(c.num_prefill)] + [f"decode-{k}" for k in range(c.num_decode)]
    )
    for k, (name, size) in enumerate(zip(names, groups(c))):
        gpus = list(slot.gpus[i : i + size]) if slot.gpus else []
        i += size if slot.gpus else 0
        out.append({"name": name, "node": slot.node(k) or slot.host(k), "host": slot.host(k), "gpus": gpus})
    return out


def order(cells: list[Cell], rank: Callable[[Cell], float] | None = None) -> list[Cell]:
    """Run order: references first (PD cells are judged against them), then the
    largest cells first (LPT: most GPUs, then longest by ``rank``, seconds: default
    :func:`estimate_s`; :meth:`pdsweep.plan.durations.CellClock.rank` with measured durations),
    stable otherwise."""
    rank = rank or estimate_s
    return sorted(cells, key=lambda c: (c.kind != "ref", -c.num_gpus, -rank(c)))


def not_runnable(cells: list[Cell], pool: Any, ref_of: Callable[[Cell], str] | None = None) -> dict[str, str]:
    """Cell id -> why it is NOT-RUNNABLE on ``pool``: it does not fit (``pool.needs``), or it
    is a reference cell (``ref_of``: PD cell -> its reference's id) that only PD cells of
    ``cells`` that do not fit are compared with: running it would judge nothing. A reference
    no PD cell of ``cells`` names (``--cells`` chose it alone) runs."""
    out = {c.id: pool.needs(c) for c in cells if not pool.fits(c)}
    if ref_of is None:
        return out
    users: dict[str, list[Cell]] = {}
    for c in cells:
        if c.kind == "pd":
            users.setdefault(ref_of(c), []).append(c)
    for c in cells:
        pds = users.get(c.id, [])
        if c.kind == "ref" and c.id not in out and pds and all(p.id in out for p in pds):
            out[c.id] = f"reference of NOT-RUNNABLE cells only ({len(pds)}, e.g. {pds[0].id}): nothing to compare"
    return out


def pack(
    cells: list[Cell],
    num_gpus: int,
    port_base: int = 20000,
    pool=None,
    estimate=None,
    ref_of: Callable[[Cell], str] | None = None,
    rank: Callable[[Cell], float] | None = None,
) -> Schedule:
    """Simulate the run-time scheduler with estimated durations (``estimate``: cell ->
    seconds, default :func:`estimate_s`; :func:`pdsweep.plan.startup.estimator` by model size),
    on ``pool`` (default a :class:`GpuPool` of ``num_gpus``; a :class:`pdsweep.plan.placement.ClusterPool`
    places over nodes), in :func:`order` by ``rank``; cells :func:`not_runnable` (with ``ref_of``) are left
    out with their reason.
    Returns placements whose concurrent cells hold disjoint GPUs and distinct lanes.
    """
    estimate = estimate or estimate_s
    pool = pool or GpuPool(num_gpus, port_base)
    why = not_runnable(cells, pool, ref_of)
    runnable = [c for c in order(cells, rank) if c.id not in why]
    too_big = [c for c in cells if c.id in why]
    running: list[tuple[float, int, Slot]] = []  # heap of (end, start order, slot)
    out: list[Placement] = []
    t, pending = 0.0, list(runnable)
    while pending or running:
        left = []  # one pass in order: a cell that did not fit does not fit after a later one starts
        for c in pending:
            slot = pool.try_acquire(c)
            if slot:
                end = t + estimate(c)
                heapq.heappush(running, (end, len(out), slot))
                out.append(Placement(c, slot, t, end))
            else:
                left.append(c)
        pending = left
        if running:
            t, _, slot = heapq.heappop(running)
            pool.release(slot)
    return Schedule(out, too_big, why)


# ---------------------------------------------------------------- reuse: order and lifecycle
def reuse_order(cells: list[Cell], keys: dict[str, set[str]]) -> list[Cell]:
    """Run order with instance reuse (``keys``: cell id -> :func:`pdsweep.deploy.instances.instance_key`
    of each instance it needs). References first, then the PD cells as paths through the
    sharing graph (two cells adjacent when they share an instance): each connected group
    in :func:`order`, starting at a cell with the fewest sharing neighbours, each next cell
    the one sharing most with the current one (ties: fewest neighbours, then order). So
    consecutive cells share what they can and a shared instance stays up between them."""
    base = order(cells)
    refs, pd = [c for c in base if c.kind == "ref"], [c for c in base if c.kind != "ref"]
    rank = {c.id: i for i, c in enumerate(pd)}
    users: dict[str, set[str]] = {}  # instance key -> the PD cells needing it
    for c in pd:
        for k in keys.get(c.id, ()):
            users.setdefault(k, set()).add(c.id)
    nbrs = {c.id: set().union(*(users[k] for k in keys.get(c.id, ()))) - {c.id} for c in pd}
    left, out = {c.id: c for c in pd}, []
    while left:
        first = next(iter(sorted(left, key=rank.__getitem__)))
        group, todo = set[str](), [first]
        while todo:
            x = todo.pop()
            if x in group:
                continue
            group.add(x)
            todo += [y for y in nbrs[x] if y in left]
        cur: str | None = min(group, key=lambda x: (len(nbrs[x] & group), rank[x]))
        while cur is not None:
            out.append(left.pop(cur))
            group.discard(cur)
            share = {x: len(keys.get(cur, set()) & keys.get(x, set())) for x in group}
            cur = min(group, key=lambda x: (-share[x], len(nbrs[x] & group), rank[x])) if group else None
    return refs + out


def lifecycle(cells: list[Cell], keys: dict[str, list[str]], ids: dict[str, str], prestart: bool = True) -> list[dict]:
    """When each instance starts and stops when ``cells`` run in this order, one at a time,
    keeping an instance up only while the next cell needs it (:meth:`InstancePool.keep_only`):
    one row per start, ``{instance_id, cells, start_before, start_during, stop_after}``
    (``start_during``: the cell whose measurement overlaps the start, with ``prestart``).
    ``keys``: cell id -> instance keys in instance order; ``ids``: key -> instance id."""
    rows: list[dict] = []
    live: dict[str, dict] = {}
    for i, c in enumerate(cells):
        for k in keys.get(c.id, []):
            if k not in live:
                live[k] = {
                    "instance_id": ids[k],
                    "cells": [],
                    "start_before": c.id,
                    "start_during": cells[i - 1].id if prestart and i else None,
                    "stop_after": None,
                }
                rows.append(live[k])
            live[k]["cells"].append(c.id)
        nxt = set(keys.get(cells[i + 1].id, [])) if i + 1 < len(cells) else set()
        for k in [k for k in live if k not in nxt]:
            live.pop(k)["stop_after"] = c.id
    return rows
