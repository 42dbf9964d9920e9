"""Fault drills: the sweep's ``fault`` axis (:data:`pdsweep.spec.sweep.Fault`). A drill cell
runs like any PD cell on instances of its own (``PDSWEEP_FAULT_DRILL`` in their env, so no
other cell reuses them) and pdsweep injects the fault while the named phase runs:

- ``kill-prefill-during-eval``: SIGKILL to prefill-0 :data:`DELAY_S` seconds into lm-eval;
- ``kill-decode-during-load``: SIGKILL to decode-0 :data:`DELAY_S` seconds into the load phase.

- ``fail-read-1-in-K``: not injected here: decode's vLLM reports every K-th completed NIXL
  READ as failed (:mod:`pdsweep.engine.readfault`, ``PDSWEEP_FAIL_READ_EVERY`` set by
  :func:`pdsweep.plan.expand.instances`), and the gate's transfer check holds vLLM's count to
  the injected one (:class:`pdsweep.judge.gate.TransferCheck`).

A kill drill's cell must then fail naming the instance and how it ended (``prefill-0 (pid N) killed by
signal 9 (SIGKILL) during eval; ...``, :func:`pdsweep.deploy.deployment.blame`), with no hang
and nothing left running; the sweep declares that with ``expect: fail`` and a ``match:``, so
the gate calls the drill XFAIL, and FAIL if the cell ends any other way (or passes).
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from collections.abc import Callable

from pdsweep.deploy.launchers import Handle
from pdsweep.spec.sweep import read_fault_every

log = logging.getLogger(__name__)
DELAY_S = 8.0  # into the phase: lm-eval / the load generator have started (2-core CPU: ~5 s to import)
DRILLS = {  # fault -> (phase as on_phase names it, instance)
    "kill-prefill-during-eval": ("eval", "prefill-0"),
    "kill-decode-during-load": ("bench", "decode-0"),
}


def armed(fault: str, handles: list[Handle], on_phase: Callable[[str], None]) -> Callable[[str], None]:
    """``on_phase`` that also injects ``fault`` (a key of :data:`DRILLS`, or ``"none"``: then
    ``on_phase`` itself) when its phase begins. Raises ``KeyError`` for an unknown fault (the
    spec's ``Fault`` type refuses it first)."""
    if fault == "none" or read_fault_every(fault):  # a READ fault is injected in decode's vLLM
        return on_phase
    phase, target = DRILLS[fault]
    fired = threading.Event()

    def kill() -> None:
        h = next((h for h in handles if h.name == target), None)
        if h is None or not h.alive():
            log.warning("fault drill %s: %s is not running; nothing killed", fault, target)
            return
        log.warning("fault drill %s: SIGKILL to %s (pid %d)", fault, target, h.pid)
        os.kill(h.pid, signal.SIGKILL)

    def hook(p: str) -> None:
        on_phase(p)
        if p == phase and not fired.is_set():
            fired.set()
            t = threading.Timer(DELAY_S, kill)
            t.daemon = True
            t.start()

    return hook
