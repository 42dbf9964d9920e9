#!/usr/bin/env python
"""Issue 39: does a spinning thread in one scheduler group delay a waking thread of another
group on the same core more than within one group? No vLLM: a "spinner" (the NIXL progress
thread of the P TP 2 -> D TP 1 stall: ``poll()`` on always-writable sockets, 1 ms timeout,
returning at once, tests/fixtures/vllm_cpu/NOTES.md "session 32") and a "probe" (the decode:
sleeps ``--period-ms``, records how late it woke, burns ``--work-ms`` of CPU) pinned to one core, for ``--seconds``,
in each placement:

- ``one-session``: both in one session (pdsweep's local launcher, ``own_group``);
- ``sessions``: a session each (srun steps; with autogroups on, an autogroup each);
- ``sessions-noautogroup``: the same with ``kernel.sched_autogroup_enabled=0``;
- ``cgroups``: one session, but a cpu cgroup each (Slurm's cgroup/v2 per-step cgroups);
- ``one-cgroup``: a session each inside one cpu cgroup (tests/_netns.py ``pdsw-39``).

``--hog N`` adds N busy loops, one per core round robin, a session each (other jobs).
Prints per placement: the probe's wake-up lateness (p50/p99/max ms), its run-queue wait
and CPU share, the spinner's CPU share (``/proc/PID/schedstat``). Root (sysctl, cgroups);
restores ``sched_autogroup_enabled`` and removes its cgroups.

  flock /tmp/pdsweep-heavy.lock .venv/bin/python scripts/repro/sched_groups.py --core 1 --seconds 8
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import subprocess
import sys
import time
from pathlib import Path

AUTOGROUP = Path("/proc/sys/kernel/sched_autogroup_enabled")
CG_ROOT = Path("/sys/fs/cgroup/cpu")  # cgroup v1 cpu controller (this host); v2: /sys/fs/cgroup
CG_TOP = "pdsw-39-sched"

SPIN = """
import select, socket, sys, time
pairs = [socket.socketpair() for _ in range(32)]
p = select.poll()
for a, _ in pairs:
    p.register(a, select.POLLOUT)
end = time.monotonic() + float(sys.argv[1])
while time.monotonic() < end:
    p.poll(1)
"""

PROBE = """
import json, sys, time
period, end, late = float(sys.argv[2]) / 1e3, time.monotonic() + float(sys.argv[1]), []
work = float(sys.argv[3]) / 1e3
while time.monotonic() < end:
    t = time.monotonic()
    time.sleep(period)
    late.append((time.monotonic() - t - period) * 1e3)
    c = time.thread_time()
    while time.thread_time() - c < work:
        pass
print(json.dumps(late))
"""


def _schedstat(pid: int) -> tuple[float, float]:
    run, wait, _ = Path(f"/proc/{pid}/schedstat").read_text().split()
    return int(run) / 1e9, int(wait) / 1e9


def _enter(core: int, cgroup: Path | None, session: bool) -> None:
    """Pre-exec: pin to ``core``, join ``cgroup``, start a session."""
    if session:
        os.setsid()
    if cgroup is not None:
        (cgroup / "cgroup.procs").write_text(str(os.getpid()))
    os.sched_setaffinity(0, {core})


def one(placement: str, core: int, seconds: float, period_ms: float, hogs: int, work_ms: float = 0.0) -> dict:
    """Run spinner + probe in ``placement``; return the probe's lateness and both CPU shares."""
    cgs: dict[str, Path | None] = {"spin": None, "probe": None}
    if placement in ("cgroups", "one-cgroup"):
        top = CG_ROOT / CG_TOP
        for k in cgs:
            cgs[k] = top / (k if placement == "cgroups" else "all")
            cgs[k].mkdir(parents=True, exist_ok=True)  # type: ignore[union-attr]
    own = placement in ("sessions", "sessions-noautogroup", "one-cgroup")
    cores = sorted(os.sched_getaffinity(0))
    hog = [
        subprocess.Popen(
            [sys.executable, "-c", "while True: pass"],
            preexec_fn=functools.partial(_enter, cores[i % len(cores)], None, True),
        )
        for i in range(hogs)
    ]
    try:
        spin = subprocess.Popen(
            [sys.executable, "-c", SPIN, str(seconds + 1)],
            preexec_fn=functools.partial(_enter, core, cgs["spin"], own),
        )
        time.sleep(0.5)
        probe = subprocess.Popen(
            [sys.executable, "-c", PROBE, str(seconds), str(period_ms), str(work_ms)],
            preexec_fn=functools.partial(_enter, core, cgs["probe"], own),
            stdout=subprocess.PIPE,
            text=True,
        )
        time.sleep(0.3)
        s0, p0, t0 = _schedstat(spin.pid), _schedstat(probe.pid), time.monotonic()
        ag = (
            Path(f"/proc/{probe.pid}/autogroup").read_text().split()[0],
            Path(f"/proc/{spin.pid}/autogroup").read_text().split()[0],
        )
        time.sleep(seconds - 1)
        s1, p1, t1 = _schedstat(spin.pid), _schedstat(probe.pid), time.monotonic()
        late = sorted(json.loads(probe.communicate(timeout=seconds + 30)[0]))
        spin.wait(timeout=30)
    finally:
        for h in hog:
            h.kill()
            h.wait()
    dt = t1 - t0
    q = lambda f: round(late[min(len(late) - 1, int(f * len(late)))], 2)  # noqa: E731
    return {
        "placement": placement,
        "autogroup_enabled": AUTOGROUP.read_text().strip(),
        "autogroups(probe,spin)": ag,
        "hogs": hogs,
        "work_ms": work_ms,
        "wakeups": len(late),
        "late_ms_p50": q(0.5),
        "late_ms_p99": q(0.99),
        "late_ms_max": round(late[-1], 2),
        "probe_wait_s_per_s": round((p1[1] - p0[1]) / dt, 3),
        "probe_cpu_share": round((p1[0] - p0[0]) / dt, 3),
        "spin_cpu_share": round((s1[0] - s0[0]) / dt, 3),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--core", type=int, default=1)
    ap.add_argument("--seconds", type=float, default=8)
    ap.add_argument("--period-ms", type=float, default=10)
    ap.add_argument("--hog", type=int, default=0)
    ap.add_argument("--work-ms", type=float, default=0.0, help="CPU the probe burns after each wake-up")
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument(
        "--placements", nargs="*", default=["one-session", "sessions", "sessions-noautogroup", "cgroups", "one-cgroup"]
    )
    ap.add_argument("--out", default=None, help="JSON lines of the results")
    a = ap.parse_args()
    orig = AUTOGROUP.read_text().strip()
    rows = []
    try:
        for _ in range(a.repeat):
            for pl in a.placements:
                AUTOGROUP.write_text("0" if pl == "sessions-noautogroup" else "1")
                rows.append(one(pl, a.core, a.seconds, a.period_ms, a.hog, a.work_ms))
                print(json.dumps(rows[-1]), flush=True)
    finally:
        AUTOGROUP.write_text(orig)
        top = CG_ROOT / CG_TOP
        for d in sorted(top.glob("*"), reverse=True) + [top]:
            with contextlib.suppress(OSError):
                d.rmdir()
        print(
            f"kernel.sched_autogroup_enabled restored to {AUTOGROUP.read_text().strip()}; cgroups left: "
            f"{[str(p) for p in top.glob('*')] if top.exists() else []}",
            flush=True,
        )
    if a.out:
        Path(a.out).write_text("".join(json.dumps(r) + "\n" for r in rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
