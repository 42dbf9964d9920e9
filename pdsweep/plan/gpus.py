"""This host's GPUs as ``nvidia-smi`` reports them: index, UUID, compute capability,
memory, driver, and the compute processes already holding each GPU.

Queried once per call with the CSV interface (``--format=csv,noheader,nounits``; memory
in MiB). A GPU with a compute process that pdsweep did not start is *busy*: the scheduler
(:func:`pdsweep.plan.schedule.detect_gpus`) never hands it out.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass, field

from pdsweep.core.errors import UserError

log = logging.getLogger(__name__)

# nvidia-smi's memory.used is what contexts hold; the driver's and firmware's own share is memory.reserved
# (free = total - reserved - used; ~500 MiB to 1.5 GiB per GPU on an idle node, so total - free is no
# measure of use). An idle GPU shows a few MiB used (the fake node: 3 MiB); a CUDA context alone is
# ~500 MiB. More than this used with no compute process listed: someone nvidia-smi cannot see.
HIDDEN_MIB = 1024

GPU_FIELDS = (
    "index", "uuid", "name", "compute_cap", "memory.total", "memory.free", "memory.used", "memory.reserved",
    "driver_version",
)  # fmt: skip
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
    used_mib: int = 0  # nvidia-smi memory.used: held by contexts (the driver's reserve not counted), MiB
    reserved_mib: int = 0  # nvidia-smi memory.reserved: the driver's and firmware's own, MiB

    @property
    def busy(self) -> bool:
        """A compute process nvidia-smi lists holds this GPU (``--query-compute-apps``)."""
        return bool(self.apps)

    @property
    def hidden_use(self) -> bool:
        """Memory in contexts (nvidia-smi ``memory.used`` > :data:`HIDDEN_MIB`; the driver's
        ``memory.reserved`` is not use) while nvidia-smi lists no compute process on it: a process
        in another container's PID namespace (nvidia-smi cannot see it)."""
        return not self.apps and self.used_mib > HIDDEN_MIB

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
    for idx, uuid, name, cap, total, free, used, reserved, driver in gpus:
        mine = tuple(a for a in apps if a.gpu_uuid == uuid)
        out.append(Gpu(_int(idx), uuid, name, cap, _int(total), _int(free), driver, mine, _int(used), _int(reserved)))
    return Inventory(tuple(out), ignored_pids=frozenset(ignore_pids))


# The UCX switch that lets cuda_ipc serve GETs (vLLM's NixlConnector READs) on GPUs without NVLink,
# where UCX turns them off (openucx/ucx src/uct/cuda/cuda_ipc/cuda_ipc_iface.c
# uct_cuda_ipc_iface_get_max_get_zcopy) and the READs run over tcp. Measured on one H200
# (scripts/device-check.sh, docs/gpu-preflight.md): 0.06-0.68 GB/s tcp/lo, 15-31 GB/s cuda_ipc with it.
CUDA_IPC_GET_ENV = "UCX_CUDA_IPC_ENABLE_GET_ZCOPY"
CUDA_IPC_GET_OFF = (
    "UCX turns cuda_ipc GET off on GPUs without NVLink (cuda_ipc_iface.c "
    f'uct_cuda_ipc_iface_get_max_get_zcopy); add `ucx: {{{CUDA_IPC_GET_ENV}: "y"}}` to the sweep'
)


def nvlink_active(text: str) -> bool:
    """Whether ``nvidia-smi nvlink --status`` output (``text``) shows an active link: a line
    ``Link <n>: <x> GB/s``. Inactive links print ``<inactive>``; a GPU without NVLink prints
    nothing (seen on one H200 PCIe slot, 2026-12-04)."""
    return any(re.search(r"^\s*Link \d+: [\d.]+ GB/s", line) for line in text.splitlines())


def nvlink_status() -> str | None:
    """``nvidia-smi nvlink --status`` output, or None without nvidia-smi or when it fails."""
    exe = shutil.which("nvidia-smi")
    if not exe:
        return None
    try:
        r = subprocess.run([exe, "nvlink", "--status"], capture_output=True, text=True, timeout=30)
    except (subprocess.SubprocessError, OSError):
        return None
    return r.stdout if r.returncode == 0 else None


def free_gpu_ids(inv: Inventory | None = None, warn: bool = True) -> tuple[int, ...]:
    """Indices of the GPUs this run may use (:func:`visible`: the user's
    ``CUDA_VISIBLE_DEVICES``, no other process's); each one left out is logged as a warning
    (:meth:`Gpu.busy_text`)."""
    inv = inv or inventory()
    gpus, lines = visible(inv)
    for line in lines if warn else ():
        log.warning("%s", line)
    return tuple(g.index for g in gpus)


def _cuda_index_order_problem(gpus: tuple[Gpu, ...], order: str) -> str | None:
    """Why integer ``CUDA_VISIBLE_DEVICES`` indices may not mean nvidia-smi's indices, or None.
    CUDA numbers devices fastest first unless ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` (CUDA C
    Programming Guide, "CUDA Environment Variables"); nvidia-smi numbers them in PCI bus
    order. Among identical GPUs both orders agree (ties go by PCI bus id)."""
    if order == "PCI_BUS_ID" or len({(g.name, g.compute_cap) for g in gpus}) <= 1:
        return None
    return (
        "CUDA_VISIBLE_DEVICES lists indices on a host with different GPU models and CUDA_DEVICE_ORDER is "
        f"{order or 'unset (FASTEST_FIRST)'}: CUDA's indices are then not nvidia-smi's; export "
        "CUDA_DEVICE_ORDER=PCI_BUS_ID or list GPU UUIDs (nvidia-smi -L)"
    )


def visible(inv: Inventory, env: Mapping[str, str] | None = None) -> tuple[tuple[Gpu, ...], list[str]]:
    """The GPUs of ``inv`` this run may use, and one line per GPU left out.

    ``CUDA_VISIBLE_DEVICES`` (when set) is the user's set: comma-separated nvidia-smi
    indices, or GPU UUIDs (``GPU-...``, a unique prefix is enough, as CUDA accepts); an
    empty value means no GPU. Integer indices follow ``CUDA_DEVICE_ORDER`` (see
    :func:`_cuda_index_order_problem`). Each instance later gets its share as nvidia-smi
    indices with ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` (:func:`pdsweep.plan.instance.instances`).
    Then GPUs a listed process holds (:meth:`Gpu.busy`) and GPUs whose memory is in use by
    a process nvidia-smi does not list (:meth:`Gpu.hidden_use`) are left out.

    Raises ``UserError`` naming ``CUDA_VISIBLE_DEVICES`` for an entry that is no GPU of this
    host, a MIG instance (``MIG-...``: pdsweep places whole GPUs; a TP group cannot span MIG
    instances, NCCL refuses), or ambiguous indices."""
    env = os.environ if env is None else env
    gpus, out = inv.gpus, []
    raw = env.get("CUDA_VISIBLE_DEVICES")
    if raw is not None and gpus:
        entries = [x.strip() for x in raw.split(",") if x.strip()]
        chosen: list[Gpu] = []
        for e in entries:
            if e.upper().startswith("MIG-"):
                raise UserError(
                    f"CUDA_VISIBLE_DEVICES={raw}: {e} is a MIG instance; pdsweep places whole GPUs (a TP group "
                    "cannot span MIG instances): give whole GPUs as indices or GPU-... UUIDs (nvidia-smi -L)"
                )
            if e.isdigit():
                if problem := _cuda_index_order_problem(gpus, env.get("CUDA_DEVICE_ORDER", "")):
                    raise UserError(problem)
                hit = [g for g in gpus if g.index == int(e)]
            else:
                hit = [g for g in gpus if g.uuid.startswith(e if e.upper().startswith("GPU-") else f"GPU-{e}")]
            if len(hit) != 1:
                listed = ", ".join(f"{g.index} ({g.uuid})" for g in gpus)
                raise UserError(
                    f"CUDA_VISIBLE_DEVICES={raw}: {e!r} is {'ambiguous' if hit else 'not a GPU of this host'}; "
                    f"allowed: nvidia-smi indices or GPU UUIDs: {listed}"
                )
            if hit[0] not in chosen:
                chosen.append(hit[0])
        out += [
            f"GPU {g.index} ({g.uuid}) is not in CUDA_VISIBLE_DEVICES={raw}: left out" for g in gpus if g not in chosen
        ]
        gpus = tuple(chosen)
    for g in gpus:
        if g.busy:
            out.append(f"{g.busy_text()}: left out of this run")
        elif g.hidden_use:
            out.append(
                f"GPU {g.index} ({g.uuid}) has {g.used_mib} MiB in use by a process nvidia-smi does not list "
                "(another container?): left out of this run"
            )
    return tuple(g for g in gpus if not g.busy and not g.hidden_use), out
