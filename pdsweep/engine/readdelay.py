"""In vLLM's decode workers: a known KV-transfer slowdown, the test-only knob
``PDSWEEP_READ_DELAY_MS`` (:data:`pdsweep.core.faults.READ_DELAY_ENV_VAR`, in the vocabulary's
:data:`pdsweep.core.faults.ENGINE_OPTIONS`; pdsweep never sets it).

With the READ log on (``PDSWEEP_NIXL_READ_LOG=1``, :mod:`pdsweep.engine.readlog`), the wrapped
``NixlPullConnectorWorker._read_blocks`` (vLLM ``kv_connector/v1/nixl/pull_worker.py``) waits
this many milliseconds after its ``t0`` stamp and before calling vLLM's ``_read_blocks``, which
prepares the descriptors and posts the READ (``make_prepped_xfer`` + ``transfer``). The READ is
posted late, the bytes are the same, and its timed interval ``[t0, tp + xfer_us]``
(:func:`pdsweep.core.logscan.nixl_read_records`) grows by the delay: a KV-transfer-time
slowdown of known size for the perf verdict's teeth (``kv kv_xfer_ms``, bench/test_perf_teeth.py).
The wait blocks decode's worker thread, as a slow post would. One wait per ``_read_blocks``
call: a request reading from k prefill ranks waits k times.

Values: ``MS`` (a number >= 0), or ``@FILE``: the file holds ``MS`` and is read at every READ,
so a bench switches the delay between load runs without restarting decode (a missing or
empty file: 0; a bad value: 0 and a warning, so the bench, not vLLM, fails).
"""

from __future__ import annotations

import logging
import math
import time
from pathlib import Path
from typing import Callable

logger = logging.getLogger("vllm.pdsweep.engine.readdelay")

SPIN_S = 2e-4  # the last 0.2 ms are spun: time.sleep overshoots by ~0.1 ms on Linux


def _ms(text: str, where: str) -> float:
    ms = float(text)
    if not (math.isfinite(ms) and ms >= 0):
        raise ValueError(f"{where}: a delay in ms must be a finite number >= 0, got {text!r}")
    return ms


def read_delay(raw: str) -> Callable[[], float]:
    """The delay source of a ``PDSWEEP_READ_DELAY_MS`` value: a function returning seconds.
    ``"5"`` -> 0.005 always; ``"@/path"`` -> the file's value at each call (module doc).
    Raises ValueError for a bad number or an empty ``@``."""
    raw = raw.strip()
    if not raw.startswith("@"):
        s = _ms(raw, "PDSWEEP_READ_DELAY_MS") / 1e3
        return lambda: s
    if not raw[1:]:
        raise ValueError("PDSWEEP_READ_DELAY_MS=@FILE needs a file path")
    path = Path(raw[1:])

    def from_file() -> float:
        try:
            text = path.read_text().strip()
        except FileNotFoundError:
            return 0.0
        try:
            return _ms(text, str(path)) / 1e3 if text else 0.0
        except ValueError as e:
            logger.warning("pdsweep: no READ delay: %s", e)
            return 0.0

    return from_file


def wait(seconds: float, clock: Callable[[], float] = time.monotonic) -> float:
    """Block for ``seconds`` (sleep, then spin the last :data:`SPIN_S`); returns the seconds
    waited by ``clock``."""
    t = clock()
    end = t + seconds
    while (left := end - clock()) > 0:
        if left > SPIN_S:
            time.sleep(left - SPIN_S / 2)
    return clock() - t
