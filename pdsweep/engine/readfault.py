"""In vLLM's decode workers: the READ-failure drill (sweep fault ``fail-read-1-in-K``).

Installed by pdsweep's vLLM plugin when ``PDSWEEP_FAIL_READ_EVERY=K``
(:data:`pdsweep.core.faults.READ_FAULT_ENV_VAR`; the fault's entry in the vocabulary:
:data:`pdsweep.core.faults.SWEEP_FAULTS`; pdsweep sets it on the
decode instances of a ``fail-read-1-in-K`` cell, :func:`pdsweep.plan.instance.instances`). It
wraps ``NixlWrapper.check_xfer_state`` (NIXL ``nixl_agent``; vLLM
``distributed/nixl_utils.py``), which vLLM's ``_pop_done_transfers``
(``kv_connector/v1/nixl/base_worker.py``) polls for every outstanding READ: every K-th READ
that NIXL reports ``"DONE"`` is reported ``"ERR"`` instead. The bytes have landed and the
handle is idle, so vLLM's failure path runs exactly as for a READ that failed on the wire:
``_handle_failed_transfer`` counts it (``vllm:nixl_num_failed_transfers``) and releases the
handle, the request's blocks are reported invalid (``get_block_ids_with_load_errors``) or the
request failed (``failed_recving``), and the scheduler applies ``kv_load_failure_policy``
(``v1/core/sched/scheduler.py`` ``_handle_invalid_blocks``): ``recompute`` recomputes the
prompt on decode, ``fail`` ends the request in error.

Each injected failure logs one line, counted into transfer.json ``read_faults.injected`` by
:func:`pdsweep.core.logscan.read_fault_counts`::

    PDSWEEP_INJECTED_READ_FAILURE read=<n> every=<K>
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Callable

from pdsweep.core.logtags import READ_FAULT_TAG
from pdsweep.engine.readlog import nixl_wrapper, wrap_once

logger = logging.getLogger("vllm.pdsweep.engine.readfault")


def wrap_check_xfer_state(orig: Callable[..., Any], every: int) -> Callable[..., Any]:
    """``check_xfer_state`` that turns every ``every``-th ``"DONE"`` (counted over this
    process's READs, in the order vLLM sees them done) into ``"ERR"``; other states pass
    through. Raises ValueError for ``every < 1``."""
    if every < 1:
        raise ValueError(f"every must be >= 1, got {every}")
    done = 0
    lock = threading.Lock()

    def check_xfer_state(self: Any, handle: Any) -> Any:
        nonlocal done
        state = orig(self, handle)
        if state != "DONE":
            return state
        with lock:
            done += 1
            n = done
        if n % every:
            return state
        logger.warning("%s read=%d every=%d", READ_FAULT_TAG, n, every)
        return "ERR"

    return check_xfer_state


def install_read_fault(every: int) -> bool:
    """Wrap ``NixlWrapper.check_xfer_state`` once; False when vLLM's NIXL wrapper is absent."""
    wrapper = nixl_wrapper()
    if wrapper is None or not hasattr(wrapper, "check_xfer_state"):
        return False
    wrap_once(wrapper, "check_xfer_state", lambda orig: wrap_check_xfer_state(orig, every))
    return True
