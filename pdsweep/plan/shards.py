"""A sweep cut into ``n`` jobs (``--shard i/n``) that keep whole instance chains.

Cells are joined when they share an instance (the chains of :mod:`pdsweep.plan.reusepack`:
:func:`pdsweep.deploy.instances.instance_key` equal), and by ``links`` the caller gives (a PD
cell and its single-instance reference, whose answers the judge compares in one run
directory; the two cells of a ``bench.pair_builds`` pair, measured interleaved). Each joined
group goes whole to one shard: longest first (estimated seconds, one cell after the other),
onto the shard with the least so far (ties: the lower index); the seconds are the plan's
(:class:`pdsweep.plan.durations.CellClock`: measured in ``--durations-from RUN_DIR``, else the
model). The cut depends on nothing but the cells and those seconds, so every job given the same
``--durations-from`` computes the same one: disjoint shards whose union is the sweep.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from pdsweep.plan.cell import Cell
from pdsweep.plan.reusepack import groups
from pdsweep.results.celltimes import RunDurations

MAX_SHARDS = 256


@dataclass(frozen=True)
class Shard:
    """Job ``index`` (1-based) of ``count``."""

    index: int
    count: int

    def __str__(self) -> str:
        return f"{self.index}/{self.count}"


@dataclass(frozen=True)
class JobArgs:
    """The job flags of ``plan``/``validate``/``run``: ``--shard i/n``, ``--budget MINUTES``
    (:mod:`pdsweep.plan.clock`) and ``--durations-from RUN_DIR`` (measured cell durations:
    :mod:`pdsweep.plan.durations`)."""

    shard: Shard | None = None
    budget: float | None = None
    durations: RunDurations | None = None


def parse_shard(text: str) -> Shard:
    """``i/n`` -> :class:`Shard`; raises ``ValueError`` naming the allowed values."""
    try:
        i, n = (int(x) for x in text.split("/"))
    except ValueError:
        raise ValueError(f"--shard {text!r}: expected i/n (e.g. 1/2), integers") from None
    if not 1 <= n <= MAX_SHARDS or not 1 <= i <= n:
        raise ValueError(f"--shard {text}: allowed 1 <= i <= n <= {MAX_SHARDS}")
    return Shard(i, n)


def cut(
    cells: list[Cell],
    count: int,
    keys: Mapping[str, Iterable[str]],
    links: Iterable[tuple[str, str]],
    estimate: Callable[[Cell], float],
) -> list[list[Cell]]:
    """``count`` disjoint lists of ``cells`` (each in the cells' order; some may be empty when
    there are fewer groups than shards) whose union is ``cells``, no :func:`groups` group split."""
    load = [0.0] * count
    members: list[set[str]] = [set() for _ in range(count)]
    gs = groups(cells, keys, links)
    for g in sorted(gs, key=lambda g: -sum(estimate(c) for c in g)):  # stable: ties keep plan order
        i = min(range(count), key=lambda j: (load[j], j))
        load[i] += sum(estimate(c) for c in g)
        members[i] |= {c.id for c in g}
    return [[c for c in cells if c.id in m] for m in members]
