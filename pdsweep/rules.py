"""vLLM / NIXL validity rules for one PD cell. Each rule returns a reason or None.

Every rule names the vLLM code it mirrors (vLLM 0.32 layout, module paths under
``vllm/distributed/kv_transfer/kv_connector/``). A rejected cell is never dropped:
``plan.expand`` lists it with the rule id and the reason.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .plan import Cell
    from .spec import LoadedSweep, ModelSpec

# kv_buffer_device accepted per platform: nixl/utils.py, _NIXL_SUPPORTED_DEVICE.
KV_BUFFER_DEVICES = {"cuda": ("cuda", "cpu"), "cpu": ("cpu",), "xpu": ("cpu", "xpu")}


def tp_ratio(prefill_tp: int, decode_tp: int) -> int:
    """vLLM's ``tp_ratio`` seen from the decode (local) side.

    ``decode_tp // prefill_tp`` (> 0) when decode TP >= prefill TP, else
    ``-(prefill_tp // decode_tp)`` (< 0). Mirrors ``TransferTopology.tp_ratio``
    (``kv_connector/utils.py``). Raises ``ValueError`` when the larger TP is not a
    multiple of the smaller (vLLM asserts).
    """
    hi, lo = max(prefill_tp, decode_tp), min(prefill_tp, decode_tp)
    if hi % lo:
        raise ValueError(f"TP {hi} is not a multiple of TP {lo}")
    return decode_tp // prefill_tp if decode_tp >= prefill_tp else -(prefill_tp // decode_tp)


def _tp_multiple(c: Cell, m: ModelSpec, ls: LoadedSweep) -> str | None:
    """``TransferTopology.tp_ratio`` (kv_connector/utils.py) asserts divisibility."""
    try:
        tp_ratio(c.prefill_tp, c.decode_tp)
    except ValueError as e:
        return f"{e}: vLLM TransferTopology.tp_ratio asserts the larger TP is a multiple of the smaller"
    return None


def _block_ratio(c: Cell, m: ModelSpec, ls: LoadedSweep) -> str | None:
    """``TransferTopology.block_size_ratio`` (kv_connector/utils.py): decode block must be
    an integer multiple of the prefill block (prefill blocks are never larger)."""
    p, d = c.prefill_block_size, c.decode_block_size
    if d % p:
        return (
            f"decode block size {d} is not a multiple of prefill block size {p} "
            "(vLLM TransferTopology.block_size_ratio; prefill blocks must be <= decode blocks)"
        )
    return None


def _hybrid_equal_blocks(c: Cell, m: ModelSpec, ls: LoadedSweep) -> str | None:
    """SSM/hybrid (HMA) models: ``_validate_remote_agent_handshake`` (nixl/base_worker.py)
    rejects block_size_ratio != 1 ("HMA does not support block size post processing")."""
    if m.is_hybrid and c.prefill_block_size != c.decode_block_size:
        return (
            f"{m.ssm} hybrid needs equal prefill/decode block sizes, got "
            f"{c.prefill_block_size}/{c.decode_block_size} (vLLM nixl/base_worker.py "
            "_validate_remote_agent_handshake: HMA does not support block size post processing)"
        )
    return None


def _hetero_tp_blocks(c: Cell, m: ModelSpec, ls: LoadedSweep) -> str | None:
    """prefill TP > decode TP reads split regions; with block_size_ratio != 1 vLLM asserts
    (nixl/base_worker.py, remote descriptor build: "block sizes are not supported")."""
    if c.prefill_tp > c.decode_tp and c.prefill_block_size != c.decode_block_size:
        return (
            f"prefill TP {c.prefill_tp} > decode TP {c.decode_tp} with different block sizes "
            f"{c.prefill_block_size}/{c.decode_block_size}: split-region reads need block_size_ratio == 1 "
            "(vLLM nixl/base_worker.py)"
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


def _kv_buffer_device(c: Cell, m: ModelSpec, ls: LoadedSweep) -> str | None:
    """``kv_buffer_device`` must be one NIXL accepts on the platform (nixl/utils.py)."""
    allowed = KV_BUFFER_DEVICES[ls.sweep.platform]
    if c.kv_buffer_device not in allowed:
        return f"kv_buffer_device '{c.kv_buffer_device}' not supported on {ls.sweep.platform} (allowed: {', '.join(allowed)})"
    return None


def _nixl_support(c: Cell, m: ModelSpec, ls: LoadedSweep) -> str | None:
    if not m.nixl.supported:
        return f"NIXL KV transfer unsupported for {c.model}: {m.nixl.reason}" + (f" [{m.nixl.ref}]" if m.nixl.ref else "")
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


def _serve_args(c: Cell, m: ModelSpec, ls: LoadedSweep) -> list[str]:
    """Every extra ``vllm serve`` arg of the cell's prefill and decode instances."""
    v = ls.sweep.serve_variant(c.serve_args)
    return [*m.serve_args, *v.both, *v.prefill, *v.decode]


def dcp_values(args: list[str]) -> list[str]:
    """Values given to ``--decode-context-parallel-size`` / ``-dcp`` in ``args`` (vLLM
    ``EngineArgs.add_cli_args``, engine/arg_utils.py; ``--flag=value`` and ``_`` spellings too)."""
    out = []
    for i, a in enumerate(args):
        flag, eq, val = a.partition("=")
        if flag.replace("_", "-") in ("--decode-context-parallel-size", "-dcp"):
            out.append(val if eq else (args[i + 1] if i + 1 < len(args) else ""))
    return out


def _unfixed_scope(c: Cell, m: ModelSpec, ls: LoadedSweep) -> str | None:
    """The unfixed build (``pdsweep.unfix``) reverts PR #49297 only in the pull worker's
    ``_read_blocks_for_req`` and base_worker's split-handle condition. Two paths that
    build on the fixed conditions are left inconsistent, so such cells are rejected:

    - DCP (``-dcp`` > 1): NIXL's DCP pull paths (``dcp_active`` in nixl/pull_worker.py,
      v0.29.0 on) came after the fix. With DCP, pure MLA reads a slice from several
      prefill ranks (``compute_tp_mapping`` -> ``dcp_source_ranks``), and the restored
      ``if self.use_mla and tp_ratio < 0 and read_specs:`` then also notifies the ranks
      it just read, beyond ``dcp_consumer_count``: neither pre-fix nor fixed behaviour.
    - the push connector (``"kv_connector": "NixlPushConnector"`` in
      ``--kv-transfer-config``, kv_connector/factory.py): nixl/push_worker.py
      ``_xfer_blocks_for_req`` (not edited) still takes
      ``src_xfer_handles_by_tp_ratio[split_key][i]`` when ``tp_ratio < 0 and (not
      self.use_mla or len(plan.all_source_ranks) > 1)``, handles the edited base_worker
      no longer builds for MLA (a KeyError, not the bug).
    """
    build = ls.sweep.builds.get(c.build)
    if build is None or not build.is_unfixed(c.build):
        return None
    args = _serve_args(c, m, ls)
    dcp = [v for v in dcp_values(args) if v.strip() != "1"]  # any other value: DCP (fail closed)
    if dcp:
        return (f"build '{c.build}' is the unfixed baseline and the cell uses DCP "
                f"(--decode-context-parallel-size {dcp[0]}): the PR #49297 revert leaves DCP's NIXL pull "
                "path inconsistent (the restored notify-all after an MLA read also notifies the ranks DCP "
                "just read, nixl/pull_worker.py _read_blocks_for_req); run DCP on fixed builds only")
    if any("NixlPushConnector" in a for a in args):
        return (f"build '{c.build}' is the unfixed baseline and the cell uses the push connector "
                "(NixlPushConnector): the PR #49297 revert edits only the pull path, and the push worker still "
                "indexes the split handles the edited base_worker no longer builds for MLA "
                "(nixl/push_worker.py _xfer_blocks_for_req); run push on fixed builds only")
    return None


RULES: dict[str, Callable[[Cell, ModelSpec, LoadedSweep], str | None]] = {
    "platform": _platform,
    "nixl-support": _nixl_support,
    "tp-multiple": _tp_multiple,
    "heads": _heads,
    "min-gpus": _min_gpus,
    "block-ratio": _block_ratio,
    "hybrid-equal-blocks": _hybrid_equal_blocks,
    "hetero-tp-blocks": _hetero_tp_blocks,
    "kv-buffer-device": _kv_buffer_device,
    "platform-limit": _platform_limit,
    "unfixed-scope": _unfixed_scope,
}


def check(cell: Cell, model: ModelSpec, ls: LoadedSweep) -> tuple[str, str] | None:
    """First failing rule as ``(rule_id, reason)``, or None when the cell is valid."""
    for rule_id, rule in RULES.items():
        reason = rule(cell, model, ls)
        if reason:
            return rule_id, reason
    return None
