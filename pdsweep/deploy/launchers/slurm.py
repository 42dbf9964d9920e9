"""The Slurm launcher: every instance one job step of the allocation pdsweep runs in.

Each instance is ``srun --jobid=$SLURM_JOB_ID --overlap -N1 -n1 --nodelist=NODE
--job-name=pdsweep.<pid>.<n>.<instance> ARGV`` (no shell), started from this host; srun's
stdout/stderr are the instance's log, srun's exit code is the step's. Why a step with
``--overlap`` and not ``--exact`` (or one ``sbatch`` per cell):

- pdsweep already placed the cell (:mod:`pdsweep.plan.placement`: TP group within one node,
  disjoint GPUs per concurrent cell, ``CUDA_VISIBLE_DEVICES`` per instance). A step that
  asks Slurm for exclusive resources (``--exact``) *waits* while any other step holds them
  ("Step creation temporarily disabled, retrying"), which reads as a startup timeout; with
  ``--overlap`` step creation never waits on our other steps.
- a step lives inside the allocation: no queue wait per cell, and the allocation's owner
  keeps it (one ``sbatch`` per cell would queue every cell behind other users' jobs).

Teardown is ``scancel JOB.STEP`` of that step only (Slurm signals the step's whole
process tree on its node: SIGTERM, then SIGKILL after ``KillWait``), never the job and
never a step we did not start: steps are found by the unique name given at start.
"""

from __future__ import annotations

import itertools
import logging
import os
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Mapping

from pdsweep.core.errors import UserError
from pdsweep.deploy.launchers.base import LOOPBACK, Handle, LaunchRequest, popen_logged

log = logging.getLogger(__name__)

STEP_LOOKUP_S = 0.2  # squeue poll interval while waiting for a step id


def _tool(name: str) -> str:
    exe = shutil.which(name)
    if not exe:
        raise UserError(f"--launcher slurm: {name} not found on PATH (install slurm-client)")
    return exe


def expand_nodelist(nodelist: str) -> list[str]:
    """``SLURM_JOB_NODELIST`` (e.g. ``gpu[01-02]``) as host names, via ``scontrol show
    hostnames`` (Slurm's own parser). Raises ``UserError`` when scontrol fails."""
    try:
        out = subprocess.run(
            [_tool("scontrol"), "show", "hostnames", nodelist], capture_output=True, text=True, timeout=30, check=True
        ).stdout
    except (subprocess.SubprocessError, OSError) as e:
        raise UserError(f"--launcher slurm: cannot expand SLURM_JOB_NODELIST={nodelist!r}: {e}") from None
    return [h for h in out.split() if h]


def node_addrs(nodes: list[str]) -> dict[str, str]:
    """``{node name: NodeAddr}`` from ``scontrol -o show node`` (the address slurmctld
    reaches the node at; the name itself where scontrol gives none)."""
    addrs = {n: n for n in nodes}
    if not nodes:
        return addrs
    try:
        out = subprocess.run(
            [_tool("scontrol"), "-o", "show", "node", ",".join(nodes)],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        ).stdout
    except (subprocess.SubprocessError, OSError) as e:
        log.warning("scontrol show node failed (%s): using node names as addresses", e)
        return addrs
    for line in out.splitlines():
        kv = dict(w.split("=", 1) for w in line.split() if "=" in w)
        if kv.get("NodeName") in addrs and kv.get("NodeAddr"):
            addrs[kv["NodeName"]] = kv["NodeAddr"]
    return addrs


def allocation(environ: dict[str, str] | None = None) -> tuple[str, list[str], int]:
    """``(job id, node names, GPUs per node)`` of the allocation we run in, from
    ``SLURM_JOB_ID``, ``SLURM_JOB_NODELIST`` and ``SLURM_GPUS_ON_NODE`` (0 when unset).
    Raises ``UserError`` outside an allocation."""
    env = os.environ if environ is None else environ
    job = env.get("SLURM_JOB_ID")
    if not job:
        raise UserError("--launcher slurm runs inside a Slurm allocation (salloc or sbatch): SLURM_JOB_ID is unset")
    nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    if not nodelist:
        raise UserError(f"--launcher slurm: job {job}: SLURM_JOB_NODELIST is unset")
    gpus = env.get("SLURM_GPUS_ON_NODE", "0")
    if not gpus.isdigit():
        raise UserError(f"--launcher slurm: SLURM_GPUS_ON_NODE={gpus!r} is not a number of GPUs")
    return job, expand_nodelist(nodelist), int(gpus)


def bound_cores(env: Mapping[str, str]) -> frozenset[int]:
    """The cores of ``VLLM_CPU_OMP_THREADS_BIND`` in ``env`` (vLLM's CPU worker format: one
    entry per rank joined by ``|``, each a list of ``N`` or ``A-B`` joined by ``,``; vllm
    ``v1/worker/cpu_worker.py``), empty when unset or not such a list (``auto``, ``nobind``)."""
    out: set[int] = set()
    for part in env.get("VLLM_CPU_OMP_THREADS_BIND", "").replace("|", ",").split(","):
        lo, _, hi = part.strip().partition("-")
        if not (lo.isdigit() and (hi.isdigit() or not hi)):
            return frozenset()
        out.update(range(int(lo), int(hi or lo) + 1))
    return frozenset(out)


def shared_cores(name: str, node: str, cores: frozenset[int], live: Mapping[str, tuple[str, frozenset[int]]]) -> str:
    """Why starting instance ``name`` on ``node`` bound to ``cores`` next to our ``live``
    steps (``{instance: (node, cores)}``) risks a stall, or ``""``. Each srun step runs in a
    session of its own (slurmstepd's) and often a cpu cgroup of its own (Slurm's cgroup/v2
    enables every available controller at job and step level, src/plugins/cgroup/v2/
    cgroup_v2.c), so each is a scheduler group of its own: the step's cgroup, or, in the root
    cpu cgroup with ``kernel.sched_autogroup_enabled=1``, its session's autogroup
    (kernel/sched/autogroup.h ``autogroup_task_group``). Instances sharing a core in separate
    groups are the P TP 2 -> D TP 1 stall of docs/slurm.md (tests/fixtures/vllm_cpu/NOTES.md,
    "session 33"); the local launcher keeps every instance in one session, srun cannot."""
    clash = sorted(
        f"{other} on cores {','.join(map(str, sorted(c & cores)))}"
        for other, (n, c) in live.items()
        if n == node and c & cores
    )
    if not clash:
        return ""
    return (
        f"{name} shares node {node} with {'; '.join(clash)}: separate Slurm steps run in separate scheduler "
        "groups (an autogroup or a cpu cgroup each), where a NIXL progress thread spinning in one step held a "
        "shared core from the other for minutes (the P TP 2 -> D TP 1 stall, docs/slurm.md); give the cell "
        "disjoint cores (nodes with more cores, or prefill and decode on different nodes)"
    )


class SlurmLauncher:
    """Instances as job steps of allocation ``job_id`` (default ``$SLURM_JOB_ID``)."""

    def __init__(self, job_id: str | None = None, nodes: list[str] | None = None) -> None:
        self.gpus_per_node = 0
        if job_id is None:
            job_id, found, self.gpus_per_node = allocation()
            nodes = nodes or found
        self.job = job_id
        self.nodes = list(nodes or [])
        self.addrs = node_addrs(self.nodes)
        self.srun, self.squeue, self.scancel = _tool("srun"), _tool("squeue"), _tool("scancel")
        self._ours: dict[str, Handle] = {}  # step name -> handle: every step this launcher started
        self._cores: dict[str, frozenset[int]] = {}  # step name -> its VLLM_CPU_OMP_THREADS_BIND cores
        self._seq = itertools.count()
        self._lock = threading.Lock()

    def argv(self, step_name: str, node: str, argv: list[str], env: dict[str, str] | None = None) -> list[str]:
        """The srun command line of one instance (a list, never a shell string). With
        ``CUDA_VISIBLE_DEVICES`` in ``env`` the program runs under ``env
        CUDA_VISIBLE_DEVICES=...``: slurmstepd's gres/gpu plugin sets that variable for a
        step to the job's GPUs on the node, over the value srun exported, and pdsweep's
        placement (node-local ids of a whole-node allocation) must win."""
        cuda = (env or {}).get("CUDA_VISIBLE_DEVICES")
        pin = ["env", f"CUDA_VISIBLE_DEVICES={cuda}"] if cuda is not None else []
        return [
            self.srun,
            f"--jobid={self.job}",
            "--overlap",
            "-N1",
            "-n1",
            f"--nodelist={node}",
            f"--job-name={step_name}",
            "--kill-on-bad-exit=1",
            "--export=ALL",
            *pin,
            *argv,
        ]

    def start(self, req: LaunchRequest) -> Handle:
        """Start ``req.argv`` as a step on ``req.node`` (None: the allocation's first node) with
        ``os.environ | env`` (srun exports it); it is reached at ``req.host`` (loopback: the
        node's NodeAddr). Raises ``OSError`` if srun cannot start, ``ValueError`` for a
        node outside the allocation."""
        node = req.node or (self.nodes[0] if self.nodes else None)
        if node is None or (self.nodes and node not in self.nodes):
            raise ValueError(f"{req.name}: node {node!r} is not in allocation {self.job} ({','.join(self.nodes)})")
        host = self.addrs.get(node, node) if req.host in (LOOPBACK, "localhost") else req.host
        step_name = f"pdsweep.{os.getpid()}.{next(self._seq)}.{req.name}"
        srun = self.argv(step_name, node, list(req.argv), dict(req.env))
        cores = bound_cores(req.env)
        with self._lock:
            live = {h.name: (h.node or "", self._cores.get(n, frozenset())) for n, h in self._ours.items() if h.alive()}
        if why := shared_cores(req.name, node, cores, live):
            log.warning("%s", why)
        proc, start = popen_logged(srun, req.env, req.log_path, start_new_session=True)
        ports = req.ports or (req.port,)
        h = Handle(req.name, proc.pid, req.port, req.log_path, ports, proc, host=host, node=node, log_start=start)
        with self._lock:
            self._ours[step_name] = h
            self._cores[step_name] = cores
        threading.Thread(target=self._resolve, args=(step_name, h), daemon=True, name=f"step-{req.name}").start()
        log.info("started %s as step %s on %s (%s:%d)", req.name, step_name, node, host, req.port)
        return h

    def _resolve(self, step_name: str, h: Handle, timeout_s: float = 60.0) -> None:
        """Fill ``h.step`` (``JOB.STEP``) once squeue lists the step, for messages and logs."""
        deadline = time.monotonic() + timeout_s
        while h.step is None and h.alive() and time.monotonic() < deadline:
            step = self.steps().get(step_name)
            if step:
                h.step = step
                return
            time.sleep(STEP_LOOKUP_S)

    def steps(self) -> dict[str, str]:
        """``{step name: JOB.STEP}`` of this job's steps that squeue lists now, ours only."""
        try:
            out = subprocess.run(
                [self.squeue, "--steps", "-j", self.job, "-h", "-o", "%i %j"],
                capture_output=True,
                text=True,
                timeout=30,
            ).stdout
        except (subprocess.SubprocessError, OSError) as e:
            log.warning("squeue failed: %s", e)
            return {}
        found = {}
        for line in out.splitlines():
            parts = line.split(None, 1)
            if len(parts) == 2 and parts[1].strip() in self._ours:
                found[parts[1].strip()] = parts[0]
        return found

    def _name(self, handle: Handle) -> str | None:
        with self._lock:
            return next((n for n, h in self._ours.items() if h is handle), None)

    def stop(self, handle: Handle, grace_s: float = 20.0) -> None:
        """``scancel`` the handle's step (only it), wait up to ``grace_s`` for srun to end,
        then SIGKILL the step; a step never created is ended by stopping its srun."""
        name = self._name(handle)
        if name is None:
            return  # not ours, or already stopped
        step = self.steps().get(name)
        if step:
            handle.step = step
            self._scancel(step)
        elif handle.proc and handle.proc.poll() is None:  # step not created yet: end the pending srun
            self._signal_srun(handle, signal.SIGTERM)
        if not self._wait(handle, grace_s):
            log.warning("%s: step %s still running after %.0f s, SIGKILL", handle.name, step or name, grace_s)
            if step:
                self._scancel(step, "KILL")
            self._signal_srun(handle, signal.SIGKILL)
            self._wait(handle, 10)
        deadline = time.monotonic() + 10  # srun may end a moment before squeue forgets the step
        while time.monotonic() < deadline and name in self.steps():
            time.sleep(STEP_LOOKUP_S)
        with self._lock:
            self._ours.pop(name, None)
            self._cores.pop(name, None)

    def kill_all(self, timeout_s: float = 20.0) -> None:
        """Cancel every step this launcher started (signal handlers, end of run): ``scancel
        JOB.STEP`` of each, never the allocation; an srun still waiting for its step gets
        SIGTERM. Repeats until neither an srun of ours runs nor squeue lists a step of ours
        (a step created while we cancel is caught), SIGKILL after ``timeout_s``."""
        with self._lock:
            handles = dict(self._ours)
        deadline = time.monotonic() + timeout_s
        while handles:
            listed = self.steps()
            running = {n: h for n, h in handles.items() if h.alive()}
            if not listed and not running:
                break
            late = time.monotonic() > deadline
            for step in listed.values():
                self._scancel(step, "KILL" if late else None)
            for name, h in running.items():
                if name not in listed:
                    self._signal_srun(h, signal.SIGKILL if late else signal.SIGTERM)
            if late and time.monotonic() > deadline + 10:
                log.warning("steps %s still listed after %.0f s", sorted(listed.values()), timeout_s + 10)
                break
            time.sleep(0.5)
        with self._lock:
            for name in handles:
                self._ours.pop(name, None)
                self._cores.pop(name, None)

    def _scancel(self, step: str, sig: str | None = None) -> None:
        argv = [self.scancel, *([f"--signal={sig}"] if sig else []), step]
        try:
            subprocess.run(argv, capture_output=True, text=True, timeout=30)
        except (subprocess.SubprocessError, OSError) as e:
            log.warning("scancel %s failed: %s", step, e)

    @staticmethod
    def _signal_srun(h: Handle, sig: int) -> None:
        try:
            os.killpg(h.pid, sig)  # srun leads its own group (start_new_session): ours
        except (ProcessLookupError, PermissionError):
            pass

    @staticmethod
    def _wait(h: Handle, timeout_s: float) -> bool:
        if h.proc is None:
            return True
        try:
            h.proc.wait(timeout=timeout_s)
            return True
        except subprocess.TimeoutExpired:
            return False
