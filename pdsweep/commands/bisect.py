"""``pdsweep bisect``: one cell over builds between a good and a bad one (:mod:`pdsweep.history.bisect`)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from pdsweep.core.errors import UserError
from pdsweep.core.paths import REPO
from pdsweep.history.bisect import bisect, run_cell_for_real


@dataclass(frozen=True)
class BisectArgs:
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
        if not ns.sweep.is_file():
            raise UserError(f"{ns.sweep}: no such sweep file")
        between = [b for b in ns.builds.split(",") if b]
        out = ns.out or REPO / "results" / f"bisect-{ns.cells}"
        return cls(ns.sweep, ns.cells, (ns.good, *between, ns.bad), out, ns.run_all, ns.resume)

    def main(self) -> int:
        args = (self.sweep, self.cell, list(self.builds), self.out, run_cell_for_real, self.run_all, self.resume)
        result = bisect(*args)
        print("\n".join(result.lines()))
        print(f"bisect: {self.out / 'bisect.json'}")
        return 0
