"""What every launcher shares: the :class:`Handle` of a started instance, the
:class:`Launcher` interface, and small helpers (log tail, port and GPU checks).

A launcher starts one instance (an argv list, never a shell string) with extra
environment and a log file, stops it, and stops everything it started (``kill_all``,
from signal handlers). It never signals or cancels anything it did not start.
"""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import time
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import psutil

log = logging.getLogger(__name__)


LOOPBACK = "127.0.0.1"


def own_group() -> dict[str, Any]:
    """``subprocess.Popen`` keywords for every process pdsweep starts on this host: a process
    group of its own (pgid == pid, so teardown signals exactly that group) in pdsweep's own
    session (Python 3.11 ``process_group=0``; ``os.setpgrp`` before exec on 3.10).

    Not a new session (``start_new_session``): with ``kernel.sched_autogroup_enabled=1``
    (the default of most distributions) each session is a scheduler group of its own, and
    on a 2-core host a prefill's group, whose NIXL progress thread spins on a UCX TCP
    endpoint waiting for the decode's ACK, held the core the decode shares for seconds to
    minutes while the decode's runnable threads got no CPU: the P TP 2 -> D TP 1 stall
    (tests/fixtures/vllm_cpu/NOTES.md, "session 33")."""
    if sys.version_info >= (3, 11):
        return {"process_group": 0}
    return {"preexec_fn": os.setpgrp}


@dataclass
class Handle:
    """A started instance: what the measuring stages need to reach it. ``host`` is the
    address it serves on (the node's hostname under Slurm); ``step`` the Slurm step id
    (``JOB.STEP``) once known, else None."""

    name: str
    pid: int
    port: int
    log_path: Path
    ports: tuple[int, ...] = ()
    proc: subprocess.Popen | None = field(default=None, repr=False)
    host: str = LOOPBACK
    step: str | None = None
    node: str | None = None  # Slurm node name
    log_start: int = 0  # bytes of log_path written before this process: a redeploy appends to the same file

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def where(self) -> str:
        """``[node ]host:port`` plus the Slurm step when there is one (for error messages)."""
        node = f"{self.node} " if self.node and self.node != self.host else ""
        return f"{node}{self.host}:{self.port}" + (f" (step {self.step})" if self.step else "")

    def returncode(self) -> int | None:
        """None while running, else the exit code (under Slurm: srun's, which is the step's)."""
        return self.proc.poll() if self.proc else None

    def alive(self) -> bool:
        return self.returncode() is None


@dataclass(frozen=True)
class LaunchRequest:
    """One instance to start: ``argv`` (a list, never a shell string) with ``os.environ |
    env``, stdout+stderr appended to ``log_path``; it serves on ``port`` (``ports``: every
    port it binds, default ``(port,)``) at ``host``, on Slurm node ``node`` (None: the
    launcher's default; the local launcher takes only loopback and no node)."""

    name: str
    argv: Sequence[str]
    env: Mapping[str, str]
    port: int
    log_path: Path
    ports: tuple[int, ...] = ()
    host: str = LOOPBACK
    node: str | None = None


def popen_logged(
    argv: Sequence[str], env: Mapping[str, str], log_path: Path, **popen: Any
) -> tuple[subprocess.Popen[bytes], int]:
    """Start ``argv`` with ``os.environ | env``, stdout+stderr appended to ``log_path`` (its
    parent created), stdin closed; ``popen``: further ``subprocess.Popen`` keywords (process
    group or session). Returns (the ``Popen``, bytes of the log written before: an instance
    restarted in one run appends to its log). Raises ``OSError`` if the program cannot start."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as out:
        start = out.tell()
        proc = subprocess.Popen(
            list(argv),
            env={**os.environ, **env},
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            **popen,
        )
    return proc, start


class Launcher(Protocol):
    """Start/stop instances (:class:`LaunchRequest`: ``host`` is the address the instance
    serves on, ``node`` the Slurm node it must run on) on ``nodes`` (none: this host only),
    reached at ``addrs`` (node -> address), ``gpus_per_node`` GPUs each (0: not known)."""

    @property
    def nodes(self) -> Sequence[str]: ...

    @property
    def addrs(self) -> Mapping[str, str]: ...

    @property
    def gpus_per_node(self) -> int: ...

    def start(self, req: LaunchRequest) -> Handle: ...

    def stop(self, handle: Handle, grace_s: float = 20.0) -> None: ...

    def kill_all(self) -> None: ...


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
        out = subprocess.run(
            [exe, "--query-compute-apps=pid", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        ).stdout
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
