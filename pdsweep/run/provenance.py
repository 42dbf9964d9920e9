"""Facts recorded with every run and cell: the pdsweep commit, the host, the time, and
the configuration hash that lines cells of two runs up (``pdsweep compare``)."""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import os
import platform
import subprocess
from typing import Any

from pdsweep.core.paths import REPO
from pdsweep.plan.expand import Cell
from pdsweep.sweepfile.sweep import LoadedSweep


def git_sha() -> str | None:
    """HEAD of the pdsweep checkout, or None outside git (asked once per run)."""
    try:
        return subprocess.run(
            ["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10, check=True
        ).stdout.strip()
    except (subprocess.SubprocessError, OSError):
        return None


def host_facts(num_gpus: int) -> dict[str, Any]:
    return {
        "hostname": platform.node(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "gpus": num_gpus,
    }


def config_hash(ls: LoadedSweep, cell: Cell) -> str:
    """Hash of everything that defines a cell except its build and its expectation (compare:
    'not comparable'): an unfixed cell expected to fail still compares with its fixed twin."""
    d = {
        k: v
        for k, v in cell.to_dict().items()
        if k
        not in (
            "id",
            "build",
            "expect_fail",
            "expect_reason",
            "expect_ref",
            "expect_match",
            "expect_vllm",
            "expect_without",
            "expect_note",
        )
    }
    d["model"] = ls.catalogue.models[cell.model].model_dump()
    d["serve"] = ls.sweep.serve_variant(cell.serve_args).model_dump()
    d["env"] = ls.sweep.env[cell.env]
    d["defaults"] = ls.sweep.defaults.model_dump(exclude={"build", "port_base"})
    d["eval"] = ls.sweep.eval.model_dump()
    if ls.sweep.bench.enabled:  # the load workloads define what the cell measured (sweeps without load keep their hash)
        d["load"] = {"workloads": [w.model_dump() for w in ls.sweep.bench.workloads], "check": ls.sweep.bench.check}
    return hashlib.sha256(json.dumps(d, sort_keys=True, default=str).encode()).hexdigest()[:16]


def now() -> str:
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
