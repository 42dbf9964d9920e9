"""What the KV integrity digests saw when a PD deployment's first request failed
(:func:`pdsweep.deploy.deployment.first_request`): a failed cell writes no transfer.json, so the
reason itself carries the digests' verdict (:mod:`pdsweep.core.kvintegrity`), e.g. the READ NIXL
refused on the unfixed build with asserts compiled out (docs/integrity.md)."""

from __future__ import annotations

import time

from pdsweep.core.kvintegrity import integrity_reasons
from pdsweep.core.kvpush import cell_integrity
from pdsweep.deploy.launchers import Handle

LOG_SETTLE_S = 1.0  # the worker logs the READ's line before vLLM answers; let its stdout reach the log file


def _text(handles: list[Handle], role: str) -> str:
    out = ""
    for h in handles:
        if not h.name.startswith(role):
            continue
        try:
            with open(h.log_path, errors="replace") as f:
                f.seek(h.log_start)
                out += f.read()
        except OSError:
            continue
    return out


def integrity_note(handles: list[Handle], settle_s: float = LOG_SETTLE_S, push: bool = False) -> list[str]:
    """The integrity reasons of ``handles``' prefill and decode logs from this use on (empty when
    nothing was digested or nothing is wrong), after ``settle_s`` seconds (``push``: a push cell's
    WRITE digests, :mod:`pdsweep.core.kvpush`)."""
    time.sleep(settle_s)
    integ = cell_integrity(_text(handles, "prefill"), _text(handles, "decode"), push)
    return [] if integ.get("not_measured") else integrity_reasons(integ, "KV digests")
