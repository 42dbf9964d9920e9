"""What one job of a sweep runs: the selected cells with identical deployments folded
(:mod:`pdsweep.plan.fold`), then its ``--shard i/n`` (:mod:`pdsweep.plan.shards`), and the
sweep's core case checked on the node. :func:`job_cells` is called by the one plan ``pdsweep plan``
prints and ``run`` executes alone (:func:`pdsweep.run.runplan.plan_cells`): a job runs what it showed."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pdsweep.core.errors import UserError
from pdsweep.deploy.instances import instance_key
from pdsweep.plan.blocks import for_cell
from pdsweep.plan.builds import build_python
from pdsweep.plan.cell import Cell
from pdsweep.plan.clock import pick, verdict
from pdsweep.plan.durations import MODEL_WORDS
from pdsweep.plan.expand import Plan, reference_of
from pdsweep.plan.fold import fold
from pdsweep.plan.instance import Slot, instances, model_path
from pdsweep.plan.pairing import no_load_phase, pairing
from pdsweep.plan.shards import JobArgs, Shard, cut
from pdsweep.plan.startup import estimator
from pdsweep.sweepfile.sweep import LoadedSweep


@dataclass
class Job:
    """``cells``: what this job runs; ``folded``: folded id -> the id that runs for it (this
    job's); ``fold_why``: folded id -> the shared blocks; ``shard``: run.json/plan.json
    ``shard`` (None: the whole sweep)."""

    cells: list[Cell]
    folded: dict[str, str] = field(default_factory=dict)
    fold_why: dict[str, str] = field(default_factory=dict)
    shard: dict[str, Any] | None = None


def _blocks(ls: LoadedSweep):
    def of(c: Cell) -> dict[str, dict[str, Any]] | None:
        try:
            return {role: e.to_dict() for role, e in for_cell(c, ls).items()}
        except ValueError:  # refused by vLLM's block arithmetic: never folded
            return None

    return of


def _keys(ls: LoadedSweep, cells: list[Cell]) -> dict[str, set[str]]:
    """Instance keys of each cell on one slot (the GPUs are where it runs, not what it is)."""
    out: dict[str, set[str]] = {}
    for c in cells:
        m = ls.catalogue.models[c.model]
        try:
            python = build_python(ls, c.build)
        except UserError:  # a build not made yet: the argv names its interpreter all the same
            python = f"{ls.sweep.builds[c.build].venv}/bin/python"
        slot = Slot(0, tuple(range(c.num_gpus)), ls.sweep.defaults.port_base)
        out[c.id] = {instance_key(s) for s in instances(c, slot, ls, model_path(m, c.model), python)}
    return out


def _links(ls: LoadedSweep, cells: list[Cell]) -> list[tuple[str, str]]:
    """A PD cell and its reference; where build pairs are measured paired (:func:`pdsweep.plan.pairing.pairing`),
    the PD cells of one compare key that have a load phase (the builds of one cell, whose pairs
    :func:`pdsweep.run.pairs.plan_pairs` measures interleaved)."""
    pd = [c for c in cells if c.kind == "pd"]
    links = [(c.id, reference_of(c, ls).id) for c in pd] if ls.sweep.eval.reference else []
    if pairing(ls.sweep.bench)[0]:
        first: dict[str, str] = {}
        links += [(first.setdefault(c.compare_key, c.id), c.id) for c in pd if no_load_phase(c) is None]
    return links


def job_cells(
    ls: LoadedSweep, cells: list[Cell], shard: Shard | None, estimate: Callable[[Cell], float] | None = None
) -> Job:
    """The cells this job runs out of the selected ``cells`` (references included): folded,
    then cut to ``shard`` by ``estimate`` (cell -> seconds: :meth:`pdsweep.plan.durations.CellClock.wall`;
    None: the model, :func:`pdsweep.plan.startup.estimator`). Raises ``UserError`` when the shard
    is empty (more shards than groups of cells that must run together)."""
    ref = (lambda c: reference_of(c, ls).id) if ls.sweep.eval.reference else (lambda c: None)
    folded = fold(cells, _blocks(ls), ref)
    job = Job(folded.cells, folded.into, folded.why)
    if shard is None:
        return job
    parts = cut(folded.cells, shard.count, _keys(ls, folded.cells), _links(ls, folded.cells), estimate or estimator(ls))
    mine = parts[shard.index - 1]
    if not mine:
        groups = sum(1 for p in parts if p)
        raise UserError(
            f"--shard {shard}: no cell for this shard: {ls.path} has {groups} groups of cells that must run "
            f"together (shared instances, references, build pairs); use --shard i/{groups} or fewer"
        )
    ids = {c.id for c in mine}
    return Job(
        mine,
        {a: r for a, r in folded.into.items() if r in ids},
        {a: w for a, w in folded.why.items() if folded.into[a] in ids},
        {"index": shard.index, "count": shard.count, "cells": len(mine), "of": len(folded.cells)},
    )


def core_case_warning(ls: LoadedSweep, plan: Plan, not_runnable: set[str]) -> str | None:
    """A warning when the sweep has core-case cells (PD, hybrid MLA + SSM model, prefill TP >
    decode TP: the shape of vLLM PR #49297) but none of them runs here (each rejected by a rule
    or NOT-RUNNABLE on this node); None otherwise, and for a sweep without the core case."""

    def core(c: Cell) -> bool:
        m = ls.catalogue.models[c.model]
        return c.kind == "pd" and m.attention == "mla" and m.is_hybrid and c.prefill_tp > c.decode_tp

    planned = [c for c in plan.cells if core(c)]
    rejected = [r.cell for r in plan.rejected if core(r.cell)]
    if not planned and not rejected:
        return None
    if any(c.id not in not_runnable for c in planned):
        return None
    return (
        f"{ls.path}: the core case (hybrid MLA + SSM, prefill TP > decode TP) has no runnable cell here: "
        f"{len(planned)} NOT-RUNNABLE on this node, {len(rejected)} rejected by rules "
        f"(e.g. {', '.join(c.id for c in (planned + rejected)[:3])}); this run cannot show PR #49297's fix"
    )


def annotate(d: dict[str, Any], ls: LoadedSweep, plan: Plan, job: Job, args: JobArgs) -> dict[str, Any]:
    """The dry run ``d`` (:func:`pdsweep.run.dryrun.plan_dict`) with this job's ``folded`` cells
    (``{id: {"runs_as", "blocks"}}``, and ``also`` on the cell that runs), its ``shard``, the
    core-case ``warnings`` and the ``budget`` verdict (:func:`pdsweep.plan.clock.verdict`)."""
    also: dict[str, list[str]] = {}
    for a, r in job.folded.items():
        also.setdefault(r, []).append(a)
    for c in d["cells"]:
        c["also"] = also.get(c["id"], [])
    d["folded"] = {a: {"runs_as": r, "blocks": job.fold_why[a]} for a, r in job.folded.items()}
    d["shard"] = job.shard
    out = {x["cell"] for x in d["schedule"]["needs_more_gpus"]}
    out |= {a for a, r in job.folded.items() if r in out}
    d["warnings"] = [w] if (w := core_case_warning(ls, plan, out)) else []
    budget = pick(args.budget, ls.sweep.budget, ls.path)
    what = f"shard {job.shard['index']}/{job.shard['count']}" if job.shard else "the whole sweep"
    shards = job.shard["count"] if job.shard else 1
    durations = d.get("durations") or {}
    basis = durations["line"] if durations.get("from") else "pdsweep's duration estimate"
    d["budget"] = verdict(d["makespan"]["s"], budget, what, shards, basis) if budget else None
    if budget and d["platform"] == "cuda" and not d["gpus"]:  # nothing placed: a makespan of 0 proves nothing
        d["budget"].update(
            fits=False,
            line=f"the budget of {budget.minutes:g} min ({budget.source}) cannot be checked: no GPU to plan on "
            "(give --gpus N, or plan on the node)",
        )
    return d


def job_text(d: dict[str, Any]) -> str:
    """The lines ``pdsweep plan`` prints for :func:`annotate`'s keys."""
    lines = [
        f"folded: {a} runs as {f['runs_as']} (the same deployment after vLLM's block arithmetic: {f['blocks']})\n"
        for a, f in (d.get("folded") or {}).items()
    ]
    if s := d.get("shard"):
        lines.append(f"shard {s['index']}/{s['count']}: {s['cells']} of {s['of']} cells (whole instance chains)\n")
    lines += durations_text(d.get("durations"))
    if b := d.get("budget"):
        lines.append(f"budget: {b['line']}\n")
    return "".join(lines)


def durations_text(rec: dict[str, Any] | None) -> list[str]:
    """The plan's lines for its ``durations`` (:meth:`pdsweep.plan.durations.CellClock.record`):
    where the cells' seconds came from and each record that fell back to the model, with why;
    none when no ``--durations-from`` was given (the model alone: the makespan line says "estimated")."""
    if not rec or not rec.get("from"):
        return []
    return [f"durations: {rec['line']}\n"] + [
        f"  {cid}: {MODEL_WORDS} ({why})\n" for cid, why in rec["unusable"].items()
    ]
