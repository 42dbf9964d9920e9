"""Expectations that follow the build: a PD cell whose shape is in the scope of a fix pdsweep
probes (:data:`pdsweep.builds.fixprobes.FIXES`) gets that fix's expected-failure signature,
conditional on the build lacking the fix (``without: [FIX]``), unless the sweep declares the
cell's expectation itself (any of ``expect``/``match``/``without``/``vllm`` on its include
entry) or turns derivation off (``derive_expectations: false``).

The derived expectation is an ordinary build-conditional one
(:mod:`pdsweep.sweepfile.expectations`): the plan resolves it against each build's probe, and
``run`` again against the build that runs the cell. Its ``expect_note`` starts with
:data:`DERIVED`, so ``pdsweep plan`` says per cell that it was derived and from which probe.

Scopes, each from the upstream code the fix changes:

- ``vllm#49297``: ``_read_blocks_for_req`` (``nixl/pull_worker.py``) asserts one read for MLA
  at ``tp_ratio < 0``; the fix exempts ``self._has_mamba``. In scope: a pull-connector PD cell
  of a hybrid MLA + SSM model with prefill TP > decode TP. The decode worker dies on the
  first PD request (``assert len(read_specs) == 1``).
- ``vllm#55306``: ``MambaConvSplitInfo.remote_conv_offsets`` (``ssm_conv_transfer_utils.py``)
  scales B/C by the TP ratio at ``tp_ratio >= 1`` though MambaMixer2 replicates them when
  ``n_groups`` < decode TP. In scope: a PD cell of a Mamba2 model with decode TP > prefill TP
  and ``ssm_state.n_groups`` < decode TP. Every READ succeeds; the consistency probe's triage
  names the transfer.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from pdsweep.plan.pushrules import uses_push
from pdsweep.plan.readplan import UNFIXED_ASSERT

if TYPE_CHECKING:
    from pdsweep.plan.cell import Cell
    from pdsweep.sweepfile.sweep import LoadedSweep, ModelSpec

DERIVED = "derived from fix probe"  # the expect_note prefix of a derived expectation


@dataclass(frozen=True)
class FixScope:
    """The cells a fix's absence breaks (``in_scope(cell, model, ls)``), the failure's
    signature (a ``match:`` regex) and why."""

    fix: str
    in_scope: Callable[[Cell, ModelSpec, LoadedSweep], bool]
    match: str
    reason: str


def _mla_ssm_hetero(c: Cell, m: ModelSpec, ls: LoadedSweep) -> bool:
    return m.attention == "mla" and m.is_hybrid and c.prefill_tp > c.decode_tp and not uses_push(c, m, ls)


def _mamba2_replicated_bc(c: Cell, m: ModelSpec, ls: LoadedSweep) -> bool:
    groups = m.ssm_state.n_groups if m.ssm_state else None
    return m.ssm == "mamba2" and groups is not None and c.decode_tp > c.prefill_tp and groups < c.decode_tp


SCOPES: tuple[FixScope, ...] = (
    FixScope(
        "vllm#49297",
        _mla_ssm_hetero,
        re.escape(UNFIXED_ASSERT),
        "the build lacks PR #49297: pre-fix _read_blocks_for_req (nixl/pull_worker.py) asserts a single read "
        "for MLA at tp_ratio < 0, but MLA + SSM plans one read per prefill rank; decode dies on the first "
        "PD request",
    ),
    FixScope(
        "vllm#55306",
        _mamba2_replicated_bc,
        "triage transfer",
        "the build lacks PR 55306: MambaConvSplitInfo.remote_conv_offsets (ssm_conv_transfer_utils.py, "
        "tp_ratio >= 1) reads B/C at sharded offsets though MambaMixer2 replicates them when n_groups < "
        "decode TP; decode's conv state is wrong",
    ),
)


def derive(cell: Cell, model: ModelSpec, ls: LoadedSweep, declared: bool) -> Cell:
    """``cell`` with the first in-scope fix's expectation as a build-conditional one
    (``expect_fail``, ``expect_match``, ``expect_without=(fix,)``, ``expect_ref`` the fix,
    ``expect_note`` :data:`DERIVED`), still to be resolved against the build; unchanged when
    ``declared`` (the sweep gave an expectation), for a reference cell, or when the sweep's
    ``derive_expectations`` is false."""
    if declared or cell.kind != "pd" or not ls.sweep.derive_expectations:
        return cell
    for s in SCOPES:
        if s.in_scope(cell, model, ls):
            return replace(
                cell,
                expect_fail=True,
                expect_reason=s.reason,
                expect_ref=s.fix,
                expect_match=s.match,
                expect_without=(s.fix,),
                expect_note=DERIVED,
            )
    return cell


def note(resolved: Cell) -> Cell:
    """A resolved derived expectation with its note saying so: ``derived from fix probe
    vllm#49297 (pdsweep.builds.fixprobes): applies: build unfixed lacks vllm#49297``. A build
    that cannot be probed yet (not made) keeps the cell expected to pass here; ``run``
    resolves it again with the build that runs the cell."""
    fix = resolved.expect_without[0]
    why = resolved.expect_note or ""
    if why.startswith("expected to fail as declared"):  # unknown build: derive nothing yet
        why = why.replace("expected to fail as declared", "not applied yet")
        resolved = replace(resolved, expect_fail=False)
    return replace(resolved, expect_note=f"{DERIVED} {fix} (pdsweep.builds.fixprobes): {why}")


def is_derived(cell: Cell) -> bool:
    return (cell.expect_note or "").startswith(DERIVED)
