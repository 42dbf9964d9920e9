"""``pdsweep`` command line. Each subcommand is (name, help, add_args, main); errors are
caught once here: ``UserError`` -> message, exit 2; ``GateFailed`` -> message, exit 1."""

from __future__ import annotations

import argparse
import json
import logging
import shlex
import sys
from collections.abc import Callable
from pathlib import Path

from .errors import EXIT_GATE_FAILED, EXIT_USER_ERROR, GateFailed, UserError


# ---------------------------------------------------------------- validate / plan
def _validate_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("sweep", help="sweep YAML (e.g. sweeps/cpu-smoke.yaml)")


def _validate(args: argparse.Namespace) -> int:
    from .plan import expand
    from .spec import load_sweep

    from .evaltasks import check_eval_tasks

    ls = load_sweep(args.sweep)
    plan = expand(ls)
    check_eval_tasks(ls)
    if not plan.pd_cells:
        why = "; ".join(sorted({f"{r.rule}: {r.reason}" for r in plan.rejected})[:3]) or "the matrix is empty"
        raise UserError(f"{args.sweep}: no PD cell to run ({len(plan.rejected)} rejected): {why}")
    print(f"{args.sweep}: valid: {len(plan.pd_cells)} PD cells, {len(plan.cells) - len(plan.pd_cells)} "
          f"reference cells, {len(plan.rejected)} rejected")
    return 0


def _plan_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("sweep")
    p.add_argument("--gpus", type=int, default=None, help="GPUs on the host (default: nvidia-smi; 0 on CPU)")
    p.add_argument("--format", choices=("table", "json"), default="table")
    p.add_argument("--cells", default=None, help="glob over cell ids")


def plan_dict(sweep: str, gpus: int | None, cells_glob: str | None = None) -> dict:
    """The dry run: cells with per-instance argv/env, rejected cells, and the schedule."""
    from .plan import expand, instances, model_path, reference_of
    from .run import build_python, select
    from .schedule import detect_gpus, pack
    from .spec import load_sweep

    ls = load_sweep(sweep)
    plan = expand(ls)
    n = gpus if gpus is not None else (detect_gpus() if ls.sweep.platform == "cuda" else 0)
    cells = select(plan, cells_glob)
    sched = pack(cells, n, ls.sweep.defaults.port_base)
    slots = {p.cell.id: p.slot for p in sched.placements}
    out_cells = []
    for c in cells:
        d = {**c.to_dict(), "tp_ratio": c.tp_ratio, "num_gpus": c.num_gpus,
             "reference_cell": reference_of(c, ls).id if c.kind == "pd" and ls.sweep.eval.reference else None}
        if c.id in slots:
            m = ls.catalogue.models[c.model]
            try:
                python = build_python(ls, c.build)  # the interpreter `run` will use
            except UserError:  # e.g. .venv-unfixed not built yet: a dry run still shows the argv
                python = f"{ls.sweep.builds[c.build].venv}/bin/python"
            d["instances"] = [s.to_dict() for s in instances(c, slots[c.id], ls, model_path(m, c.model, create=False),
                                                             python)]
        out_cells.append(d)
    return {"sweep": str(ls.path), "platform": ls.sweep.platform, "gpus": n, "cells": out_cells,
            "rejected": [{"cell_id": r.cell.id, "rule": r.rule, "reason": r.reason} for r in plan.rejected],
            "schedule": sched.to_dict()}


def _plan(args: argparse.Namespace) -> int:
    d = plan_dict(args.sweep, args.gpus, args.cells)
    if args.format == "json":
        print(json.dumps(d, indent=2))
        return 0
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    con = Console(highlight=False, soft_wrap=True)
    t = Table(title=f"{d['sweep']}: {len(d['cells'])} cells ({d['platform']}, {d['gpus']} GPUs)")
    for col in ("cell", "tp_ratio", "GPUs", "instances", "expect", "reference"):
        t.add_column(col)
    for c in d["cells"]:
        t.add_row(c["id"], str(c["tp_ratio"]) if c["kind"] == "pd" else "-", str(c["num_gpus"]),
                  str(len(c.get("instances", []))) or "-",
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
        con.print(f"not scheduled: {x['cell']} needs {x['needs']} GPUs (host has {d['gpus']})")
    con.print("\n[bold]instances (dry run)[/bold]")
    for c in d["cells"]:
        for i in c.get("instances", []):
            env = " ".join(f"{k}={shlex.quote(v)}" for k, v in i["env"].items())
            con.print(escape(f"[{c['id']}] {i['name']}: {env} {shlex.join(i['argv'])}"))
    con.print("\n[bold]schedule[/bold]")
    for p in s["placements"]:
        gp = ",".join(map(str, p["gpus"])) or "cpu"
        con.print(f"  t={p['start_s']:7.0f}s..{p['end_s']:7.0f}s  lane {p['lane']} ports {p['port_base']}+  "
                  f"GPUs {gp:12} {p['cell']}")
    con.print(f"estimated makespan {s['makespan_s']:.0f} s vs {s['serial_s']:.0f} s one by one "
              f"(ratio {s['ratio']:.2f})")
    return 0


# ---------------------------------------------------------------- run
def _run_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("sweep")
    p.add_argument("--out", type=Path, default=None, help="run directory (default results/<sweep>-<time>)")
    p.add_argument("--cells", default=None, help="glob over cell ids (their references are added)")
    p.add_argument("--gpus", type=int, default=None)
    p.add_argument("--resume", action="store_true", help="skip cells whose status is final")
    p.add_argument("--quiet", action="store_true", help="one line per cell (CI logs)")
    p.add_argument("--skip-eval", action="store_true", help="deploy and probe only, no lm-eval")
    p.add_argument("--drop-kv-transfer-params", action="store_true", help=argparse.SUPPRESS)  # tests only
    p.add_argument("--scramble-kv-block-ids", action="store_true", help=argparse.SUPPRESS)  # tests only


def _run(args: argparse.Namespace) -> int:
    from .run import RunOptions, run_sweep

    opts = RunOptions(out=args.out, cells=args.cells, gpus=args.gpus, resume=args.resume, quiet=args.quiet,
                      drop_kv_transfer_params=args.drop_kv_transfer_params,
                      scramble_kv_block_ids=args.scramble_kv_block_ids, skip_eval=args.skip_eval)
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

    result = gate_run(args.run_dir)  # the gate settings frozen into run.json
    write_junit(result, args.junit or args.run_dir / "junit.xml")
    summary = write_summary(result, args.summary or args.run_dir / "summary.md")
    print(Path(summary).read_text() if summary else "")
    if not result.passed:
        raise GateFailed(f"gate: {result.headline()}")
    print(f"gate: {result.headline()}")
    return 0


def _compare_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("a", type=Path, help="baseline run (e.g. unfixed, or the last green nightly)")
    p.add_argument("b", type=Path, help="candidate run")
    p.add_argument("--out", type=Path, default=None, help="directory for compare.md / compare.json")


def _compare(args: argparse.Namespace) -> int:
    from .compare import compare_runs, write_json, write_markdown

    res = compare_runs(args.a, args.b)
    out = args.out or args.b
    md = write_markdown(res, Path(out) / "compare.md")
    write_json(res, Path(out) / "compare.json")
    print(Path(md).read_text())
    if res.regressed:
        raise GateFailed(f"compare: {len(res.regressions)} regression(s) of {args.b} against {args.a}")
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
        "the NIXL connector. Exit codes: 0 ok, 1 gate/compare failed, 2 bad input.")
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


if __name__ == "__main__":
    sys.exit(main())
