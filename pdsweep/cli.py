"""``pdsweep`` command line: one table of subcommands (:data:`SUBCOMMANDS`).

A subcommand is an Args dataclass in its own module of :mod:`pdsweep.commands` (vLLM's
``benchmarks/sweep`` pattern): ``add_cli_args`` declares its flags, ``from_cli_args`` turns
the parsed namespace into the dataclass and does all validation (bad input: ``UserError``),
``main`` runs it. Heavy modules (the PD
proxy, the baseline builder, the transfer bench) keep their own ``add_cli_args`` /
``main``. Every subcommand's module is imported only when its command is chosen. Errors are caught once, by
:func:`pdsweep.core.errors.run_main`: ``UserError`` -> message, exit 2; ``GateFailed`` ->
message, exit 1; anything else (an ``OSError`` included) is a pdsweep bug or an
environment fault: traceback, exit 3 (docs/gate.md "Exit codes").
"""

from __future__ import annotations

import argparse
import atexit
import logging
import os
import sys
from dataclasses import dataclass
from typing import Any, NoReturn

from pdsweep.core.env import ARCH_ENV
from pdsweep.core.errors import run_main

__all__ = ["SUBCOMMANDS", "Command", "build_parser", "chosen_path", "entry", "exit_now", "main"]


@dataclass(frozen=True)
class Command:
    """One row of :data:`SUBCOMMANDS`. A leaf's ``module`` (relative to the package) is imported
    only when the command is chosen (start-up stays light: ``pdsweep --help`` imports no
    subcommand); its flags and entry point come from the Args dataclass ``args`` of that module
    (``add_cli_args``, ``from_cli_args(ns).main()``) or, without ``args``, from the module's own
    ``add_cli_args(parser)`` / ``main(namespace)``; ``children``: nested subcommands (``bench transfer``)."""

    name: str
    help: str
    module: str | None = None
    args: str | None = None
    children: tuple[Command, ...] = ()

    def add_cli_args(self, p: argparse.ArgumentParser, load: bool) -> None:
        """Declare the flags (only when ``load``: the chosen command) and the entry point."""
        if load:
            self._entry().add_cli_args(p)
        p.set_defaults(func=self._main)

    def _main(self, ns: argparse.Namespace) -> Any:
        entry = self._entry()
        return entry.from_cli_args(ns).main() if self.args else entry.main(ns)

    def _entry(self) -> Any:
        """The Args class, or the module itself for a row without one."""
        mod = self._load()
        return getattr(mod, self.args) if self.args else mod

    def _load(self) -> Any:
        return __import__(f"pdsweep.{self.module}", fromlist=["main"])


SUBCOMMANDS: tuple[Command, ...] = (
    Command("validate", "check a sweep file", "commands.validate", "ValidateArgs"),
    Command("plan", "cells, rejected cells, instance argv/env (dry run) and schedule", "commands.plan", "PlanArgs"),
    Command(
        "fetch",
        "download a sweep's missing weights and eval datasets (disk checked first)",
        "commands.fetch",
        "FetchArgs",
    ),
    Command("run", "deploy and measure every cell", "commands.run", "RunArgs"),
    Command("gate", "pass/fail a run (exit 1 on failure), JUnit + summary", "commands.gate", "GateArgs"),
    Command("compare", "compare two runs cell by cell (exit 1 on regression)", "commands.compare", "CompareArgs"),
    Command("report", "markdown + HTML report with plots", "commands.report", "ReportArgs"),
    Command(
        "history",
        "the history store",
        children=(
            Command(
                "add",
                "append run directories to the history store (a run added twice is one entry)",
                "commands.history",
                "HistoryAddArgs",
            ),
            Command(
                "show",
                "series per cell and metric, with the first run of each sustained change",
                "commands.history",
                "HistoryShowArgs",
            ),
        ),
    ),
    Command(
        "dashboard",
        "one static HTML page of the history (per cell: verdicts and figures over time)",
        "commands.history",
        "DashboardArgs",
    ),
    Command(
        "bisect",
        "run one cell on builds between a good and a bad one; name the first bad build",
        "commands.bisect",
        "BisectArgs",
    ),
    Command(
        "best", "which P/D configuration to deploy under an SLO (exit 1: none meets it)", "commands.best", "BestArgs"
    ),
    Command("proxy", "run the PD proxy", "deploy.proxy"),
    Command("baseline-env", "build the unfixed vLLM venv (PR #49297 undone)", "builds.baseline"),
    Command(
        "builds",
        "sweep builds",
        children=(
            Command("make", "make a build venv: vLLM version, wheel file/URL or source tree", "builds.make"),
            Command(
                "tonight",
                "make VLLM's build and its unfixed twin; write the sweep pointed at both (make nightly VLLM=...)",
                "commands.tonight",
            ),
        ),
    ),
    Command(
        "bench",
        "benchmarks",
        children=(
            Command("transfer", "KV-transfer micro-benchmark on real NIXL (fixed/unfixed read plan)", "xfer.bench"),
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
        os.environ[ARCH_ENV] = args.gpu_arch  # read by pdsweep.plan.blocks.target_arch (plan, run, children)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    return run_main(lambda: args.func(args))


def exit_now(code: int) -> NoReturn:
    """End the process with ``code``. When it imported Triton (an in-process ``vllm bench serve``,
    :mod:`pdsweep.measure.benchserve`, imports vLLM's kernels), after the exit handlers
    (``atexit``: answer stores, probes, logging) and flushed output, but without the
    interpreter's finalization: there Triton 3.9's nanobind bindings report their own leaks
    ("nanobind: leaked 514 functions!", ~100 lines on stderr, harmless) and torch and vLLM
    tear down for seconds. Otherwise a plain ``sys.exit``."""
    if "triton" not in sys.modules:
        sys.exit(code)
    atexit._run_exitfuncs()
    for f in (sys.stdout, sys.stderr):
        try:
            f.flush()
        except (OSError, ValueError):  # closed or a broken pipe: nothing left to write
            pass
    os._exit(code)


def entry() -> NoReturn:
    """The ``pdsweep`` console script and ``python -m pdsweep``: :func:`main`, then :func:`exit_now`."""
    exit_now(main())


if __name__ == "__main__":
    entry()
