"""In vLLM's processes: the KV integrity digests of push mode (``NixlPushConnector``: prefill WRITEs the
KV into the blocks decode registered; transfer.json ``integrity`` through :mod:`pdsweep.core.kvpush`).

Installed by pdsweep's vLLM plugin with :mod:`pdsweep.engine.kvdigest` (``PDSWEEP_KV_DIGEST=1``), whose
``get_xfer_descs``/``prep_xfer_dlist`` wrappers record every prepared host-memory descriptor list (its
rows and, for a remote list, the agent it names).

**Prefill** (kv_producer, the WRITEs posted): vLLM 0.32.0's ``nixl/push_worker.py`` posts each WRITE from
its writer thread: ``_xfer_blocks(read_spec=..., request_id=..., remote_request_id=...)`` computes the
descriptor ids and calls ``make_prepped_xfer("WRITE", local, ids, remote, ids, notif_msg="<decode request
id>:<prefill TP>")``. :func:`wrap_xfer_blocks` remembers (on that thread) the worker, both request ids and
``read_spec.local_block_ids`` (kernel ids per group); :func:`wrap_make_prepped_xfer` digests the local
(source) row of every descriptor of the WRITE before it is posted (the blocks stay held until vLLM sees
the WRITE done) and logs them keyed by the remote (decode) row, each with the prefill (group, kind, block,
index) whose descriptor holds the source row (vLLM's ``_compute_desc_ids`` over ``src_blocks_data``,
:func:`pdsweep.engine.kvdigest.physical_descs`; a split handle's row, prefill TP < decode TP, is a slice
of one)::

    PDSWEEP_KV_WRITE agent=<decode agent> engine=<prefill engine> rank=<prefill tp rank> req=<prefill
    request id> dreq=<decode request id> us=<digest us> bytes=<n> d=<g>/<kind>/<block>/<i>/<decode addr
    hex>/<len>/<digest>;...

**Decode** (kv_consumer, the blocks landed): decode holds no NIXL handle; ``_get_new_notifs`` counts one
notification per prefill rank WRITE-ing to it and, once a request's count is complete, adds an empty
``_recving_transfers[req]`` that ``base_worker.py`` ``get_transfer_results`` reports done right after
(``_pop_done_transfers``), before the scheduler lets a decode step write. :func:`wrap_get_new_notifs`
digests, between the two, every descriptor of the request's blocks (``_recving_metadata[req]
.local_physical_block_ids``, the blocks decode registered) whole and, when prefill TP = k x decode TP
(``meta.tp_size``: prefill's), in k equal parts (each prefill rank WRITEs its shard)::

    PDSWEEP_KV_PUSHED agent=<decode agent> req=<decode request id> state=DONE us=<us> bytes=<n> split=<k>
    d=<g>/<kind>/<decode block>/<addr hex>/<len>/<digest>;<addr hex>/<len>/<digest> (a part);...

With ``PDSWEEP_FLIP_BYTE_EVERY=N`` (the sweep fault ``flip-byte-1-in-N``) every N-th completed request has
one byte of its first descriptor inverted in decode's KV cache before the digest (``PDSWEEP_INJECTED_BYTE_FLIP``).
Host memory only (descriptor lists of another memory type are never recorded, so no line is logged).
"""

from __future__ import annotations

import bisect
import itertools
import logging
import threading
import time
from typing import Any, Callable

from pdsweep.core.faults import FLIP_BYTE_ENV_VAR
from pdsweep.core.kvlines import FLIP_TAG, PUSHED_TAG, WRITE_TAG
from pdsweep.engine.kvdigest import _DLISTS, digest, flip_byte, physical_descs, wrap_once
from pdsweep.engine.readlog import log_word, nixl_wrapper

logger = logging.getLogger("vllm.pdsweep.engine.kvpushdigest")

_MARK = "_pdsweep_kvpush"
_POSTING = threading.local()  # prefill's writer thread: the WRITE vLLM's _xfer_blocks is posting now


# ---------------------------------------------------------------- prefill: the WRITEs posted


def wrap_xfer_blocks(orig: Callable[..., Any]) -> Callable[..., Any]:
    """Push ``_xfer_blocks`` (vLLM passes every argument by keyword) that leaves ``(worker, prefill
    request id, decode request id, local kernel block ids per group)`` for the ``make_prepped_xfer`` it calls."""

    def _xfer_blocks(self: Any, *a: Any, **kw: Any) -> Any:
        spec = kw.get("read_spec", a[0] if a else None)
        blocks = getattr(spec, "local_block_ids", None)
        _POSTING.write = (self, str(kw.get("request_id")), str(kw.get("remote_request_id")), blocks)
        try:
            return orig(self, *a, **kw)
        finally:
            _POSTING.write = None

    return _xfer_blocks


def source_keys(worker: Any, blocks: Any) -> tuple[list[int], list[tuple[int, str, int, int, int, int]]]:
    """Prefill's descriptors of ``blocks`` (kernel ids per group) sorted by address, and their start
    addresses (for :func:`bisect.bisect_right`)."""
    descs = sorted(physical_descs(worker, blocks), key=lambda d: d[4])
    return [d[4] for d in descs], descs


def write_line(info: tuple[Any, str, str, Any], local: Any, remote: Any, agent: str) -> str:
    """The :data:`WRITE_TAG` line of one WRITE (module doc): ``local``/``remote`` its Nx3 rows."""
    worker, req, dreq, blocks = info
    t = time.perf_counter()
    starts, descs = source_keys(worker, blocks)
    parts, nbytes = [], 0
    for (laddr, llen, _), (raddr, rlen, _) in zip(local.tolist(), remote.tolist()):
        k = bisect.bisect_right(starts, int(laddr)) - 1
        d = descs[k] if k >= 0 and int(laddr) < descs[k][4] + descs[k][5] else (-1, "unmapped", -1, -1, 0, 0)
        parts.append(f"{d[0]}/{d[1]}/{d[2]}/{d[3]}/{int(raddr):x}/{int(rlen)}/{digest(int(laddr), int(llen))}")
        nbytes += int(llen)
    us = (time.perf_counter() - t) * 1e6
    return (
        f"{WRITE_TAG} agent={agent} engine={worker.engine_id} rank={worker.tp_rank} req={log_word(req)} "
        f"dreq={log_word(dreq)} us={us:.0f} bytes={nbytes} d={';'.join(parts)}"
    )


def wrap_make_prepped_xfer(orig: Callable[..., Any]) -> Callable[..., Any]:
    """``make_prepped_xfer`` that logs a push WRITE's :data:`WRITE_TAG` line (digested before the post)."""

    def make_prepped_xfer(self: Any, op: str, local: Any, lids: Any, remote: Any, rids: Any, *a: Any, **kw: Any) -> Any:
        info = getattr(_POSTING, "write", None)
        line = None
        if op == "WRITE" and info is not None and local in _DLISTS and remote in _DLISTS:
            try:
                rows = (_DLISTS[local][1][list(lids)], _DLISTS[remote][1][list(rids)])
                line = write_line(info, *rows, _DLISTS[remote][0])
            except Exception as e:  # noqa: BLE001 - the measurement must never stop vLLM
                logger.warning("%s req=%s failed: %r", WRITE_TAG, info[1], e)
        handle = orig(self, op, local, lids, remote, rids, *a, **kw)
        if line is not None:
            logger.info("%s", line)
        return handle

    return make_prepped_xfer


# ---------------------------------------------------------------- decode: the blocks landed


def pushed_line(worker: Any, req: str, meta: Any, flip_now: bool) -> str:
    """The :data:`PUSHED_TAG` line of one request whose WRITEs were all notified (module doc)."""
    k = max(1, int(getattr(meta, "tp_size", 1) or 1) // max(1, int(worker.world_size)))
    descs = physical_descs(worker, meta.local_physical_block_ids)
    if flip_now and descs:
        flip_byte(descs[0][4])
        logger.warning("%s req=%s remote_addr=%x", FLIP_TAG, req, descs[0][4])
    t = time.perf_counter()
    parts, nbytes = [], 0
    for g, kind, b, _i, addr, length in descs:
        parts.append(f"{g}/{kind}/{b}/{addr:x}/{length}/{digest(addr, length)}")
        nbytes += length
        if k > 1 and length % k == 0:
            n = length // k
            parts += [f"{addr + p * n:x}/{n}/{digest(addr + p * n, n)}" for p in range(k)]
    us = (time.perf_counter() - t) * 1e6
    return (
        f"{PUSHED_TAG} agent={worker.nixl_wrapper.name} req={log_word(req)} state=DONE us={us:.0f} "
        f"bytes={nbytes} split={k} d={';'.join(parts)}"
    )


def wrap_get_new_notifs(orig: Callable[..., Any], flip_every: int = 0) -> Callable[..., Any]:
    """Push ``_get_new_notifs`` that logs the :data:`PUSHED_TAG` line of each request it found complete
    (an entry it added to ``_recving_transfers``), before ``get_transfer_results`` reports it done
    (``flip_every``: the byte-flip drill, 0 off)."""
    done = itertools.count(1)

    def _get_new_notifs(self: Any) -> Any:
        before = set(self._recving_transfers)
        out = orig(self)
        for req in [r for r in self._recving_transfers if r not in before]:
            meta = self._recving_metadata.get(req)
            if meta is None:
                continue
            n = next(done)
            try:
                logger.info("%s", pushed_line(self, str(req), meta, bool(flip_every and n % flip_every == 0)))
            except Exception as e:  # noqa: BLE001
                logger.warning("%s req=%s failed: %r", PUSHED_TAG, req, e)
        return out

    return _get_new_notifs


def install_push_digest(flip_every: int = 0) -> bool:
    """Install the prefill and decode push wrappers (module doc) once; False when vLLM's push worker
    (``nixl/push_worker.py``, vLLM >= 0.27.0) or its methods are not where they were."""
    try:
        from vllm.distributed.kv_transfer.kv_connector.v1.nixl.push_worker import NixlPushConnectorWorker
    except Exception:  # noqa: BLE001 - another vLLM layout: the plugin warns
        return False
    wrapper = nixl_wrapper()
    methods = ("_xfer_blocks", "_get_new_notifs")
    if (
        wrapper is None
        or not hasattr(wrapper, "make_prepped_xfer")
        or not all(hasattr(NixlPushConnectorWorker, m) for m in methods)
    ):
        return False
    wrap_once(NixlPushConnectorWorker, "_xfer_blocks", wrap_xfer_blocks, _MARK)
    wrap_once(NixlPushConnectorWorker, "_get_new_notifs", lambda o: wrap_get_new_notifs(o, flip_every), _MARK)
    wrap_once(wrapper, "make_prepped_xfer", wrap_make_prepped_xfer, _MARK)
    return True


def install_push_from_env(env: Any) -> None:
    """The plugin's entry (after :func:`pdsweep.engine.kvdigest.install_from_env`, whose descriptor-list
    wrappers this needs): install with ``PDSWEEP_FLIP_BYTE_EVERY`` from ``env``; a bad value or another
    vLLM layout: a warning, never an exception into vLLM."""
    try:
        flip = int(env.get(FLIP_BYTE_ENV_VAR) or 0)
        if flip < 0:
            raise ValueError(f"{FLIP_BYTE_ENV_VAR} >= 0")
        if not install_push_digest(flip):
            logger.warning("pdsweep: KV digest: vLLM's NIXL push worker not found; push cells not measured")
            return
        logger.info("pdsweep: KV integrity digests of push WRITEs on")
        if flip:
            logger.info("pdsweep: fault drill: every %d-th request pushed gets one byte flipped", flip)
    except Exception as e:  # noqa: BLE001
        logger.warning("pdsweep: push KV digest not installed: %s", e)
