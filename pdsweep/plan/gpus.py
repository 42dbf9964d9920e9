"""This host's GPUs as ``nvidia-smi`` reports them: index, UUID, compute capability,
memory, driver, and the compute processes already holding each GPU.

Queried once per call with the CSV interface (``--format=csv,noheader,nounits``; memory
in MiB). A GPU with a compute process that pdsweep did not start is *busy*: the scheduler
(:func:`pdsweep.plan.schedule.detect_gpus`) never hands it out.
"""

from __future__ import annotations

import logging
import shutil
import subprocess
from dataclasses import dataclass, field

log = logging.getLogger(__name__)

GPU_FIELDS = ("index", "uuid", "name", "compute_cap", "memory.total", "memory.free", "driver_version")
APP_FIELDS = ("pid", "process_name", "used_memory", "gpu_uuid")


@dataclass(frozen=True)
class ComputeApp:
    pid: int
    process_name: str
    used_mib: int
    gpu_uuid: str


@dataclass(frozen=True)
class Gpu:
    index: int
    uuid: str
    name: str
    compute_cap: str  # "9.0"
    total_mib: int
    free_mib: int
    driver: str  # "580.65.06"
    apps: tuple[ComputeApp, ...] = ()

    @property
    def busy(self) -> bool:
        return bool(self.apps)

    def busy_text(self) -> str:
        """``GPU 3 (GPU-...) is in use by pid 4242 python (20480 MiB)``."""
        who = ", ".join(f"pid {a.pid} {a.process_name} ({a.used_mib} MiB)" for a in self.apps)
        return f"GPU {self.index} ({self.uuid}) is in use by {who}"


@dataclass(frozen=True)
class Inventory:
    gpus: tuple[Gpu, ...] = ()
    error: str | None = None  # nvidia-smi present but failed: the message
    ignored_pids: frozenset[int] = field(default_factory=frozenset)

    @property
    def free(self) -> tuple[Gpu, ...]:
        return tuple(g for g in self.gpus if not g.busy)

    @property
    def driver(self) -> str | None:
        return self.gpus[0].driver if self.gpus else None


def _csv(exe: str, query: str, fields: tuple[str, ...]) -> list[list[str]]:
    out = subprocess.run(
        [exe, f"--query-{query}={','.join(fields)}", "--format=csv,noheader,nounits"],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    ).stdout
    rows = [[x.strip() for x in line.split(",")] for line in out.splitlines() if line.strip()]
    for r in rows:
        if len(r) != len(fields):
            raise ValueError(f"nvidia-smi --query-{query}: {len(r)} fields in {r!r}, expected {len(fields)}")
    return rows


def _int(text: str) -> int:
    """MiB or pid; nvidia-smi prints ``[N/A]`` where a value is unknown (0 then)."""
    return int(text) if text.isdigit() else 0


def inventory(ignore_pids: frozenset[int] | set[int] = frozenset()) -> Inventory:
    """The GPUs ``nvidia-smi`` lists with their compute processes (``ignore_pids``: ours,
    not counted as busy). No ``nvidia-smi``: an empty inventory; one that fails (driver
    not loaded) or prints something else: empty, with ``error`` set."""
    exe = shutil.which("nvidia-smi")
    if not exe:
        return Inventory()
    try:
        gpus = _csv(exe, "gpu", GPU_FIELDS)
        apps = [
            ComputeApp(_int(pid), name, _int(mib), uuid)
            for pid, name, mib, uuid in _csv(exe, "compute-apps", APP_FIELDS)
            if _int(pid) not in ignore_pids
        ]
    except (subprocess.SubprocessError, OSError, ValueError) as e:
        return Inventory(error=f"nvidia-smi failed: {e}")
    out = []
    for idx, uuid, name, cap, total, free, driver in gpus:
        mine = tuple(a for a in apps if a.gpu_uuid == uuid)
        out.append(Gpu(_int(idx), uuid, name, cap, _int(total), _int(free), driver, mine))
    return Inventory(tuple(out), ignored_pids=frozenset(ignore_pids))


def free_gpu_ids(inv: Inventory | None = None, warn: bool = True) -> tuple[int, ...]:
    """Indices of the GPUs no other process holds; each busy one logged as a warning
    naming the process (:meth:`Gpu.busy_text`)."""
    inv = inv or inventory()
    for g in inv.gpus:
        if g.busy and warn:
            log.warning("%s: not used by this run", g.busy_text())
    return tuple(g.index for g in inv.free)
