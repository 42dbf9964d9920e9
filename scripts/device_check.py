"""The GPU check behind scripts/device-check.sh (run that, not this): nvidia-smi facts,
``detect_gpus`` and busy-GPU detection against a torch process it starts, and
``pdsweep bench transfer`` with Kimi-Linear and GLM-5.3-Flash-4L geometry (p2d1, p4d1, p4d2
byte-verified; the unfixed plan refused), with the UCX transports used, and the torch KV digest's
GB/s and estimated TTFT share (:mod:`pdsweep.xfer.digestcheck`). Imports no pydantic: the
bench runs as ``python -m pdsweep.xfer.bench`` and reads the catalogue through
:mod:`pdsweep.xfer.light` where pydantic is missing (the lent device: python 3.12, torch, numpy,
PyYAML). Writes ``OUT/device-check.json``;
exit 0 when every check passed, 1 otherwise.

``--device cpu`` is the dry run for machines without a GPU (CI): a fake ``nvidia-smi``
(tests/_fakesmi.py) lists the holder process on GPU 0, and the bench uses host memory.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from pdsweep.plan.gpus import CUDA_IPC_GET_ENV, CUDA_IPC_GET_OFF
from pdsweep.xfer.digestcheck import digest_check, summary

REPO = Path(__file__).resolve().parents[1]
PAIRS = ((2, 1), (4, 1), (4, 2))
MODELS = ("kimi-linear", "glm-5.3-flash-4l")
# The UCX transport a one-node READ must take: cma between host buffers, cuda_ipc between GPU buffers.
# Anything else (tcp/lo) is UCX's silent fallback: the bytes arrive, 10-100x slower.
EXPECTED_TRANSPORT = {"cpu": "cma", "cuda": "cuda_ipc"}
# UCX disables cuda_ipc GET (the READ vLLM's NixlConnector posts) when GPU 0 has no active NVLink
# (openucx/ucx src/uct/cuda/cuda_ipc/cuda_ipc_iface.c uct_cuda_ipc_iface_get_max_get_zcopy) unless
# this is on; a READ then runs as "software emulation" over tcp (vllm issue 52607, nixl PR 2208).
GET_ZCOPY_ENV = {CUDA_IPC_GET_ENV: "y"}
HOLD_GPU = (
    "import sys, time\n"
    "dev = sys.argv[1]\n"
    "if dev == 'cpu':\n"
    "    x = bytearray(1 << 20)  # the dry run: a process for the fake nvidia-smi to list (no torch needed)\n"
    "else:\n"
    "    import torch\n"
    "    x = torch.ones(256 << 20, dtype=torch.uint8, device=dev)  # 256 MiB: a CUDA context on GPU 0\n"
    "print('ready', flush=True)\n"
    "time.sleep(600)\n"
)


def run(cmd: list[str], timeout: float, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kw)


def smi_facts() -> dict:
    """nvidia-smi's GPU rows and compute apps (pdsweep.plan.gpus.inventory), or why not."""
    from pdsweep.plan.gpus import inventory

    inv = inventory()
    exe = shutil.which("nvidia-smi")
    head = run([exe], 30).stdout.splitlines()[:12] if exe else []
    # NVLink state and the GPU/NIC topology, raw: whether UCX will READ over cuda_ipc (GET_ZCOPY_ENV)
    nvlink = run([exe, "nvlink", "--status"], 30) if exe else None
    topo = run([exe, "topo", "-m"], 30) if exe else None
    return {
        "nvidia_smi": exe,
        "error": inv.error,
        "driver": inv.driver,
        "gpus": [{k: v for k, v in g.__dict__.items() if k != "apps"} for g in inv.gpus],
        "compute_apps": [a.__dict__ for g in inv.gpus for a in g.apps],
        "header": head,
        "nvlink_status": (nvlink.stdout + nvlink.stderr).splitlines()[:40] if nvlink else [],
        "topo": (topo.stdout + topo.stderr).splitlines()[:40] if topo else [],
    }


def torch_facts() -> dict:
    try:
        import torch
    except ImportError as e:
        return {"error": str(e)}
    out = {"torch": torch.__version__, "cuda": torch.version.cuda, "available": torch.cuda.is_available()}
    if out["available"]:
        out["devices"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        out["capability"] = [
            ".".join(map(str, torch.cuda.get_device_capability(i))) for i in range(torch.cuda.device_count())
        ]
    return out


@contextlib.contextmanager
def fake_smi_with(pid: int):
    """CPU dry run: a fake 2-GPU nvidia-smi (tests/_fakesmi.py) first on PATH, GPU 0 held by ``pid``."""
    sys.path.insert(0, str(REPO / "tests"))
    from _fakesmi import fake_nvidia_smi

    with tempfile.TemporaryDirectory(prefix="pdsweep-fake-smi-") as d:
        fake_nvidia_smi(Path(d), 2, busy={0: (pid, "python3", 256)})
        old = os.environ["PATH"]
        os.environ["PATH"] = f"{d}:{old}"
        try:
            yield
        finally:
            os.environ["PATH"] = old


def busy_check(device: str) -> dict:
    """Start a torch process holding GPU 0; ``detect_gpu_ids`` must leave GPU 0 out while it
    lives (a warning naming its pid) and give it back after it exits."""
    from pdsweep.plan.gpus import free_gpu_ids, inventory

    # pdsweep.plan.schedule.detect_gpu_ids() is free_gpu_ids(inventory()); called here directly so
    # the check imports no pydantic (pdsweep.plan.schedule imports the sweep schema)
    def detect_gpu_ids() -> tuple[int, ...]:
        return free_gpu_ids(inventory())

    def detect_gpus() -> int:
        return len(detect_gpu_ids())

    before = list(detect_gpu_ids())
    dev = "cuda:0" if device == "cuda" else "cpu"
    holder = subprocess.Popen([sys.executable, "-c", HOLD_GPU, dev], stdout=subprocess.PIPE, text=True)
    out: dict = {"before": before, "holder_pid": holder.pid}
    try:
        line = holder.stdout.readline().strip()  # type: ignore[union-attr]
        out["holder_ready"] = line == "ready"
        ctx = fake_smi_with(holder.pid) if device == "cpu" else contextlib.nullcontext()
        with ctx:
            seen = None
            for _ in range(40):  # the context shows up in nvidia-smi within a second or two
                inv = inventory()
                seen = next((g for g in inv.gpus if any(a.pid == holder.pid for a in g.apps)), None)
                if seen:
                    break
                time.sleep(0.5)
            out["seen_on_gpu"] = seen.index if seen else None
            out["busy_text"] = seen.busy_text() if seen else None
            out["during"] = list(detect_gpu_ids())  # what the scheduler hands out now
            out["detect_gpus_during"] = detect_gpus()
            if device == "cpu":
                out["fake_nvidia_smi"] = True
    finally:
        holder.kill()
        holder.wait()
    for _ in range(40):
        after = list(detect_gpu_ids())
        if device == "cpu" or 0 in after or 0 not in before:
            break
        time.sleep(0.5)
    out["after"] = after
    if seen is None and device == "cuda":
        out["note"] = (
            "nvidia-smi listed no compute process for the holder pid (a container's PID namespace hides "
            "host pids): busy detection by process cannot work here; pdsweep.plan.gpus sees busy GPUs only "
            "through --query-compute-apps"
        )
    out["ok"] = bool(
        out["holder_ready"]
        and seen is not None
        and seen.index == 0
        and 0 not in out["during"]
        and str(holder.pid) in (out["busy_text"] or "")
    )
    return out


def transport_verdict(device: str, transport: str | None) -> str | None:
    """None when ``transport`` (the bench's ``UCX_PROTO_INFO`` READ lanes, e.g. ``cuda_ipc/cuda``
    or ``tcp/lo, cuda_copy/cuda``) is the one-node transport expected for ``device``
    (:data:`EXPECTED_TRANSPORT`); else why not, naming the UCX cause for a GPU READ over tcp."""
    want = EXPECTED_TRANSPORT[device]
    used = [t.strip().split("/")[0] for t in (transport or "").split(",") if t.strip()]
    if used and all(u == want for u in used):
        return None
    why = f"KV READ over UCX {transport or 'unknown'}; expected {want}"
    if device == "cuda" and "tcp" in used:
        why += f" ({CUDA_IPC_GET_OFF})"  # as the gate says it (pdsweep.judge.transfer)
    return why


def bench(
    device: str,
    out_dir: Path,
    model: str,
    p: int,
    d: int,
    plan: str,
    opts: argparse.Namespace,
    env: dict[str, str] | None = None,
) -> dict:
    """One ``pdsweep bench transfer`` run (a subprocess, as a user runs it; ``python -m
    pdsweep.xfer.bench``: the bench module alone, no other subcommand's imports), with ``env``
    added to the environment. ``ok``: it ran, every byte verified and the READs took the expected
    transport (:func:`transport_verdict`, reason in ``transport_problem``)."""
    tag = "".join(f"-{k.lower()}-{v}" for k, v in (env or {}).items())
    js = out_dir / f"bench-{model}-p{p}d{d}-{plan}{tag}.json"
    cmd = [sys.executable, "-m", "pdsweep.xfer.bench", "--model", model, "--prefill-tp", str(p)]
    cmd += ["--decode-tp", str(d), "--block-size", "128", "--blocks", str(opts.blocks), "--iters", str(opts.iters)]
    cmd += ["--device", device, "--plan", plan, "--json", str(js), "--models", str(REPO / "sweeps" / "models.yaml")]
    cmd += ["--mapping", opts.mapping]
    t = time.monotonic()
    r = run(cmd, 240, cwd=REPO, env={**os.environ, **(env or {})})
    res = {"cmd": " ".join(cmd[1:]), "env": env or {}, "rc": r.returncode, "wall_s": round(time.monotonic() - t, 1)}
    res["stdout_tail"] = r.stdout.splitlines()[-6:] + r.stderr.splitlines()[-4:]
    if plan == "unfixed":
        res["refused"] = r.returncode == 1 and "refused before reading" in r.stdout
        res["ok"] = res["refused"]
        return res
    data = json.loads(js.read_text()) if js.exists() else {}
    v = data.get("verification") or {}
    res.update(
        gbps=data.get("gbps"),
        memcpy_gbps=data.get("memcpy_gbps"),
        bytes_per_iteration=data.get("bytes_per_iteration"),
        transport=data.get("transport"),
        verified_bytes=v.get("checked_bytes"),
        transport_problem=transport_verdict(device, data.get("transport")) if r.returncode == 0 else None,
    )
    if r.returncode != 0:  # the bench's own error, not a transport guess about a run that never read
        res["transport_problem"] = f"bench exited {r.returncode}: " + " | ".join(res["stdout_tail"][-2:])
    res["ok"] = r.returncode == 0 and v.get("ok") is True and res["transport_problem"] is None
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--out", type=Path, default=REPO / "results" / "device-check")
    ap.add_argument("--blocks", type=int, default=64, help="attention blocks per request (cpu dry run: 2)")
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument(
        "--mapping", default="auto", help="bench --mapping: auto (vLLM's compute_tp_mapping) or builtin (cpu dry run)"
    )
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    report: dict = {"device": args.device, "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    report["nvidia_smi"] = smi_facts()
    report["torch"] = torch_facts()
    report["busy_gpu"] = busy_check(args.device)
    report["pydantic_imported"] = "pydantic" in sys.modules
    report["bench"] = {
        f"{m} p{p}d{d}": bench(args.device, args.out, m, p, d, "fixed", args) for m in MODELS for p, d in PAIRS
    }
    once = argparse.Namespace(**{**vars(args), "iters": 1})
    report["bench"]["kimi-linear p2d1-unfixed"] = bench(args.device, args.out, "kimi-linear", 2, 1, "unfixed", once)
    if args.device == "cuda" and any("tcp" in str(b.get("transport")) for b in report["bench"].values()):
        # the remedy measured beside the failure: the same READs with cuda_ipc GET forced on
        tag = " ".join(f"{k}={v}" for k, v in GET_ZCOPY_ENV.items())
        for m in MODELS:
            for p, d in PAIRS:
                res = bench(args.device, args.out, m, p, d, "fixed", args, GET_ZCOPY_ENV)
                report["bench"][f"{m} p{p}d{d} {tag}"] = res
    report["kv_digest"] = digest_check(args.device, args.iters)  # the torch KV digest's GB/s and TTFT share
    report["ucx_transports"] = sorted({b["transport"] for b in report["bench"].values() if b.get("transport")})
    checks = {"busy_gpu": report["busy_gpu"]["ok"], **{f"bench {k}": b["ok"] for k, b in report["bench"].items()}}
    if not report["kv_digest"].get("skipped"):  # skipped: the CPU dry run without torch, said in its line below
        checks["kv_digest"] = report["kv_digest"]["ok"]
    if args.device == "cuda":
        checks["nvidia_smi"] = bool(report["nvidia_smi"]["gpus"]) and not report["nvidia_smi"]["error"]
    report["checks"] = checks
    report["ok"] = all(checks.values())
    report["wall_s"] = round(time.monotonic() - t0, 1)
    path = args.out / "device-check.json"
    path.write_text(json.dumps(report, indent=2, default=str) + "\n")
    for name, ok in checks.items():
        print(f"{'ok  ' if ok else 'FAIL'} {name}")
    for k, b in report["bench"].items():
        if "gbps" in b:
            print(
                f"     {k}: {b['gbps'] or float('nan'):.2f} GB/s ({b['transport']}), {b['verified_bytes']} bytes verified"
            )
            if b.get("transport_problem"):
                print(f"       {b['transport_problem']}")
    print(f"     {summary(report['kv_digest'])}")
    print(f"device-check: {'OK' if report['ok'] else 'FAILED'} in {report['wall_s']} s; wrote {path}")
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
