"""``pdsweep compare``: two runs cell by cell (:func:`pdsweep.judge.compare.compare_runs`), compare.md/json/JUnit."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from pdsweep.commands.args import check_outputs, one_run, run_dirs, write_and_show
from pdsweep.judge.compare import compare_runs
from pdsweep.judge.gate import gate_run
from pdsweep.judge.pareto import front_changes, points
from pdsweep.report.perf_compare import COMPARE_JUNIT, pairing_line, perf_headline, perf_teeth, write_compare_junit
from pdsweep.report.render import write_compare_json, write_compare_markdown
from pdsweep.results import layout
from pdsweep.results.outputs import refuse_results_path


@dataclass(frozen=True)
class CompareArgs:
    a: Path
    b: Path
    out: Path
    a_build: str | None = None
    b_build: str | None = None
    allow_missing: bool = False
    allow_other_sweep: bool = False

    @classmethod
    def add_cli_args(cls, p: argparse.ArgumentParser) -> None:
        p.add_argument(
            "a", type=run_dirs, help="baseline run (e.g. unfixed, or the last green nightly; shards: DIR,DIR,...)"
        )
        p.add_argument("b", type=run_dirs, help="candidate run (shards of one run: DIR,DIR,...)")
        p.add_argument("--out", type=Path, default=None, help="directory for compare.md / compare.json")
        p.add_argument(
            "--a-build", default=None, help="only A's PD cells of this build (e.g. fixed); references: see --b-build"
        )
        p.add_argument(
            "--b-build",
            default=None,
            help="only B's PD cells of this build (e.g. unfixed); A and B one run: its references are not compared",
        )
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
        """``--out`` defaults to B (shards: their merged view, :mod:`pdsweep.results.shards`);
        raises ``UserError`` when an output cannot be written or the shards are not one run's."""
        a, b = one_run(ns.a), one_run(ns.b)
        args = cls(a, b, Path(ns.out or b), ns.a_build, ns.b_build, ns.allow_missing, ns.allow_other_sweep)
        for run in (a, b):
            for name in (layout.COMPARE_MD, layout.COMPARE_JSON):
                refuse_results_path(run, args.out / name, "--out")
        check_outputs(
            (layout.COMPARE_MD, args.out / layout.COMPARE_MD), (layout.COMPARE_JSON, args.out / layout.COMPARE_JSON)
        )
        return args

    def front_changes(self) -> list[str]:
        """Where each model's Pareto front moved from A to B (pdsweep.judge.pareto.front_changes),
        each side's points of its build when --a-build/--b-build pick one (one run: two builds, whose
        unpaired moves are shown, not claimed)."""

        def side(run: Path, build: str | None) -> list:
            return [p for p in points(run, gate_run(run)) if build is None or p.build == build]

        same_run = self.a.resolve() == self.b.resolve()
        return front_changes(side(self.a, self.a_build), side(self.b, self.b_build), same_run=same_run)

    def main(self) -> int:
        res = compare_runs(
            self.a,
            self.b,
            allow_missing=self.allow_missing,
            allow_other_sweep=self.allow_other_sweep,
            a_build=self.a_build,
            b_build=self.b_build,
        )

        verdict = f"compare: {'REGRESSED' if res.regressed else 'NO REGRESSION'} of {self.b} against {self.a}"
        verdict += "".join(f"\nnote: {n}" for n in res.notes) + f"\n{perf_headline(res)}\n{perf_teeth(res)}"
        verdict += "".join(f"\n{line}" for line in [pairing_line(res)] if line)

        def write() -> Path:
            md = write_compare_markdown(res, self.out / layout.COMPARE_MD)
            write_compare_json(res, self.out / layout.COMPARE_JSON)
            write_compare_junit(res, self.out / COMPARE_JUNIT)
            return md

        write_and_show(write, verdict)
        fronts = self.front_changes()  # shown, not judged: the perf verdicts above judge each cell
        print("".join(f"front: {line}\n" for line in fronts) or "front: no Pareto front moved beyond noise")
        res.raise_for_verdict()
        print(verdict)
        return 0
