"""What one ``pdsweep run`` carries from cell to cell: the options it was started with
(:class:`RunOptions`, the flags of ``pdsweep run``) and the run's state (:class:`RunContext`),
shared by the sweep loop (:mod:`pdsweep.run.sweep`) and one cell's work (:mod:`pdsweep.run.cell`)."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pdsweep.core.faults import PROXY_OPTIONS, ProxyFaults
from pdsweep.deploy.launchers import Launcher, LocalLauncher
from pdsweep.deploy.portblocks import AltBlocks
from pdsweep.plan.expand import Plan
from pdsweep.run.progress import Progress
from pdsweep.sweepfile.sweep import LoadedSweep


@dataclass
class RunOptions:
    out: Path | None = None
    cells: str | None = None  # glob over cell ids
    gpus: int | None = None
    resume: bool = False
    quiet: bool = False
    drop_kv_transfer_params: bool = False  # test-only: decode recomputes (the transfer gate catches it)
    scramble_kv_block_ids: bool = False  # test-only: KV arrives wrong (the consistency probe catches it)
    scramble_every: int = 0  # test-only: 1 in k requests under concurrency KV arrives wrong (the load check)
    stale_kv_transfer_params: bool = False  # test-only: decode gets the previous request's KV handle
    decode_delay_s: float = 0.0  # test-only: the PD proxy sleeps before each decode leg (bench/test_perf_teeth.py)
    skip_eval: bool = False
    launcher: str = "local"  # local | slurm (job steps of the allocation we run in)
    gpus_per_node: int | None = None  # slurm: overrides SLURM_GPUS_ON_NODE
    reuse: bool = True  # share identical instances across cells (pdsweep.deploy.instances); False: --no-reuse
    prestart: bool = True  # with reuse: start the next cell's new instances while this one measures
    preflight: bool = True  # weights, memory fit, driver, busy GPUs (pdsweep.run.preflight); False: --no-preflight
    shard: Any = None  # pdsweep.plan.shards.Shard: job i of n (--shard i/n); None: the whole sweep
    durations_from: Any = None  # pdsweep.results.celltimes.RunDurations of --durations-from RUN_DIR; None: the model

    @property
    def faults(self) -> ProxyFaults:
        """The proxy's faults: the options named in :data:`pdsweep.core.faults.PROXY_OPTIONS`."""
        return ProxyFaults(**{name: getattr(self, name) for name in PROXY_OPTIONS})


@dataclass
class RunContext:
    ls: LoadedSweep
    plan: Plan
    run_dir: Path
    opts: RunOptions
    launcher: Launcher = field(default_factory=LocalLauncher)
    needs: Any = None  # pool.needs: why a cell does not fit (run.json reason)
    stop: threading.Event = field(default_factory=threading.Event)
    progress: Progress | None = None
    builds: dict[str, dict[str, Any]] = field(default_factory=dict)
    git_shas: list[str] = field(default_factory=list)  # every pdsweep commit that ran cells (resume)
    sweep_sha256: str = ""  # of the sweep file as loaded for this run
    git_sha: str | None = None  # this invocation's pdsweep commit (asked of git once)
    provider: Any = None  # pdsweep.deploy.instances.InstancePool (reuse) or Fresh (--no-reuse)
    alt: AltBlocks = field(default_factory=AltBlocks)  # alternate port blocks (lane ports taken)
    timings: dict[str, float] = field(default_factory=dict)  # run.json: judge_s, wall_s, ...
    unpaired: dict[str, str] = field(default_factory=dict)  # bench.pair_builds: cell id -> why it runs alone
