"""Compatibility alias: the launchers moved to :mod:`pdsweep.launchers` (``local`` and
``slurm``). Kept so existing ``from pdsweep.launcher import ...`` keeps working."""

from .launchers import (LOOPBACK, Handle, Launcher, LocalLauncher, gpu_pids, group_members,  # noqa: F401
                        port_free, tail, wait_gpus_released)
