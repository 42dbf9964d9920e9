"""The one plan of a run: what ``pdsweep plan`` prints and ``pdsweep run`` executes.

:func:`plan_cells` takes the job's cells (folded, sharded: :func:`pdsweep.run.jobs.job_cells`), has them
placed (:func:`place`: one host's GPUs, fitted by the preflight or ``plan_fit``, or a cluster's nodes), and
the cells that run there (NOT-RUNNABLE ones with why), the estimated schedule and the cells left to run; then
:meth:`RunPlan.with_instances` each cell's instances, the run order (with instance reuse:
:func:`pdsweep.plan.schedule.reuse_order`), the reuse record, the GPU dispatch
(:func:`pdsweep.run.gpureuse.plan_order`), the ``bench.pair_builds`` pairs and the executor
(:data:`EXECUTORS`). Nothing here starts or writes anything: ``run`` takes every decision from
the :class:`RunPlan` and no other derivation (tests/test_run_plan.py holds it)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from pdsweep.core.errors import UserError
from pdsweep.deploy.instances import instance_key, reuse_record
from pdsweep.plan.dispatch import Inputs, Placed
from pdsweep.plan.durations import CellClock
from pdsweep.plan.expand import Plan, reference_of
from pdsweep.plan.instance import InstanceSpec, instances, model_path
from pdsweep.plan.pairing import pairing
from pdsweep.plan.placement import Cluster, ClusterPool
from pdsweep.plan.schedule import GpuPool, Schedule, detect_gpus, order, pack, reuse_order
from pdsweep.plan.shards import JobArgs
from pdsweep.plan.startup import estimator
from pdsweep.run.gpureuse import plan_order, record
from pdsweep.run.jobs import Job, job_cells
from pdsweep.run.pairs import Pair, fitting, plan_pairs
from pdsweep.run.preflight import plan_fit, preflight
from pdsweep.sweepfile.sweep import LoadedSweep

log = logging.getLogger(__name__)
Pool = GpuPool | ClusterPool
# a job's cells -> :func:`place`'s (pool, fitted shape, warnings: logged), with the caller's resources and checks
Placer = Callable[[list[Any]], tuple[Pool, str | None, list[str]]]

# How `run` executes a plan, by (instance reuse, GPUs on this host): `cells` dispatches each cell
# with its own instances on free GPUs (or one at a time on CPU); `reuse` runs one cell at a time
# on shared instances; `reuse dispatch` runs cells at once, instances keeping their GPUs
# (pdsweep.run.gpureuse). A cluster has no instance reuse.
EXECUTORS = {
    (False, False): "cells",
    (False, True): "cells",
    (True, False): "reuse",
    (True, True): "reuse dispatch",
}


def place(
    ls: LoadedSweep,
    cells: list[Any],
    gpus: int | None,
    cluster: Cluster | None,
    check: bool,
    fit: bool,
    refuse_unfetched: bool = False,
) -> tuple[Pool, str | None, list[str]]:
    """(an empty pool of the resources ``cells`` run on, the node shape they were memory-fitted
    to or None, the preflight's warnings): ``cluster``'s nodes, or this host's ``gpus`` (None:
    nvidia-smi on CUDA, 0 on CPU); ``check``: weights, memory fit, driver and busy GPUs
    (:func:`pdsweep.run.preflight.preflight`, raises ``UserError``); ``fit`` (the dry run): else,
    on CUDA without ``gpus``, the GPUs nvidia-smi lists (:func:`pdsweep.run.preflight.plan_fit`).
    ``refuse_unfetched`` (``run``): a hub model not (completely) in the cache raises ``UserError``
    before anything starts: an instance would download inside its startup budget (``plan`` warns)."""
    cuda, port_base = ls.sweep.platform == "cuda", ls.sweep.defaults.port_base
    if cluster is not None:
        return ClusterPool(cluster if cuda else replace(cluster, gpus_per_node=0), port_base), None, []
    checked = None
    if check:
        checked = preflight(ls, cells, gpus)
        if refuse_unfetched and checked.unfetched:
            raise UserError(f"{ls.path}: preflight: nothing started:\n" + "\n".join(checked.unfetched))
    elif fit and cuda and gpus is None:
        checked = plan_fit(ls, cells)  # the GPUs nvidia-smi lists: usable ones, per-cell memory fit
    warnings = checked.warnings if checked else []
    if checked is not None and cuda and checked.gpu_ids:
        ids = checked.gpu_ids
        return GpuPool(len(ids), port_base, ids=ids, unfit=checked.unfit), checked.shape, warnings
    n = gpus if gpus is not None else (detect_gpus() if cuda and not fit else 0)
    return GpuPool(n, port_base), None, warnings


def fresh_pool(pool: Pool) -> Pool:
    """An empty pool like ``pool`` (a schedule simulated on it must not take the run's GPUs)."""
    if isinstance(pool, ClusterPool):
        return ClusterPool(pool.cluster, pool.port_base, pool.cpus)
    return GpuPool(pool.num_gpus, pool.port_base, pool.cpus, ids=pool.ids, unfit=pool.unfit)


@dataclass(frozen=True)
class RunPlan:
    """What a run does. ``job``: the job's cells out of the selected ones (folded, sharded), what was
    folded into what; ``cells``: the job's cells (with the references they need); ``fitted``: the node
    shape :func:`place` fitted them to (or None); ``why``: cell id -> why it is NOT-RUNNABLE here;
    ``schedule``: the estimated cell schedule; ``runnable``: the others in run order; ``todo``: those
    left to run (``done``: final under ``--resume``), in the order ``run`` takes them; ``specs``: cell
    id -> its planned instances (ports of its schedule lane; GPU ids are where, not what); ``reuse``:
    plan.json ``reuse`` (None without instance reuse); ``dispatch``: (priority order, simulation,
    inputs) of the reuse dispatch on GPUs; ``pairs``: ``bench.pair_builds`` pairs, why other PD cells run alone;
    ``clock``: each cell's seconds (measured in ``--durations-from``, else the model: :class:`CellClock`)."""

    ls: LoadedSweep
    expanded: Plan
    job: Job
    pool: Pool
    why: dict[str, str]
    schedule: Schedule
    runnable: list[Any]
    todo: list[Any]
    fitted: str | None = None
    reuse_on: bool = True
    prestart: bool = True
    specs: dict[str, list[InstanceSpec]] = field(default_factory=dict)
    reuse: dict[str, Any] | None = None
    dispatch: tuple[list[Any], list[Placed], Inputs] | None = None
    pairs: tuple[list[Pair], dict[str, str]] | None = None
    clock: CellClock | None = None

    @property
    def seconds(self) -> CellClock:
        """:attr:`clock`, or the model alone when none was given."""
        return self.clock or CellClock(estimator(self.ls), self.ls.sweep.platform)

    @property
    def cells(self) -> list[Any]:
        return self.job.cells

    @property
    def executor(self) -> str:
        """How ``run`` executes this plan: a key of the run's executors (:data:`EXECUTORS`)."""
        return EXECUTORS[(self.reuse_on, bool(self.pool.num_gpus))]

    def with_instances(self, python_of: dict[str, str | None], unbuilt: set[str] | frozenset[str]) -> RunPlan:
        """This plan with each scheduled cell's instances (``python_of``: build -> its
        interpreter, None when unusable; ``unbuilt``: models without a checkpoint: their cells
        plan no instance), the reuse order and record, the dispatch and the pairs."""
        ls, clock = self.ls, self.seconds
        slots = {p.cell.id: p.slot for p in self.schedule.placements}
        specs = {c.id: _specs(ls, c, slots[c.id], python_of.get(c.build), unbuilt) for c in self.cells if c.id in slots}
        todo, reuse, dispatch = self.todo, None, None
        pairs = _pairs(ls, todo, self.runnable)
        if pairs and self.pool.num_gpus:  # a pair larger than the pool runs its cells alone, in the dispatch
            pairs = fitting(pairs, self.pool.num_gpus)
        if self.reuse_on:
            # build pairs run first, their instances stopped after each (pdsweep.run.pairs): no reuse across them
            paired = [c for p in (pairs[0] if pairs else []) for c in (p.a, p.b)]
            rest = [c for c in todo if c not in paired]
            mine = {c.id: specs.get(c.id, []) for c in todo}
            rest = reuse_order(rest, {c.id: {instance_key(s) for s in mine[c.id]} for c in rest})
            todo = paired + rest
            reuse = reuse_record(todo, mine, self.prestart)
            if self.pool.num_gpus:  # the cells the pairs leave: what run_pairs hands the dispatch
                dispatch = plan_order(rest, mine, self.pool.num_gpus, clock.wall, self.prestart, clock.work)
                reuse["schedule"] = record(dispatch[1], clock.wall)
                reuse["schedule"]["instance_starts"] += sum(len(mine[c.id]) for c in paired)  # each pair starts its own
        return replace(self, specs=specs, todo=todo, reuse=reuse, dispatch=dispatch, pairs=pairs)


def _pairs(ls: LoadedSweep, todo: list[Any], runnable: list[Any]) -> tuple[list[Pair], dict[str, str]] | None:
    """The build pairs ``run`` measures paired and why each other PD cell meant to pair runs
    alone (:func:`pdsweep.run.pairs.plan_pairs`); None when the sweep does not pair
    (:func:`pdsweep.plan.pairing.pairing`) or, by default, has nothing to pair."""
    on, _ = pairing(ls.sweep.bench)
    if not on:
        return None
    explicit = ls.sweep.bench.pair_builds is True
    pairs = plan_pairs(list(ls.sweep.builds), todo, runnable, explicit)
    return pairs if explicit or pairs[0] or pairs[1] else None


def _specs(ls: LoadedSweep, cell: Any, slot: Any, python: str | None, unbuilt: Any) -> list[InstanceSpec]:
    """The instances ``cell`` runs on ``slot``; none when its build or checkpoint is unusable."""
    if python is None or cell.model in unbuilt:
        return []
    try:
        mpath = model_path(ls.catalogue.models[cell.model], cell.model)
    except UserError:
        return []
    return instances(cell, slot, ls, mpath, python)


def plan_cells(
    expanded: Plan, selected: list[Any], job_args: JobArgs, where: Placer, reuse: bool = True,
    prestart: bool = True, done: Callable[[Any], bool] = lambda c: False,
) -> RunPlan:  # fmt: skip
    """The plan of this job (``job_args.shard`` of the ``selected`` cells, folded: :func:`job_cells`;
    ``UserError`` for an empty shard) on the pool ``where`` places its cells on (instances:
    :meth:`RunPlan.with_instances`). ``reuse``: share identical instances (not on a cluster);
    ``prestart``: start the next cell's instances early; ``done(cell)``: final (``--resume``);
    ``job_args.durations``: measured cell durations of a previous run (``--durations-from``; the shard
    cut, schedule and dispatch take them where a cell has one)."""
    ls = expanded.loaded
    clock = CellClock(estimator(ls), ls.sweep.platform, job_args.durations)
    job = job_cells(ls, selected, job_args.shard, clock.wall)
    cells = job.cells
    pool, fitted, warnings = where(cells)
    for w in warnings:
        log.warning("%s", w)
    ref_of = (lambda c: reference_of(c, ls).id) if ls.sweep.eval.reference else None
    sched = pack(
        cells, pool.num_gpus, pool.port_base, pool=fresh_pool(pool), estimate=clock.wall, ref_of=ref_of, rank=clock.rank
    )
    why = sched.reasons
    runnable = [c for c in order(cells, clock.rank) if c.id not in why]
    reuse_on = reuse and not isinstance(pool, ClusterPool)
    todo = [c for c in runnable if not done(c)]
    return RunPlan(ls, expanded, job, pool, why, sched, runnable, todo, fitted, reuse_on, prestart, clock=clock)
