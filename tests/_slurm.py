"""A real Slurm cluster for tests, private to one test module: one slurmctld and two
slurmd on this host (nodes ``pdsweep-n1``, ``pdsweep-n2``, each ``slurmd -N NAME`` on its
own port, ``NodeAddr=127.0.0.1``), so prefill and decode steps run through different
slurmd as on two nodes (what differs on real nodes is only the network between them).

Debian's ``slurmctld``/``slurmd``/``munge`` (installed by ``.ci/run``; facts in
../shared/SLURM.md): a private ``munged`` (own key, socket, pid file), a minimal
``slurm.conf`` on free ports with ``ProctrackType=proctrack/linuxproc`` (no cgroups in
this sandbox) and ``TaskPlugin=task/none``, every daemon started here and stopped by the
PID in its pid file (never by name). Every client command needs ``SLURM_CONF``:
:attr:`Cluster.env` carries it.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

DAEMONS = ("munged", "slurmctld", "slurmd", "srun", "squeue", "scancel", "salloc", "scontrol")


def missing() -> list[str]:
    """Slurm/munge programs not on PATH (``/usr/sbin`` included)."""
    path = os.environ.get("PATH", "") + ":/usr/sbin:/sbin"
    return [p for p in DAEMONS if not shutil.which(p, path=path)]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


NODES = ("pdsweep-n1", "pdsweep-n2")
NODELIST = "pdsweep-n[1-2]"  # as Slurm writes SLURM_JOB_NODELIST (expanded by scontrol)
NODE_ADDR = "127.0.0.1"


@dataclass
class Cluster:
    root: Path
    nodes: tuple[str, ...]
    env: dict[str, str]  # os.environ + SLURM_CONF (+ PATH with /usr/sbin)
    pidfiles: tuple[Path, ...]

    @property
    def node(self) -> str:
        return self.nodes[0]

    def run(self, *argv: str, timeout: float = 30, check: bool = True) -> subprocess.CompletedProcess:
        return subprocess.run(list(argv), env=self.env, capture_output=True, text=True, timeout=timeout, check=check)

    def salloc(self, name: str = "pdsweep-test") -> str:
        """A fresh allocation of every node (no shell); returns its job id."""
        out = self.run(
            "salloc", "--no-shell", f"-N{len(self.nodes)}", "--exclusive", "-J", name, "--immediate=30", timeout=60
        )
        for word in (out.stderr + out.stdout).replace(".", " ").split():
            if word.isdigit():
                return word
        raise RuntimeError(f"salloc gave no job id: {out.stderr}")

    def steps(self, job: str) -> list[str]:
        """``jobid.stepid name`` of every step of ``job`` squeue lists (extern/batch excluded)."""
        out = self.run("squeue", "--steps", "-j", job, "-h", "-o", "%i %j", check=False).stdout
        return [
            line.strip()
            for line in out.splitlines()
            if line.strip() and not line.split()[0].endswith((".extern", ".batch", ".interactive"))
        ]


def _conf(
    root: Path,
    host: str,
    cpus: int,
    ctld_port: int,
    munge_socket: Path,
    addrs: tuple[str, ...] = (),
    ctld_addr: str | None = None,
) -> str:
    """slurm.conf of the test cluster: node ``NODES[i]`` at ``addrs[i]`` (default
    :data:`NODE_ADDR` for every node), slurmctld at ``ctld_addr`` (default: ``host``)."""
    nodes = "\n".join(
        f"NodeName={n} NodeHostname={host} NodeAddr={addrs[i] if addrs else NODE_ADDR} Port={_free_port()} "
        f"CPUs={cpus} RealMemory=10000 State=UNKNOWN"
        for i, n in enumerate(NODES)
    )
    ctld = f"{host}({ctld_addr})" if ctld_addr else host
    return f"""ClusterName=pdsweep-test
SlurmctldHost={ctld}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={munge_socket}
CredType=cred/munge
SlurmctldPort={ctld_port}
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool/%n
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd-%n.pid
SlurmctldLogFile={root}/slurmctld.log
SlurmdLogFile={root}/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
ReturnToService=2
SchedulerType=sched/builtin
KillWait=5
InactiveLimit=0
{nodes}
PartitionName=debug Nodes={",".join(NODES)} Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO
"""


def _stop_pidfile(pidfile: Path, timeout_s: float = 15.0) -> None:
    """SIGTERM the PID written in ``pidfile`` (a daemon this fixture started), then SIGKILL."""
    try:
        pid = int(pidfile.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.1)
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


@contextlib.contextmanager
def cluster(
    root: Path,
    cpus: int | None = None,
    ready_timeout_s: float = 30.0,
    addrs: tuple[str, ...] = (),
    ctld_addr: str | None = None,
    prefixes: tuple[tuple[str, ...], ...] = (),
) -> Iterator[Cluster]:
    """Start munged, slurmctld and one slurmd per node under ``root`` (``cpus`` per node,
    default half the host's); yield a :class:`Cluster` once ``sinfo`` shows every node
    idle; stop the daemons by PID. With ``prefixes`` (tests/_netns.py: enter node ``i``'s
    namespaces) slurmd of ``NODES[i]`` runs in the foreground as ``prefixes[i] + [slurmd -D
    ...]``, a child of this process stopped by its PID here (the PID slurmd writes is one of
    its own PID namespace, never signalled), and is reached at ``addrs[i]``, slurmctld at
    ``ctld_addr``. Raises ``RuntimeError`` with the daemon logs when the cluster does not
    come up."""
    root.mkdir(parents=True, exist_ok=True)
    for d in ("state", "spool", "munge"):
        (root / d).mkdir(exist_ok=True)
    os.chmod(root / "munge", 0o700)
    host = socket.gethostname().split(".")[0]
    key = root / "munge" / "munge.key"
    key.write_bytes(os.urandom(1024))
    os.chmod(key, 0o400)
    msock = root / "munge" / "munge.socket"
    conf = root / "slurm.conf"
    conf.write_text(
        _conf(root, host, cpus or max(1, (os.cpu_count() or 2) // 2), _free_port(), msock, addrs, ctld_addr)
    )
    env = {**os.environ, "SLURM_CONF": str(conf), "PATH": os.environ.get("PATH", "") + ":/usr/sbin:/sbin"}
    for k in [k for k in env if k.startswith("SLURM_") and k != "SLURM_CONF"]:
        del env[k]  # an outer allocation must not leak into the private cluster
    slurmd_pids = () if prefixes else tuple(root / f"slurmd-{n}.pid" for n in NODES)
    pidfiles = (*slurmd_pids, root / "slurmctld.pid", root / "munge" / "munged.pid")
    children: list[subprocess.Popen] = []
    cl = Cluster(root, NODES, env, pidfiles)
    try:
        subprocess.run(
            [
                "munged",
                "--force",
                f"--socket={msock}",
                f"--key-file={key}",
                f"--pid-file={pidfiles[-1]}",
                f"--log-file={root / 'munge' / 'munged.log'}",
                f"--seed-file={root / 'munge' / 'munged.seed'}",
            ],
            env=env,
            check=True,
            timeout=20,
            capture_output=True,
        )
        subprocess.run(["slurmctld", "-f", str(conf)], env=env, check=True, timeout=20, capture_output=True)
        for i, n in enumerate(NODES):
            if prefixes:
                with open(root / f"slurmd-{n}.out", "ab") as out:
                    children.append(
                        subprocess.Popen(
                            [*prefixes[i], "slurmd", "-D", "-N", n, "-f", str(conf)],
                            env=env,
                            stdout=out,
                            stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL,
                        )
                    )
                continue
            subprocess.run(["slurmd", "-N", n, "-f", str(conf)], env=env, check=True, timeout=20, capture_output=True)
        deadline = time.monotonic() + ready_timeout_s
        while True:
            out = cl.run("sinfo", "-h", "-N", "-o", "%N %t", check=False, timeout=10)
            if out.returncode == 0 and out.stdout.count(" idle") == len(NODES):
                break
            if time.monotonic() > deadline:
                logs = "\n".join(f"--- {p.name}\n{p.read_text()[-2000:]}" for p in sorted(root.glob("slurm*.log")))
                raise RuntimeError(
                    f"slurm cluster not up after {ready_timeout_s:.0f} s: {out.stdout}{out.stderr}\n{logs}"
                )
            time.sleep(0.2)
        yield cl
    finally:
        for c in children:  # slurmd in namespaces of its own, stopped by our child's PID: `unshare --fork`
            c.kill()  # blocks SIGTERM while it waits, so SIGKILL; its --kill-child then SIGTERMs slurmd
            c.wait(timeout=10)
        for p in pidfiles:
            _stop_pidfile(p)


@pytest.fixture(scope="module")
def slurm_cluster(tmp_path_factory) -> Iterator[Cluster]:
    """A :func:`cluster` for one test module. Skipped without Slurm or root, unless
    ``PDSWEEP_REQUIRE_SLURM=1`` (``.ci/run``): then it fails."""
    gone = missing()
    if gone or os.geteuid() != 0:
        why = f"Slurm not usable here (missing: {gone}, uid {os.geteuid()})"
        if os.environ.get("PDSWEEP_REQUIRE_SLURM") == "1":
            pytest.fail(why + " but PDSWEEP_REQUIRE_SLURM=1")
        pytest.skip(why)
    with cluster(tmp_path_factory.mktemp("slurm")) as cl:
        yield cl


def allocation_env(cl: Cluster, job: str) -> dict[str, str]:
    """What a shell inside ``salloc`` sees (for commands run in allocation ``job``)."""
    return {**cl.env, "SLURM_JOB_ID": job, "SLURM_JOB_NODELIST": NODELIST}
