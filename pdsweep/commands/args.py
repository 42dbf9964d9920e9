"""Shared pieces of the subcommands' Args classes: argparse types, common flags, output
checks, the history store's default path."""

from __future__ import annotations

import argparse
import os
import re
import sys
from collections.abc import Callable
from pathlib import Path

from pdsweep.core.errors import UserError
from pdsweep.core.paths import REPO
from pdsweep.history.store import add_run
from pdsweep.plan.shards import JobArgs, Shard, parse_shard
from pdsweep.results import layout
from pdsweep.results.celltimes import RunDurations, read_durations
from pdsweep.results.shards import merged_view


def gpu_count(text: str) -> int:
    """argparse type of ``--gpus``: an integer in 0..4096 (argparse then exits 2 with usage)."""
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if not 0 <= n <= 4096:
        raise argparse.ArgumentTypeError(f"{n} GPUs: allowed 0..4096")
    return n


def gpu_arch(text: str) -> str:
    """argparse type of ``--gpu-arch``: ``smXY`` (sm80, sm90, sm100, ...), lower-cased."""
    if not re.fullmatch(r"sm\d{2,3}", text.strip().lower()):
        raise argparse.ArgumentTypeError(f"{text!r}: expected smXY (sm80, sm89, sm90, sm100, sm103, sm120)")
    return text.strip().lower()


def gpu_arch_arg(p: argparse.ArgumentParser) -> None:
    """``--gpu-arch``: the GPU vLLM's backend choice and kernel blocks are computed for
    (:func:`pdsweep.plan.blocks.target_arch`); :func:`main` exports it as ``PDSWEEP_GPU_ARCH``."""
    p.add_argument(
        "--gpu-arch",
        type=gpu_arch,
        default=None,
        help="target GPU for attention backend and kernel blocks (default: nvidia-smi compute_cap, else sm90)",
    )


def shard_arg(p: argparse.ArgumentParser) -> None:
    """``--shard i/n``: job i of n, each keeping whole instance chains (:mod:`pdsweep.plan.shards`)."""
    p.add_argument(
        "--shard",
        type=shard,
        default=None,
        metavar="I/N",
        help="run or plan job I of N: the sweep cut into N disjoint jobs keeping whole instance chains",
    )


def shard(text: str) -> Shard:
    """argparse type of ``--shard``: :func:`pdsweep.plan.shards.parse_shard` (exit 2 with usage)."""
    try:
        return parse_shard(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def minutes(text: str) -> float:
    """argparse type of ``--budget``: minutes, 0 < m <= 10080 (a week)."""
    try:
        m = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of minutes") from None
    if not 0 < m <= 10080:
        raise argparse.ArgumentTypeError(f"{text} minutes: allowed 0 < minutes <= 10080")
    return m


def budget_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--budget",
        type=minutes,
        default=None,
        metavar="MINUTES",
        help="the job's time limit: fail (exit 2) when the planned makespan exceeds it (default: the sweep's budget)",
    )


def job_args(ns: argparse.Namespace) -> JobArgs:
    """:class:`pdsweep.plan.shards.JobArgs` of ``--shard``, ``--budget`` and ``--durations-from``."""
    return JobArgs(getattr(ns, "shard", None), getattr(ns, "budget", None), getattr(ns, "durations_from", None))


def durations_run(text: str) -> RunDurations:
    """argparse type of ``--durations-from``: the measured cell durations of the run directory
    ``text`` (:func:`pdsweep.results.celltimes.read_durations`); one that does not exist or is
    not a run exits 2 naming it."""
    try:
        return read_durations(Path(text))
    except UserError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def durations_arg(p: argparse.ArgumentParser) -> None:
    """``--durations-from RUN_DIR``: each cell's measured wall time there, else pdsweep's model
    (:mod:`pdsweep.plan.durations`), for the budget check, the shard cut and the dispatch order."""
    p.add_argument(
        "--durations-from",
        type=durations_run,
        default=None,
        metavar="RUN_DIR",
        help="a previous run: each cell it ran takes its measured wall time there (budget, shards); "
        "the others pdsweep's duration model",
    )


def run_dirs(text: str) -> list[Path]:
    """argparse type of a run argument that may be the shards of one run: ``DIR`` or
    ``DIR,DIR,...`` (:func:`pdsweep.results.shards.merged_view`)."""
    return [Path(x) for x in text.split(",") if x]


def one_run(dirs: list[Path] | Path) -> Path:
    """The run directory of ``dirs``: itself, or the merged view of its shards
    (:func:`pdsweep.results.shards.merged_view`; ``UserError`` when they are not one run's shards)."""
    return merged_view(dirs if isinstance(dirs, list) else [dirs])


def no_check_argv_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--no-check-argv",
        action="store_true",
        help="skip parsing each instance's vllm serve argv with the installed vLLM's CLI classes",
    )


def check_outputs(*named: tuple[str, Path]) -> None:
    """Raise ``UserError`` when two outputs are one file or one cannot be written
    (:func:`pdsweep.results.layout.check_writable`), before any work starts."""
    seen: dict[Path, str] = {}
    for flag, path in named:
        key = layout.resolved(Path(path))
        if key in seen:
            raise UserError(f"{flag} {path} is the same file as {seen[key]}: one would overwrite the other")
        seen[key] = f"{flag} {path}"
        layout.check_writable(Path(path))


def write_and_show(write: Callable[[], Path], verdict: str) -> None:
    """Run ``write`` (it writes a command's outputs and returns the markdown one) and
    print that file; when writing fails, print ``verdict`` on stderr first, so the
    verdict is never lost to a full disk, then re-raise."""
    try:
        print(Path(write()).read_text())
    except BaseException:
        print(verdict, file=sys.stderr)
        raise


def default_history() -> Path:
    """``$PDSWEEP_HISTORY``, else ``results/history.sqlite`` in the checkout."""
    env = os.environ.get("PDSWEEP_HISTORY")
    return Path(env) if env else REPO / "results" / "history.sqlite"


def append_history(db: Path, run_dir: Path) -> None:
    """Append a finished run to the history; a store that cannot take it is a warning
    (the run's own results are complete either way)."""
    try:
        add_run(db, run_dir)
    except (UserError, OSError) as e:
        print(f"warning: run not added to the history {db}: {e}", file=sys.stderr)
