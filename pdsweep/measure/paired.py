"""Paired, interleaved load repeats of two cells that differ only by build (``bench.pair_builds``).

Both cells are deployed at once (:mod:`pdsweep.run.pairs`); each runs its non-load phases as
alone, then the load phase waits until both have reached it, and the two sides' repeats take
turns in ABBA order (:func:`abba_order`: ``a b b a a b ...``), so a drift in the machine's
load hits both sides of a pair and a first-mover effect cancels over pairs (Kalibera and
Jones, "Rigorous benchmarking in reasonable time", ISMM 2013). Neither side runs a request
while the other measures; a side leaves its checked workloads until every turn is done.

Each side's load.json then carries ``pairing: {id, side, partner, order, repeats}``; the judge
(:func:`pdsweep.judge.perf.paired_with`) takes the paired t interval for two bodies with one
``id`` on opposite sides. When the partner fails (or never reaches the load phase) the other
side goes on alone: its repeats are kept, its load.json has no ``pairing`` but ``unpaired``
saying why (the independent interval is used).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

from pdsweep.deploy.deployment import CellFailed

SIDES = ("a", "b")


def abba_order(repeats: int) -> list[str]:
    """The sides in the order they run, ``2 * repeats`` entries: pair ``i`` runs ``a`` then ``b``
    when ``i`` is even, ``b`` then ``a`` when odd (``a b b a a b``). Raises ``ValueError`` for
    fewer than 1 repeat."""
    if repeats < 1:
        raise ValueError(f"paired repeats need at least 1 repeat, got {repeats}")
    return [s for i in range(repeats) for s in (SIDES if i % 2 == 0 else SIDES[::-1])]


class PairTurns:
    """The turns of one pair, shared by its two cells' threads: ``cells`` maps side (``a``,
    ``b``) to cell id, ``repeats`` load repeats a side, ``stop`` the run's interrupt flag
    (a waiting side raises :class:`pdsweep.deploy.deployment.CellFailed` once it is set)."""

    def __init__(
        self, pair_id: str, cells: dict[str, str], repeats: int, stop: Callable[[], bool] = lambda: False
    ) -> None:
        self.id, self.cells, self.repeats, self.stop = pair_id, dict(cells), repeats, stop
        self.order = abba_order(repeats)
        seen = dict.fromkeys(SIDES, 0)
        self.schedule: list[tuple[str, int]] = []  # (side, repeat index) in run order
        for s in self.order:
            self.schedule.append((s, seen[s]))
            seen[s] += 1
        self.pos = 0  # turns done
        self.arrived: set[str] = set()
        self.gone: dict[str, str] = {}  # side -> why it left before its last turn
        self.cond = threading.Condition()

    def side(self, side: str) -> PairSide:
        """The handle of one side (``a`` or ``b``); raises ``KeyError`` for another."""
        if side not in self.cells:
            raise KeyError(side)
        return PairSide(self, side)

    def _wait(self, ready: Callable[[], bool], what: str) -> None:
        with self.cond:
            while not ready():
                if self.stop():
                    raise CellFailed("bench", f"interrupted while waiting for {what} (pair {self.id})")
                self.cond.wait(0.2)


class PairSide:
    """One cell's view of its :class:`PairTurns`: ``arrive`` at the load phase, take each
    repeat's ``turn``, ``finish`` (wait for the last turn), ``leave`` when the cell ends."""

    def __init__(self, turns: PairTurns, side: str) -> None:
        self.turns, self.name = turns, side
        self.other = next(s for s in SIDES if s != side)
        self.partner = turns.cells[self.other]
        self.repeats = turns.repeats

    @property
    def broken(self) -> str | None:
        """Why this side is measured alone (the partner left before its last turn), else None."""
        with self.turns.cond:
            why = self.turns.gone.get(self.other)
        return None if why is None else f"partner {self.partner} left before the paired repeats were done: {why}"

    def arrive(self) -> None:
        """This side reached its load phase: wait until the partner has too (or left)."""
        t = self.turns
        with t.cond:
            t.arrived.add(self.name)
            t.cond.notify_all()
        t._wait(lambda: self.other in t.arrived or self.other in t.gone, f"{self.partner} to reach its load phase")

    @contextlib.contextmanager
    def turn(self, i: int) -> Iterator[None]:
        """Repeat ``i`` of this side: waits for its place in the ABBA order, unless the partner
        left (then it runs at once). An exception inside leaves the pair (the partner goes on alone)."""
        t = self.turns
        t._wait(
            lambda: self.other in t.gone or t.pos >= len(t.schedule) or t.schedule[t.pos] == (self.name, i),
            f"{self.partner}'s turn",
        )
        try:
            yield
        except BaseException as e:
            self.leave(f"failed in its load repeat {i}: {type(e).__name__}: {e}")
            raise
        with t.cond:
            if t.pos < len(t.schedule) and t.schedule[t.pos] == (self.name, i):
                t.pos += 1
            t.cond.notify_all()

    def finish(self) -> None:
        """Wait until every turn of both sides is done (or the partner left): nothing of this
        side (its checked workloads) runs while the partner measures."""
        t = self.turns
        t._wait(lambda: self.other in t.gone or t.pos >= len(t.schedule), f"{self.partner}'s last repeat")

    def leave(self, why: str) -> None:
        """This cell ended (``why``: its status and reason); the partner goes on alone if the
        turns were not all done. Idempotent."""
        t = self.turns
        with t.cond:
            if t.pos < len(t.schedule) and self.name not in t.gone:
                t.gone[self.name] = why
            t.cond.notify_all()

    def load_fields(self) -> dict[str, Any]:
        """What this side's load.json gets: ``{"pairing": {id, side, partner, order, repeats}}``
        when every turn ran paired, else ``{"unpaired": why}``."""
        why = self.broken
        if why is not None:
            return {"unpaired": why}
        t = self.turns
        return {
            "pairing": {
                "id": t.id,
                "side": self.name,
                "partner": self.partner,
                "order": "".join(t.order),
                "repeats": t.repeats,
            }
        }


class Unpaired:
    """A cell the sweep meant to pair that runs alone (no partner to run with, resume, the pair
    does not fit the pool): the plain repeats, and load.json ``unpaired: why``."""

    def __init__(self, why: str) -> None:
        self.why = why

    def load_fields(self) -> dict[str, Any]:
        return {"unpaired": self.why}
