"""``pdsweep fetch``: download the weights of a sweep's models once, before any instance starts
(:mod:`pdsweep.run.fetch`)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from pdsweep.plan.expand import expand
from pdsweep.run.fetch import fetch, missing_datasets, sweep_models
from pdsweep.sweepfile.sweep import load_sweep


@dataclass(frozen=True)
class FetchArgs:
    sweep: str
    cells: str | None = None

    @classmethod
    def add_cli_args(cls, p: argparse.ArgumentParser) -> None:
        p.add_argument("sweep", help="sweep YAML (e.g. sweeps/hybrid-mla-mamba.yaml)")
        p.add_argument("--cells", default=None, help="only the models of the cells matching this glob")

    @classmethod
    def from_cli_args(cls, ns: argparse.Namespace) -> FetchArgs:
        return cls(ns.sweep, ns.cells)

    def main(self) -> int:
        from fnmatch import fnmatch

        plan = expand(load_sweep(self.sweep))
        cells = [c for c in plan.cells if self.cells is None or fnmatch(c.id, self.cells)]
        got = fetch(sweep_models(plan.loaded, cells), datasets=missing_datasets(list(plan.loaded.sweep.eval.tasks)))
        print(
            f"pdsweep fetch: {len(got)} downloaded" if got else "pdsweep fetch: every model and eval dataset is local"
        )
        return 0
