"""``pdsweep run``: execute a planned sweep, cell by cell (concurrently on disjoint GPU
sets), writing ``results/<run>/`` as described in results/README.md.

A failing cell is recorded (status.json: phase, reason, log tail) and the sweep goes on.
``--resume`` skips cells whose status is final. SIGINT/SIGTERM tear down every process
this run started, mark in-flight cells ``interrupted`` (not final) and exit 130; further
SIGINT/SIGTERM are ignored from the first on (teardown is SIGKILL and bounded).
After the cells, a judge pass writes accuracy.json and consistency.json from the raw
eval.json / probe.json of each PD cell and its single-instance reference.
"""

from __future__ import annotations

import concurrent.futures as cf
import datetime as dt
import functools
import hashlib
import logging
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pdsweep import __version__
from pdsweep.builds import attnprobe
from pdsweep.core.errors import UserError
from pdsweep.core.paths import REPO
from pdsweep.deploy import launchers
from pdsweep.deploy.instances import Fresh, InstancePool
from pdsweep.deploy.launchers import Launcher
from pdsweep.judge.accuracy import frozen_expected
from pdsweep.judge.verdicts import judge_run
from pdsweep.measure.evaltasks import check_eval_tasks
from pdsweep.plan.builds import build_info
from pdsweep.plan.crossnode import loopback_node_addrs
from pdsweep.plan.expand import Cell, expand, reference_of, select_cells
from pdsweep.plan.instance import PORTS_PER_SLOT, Slot
from pdsweep.plan.placement import Cluster
from pdsweep.plan.schedule import GpuPool
from pdsweep.plan.shards import JobArgs
from pdsweep.results import layout
from pdsweep.run.cell import run_cell
from pdsweep.run.context import RunContext, RunOptions
from pdsweep.run.feasible import feasibility_warnings
from pdsweep.run.gpureuse import run_dispatch
from pdsweep.run.pairs import lanes, run_pairs
from pdsweep.run.prebuild import prebuild_checkpoints
from pdsweep.run.progress import Progress
from pdsweep.run.provenance import git_sha, host_facts, now
from pdsweep.run.runplan import RunPlan, place, plan_cells
from pdsweep.sweepfile.sweep import LoadedSweep, load_sweep

log = logging.getLogger(__name__)


# ---------------------------------------------------------------- the sweep
def default_run_dir(ls: LoadedSweep) -> Path:
    return REPO / "results" / f"{ls.sweep.name}-{dt.datetime.now().strftime('%Y%m%d-%H%M%S')}"


def write_index(ctx: RunContext, rp: RunPlan, started: str, finished: str | None) -> None:
    num_gpus, too_big = rp.pool.num_gpus, [c for c in rp.cells if c.id in rp.why]  # a reference only they need, too
    index = {
        "name": ctx.run_dir.name,
        "sweep": str(ctx.ls.path),
        "sweep_name": ctx.ls.sweep.name,
        "sweep_sha256": ctx.sweep_sha256,
        "platform": ctx.ls.sweep.platform,
        "started": started,
        "finished": finished,
        "host": host_facts(num_gpus),
        "git_sha": ctx.git_sha,
        "git_shas": ctx.git_shas,
        "pdsweep_version": __version__,
        "gate": ctx.ls.sweep.gate.model_dump(),
        "bench": ctx.ls.sweep.bench.model_dump(),
        "eval": ctx.ls.sweep.eval.model_dump(),  # what accuracy.json and consistency.json must hold
        "expected": frozen_expected([c.model for c in rp.cells], ctx.ls.sweep.eval.tasks),  # each task's expected score
        "reuse": isinstance(ctx.provider, InstancePool),
        "timings": ctx.timings,
        "instances": ctx.provider.record() if ctx.provider else None,
        "cells": {
            c.id: {
                "kind": c.kind,
                "status": layout.cell_status(ctx.run_dir, c.id) or "pending",
                "expect_fail": c.expect_fail,
            }
            for c in rp.cells
        },
        "folded": rp.job.folded,  # folded id -> the id that ran for it (pdsweep.plan.fold)
        "shard": rp.job.shard,  # job i of n (pdsweep.plan.shards)
        "rejected": [{"cell_id": r.cell.id, "rule": r.rule, "reason": r.reason} for r in ctx.plan.rejected]
        + [
            {
                "cell_id": c.id,
                "rule": layout.NEEDS_GPUS,
                "reason": ctx.needs(c) if ctx.needs else f"needs {c.num_gpus} GPUs, host has {num_gpus}",
            }
            for c in too_big
        ],
    }
    layout.write_json(ctx.run_dir / layout.RUN_FILE, index)


def run_sweep(path: str | Path, opts: RunOptions) -> Path:
    """Run every selected cell of the sweep at ``path`` as its :class:`pdsweep.run.runplan.RunPlan`
    says; returns the run directory. Raises ``UserError`` for a sweep or run directory that
    cannot be run (before any write), ``KeyboardInterrupt`` after SIGINT/SIGTERM (every process
    stopped)."""
    t_run = time.monotonic()
    ctx, rp = _open_run(path, opts)
    pool = rp.pool
    prev = layout.read_json_or_none(ctx.run_dir / layout.RUN_FILE) if opts.resume else None
    started = (prev or {}).get("started") or now()  # a resumed run keeps when it began: its history key
    write_index(ctx, rp, started, None)
    ctx.builds = {b: build_info(ctx.ls, b) for b in sorted({c.build for c in rp.todo})}
    t = time.monotonic()
    _, unbuilt = prebuild_checkpoints(ctx.ls, rp.todo)  # before any instance (prestart) needs one
    ctx.timings["checkpoints_s"] = round(time.monotonic() - t, 3)
    pythons = {b: None if info.get("error") else info.get("python") for b, info in ctx.builds.items()}
    rp = rp.with_instances(pythons, set(unbuilt))
    _write_plan(ctx, rp)
    attnprobe.close_probes()  # planning is done: no vLLM-importing probe lives through the cells
    above = ctx.ls.sweep.defaults.port_base + PORTS_PER_SLOT * lanes(
        bool(rp.pairs and rp.pairs[0]), pool.num_gpus
    )  # the lanes' ports
    ctx.provider = InstancePool(ctx.launcher, ctx.run_dir / "instances", above) if rp.reuse_on else Fresh(ctx.launcher)
    ctx.progress = Progress(len(rp.todo), quiet=opts.quiet, skipped=len(rp.runnable) - len(rp.todo))

    def on_signal(signum, frame):
        for s in old:  # teardown runs to its end: a second Ctrl-C cannot cut it short (it is SIGKILL, bounded)
            signal.signal(s, signal.SIG_IGN)
        ctx.stop.set()
        ctx.launcher.kill_all()
        raise KeyboardInterrupt

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        todo = run_pairs(ctx, rp.todo, pool, rp.pairs)  # build pairs (pdsweep.plan.pairing) first, both cells at once
        EXECUTORS[rp.executor](ctx, rp, todo)
    except KeyboardInterrupt:
        ctx.stop.set()
        ctx.launcher.kill_all()
        write_index(ctx, rp, started, None)
        raise
    finally:
        if isinstance(ctx.provider, InstancePool) and not ctx.stop.is_set():
            ctx.provider.close()  # the last cell's instances, stopped gracefully
        ctx.launcher.kill_all()
        ctx.alt.close()  # the run's host-wide port claims (pdsweep.deploy.portlocks): none outlives it
        if isinstance(ctx.provider, InstancePool):
            ctx.provider.blocks.close()
        attnprobe.close_probes()  # any a cell's block check started again
        ctx.progress.close()
        for s, h in old.items():
            signal.signal(s, h)
    t = time.monotonic()
    judge_run(ctx.run_dir, ctx.ls)
    ctx.timings.update(judge_s=round(time.monotonic() - t, 3), cells_s=round(t - t_run, 3))
    ctx.timings["wall_s"] = round(time.monotonic() - t_run, 3)
    write_index(ctx, rp, started, now())
    return ctx.run_dir


def _open_run(path: str | Path, opts: RunOptions) -> tuple[RunContext, RunPlan]:
    """Load, check and open the run: (context, the run's plan before its instances). Raises
    ``UserError`` before anything is written."""
    ls = load_sweep(path)
    plan = expand(ls)
    for warning in feasibility_warnings(plan, tasks=not opts.skip_eval):
        log.warning("%s", warning)
    cells = select_cells(plan, opts.cells)
    if not plan.pd_cells:
        raise UserError(f"{ls.path}: no PD cell to run ({len(plan.rejected)} rejected; see `pdsweep plan`)")
    if not opts.skip_eval:
        check_eval_tasks(ls)
    if not cells:
        raise UserError(f"no cell of {ls.path} matches --cells {opts.cells!r}")
    run_dir = (Path(opts.out) if opts.out else default_run_dir(ls)).resolve()  # results/latest -> its run
    old = layout.read_json_or_none(run_dir / layout.RUN_FILE)
    if old and not opts.resume:
        raise UserError(f"{run_dir} already holds a run; pass --resume to finish it or choose another --out")
    sha = hashlib.sha256(ls.path.read_bytes()).hexdigest()
    if old and old.get("sweep_sha256") not in (None, sha):
        raise UserError(
            f"{run_dir}: {ls.path} changed since this run started (sweep_sha256 differs); "
            "results would mix two sweeps: start a new run"
        )
    launcher, cluster = launcher_cluster(ls, opts)  # outside an allocation: refused before any write
    done = (lambda c: layout.cell_status(run_dir, c.id) in layout.FINAL_STATUSES) if opts.resume else lambda c: False
    check = opts.preflight and opts.launcher == "local"  # weights, memory, driver, busy GPUs: before anything starts
    where = functools.partial(place, ls, gpus=opts.gpus, cluster=cluster, check=check, fit=False, refuse_unfetched=True)
    # this job's cells (identical deployments folded, then its shard), placed and scheduled
    job = JobArgs(opts.shard, None, opts.durations_from)  # `run` checks no budget: `plan`/`validate` do
    rp = plan_cells(plan, cells, job, where, opts.reuse, opts.prestart, done)
    if opts.durations_from is not None:  # where the shard cut and dispatch order took their seconds from
        print(f"durations: {rp.seconds.record(rp.cells)['line']}", file=sys.stderr)
    if rp.fitted:
        log.info("cells fitted to %s", rp.fitted)
    current = git_sha()
    git_shas = [x for x in dict.fromkeys([*(old or {}).get("git_shas", []), current]) if x]
    run_dir.mkdir(parents=True, exist_ok=True)
    why, pool = rp.why, rp.pool
    ctx = RunContext(
        ls,
        plan,
        run_dir,
        opts,
        launcher=launcher,
        needs=lambda c: why.get(c.id) or pool.needs(c),
        git_shas=git_shas,
        sweep_sha256=sha,
        git_sha=current,
    )
    return ctx, rp


def _write_plan(ctx: RunContext, rp: RunPlan) -> None:
    """plan.json: cells, rejected cells, the schedule and, with reuse, the run order and
    which instance each cell uses, when each starts and stops (:func:`pdsweep.plan.schedule.lifecycle`)."""
    body: dict[str, Any] = {
        "cells": [c.to_dict() for c in rp.cells],
        "rejected": [{"cell": r.cell.to_dict(), "rule": r.rule, "reason": r.reason} for r in rp.expanded.rejected],
        "schedule": rp.schedule.to_dict(),
        # what each PD cell's accuracy.json must name as its reference (judge.planned.PlannedTasksCheck)
        "references": {c.id: reference_of(c, ctx.ls).id for c in rp.cells if c.kind == "pd"},
        "durations": rp.seconds.record(rp.cells),  # where the plan's cell seconds came from (--durations-from)
    }
    if rp.reuse is not None and rp.todo:
        body["reuse"] = rp.reuse
    layout.write_json(ctx.run_dir / layout.PLAN_FILE, body)


def launcher_cluster(ls: LoadedSweep, opts: RunOptions) -> tuple[Launcher, Cluster | None]:
    """The launcher of ``opts.launcher`` and the cluster it places over: local -> this host
    (None); slurm -> the nodes x GPUs of the allocation we run in (``SLURM_JOB_NODELIST``,
    ``SLURM_GPUS_ON_NODE`` or ``--gpus-per-node``; 0 on CPU). Raises ``UserError`` (unknown
    launcher, no allocation, a node of a multi-host allocation at a loopback address)."""
    launcher = launchers.make_launcher(opts.launcher)
    if opts.launcher != "slurm":
        return launcher, None
    gpn = opts.gpus_per_node if opts.gpus_per_node is not None else launcher.gpus_per_node
    nodes = tuple(launcher.nodes)
    addrs = tuple(launcher.addrs[n] for n in nodes)
    if bad := loopback_node_addrs(nodes, addrs):  # refused before any write (pdsweep.plan.crossnode)
        raise UserError(
            f"--launcher slurm: a node of a multi-host allocation has a loopback address: {'; '.join(bad)} "
            f"(scontrol show node; all addresses: {', '.join(addrs)}); prefill and decode on different "
            "nodes reach each other at NodeAddr, which must be the node's reachable address"
        )
    return launcher, Cluster(nodes, gpn if ls.sweep.platform == "cuda" else 0, addrs)


def _dispatch(ctx: RunContext, rp: RunPlan, todo: list[Cell]) -> None:
    """Start cells in order whenever their GPUs are free; wait for one to finish otherwise."""
    pending, pool = list(todo), rp.pool
    workers = max(1, pool.num_gpus)
    with cf.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="cell") as ex:
        running: dict[cf.Future, Slot] = {}
        while pending or running:
            if ctx.stop.is_set():
                break
            for cell in list(pending):
                slot = pool.try_acquire(cell)
                if slot is None:
                    continue
                pending.remove(cell)
                running[ex.submit(run_cell, ctx, cell, slot)] = slot
            if not running:
                break
            done, _ = cf.wait(list(running), timeout=0.5, return_when=cf.FIRST_COMPLETED)
            for fut in done:
                pool.release(running.pop(fut))
                fut.result()


def _sequential(ctx: RunContext, rp: RunPlan, todo: list[Cell]) -> None:
    """One cell at a time on the shared instance pool (``ctx.provider``): once a cell is
    ready, the next cell's new instances start (``prestart``: their startup overlaps this
    cell's measurement); after it, every instance the next cell does not need stops."""
    provider: InstancePool = ctx.provider
    pool, keys = rp.pool, rp.specs
    for i, cell in enumerate(todo):
        if ctx.stop.is_set():
            break
        nxt = todo[i + 1] if i + 1 < len(todo) else None
        hook = None
        if nxt is not None and ctx.opts.prestart and keys.get(nxt.id):
            hook = functools.partial(provider.prestart, keys[nxt.id], nxt.id)
        slot = pool.try_acquire(cell)
        if slot is None:  # a CPU lane is free between cells: this is a pdsweep bug
            raise RuntimeError(f"{cell.id}: no free lane in the sequential run")
        try:
            run_cell(ctx, cell, slot, on_ready=hook)
        finally:
            pool.release(slot)
        provider.keep_only(keys.get(nxt.id, []) if nxt else [], cell.id)


def _reuse_dispatch(ctx: RunContext, rp: RunPlan, todo: list[Cell]) -> None:
    """The plan's GPU dispatch (:func:`pdsweep.run.gpureuse.run_dispatch`) of the cells of ``todo``
    (those ``bench.pair_builds`` left), in the plan's priority order."""
    assert rp.dispatch is not None and isinstance(rp.pool, GpuPool), "reuse dispatch planned without GPUs"
    left = {c.id for c in todo}
    order, _, inp = rp.dispatch
    run_dispatch(ctx, ([c for c in order if c.id in left], inp), rp.pool, rp.specs, run_cell)


# the executor of each RunPlan.executor (pdsweep.run.runplan.EXECUTORS)
EXECUTORS: dict[str, Callable[[RunContext, RunPlan, list[Cell]], None]] = {
    "cells": _dispatch,
    "reuse": _sequential,
    "reuse dispatch": _reuse_dispatch,
}
