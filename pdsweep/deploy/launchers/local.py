"""The local launcher: every instance a child process leading its own process group, in
pdsweep's session (:func:`pdsweep.deploy.launchers.base.own_group`: one scheduler
autogroup for the whole sweep). It only ever signals process groups it created
itself: it never matches processes by name (upstream's ``pkill -f "vllm serve"`` kills
every vLLM on the host).
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import threading
import time

import psutil

from pdsweep.deploy.launchers.base import (
    LOOPBACK,
    Handle,
    LaunchRequest,
    group_members,
    own_group,
    popen_logged,
    port_free,
    wait_gpus_released,
)

log = logging.getLogger(__name__)


class LocalLauncher:
    """Instances as local child processes, each leading its own process group."""

    def __init__(self) -> None:
        self.nodes: tuple[str, ...] = ()  # this host only
        self.addrs: dict[str, str] = {}
        self.gpus_per_node = 0
        self._groups: set[int] = set()
        self._lock = threading.Lock()

    def start(self, req: LaunchRequest) -> Handle:
        """Start ``req.argv`` (:func:`~pdsweep.deploy.launchers.base.popen_logged`) leading its
        own process group. Raises ``OSError`` if the program cannot start, ``ValueError`` for a
        ``host`` other than loopback or a ``node`` (use the slurm launcher)."""
        if req.host not in (LOOPBACK, "localhost") or req.node:
            raise ValueError(f"{req.name}: the local launcher runs on this host only, not on {req.node or req.host!r}")
        proc, start = popen_logged(req.argv, req.env, req.log_path, **own_group())
        with self._lock:
            self._groups.add(proc.pid)  # group leader: pgid == pid
        log.info("started %s pid=%d port=%d", req.name, proc.pid, req.port)
        return Handle(req.name, proc.pid, req.port, req.log_path, req.ports or (req.port,), proc, log_start=start)

    def stop(self, handle: Handle, grace_s: float = 20.0) -> None:
        """SIGTERM the instance's process group, wait ``grace_s``, SIGKILL what is left,
        reap, then wait (bounded) until its ports are free."""
        pgid = handle.pid
        with self._lock:
            if pgid not in self._groups:
                return  # not ours, or already stopped: never signal it
        try:  # descendants that left our group (setsid) are still ours: they descend from our child
            strays = [c for c in psutil.Process(pgid).children(recursive=True)]
        except psutil.Error:
            strays = []
        pids = {pgid} | {p.pid for p in strays} | {p.pid for p in group_members(pgid)}
        self._signal(pgid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and group_members(pgid):
            if handle.proc:
                try:
                    handle.proc.wait(timeout=0.2)
                except subprocess.TimeoutExpired:
                    pass
            else:
                time.sleep(0.2)
        if group_members(pgid):
            log.warning("%s: process group %d still alive after %.0f s, SIGKILL", handle.name, pgid, grace_s)
            self._signal(pgid, signal.SIGKILL)
            psutil.wait_procs(group_members(pgid), timeout=10)
        for p in strays:
            try:
                if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                    p.kill()
            except psutil.Error:
                pass
        if handle.proc:
            try:
                handle.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
        with self._lock:
            self._groups.discard(pgid)
        wait_gpus_released(pids)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not all(port_free(p) for p in handle.ports):
            time.sleep(0.1)

    def kill_all(self) -> None:
        """SIGKILL every process group this launcher started (signal handlers, atexit)."""
        with self._lock:
            groups = list(self._groups)
        for pgid in groups:
            self._signal(pgid, signal.SIGKILL)
        for pgid in groups:
            psutil.wait_procs(group_members(pgid), timeout=10)
        with self._lock:
            self._groups.clear()

    @staticmethod
    def _signal(pgid: int, sig: int) -> None:
        try:
            os.killpg(pgid, sig)
        except (ProcessLookupError, PermissionError):
            pass
