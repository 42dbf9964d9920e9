"""``pdsweep history add|show`` and ``pdsweep dashboard``: the history store (:mod:`pdsweep.history`)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from pdsweep.commands.args import check_outputs, default_history, one_run, run_dirs
from pdsweep.core.errors import UserError
from pdsweep.history.dashboard import render
from pdsweep.history.store import add_run
from pdsweep.history.text import DEFAULT_METRICS, append_to_summary, run_news, show_lines
from pdsweep.results import layout


@dataclass(frozen=True)
class HistoryAddArgs:
    runs: tuple[Path, ...]
    db: Path

    @classmethod
    def add_cli_args(cls, p: argparse.ArgumentParser) -> None:
        p.add_argument(
            "runs",
            type=run_dirs,
            nargs="+",
            help="run directories; the n shards of one run (`run --shard i/n`) as DIR,DIR,...: one entry",
        )
        p.add_argument("--db", type=Path, default=None, help="default $PDSWEEP_HISTORY or results/history.sqlite")

    @classmethod
    def from_cli_args(cls, ns: argparse.Namespace) -> HistoryAddArgs:
        for dirs in ns.runs:
            for r in dirs:
                if not (r / layout.RUN_FILE).is_file():
                    raise UserError(f"{r}: not a run directory (no {layout.RUN_FILE})")
        return cls(tuple(one_run(dirs) for dirs in ns.runs), ns.db or default_history())

    def main(self) -> int:
        for r in self.runs:
            key = add_run(self.db, r)
            news = run_news(self.db, r)
            append_to_summary(r, news)
            print(f"{r}: run {key} in {self.db}")
            print("\n".join(news.lines()))
        return 0


@dataclass(frozen=True)
class HistoryShowArgs:
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
        return cls(ns.db or default_history(), ns.cell, tuple(ns.metric or DEFAULT_METRICS), ns.sweep)

    def main(self) -> int:
        print("\n".join(show_lines(self.db, self.cell, self.metrics, self.sweep)))
        return 0


@dataclass(frozen=True)
class DashboardArgs:
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
        print(render(self.db, self.out, self.sweep))
        return 0
