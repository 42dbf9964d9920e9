"""Launchers: how an instance is started and stopped. ``local`` (child processes of
this host) and ``slurm`` (job steps inside an allocation) share one interface
(:class:`~pdsweep.deploy.launchers.base.Launcher`), so planning, measuring and gating never
know which one ran a cell."""

from __future__ import annotations

from pdsweep.core.errors import UserError
from pdsweep.deploy.launchers.base import (
    LOOPBACK,
    Handle,
    Launcher,
    gpu_pids,
    group_members,
    port_free,
    tail,
    wait_gpus_released,
)
from pdsweep.deploy.launchers.local import LocalLauncher
from pdsweep.deploy.launchers.slurm import SlurmLauncher

LAUNCHERS = ("local", "slurm")


def make_launcher(name: str) -> Launcher:
    """A launcher by name. Raises ``UserError`` for an unknown name, or (slurm) outside
    an allocation."""
    if name == "local":
        return LocalLauncher()
    if name == "slurm":
        return SlurmLauncher()
    raise UserError(f"--launcher: unknown launcher {name!r}; allowed: {', '.join(LAUNCHERS)}")


__all__ = [
    "LAUNCHERS",
    "LOOPBACK",
    "Handle",
    "Launcher",
    "LocalLauncher",
    "gpu_pids",
    "group_members",
    "make_launcher",
    "port_free",
    "tail",
    "wait_gpus_released",
]
