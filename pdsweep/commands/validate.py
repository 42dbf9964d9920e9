"""``pdsweep validate``: check a sweep file (schema, rules, eval tasks, every instance's ``vllm serve`` argv)."""

from __future__ import annotations

import argparse
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
from pdsweep.measure.evaltasks import check_eval_tasks
from pdsweep.measure.percentiles import percentile_plan
from pdsweep.plan.expand import expand
from pdsweep.plan.shards import JobArgs
from pdsweep.run.dryrun import check_cells_argv, plan_dict
from pdsweep.run.feasible import feasibility_warnings
from pdsweep.run.preflight import preflight as gpu_preflight
from pdsweep.sweepfile.sweep import load_sweep


@dataclass(frozen=True)
class ValidateArgs:
    sweep: str
    check_argv: bool = True
    preflight: bool = False
    job: Any = None  # pdsweep.plan.shards.JobArgs: --shard, --budget
    gpus: int | None = None  # the node the budget is checked on (default: nvidia-smi)

    @classmethod
    def add_cli_args(cls, p: argparse.ArgumentParser) -> None:
        p.add_argument("sweep", help="sweep YAML (e.g. sweeps/cpu-smoke.yaml)")
        no_check_argv_arg(p)
        p.add_argument(
            "--preflight",
            action="store_true",
            help="also check weights, memory fit, driver and busy GPUs on this host (pdsweep.run.preflight)",
        )
        gpu_arch_arg(p)
        budget_arg(p)
        shard_arg(p)
        durations_arg(p)
        p.add_argument(
            "--gpus", type=gpu_count, default=None, help="GPUs the budget is checked on (default: nvidia-smi)"
        )

    @classmethod
    def from_cli_args(cls, ns: argparse.Namespace) -> ValidateArgs:
        return cls(ns.sweep, not ns.no_check_argv, ns.preflight, job_args(ns), ns.gpus)

    def main(self) -> int:
        ls = load_sweep(self.sweep)
        plan = expand(ls)
        for w in feasibility_warnings(plan):
            print(f"warning: {w}", file=sys.stderr)
        check_eval_tasks(ls)
        if not plan.pd_cells:
            why = "; ".join(sorted({f"{r.rule}: {r.reason}" for r in plan.rejected})[:3]) or "the matrix is empty"
            raise UserError(f"{self.sweep}: no PD cell to run ({len(plan.rejected)} rejected): {why}")
        if self.check_argv:
            check_cells_argv(plan.loaded, plan.cells)
        if self.preflight:
            for w in gpu_preflight(ls, plan.cells).warnings:
                print(f"warning: {w}", file=sys.stderr)
        print_perf_lines(ls.sweep)
        job = self.job or JobArgs()
        if job.budget is not None or ls.sweep.budget is not None:
            check_budget(self.sweep, self.gpus, job)
        elif job.durations is not None:
            print(f"--durations-from {job.durations.run_dir}: no budget to check (--budget, or the sweep's budget:)")
        print(
            f"{self.sweep}: valid: {len(plan.pd_cells)} PD cells, {len(plan.cells) - len(plan.pd_cells)} "
            f"reference cells, {len(plan.rejected)} rejected"
            + ("; every vllm serve argv parses" if self.check_argv else "")
        )
        return 0


def check_budget(sweep: str, gpus: int | None, job: Any) -> None:
    """The CI clock (:mod:`pdsweep.plan.clock`): the planned makespan of the sweep (or its
    ``--shard``) against ``--budget`` or the sweep's ``budget``; prints the comparison, raises
    ``UserError`` naming both figures when it cannot fit."""

    b = plan_dict(sweep, gpus, check=False, job_args=job)["budget"]
    if not b["fits"]:
        raise UserError(f"{sweep}: {b['line']}")
    print(f"budget: {b['line']}")


def print_perf_lines(sweep: Any) -> None:
    """With the load phase on: which percentiles the perf verdict judges at ``bench.num_prompts``
    (:func:`pdsweep.measure.percentiles.percentile_plan`) on stdout, and a ``warning:`` on stderr per
    ``gate.perf`` family it cannot judge; nothing without a load phase."""
    if not sweep.bench.enabled:
        return
    line, warns = percentile_plan(sweep.bench.num_prompts, sweep.gate.perf)
    print(line)
    for w in warns:
        print(f"warning: {w}", file=sys.stderr)
