"""Place cells over the nodes x GPUs of a cluster (a Slurm allocation, or ``pdsweep plan
--nodes N --gpus-per-node G``).

Rules: an instance's GPU group (its TP x DP ranks) lives on one node, because vLLM's TP
group runs on one host unless a multi-node backend (Ray, ``--nnodes``) is configured,
which pdsweep does not do (vllm/config/parallel.py ``ParallelConfig``: ``nnodes`` 1);
prefill and decode instances may sit on different nodes (NIXL reaches the prefill side
channel at ``VLLM_NIXL_SIDE_CHANNEL_HOST``). Groups are placed largest first, each on the
node with the fewest free GPUs that still holds it (best fit), so concurrent cells pack.
On CPU (no GPUs) a cell holds the whole allocation: prefill instances (and a reference)
run on the first node, decode instances on the last, so with two nodes P and D are apart.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from pdsweep.plan.expand import Cell
from pdsweep.plan.instance import PORTS_PER_SLOT, Slot


@dataclass(frozen=True)
class Cluster:
    """Node names and GPUs per node (0: CPU nodes)."""

    nodes: tuple[str, ...]
    gpus_per_node: int
    addrs: tuple[str, ...] = ()  # address of each node (Slurm NodeAddr); empty: the names

    def addr(self, node: str) -> str:
        return self.addrs[self.nodes.index(node)] if self.addrs else node

    @classmethod
    def synthetic(cls, n: int, gpus_per_node: int) -> Cluster:
        """``n`` nodes named ``node0..`` (a dry-run plan of a cluster we are not on)."""
        return cls(tuple(f"node{i}" for i in range(n)), gpus_per_node)

    @property
    def num_gpus(self) -> int:
        return len(self.nodes) * self.gpus_per_node

    def describe(self) -> str:
        return f"{len(self.nodes)} node{'s' if len(self.nodes) != 1 else ''} x {self.gpus_per_node} GPUs"


def groups(cell: Cell) -> list[int]:
    """GPUs of each instance in instance order (prefill-i, then decode-i, or single-0):
    TP, times PP for prefill and DP for decode. Same order as :func:`pdsweep.plan.instance.instances`."""
    if cell.kind == "ref":
        return [cell.decode_tp]
    return [cell.prefill_tp * cell.prefill_pp] * cell.num_prefill + [cell.decode_tp * cell.decode_dp] * cell.num_decode


def fit_groups(sizes: list[int], free: dict[str, list[int]]) -> list[tuple[str, tuple[int, ...]]] | None:
    """Node and GPU ids per group (in the order of ``sizes``), taken from ``free`` (node ->
    free GPU ids, not modified), or None when the groups do not fit."""
    left = {n: list(g) for n, g in free.items()}
    out: list[tuple[str, tuple[int, ...]] | None] = [None] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: -sizes[i]):
        fits = [n for n in left if len(left[n]) >= sizes[i]]
        if not fits:
            return None
        node = min(fits, key=lambda n: len(left[n]))  # best fit; ties: first node
        out[i] = (node, tuple(left[node][: sizes[i]]))
        left[node] = left[node][sizes[i] :]
    return out  # type: ignore[return-value]


def min_nodes(sizes: list[int], gpus_per_node: int) -> int:
    """Nodes of ``gpus_per_node`` GPUs the groups need (first fit decreasing; a group
    larger than a node counts as unplaceable: returns 0)."""
    if any(s > gpus_per_node for s in sizes):
        return 0
    bins: list[int] = []
    for s in sorted(sizes, reverse=True):
        for j, used in enumerate(bins):
            if used + s <= gpus_per_node:
                bins[j] += s
                break
        else:
            bins.append(s)
    return len(bins)


def needs(cell: Cell, cluster: Cluster) -> str | None:
    """Why ``cell`` can never run on ``cluster`` (e.g. "needs 12 GPUs on 2 nodes,
    allocation has 1 node x 8 GPUs"), or None when it fits an empty cluster."""
    if not cell.num_gpus:
        return None
    sizes = groups(cell)
    m = min_nodes(sizes, cluster.gpus_per_node)
    if m == 0:
        return (
            f"needs {max(sizes)} GPUs on one node for one TP group ({cell.num_gpus} GPUs in all), "
            f"allocation has {cluster.describe()}"
        )
    if m > len(cluster.nodes):
        return f"needs {cell.num_gpus} GPUs on {m} nodes, allocation has {cluster.describe()}"
    return None


class LanePool:
    """What every pool shares: port lanes (lane ``i`` owns ``PORTS_PER_SLOT`` ports from
    ``port_base + i * PORTS_PER_SLOT``; the lowest free lane is taken) and, on CPU, one cell
    at a time holding every core. Subclasses place GPUs (:class:`ClusterPool`,
    :class:`pdsweep.plan.schedule.GpuPool`) under :attr:`lock`."""

    def __init__(self, port_base: int, cpus: tuple[int, ...] = ()) -> None:
        self.port_base, self.cpus = port_base, cpus
        self.lanes: set[int] = set()
        self.cpu_busy = False
        self.lock = threading.RLock()  # re-entered by try_acquire_both

    def _take_cpu(self) -> bool:
        """Claim the CPU for a GPU-less cell (under the lock); False when another holds it."""
        if self.cpu_busy:
            return False
        self.cpu_busy = True
        return True

    def try_acquire(self, cell: Cell) -> Slot | None:
        """A lane (and GPUs) for ``cell``, or None when not free now (subclasses)."""
        raise NotImplementedError

    def release(self, slot: Slot) -> None:
        raise NotImplementedError

    def try_acquire_both(self, a: Cell, b: Cell) -> tuple[Slot, Slot] | None:
        """Slots for ``a`` and ``b`` at once (the two sides of a ``bench.pair_builds`` pair),
        or None when they are not free together; taken under one hold of :attr:`lock`, so no
        other cell gets between them. On CPU both share one claim of every core."""
        with self.lock:
            first = self.try_acquire(a)
            if first is None:
                return None
            if not first.gpus:
                self.cpu_busy = False  # the second side shares the first's CPU claim
            second = self.try_acquire(b)
            if second is None:
                self.release(first)
                return None
            return first, second

    def _take_lane(self) -> int:
        lane = min(set(range(len(self.lanes) + 1)) - self.lanes)
        self.lanes.add(lane)
        return lane

    def _free_lane(self, slot: Slot) -> None:
        self.lanes.discard(slot.index)
        if not slot.gpus:
            self.cpu_busy = False


class ClusterPool(LanePool):
    """Thread-safe pool of (node, GPU) pairs and port lanes, the over-nodes sibling of
    :class:`pdsweep.plan.schedule.GpuPool` (same ``fits`` / ``try_acquire`` / ``release``)."""

    def __init__(self, cluster: Cluster, port_base: int, cpus: tuple[int, ...] = ()) -> None:
        super().__init__(port_base, cpus)
        self.cluster = cluster
        self.free = {n: list(range(cluster.gpus_per_node)) for n in cluster.nodes}
        self.num_gpus = cluster.num_gpus
        self.held: dict[int, list[tuple[str, tuple[int, ...]]]] = {}

    def fits(self, cell: Cell) -> bool:
        return needs(cell, self.cluster) is None

    def needs(self, cell: Cell) -> str:
        return needs(cell, self.cluster) or ""

    def try_acquire(self, cell: Cell) -> Slot | None:
        """Place ``cell`` on free GPUs now (a lane of ports with it), or None."""
        with self.lock:
            if cell.num_gpus == 0:
                if not self._take_cpu():
                    return None
                first, last = self.cluster.nodes[0], self.cluster.nodes[-1]
                placed: list[tuple[str, tuple[int, ...]]]  # (node, its GPUs)
                placed = [(first, ())] * (cell.num_prefill if cell.kind == "pd" else 1)
                placed += [(last, ())] * (cell.num_decode if cell.kind == "pd" else 0)
            else:
                got = fit_groups(groups(cell), self.free)
                if got is None:
                    return None
                placed = got
                for node, gpus in placed:
                    self.free[node] = [g for g in self.free[node] if g not in gpus]
            lane = self._take_lane()
            self.held[lane] = placed
            return Slot(
                lane,
                tuple(g for _, gs in placed for g in gs),
                self.port_base + lane * PORTS_PER_SLOT,
                self.cpus,
                hosts=tuple(self.cluster.addr(n) for n, _ in placed),
                nodes=tuple(n for n, _ in placed),
            )

    def release(self, slot: Slot) -> None:
        with self.lock:
            for node, gpus in self.held.pop(slot.index, []):
                self.free[node] = sorted(set(self.free[node]) | set(gpus))
            self._free_lane(slot)
