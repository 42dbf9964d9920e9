"""``pdsweep`` command line: one table of subcommands (:data:`SUBCOMMANDS`).

A subcommand is an Args dataclass in its own module of :mod:`pdsweep.commands` (vLLM's
``benchmarks/sweep`` pattern): ``add_cli_args`` declares its flags, ``from_cli_args`` turns
the parsed namespace into the dataclass and does all validation (bad input: ``UserError``),
``main`` runs it. Heavy modules (the PD
proxy, the baseline builder, the transfer bench) keep their own ``add_cli_args`` /
``main`` and are imported only when their command is chosen. Errors are caught once, by
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

from pdsweep.commands.best import BestArgs
from pdsweep.commands.bisect import BisectArgs
from pdsweep.commands.compare import CompareArgs
from pdsweep.commands.fetch import FetchArgs
from pdsweep.commands.gate import GateArgs
from pdsweep.commands.history import DashboardArgs, HistoryAddArgs, HistoryShowArgs
from pdsweep.commands.plan import PlanArgs
from pdsweep.commands.report import ReportArgs
from pdsweep.commands.run import RunArgs
from pdsweep.commands.validate import ValidateArgs
from pdsweep.core.errors import run_main

__all__ = ["SUBCOMMANDS", "Command", "build_parser", "chosen_path", "entry", "exit_now", "main"]


@dataclass(frozen=True)
class Command:
    """One row of :data:`SUBCOMMANDS`. Its flags and entry point come from ``args`` (an
    Args dataclass of pdsweep.commands) or, for a heavy module imported only when the command is
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
    Command.of(FetchArgs),
    Command.of(RunArgs),
    Command.of(GateArgs),
    Command.of(CompareArgs),
    Command.of(ReportArgs),
    Command("history", "the history store", children=(Command.of(HistoryAddArgs), Command.of(HistoryShowArgs))),
    Command.of(DashboardArgs),
    Command.of(BisectArgs),
    Command.of(BestArgs),
    Command("proxy", "run the PD proxy", module="deploy.proxy"),
    Command("baseline-env", "build the unfixed vLLM venv (PR #49297 undone)", module="builds.baseline"),
    Command(
        "builds",
        "sweep builds",
        children=(
            Command("make", "make a build venv: vLLM version, wheel file/URL or source tree", module="builds.make"),
            Command(
                "tonight",
                "make VLLM's build and its unfixed twin; write the sweep pointed at both (make nightly VLLM=...)",
                module="commands.tonight",
            ),
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
