"""The dry run (``pdsweep plan``, and the argv check of ``validate``): the cells of a
sweep with every instance's exact ``vllm serve`` argv/env, the rejected cells with their
rule, and the schedule over one host or a cluster, as a dict (``--format json``) or as
tables. Starts nothing and writes nothing (tiny checkpoints are named, not built)."""

from __future__ import annotations

import shlex
import sys

from .errors import UserError


def check_argv(ls, cells) -> None:
    """Parse every instance argv of ``cells`` with the installed vLLM (:mod:`pdsweep.argcheck`);
    raises ``UserError`` naming cell, instance and vLLM's message."""
    from .argcheck import check_instances
    from .plan import Slot, instances, model_path

    items = []
    for c in cells:
        m = ls.catalogue.models[c.model]
        slot = Slot(0, tuple(range(c.num_gpus)), ls.sweep.defaults.port_base)
        specs = instances(c, slot, ls, model_path(m, c.model, create=False), "python")
        items += [(c.id, i.name, i.argv) for i in specs]
    bad = check_instances(items)
    if bad:
        raise UserError(f"{ls.path}: vLLM refuses {len(bad)} instance argv(s):\n" + "\n".join(bad))


def plan_cluster(nodes: int | None, gpus_per_node: int | None, launcher: str = "local"):
    """The :class:`pdsweep.placement.Cluster` to place over, or None (one host). Raises
    ``UserError`` for ``--nodes`` without ``--gpus-per-node`` or non-positive counts."""
    from .placement import Cluster

    if nodes is None and launcher != "slurm":
        if gpus_per_node is not None:
            raise UserError("--gpus-per-node needs --nodes N (or --launcher slurm inside an allocation)")
        return None
    if nodes is not None:
        if gpus_per_node is None or nodes < 1 or gpus_per_node < 0:
            raise UserError(f"--nodes {nodes}: give --gpus-per-node G as well (nodes >= 1, G >= 0)")
        return Cluster.synthetic(nodes, gpus_per_node)
    from .launchers.slurm import allocation, node_addrs

    _, names, gpn = allocation()
    addrs = node_addrs(names)
    return Cluster(tuple(names), gpn if gpus_per_node is None else gpus_per_node, tuple(addrs[n] for n in names))


def plan_dict(sweep: str, gpus: int | None, cells_glob: str | None = None, cluster=None,
              check: bool = False) -> dict:
    """The dry run: cells with per-instance argv/env (and node), rejected cells, and the
    schedule; over ``cluster`` (nodes x GPUs) when given, else over one host's ``gpus``."""
    from .builds import build_python
    from .plan import expand, instances, model_path, planned_blocks, reference_of, select
    from .schedule import detect_gpus, pack
    from .spec import load_sweep

    from .feasible import preflight

    ls = load_sweep(sweep)
    plan = expand(ls)
    preflight(plan, tasks=False)  # validate also asks lm-eval for the task names
    n = gpus if gpus is not None else (detect_gpus() if ls.sweep.platform == "cuda" else 0)
    cells = select(plan, cells_glob)
    if check:
        check_argv(ls, cells)
    pool = None
    if cluster is not None:
        from dataclasses import replace

        from .placement import ClusterPool

        if ls.sweep.platform != "cuda":
            cluster = replace(cluster, gpus_per_node=0)
        pool = ClusterPool(cluster, ls.sweep.defaults.port_base)
        n = cluster.num_gpus
    sched = pack(cells, n, ls.sweep.defaults.port_base, pool=pool)
    slots = {p.cell.id: p.slot for p in sched.placements}
    out_cells, specs_of = [], {}
    for c in cells:
        d = {**c.to_dict(), "tp_ratio": c.tp_ratio, "num_gpus": c.num_gpus, "blocks": _cell_blocks(c, ls),
             "reference_cell": reference_of(c, ls).id if c.kind == "pd" and ls.sweep.eval.reference else None}
        if c.id in slots:
            m = ls.catalogue.models[c.model]
            try:
                python = build_python(ls, c.build)  # the interpreter `run` will use
            except UserError:  # e.g. .venv-unfixed not built yet: a dry run still shows the argv
                python = f"{ls.sweep.builds[c.build].venv}/bin/python"
            specs = specs_of[c.id] = instances(c, slots[c.id], ls, model_path(m, c.model, create=False), python)
            d["instances"] = [{**s.to_dict(), "blocks": planned_blocks(m, ls.sweep.platform, s)} for s in specs]
        out_cells.append(d)
    # `run` shares identical instances across cells on one host without GPUs (pdsweep.instances)
    reuse = reuse_plan([c for c in cells if c.id in specs_of], specs_of) if n == 0 and cluster is None else None
    return {"sweep": str(ls.path), "platform": ls.sweep.platform, "gpus": n,
            "nodes": list(cluster.nodes) if cluster else None, "cells": out_cells,
            "rejected": [r.to_dict() for r in plan.rejected],
            "schedule": sched.to_dict(), "reuse": reuse}


def reuse_plan(cells, specs_of: dict) -> dict:
    """What ``run`` (reuse on) does with ``cells``: its run order
    (:func:`pdsweep.schedule.reuse_order`), then :func:`pdsweep.instances.reuse_record`,
    the shape of plan.json ``reuse``."""
    from .instances import instance_key, reuse_record
    from .schedule import reuse_order

    todo = reuse_order(cells, {cid: {instance_key(s) for s in sp} for cid, sp in specs_of.items()})
    return reuse_record(todo, specs_of)


def _cell_blocks(cell, ls) -> dict:
    """Effective blocks per role (:func:`pdsweep.blocks.for_cell`), or ``{"error": msg}``."""
    from .blocks import for_cell

    try:
        return {role: e.to_dict() for role, e in for_cell(cell, ls).items()}
    except ValueError as e:
        return {"error": str(e)}


def _blocks_text(blocks: dict) -> str:
    """``P 1024/64 D 1920/64``: effective logical/kernel block per role (``?``: unknown)."""
    if "error" in blocks:
        return "error"
    return " ".join(f"{role[0].upper()} {b.get('logical') or '?'}/{b.get('kernel') or '?'}"
                    for role, b in blocks.items())


def print_plan(d: dict) -> None:
    """:func:`plan_dict` as tables for a terminal (cells, rejected cells, instance argv,
    schedule); whole lines when stdout is not a terminal (CI logs)."""
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    # not a terminal (CI logs): no 80-column cut, whole cell ids and reasons
    con = Console(highlight=False, soft_wrap=True, width=None if sys.stdout.isatty() else 100_000)
    where = f"{len(d['nodes'])} nodes, {d['gpus']} GPUs" if d["nodes"] else f"{d['gpus']} GPUs"
    t = Table(title=f"{d['sweep']}: {len(d['cells'])} cells ({d['platform']}, {where})")
    for col in ("cell", "tp_ratio", "GPUs", "instances", "blocks logical/kernel", "expect", "reference"):
        t.add_column(col, overflow="fold")
    for c in d["cells"]:
        t.add_row(c["id"], str(c["tp_ratio"]) if c["kind"] == "pd" else "-", str(c["num_gpus"]),
                  str(len(c.get("instances", []))) or "-", _blocks_text(c["blocks"]),
                  ("fail" if c["expect_fail"] else "") + (f" ({c['expect_note']})" if c.get("expect_note") else ""),
                  c.get("reference_cell") or "-")
    con.print(t)
    if d["rejected"]:
        r = Table(title=f"rejected: {len(d['rejected'])} cells")
        r.add_column("cell")
        r.add_column("rule")
        r.add_column("reason")
        for x in d["rejected"]:
            r.add_row(x["cell_id"], x["rule"], x["reason"])
        con.print(r)
    s = d["schedule"]
    for x in s["needs_more_gpus"]:
        why = x.get("reason") or f"needs {x['needs']} GPUs (host has {d['gpus']})"
        con.print(f"not scheduled: {x['cell']} {why}")
    con.print("\n[bold]instances (dry run)[/bold]")
    for c in d["cells"]:
        for i in c.get("instances", []):
            env = " ".join(f"{k}={shlex.quote(v)}" for k, v in i["env"].items())
            on = f" on {i['node']}" if d["nodes"] else ""
            con.print(escape(f"[{c['id']}] {i['name']}{on}: {env} {shlex.join(i['argv'])}"))
    con.print("\n[bold]schedule[/bold]")
    for p in s["placements"]:
        gp = placement_text(p) if d["nodes"] else ",".join(map(str, p["gpus"])) or "cpu"
        con.print(f"  t={p['start_s']:7.0f}s..{p['end_s']:7.0f}s  lane {p['lane']} ports {p['port_base']}+  "
                  f"GPUs {gp:12} {p['cell']}")
    con.print(f"estimated makespan {s['makespan_s']:.0f} s vs {s['serial_s']:.0f} s one by one "
              f"(ratio {s['ratio']:.2f})")
    if d.get("reuse"):
        _print_reuse(con, d["reuse"])


def _print_reuse(con, reuse: dict) -> None:
    """The instances ``run`` shares across cells (started once, reset between cells)."""
    from rich.table import Table

    shared = [r for r in reuse["instances"] if len(r["cells"]) > 1]
    t = Table(title=f"instance reuse: {reuse['distinct']} distinct instances for {reuse['per_cell']} uses "
                    f"({len(shared)} shared; `run --no-reuse` starts one per use)")
    for col in ("instance", "cells (in run order)", "stops after"):
        t.add_column(col, overflow="fold")
    for r in shared:
        t.add_row(r["instance_id"], ", ".join(r["cells"]), r["stop_after"] or "-")
    con.print(t)


def placement_text(p: dict) -> str:
    """``prefill-0@node0:0-7 decode-0@node1:0-3`` from a schedule placement's
    ``instances`` (``@node0:cpu`` on CPU)."""
    return " ".join(f"{i['name']}@{i['node']}:{_ranges(i['gpus']) if i['gpus'] else 'cpu'}" for i in p["instances"])


def _ranges(ids: list[int]) -> str:
    ids = sorted(set(ids))
    out, start = [], ids[0]
    for a, b in zip(ids, ids[1:] + [None]):
        if b != a + 1:
            out.append(f"{start}" if start == a else f"{start}-{a}")
            start = b
    return ",".join(out)
