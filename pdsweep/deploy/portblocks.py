"""The port blocks a run holds: :class:`PortBlocks` (pdsweep's allocator, one user per block,
claimed host-wide through :class:`pdsweep.deploy.portlocks.HostClaims`) and :class:`AltBlocks`
(a running cell's lane, or an alternate block when another process holds the lane's ports).
A block is ``PORTS_PER_SLOT`` ports (:mod:`pdsweep.plan.instance`, the one port layout)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from dataclasses import replace

from pdsweep.deploy.deployment import CellFailed, taken_ports
from pdsweep.deploy.portlocks import HostClaims
from pdsweep.plan.instance import PORTS_PER_SLOT, InstanceSpec, Slot, on_slot, ports_fit


class PortBlocks:
    """pdsweep's port allocator: blocks of ports, each held by one user (a pooled instance, a
    cell on its lane or an alternate one) until released, and claimed only when no other
    process on the host claims it (:class:`pdsweep.deploy.portlocks.HostClaims`: another
    ``pdsweep run``, whose instances may not listen yet) and the caller's check finds its
    ports free. Thread-safe; one per user in a run (no module state)."""

    def __init__(self, claims: HostClaims | None = None) -> None:
        self.claimed: set[int] = set()
        self.host = claims if claims is not None else HostClaims()
        self.lock = threading.Lock()

    def claim(self, bases: Iterable[int], free: Callable[[int], bool]) -> int | None:
        """The first base in ``bases`` not held here nor by another process and for which
        ``free(base)``, now held; None if there is none."""
        with self.lock:
            for base in bases:
                if base in self.claimed or not self.host.claim(base):
                    continue
                if free(base):
                    self.claimed.add(base)
                    return base
                self.host.drop(base)
        return None

    def release(self, base: int) -> None:
        with self.lock:
            self.claimed.discard(base)
            self.host.drop(base)

    def close(self) -> None:
        """Release every block (the run has ended)."""
        with self.lock:
            self.claimed.clear()
            self.host.close()


class AltBlocks:
    """A running cell's lane, claimed on the host (:class:`PortBlocks`), or an alternate block
    when another process holds or claims the lane's ports: blocks of ``PORTS_PER_SLOT`` from
    lane :data:`ALT_BLOCKS_FROM` on, each held by one running cell (one per run, no module state)."""

    def __init__(self) -> None:
        self.blocks = PortBlocks()

    def free_slot(
        self, slot: Slot, specs: list[InstanceSpec], proxy_only: bool = False
    ) -> tuple[Slot, list[InstanceSpec]]:
        """``slot`` and ``specs`` (planned on it) if no other run on the host claims the lane and
        none of their ports is taken (``proxy_only``: its proxy port, when the instances get their ports elsewhere,
        :class:`InstancePool`), else the same slot on the first free alternate block with
        ``specs`` moved there (:func:`pdsweep.plan.instance.on_slot`). Raises
        ``CellFailed('start')`` when no block is free."""
        mine = [] if proxy_only else specs
        if self.blocks.claim([slot.port_base], lambda _: not taken_ports(mine, slot)) is not None:
            return slot, specs  # its own lane: no other run on the host claims it, nothing listens there
        first = slot.port_base - slot.index * PORTS_PER_SLOT
        bases = (first + j * PORTS_PER_SLOT for j in range(ALT_BLOCKS_FROM, ALT_BLOCKS_FROM + 64))

        def free(base: int) -> bool:
            alt = replace(slot, port_base=base)
            return not taken_ports([] if proxy_only else on_slot(specs, alt), alt)

        base = self.blocks.claim((b for b in bases if ports_fit(b, PORTS_PER_SLOT)), free)
        if base is None:
            raise CellFailed("start", f"no free block of {PORTS_PER_SLOT} ports found near {slot.port_base}")
        alt = replace(slot, port_base=base)
        return alt, on_slot(specs, alt)

    def release(self, slot: Slot) -> None:
        self.blocks.release(slot.port_base)

    def close(self) -> None:
        """Release every block still held (the run has ended)."""
        self.blocks.close()


ALT_BLOCKS_FROM = 64  # alternates start past any lane a run can use
