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
from pdsweep.results import layout


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
        key = Path(path).resolve()
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

    from pdsweep.core.paths import REPO

    env = os.environ.get("PDSWEEP_HISTORY")
    return Path(env) if env else REPO / "results" / "history.sqlite"


def append_history(db: Path, run_dir: Path) -> None:
    """Append a finished run to the history; a store that cannot take it is a warning
    (the run's own results are complete either way)."""
    from pdsweep.history.store import add_run

    try:
        add_run(db, run_dir)
    except (UserError, OSError) as e:
        print(f"warning: run not added to the history {db}: {e}", file=sys.stderr)
