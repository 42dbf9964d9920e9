"""Per-core heartbeats and a per-thread CPU sampler, to see who holds a core during a stall.

One heartbeat process pinned to each core sleeps 10 ms in a loop and logs every wake-up that
came more than ``--gap-s`` late (``GAP core=C late_s=... at=...``): a nice-0 SCHED_OTHER task
that cannot run for seconds means that core was not schedulable for it. A sampler pinned to
``--sampler-core`` reads every thread's ``/proc/PID/task/TID/stat`` (utime, stime, last core)
each ``--every-s`` and, for each interval with a heartbeat gap, logs the threads that ran on the
starved core (``HOG core=C tid=... comm=... user_s=... sys_s=...``) and, for gaps of at least
``--stack-gap-s`` while it lasts, up to five samples of every thread in state R on that core:
its syscall and kernel stack (``LIVE core=C ...``; root).

Usage (beside a repro or a sweep, until Ctrl-C or --duration-s)::

    .venv/bin/python scripts/repro/cpu_watch.py --out /tmp/cpuwatch.log --duration-s 3600
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import time
from pathlib import Path
from typing import Any

TICK = os.sysconf("SC_CLK_TCK")


def heartbeat(core: int, gap_s: float, q: mp.Queue, beat: Any) -> None:
    os.sched_setaffinity(0, {core})
    last = time.monotonic()
    while True:
        time.sleep(0.01)
        now = time.monotonic()
        beat.value = now
        if now - last - 0.01 > gap_s:
            q.put((core, now - last, time.time()))
        last = now


def thread_stats() -> list[tuple[str, int, list[str]]]:
    """(pid/comm, tid, the /proc/PID/task/TID/stat fields after comm) of every thread on the host."""
    out = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for tid in tids:
            try:
                raw = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
            except OSError:
                continue
            comm = raw[raw.index("(") + 1 : raw.rindex(")")]
            out.append((f"{pid}/{comm}", int(tid), raw[raw.rindex(")") + 2 :].split()))
    return out


def running_on(core: int) -> list[tuple[str, int]]:
    """(pid/comm, tid) of every thread in state R whose last core is ``core``."""
    me = os.getpid()
    return [(name, tid) for name, tid, f in thread_stats() if f[0] == "R" and int(f[36]) == core and tid != me]


def threads() -> dict[int, tuple[str, int, int, int]]:
    """{tid: (pid/comm, utime ticks, stime ticks, last core)} of every thread on the host."""
    return {tid: (name, int(f[11]), int(f[12]), int(f[36])) for name, tid, f in thread_stats()}


def kernel_where(pid: str, tid: int) -> str:
    """One sample of a thread: its state, current syscall (number and first args) and kernel stack."""
    base = f"/proc/{pid}/task/{tid}"
    out = []
    for name in ("stat", "syscall", "stack"):
        try:
            text = Path(f"{base}/{name}").read_text().strip()
        except OSError as e:
            text = f"({e.strerror})"
        if name == "stat":
            text = "state " + text[text.rindex(")") + 2 :].split()[0]
        elif name == "stack":
            text = " <- ".join(line.split("] ", 1)[-1].split("+")[0] for line in text.splitlines()[:8])
        out.append(f"{name}: {text}")
    return " | ".join(out)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--gap-s", type=float, default=0.5)
    ap.add_argument("--every-s", type=float, default=0.5)
    ap.add_argument("--sampler-core", type=int, default=0)
    ap.add_argument("--duration-s", type=float, default=3600)
    ap.add_argument(
        "--stack-gap-s", type=float, default=1.0, help="sample the top thread's kernel stack on gaps this long"
    )
    a = ap.parse_args()
    cores = sorted(os.sched_getaffinity(0))
    q: mp.Queue = mp.Queue()
    last_beat = {c: mp.Value("d", time.monotonic()) for c in cores}
    beats = [mp.Process(target=heartbeat, args=(c, a.gap_s, q, last_beat[c]), daemon=True) for c in cores]
    for b in beats:
        b.start()
    os.sched_setaffinity(0, {a.sampler_core})
    hist: list[tuple[float, dict]] = [(time.time(), threads())]
    live_samples: dict[int, int] = {}
    t_end = time.monotonic() + a.duration_s
    with a.out.open("a", buffering=1) as log:
        log.write(f"START at={time.time():.3f} cores={cores} gap_s={a.gap_s}\n")
        try:
            next_sample = time.monotonic()
            while time.monotonic() < t_end:
                time.sleep(0.1)
                for c in cores:  # a core whose heartbeat is late now: who runs there, in which syscall
                    stale = time.monotonic() - last_beat[c].value
                    if c != a.sampler_core and stale > a.stack_gap_s and live_samples.get(c, 0) < 5:
                        live_samples[c] = live_samples.get(c, 0) + 1
                        for comm, tid in running_on(c):
                            log.write(
                                f"  LIVE core={c} stale_s={stale:.2f} tid={tid} comm={comm} "
                                f"{kernel_where(comm.split('/')[0], tid)}\n"
                            )
                    elif stale < 0.1:
                        live_samples[c] = 0
                if time.monotonic() < next_sample:
                    continue
                next_sample += a.every_s
                hist.append((time.time(), threads()))
                hist = hist[-240:]  # two minutes at 0.5 s
                while not q.empty():
                    core, late, at = q.get()
                    log.write(f"GAP core={core} late_s={late:.2f} at={at:.3f}\n")
                    # the threads that ran on that core over the gap (samples bracketing it)
                    t0 = at - late
                    before = next((s for t, s in reversed(hist) if t <= t0), hist[0][1])
                    after = hist[-1][1]
                    ran = []
                    for tid, (comm, ut, st, cpu) in after.items():
                        if tid in before and cpu == core:
                            du, ds = ut - before[tid][1], st - before[tid][2]
                            if du + ds > 0:
                                ran.append((du + ds, tid, comm, du / TICK, ds / TICK))
                    for _, tid, comm, us, ss in sorted(ran, reverse=True)[:6]:
                        log.write(f"  HOG core={core} tid={tid} comm={comm} user_s={us:.2f} sys_s={ss:.2f}\n")
        except KeyboardInterrupt:
            pass
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
