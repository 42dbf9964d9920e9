"""``pdsweep report``: the markdown + HTML report (:func:`pdsweep.report.html.write_report`)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from pdsweep.commands.args import one_run, run_dirs
from pdsweep.report.html import write_report
from pdsweep.results.outputs import refuse_results_path


@dataclass(frozen=True)
class ReportArgs:
    run_dir: Path
    compare_with: Path | None = None
    out: Path | None = None

    @classmethod
    def add_cli_args(cls, p: argparse.ArgumentParser) -> None:
        p.add_argument(
            "run_dir", type=Path, nargs="+", help="a run directory, or the n shard directories of one run (--shard i/n)"
        )
        p.add_argument("--compare-with", type=run_dirs, default=None, help="a run directory (shards: DIR,DIR,...)")
        p.add_argument("--out", type=Path, default=None)

    @classmethod
    def from_cli_args(cls, ns: argparse.Namespace) -> ReportArgs:
        run_dir = one_run(ns.run_dir)  # shards: their merged view (pdsweep.results.shards)
        if ns.out is not None:
            refuse_results_path(run_dir, ns.out, "--out")
        return cls(run_dir, one_run(ns.compare_with) if ns.compare_with else None, ns.out)

    def main(self) -> int:
        for kind, path in write_report(self.run_dir, self.out, self.compare_with).items():
            print(f"{kind}: {path}")
        return 0
