#!/usr/bin/env python
"""Reproducer: one PD pair (or single instance) of a cpu-smoke model, started exactly as
pdsweep plans it, one direct P->D request (toy_proxy_server.py flow), and on a stall a
`py-spy dump` of every thread of every process of both instances.

  .venv/bin/python scripts/repro/cpu_pd.py --model tiny-llama --prefill-tp 2 --decode-tp 1 \
      [--extra-decode ARG ...] [--extra-both ARG ...] [--prompt-tokens 100] [--timeout 120]

Platform limits are bypassed on purpose (this is how a limit is re-checked). Logs and
dumps go to --out (default /tmp/pdsweep-repro). Exits 0 when the PD answer arrived.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
from pdsweep.deploy.launchers.base import own_group  # noqa: E402
from pdsweep.plan import instance as P  # noqa: E402
from pdsweep.plan.cell import Cell  # noqa: E402
from pdsweep.sweepfile.sweep import load_sweep  # noqa: E402


def sockets(out: Path, tag: str) -> None:
    """Every TCP socket of the host with its state, queues and process (``ss -tanpe``): a stalled
    NIXL handshake shows as a SYN-SENT connect or a LISTEN socket whose accept queue is full."""
    try:
        text = subprocess.run(["ss", "-tanpe"], capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.TimeoutExpired) as e:
        text = f"ss: {e}\n"
    (out / f"sockets-{tag}.txt").write_text(text)


def _group_pids(pgids: list[int]) -> list[int]:
    """Every live process whose process group is one of ``pgids`` (our instances' groups)."""
    pids = []
    for e in Path("/proc").iterdir():
        try:
            if e.name.isdigit() and os.getpgid(int(e.name)) in pgids:
                pids.append(int(e.name))
        except OSError:
            continue
    return sorted(pids)


def epolls(pgids: list[int], out: Path, tag: str) -> None:
    """Every epoll set of our processes: which fds it watches and for which events
    (``/proc/PID/fdinfo``: ``tfd`` and the ``events`` mask, 0x1 EPOLLIN, 0x4 EPOLLOUT, 0x80000000
    EPOLLET), with what each fd is (socket inode, pipe, eventfd): a connected socket watched
    for EPOLLOUT with nothing to send keeps a progress thread's poll() returning at once."""
    with open(out / f"epoll-{tag}.txt", "w") as f:
        for pid in _group_pids(pgids):
            try:
                fds = {}
                for e in Path(f"/proc/{pid}/fd").iterdir():
                    try:
                        fds[e.name] = os.readlink(e)
                    except OSError:
                        continue
                f.write(f"===== pid {pid} {Path(f'/proc/{pid}/comm').read_text().strip()}\n")
                for fd, target in sorted(fds.items(), key=lambda kv: int(kv[0])):
                    if "eventpoll" not in target:
                        continue
                    info = Path(f"/proc/{pid}/fdinfo/{fd}").read_text()
                    rows = [ln for ln in info.splitlines() if ln.startswith("tfd:")]
                    f.write(f"  epfd {fd}: {len(rows)} watched\n")
                    for ln in rows:
                        parts = ln.split()
                        tfd = parts[1]
                        f.write(f"    {ln.strip()}  -> {fds.get(tfd, '?')}\n")
            except OSError:
                continue
    print(f"epoll sets -> {out}/epoll-{tag}.txt")


def dump_all(pgids: list[int], out: Path, tag: str) -> None:
    py_spy = Path(sys.executable).parent / "py-spy"
    with open(out / f"py-spy-{tag}.txt", "w") as f:
        for pid in _group_pids(pgids):
            try:
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                f.write(f"===== pid {pid} pgid {os.getpgid(pid)} {cmdline.strip()[:150]}\n")
            except OSError:
                continue
            f.write(_threads_text(pid))
            f.flush()
            # --nonblocking: a process stuck in a native call can make a pausing py-spy wait forever
            f.write(_run([str(py_spy), "dump", "--nonblocking", "--pid", str(pid)], 30))
            if "Worker" in Path(f"/proc/{pid}/comm").read_text():  # native stacks of the TP workers
                f.write(
                    _run(
                        [
                            "gdb",
                            "-p",
                            str(pid),
                            "-batch",
                            "-ex",
                            "set pagination off",
                            "-ex",
                            "thread apply all bt 20",
                        ],
                        60,  # bounded: a gdb on a zombie worker once never returned
                    )
                )
            f.flush()
    print(f"dump -> {out}/py-spy-{tag}.txt")


def mq_dump(pgids: list[int], out: Path) -> None:
    """SIGUSR2 to every process of our groups (each has pdsweep's handler: --mq-dump), then the
    PDSWEEP_MQ lines they logged (within vLLM's 5 s shm poll)."""
    for g in pgids:
        try:
            os.killpg(g, signal.SIGUSR2)
        except ProcessLookupError:
            pass
    time.sleep(12)
    for log in sorted(out.glob("*.log")):
        lines = [ln for ln in log.read_text(errors="replace").splitlines() if "PDSWEEP_MQ" in ln]
        print(f"== {log.name}\n" + "\n".join(lines))


def _run(argv: list[str], timeout_s: float) -> str:
    try:
        r = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s)
        return r.stdout + r.stderr + "\n"
    except (subprocess.TimeoutExpired, OSError) as e:
        return f"{argv[0]}: {e}\n"


def _threads_text(pid: int) -> str:
    """Each thread: tid, name, state, kernel wait channel and current syscall (/proc)."""
    rows = []
    for t in sorted(Path(f"/proc/{pid}/task").iterdir(), key=lambda t: int(t.name)):
        try:
            st = (t / "stat").read_text().rsplit(")", 1)[1].split()
            rows.append(
                f"  tid {t.name:>7} {(t / 'comm').read_text().strip():<20} state {st[0]} "
                f"wchan {(t / 'wchan').read_text().strip() or '-':<24} syscall {(t / 'syscall').read_text().strip()[:60]}"
            )
        except OSError:
            continue
    return "\n".join(rows) + "\n"


def thread_cpu(pgids: list[int], out: Path, tag: str, window_s: float = 3.0) -> None:
    """CPU seconds each thread of our process groups used over ``window_s`` (utime+stime
    from /proc/PID/task/TID/stat), with the core it last ran on: who starves whom."""

    def sample() -> dict[tuple[int, int], tuple[str, float, str]]:
        res = {}
        for pid in _group_pids(pgids):
            try:
                pname = Path(f"/proc/{pid}/comm").read_text().strip()
                for t in Path(f"/proc/{pid}/task").iterdir():
                    st = (t / "stat").read_text().rsplit(")", 1)[1].split()
                    comm = (t / "comm").read_text().strip()
                    res[(pid, int(t.name))] = (
                        f"{pname}/{comm}",
                        (int(st[11]) + int(st[12])) / os.sysconf("SC_CLK_TCK"),
                        st[36],
                    )
            except (OSError, IndexError):
                continue
        return res

    a = sample()
    time.sleep(window_s)
    b = sample()
    rows = sorted(((b[k][1] - a[k][1], k, b[k][0], b[k][2]) for k in b if k in a), reverse=True)
    with open(out / f"threads-{tag}.txt", "w") as f:
        f.write(f"CPU s per thread over {window_s} s (pid, tid, process/thread, last core)\n")
        for d, (pid, tid), name, core in rows[:15]:
            f.write(f"{d:6.2f}  {pid:>7} {tid:>7}  {name:<40} core {core}\n")
    print((out / f"threads-{tag}.txt").read_text())


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sweep", default=str(REPO / "sweeps/cpu-smoke.yaml"))
    ap.add_argument("--model", default="tiny-llama")
    ap.add_argument("--prefill-tp", type=int, default=2)
    ap.add_argument("--decode-tp", type=int, default=1)
    ap.add_argument("--block-size", type=int, default=32)
    ap.add_argument(
        "--serve-args", default="base", help="the sweep's serve_args variant, e.g. push (sweeps/cpu-push.yaml)"
    )
    ap.add_argument("--extra-both", nargs="*", default=[])
    ap.add_argument("--extra-prefill", nargs="*", default=[])
    ap.add_argument("--extra-decode", nargs="*", default=[])
    ap.add_argument("--env", nargs="*", default=[], help="KEY=VALUE for both instances")
    ap.add_argument("--env-decode", nargs="*", default=[], help="KEY=VALUE for the decode instance only")
    ap.add_argument("--nice-prefill", type=int, default=0, help="start the prefill instance under `nice -n N`")
    ap.add_argument(
        "--new-session",
        action="store_true",
        help="start each instance in a session of its own (setsid; pdsweep did before 2026-12-02 session 33): "
        "one scheduler autogroup per instance (kernel.sched_autogroup_enabled), which reproduces the stall",
    )
    ap.add_argument("--prompt-tokens", type=int, default=100)
    ap.add_argument("--requests", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=120)
    ap.add_argument("--sample-after", type=float, default=10, help="per-thread CPU sample when decode takes longer")
    ap.add_argument("--port-base", type=int, default=21000)
    ap.add_argument(
        "--mq-dump",
        action="store_true",
        help="PDSWEEP_DEBUG_MQ_DUMP=1 in every instance; on a stall, SIGUSR2 makes each process log its "
        "shm RPC rings (PDSWEEP_MQ lines: role, current_idx, chunk flags)",
    )
    ap.add_argument(
        "--dump-on-stall",
        action="store_true",
        help="also take the py-spy + gdb dump at --sample-after (during the stall, not only at the timeout)",
    )
    ap.add_argument("--out", default="/tmp/pdsweep-repro")
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    ls = load_sweep(a.sweep)
    model = ls.catalogue.models[a.model]
    cell = Cell(
        model=a.model,
        prefill_tp=a.prefill_tp,
        decode_tp=a.decode_tp,
        prefill_block_size=a.block_size,
        decode_block_size=a.block_size,
        num_prefill=1,
        num_decode=1,
        kv_buffer_device="cpu",
        build="fixed",
        platform="cpu",
        serve_args=a.serve_args,
    )
    mpath = P.model_path(model, a.model)
    specs = P.instances(cell, P.Slot(0, (), a.port_base, tuple(range(os.cpu_count() or 1))), ls, mpath, sys.executable)
    extra_env = dict(kv.split("=", 1) for kv in a.env)
    if a.mq_dump:
        extra_env["PDSWEEP_DEBUG_MQ_DUMP"] = "1"
    procs = []
    session = {"start_new_session": True} if a.new_session else own_group()  # as pdsweep's launchers
    for s in specs:
        argv = list(s.argv) + a.extra_both + (a.extra_prefill if s.role == "prefill" else a.extra_decode)
        if s.role == "prefill" and a.nice_prefill:
            argv = ["nice", "-n", str(a.nice_prefill), *argv]
        role_env = dict(kv.split("=", 1) for kv in a.env_decode) if s.role == "decode" else {}
        env = {**os.environ, **s.env, **extra_env, **role_env, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1"}
        (out / f"{s.name}.cmd").write_text(
            json.dumps({"argv": argv, "env": {**s.env, **extra_env, **role_env}}, indent=1)
        )
        log = open(out / f"{s.name}.log", "w")
        procs.append((s, subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, **session)))
        print(
            f"{s.name}: pid {procs[-1][1].pid} port {s.port} side channel {s.side_channel_port} "
            f"bind {env.get('VLLM_CPU_OMP_THREADS_BIND')}"
        )
    pgids = [p.pid for _, p in procs]
    rc = 1

    def interrupted(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupted)  # SIGTERM tears down like Ctrl-C
    try:
        t0 = time.monotonic()
        for s, p in procs:
            while True:
                if p.poll() is not None:
                    print(f"{s.name} exited {p.returncode}")
                    return 1
                try:
                    if httpx.get(f"http://127.0.0.1:{s.port}/health", timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                time.sleep(0.5)
            print(f"{s.name} healthy after {time.monotonic() - t0:.1f} s")
        pre, dec = specs[0], specs[-1]
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(Path(mpath) / "tokenizer.json"))
        ids = tok.encode(" ".join(["the river and the mountain window"] * 200)).ids[: a.prompt_tokens]
        for i in range(a.requests):
            req = {"model": a.model, "prompt": ids[i:], "max_tokens": 8, "temperature": 0, "ignore_eos": True}
            # one id on both legs, as pdsweep's PD proxy sends: push mode (nixl/push_worker.py) matches decode's
            # registration to prefill's finished blocks by it (get_base_request_id); without it push never WRITEs
            hdr = {"X-Request-Id": f"repro-{os.getpid()}-{i}"}
            t1 = time.monotonic()
            pj = httpx.post(
                f"http://127.0.0.1:{pre.port}/v1/completions",
                timeout=a.timeout,
                headers=hdr,
                json={
                    **req,
                    "max_tokens": 1,
                    "stream": False,
                    "kv_transfer_params": {
                        "do_remote_decode": True,
                        "do_remote_prefill": False,
                        "remote_engine_id": None,
                        "remote_block_ids": None,
                        "remote_host": None,
                        "remote_port": None,
                    },
                },
            ).json()
            print(
                f"request {i}: prefill {time.monotonic() - t1:.2f} s kv_transfer_params={pj.get('kv_transfer_params')}"
            )
            if dec.role == "single":
                rc = 0
                continue
            t2 = time.monotonic()
            import concurrent.futures as cf

            with cf.ThreadPoolExecutor(1) as ex:
                fut = ex.submit(
                    httpx.post,
                    f"http://127.0.0.1:{dec.port}/v1/completions",
                    timeout=a.timeout,
                    headers=hdr,
                    json={**req, "kv_transfer_params": pj["kv_transfer_params"]},
                )
                try:
                    fut.result(timeout=a.sample_after)
                except cf.TimeoutError:
                    thread_cpu(pgids, out, f"req{i}")
                    sockets(out, f"req{i}")
                    if a.dump_on_stall:
                        epolls(pgids, out, f"req{i}")
                        dump_all(pgids, out, f"req{i}")
                try:
                    dj = fut.result().json()
                except httpx.TimeoutException:
                    dj = None
            if dj is not None:
                print(f"request {i}: decode {time.monotonic() - t2:.2f} s -> {dj['choices'][0]['text']!r}")
                rc = 0
            else:
                print(f"request {i}: decode timed out after {a.timeout} s")
                sockets(out, f"stall{i}")
                dump_all(pgids, out, f"stall{i}")  # first: the state as the stall left it
                if a.mq_dump:
                    mq_dump(pgids[-1:], out)  # decode only: SIGUSR2 ends a process without the handler
                rc = 1
                break
        m = httpx.get(f"http://127.0.0.1:{dec.port}/metrics", timeout=5).text
        print("\n".join(line for line in m.splitlines() if line.startswith("vllm:nixl_") and "_count" in line))
        return rc
    finally:
        # a second Ctrl-C or SIGTERM must not cut the teardown short (it once left a prefill running)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        for _, p in procs:
            try:
                os.killpg(p.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        for _, p in procs:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)


if __name__ == "__main__":
    sys.exit(main())
