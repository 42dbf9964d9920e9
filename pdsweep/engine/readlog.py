"""In vLLM's workers: one log line per completed NIXL READ (pull mode, decode) or WRITE (push
mode, prefill), naming the prefill rank read from (the prefill rank that wrote), so a run
records the bytes moved per prefill rank (transfer.json ``reads_by_prefill_rank``,
``writes_by_prefill_rank``). vLLM's ``vllm:nixl_bytes_transferred`` sums over every rank;
with prefill TP > decode TP on a hybrid MLA + SSM model (vLLM PR #49297) the split is the
point: the MLA latent comes from one rank, the SSM shards from all of them.

Installed by pdsweep's vLLM plugin when ``PDSWEEP_NIXL_READ_LOG=1`` (pdsweep sets it on
decode instances). It wraps two methods and changes no value:

- ``NixlPullConnectorWorker._read_blocks`` (vLLM ``kv_connector/v1/nixl/pull_worker.py``):
  the handles it appends to ``_recving_transfers[request_id]`` are mapped to
  ``read_spec.remote_rank`` and the remote engine;
- ``NixlWrapper.get_xfer_telemetry`` (NIXL ``nixl_agent``; vLLM ``distributed/nixl_utils.py``),
  which vLLM calls once per READ that is DONE (``base_worker.py``): the mapped handle is
  logged with NIXL's ``totalBytes`` and ``descCount`` as

      PDSWEEP_NIXL_READ remote_engine=<id> remote_rank=<r> bytes=<n> descs=<k> req=<request id>
      t0=<s> t1=<s> xfer_us=<us> tp=<s>

``t0``: ``time.monotonic()`` (CLOCK_MONOTONIC, one clock for every process of the host) when
vLLM called ``_read_blocks`` (descriptors not yet prepared), ``tp`` when it called NIXL's
``transfer`` for this READ (:func:`wrap_transfer`; when that wrapper is absent, when
``_read_blocks`` returned), ``t1`` when vLLM saw it DONE; ``xfer_us``: NIXL's ``xferDuration`` from the post (-1 when
NIXL has none). The test-only READ delay (:mod:`pdsweep.engine.readdelay`) waits between
``t0`` and the post. Parsed by :func:`pdsweep.core.logscan.nixl_reads_by_rank` and
:func:`pdsweep.core.logscan.nixl_read_records` (the transfer intervals of a load repeat).

The WRITE log (``PDSWEEP_NIXL_WRITE_LOG=1``, set on the prefill instances of push cells) wraps
``NixlPushConnectorWorker._xfer_blocks`` (vLLM ``nixl/push_worker.py``: posts one WRITE to one
decode rank and returns its handle, which ``_xfer_blocks_for_req`` adds to
``_sending_transfers``; ``base_worker.py`` ``_pop_done_transfers`` calls ``get_xfer_telemetry``
once it is DONE) and logs, with the same telemetry wrapper,

    PDSWEEP_NIXL_WRITE local_rank=<prefill tp rank> remote_engine=<decode engine id>
    remote_rank=<decode rank> bytes=<n> descs=<k> req=<request id> t0=<s> t1=<s> xfer_us=<us>

parsed by :func:`pdsweep.core.logscan.nixl_writes_by_rank`.
"""

from __future__ import annotations

import importlib
import logging
import re
import time
from typing import Any, Callable

from pdsweep.core.logtags import NIXL_READ_TAG, NIXL_WRITE_TAG
from pdsweep.engine.readdelay import wait

logger = logging.getLogger("vllm.pdsweep.engine.readlog")
_SPACE = re.compile(r"\s")


def log_word(text: str) -> str:
    """``text`` (a request id: vLLM takes it from the client's ``X-Request-Id``) as one field of a log line:
    each whitespace character (tab, no-break space, ...; the parsers' ``\\S+``) an underscore."""
    return _SPACE.sub("_", text)


def wrap_read_blocks(
    orig: Callable[..., Any], posted: dict[Any, tuple[Any, ...]], delay: Callable[[], float] | None = None
) -> Callable[..., Any]:
    """``_read_blocks`` that records, for each handle it posts, ``(remote engine, remote rank,
    request id, t0, tp)`` in ``posted`` (vLLM passes every argument by keyword): monotonic
    seconds when vLLM was asked to read and when its ``_read_blocks`` returned, the READ posted.
    ``delay`` (test-only, :mod:`pdsweep.engine.readdelay`): seconds to wait between ``t0`` and
    vLLM's ``_read_blocks``, so the READ is posted that much later, inside its timed interval."""

    def _read_blocks(self: Any, *args: Any, **kw: Any) -> Any:
        spec = kw.get("read_spec", args[0] if args else None)
        req = kw.get("request_id")
        before = len(self._recving_transfers.get(req, ()))
        t0 = time.monotonic()
        if delay is not None and (s := delay()) > 0:
            wait(s)
        ok = orig(self, *args, **kw)
        done = time.monotonic()
        assert spec is not None, "vLLM's _read_blocks got no read_spec"
        for handle in self._recving_transfers.get(req, [])[before:]:
            tp = _POST_AT.pop(handle, done)  # NIXL's transfer() called (wrap_transfer), else _read_blocks returned
            posted[handle] = (str(kw.get("dst_engine_id")), int(spec.remote_rank), str(req), t0, tp)
        return ok

    return _read_blocks


def wrap_transfer(orig: Callable[..., Any], post_at: dict[Any, float]) -> Callable[..., Any]:
    """``NixlWrapper.transfer`` (NIXL ``nixl_agent.transfer``: posts a prepared READ) that records
    the monotonic time it was called at in ``post_at[handle]``: NIXL's ``xferDuration`` counts
    from there. The post itself can take milliseconds (on 2 cores it waited 2-5 ms for NIXL's
    progress thread on some READs, the READ done on return), so the end of a READ is this time
    plus ``xferDuration``, not the time the post returned plus it."""

    def transfer(self: Any, handle: Any, *args: Any, **kw: Any) -> Any:
        post_at[handle] = time.monotonic()
        return orig(self, handle, *args, **kw)

    return transfer


def wrap_xfer_blocks(orig: Callable[..., Any], posted: dict[Any, tuple[Any, ...]]) -> Callable[..., Any]:
    """Push ``_xfer_blocks`` that records the handle it returns (None: nothing posted) as
    ``(remote engine, decode rank, request id, monotonic post time, WRITE tag, prefill tp rank)``
    in ``posted`` (vLLM passes every argument by keyword)."""

    def _xfer_blocks(self: Any, *args: Any, **kw: Any) -> Any:
        spec = kw.get("read_spec", args[0] if args else None)
        t0 = time.monotonic()
        handle = orig(self, *args, **kw)
        if handle is not None and spec is not None:
            posted[handle] = (
                str(kw.get("dst_engine_id")),
                int(spec.remote_rank),
                str(kw.get("request_id")),
                t0,
                NIXL_WRITE_TAG,
                int(self.tp_rank),
            )
        return handle

    return _xfer_blocks


def wrap_telemetry(orig: Callable[..., Any], posted: dict[Any, tuple[Any, ...]]) -> Callable[..., Any]:
    """``get_xfer_telemetry`` that logs one :data:`~pdsweep.core.logtags.NIXL_READ_TAG` (or, for
    a WRITE, :data:`~pdsweep.core.logtags.NIXL_WRITE_TAG` with ``local_rank``) line for a handle
    ``posted`` names (and forgets it); other handles pass through silently."""

    def get_xfer_telemetry(self: Any, handle: Any) -> Any:
        res = orig(self, handle)
        where = posted.pop(handle, None)
        if where is not None and res is not None:
            xfer = getattr(res, "xferDuration", None)
            read = len(where) < 6
            tag = NIXL_READ_TAG if read else f"{where[4]} local_rank={where[5]}"
            logger.info(
                "%s remote_engine=%s remote_rank=%d bytes=%d descs=%d req=%s t0=%.6f t1=%.6f xfer_us=%d%s",
                tag,
                where[0],
                where[1],
                int(res.totalBytes),
                int(res.descCount),
                log_word(where[2]) or "-",
                where[3],
                time.monotonic(),
                int(xfer) if isinstance(xfer, (int, float)) else -1,
                f" tp={where[4]:.6f}" if read and len(where) > 4 else "",
            )
        return res

    return get_xfer_telemetry


def nixl_wrapper() -> Any:
    """vLLM's ``NixlWrapper`` class (``vllm/distributed/nixl_utils.py``: NIXL's ``nixl_agent``),
    or None when this vLLM or its NIXL has none."""
    try:
        from vllm.distributed.nixl_utils import NixlWrapper
    except Exception:  # noqa: BLE001 - another vLLM layout: the plugin warns
        return None
    return NixlWrapper


def wrap_once(owner: Any, attr: str, make: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
    """Replace ``owner.attr`` by ``make(owner.attr)``, marked ``_pdsweep``, unless pdsweep
    already did (a second plugin load in one process)."""
    orig = getattr(owner, attr)
    if getattr(orig, "_pdsweep", False):
        return
    new = make(orig)
    new._pdsweep = True  # type: ignore[attr-defined]
    setattr(owner, attr, new)


# handles posted and not yet DONE, shared by the READ and WRITE wrappers of one process
# (one get_xfer_telemetry wrapper serves both)
_POSTED: dict[Any, tuple[Any, ...]] = {}
# handle -> monotonic time NIXL's transfer() was called for it (wrap_transfer; READ log only)
_POST_AT: dict[Any, float] = {}


def _install(module: str, cls: str, method: str, wrap: Any) -> bool:
    """Wrap ``module.cls.method`` with ``wrap(orig, _POSTED)`` and NIXL's ``get_xfer_telemetry``
    once; False when that vLLM worker, its method or NIXL is absent."""
    try:
        worker = getattr(importlib.import_module(f"vllm.distributed.kv_transfer.kv_connector.v1.nixl.{module}"), cls)
    except Exception:  # noqa: BLE001 - another vLLM layout: the plugin warns
        return False
    wrapper = nixl_wrapper()
    if wrapper is None or not hasattr(worker, method):
        return False
    wrap_once(worker, method, lambda orig: wrap(orig, _POSTED))
    wrap_once(wrapper, "get_xfer_telemetry", lambda orig: wrap_telemetry(orig, _POSTED))
    return True


def install_nixl_read_log(delay: Callable[[], float] | None = None) -> bool:
    """Install both wrappers once (``delay``: :func:`wrap_read_blocks`); False when vLLM's pull
    worker or NIXL is absent."""
    ok = _install("pull_worker", "NixlPullConnectorWorker", "_read_blocks", lambda o, p: wrap_read_blocks(o, p, delay))
    if ok and hasattr(nixl_wrapper(), "transfer"):
        wrap_once(nixl_wrapper(), "transfer", lambda orig: wrap_transfer(orig, _POST_AT))
    return ok


def install_nixl_write_log() -> bool:
    """Install the push WRITE wrapper and the telemetry wrapper once; False when vLLM's push
    worker (``nixl/push_worker.py``, vLLM >= 0.27.0) or NIXL is absent."""
    return _install("push_worker", "NixlPushConnectorWorker", "_xfer_blocks", wrap_xfer_blocks)
