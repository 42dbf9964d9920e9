"""Fault drills: the sweep's ``fault`` axis (names, where each acts and the failure it must end
with: :data:`pdsweep.core.faults.SWEEP_FAULTS`). A drill cell
runs like any PD cell on instances of its own (``PDSWEEP_FAULT_DRILL`` in their env, so no
other cell reuses them) and pdsweep injects the fault while the named phase runs:

- ``kill-prefill-during-eval``: SIGKILL to prefill-0 as lm-eval starts;
- ``kill-decode-during-load``: SIGKILL to decode-0 as the load generator starts.

The kill lands :data:`KILL_AFTER_S` into the phase, while its client is still starting (lm-eval
and ``vllm bench serve`` take seconds to import), so every request of the phase needs the dead
instance and the phase itself fails, on a fast host or a loaded one; no later load run or
checked workload starts once an instance has ended
(:func:`pdsweep.deploy.deployment.stop_if_ended`). A kill 8 s into the phase raced it: on a
quiet 2-core host lm-eval sent its 20 requests concurrently, their prefill
legs ended within half a second of the first, and the eval passed; the death surfaced in the
load phase ("killed ... during bench") and failed the drill's signature (a fresh make sweep, and
1 of 3 reruns with the kill half a second after the first request reached prefill).

- ``fail-read-1-in-K``: not injected here: decode's vLLM reports every K-th completed NIXL
  READ as failed (:mod:`pdsweep.engine.readfault`, ``PDSWEEP_FAIL_READ_EVERY`` set by
  :func:`pdsweep.plan.instance.instances`), and the gate's transfer check holds vLLM's count to
  the injected one (:class:`pdsweep.judge.gate.TransferCheck`).

- ``decode-after-lease-expiry`` (``-1-in-K``): not a kill: the PD proxy holds 1 in 4 (K) decode legs
  :data:`LEASE_MARGIN_S` seconds longer than prefill's KV lease
  (``kv_lease_duration``, :func:`lease_drill_faults`). Prefill's NIXL worker reclaims the
  unread blocks when the lease runs out (vLLM ``nixl/base_worker.py``
  ``_reap_expired_send_leases``: ``vllm:nixl_num_kv_expired_reqs``), the requests the proxy
  did not hold reuse them, and the held decode READs them anyway: the READ succeeds, prefill
  counts its notification (``pull_worker.py`` ``_get_new_notifs``:
  ``vllm:nixl_num_notifications_after_expiry``), and the answer comes back with HTTP 200 from
  whatever the blocks now hold. The gate's transfer check fails the cell naming the counter
  (:func:`pdsweep.judge.gate.stale_reads`); the checked answers name the wrong ones.

- ``scramble-kv-1-in-K``: not a kill: the PD proxy reverses ``remote_block_ids`` in the
  ``kv_transfer_params`` of 1 in K decode legs that arrive while another request is in flight
  (:attr:`pdsweep.core.faults.ProxyFaults.scramble_every`, :func:`lease_drill_faults`): decode
  READs the right number of prefill's blocks in the wrong order, every READ succeeds and the answer
  comes back wrong with HTTP 200. Concurrency 1 is spared, so the load check's answers at
  concurrency 2 and up name the damage (the planted point of ``sweeps/cpu-pareto.yaml``).

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
from dataclasses import replace

from pdsweep.core.errors import UserError
from pdsweep.core.faults import ProxyFaults, lease_drill_every, scramble_kv_every, sweep_fault
from pdsweep.deploy.launchers import Handle
from pdsweep.plan.cell import Cell
from pdsweep.plan.instance import kv_transfer_config
from pdsweep.sweepfile.sweep import LoadedSweep

log = logging.getLogger(__name__)
KILL_AFTER_S = 1.0  # into the phase: its client (lm-eval, vllm bench serve) has not sent a request yet
VLLM_DEFAULT_LEASE_S = 30  # nixl/base_worker.py: get_from_extra_config("kv_lease_duration", 30)
LEASE_MARGIN_S = 5.0  # held decode legs wait lease + this: the lease has run out and other requests ran
MAX_DRILL_LEASE_S = 10  # every held leg waits the lease: longer makes the drill cell minutes slower


def lease_s(cell: Cell, ls: LoadedSweep) -> int:
    """Prefill's KV lease in seconds as the cell's ``--kv-transfer-config`` sets it
    (``kv_connector_extra_config.kv_lease_duration``), else vLLM's default (30 s)."""
    extra = kv_transfer_config(cell, "prefill", ls).get("kv_connector_extra_config") or {}
    return int(extra.get("kv_lease_duration", VLLM_DEFAULT_LEASE_S))


def lease_drill_faults(cell: Cell, ls: LoadedSweep, base: ProxyFaults) -> ProxyFaults:
    """The PD proxy's faults for ``cell``: ``base`` (the run's test-only options), or for the
    ``decode-after-lease-expiry`` drill the decode delay of the module docstring (seconds:
    lease + :data:`LEASE_MARGIN_S`, 1 in :func:`pdsweep.core.faults.lease_drill_every` legs), for ``scramble-kv-1-in-K``
    ``scramble_every`` K (the proxy's KV scramble under load). Raises UserError
    naming the cell and the field when the drill's lease exceeds :data:`MAX_DRILL_LEASE_S`
    (set ``serve_args.<variant>.kv_transfer_extra.kv_connector_extra_config.kv_lease_duration``)."""
    if every := scramble_kv_every(cell.fault):
        return replace(base, scramble_every=every)
    if (every := lease_drill_every(cell.fault)) is None:
        return base
    lease = lease_s(cell, ls)
    if lease > MAX_DRILL_LEASE_S:
        raise UserError(
            f"cell {cell.id}: fault {cell.fault} needs a short KV lease: kv_lease_duration is {lease} s "
            f"(serve_args.{cell.serve_args}.kv_transfer_extra.kv_connector_extra_config.kv_lease_duration "
            f"or defaults.kv_lease_duration_s; allowed: 1..{MAX_DRILL_LEASE_S})"
        )
    return replace(base, decode_delay_s=lease + LEASE_MARGIN_S, decode_delay_every=every)


def armed(fault: str, handles: list[Handle], on_phase: Callable[[str], None]) -> Callable[[str], None]:
    """``on_phase`` that also injects ``fault`` when its phase begins, for a fault that acts as a
    ``drill`` (:data:`pdsweep.core.faults.SWEEP_FAULTS`: a kill with its phase and target); for
    ``"none"`` and the faults the proxy or decode's vLLM inject, ``on_phase`` itself. Raises
    ``ValueError`` for an unknown fault (the spec's ``Fault`` type refuses it first)."""
    kind = sweep_fault(fault)
    if kind is None or kind.where != "drill":
        return on_phase
    phase, target = kind.phase, kind.target
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
            t = threading.Timer(KILL_AFTER_S, kill)
            t.daemon = True
            t.start()

    return hook
