"""``pdsweep plan``: the dry run (cells, rejected cells, instance argv/env, schedule)."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from typing import Any

from pdsweep.commands.args import (
    budget_arg,
    durations_arg,
    gpu_arch_arg,
    gpu_count,
    job_args,
    no_check_argv_arg,
    shard_arg,
)
from pdsweep.core.errors import UserError
from pdsweep.run.dryrun import plan_cluster, plan_dict, print_plan


@dataclass(frozen=True)
class PlanArgs:
    sweep: str
    gpus: int | None = None
    format: str = "table"
    cells: str | None = None
    check_argv: bool = True
    cluster: Any = None  # pdsweep.plan.placement.Cluster, or None: one host
    preflight: bool = False
    job: Any = None  # pdsweep.run.jobs.JobArgs: --shard, --budget

    @classmethod
    def add_cli_args(cls, p: argparse.ArgumentParser) -> None:
        p.add_argument("sweep")
        p.add_argument("--gpus", type=gpu_count, default=None, help="GPUs on the host (default: nvidia-smi; 0 on CPU)")
        p.add_argument("--format", choices=("table", "json"), default="table")
        p.add_argument("--cells", default=None, help="glob over cell ids")
        no_check_argv_arg(p)
        gpu_arch_arg(p)
        p.add_argument(
            "--preflight",
            action="store_true",
            help="check weights, memory fit, driver and busy GPUs as `run` does (exit 2 on a problem)",
        )
        p.add_argument(
            "--nodes", type=int, default=None, help="place over N nodes (named node0..; needs --gpus-per-node)"
        )
        p.add_argument(
            "--gpus-per-node", type=int, default=None, help="GPUs per node (with --nodes or --launcher slurm)"
        )
        p.add_argument(
            "--launcher",
            choices=("local", "slurm"),
            default="local",
            help="slurm: place over the allocation we run in (SLURM_JOB_NODELIST, SLURM_GPUS_ON_NODE)",
        )
        shard_arg(p)
        budget_arg(p)
        durations_arg(p)

    @classmethod
    def from_cli_args(cls, ns: argparse.Namespace) -> PlanArgs:
        """Raises ``UserError`` for ``--nodes`` without ``--gpus-per-node`` (and the
        like) or ``--launcher slurm`` outside an allocation."""
        return cls(
            ns.sweep,
            ns.gpus,
            ns.format,
            ns.cells,
            not ns.no_check_argv,
            plan_cluster(ns.nodes, ns.gpus_per_node, ns.launcher),
            ns.preflight,
            job_args(ns),
        )

    def main(self) -> int:
        d = plan_dict(
            self.sweep,
            self.gpus,
            self.cells,
            self.cluster,
            check=self.check_argv,
            gpu_check=self.preflight,
            job_args=self.job,
        )
        if self.format == "json":
            print(json.dumps(d, indent=2))
            for w in d["warnings"]:
                print(f"warning: {w}", file=sys.stderr)
        else:
            print_plan(d)
        if d["budget"] and not d["budget"]["fits"]:  # after the plan: what does not fit is in sight
            raise UserError(f"{self.sweep}: {d['budget']['line']}")
        return 0
