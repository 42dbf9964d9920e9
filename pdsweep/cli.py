"""``pdsweep`` command line. Each subcommand is (name, help, add_args, main); errors are
caught once here: ``UserError`` (and ``OSError``) -> message, exit 2; ``GateFailed`` ->
message, exit 1; anything else is a pdsweep bug: traceback, exit 3 (README "Exit codes")."""

from __future__ import annotations

import argparse
import json
import logging
import shlex
import sys
import traceback
from collections.abc import Callable
from pathlib import Path

from .errors import EXIT_GATE_FAILED, EXIT_INTERNAL, EXIT_USER_ERROR, GateFailed, UserError


# ---------------------------------------------------------------- validate / plan
def gpu_count(text: str) -> int:
    """argparse type of ``--gpus``: an integer in 0..4096 (argparse then exits 2 with usage)."""
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if not 0 <= n <= 4096:
        raise argparse.ArgumentTypeError(f"{n} GPUs: allowed 0..4096")
    return n


def _validate_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("sweep", help="sweep YAML (e.g. sweeps/cpu-smoke.yaml)")
    _no_check_argv_arg(p)


def _no_check_argv_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--no-check-argv", action="store_true",
                   help="skip parsing each instance's vllm serve argv with the installed vLLM's CLI classes")


def check_argv(ls, cells) -> None:
    """Parse every instance argv of ``cells`` with the installed vLLM (:mod:`pdsweep.argcheck`);
    raises ``UserError`` naming cell, instance and vLLM's message."""
    from .argcheck import check_instances
    from .plan import Slot, instances, model_path

    items = []
    for c in cells:
        m = ls.catalogue.models[c.model]
        slot = Slot(0, tuple(range(c.num_gpus)), ls.sweep.defaults.port_base)
        items += [(c.id, i.name, i.argv) for i in instances(c, slot, ls, model_path(m, c.model, create=False), "python")]
    bad = check_instances(items)
    if bad:
        raise UserError(f"{ls.path}: vLLM refuses {len(bad)} instance argv(s):\n" + "\n".join(bad))


def _validate(args: argparse.Namespace) -> int:
    from .feasible import preflight
    from .plan import expand
    from .spec import load_sweep

    from .evaltasks import check_eval_tasks

    ls = load_sweep(args.sweep)
    plan = expand(ls)
    for w in preflight(plan):
        print(f"warning: {w}", file=sys.stderr)
    check_eval_tasks(ls)
    if not plan.pd_cells:
        why = "; ".join(sorted({f"{r.rule}: {r.reason}" for r in plan.rejected})[:3]) or "the matrix is empty"
        raise UserError(f"{args.sweep}: no PD cell to run ({len(plan.rejected)} rejected): {why}")
    if not args.no_check_argv:
        check_argv(plan.loaded, plan.cells)
    print(f"{args.sweep}: valid: {len(plan.pd_cells)} PD cells, {len(plan.cells) - len(plan.pd_cells)} "
          f"reference cells, {len(plan.rejected)} rejected" + ("" if args.no_check_argv else
                                                              "; every vllm serve argv parses"))
    return 0


def _plan_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("sweep")
    p.add_argument("--gpus", type=gpu_count, default=None, help="GPUs on the host (default: nvidia-smi; 0 on CPU)")
    p.add_argument("--format", choices=("table", "json"), default="table")
    p.add_argument("--cells", default=None, help="glob over cell ids")
    _no_check_argv_arg(p)
    p.add_argument("--nodes", type=int, default=None, help="place over N nodes (named node0..; needs --gpus-per-node)")
    p.add_argument("--gpus-per-node", type=int, default=None, help="GPUs per node (with --nodes or --launcher slurm)")
    p.add_argument("--launcher", choices=("local", "slurm"), default="local",
                   help="slurm: place over the allocation we run in (SLURM_JOB_NODELIST, SLURM_GPUS_ON_NODE)")


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
    from .plan import expand, instances, model_path, planned_blocks, reference_of
    from .run import build_python, select
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
    out_cells = []
    for c in cells:
        d = {**c.to_dict(), "tp_ratio": c.tp_ratio, "num_gpus": c.num_gpus, "blocks": _cell_blocks(c, ls),
             "reference_cell": reference_of(c, ls).id if c.kind == "pd" and ls.sweep.eval.reference else None}
        if c.id in slots:
            m = ls.catalogue.models[c.model]
            try:
                python = build_python(ls, c.build)  # the interpreter `run` will use
            except UserError:  # e.g. .venv-unfixed not built yet: a dry run still shows the argv
                python = f"{ls.sweep.builds[c.build].venv}/bin/python"
            specs = instances(c, slots[c.id], ls, model_path(m, c.model, create=False), python)
            d["instances"] = [{**s.to_dict(), "blocks": planned_blocks(m, ls.sweep.platform, s)} for s in specs]
        out_cells.append(d)
    return {"sweep": str(ls.path), "platform": ls.sweep.platform, "gpus": n,
            "nodes": list(cluster.nodes) if cluster else None, "cells": out_cells,
            "rejected": [{"cell_id": r.cell.id, "rule": r.rule, "reason": r.reason} for r in plan.rejected],
            "schedule": sched.to_dict()}


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


def _plan(args: argparse.Namespace) -> int:
    d = plan_dict(args.sweep, args.gpus, args.cells, plan_cluster(args.nodes, args.gpus_per_node, args.launcher),
                  check=not args.no_check_argv)
    if args.format == "json":
        print(json.dumps(d, indent=2))
        return 0
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
    return 0


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


# ---------------------------------------------------------------- run
def _run_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("sweep")
    p.add_argument("--out", type=Path, default=None, help="run directory (default results/<sweep>-<time>)")
    p.add_argument("--cells", default=None, help="glob over cell ids (their references are added)")
    p.add_argument("--gpus", type=gpu_count, default=None)
    p.add_argument("--resume", action="store_true", help="skip cells whose status is final")
    p.add_argument("--quiet", action="store_true", help="one line per cell (CI logs)")
    p.add_argument("--skip-eval", action="store_true", help="deploy and probe only, no lm-eval")
    p.add_argument("--no-reuse", action="store_true",
                   help="one deployment per cell (default: identical instances are shared across cells)")
    p.add_argument("--launcher", choices=("local", "slurm"), default="local",
                   help="slurm: every instance a job step of the allocation pdsweep runs in (salloc/sbatch)")
    p.add_argument("--gpus-per-node", type=int, default=None, help="slurm: GPUs per node (default SLURM_GPUS_ON_NODE)")
    p.add_argument("--drop-kv-transfer-params", action="store_true", help=argparse.SUPPRESS)  # tests only
    p.add_argument("--scramble-kv-block-ids", action="store_true", help=argparse.SUPPRESS)  # tests only


def _run(args: argparse.Namespace) -> int:
    from .run import RunOptions, run_sweep

    opts = RunOptions(out=args.out, cells=args.cells, gpus=args.gpus, resume=args.resume, quiet=args.quiet,
                      drop_kv_transfer_params=args.drop_kv_transfer_params,
                      scramble_kv_block_ids=args.scramble_kv_block_ids, skip_eval=args.skip_eval,
                      launcher=args.launcher, gpus_per_node=args.gpus_per_node, reuse=not args.no_reuse)
    try:
        run_dir = run_sweep(args.sweep, opts)
    except KeyboardInterrupt:
        print("interrupted: every process this run started was stopped; finish with --resume", file=sys.stderr)
        return 130
    print(run_dir)
    return 0


# ---------------------------------------------------------------- gate / compare / report
def _gate_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir", type=Path)
    p.add_argument("--junit", type=Path, default=None)
    p.add_argument("--summary", type=Path, default=None)


def _gate(args: argparse.Namespace) -> int:
    from .gate import gate_run, write_junit, write_summary

    junit, summary = args.junit or args.run_dir / "junit.xml", args.summary or args.run_dir / "summary.md"
    check_outputs(("--junit", junit), ("--summary", summary))
    result = gate_run(args.run_dir)  # the gate settings frozen into run.json
    try:
        write_junit(result, junit)
        print(Path(write_summary(result, summary)).read_text())
    except BaseException:  # the verdict is printed even when an output could not be written
        print(f"gate: {result.headline()}", file=sys.stderr)
        raise
    if not result.passed:
        raise GateFailed(f"gate: {result.headline()}")
    print(f"gate: {result.headline()}")
    return 0


def check_outputs(*named: tuple[str, Path]) -> None:
    """Raise ``UserError`` when two outputs are one file or one cannot be written
    (:func:`pdsweep.layout.check_writable`), before any work starts."""
    from . import layout

    seen: dict[Path, str] = {}
    for flag, path in named:
        key = Path(path).resolve()
        if key in seen:
            raise UserError(f"{flag} {path} is the same file as {seen[key]}: one would overwrite the other")
        seen[key] = f"{flag} {path}"
        layout.check_writable(Path(path))


def _compare_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("a", type=Path, help="baseline run (e.g. unfixed, or the last green nightly)")
    p.add_argument("b", type=Path, help="candidate run")
    p.add_argument("--out", type=Path, default=None, help="directory for compare.md / compare.json")
    p.add_argument("--a-build", default=None, help="only A's cells of this build (e.g. fixed)")
    p.add_argument("--b-build", default=None, help="only B's cells of this build (e.g. unfixed)")
    p.add_argument("--allow-missing", action="store_true",
                   help="cells of A missing in B do not fail the comparison (default: they do)")
    p.add_argument("--allow-other-sweep", action="store_true",
                   help="compare runs of different sweeps (default: refused, exit 2)")


def _compare(args: argparse.Namespace) -> int:
    from .compare import compare_runs, write_json, write_markdown

    out = Path(args.out or args.b)
    check_outputs(("compare.md", out / "compare.md"), ("compare.json", out / "compare.json"))
    res = compare_runs(args.a, args.b, allow_missing=args.allow_missing, allow_other_sweep=args.allow_other_sweep,
                       a_build=args.a_build, b_build=args.b_build)
    verdict = "REGRESSED" if res.regressed else "NO REGRESSION"
    try:
        md = write_markdown(res, out / "compare.md")
        write_json(res, out / "compare.json")
        print(Path(md).read_text())
    except BaseException:  # the verdict is printed even when an output could not be written
        print(f"compare: {verdict} of {args.b} against {args.a}", file=sys.stderr)
        raise
    res.raise_for_verdict()
    print(f"compare: {verdict} of {args.b} against {args.a}")
    return 0


def _report_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir", type=Path)
    p.add_argument("--compare-with", type=Path, default=None)
    p.add_argument("--out", type=Path, default=None)


def _report(args: argparse.Namespace) -> int:
    from .report import write_report

    for kind, path in write_report(args.run_dir, args.out, args.compare_with).items():
        print(f"{kind}: {path}")
    return 0


# ---------------------------------------------------------------- delegated subcommands
def _delegate(module: str) -> tuple[Callable, Callable]:
    def add(p: argparse.ArgumentParser) -> None:
        __import__(f"pdsweep.{module}", fromlist=["add_cli_args"]).add_cli_args(p)

    def main(args: argparse.Namespace) -> int:
        return __import__(f"pdsweep.{module}", fromlist=["main"]).main(args)

    return add, main


SUBCOMMANDS: tuple[tuple[str, str, Callable, Callable], ...] = (
    ("validate", "check a sweep file", _validate_args, _validate),
    ("plan", "cells, rejected cells, instance argv/env (dry run) and schedule", _plan_args, _plan),
    ("run", "deploy and measure every cell", _run_args, _run),
    ("gate", "pass/fail a run (exit 1 on failure), JUnit + summary", _gate_args, _gate),
    ("compare", "compare two runs cell by cell (exit 1 on regression)", _compare_args, _compare),
    ("report", "markdown + HTML report with plots", _report_args, _report),
    ("proxy", "run the PD proxy", *_delegate("proxy")),
    ("baseline-env", "build the unfixed vLLM venv (PR #49297 undone)", *_delegate("unfix")),
)


DELEGATED = {"proxy", "baseline-env", "bench"}  # heavier modules: imported only when chosen


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pdsweep", description="Accuracy and KV-transfer sweeps for vLLM prefill/decode disaggregation over "
        "the NIXL connector. Exit codes: 0 ok, 1 gate/compare verdict failed, 2 bad input (no "
        "traceback), 3 internal error (with traceback), 130 interrupted.")
    parser.add_argument("-v", "--verbose", action="store_true")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, help_, add, main in SUBCOMMANDS:
        p = sub.add_parser(name, help=help_)
        if name not in DELEGATED or name in argv:
            add(p)
        p.set_defaults(func=main)
    bench = sub.add_parser("bench", help="benchmarks").add_subparsers(dest="bench_command", required=True)
    add, main = _delegate("xfer.bench")
    p = bench.add_parser("transfer", help="KV-transfer micro-benchmark on real NIXL (fixed/unfixed read plan)")
    if "bench" in argv:
        add(p)
    p.set_defaults(func=main)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser(argv).parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return int(args.func(args) or 0)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USER_ERROR
    except GateFailed as e:
        print(str(e), file=sys.stderr)
        return EXIT_GATE_FAILED
    except OSError as e:  # an output path that is a file, a read-only results dir, ...
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USER_ERROR
    except Exception:  # a bug in pdsweep, not bad input or a verdict: say so, with the traceback
        traceback.print_exc()
        print(f"internal error in pdsweep (exit {EXIT_INTERNAL}): please report it with the traceback above",
              file=sys.stderr)
        return EXIT_INTERNAL


if __name__ == "__main__":
    sys.exit(main())
