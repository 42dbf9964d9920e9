"""``pdsweep`` command line: one table of subcommands (:data:`SUBCOMMANDS`).

A subcommand is an Args dataclass (vLLM's ``benchmarks/sweep`` pattern): ``add_cli_args``
declares its flags, ``from_cli_args`` turns the parsed namespace into the dataclass and
does all validation (bad input: ``UserError``), ``main`` runs it. Heavy modules (the PD
proxy, the baseline builder, the transfer bench) keep their own ``add_cli_args`` /
``main`` and are imported only when their command is chosen. Errors are caught once, by
:func:`pdsweep.core.errors.run_main`: ``UserError`` -> message, exit 2; ``GateFailed`` ->
message, exit 1; anything else (an ``OSError`` included) is a pdsweep bug or an
environment fault: traceback, exit 3 (docs/gate.md "Exit codes").
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from pdsweep.core.errors import EXIT_INTERRUPTED, GateFailed, UserError, run_main
from pdsweep.results import layout
from pdsweep.results.outputs import refuse_results_path


def gpu_count(text: str) -> int:
    """argparse type of ``--gpus``: an integer in 0..4096 (argparse then exits 2 with usage)."""
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if not 0 <= n <= 4096:
        raise argparse.ArgumentTypeError(f"{n} GPUs: allowed 0..4096")
    return n


def gpu_arch(text: str) -> str:
    """argparse type of ``--gpu-arch``: ``smXY`` (sm80, sm90, sm100, ...), lower-cased."""
    if not re.fullmatch(r"sm\d{2,3}", text.strip().lower()):
        raise argparse.ArgumentTypeError(f"{text!r}: expected smXY (sm80, sm89, sm90, sm100, sm103, sm120)")
    return text.strip().lower()


def _gpu_arch_arg(p: argparse.ArgumentParser) -> None:
    """``--gpu-arch``: the GPU vLLM's backend choice and kernel blocks are computed for
    (:func:`pdsweep.plan.blocks.target_arch`); :func:`main` exports it as ``PDSWEEP_GPU_ARCH``."""
    p.add_argument(
        "--gpu-arch",
        type=gpu_arch,
        default=None,
        help="target GPU for attention backend and kernel blocks (default: nvidia-smi compute_cap, else sm90)",
    )


def _no_check_argv_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--no-check-argv",
        action="store_true",
        help="skip parsing each instance's vllm serve argv with the installed vLLM's CLI classes",
    )


def check_outputs(*named: tuple[str, Path]) -> None:
    """Raise ``UserError`` when two outputs are one file or one cannot be written
    (:func:`pdsweep.results.layout.check_writable`), before any work starts."""
    seen: dict[Path, str] = {}
    for flag, path in named:
        key = Path(path).resolve()
        if key in seen:
            raise UserError(f"{flag} {path} is the same file as {seen[key]}: one would overwrite the other")
        seen[key] = f"{flag} {path}"
        layout.check_writable(Path(path))


def write_and_show(write: Callable[[], Path], verdict: str) -> None:
    """Run ``write`` (it writes a command's outputs and returns the markdown one) and
    print that file; when writing fails, print ``verdict`` on stderr first, so the
    verdict is never lost to a full disk, then re-raise."""
    try:
        print(Path(write()).read_text())
    except BaseException:
        print(verdict, file=sys.stderr)
        raise


# ---------------------------------------------------------------- validate / plan
@dataclass(frozen=True)
class ValidateArgs:
    parser_name: ClassVar[str] = "validate"
    parser_help: ClassVar[str] = "check a sweep file"

    sweep: str
    check_argv: bool = True
    preflight: bool = False

    @classmethod
    def add_cli_args(cls, p: argparse.ArgumentParser) -> None:
        p.add_argument("sweep", help="sweep YAML (e.g. sweeps/cpu-smoke.yaml)")
        _no_check_argv_arg(p)
        p.add_argument(
            "--preflight",
            action="store_true",
            help="also check weights, memory fit, driver and busy GPUs on this host (pdsweep.run.preflight)",
        )
        _gpu_arch_arg(p)

    @classmethod
    def from_cli_args(cls, ns: argparse.Namespace) -> ValidateArgs:
        return cls(ns.sweep, not ns.no_check_argv, ns.preflight)

    def main(self) -> int:
        from pdsweep.measure.evaltasks import check_eval_tasks
        from pdsweep.plan.expand import expand
        from pdsweep.run.dryrun import check_argv
        from pdsweep.run.feasible import preflight
        from pdsweep.spec.sweep import load_sweep

        ls = load_sweep(self.sweep)
        plan = expand(ls)
        for w in preflight(plan):
            print(f"warning: {w}", file=sys.stderr)
        check_eval_tasks(ls)
        if not plan.pd_cells:
            why = "; ".join(sorted({f"{r.rule}: {r.reason}" for r in plan.rejected})[:3]) or "the matrix is empty"
            raise UserError(f"{self.sweep}: no PD cell to run ({len(plan.rejected)} rejected): {why}")
        if self.check_argv:
            check_argv(plan.loaded, plan.cells)
        if self.preflight:
            from pdsweep.run.preflight import preflight as gpu_preflight

            for w in gpu_preflight(ls, plan.cells).warnings:
                print(f"warning: {w}", file=sys.stderr)
        print(
            f"{self.sweep}: valid: {len(plan.pd_cells)} PD cells, {len(plan.cells) - len(plan.pd_cells)} "
            f"reference cells, {len(plan.rejected)} rejected"
            + ("; every vllm serve argv parses" if self.check_argv else "")
        )
        return 0


@dataclass(frozen=True)
class PlanArgs:
    parser_name: ClassVar[str] = "plan"
    parser_help: ClassVar[str] = "cells, rejected cells, instance argv/env (dry run) and schedule"

    sweep: str
    gpus: int | None = None
    format: str = "table"
    cells: str | None = None
    check_argv: bool = True
    cluster: Any = None  # pdsweep.plan.placement.Cluster, or None: one host
    preflight: bool = False

    @classmethod
    def add_cli_args(cls, p: argparse.ArgumentParser) -> None:
        p.add_argument("sweep")
        p.add_argument("--gpus", type=gpu_count, default=None, help="GPUs on the host (default: nvidia-smi; 0 on CPU)")
        p.add_argument("--format", choices=("table", "json"), default="table")
        p.add_argument("--cells", default=None, help="glob over cell ids")
        _no_check_argv_arg(p)
        _gpu_arch_arg(p)
        p.add_argument(
            "--preflight",
            action="store_true",
            help="check weights, memory fit, driver and busy GPUs as `run` does (exit 2 on a problem)",
        )
        p.add_argument(
            "--nodes", type=int, default=None, help="place over N nodes (named node0..; needs --gpus-per-node)"
        )
        p.add_argument(
            "--gpus-per-node", type=int, default=None, help="GPUs per node (with --nodes or --launcher slurm)"
        )
        p.add_argument(
            "--launcher",
            choices=("local", "slurm"),
            default="local",
            help="slurm: place over the allocation we run in (SLURM_JOB_NODELIST, SLURM_GPUS_ON_NODE)",
        )

    @classmethod
    def from_cli_args(cls, ns: argparse.Namespace) -> PlanArgs:
        """Raises ``UserError`` for ``--nodes`` without ``--gpus-per-node`` (and the
        like) or ``--launcher slurm`` outside an allocation."""
        from pdsweep.run.dryrun import plan_cluster

        return cls(
            ns.sweep,
            ns.gpus,
            ns.format,
            ns.cells,
            not ns.no_check_argv,
            plan_cluster(ns.nodes, ns.gpus_per_node, ns.launcher),
            ns.preflight,
        )

    def main(self) -> int:
        from pdsweep.run.dryrun import plan_dict, print_plan

        d = plan_dict(self.sweep, self.gpus, self.cells, self.cluster, check=self.check_argv, gpu_check=self.preflight)
        if self.format == "json":
            print(json.dumps(d, indent=2))
        else:
            print_plan(d)
        return 0


# ---------------------------------------------------------------- run
@dataclass(frozen=True)
class RunArgs:
    """``pdsweep run``. Every flag whose dest names a :class:`pdsweep.run.sweep.RunOptions`
    field is passed on as that field: a new option is a field there plus a flag here."""

    parser_name: ClassVar[str] = "run"
    parser_help: ClassVar[str] = "deploy and measure every cell"

    sweep: str
    opts: Any  # pdsweep.run.sweep.RunOptions (imported with the run command only)
    history: Path | None = None  # None: not appended

    @classmethod
    def add_cli_args(cls, p: argparse.ArgumentParser) -> None:
        p.add_argument("sweep")
        p.add_argument("--out", type=Path, default=None, help="run directory (default results/<sweep>-<time>)")
        p.add_argument("--cells", default=None, help="glob over cell ids (their references are added)")
        p.add_argument("--gpus", type=gpu_count, default=None)
        _gpu_arch_arg(p)
        p.add_argument("--resume", action="store_true", help="skip cells whose status is final")
        p.add_argument("--quiet", action="store_true", help="one line per cell (CI logs)")
        p.add_argument("--skip-eval", action="store_true", help="deploy and probe only, no lm-eval")
        p.add_argument(
            "--no-reuse",
            dest="reuse",
            action="store_false",
            help="one deployment per cell (default: identical instances are shared across cells)",
        )
        p.add_argument(
            "--launcher",
            choices=("local", "slurm"),
            default="local",
            help="slurm: every instance a job step of the allocation pdsweep runs in (salloc/sbatch)",
        )
        p.add_argument(
            "--gpus-per-node", type=int, default=None, help="slurm: GPUs per node (default SLURM_GPUS_ON_NODE)"
        )
        p.add_argument(
            "--history",
            type=Path,
            default=None,
            help="history store the finished run is appended to (default $PDSWEEP_HISTORY or results/history.sqlite)",
        )
        p.add_argument("--no-history", action="store_true", help="do not append the run to the history store")
        p.add_argument(
            "--no-preflight",
            dest="preflight",
            action="store_false",
            help="skip the weights / memory / driver / busy-GPU preflight (pdsweep.run.preflight)",
        )
        p.add_argument("--drop-kv-transfer-params", action="store_true", help=argparse.SUPPRESS)  # tests only
        p.add_argument("--scramble-kv-block-ids", action="store_true", help=argparse.SUPPRESS)  # tests only
        p.add_argument("--scramble-every", type=int, default=0, metavar="K", help=argparse.SUPPRESS)  # tests only
        p.add_argument("--stale-kv-transfer-params", action="store_true", help=argparse.SUPPRESS)  # tests only
        p.add_argument("--decode-delay-s", type=float, default=0.0, help=argparse.SUPPRESS)  # perf proof only

    @classmethod
    def from_cli_args(cls, ns: argparse.Namespace) -> RunArgs:
        from pdsweep.run.sweep import RunOptions

        given = {f.name: getattr(ns, f.name) for f in dataclasses.fields(RunOptions) if hasattr(ns, f.name)}
        opts = RunOptions(**given)
        try:
            opts.faults  # noqa: B018 -- validates the test-only fault options before anything runs
        except ValueError as e:
            raise UserError(f"pdsweep run: {e}") from None
        return cls(ns.sweep, opts, None if ns.no_history else (ns.history or default_history()))

    def main(self) -> int:
        from pdsweep.run.sweep import run_sweep

        try:
            run_dir = run_sweep(self.sweep, self.opts)
        except KeyboardInterrupt:
            print("interrupted: every process this run started was stopped; finish with --resume", file=sys.stderr)
            return EXIT_INTERRUPTED
        if self.history is not None:
            append_history(self.history, run_dir)
        print(run_dir)
        return 0


def default_history() -> Path:
    """``$PDSWEEP_HISTORY``, else ``results/history.sqlite`` in the checkout."""
    import os

    from pdsweep.core.paths import REPO

    env = os.environ.get("PDSWEEP_HISTORY")
    return Path(env) if env else REPO / "results" / "history.sqlite"


def append_history(db: Path, run_dir: Path) -> None:
    """Append a finished run to the history; a store that cannot take it is a warning
    (the run's own results are complete either way)."""
    from pdsweep.history.store import add_run

    try:
        add_run(db, run_dir)
    except (UserError, OSError) as e:
        print(f"warning: run not added to the history {db}: {e}", file=sys.stderr)


# ---------------------------------------------------------------- history / dashboard
@dataclass(frozen=True)
class HistoryAddArgs:
    parser_name: ClassVar[str] = "add"
    parser_help: ClassVar[str] = "append run directories to the history store (a run added twice is one entry)"

    runs: tuple[Path, ...]
    db: Path

    @classmethod
    def add_cli_args(cls, p: argparse.ArgumentParser) -> None:
        p.add_argument("runs", type=Path, nargs="+")
        p.add_argument("--db", type=Path, default=None, help="default $PDSWEEP_HISTORY or results/history.sqlite")

    @classmethod
    def from_cli_args(cls, ns: argparse.Namespace) -> HistoryAddArgs:
        for r in ns.runs:
            if not (r / layout.RUN_FILE).is_file():
                raise UserError(f"{r}: not a run directory (no {layout.RUN_FILE})")
        return cls(tuple(ns.runs), ns.db or default_history())

    def main(self) -> int:
        from pdsweep.history.store import add_run
        from pdsweep.history.text import append_to_summary, run_news

        for r in self.runs:
            key = add_run(self.db, r)
            news = run_news(self.db, r)
            append_to_summary(r, news)
            print(f"{r}: run {key} in {self.db}")
            print("\n".join(news.lines()))
        return 0


@dataclass(frozen=True)
class HistoryShowArgs:
    parser_name: ClassVar[str] = "show"
    parser_help: ClassVar[str] = "series per cell and metric, with the first run of each sustained change"

    db: Path
    cell: str
    metrics: tuple[str, ...]
    sweep: str | None

    @classmethod
    def add_cli_args(cls, p: argparse.ArgumentParser) -> None:
        p.add_argument("--db", type=Path, default=None, help="default $PDSWEEP_HISTORY or results/history.sqlite")
        p.add_argument("--cell", default="*", help="glob over cell ids")
        p.add_argument(
            "--metric",
            action="append",
            default=None,
            help="glob over metric names (repeatable; default: verdict, accuracy.*, gbps_wall, ttft_p50_s, "
            "tpot_mean_s; '*' for all)",
        )
        p.add_argument("--sweep", default=None, help="only runs of this sweep name")

    @classmethod
    def from_cli_args(cls, ns: argparse.Namespace) -> HistoryShowArgs:
        from pdsweep.history.text import DEFAULT_METRICS

        return cls(ns.db or default_history(), ns.cell, tuple(ns.metric or DEFAULT_METRICS), ns.sweep)

    def main(self) -> int:
        from pdsweep.history.text import show_lines

        print("\n".join(show_lines(self.db, self.cell, self.metrics, self.sweep)))
        return 0


@dataclass(frozen=True)
class DashboardArgs:
    parser_name: ClassVar[str] = "dashboard"
    parser_help: ClassVar[str] = "one static HTML page of the history (per cell: verdicts and figures over time)"

    db: Path
    out: Path
    sweep: str | None

    @classmethod
    def add_cli_args(cls, p: argparse.ArgumentParser) -> None:
        p.add_argument("--db", type=Path, default=None, help="default $PDSWEEP_HISTORY or results/history.sqlite")
        p.add_argument("--out", type=Path, default=None, help="default dashboard.html beside the store")
        p.add_argument("--sweep", default=None, help="only runs of this sweep name")

    @classmethod
    def from_cli_args(cls, ns: argparse.Namespace) -> DashboardArgs:
        db = ns.db or default_history()
        out = ns.out or db.with_name("dashboard.html")
        check_outputs(("--out", out))
        return cls(db, out, ns.sweep)

    def main(self) -> int:
        from pdsweep.history.dashboard import render

        print(render(self.db, self.out, self.sweep))
        return 0


@dataclass(frozen=True)
class BisectArgs:
    parser_name: ClassVar[str] = "bisect"
    parser_help: ClassVar[str] = "run one cell on builds between a good and a bad one; name the first bad build"

    sweep: Path
    cell: str
    builds: tuple[str, ...]
    out: Path
    run_all: bool
    resume: bool = False

    @classmethod
    def add_cli_args(cls, p: argparse.ArgumentParser) -> None:
        p.add_argument("sweep", type=Path)
        p.add_argument("--cells", required=True, help="the cell id (its build part names the build replaced)")
        p.add_argument("--good", required=True, help="a build of the sweep, venv:PATH or python:PATH")
        p.add_argument("--bad", required=True)
        p.add_argument("--builds", default="", help="comma-separated builds between good and bad, in order")
        p.add_argument("--all", dest="run_all", action="store_true", help="run every build (non-monotone series)")
        p.add_argument("--out", type=Path, default=None, help="default results/bisect-<cell>")
        p.add_argument("--resume", action="store_true", help="finish an interrupted bisect: final steps are kept")

    @classmethod
    def from_cli_args(cls, ns: argparse.Namespace) -> BisectArgs:
        from pdsweep.core.paths import REPO

        if not ns.sweep.is_file():
            raise UserError(f"{ns.sweep}: no such sweep file")
        between = [b for b in ns.builds.split(",") if b]
        out = ns.out or REPO / "results" / f"bisect-{ns.cells}"
        return cls(ns.sweep, ns.cells, (ns.good, *between, ns.bad), out, ns.run_all, ns.resume)

    def main(self) -> int:
        from pdsweep.history.bisect import bisect, run_cell_for_real

        args = (self.sweep, self.cell, list(self.builds), self.out, run_cell_for_real, self.run_all, self.resume)
        result = bisect(*args)
        print("\n".join(result.lines()))
        print(f"bisect: {self.out / 'bisect.json'}")
        return 0


# ---------------------------------------------------------------- gate / compare / report
@dataclass(frozen=True)
class GateArgs:
    parser_name: ClassVar[str] = "gate"
    parser_help: ClassVar[str] = "pass/fail a run (exit 1 on failure), JUnit + summary"

    run_dir: Path
    junit: Path
    summary: Path
    require_all_cells: bool | None = None
    nightly: bool = False

    @classmethod
    def add_cli_args(cls, p: argparse.ArgumentParser) -> None:
        p.add_argument("run_dir", type=Path)
        p.add_argument("--junit", type=Path, default=None)
        p.add_argument("--summary", type=Path, default=None)
        p.add_argument(
            "--require-all-cells",
            action="store_true",
            default=None,
            help="cells needing more GPUs than the host/allocation FAIL (default: NOT-RUNNABLE, listed; "
            "the run's gate.require_all_cells)",
        )
        p.add_argument(
            "--nightly", action="store_true", help="FLAKY cells fail by gate.flaky_fails_nightly (default: they do)"
        )

    @classmethod
    def from_cli_args(cls, ns: argparse.Namespace) -> GateArgs:
        """Outputs default into the run directory; raises ``UserError`` when one cannot
        be written or both are one file."""
        args = cls(
            ns.run_dir,
            ns.junit or ns.run_dir / layout.JUNIT_FILE,
            ns.summary or ns.run_dir / layout.SUMMARY_FILE,
            ns.require_all_cells,
            ns.nightly,
        )
        check_outputs(("--junit", args.junit), ("--summary", args.summary))
        for flag, path in (("--junit", args.junit), ("--summary", args.summary)):
            refuse_results_path(args.run_dir, path, flag)
        return args

    def main(self) -> int:
        from pdsweep.judge.gate import gate_run
        from pdsweep.judge.render import write_junit, write_summary

        result = gate_run(self.run_dir, require_all_cells=self.require_all_cells, nightly=self.nightly)

        def write() -> Path:
            write_junit(result, self.junit)
            return write_summary(result, self.summary)

        write_and_show(write, f"gate: {result.headline()}")
        if not result.passed:
            raise GateFailed(f"gate: {result.headline()}")
        print(f"gate: {result.headline()}")
        return 0


@dataclass(frozen=True)
class CompareArgs:
    parser_name: ClassVar[str] = "compare"
    parser_help: ClassVar[str] = "compare two runs cell by cell (exit 1 on regression)"

    a: Path
    b: Path
    out: Path
    a_build: str | None = None
    b_build: str | None = None
    allow_missing: bool = False
    allow_other_sweep: bool = False

    @classmethod
    def add_cli_args(cls, p: argparse.ArgumentParser) -> None:
        p.add_argument("a", type=Path, help="baseline run (e.g. unfixed, or the last green nightly)")
        p.add_argument("b", type=Path, help="candidate run")
        p.add_argument("--out", type=Path, default=None, help="directory for compare.md / compare.json")
        p.add_argument("--a-build", default=None, help="only A's cells of this build (e.g. fixed)")
        p.add_argument("--b-build", default=None, help="only B's cells of this build (e.g. unfixed)")
        p.add_argument(
            "--allow-missing",
            action="store_true",
            help="cells of A missing in B do not fail the comparison (default: they do)",
        )
        p.add_argument(
            "--allow-other-sweep",
            action="store_true",
            help="compare runs of different sweeps (default: refused, exit 2)",
        )

    @classmethod
    def from_cli_args(cls, ns: argparse.Namespace) -> CompareArgs:
        """``--out`` defaults to B; raises ``UserError`` when an output cannot be written."""
        args = cls(ns.a, ns.b, Path(ns.out or ns.b), ns.a_build, ns.b_build, ns.allow_missing, ns.allow_other_sweep)
        for run in (ns.a, ns.b):
            for name in (layout.COMPARE_MD, layout.COMPARE_JSON):
                refuse_results_path(run, args.out / name, "--out")
        check_outputs(
            (layout.COMPARE_MD, args.out / layout.COMPARE_MD), (layout.COMPARE_JSON, args.out / layout.COMPARE_JSON)
        )
        return args

    def main(self) -> int:
        from pdsweep.judge.compare import compare_runs
        from pdsweep.judge.render import write_compare_json, write_compare_markdown

        res = compare_runs(
            self.a,
            self.b,
            allow_missing=self.allow_missing,
            allow_other_sweep=self.allow_other_sweep,
            a_build=self.a_build,
            b_build=self.b_build,
        )
        from pdsweep.judge.perfrender import COMPARE_JUNIT, perf_headline, write_compare_junit

        verdict = f"compare: {'REGRESSED' if res.regressed else 'NO REGRESSION'} of {self.b} against {self.a}"
        verdict += f"\n{perf_headline(res)}"

        def write() -> Path:
            md = write_compare_markdown(res, self.out / layout.COMPARE_MD)
            write_compare_json(res, self.out / layout.COMPARE_JSON)
            write_compare_junit(res, self.out / COMPARE_JUNIT)
            return md

        write_and_show(write, verdict)
        res.raise_for_verdict()
        print(verdict)
        return 0


@dataclass(frozen=True)
class ReportArgs:
    parser_name: ClassVar[str] = "report"
    parser_help: ClassVar[str] = "markdown + HTML report with plots"

    run_dir: Path
    compare_with: Path | None = None
    out: Path | None = None

    @classmethod
    def add_cli_args(cls, p: argparse.ArgumentParser) -> None:
        p.add_argument("run_dir", type=Path)
        p.add_argument("--compare-with", type=Path, default=None)
        p.add_argument("--out", type=Path, default=None)

    @classmethod
    def from_cli_args(cls, ns: argparse.Namespace) -> ReportArgs:
        if ns.out is not None:
            refuse_results_path(ns.run_dir, ns.out, "--out")
        return cls(ns.run_dir, ns.compare_with, ns.out)

    def main(self) -> int:
        from pdsweep.judge.report import write_report

        for kind, path in write_report(self.run_dir, self.out, self.compare_with).items():
            print(f"{kind}: {path}")
        return 0


# ---------------------------------------------------------------- the table
@dataclass(frozen=True)
class Command:
    """One row of :data:`SUBCOMMANDS`. Its flags and entry point come from ``args`` (an
    Args dataclass above) or, for a heavy module imported only when the command is
    chosen, from ``module``'s ``add_cli_args(parser)`` / ``main(namespace)``;
    ``children``: nested subcommands (``bench transfer``)."""

    name: str
    help: str
    args: type | None = None
    module: str | None = None
    children: tuple[Command, ...] = ()

    @classmethod
    def of(cls, args: type) -> Command:
        return cls(args.parser_name, args.parser_help, args=args)  # type: ignore[attr-defined]

    def add_cli_args(self, p: argparse.ArgumentParser, load: bool) -> None:
        """Declare the flags (a lazy module's only when ``load``) and the entry point."""
        if self.args is not None:
            self.args.add_cli_args(p)  # type: ignore[attr-defined]
            p.set_defaults(func=lambda ns, a=self.args: a.from_cli_args(ns).main())
        elif self.module is not None:
            if load:
                self._load().add_cli_args(p)
            p.set_defaults(func=lambda ns: self._load().main(ns))

    def _load(self) -> Any:
        return __import__(f"pdsweep.{self.module}", fromlist=["main"])


SUBCOMMANDS: tuple[Command, ...] = (
    Command.of(ValidateArgs),
    Command.of(PlanArgs),
    Command.of(RunArgs),
    Command.of(GateArgs),
    Command.of(CompareArgs),
    Command.of(ReportArgs),
    Command("history", "the history store", children=(Command.of(HistoryAddArgs), Command.of(HistoryShowArgs))),
    Command.of(DashboardArgs),
    Command.of(BisectArgs),
    Command("proxy", "run the PD proxy", module="deploy.proxy"),
    Command("baseline-env", "build the unfixed vLLM venv (PR #49297 undone)", module="builds.baseline"),
    Command(
        "builds",
        "sweep builds",
        children=(
            Command("make", "make a build venv: vLLM version, wheel file/URL or source tree", module="builds.make"),
        ),
    ),
    Command(
        "bench",
        "benchmarks",
        children=(
            Command(
                "transfer", "KV-transfer micro-benchmark on real NIXL (fixed/unfixed read plan)", module="xfer.bench"
            ),
        ),
    ),
)


def chosen_path(argv: list[str], table: tuple[Command, ...] = SUBCOMMANDS) -> list[str]:
    """Names of the commands ``argv`` chooses, outermost first (``["bench", "transfer"]``):
    its leading words (non-options; the top-level options take no value) as far as they
    name rows of ``table``. Only these rows' lazy modules are imported; argparse then
    parses (and refuses) ``argv`` as usual."""
    path: list[str] = []
    rows = table
    for word in (a for a in argv if not a.startswith("-")):
        row = next((c for c in rows if c.name == word), None)
        if row is None:
            break
        path.append(row.name)
        rows = row.children
        if not rows:
            break
    return path


def _add_commands(sub: Any, rows: tuple[Command, ...], chosen: list[str], prefix: list[str]) -> None:
    for row in rows:
        p = sub.add_parser(row.name, help=row.help)
        here = [*prefix, row.name]
        if row.children:
            inner = p.add_subparsers(dest=f"{row.name}_command", required=True)
            _add_commands(inner, row.children, chosen, here)
        else:
            row.add_cli_args(p, load=chosen[: len(here)] == here)


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The ``pdsweep`` parser; the flags of a lazy module are declared when ``argv``
    chooses its command (:func:`chosen_path`)."""
    parser = argparse.ArgumentParser(
        prog="pdsweep",
        description="Accuracy and KV-transfer sweeps for vLLM prefill/decode disaggregation over "
        "the NIXL connector. Exit codes: 0 ok, 1 gate/compare verdict failed, 2 bad input (no "
        "traceback), 3 internal error (with traceback), 130 interrupted.",
    )
    parser.add_argument("-v", "--verbose", action="store_true")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_commands(sub, SUBCOMMANDS, chosen_path(argv or []), [])
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser(argv).parse_args(argv)
    if getattr(args, "gpu_arch", None):
        os.environ["PDSWEEP_GPU_ARCH"] = args.gpu_arch  # pdsweep.plan.blocks.ARCH_ENV (plan, run, children)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    return run_main(lambda: args.func(args))


if __name__ == "__main__":
    sys.exit(main())
