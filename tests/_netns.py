"""Two hosts on one machine: the test Slurm cluster of tests/_slurm.py with each slurmd in a
network namespace of its own (issue 39), so prefill and decode steps have separate network
stacks, addresses and interfaces, as on two nodes.

The test network (created here, deleted in teardown, nothing else is addressed):

- bridge ``pdsw-br39`` in the root namespace at ``10.231.39.1/24`` (slurmctld, srun, the
  proxy, lm-eval and pdsweep itself live there);
- per node ``i`` (1, 2): namespace ``pdsw-n{i}`` holding one end of a veth pair, device
  ``pdsw-n{i}`` at ``10.231.39.1{i}/24`` (its ``lo`` up: vLLM's own processes talk over it), the
  other end ``pdsw-n{i}h`` a port of the bridge.

Nodes reach each other and the root namespace over the bridge (layer 2: no routing, no
forwarding, no NAT). Unix sockets are files, so the one ``munged`` socket serves every
namespace. Teardown stops every daemon by PID (tests/_slurm.py), then kills any process
still in a namespace (``ip netns pids``: steps the daemons left), then deletes the namespaces
(which deletes their veth pairs) and the bridge; :func:`leftovers` says what is left.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from _slurm import NODES, Cluster, cluster, missing

PREFIX = "pdsw"
BRIDGE = "pdsw-br39"
CTLD_ADDR = "10.231.39.1"
PREFIXLEN = 24
NETNS = tuple(f"pdsw-n{i + 1}" for i in range(len(NODES)))  # namespace of NODES[i]
DEVICES = NETNS  # the veth end inside each namespace has the namespace's name
ADDRS = tuple(f"10.231.39.1{i + 1}" for i in range(len(NODES)))  # NodeAddr of NODES[i]
CPU_GROUP = "pdsw-39"  # cpu cgroup holding both slurmd and so every step (see cpu_group)


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30, check=check)


def usable() -> str | None:
    """Why two-namespace tests cannot run here (not root, no ``ip``, no Slurm), or None."""
    if os.geteuid() != 0:
        return f"network namespaces need root (uid {os.geteuid()})"
    if not shutil.which("ip"):
        return "iproute2's ip is not installed"
    gone = missing()
    return f"Slurm not usable here (missing: {gone})" if gone else None


def leftovers() -> list[str]:
    """Namespaces and links of ours (``pdsw`` names) that exist now."""
    ns = [line.split()[0] for line in _ip("netns", "list").stdout.splitlines() if line.strip()]
    links = [
        line.split(":")[1].strip().split("@")[0]
        for line in _ip("-o", "link", "show").stdout.splitlines()
        if line.count(":") >= 2
    ]
    ours = [n for n in ns + links if n == BRIDGE or n in NETNS or n in {f"{d}h" for d in DEVICES}]
    root = cpu_cgroup_root()
    return ours + ([str(root / CPU_GROUP)] if root and (root / CPU_GROUP).exists() else [])


def cpu_cgroup_root() -> Path | None:
    """Where a cgroup with the ``cpu`` controller can be made: cgroup v1's ``/sys/fs/cgroup/cpu``,
    or the v2 root when it already delegates ``cpu`` to its children; None otherwise."""
    v1 = Path("/sys/fs/cgroup/cpu")
    if (v1 / "cgroup.procs").exists() and (v1 / "cpu.shares").exists():
        return v1
    v2 = Path("/sys/fs/cgroup")
    with contextlib.suppress(OSError):
        if "cpu" in (v2 / "cgroup.subtree_control").read_text().split():
            return v2
    return None


def _ns_pids(namespaces: tuple[str, ...]) -> list[int]:
    present = _ip("netns", "list").stdout.split()
    return [int(p) for ns in namespaces if ns in present for p in _ip("netns", "pids", ns, check=False).stdout.split()]


def _kill_ns_pids(namespaces: tuple[str, ...], grace_s: float = 3.0) -> None:
    """SIGTERM every process in ``namespaces`` (only ours run there: the slurmd we started,
    PID 1 of its PID namespace, and what it left), SIGKILL what is left after ``grace_s``."""
    deadline, sig = time.monotonic() + grace_s, signal.SIGTERM
    while pids := _ns_pids(namespaces):
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        if time.monotonic() > deadline:
            if sig == signal.SIGKILL and time.monotonic() > deadline + 5:
                return
            sig = signal.SIGKILL
        time.sleep(0.1)


def _teardown(timeout_s: float = 10.0) -> None:
    """Kill what runs in our namespaces, delete veth pairs (both ends go with one), the
    namespaces and the bridge; wait until :func:`leftovers` is empty (the kernel frees a
    namespace's devices asynchronously)."""
    _kill_ns_pids(NETNS)
    for ns, dev in zip(NETNS, DEVICES):
        _ip("link", "del", f"{dev}h", check=False)
        _ip("netns", "del", ns, check=False)
    _ip("link", "del", BRIDGE, check=False)
    deadline = time.monotonic() + timeout_s
    group = (cpu_cgroup_root() or Path("/nonexistent")) / CPU_GROUP
    while group.exists() and time.monotonic() < deadline:  # EBUSY until its last task is gone
        with contextlib.suppress(OSError):
            group.rmdir()
        time.sleep(0.1)
    while leftovers() and time.monotonic() < deadline:
        time.sleep(0.2)


def running_under(root: Path) -> list[str]:
    """``PID cmdline`` of every process whose command line names ``root`` (the cluster's
    slurm.conf, munge socket and pid files live there: our daemons and their steps)."""
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
            except OSError:
                continue
            if str(root) in cmd:
                out.append(f"{d.name} {cmd}")
    return out


@contextlib.contextmanager
def testnet(cpu_group: bool = True) -> Iterator[Path | None]:
    """Create the bridge, namespaces and veth pairs above, and with ``cpu_group`` the cpu
    cgroup :data:`CPU_GROUP` (yielded; None without); delete them on exit (even on failure).
    Raises ``RuntimeError`` when something of ours already exists (another run of this test,
    or one that did not clean up: ``ip netns del pdsw-n1`` ...)."""
    if left := leftovers():
        raise RuntimeError(f"test network already present: {left} (another run, or a failed teardown)")
    group = None
    try:
        if cpu_group:
            root = cpu_cgroup_root()
            if root is None:
                raise RuntimeError("no cgroup with the cpu controller here (see tests/_netns.py cpu_group)")
            group = root / CPU_GROUP
            group.mkdir()
        _ip("link", "add", BRIDGE, "type", "bridge")
        _ip("addr", "add", f"{CTLD_ADDR}/{PREFIXLEN}", "dev", BRIDGE)
        _ip("link", "set", BRIDGE, "up")
        for ns, dev, addr in zip(NETNS, DEVICES, ADDRS):
            _ip("netns", "add", ns)
            _ip("link", "add", f"{dev}h", "type", "veth", "peer", "name", dev, "netns", ns)
            _ip("link", "set", f"{dev}h", "master", BRIDGE)
            _ip("link", "set", f"{dev}h", "up")
            _ip("-n", ns, "addr", "add", f"{addr}/{PREFIXLEN}", "dev", dev)
            _ip("-n", ns, "link", "set", dev, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
        yield group
    finally:
        _teardown()


# Run a program in a network namespace with a sysfs of that namespace and the host's cgroup
# mounts: UCX lists network devices from /sys/class/net (uct_tcp_query_devices), which shows
# the namespace of whoever mounted sysfs, so under a bare `nsenter --net` UCX saw the root
# namespace's devices and offered only tcp/lo; `ip netns exec` remounts /sys but loses
# /sys/fs/cgroup, without which slurmd 22.05 does not start ("Unable to initialize cgroup
# plugin"). $1: an empty directory to park the cgroup mounts in; the rest: the program.
_ENTER = (
    'mount --rbind /sys/fs/cgroup "$1" && mount -t sysfs sysfs /sys && mount --move "$1" /sys/fs/cgroup && '
    'shift && exec "$@"'
)


def in_group(group: Path | None) -> tuple[str, ...]:
    """Command prefix moving the program into cpu cgroup ``group`` before it execs (empty
    for None). Why (issue 39): each srun step runs in a session of its own (its slurmstepd's),
    and with ``kernel.sched_autogroup_enabled=1`` every session is a scheduler group of its
    own, the launch that stalled P TP 2 -> D TP 1 on one host (docs/cpu.md, "One scheduler
    group per sweep"). The two nodes here share the host's cores, which two real hosts never
    do; the kernel applies autogroups only to tasks of the root cpu cgroup, so one cgroup for
    both nodes makes all their steps one scheduler group, as pdsweep's local launcher does
    with one session."""
    if group is None:
        return ()
    return ("sh", "-c", 'echo $$ > "$1/cgroup.procs" && shift && exec "$@"', "sh", str(group))


def enter(ns: str, park: Path) -> tuple[str, ...]:
    """Command prefix running a program as a second host: in network namespace ``ns`` and in
    new PID, IPC and mount namespaces (the namespace's sysfs, the host's cgroups, a /proc of
    its own; ``park``: a scratch dir). Not the network alone: UCX's shared-memory transports
    reach any process of the same kernel, boot id and PID namespace (``cma``:
    process_vm_readv), so across network namespaces only, NIXL READ over ``cma/memory``
    (seen here); a PID namespace of its own makes ``cma`` unreachable, an IPC one ``sysv``.
    The program is PID 1 of its namespace: when it ends, the kernel kills everything left
    there; ``unshare --kill-child=SIGTERM`` sends it SIGTERM when unshare ends."""
    park.mkdir(parents=True, exist_ok=True)
    return (
        "nsenter",
        f"--net=/run/netns/{ns}",
        "unshare",
        "--mount",
        "--pid",
        "--ipc",
        "--fork",
        "--kill-child=SIGTERM",
        "--mount-proc",
        "--propagation",
        "private",
        "sh",
        "-c",
        _ENTER,
        "sh",
        str(park),
    )


@contextlib.contextmanager
def netns_cluster(root: Path, cpus: int | None = None, cpu_group: bool = True) -> Iterator[Cluster]:
    """:func:`testnet` plus the Slurm cluster of tests/_slurm.py on it: slurmd of
    ``NODES[i]`` in namespace ``NETNS[i]`` at ``ADDRS[i]`` (with ``cpu_group``: both in
    :data:`CPU_GROUP`, :func:`in_group`), slurmctld in the root namespace at
    :data:`CTLD_ADDR`. Daemons stop before the network goes."""
    with testnet(cpu_group) as group:
        prefixes = tuple(in_group(group) + enter(ns, root / f"cgroup-{ns}") for ns in NETNS)
        with cluster(root, cpus, addrs=ADDRS, ctld_addr=CTLD_ADDR, prefixes=prefixes) as cl:
            yield cl


@pytest.fixture(scope="module")
def slurm_netns_cluster(tmp_path_factory) -> Iterator[Cluster]:
    """A :func:`netns_cluster` for one test module; afterwards nothing of ours is left
    (asserted). Skipped where :func:`usable` says why, unless ``PDSWEEP_REQUIRE_SLURM=1``."""
    why = usable()
    if why:
        if os.environ.get("PDSWEEP_REQUIRE_SLURM") == "1":
            pytest.fail(why + " but PDSWEEP_REQUIRE_SLURM=1")
        pytest.skip(why)
    root = tmp_path_factory.mktemp("slurm-netns")
    with netns_cluster(root) as cl:
        yield cl
    assert leftovers() == [], f"test network left behind: {leftovers()}"
    assert running_under(root) == [], f"daemons left running: {running_under(root)}"
