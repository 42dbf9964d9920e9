"""``pdsweep best``: the P/D configuration with the highest goodput per GPU that meets an SLO
(:func:`pdsweep.judge.pareto.best`), its interval and the runner-up."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from pdsweep.core.errors import GateFailed, UserError
from pdsweep.judge.gate import gate_run
from pdsweep.judge.pareto import best, describe, points
from pdsweep.results import layout
from pdsweep.sweepfile.slo import parse_slo


@dataclass(frozen=True)
class BestArgs:
    run_dir: Path
    slo: str
    model: str | None = None

    @classmethod
    def add_cli_args(cls, p: argparse.ArgumentParser) -> None:
        p.add_argument("run_dir", type=Path)
        p.add_argument(
            "--slo",
            required=True,
            help="latency limits in ms, e.g. ttft_p90=500,tpot_p90=50 (keys: ttft|tpot|itl|e2el _ p50|p90|p99)",
        )
        p.add_argument("--model", default=None, help="only this model's cells (default: every model)")

    @classmethod
    def from_cli_args(cls, ns: argparse.Namespace) -> BestArgs:
        parse_slo(ns.slo)  # refused before the run is read
        return cls(ns.run_dir, ns.slo, ns.model)

    def main(self) -> int:
        result = gate_run(self.run_dir)
        pts = points(self.run_dir, result)
        lost = [r for c in result.cells for r in c.reasons if f"/{layout.LOAD_FILE}: unreadable" in r]
        if not pts and lost:  # not "the run measured no bench phase": it did, and its figures are damaged
            raise UserError(f"no load points: {'; '.join(lost)}")
        models = sorted({p.model for p in pts})
        none_met = []
        chosen: list[str | None] = [self.model] if self.model else [*models] or [None]
        for model in chosen:
            b = best(pts, parse_slo(self.slo), model)
            print(f"{model}:" if model else "all models:")
            print("".join(f"  {line}\n" for line in describe(b)), end="")
            if b.choice is None:
                none_met.append(model or "all models")
        if none_met:
            raise GateFailed(f"best: no configuration meets the SLO for {', '.join(none_met)}")
        return 0
