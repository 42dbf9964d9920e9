#!/usr/bin/env python
"""Reproducer for issue 39's cross-namespace stall: the two-namespace Slurm cluster of
tests/_netns.py, then ``pdsweep run sweeps/cpu-smoke.yaml --launcher slurm --cells CELL``
``--repeat`` times. When the decode has done its NIXL handshakes but not answered the first
request within ``--sample-after`` s, it records, for every process in the nodes' namespaces:
its session, process group and ``/proc/PID/autogroup``; per-thread CPU, run-queue wait
(``/proc/PID/task/TID/schedstat``) and last core over a window; ``py-spy dump``; ``ss``
in each namespace. Then it interrupts the run (pdsweep cancels its steps).

  flock /tmp/pdsweep-heavy.lock .venv/bin/python scripts/repro/netns_pd.py \
      [--cells 'tiny-mla-mamba2.p2d1.b128-128.fixed'] [--repeat 3] [--autogroup 0|1] [--cpu-group] [--hog N] [--out DIR]

``--autogroup`` sets ``kernel.sched_autogroup_enabled`` for the runs and restores the value
it found; ``--hog N`` runs N busy loops (one per core round robin, a session each) during each
run; every run writes ``trace-runN.json``: CPU and run-queue wait per process of the nodes and
the hogs between decode start, handshake and first answer (:class:`Tracer`). Exits 0 when every
run's cell got past its first request. Results of issue 39: tests/fixtures/vllm_cpu/NOTES.md.
"""

from __future__ import annotations

import argparse
import fnmatch
import functools
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests"))
from _netns import NETNS, netns_cluster  # noqa: E402
from _slurm import allocation_env  # noqa: E402

AUTOGROUP = Path("/proc/sys/kernel/sched_autogroup_enabled")
TICK = os.sysconf("SC_CLK_TCK")


def ns_pids() -> list[int]:
    pids = []
    for ns in NETNS:
        r = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True)
        pids += [int(p) for p in r.stdout.split()]
    return sorted(pids)


def _read(p: Path) -> str:
    try:
        return p.read_text().strip()
    except OSError:
        return "?"


def _proc_line(pid: int) -> str:
    st = _read(Path(f"/proc/{pid}/stat")).rsplit(")", 1)[-1].split()
    sid_pgid = f"pgid {st[2]} sid {st[3]}" if len(st) > 4 else ""
    cmd = _read(Path(f"/proc/{pid}/cmdline")).replace("\0", " ")[:110]
    cg = [
        ln.split(":", 2)[2] for ln in _read(Path(f"/proc/{pid}/cgroup")).splitlines() if ":cpu:" in ln or ":cpu," in ln
    ]
    return f"pid {pid} {sid_pgid} autogroup [{_read(Path(f'/proc/{pid}/autogroup'))}] cpu cgroup {cg} {cmd}"


def _threads(pids: list[int]) -> dict[tuple[int, int], tuple[str, float, float, int, str, str]]:
    """(pid, tid) -> (proc/thread, cpu s, run-queue wait s, timeslices, state, last core)."""
    res = {}
    for pid in pids:
        pname = _read(Path(f"/proc/{pid}/comm"))
        try:
            tasks = list(Path(f"/proc/{pid}/task").iterdir())
        except OSError:
            continue
        for t in tasks:
            try:
                st = (t / "stat").read_text().rsplit(")", 1)[1].split()
                run_ns, wait_ns, slices = ((t / "schedstat").read_text().split() + ["0", "0", "0"])[:3]
                res[(pid, int(t.name))] = (
                    f"{pname}/{(t / 'comm').read_text().strip()}",
                    (int(st[11]) + int(st[12])) / TICK,
                    int(wait_ns) / 1e9,
                    int(slices),
                    st[0],
                    st[36],
                )
            except (OSError, IndexError, ValueError):
                continue
    return res


def evidence(out: Path, tag: str, driver: int, window_s: float = 5.0) -> None:
    pids = ns_pids()
    host_all = [int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit()]
    with open(out / f"evidence-{tag}.txt", "w") as f:
        f.write(f"== {time.strftime('%H:%M:%S')} loadavg {_read(Path('/proc/loadavg'))}\n")
        f.write(f"kernel.sched_autogroup_enabled={_read(AUTOGROUP)}\n== processes in {NETNS}\n")
        f.write("\n".join(_proc_line(p) for p in pids) + "\n")
        f.write(f"== pdsweep in the root namespace\n{_proc_line(driver)}\n")
        a, ha = _threads(pids), _threads(host_all)
        time.sleep(window_s)
        b, hb = _threads(pids), _threads(host_all)
        f.write(f"== per thread over {window_s} s: cpu s, run-queue wait s, timeslices, state, core (ours)\n")
        rows = sorted(
            ((b[k][1] - a[k][1], b[k][2] - a[k][2], b[k][3] - a[k][3], k, b[k]) for k in b if k in a),
            key=lambda r: -(r[0] + r[1]),
        )
        for cpu, wait, sl, (pid, tid), v in rows[:30]:
            f.write(f"{cpu:6.2f} {wait:6.2f} {sl:6d}  {pid:>7} {tid:>7} {v[0]:<42} {v[4]} core {v[5]}\n")
        f.write(f"== busiest threads of the whole host over {window_s} s (cpu s, wait s)\n")
        hrows = sorted(
            ((hb[k][1] - ha[k][1], hb[k][2] - ha[k][2], k, hb[k][0]) for k in hb if k in ha), key=lambda r: -r[0]
        )
        for cpu, wait, (pid, tid), name in hrows[:15]:
            f.write(f"{cpu:6.2f} {wait:6.2f}  {pid:>7} {tid:>7} {name}\n")
        for ns in NETNS:
            ss = subprocess.run(["ip", "netns", "exec", ns, "ss", "-tanpe"], capture_output=True, text=True)
            f.write(f"== ss -tanpe in {ns}\n{ss.stdout}{ss.stderr}")
        py_spy = Path(sys.executable).parent / "py-spy"
        for pid in pids:
            if "python" not in _read(Path(f"/proc/{pid}/cmdline")):
                continue
            f.write(f"== py-spy dump {_proc_line(pid)}\n")
            r = subprocess.run(
                [str(py_spy), "dump", "--nonblocking", "--pid", str(pid)], capture_output=True, text=True, timeout=60
            )
            f.write(r.stdout + r.stderr)
            f.flush()
    print(f"evidence -> {out}/evidence-{tag}.txt", flush=True)


def start_hogs(n: int) -> list[subprocess.Popen]:
    """``n`` busy loops, hog ``i`` pinned to core ``i % cores``, each in a session (so, with
    autogroups, a scheduler group) of its own: the load of other jobs on the host."""
    cores = sorted(os.sched_getaffinity(0))
    return [
        subprocess.Popen(
            [sys.executable, "-c", "while True: pass"],
            start_new_session=True,
            preexec_fn=functools.partial(os.sched_setaffinity, 0, {cores[i % len(cores)]}),
        )
        for i in range(n)
    ]


class Tracer:
    """Samples every thread of the nodes' namespaces and of ``extra`` PIDs (the hogs) every
    ``every_s``: per process, CPU s and run-queue wait s (``/proc/PID/task/TID/schedstat``),
    summed over its threads. :meth:`mark` names instants (decode log seen, handshake, first
    answer); :meth:`write` stores per-process deltas between consecutive marks."""

    def __init__(self, extra: list[int], every_s: float = 1.0) -> None:
        import threading

        self.extra, self.every_s, self.marks = extra, every_s, {}
        self.samples: list[tuple[float, dict]] = []
        self.names: dict[str, str] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def start(self) -> None:
        self.mark("start")
        self._thread.start()

    def _sample(self) -> dict:
        per: dict = {}
        ns_of = {}
        for ns in NETNS:
            r = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True)
            ns_of.update({int(p): ns for p in r.stdout.split()})
        ns_of.update({p: "hog" for p in self.extra})
        for (pid, _tid), v in _threads(list(ns_of)).items():
            key = f"{ns_of[pid]} {pid}"  # comm changes (python -> VLLM::Worker_TP): named at write
            self.names[key] = v[0].split("/")[0]
            cpu, wait = per.get(key, (0.0, 0.0))
            per[key] = (cpu + v[1], wait + v[2])
        return per

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.samples.append((time.monotonic(), self._sample()))
            self._stop.wait(self.every_s)

    def mark(self, name: str) -> None:
        self.marks[name] = time.monotonic()

    def stop(self) -> None:
        self.mark("end")
        self._stop.set()
        self._thread.join()
        self.samples.append((time.monotonic(), self._sample()))

    def _at(self, t: float) -> tuple[float, dict]:
        return min(self.samples, key=lambda s: abs(s[0] - t))

    def write(self, path: Path) -> None:
        names = sorted(self.marks, key=self.marks.get)
        phases = []
        for a, b in zip(names, names[1:]):
            (ta, sa), (tb, sb) = self._at(self.marks[a]), self._at(self.marks[b])
            rows = {
                f"{k} {self.names.get(k, '?')}": (
                    round(sb[k][0] - sa.get(k, (0, 0))[0], 2),
                    round(sb[k][1] - sa.get(k, (0, 0))[1], 2),
                )
                for k in sb
            }
            groups: dict = {}
            for k, (c, w) in rows.items():
                g = k.split()[0]
                gc, gw = groups.get(g, (0.0, 0.0))
                groups[g] = (round(gc + c, 2), round(gw + w, 2))
            phases.append({"phase": f"{a}->{b}", "s": round(tb - ta, 2), "by_ns": groups, "by_process": rows})
            print(f"  {a}->{b} {tb - ta:.1f} s  cpu/wait s: {groups}", flush=True)
        path.write_text(
            json.dumps(
                {"marks": {n: round(self.marks[n] - self.marks["start"], 2) for n in names}, "phases": phases}, indent=1
            )
        )


def one_run(
    env: dict[str, str],
    cells: str,
    out: Path,
    sample_after: float,
    budget_s: float,
    keep: bool,
    seed: Path | None,
    tracer: "Tracer",
) -> str:
    """Run pdsweep once; returns 'ok' (first request answered), 'stall' or 'other: ...'. With
    ``seed`` (an earlier run dir) its final reference cells are reused (``--resume``)."""
    log = open(out.with_suffix(".pdsweep.log"), "w")
    argv = [sys.executable, "-m", "pdsweep", "run", str(REPO / "sweeps/cpu-smoke.yaml"), "--launcher", "slurm"]
    if seed and seed.is_dir():
        shutil.copytree(seed, out, ignore=lambda d, names: [n for n in names if fnmatch.fnmatch(n, cells)])
        argv.append("--resume")
    p = subprocess.Popen(
        [*argv, "--cells", cells, "--out", str(out), "--quiet"], env=env, cwd=REPO, stdout=log, stderr=log
    )
    t0, handshake_t, verdict = time.monotonic(), None, "other: pdsweep ended first"
    try:
        while p.poll() is None and time.monotonic() - t0 < budget_s:
            time.sleep(1)
            dlogs = [d for d in out.glob("*.p2d1.*/logs/decode-0.log")] + list(out.glob("*.p1d1.*/logs/decode-0.log"))
            if not dlogs:
                continue
            text = dlogs[-1].read_text(errors="replace")
            if '"POST /v1/completions HTTP/1.1" 200' in text:
                if verdict != "ok":
                    tracer.mark("answer")
                verdict = "ok"
                print(f"  first request answered {time.monotonic() - t0:.0f} s into the run", flush=True)
                if not keep:
                    break
                continue
            if "decode" not in tracer.marks:
                tracer.mark("decode")
            if "Transfer plan" in text and handshake_t is None:
                handshake_t = time.monotonic()
                tracer.mark("handshake")
            if handshake_t and time.monotonic() - handshake_t > sample_after and verdict != "stall":
                verdict = "stall"
                tracer.mark("stall")
                print(f"  stall: no decode answer {sample_after:.0f} s after the handshake; sampling", flush=True)
                evidence(out.parent, f"{out.name}-a", p.pid)
                time.sleep(20)
                evidence(out.parent, f"{out.name}-b", p.pid)
                break
        else:
            if p.poll() is None:
                verdict = "other: budget spent"
    finally:
        if p.poll() is None:
            p.send_signal(signal.SIGINT)  # pdsweep cancels its own steps
            try:
                p.wait(90)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
    return verdict


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cells", default="tiny-mla-mamba2.p2d1.b128-128.fixed")
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--autogroup", choices=("0", "1"), default=None)
    ap.add_argument("--cpu-group", action="store_true", help="both slurmd in one cpu cgroup (tests/_netns.py)")
    ap.add_argument(
        "--hog",
        type=int,
        default=0,
        help="N busy-loop processes, each in a session of its own (other jobs' load), during each run",
    )
    ap.add_argument("--sample-after", type=float, default=30)
    ap.add_argument("--budget", type=float, default=300, help="seconds per run before giving up")
    ap.add_argument("--keep", action="store_true", help="let each run finish (gate it) instead of stopping early")
    ap.add_argument("--env", nargs="*", default=[], help="KEY=VALUE for pdsweep and (srun --export=ALL) its steps")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # `timeout`: still tear everything down
    out = Path(a.out or tempfile.mkdtemp(prefix="pdsweep-netns-"))
    out.mkdir(parents=True, exist_ok=True)
    orig = _read(AUTOGROUP)
    results = []
    try:
        if a.autogroup is not None:
            AUTOGROUP.write_text(a.autogroup)
        print(f"kernel.sched_autogroup_enabled={_read(AUTOGROUP)} (was {orig}); out {out}", flush=True)
        with netns_cluster(out / "cluster", cpu_group=a.cpu_group) as cl:
            job = cl.salloc("pdsweep-netns-repro")
            try:
                env = {**allocation_env(cl, job), "PYTHONPATH": str(REPO)}
                env.update(dict(kv.split("=", 1) for kv in a.env))
                for i in range(a.repeat):
                    t = time.monotonic()
                    hogs = start_hogs(a.hog)
                    try:
                        tracer = Tracer([h.pid for h in hogs])
                        tracer.start()
                        v = one_run(
                            env,
                            a.cells,
                            out / f"run{i}",
                            a.sample_after,
                            a.budget,
                            a.keep,
                            out / "run0" if i else None,
                            tracer,
                        )
                        tracer.stop()
                        tracer.write(out / f"trace-run{i}.json")
                    finally:
                        for h in hogs:
                            h.kill()
                            h.wait()
                    results.append({"run": i, "verdict": v, "s": round(time.monotonic() - t, 1)})
                    print(f"run {i}: {v} ({results[-1]['s']} s)", flush=True)
            finally:
                cl.run("scancel", job, check=False)
    finally:
        AUTOGROUP.write_text(orig)
        print(f"kernel.sched_autogroup_enabled restored to {_read(AUTOGROUP)}", flush=True)
    (out / "results.json").write_text(json.dumps(results, indent=1))
    print(json.dumps(results))
    return 0 if all(r["verdict"] == "ok" for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
