"""Start and stop one serving instance. One small interface, so Slurm or Kubernetes
launchers can be added without touching planning, measuring or gating.

The local launcher puts every instance in its own session and process group
(``start_new_session=True``) and only ever signals process groups it created itself:
it never matches processes by name (upstream's ``pkill -f "vllm serve"`` kills every
vLLM on the host).
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import psutil

log = logging.getLogger(__name__)


@dataclass
class Handle:
    """A started instance: what the measuring stages need to reach it."""

    name: str
    pid: int
    port: int
    log_path: Path
    ports: tuple[int, ...] = ()
    proc: subprocess.Popen | None = field(default=None, repr=False)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def returncode(self) -> int | None:
        """None while running, else the exit code."""
        return self.proc.poll() if self.proc else None

    def alive(self) -> bool:
        return self.returncode() is None


class Launcher(Protocol):
    def start(self, name: str, argv: list[str], env: dict[str, str], port: int, log_path: Path,
              ports: tuple[int, ...] = ()) -> Handle: ...

    def stop(self, handle: Handle, grace_s: float = 20.0) -> None: ...


def tail(path: Path, n: int = 50) -> list[str]:
    """Last ``n`` lines of a log file (empty list if absent)."""
    try:
        with open(path, errors="replace") as f:
            return [line.rstrip("\n") for line in deque(f, maxlen=n)]
    except OSError:
        return []


def port_free(port: int, host: str = "127.0.0.1") -> bool:
    """True when nothing listens on ``host:port`` and it can be bound now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def group_members(pgid: int) -> list[psutil.Process]:
    """Live processes whose process group is ``pgid`` (ours: we created the group)."""
    out = []
    for p in psutil.process_iter(["pid"]):
        try:
            if os.getpgid(p.pid) == pgid and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except (ProcessLookupError, psutil.Error, OSError):
            continue
    return out


def gpu_pids() -> set[int] | None:
    """PIDs holding a GPU context (``nvidia-smi --query-compute-apps``); None without nvidia-smi."""
    import shutil

    exe = shutil.which("nvidia-smi")
    if not exe:
        return None
    try:
        out = subprocess.run([exe, "--query-compute-apps=pid", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=30, check=True).stdout
    except (subprocess.SubprocessError, OSError):
        return None
    return {int(x) for x in out.split() if x.strip().isdigit()}


def wait_gpus_released(pids: set[int], timeout_s: float = 60.0) -> bool:
    """Wait until none of ``pids`` (processes we started) holds a GPU context, so the next
    cell can take the GPUs. True when released (or no nvidia-smi), False on timeout."""
    deadline = time.monotonic() + timeout_s
    while True:
        held = gpu_pids()
        if held is None or not (held & pids):
            return True
        if time.monotonic() > deadline:
            log.warning("GPU contexts of pids %s still present after %.0f s", sorted(held & pids), timeout_s)
            return False
        time.sleep(0.5)


class LocalLauncher:
    """Instances as local child processes, each leading its own process group."""

    def __init__(self) -> None:
        self._groups: set[int] = set()
        self._lock = threading.Lock()

    def start(self, name: str, argv: list[str], env: dict[str, str], port: int, log_path: Path,
              ports: tuple[int, ...] = ()) -> Handle:
        """Start ``argv`` (a list, never a shell string) with ``os.environ | env``,
        stdout+stderr to ``log_path``. Raises ``OSError`` if the program cannot start."""
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(log_path, "ab") as out:
            proc = subprocess.Popen(argv, env={**os.environ, **env}, stdout=out, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=True)
        with self._lock:
            self._groups.add(proc.pid)  # session leader: pgid == pid
        log.info("started %s pid=%d port=%d", name, proc.pid, port)
        return Handle(name, proc.pid, port, log_path, ports or (port,), proc)

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
