"""The dry run (``pdsweep plan``, and the argv check of ``validate``): the cells of a
sweep with every instance's exact ``vllm serve`` argv/env, the rejected cells with their
rule, and the schedule over one host or a cluster, as a dict (``--format json``) or as
tables: the :class:`pdsweep.run.runplan.RunPlan` ``run`` executes. Starts nothing and writes
nothing (tiny checkpoints are named, not built)."""

from __future__ import annotations

import logging
import shlex
import sys
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from pdsweep.builds import answers, attnprobe, fixprobes
from pdsweep.builds.argcheck import submit_instances
from pdsweep.builds.make import PROVENANCE_FIELDS, read_marker
from pdsweep.core.errors import UserError
from pdsweep.deploy.launchers.slurm import allocation, node_addrs
from pdsweep.measure.percentiles import percentile_plan
from pdsweep.plan.blocks import for_cell, target_arch
from pdsweep.plan.builds import build_python
from pdsweep.plan.expand import expand, reference_of, select_cells
from pdsweep.plan.instance import PORTS_PER_SLOT, Slot, check_ports, instances, model_path, planned_blocks
from pdsweep.plan.placement import Cluster
from pdsweep.plan.shards import JobArgs
from pdsweep.run.feasible import feasibility_warnings
from pdsweep.run.jobs import annotate, job_text
from pdsweep.run.pairplan import pairs_dict, pairs_off, pairs_text
from pdsweep.run.runplan import RunPlan, place, plan_cells
from pdsweep.run.unverified import cell_unverified, unverified_text
from pdsweep.sweepfile.sweep import LoadedSweep, load_sweep

log = logging.getLogger(__name__)


def check_cells_argv(ls: LoadedSweep, cells: list[Any]) -> None:
    """Parse every instance argv of ``cells`` with the installed vLLM (:mod:`pdsweep.builds.argcheck`);
    raises ``UserError`` naming cell, instance and vLLM's message."""
    submit_cells_argv(ls, cells)()


def submit_cells_argv(ls: LoadedSweep, cells: list[Any]) -> Any:
    """:func:`check_cells_argv` started: vLLM parses (in its probe process) until the returned
    function is called, which waits and raises ``UserError`` as :func:`check_cells_argv`."""
    items = []
    for c in cells:
        m = ls.catalogue.models[c.model]
        slot = Slot(0, tuple(range(c.num_gpus)), ls.sweep.defaults.port_base)
        specs = instances(c, slot, ls, model_path(m, c.model), "python")
        items += [(c.id, i.name, i.argv) for i in specs]
    wait = submit_instances(items)

    def verdict() -> None:
        if bad := wait():
            raise UserError(f"{ls.path}: vLLM refuses {len(bad)} instance argv(s):\n" + "\n".join(bad))

    return verdict


def start_probe_if_cold(ls: LoadedSweep, check: bool) -> None:
    """Start this interpreter's vLLM probe (:func:`pdsweep.builds.attnprobe.start`) when the plan
    will ask it (argv check, or a CUDA sweep's backend choice) and its answers are not kept yet:
    vLLM's import then overlaps expanding the sweep. A warm store starts nothing."""
    py = sys.executable
    code = attnprobe.SCRIPT
    if (check and answers.cold("argv", py, code)) or (ls.sweep.platform == "cuda" and answers.cold("attn", py, code)):
        attnprobe.start(py)


MAX_NODES = 4096  # a plan over more nodes is a typo, not a cluster
MAX_GPUS_PER_NODE = 64


def _check_slot_ports(slots: dict, port_base: int) -> None:
    """Raise ``UserError`` when a lane the schedule placed (one host or a cluster) has ports
    past :data:`pdsweep.plan.instance.MAX_PORT` (:func:`pdsweep.plan.instance.check_ports`)."""
    if slots:
        lanes = len({s.port_base for s in slots.values()})
        check_ports(
            port_base,
            max(s.port_base for s in slots.values()) + PORTS_PER_SLOT - port_base,
            f"defaults.port_base {port_base}: the schedule runs {lanes} lanes of {PORTS_PER_SLOT} ports "
            "(lower port_base, or fewer nodes/GPUs)",
        )


def plan_cluster(nodes: int | None, gpus_per_node: int | None, launcher: str = "local") -> Cluster | None:
    """The :class:`pdsweep.plan.placement.Cluster` to place over, or None (one host). Raises
    ``UserError`` for ``--nodes`` without ``--gpus-per-node`` or non-positive counts."""
    if nodes is None and launcher != "slurm":
        if gpus_per_node is not None:
            raise UserError("--gpus-per-node needs --nodes N (or --launcher slurm inside an allocation)")
        return None
    if gpus_per_node is not None and not 0 <= gpus_per_node <= MAX_GPUS_PER_NODE:
        raise UserError(f"--gpus-per-node {gpus_per_node}: allowed 0..{MAX_GPUS_PER_NODE}")
    if nodes is not None:
        if not 1 <= nodes <= MAX_NODES:
            raise UserError(f"--nodes {nodes}: allowed 1..{MAX_NODES}")
        if gpus_per_node is None:
            raise UserError(f"--nodes {nodes}: give --gpus-per-node G as well (G 0..{MAX_GPUS_PER_NODE})")
        if launcher == "slurm":
            raise UserError("--nodes places over a synthetic cluster; --launcher slurm over the allocation: give one")
        return Cluster.synthetic(nodes, gpus_per_node)
    _, names, gpn = allocation()
    addrs = node_addrs(names)
    return Cluster(tuple(names), gpn if gpus_per_node is None else gpus_per_node, tuple(addrs[n] for n in names))


def plan_dict(
    sweep: str,
    gpus: int | None,
    cells_glob: str | None = None,
    cluster: Cluster | None = None,
    check: bool = False,
    gpu_check: bool = False,
    job_args: JobArgs | None = None,
) -> dict[str, Any]:
    """The dry run: cells with per-instance argv/env (and node), rejected cells, and the
    schedule; over ``cluster`` (nodes x GPUs) when given, else over one host's ``gpus``.
    ``gpu_check``: run :func:`pdsweep.run.preflight.preflight` first (``UserError`` on a problem;
    busy GPUs are left out of the schedule). ``job_args``: :class:`pdsweep.plan.shards.JobArgs`
    (``--shard``, ``--budget``, ``--durations-from``; folding, the core-case warning and the budget:
    :func:`pdsweep.run.jobs.annotate`)."""
    ls = load_sweep(sweep)
    start_probe_if_cold(ls, check)
    plan = expand(ls)
    feasibility_warnings(plan, tasks=False)  # validate also asks lm-eval for the task names
    cells = select_cells(plan, cells_glob)
    if cells_glob and not cells:
        raise UserError(f"--cells {cells_glob!r} selects no cell of {ls.path} ({len(plan.cells)} cells)")
    job_args = job_args or JobArgs()
    verdicts = []  # vLLM parses every argv of the job's cells while they are scheduled

    def where(job: list[Any]) -> tuple[Any, str | None, list[str]]:
        if check:
            verdicts.append(submit_cells_argv(ls, job))
        return place(ls, job, gpus, cluster, check=gpu_check, fit=True)

    try:  # vLLM's refusals come first
        rp = plan_cells(plan, cells, job_args, where)
        rp = rp.with_instances(dry_pythons(ls, rp.cells), frozenset())
        _check_slot_ports({p.cell.id: p.slot for p in rp.schedule.placements}, ls.sweep.defaults.port_base)
    except UserError:
        for verdict in verdicts:
            verdict()
        raise
    for verdict in verdicts:
        verdict()
    return annotate(_as_dict(rp, rp.fitted, cluster), ls, plan, rp.job, job_args)


def dry_pythons(ls: LoadedSweep, cells: list[Any]) -> dict[str, str | None]:
    """Build -> the interpreter ``run`` will use (a venv not made yet: its path, so a dry run
    still shows the argv)."""
    out: dict[str, str | None] = {}
    for b in dict.fromkeys(c.build for c in cells):
        try:
            out[b] = build_python(ls, b)
        except UserError:  # e.g. .venv-unfixed not built yet
            out[b] = f"{ls.sweep.builds[b].venv}/bin/python"
    return out


def _as_dict(rp: RunPlan, fitted: str | None, cluster: Cluster | None) -> dict[str, Any]:
    """``rp`` as ``pdsweep plan --format json`` prints it."""
    ls, sched = rp.ls, rp.schedule
    chained = rp.reuse["schedule"] if rp.reuse and rp.reuse.get("schedule") else None
    pairs = pairs_dict(rp)
    # build pairs: both deployments at once; on GPUs they run before the dispatch (pdsweep.run.pairplan)
    extra = ((pairs or {}).get("overhead_s") or 0.0) + ((pairs or {}).get("first_s") or 0.0)
    return {
        # the one schedule `run` follows: reuse dispatch on this host's GPUs (pdsweep.run.gpureuse), else cells
        "makespan": {
            "s": round((chained["makespan_s"] if chained else sched.makespan_s) + extra, 1),
            "follows": "reuse dispatch" if chained else "cells",
            "pairs_s": extra,
        },
        "sweep": str(ls.path),
        "platform": ls.sweep.platform,
        "builds": {b: build_record(ls, b) for b in sorted({c.build for c in rp.cells})},
        "gpu_arch": _gpu_arch(ls.sweep.platform),
        "gpus": rp.pool.num_gpus,
        "fitted_to": fitted,  # the node shape cells were memory-fitted to (pdsweep.run.preflight.memory_fit)
        "nodes": list(cluster.nodes) if cluster else None,
        "cells": [_cell_entry(rp, c) for c in rp.cells],
        "rejected": [
            {**r.to_dict(), "unverified": cell_unverified(_cell_blocks(r.cell, ls))} for r in rp.expanded.rejected
        ],
        "schedule": sched.to_dict(),
        "reuse": rp.reuse,
        "perf": _perf(ls),
        "pairs": pairs,
        "pairs_off": pairs_off(rp),
        "durations": rp.seconds.record(rp.cells),  # measured (--durations-from) or the model, per cell
    }


def _perf(ls: LoadedSweep) -> dict[str, Any] | None:
    """The percentiles ``compare`` judges at ``bench.num_prompts`` and the ``gate.perf`` families
    it cannot (:func:`pdsweep.measure.percentiles.percentile_plan`); None without a load phase."""
    b = ls.sweep.bench
    return dict(zip(("line", "warnings"), percentile_plan(b.num_prompts, ls.sweep.gate.perf))) if b.enabled else None


def _cell_entry(rp: RunPlan, c: Any) -> dict[str, Any]:
    """One cell of the dry run: the cell, its TP ratio, GPUs, blocks and reference, and (when
    scheduled) per instance argv/env and blocks."""
    ls = rp.ls
    d = {
        **c.to_dict(),
        "tp_ratio": c.tp_ratio,
        "num_gpus": c.num_gpus,
        "blocks": (blocks := _cell_blocks(c, ls)),
        "unverified": cell_unverified(blocks),
        "reference_cell": reference_of(c, ls).id if c.kind == "pd" and ls.sweep.eval.reference else None,
    }
    if c.id in rp.specs:
        m = ls.catalogue.models[c.model]
        d["instances"] = [{**s.to_dict(), "blocks": planned_blocks(m, ls.sweep.platform, s)} for s in rp.specs[c.id]]
    return d


def build_record(ls: LoadedSweep, name: str) -> dict[str, Any]:
    """What the plan shows of build ``name``: its interpreter and, for a build made by
    ``pdsweep builds make``, the provenance its marker recorded (vLLM version and commit,
    torch, nixl meta and the nixl_cuXX imported, UCX); ``made: None`` for a venv as is
    (``run`` asks its interpreter and records the same fields in cell.json); and what its
    ``vllm:nixl_num_failed_transfers`` counts (probe ``vllm#55854``, :mod:`pdsweep.builds.fixprobes`)."""
    try:
        python = build_python(ls, name)
    except UserError as e:
        return {"python": None, "made": None, "error": str(e)}
    marker = read_marker(Path(python).parent.parent)
    made = {k: marker["provenance"].get(k) for k in PROVENANCE_FIELDS} if marker else None
    counts = fixprobes.accounting_label(fixprobes.probe_python(python)[1].get(fixprobes.FAILED_TRANSFER_ACCOUNTING))
    return {"python": python, "made": made, "failed_transfer_accounting": counts}


def _cell_blocks(cell: Any, ls: LoadedSweep) -> dict[str, Any]:
    """Effective blocks per role (:func:`pdsweep.plan.blocks.for_cell`), or ``{"error": msg}``."""
    try:
        return {role: e.to_dict() for role, e in for_cell(cell, ls).items()}
    except ValueError as e:
        return {"error": str(e)}


def _gpu_arch(platform: str) -> dict[str, str] | None:
    """``{"arch": "sm90", "source": "--gpu-arch" | "nvidia-smi" | "assumed ..."}`` on CUDA, else None."""
    if platform != "cuda":
        return None
    arch, source = target_arch()
    return {"arch": arch, "source": source}


def _blocks_text(blocks: dict) -> str:
    """``P FLASHMLA 1024/64 D FLASHMLA 1920/64``: attention backend and effective
    logical/kernel block per role (``?``: unknown)."""
    if "error" in blocks:
        return "error"
    return " ".join(
        f"{role[0].upper()} {b.get('backend')}{_table_mark(b)} {b.get('logical') or '?'}/{b.get('kernel') or '?'}"
        for role, b in blocks.items()
    )


def _table_mark(b: dict) -> str:
    """``(table)`` on CUDA where vLLM could not be asked (no head geometry in the catalogue)."""
    return "(table)" if b.get("arch") and b.get("backend_source") == "pdsweep table" else ""


def instance_blocks_text(b: dict | None) -> str:
    """``backend FLASHMLA, logical 1920 / kernel 64 (vLLM 0.32.0, sm90)`` for one instance."""
    if not b:
        return ""
    if "error" in b:
        return f"blocks: {b['error']}"
    where = ", ".join(x for x in (b.get("backend_source"), b.get("arch")) if x)
    return f"backend {b['backend']}, logical {b.get('logical') or '?'} / kernel {b.get('kernel') or '?'} ({where})"


def print_plan(d: dict) -> None:
    """:func:`plan_dict` as tables for a terminal (cells, rejected cells, instance argv,
    schedule); whole lines when stdout is not a terminal (CI logs)."""
    # not a terminal (CI logs): no 80-column cut, whole cell ids and reasons
    con = Console(highlight=False, soft_wrap=True, width=None if sys.stdout.isatty() else 100_000)
    where = f"{len(d['nodes'])} nodes, {d['gpus']} GPUs" if d["nodes"] else f"{d['gpus']} GPUs"
    if d.get("gpu_arch"):
        where += f", {d['gpu_arch']['arch']} ({d['gpu_arch']['source']})"
    if d.get("fitted_to"):
        where += f", fitted to {d['fitted_to']}"
    t = Table(title=f"{d['sweep']}: {len(d['cells'])} cells ({d['platform']}, {where})")
    for col in ("cell", "tp_ratio", "GPUs", "instances", "backend logical/kernel", "expect", "reference"):
        t.add_column(col, overflow="fold")
    for c in d["cells"]:
        t.add_row(
            c["id"],
            str(c["tp_ratio"]) if c["kind"] == "pd" else "-",
            str(c["num_gpus"]),
            str(len(c.get("instances", []))) or "-",
            _blocks_text(c["blocks"]),
            ("fail" if c["expect_fail"] else "") + (f" ({c['expect_note']})" if c.get("expect_note") else ""),
            c.get("reference_cell") or "-",
        )
    con.print(t)
    for name, b in (d.get("builds") or {}).items():
        if b.get("made"):
            what = ", ".join(f"{k} {v}" for k, v in b["made"].items())
        else:
            what = b.get("error") or "a venv as is (provenance recorded in cell.json at run time)"
        if b.get("failed_transfer_accounting"):
            what += f"; vllm:nixl_num_failed_transfers counts {b['failed_transfer_accounting']}"
        con.print(f"build {escape(name)}: {escape(str(b.get('python')))}: {escape(what)}")
    con.file.write("".join(rejected_text(d["rejected"]) + unverified_text(d["cells"], d["rejected"])))
    s = d["schedule"]
    for x in s["needs_more_gpus"]:
        why = x.get("reason") or f"needs {x['needs']} GPUs (host has {d['gpus']})"
        con.print(escape(f"NOT-RUNNABLE: {x['cell']}: {why}"))
    con.print("\n[bold]instances (dry run)[/bold]")
    lines = []  # plain text: rich's markup pass costs seconds over thousands of argv lines
    for c in d["cells"]:
        for i in c.get("instances", []):
            env = " ".join(f"{k}={shlex.quote(v)}" for k, v in i["env"].items())
            on = f" on {i['node']}" if d["nodes"] else ""
            lines.append(f"[{c['id']}] {i['name']}{on}: {env} {shlex.join(i['argv'])}\n")
            if i.get("blocks"):
                lines.append(f"    {i['name']}: {instance_blocks_text(i['blocks'])}\n")
    con.file.write("".join(lines))
    if d.get("reuse"):
        _print_reuse(con, d["reuse"])
    m = d["makespan"]
    con.print("\n[bold]schedule[/bold]" + (" (reuse dispatch: what `run` follows)" if m["follows"] != "cells" else ""))
    if m["follows"] == "cells":
        rows = [
            f"  t={p['start_s']:7.0f}s..{p['end_s']:7.0f}s  lane {p['lane']} ports {p['port_base']}+  "
            f"GPUs {placement_text(p) if d['nodes'] else ','.join(map(str, p['gpus'])) or 'cpu':12} {p['cell']}\n"
            for p in s["placements"]
        ]
        one_by_one = s["serial_s"]
    else:
        sched = d["reuse"]["schedule"]
        rows = [
            f"  t={p['start_s']:7.0f}s..{p['end_s']:7.0f}s  {p['gpus']} GPUs  "
            + (f"{p['instance_starts']} instance starts" if p["instance_starts"] else "instances up    ")
            + (f" ({p['prestarted']} prestarted)" if p["prestarted"] else "")
            + f"  {p['cell']}\n"
            for p in sched["cells"]
        ]
        one_by_one = sched["sequential_s"]
    con.file.write("".join(rows))
    con.print(
        f"estimated makespan {m['s']:.0f} s (the schedule `run` follows: {m['follows']}"
        + (f"; + {m['pairs_s']:.0f} s for the build pairs" if m.get("pairs_s") else "")
        + f") vs {one_by_one:.0f} s one cell at a time"
    )
    _print_measured_as(con, d)
    con.file.write(job_text(d))
    for w in d.get("warnings") or []:
        print(f"warning: {w}", file=sys.stderr)


def _print_measured_as(con: Console, d: dict) -> None:
    """The ``pairs`` and ``perf`` of :func:`plan_dict` (its warnings logged)."""
    con.file.write(pairs_text(d.get("pairs"), d.get("pairs_off")))
    if perf := d.get("perf"):
        con.file.write(perf["line"] + "\n")
        for w in perf["warnings"]:
            log.warning("%s", w)


REJECTED_EXAMPLES = 3  # cell ids shown per distinct reason (all of them: --format json)


def rejected_text(rejected: list[dict]) -> list[str]:
    """Lines of the rejected cells grouped by rule, then by reason, each with its count and
    a few cell ids (a 1000-cell sweep repeats one reason across builds and variants)."""
    if not rejected:
        return []
    by_rule: dict[str, dict[str, list[str]]] = {}
    for x in rejected:
        by_rule.setdefault(x["rule"], {}).setdefault(x["reason"], []).append(x["cell_id"])
    out = [f"\nrejected: {len(rejected)} cells by {len(by_rule)} rules (every cell id: --format json)\n"]
    for rule, reasons in sorted(by_rule.items(), key=lambda kv: -sum(map(len, kv[1].values()))):
        out.append(f"  {rule}: {sum(map(len, reasons.values()))} cells, {len(reasons)} distinct reason(s)\n")
        for reason, ids in sorted(reasons.items(), key=lambda kv: -len(kv[1])):
            more = f" and {len(ids) - REJECTED_EXAMPLES} more" if len(ids) > REJECTED_EXAMPLES else ""
            out.append(f"    {len(ids):4d} x {reason}\n         e.g. {', '.join(ids[:REJECTED_EXAMPLES])}{more}\n")
    return out


def _print_reuse(con: Console, reuse: dict) -> None:
    """The instances ``run`` shares across cells (started once, reset between cells)."""
    shared = [r for r in reuse["instances"] if len(r["cells"]) > 1]
    t = Table(
        title=f"instance reuse: {reuse['distinct']} distinct instances for {reuse['per_cell']} uses, "
        f"{len(reuse['instances'])} starts ({len(shared)} shared; `run --no-reuse` starts one per use)"
    )
    for col in ("instance", "cells (in run order)", "stops after"):
        t.add_column(col, overflow="fold")
    for r in shared:
        t.add_row(r["instance_id"], ", ".join(r["cells"]), r["stop_after"] or "-")
    con.print(t)
    if s := reuse.get("schedule"):
        n = s["instance_starts"]
        line = "with reuse on GPUs: a cell runs when its instances are free and its new ones fit on free GPUs"
        if n > reuse["distinct"]:  # stopped for room, or ended by a cell expected to fail (pdsweep.plan.dispatch)
            line += f"; {n} instance starts: {n - reuse['distinct']} again (stopped for room, or an expected failure)"
        con.print(line)


def placement_text(p: dict) -> str:
    """``prefill-0@node0:0-7 decode-0@node1:0-3`` from a schedule placement's
    ``instances`` (``@node0:cpu`` on CPU)."""
    return " ".join(f"{i['name']}@{i['node']}:{_ranges(i['gpus']) if i['gpus'] else 'cpu'}" for i in p["instances"])


def _ranges(ids: list[int]) -> str:
    ids = sorted(set(ids))
    out: list[str] = []
    start: int | None = ids[0]
    for a, b in zip(ids, ids[1:] + [None]):
        if b != a + 1:
            out.append(f"{start}" if start == a else f"{start}-{a}")
            start = b
    return ",".join(out)
