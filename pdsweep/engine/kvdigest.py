"""In vLLM's processes: the KV integrity digests (transfer.json ``integrity``, :mod:`pdsweep.core.kvintegrity`).

Installed by pdsweep's vLLM plugin when ``PDSWEEP_KV_DIGEST=1`` (pdsweep sets it on every
instance of a PD pull cell on CPU, and on GPU where the sweep opts in). Model-agnostic: it digests
the memory ranges vLLM registered with NIXL (one NIXL descriptor = one region of one block:
attention K or V, the MLA latent, one Mamba conv sub-projection or the SSM temporal state), never
model tensors.

**Prefill** (the blocks offered): ``NixlPullConnectorScheduler.request_finished`` (vLLM
``kv_connector/v1/nixl/pull_scheduler.py``) returns the block ids a finished request keeps for
decode (``remote_block_ids``); this module remembers them and ``build_connector_meta``
(``base_scheduler.py``) hands them to the workers on the next ``NixlConnectorMetadata``
(attribute ``_pdsweep_offered``). The worker's ``start_load_kv`` digests every descriptor of
those blocks before vLLM runs the step: descriptor ids from vLLM's own
``NixlBaseConnectorWorker._compute_desc_ids`` (``base_worker.py``), one (group, block) at a
time, rows of ``src_blocks_data`` (address, length, device). One line per request and rank::

    PDSWEEP_KV_OFFER agent=<nixl agent> engine=<id> rank=<tp rank> req=<prefill request id>
    us=<digest us> bytes=<n> split=<k> impl=<digest> sample=<f>
    d=<group>/<kind>/<block>/<i>/<addr hex>/<len>/<digest>;...

``kind``: ``kv`` (attention K/V), ``mla`` (latent), ``ssm-conv``, ``ssm-temporal``; ``i``: the
descriptor's index within its (group, block) (layer, region). Each descriptor is also digested in
:data:`~pdsweep.core.kvintegrity.KV_DIGEST_PARTS` equal parts, ``i`` then ``<i>.<part>``: at decode
TP = k x prefill TP each decode rank reads 1/k of a block, and with k dividing the parts its bytes
are a part prefill digested. Fixed, not per cell, so the prefill instance of a p1d1 and a p1d2 cell
is one instance (the plan's instance key includes the env).

**Decode** (the blocks landed): ``NixlWrapper.get_xfer_descs``/``prep_xfer_dlist`` (NIXL
``nixl_agent``; vLLM ``distributed/nixl_utils.py``) are wrapped to remember each prepared
descriptor list's rows and agent; ``make_prepped_xfer("READ", ...)`` to remember each READ's
local and remote rows and the prefill request id (its ``notif_msg``, ``<remote request
id>:<consumers>``, ``pull_worker.py`` ``_read_blocks``); ``check_xfer_state`` (polled by
``base_worker.py`` ``_pop_done_transfers``, after pdsweep's READ-failure drill when both are on)
digests the local rows of a READ it reports ``DONE``, before vLLM releases the handle and
before the scheduler learns the request's KV arrived (so before any decode step writes).
``NixlPullConnectorWorker._read_blocks`` (``pull_worker.py``), which posts the READ, is wrapped
to add vLLM's ``tp_ratio`` to that prefill engine (``TransferTopology.tp_ratio``) and the READ's
``read_spec.remote_block_ids`` per group (the request's blocks in its order, before prefix-cache
trimming: decode fills its blocks position by position from them)::

    PDSWEEP_KV_LANDED agent=<prefill agent> req=<prefill request id> state=DONE us=<us>
    bytes=<n> tp_ratio=<k> order=<group>:<block>,<block>|... impl=<digest> d=<remote addr hex>/<len>/<digest>;...

A READ reported otherwise (``ERR``: a failed READ, the drill's included) logs ``state=ERR`` and
no digests; a READ NIXL refused to prepare (``make_prepped_xfer`` raised: vLLM's
``transfer_setup_failed``) logs ``state=REFUSED`` with the first descriptor whose local and remote
lengths differ (:func:`refused_line`). With ``PDSWEEP_FLIP_BYTE_EVERY=N`` (the sweep fault ``flip-byte-1-in-N``), every
N-th READ reported DONE has one byte of its first descriptor inverted in decode's KV cache
before the digest, logged as ``PDSWEEP_INJECTED_BYTE_FLIP``.

Digest: the first 64 bits of SHA-256 (``hashlib``, OpenSSL: SHA-NI where the CPU has it; BLAKE2b
was 13x slower on the 2-core AMD EPYC host, ``bench/test_integrity_overhead.py``), over the bytes
in place (ctypes). KV cache on a CUDA device (``nixl_memory_type`` ``VRAM``; or
``PDSWEEP_KV_DIGEST_IMPL=torch``, the CPU dry run): :mod:`pdsweep.engine.torchdigest` (128 bits, batched
on the device) over the storages vLLM registered (``register_kv_caches`` is wrapped to find them); each
line names its digest (``impl=``). A prefill worker with device KV and no storage map logs ``not
measured`` once instead of an offer line. ``PDSWEEP_KV_DIGEST_SAMPLE=f`` (GPU sweeps,
:mod:`pdsweep.core.kvsample`): a request :func:`~pdsweep.core.kvsample.sampled` leaves out logs its
offer line with ``sampled_out=1`` and its landed line with ``state=SAMPLED_OUT``, no digests.
"""

from __future__ import annotations

import ctypes
import hashlib
import itertools
import logging
import threading
import time
from typing import Any, Callable

from pdsweep.core.faults import FLIP_BYTE_ENV_VAR
from pdsweep.core.kvintegrity import KV_DIGEST_PARTS
from pdsweep.core.kvlines import DIGEST_NAME, FLIP_TAG, LANDED_TAG, OFFER_TAG, TORCH_DIGEST_NAME
from pdsweep.core.kvsample import IMPL_ENV_VAR, SAMPLE_ENV_VAR, SAMPLED_OUT_STATE, parse_fraction, sampled
from pdsweep.engine.readlog import log_word, nixl_wrapper
from pdsweep.engine.torchdigest import StorageMap, tensors_of

logger = logging.getLogger("vllm.pdsweep.engine.kvdigest")

_MARK = "_pdsweep_kvdigest"

# scheduler process: request id -> block ids offered, not yet handed to the workers
_PENDING: dict[str, Any] = {}
# worker process: prepared descriptor list handle -> (agent name, Nx3 rows); descs object id -> rows
_DLISTS: dict[Any, tuple[str, Any]] = {}
_DESCS: dict[int, tuple[Any, Any]] = {}
# READ handle -> (local rows, remote rows, remote agent, prefill request id, " tp_ratio=.. order=.." or "")
_READS: dict[Any, tuple[Any, Any, str, str, str]] = {}
_LOCK = threading.Lock()
_POSTING = threading.local()  # decode worker: the READ vLLM's _read_blocks is posting now (its extra fields)
# the registered KV storages (set when the torch digest is used), PDSWEEP_KV_DIGEST_IMPL=torch, the sample fraction
_STATE: dict[str, Any] = {"map": None, "torch": False, "sample": 1.0}


def digest(addr: int, length: int) -> str:
    """:data:`DIGEST_NAME` hex (16 digits) of ``length`` bytes of this process's memory at ``addr``."""
    buf = (ctypes.c_char * length).from_address(addr)
    return hashlib.sha256(memoryview(buf)).hexdigest()[:16]


def impl_name() -> str:
    """The digest this process uses: :data:`TORCH_DIGEST_NAME` once vLLM registered KV storages the torch
    digest serves (a CUDA device, or ``PDSWEEP_KV_DIGEST_IMPL=torch``), else :data:`DIGEST_NAME`."""
    return TORCH_DIGEST_NAME if _STATE["map"] is not None else DIGEST_NAME


def digest_many(regions: list[tuple[int, int]]) -> list[str]:
    """The digests of ``(addr, length)`` regions with :func:`impl_name`'s digest (torch: batched on the
    storage's device, :class:`~pdsweep.engine.torchdigest.StorageMap`). Raises ``ValueError`` for a
    region outside every registered storage when the torch digest is in use (never read blindly)."""
    smap = _STATE["map"]
    if smap is None:
        return [digest(a, n) for a, n in regions]
    got = smap.digest_many(regions)
    if any(d is None for d in got):
        a, n = regions[got.index(None)]
        raise ValueError(f"{a:x}/{n} is in no KV cache storage vLLM registered")
    return [str(d) for d in got]


def flip_byte(addr: int) -> None:
    """Invert the byte at ``addr`` (the byte-flip drill): in its registered storage when the torch digest
    is in use (device memory), else in place."""
    if _STATE["map"] is not None and _STATE["map"].flip_byte(addr):
        return
    b = ctypes.c_ubyte.from_address(addr)
    b.value ^= 0xFF


# ---------------------------------------------------------------- prefill: the blocks offered


def group_kind(worker: Any, group: int) -> str:
    """``kv``, ``mla`` or ``ssm`` for KV cache group ``group`` (vLLM ``tp_mapping.py``
    ``_is_attention_spec``/``_is_ssm_spec`` on ``worker._group_spec_types``)."""
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.tp_mapping import _is_ssm_spec

    if _is_ssm_spec(worker._group_spec_types[group]):
        return "ssm"
    return "mla" if worker.use_mla else "kv"


def ssm_part(worker: Any, i: int) -> str:
    """``ssm-temporal`` or ``ssm-conv`` for the i-th SSM descriptor of one block: vLLM lays them
    out per layer as the conv sub-projections, then the temporal state (``base_worker.py``
    ``_build_mamba_local``; ``_compute_desc_ids`` orders them by region)."""
    per_layer = len(worker._conv_decomp.local_conv_offsets) + 1
    return "ssm-temporal" if i % per_layer == per_layer - 1 else "ssm-conv"


def offered_descs(worker: Any, block_ids: Any) -> list[tuple[int, str, int, int, int, int]]:
    """``(group, kind, block, i, addr, len)`` of every descriptor of the offered ``block_ids``
    (logical, per KV cache group), in prefill's own descriptor list."""
    return physical_descs(
        worker, worker._logical_to_kernel_block_ids(block_ids, worker._physical_blocks_per_logical_kv_block)
    )


def physical_descs(worker: Any, phys: Any) -> list[tuple[int, str, int, int, int, int]]:
    """:func:`offered_descs` of kernel (physical) block ids ``phys``, per KV cache group: the rows of this
    worker's own ``src_blocks_data`` (``base_worker.py`` ``register_local_xfer_handler``), descriptor ids from
    vLLM's ``_compute_desc_ids`` one (group, block) at a time."""
    rows = worker.src_blocks_data
    out = []
    for g, ids in enumerate(phys):
        kind = group_kind(worker, g)
        for b in ids:
            one = [[int(b)] if k == g else [] for k in range(len(phys))]
            desc_ids = worker._compute_desc_ids(
                block_ids=one,
                dst_num_blocks=worker.dst_num_blocks[worker.engine_id],
                block_size_ratio=None,
                physical_blocks_per_logical=worker._physical_blocks_per_logical_kv_block,
                region_num_blocks=(worker.dst_region_num_blocks.get(worker.engine_id) or None),
                region_group_ids=(worker.region_group_ids or None),
                uses_region_group_mapping=worker._uses_region_group_mapping,
            )
            for i, d in enumerate(desc_ids):
                addr, length = int(rows[d][0]), int(rows[d][1])
                k = ssm_part(worker, i) if kind == "ssm" else kind
                out.append((g, k, int(b), i, addr, length))
    return out


def offer_line(worker: Any, req: str, block_ids: Any, split: int = KV_DIGEST_PARTS) -> str:
    """The :data:`OFFER_TAG` line of one request (module doc); no digests for a request :func:`sampled`
    leaves out (``sampled_out=1``)."""
    req = log_word(req)
    head = f"{OFFER_TAG} agent={worker.nixl_wrapper.name} engine={worker.engine_id} rank={worker.tp_rank} req={req}"
    tail = f"split={split} impl={impl_name()} sample={_STATE['sample']:g}"
    if not sampled(req, _STATE["sample"]):
        return f"{head} us=0 bytes=0 {tail} sampled_out=1 d="
    t = time.perf_counter()
    units, regions, nbytes = [], [], 0
    for g, kind, b, i, addr, length in offered_descs(worker, block_ids):
        units.append(f"{g}/{kind}/{b}/{i}/{addr:x}/{length}")
        regions.append((addr, length))
        nbytes += length
        if split > 1 and length % split == 0:
            n = length // split
            units += [f"{g}/{kind}/{b}/{i}.{p}/{addr + p * n:x}/{n}" for p in range(split)]
            regions += [(addr + p * n, n) for p in range(split)]
    parts = [f"{u}/{d}" for u, d in zip(units, digest_many(regions))]
    us = (time.perf_counter() - t) * 1e6
    return f"{head} us={us:.0f} bytes={nbytes} {tail} d={';'.join(parts)}"


def wrap_request_finished(orig: Callable[..., Any]) -> Callable[..., Any]:
    """Scheduler: remember the blocks of a request whose free vLLM delays for decode."""

    def request_finished(self: Any, request: Any, block_ids: Any) -> Any:
        delay, params = orig(self, request, block_ids)
        if delay and params and params.get("do_remote_prefill"):  # prefill's answer: decode is to read
            _PENDING[str(request.request_id)] = [list(g) for g in params.get("remote_block_ids") or ()]
        return delay, params

    return request_finished


def wrap_build_meta(orig: Callable[..., Any]) -> Callable[..., Any]:
    """Scheduler: hand the remembered blocks to the workers on the next metadata."""

    def build_connector_meta(self: Any, *args: Any, **kw: Any) -> Any:
        meta = orig(self, *args, **kw)
        if _PENDING:
            meta._pdsweep_offered = dict(_PENDING)
            _PENDING.clear()
        return meta

    return build_connector_meta


def wrap_start_load_kv(orig: Callable[..., Any], split: int = KV_DIGEST_PARTS) -> Callable[..., Any]:
    """Worker: digest the offered blocks, then run vLLM's ``start_load_kv``."""

    def start_load_kv(self: Any, metadata: Any) -> Any:
        offered = getattr(metadata, "_pdsweep_offered", None) or {}
        if offered and getattr(self, "nixl_memory_type", None) != "DRAM" and _STATE["map"] is None:
            if not getattr(self, _MARK, False):
                setattr(self, _MARK, True)
                mem = self.nixl_memory_type
                logger.warning("%s not measured: KV cache in %s, no torch storage map", OFFER_TAG, mem)
            offered = {}
        for req, block_ids in offered.items():
            try:
                logger.info("%s", offer_line(self, req, block_ids, split))
            except Exception as e:  # noqa: BLE001 - the measurement must never stop vLLM
                logger.warning("%s req=%s failed: %r", OFFER_TAG, req, e)
        return orig(self, metadata)

    return start_load_kv


# ---------------------------------------------------------------- decode: the blocks landed


def read_fields(worker: Any, read_spec: Any, dst_engine_id: str) -> str:
    """`` tp_ratio=<k> order=<g>:<b>,..|..`` of the READ ``_read_blocks`` posts: vLLM's tp_ratio to the
    prefill engine (``transfer_topo.tp_ratio``, as ``_read_blocks_for_req`` computes it) and the
    non-empty groups of ``read_spec.remote_block_ids`` (no order for region-mapped reads)."""
    topo = worker.transfer_topo
    k = int(topo.tp_ratio(topo.get_engine_info(dst_engine_id).remote_tp_size))
    order = ""
    if not getattr(read_spec, "block_ids_by_region", False):
        groups = [(g, list(ids)) for g, ids in enumerate(read_spec.remote_block_ids)]
        order = "|".join(f"{g}:{','.join(str(int(b)) for b in ids)}" for g, ids in groups if len(ids))
    return f" tp_ratio={k}" + (f" order={order}" if order else "")


def wrap_read_blocks(orig: Callable[..., Any]) -> Callable[..., Any]:
    """Worker (decode): :func:`read_fields` of the READ vLLM's ``_read_blocks`` posts, for the
    ``make_prepped_xfer`` it calls (vLLM calls ``_read_blocks`` with keywords)."""

    def _read_blocks(self: Any, *a: Any, **kw: Any) -> Any:
        try:
            spec = kw.get("read_spec", a[0] if a else None)
            _POSTING.fields = read_fields(self, spec, kw.get("dst_engine_id", a[1] if len(a) > 1 else ""))
        except Exception:  # noqa: BLE001 - another vLLM layout: the lines go without these fields
            _POSTING.fields = ""
        try:
            return orig(self, *a, **kw)
        finally:
            _POSTING.fields = ""

    return _read_blocks


def desc_rows(descs: Any) -> Any:
    """An Nx3 uint64 array of (address, length, device) from what vLLM hands NIXL's
    ``get_xfer_descs``: an Nx3 numpy array or a list of 3-element rows (the split local lists of
    ``base_worker.py`` ``_build_local_splits_from_plan``); None for anything else (tensors)."""
    import numpy as np

    if isinstance(descs, np.ndarray):
        return descs.astype(np.uint64) if descs.ndim == 2 and descs.shape[1] == 3 else None
    if isinstance(descs, (list, tuple)) and descs and isinstance(descs[0], (list, tuple)) and len(descs[0]) == 3:
        return np.asarray(descs, dtype=np.uint64)
    return None


def wrap_get_xfer_descs(orig: Callable[..., Any]) -> Callable[..., Any]:
    def get_xfer_descs(self: Any, descs: Any, *args: Any, **kw: Any) -> Any:
        out = orig(self, descs, *args, **kw)
        mem = kw.get("mem_type", args[0] if args else None)
        if mem in ("DRAM", "VRAM") and (rows := desc_rows(descs)) is not None:  # VRAM: the torch digest
            _DESCS[id(out)] = (out, rows)  # keep ``out`` alive: its id stays unique
        return out

    return get_xfer_descs


def wrap_prep_xfer_dlist(orig: Callable[..., Any]) -> Callable[..., Any]:
    def prep_xfer_dlist(self: Any, agent_name: str, xfer_list: Any, *args: Any, **kw: Any) -> Any:
        handle = orig(self, agent_name, xfer_list, *args, **kw)
        known = _DESCS.pop(id(xfer_list), None)
        if known is not None:
            name = agent_name.decode() if isinstance(agent_name, bytes) else str(agent_name)  # vLLM passes bytes
            _DLISTS[handle] = (name, known[1])
        return handle

    return prep_xfer_dlist


def wrap_make_prepped_xfer(orig: Callable[..., Any]) -> Callable[..., Any]:
    def make_prepped_xfer(self: Any, op: str, local: Any, lids: Any, remote: Any, rids: Any, *a: Any, **kw: Any) -> Any:
        notif = kw.get("notif_msg", a[0] if a else b"")
        where = None
        if op == "READ" and local in _DLISTS and remote in _DLISTS and notif:
            req = bytes(notif).decode(errors="replace").rsplit(":", 1)[0]
            rows = (_DLISTS[local][1][list(lids)], _DLISTS[remote][1][list(rids)])
            where = (*rows, _DLISTS[remote][0], req, getattr(_POSTING, "fields", ""))
        try:
            handle = orig(self, op, local, lids, remote, rids, *a, **kw)
        except Exception:
            if where is not None:  # NIXL refused the READ (vLLM: transfer_setup_failed): say where lengths differ
                logger.info("%s", refused_line(where))
            raise
        if where is not None:
            _READS[handle] = where
        return handle

    return make_prepped_xfer


def refused_line(where: tuple[Any, Any, str, str, str]) -> str:
    """The :data:`LANDED_TAG` line of a READ NIXL refused to prepare (``state=REFUSED``): ``d`` names
    the first descriptor whose local and remote lengths differ as ``<remote addr>/<len>/local<len>``
    (NIXL ``makeXferReq``: "length mismatch"), empty when they all agree."""
    local, remote, agent, req, _ = where
    bad = [(r, ll) for (_, ll, _), r in zip(local.tolist(), remote.tolist()) if int(ll) != int(r[1])]
    d = f"{int(bad[0][0][0]):x}/{int(bad[0][0][1])}/local{int(bad[0][1])}" if bad else ""
    return f"{LANDED_TAG} agent={agent} req={log_word(req)} state=REFUSED us=0 bytes=0 d={d}"


def landed_line(where: tuple[Any, Any, str, str, str], state: str, flip_now: bool) -> str:
    """The :data:`LANDED_TAG` line of one READ (module doc)."""
    local, remote, agent, req, fields = where
    req = log_word(req)
    if state == "DONE" and not sampled(req, _STATE["sample"]):
        state = SAMPLED_OUT_STATE
    head = f"{LANDED_TAG} agent={agent} req={req} state={state}"
    if state != "DONE":
        return f"{head} us=0 bytes=0 d="
    if flip_now and len(local):
        flip_byte(int(local[0][0]))
        logger.warning("%s req=%s remote_addr=%x", FLIP_TAG, req, int(remote[0][0]))
    t = time.perf_counter()
    pairs = [(int(la), int(ra), int(rn)) for (la, _, _), (ra, rn, _) in zip(local.tolist(), remote.tolist())]
    digests = digest_many([(la, rn) for la, _, rn in pairs])
    parts = [f"{ra:x}/{rn}/{d}" for (_, ra, rn), d in zip(pairs, digests)]
    us = (time.perf_counter() - t) * 1e6
    return f"{head} us={us:.0f} bytes={sum(p[2] for p in pairs)}{fields} impl={impl_name()} d={';'.join(parts)}"


def wrap_check_xfer_state(orig: Callable[..., Any], flip_every: int = 0) -> Callable[..., Any]:
    """``check_xfer_state`` that logs a READ's :data:`LANDED_TAG` line once it is no longer
    ``PROC`` (``flip_every``: the byte-flip drill, 0 off)."""
    done = itertools.count(1)

    def check_xfer_state(self: Any, handle: Any) -> Any:
        state = orig(self, handle)
        if state == "PROC" or handle not in _READS:
            return state
        with _LOCK:
            where = _READS.pop(handle, None)
            n = next(done) if state == "DONE" else 0
        if where is not None:
            try:
                logger.info("%s", landed_line(where, str(state), bool(flip_every and n and n % flip_every == 0)))
            except Exception as e:  # noqa: BLE001
                logger.warning("%s req=%s failed: %r", LANDED_TAG, where[3], e)
        return state

    return check_xfer_state


def use_storages(kv_caches: Any, force_torch: bool = False) -> None:
    """Digest with torch (:func:`impl_name`) over the storages of ``kv_caches`` (vLLM's registered
    tensors) when any is on a device other than the host, or ``force_torch``; else leave SHA-256 on."""
    tensors = list(tensors_of(kv_caches))
    if tensors and (force_torch or any(t.device.type != "cpu" for t in tensors)):
        _STATE["map"] = StorageMap(tensors)


def wrap_register_kv_caches(orig: Callable[..., Any]) -> Callable[..., Any]:
    """Worker: after vLLM's ``register_kv_caches`` (``base_worker.py``), the storages NIXL got:
    ``host_xfer_buffers`` when vLLM stages KV in host memory, else ``device_kv_caches``."""

    def register_kv_caches(self: Any, kv_caches: Any) -> Any:
        out = orig(self, kv_caches)
        try:
            staged = getattr(self, "use_host_buffer", False)
            use_storages(self.host_xfer_buffers if staged else self.device_kv_caches, _STATE["torch"])
            if _STATE["map"] is not None:
                logger.info("pdsweep: KV digest %s on %s", TORCH_DIGEST_NAME, ",".join(_STATE["map"].devices))
        except Exception as e:  # noqa: BLE001 - the measurement must never stop vLLM
            logger.warning("pdsweep: KV digest: no torch storage map (%r): %s on host memory only", e, DIGEST_NAME)
        return out

    return register_kv_caches


def wrap_once(
    owner: Any, attr: str, make: Callable[[Callable[..., Any]], Callable[..., Any]], mark: str = _MARK
) -> None:
    """Replace ``owner.attr`` with ``make(owner.attr)`` unless a wrapper carrying ``mark`` is there already
    (the plugin loads in every vLLM process; a second install must not wrap twice)."""
    orig = getattr(owner, attr)
    if getattr(orig, mark, False):
        return
    new = make(orig)
    setattr(new, mark, True)
    setattr(owner, attr, new)


def install_kv_digest(flip_every: int = 0) -> bool:
    """Install the prefill and decode wrappers (module doc) once; False when vLLM's pull
    connector or NIXL wrapper is not where it was. ``flip_every``: the byte-flip drill."""

    try:
        from vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_scheduler import NixlPullConnectorScheduler
        from vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_worker import NixlPullConnectorWorker
    except Exception:  # noqa: BLE001 - another vLLM layout: the plugin warns
        return False
    wrapper = nixl_wrapper()
    names = ("get_xfer_descs", "prep_xfer_dlist", "make_prepped_xfer", "check_xfer_state")
    if wrapper is None or not all(hasattr(wrapper, n) for n in names):
        return False
    wrap_once(NixlPullConnectorScheduler, "request_finished", wrap_request_finished)
    wrap_once(NixlPullConnectorScheduler, "build_connector_meta", wrap_build_meta)
    wrap_once(NixlPullConnectorWorker, "start_load_kv", wrap_start_load_kv)
    wrap_once(NixlPullConnectorWorker, "register_kv_caches", wrap_register_kv_caches)
    if hasattr(NixlPullConnectorWorker, "_read_blocks"):  # the order and tp_ratio fields (module doc)
        wrap_once(NixlPullConnectorWorker, "_read_blocks", wrap_read_blocks)
    wrap_once(wrapper, "get_xfer_descs", wrap_get_xfer_descs)
    wrap_once(wrapper, "prep_xfer_dlist", wrap_prep_xfer_dlist)
    wrap_once(wrapper, "make_prepped_xfer", wrap_make_prepped_xfer)
    wrap_once(wrapper, "check_xfer_state", lambda o: wrap_check_xfer_state(o, flip_every))
    return True


def install_from_env(env: Any) -> None:
    """The plugin's entry: install with ``PDSWEEP_FLIP_BYTE_EVERY``, ``PDSWEEP_KV_DIGEST_SAMPLE`` and
    ``PDSWEEP_KV_DIGEST_IMPL`` from ``env`` (a bad value: a warning, never an exception into vLLM)."""

    try:
        flip = int(env.get(FLIP_BYTE_ENV_VAR) or 0)
        if flip < 0:
            raise ValueError(f"{FLIP_BYTE_ENV_VAR} >= 0")
        _STATE["sample"] = parse_fraction(env.get(SAMPLE_ENV_VAR))
        _STATE["torch"] = (env.get(IMPL_ENV_VAR) or "").strip() == "torch"
        if not install_kv_digest(flip):
            logger.warning("pdsweep: KV digest: vLLM's NIXL pull connector or NixlWrapper not found; not measured")
            return
        logger.info(
            "pdsweep: KV integrity digests on (%s; %s on device memory; prefill parts %d; sample %g)",
            DIGEST_NAME,
            TORCH_DIGEST_NAME,
            KV_DIGEST_PARTS,
            _STATE["sample"],
        )
        if flip:
            logger.info("pdsweep: fault drill: every %d-th completed NIXL READ gets one byte flipped", flip)
    except Exception as e:  # noqa: BLE001
        logger.warning("pdsweep: KV digest not installed: %s", e)
