"""``pdsweep plan``: the dry run (cells, rejected cells, instance argv/env, schedule)."""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from typing import Any, ClassVar

from pdsweep.commands.args import gpu_arch_arg, gpu_count, no_check_argv_arg


@dataclass(frozen=True)
class PlanArgs:
    parser_name: ClassVar[str] = "plan"
    parser_help: ClassVar[str] = "cells, rejected cells, instance argv/env (dry run) and schedule"

    sweep: str
    gpus: int | None = None
    format: str = "table"
    cells: str | None = None
    check_argv: bool = True
    cluster: Any = None  # pdsweep.plan.placement.Cluster, or None: one host
    preflight: bool = False

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

    @classmethod
    def from_cli_args(cls, ns: argparse.Namespace) -> PlanArgs:
        """Raises ``UserError`` for ``--nodes`` without ``--gpus-per-node`` (and the
        like) or ``--launcher slurm`` outside an allocation."""
        from pdsweep.run.dryrun import plan_cluster

        return cls(
            ns.sweep,
            ns.gpus,
            ns.format,
            ns.cells,
            not ns.no_check_argv,
            plan_cluster(ns.nodes, ns.gpus_per_node, ns.launcher),
            ns.preflight,
        )

    def main(self) -> int:
        from pdsweep.run.dryrun import plan_dict, print_plan

        d = plan_dict(self.sweep, self.gpus, self.cells, self.cluster, check=self.check_argv, gpu_check=self.preflight)
        if self.format == "json":
            print(json.dumps(d, indent=2))
        else:
            print_plan(d)
        return 0
