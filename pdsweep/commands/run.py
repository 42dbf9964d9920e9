"""``pdsweep run``: deploy and measure every cell, then append the run to the history store."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from dataclasses import dataclass
from pathlib import Path

from pdsweep.commands.args import append_history, default_history, durations_arg, gpu_arch_arg, gpu_count, shard_arg
from pdsweep.core.errors import EXIT_INTERRUPTED, UserError, ignore_stop_signals
from pdsweep.run.context import RunOptions
from pdsweep.run.sweep import run_sweep


@dataclass(frozen=True)
class RunArgs:
    """``pdsweep run``. Every flag whose dest names a :class:`pdsweep.run.context.RunOptions`
    field is passed on as that field: a new option is a field there plus a flag here."""

    sweep: str
    opts: RunOptions
    history: Path | None = None  # None: not appended

    @classmethod
    def add_cli_args(cls, p: argparse.ArgumentParser) -> None:
        p.add_argument("sweep")
        p.add_argument("--out", type=Path, default=None, help="run directory (default results/<sweep>-<time>)")
        p.add_argument("--cells", default=None, help="glob over cell ids (their references are added)")
        p.add_argument("--gpus", type=gpu_count, default=None)
        gpu_arch_arg(p)
        p.add_argument("--resume", action="store_true", help="skip cells whose status is final")
        shard_arg(p)
        durations_arg(p)
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
        given = {f.name: getattr(ns, f.name) for f in dataclasses.fields(RunOptions) if hasattr(ns, f.name)}
        opts = RunOptions(**given)
        try:
            opts.faults  # noqa: B018 -- validates the test-only fault options before anything runs
        except ValueError as e:
            raise UserError(f"pdsweep run: {e}") from None
        return cls(ns.sweep, opts, None if ns.no_history else (ns.history or default_history()))

    def main(self) -> int:
        try:
            run_dir = run_sweep(self.sweep, self.opts)
        except KeyboardInterrupt:
            ignore_stop_signals()  # exit 130, not death by SIGINT (see its docstring)
            print("interrupted: every process this run started was stopped; finish with --resume", file=sys.stderr)
            return EXIT_INTERRUPTED
        if self.history is not None and self.opts.shard is not None:
            print(
                f"--shard {self.opts.shard}: not added to the history {self.history}: a shard is part of one run; "
                "`pdsweep history add DIR,DIR,...` of all its shards (or `make nightly-finish RUN=DIR,DIR,...`) "
                "adds the night once",
                file=sys.stderr,
            )
        elif self.history is not None:
            append_history(self.history, run_dir)
        print(run_dir)
        return 0
