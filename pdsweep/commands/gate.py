"""``pdsweep gate``: judge a run (:func:`pdsweep.judge.gate.gate_run`), write JUnit and summary.md."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from pdsweep.commands.args import check_outputs, one_run, write_and_show
from pdsweep.core.errors import GateFailed
from pdsweep.judge.gate import gate_run
from pdsweep.report.render import write_junit, write_summary
from pdsweep.results import layout
from pdsweep.results.outputs import refuse_results_path


@dataclass(frozen=True)
class GateArgs:
    run_dir: Path
    junit: Path
    summary: Path
    require_all_cells: bool | None = None
    nightly: bool = False

    @classmethod
    def add_cli_args(cls, p: argparse.ArgumentParser) -> None:
        p.add_argument(
            "run_dir", type=Path, nargs="+", help="a run directory, or the n shard directories of one run (--shard i/n)"
        )
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
        """Outputs default into the run directory (shards: their merged view); raises ``UserError`` when one cannot
        be written or both are one file."""
        run_dir = one_run(ns.run_dir)  # shards: their merged view (pdsweep.results.shards)
        args = cls(
            run_dir,
            ns.junit or run_dir / layout.JUNIT_FILE,
            ns.summary or run_dir / layout.SUMMARY_FILE,
            ns.require_all_cells,
            ns.nightly,
        )
        check_outputs(("--junit", args.junit), ("--summary", args.summary))
        for flag, path in (("--junit", args.junit), ("--summary", args.summary)):
            refuse_results_path(args.run_dir, path, flag)
        return args

    def main(self) -> int:
        result = gate_run(self.run_dir, require_all_cells=self.require_all_cells, nightly=self.nightly)

        def write() -> Path:
            write_junit(result, self.junit)
            return write_summary(result, self.summary)

        write_and_show(write, f"gate: {result.headline()}")
        if not result.passed:
            raise GateFailed(f"gate: {result.headline()}")
        print(f"gate: {result.headline()}")
        return 0
