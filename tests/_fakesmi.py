"""A fake ``nvidia-smi`` (``-L``, ``--query-gpu=``, ``--query-compute-apps=``) with GPUs and the
compute processes holding them, for the preflight, scheduler and device-check tests. Standard
library only: ``scripts/device_check.py --device cpu`` imports it on a python without FastAPI."""

from __future__ import annotations

import json
from pathlib import Path

FAKE_SMI = '''#!{python}
"""Fake nvidia-smi: answers -L, --query-gpu=, --query-compute-apps= and nvlink --status from smi.json."""
import json, sys
from pathlib import Path
d = json.loads((Path(__file__).parent / "smi.json").read_text())
with open(Path(__file__).parent / "smi.calls", "a") as f:
    f.write(" ".join(sys.argv[1:]) + "\\n")
if d.get("fail"):
    sys.exit("NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver")
if sys.argv[1:3] == ["nvlink", "--status"]:
    for g in d["gpus"]:
        if d["nvlink"]:  # an SXM node: 18 links per GPU; a PCIe GPU prints nothing (one H200, 2026-12-04)
            print(f"GPU {{g['index']}}: {{g['name']}} (UUID: {{g['uuid']}})")
            print("\\n".join(f"\\t Link {{k}}: 26.562 GB/s" for k in range(18)))
    sys.exit(0)
for a in sys.argv[1:]:
    if a == "-L":
        for g in d["gpus"]:
            print(f"GPU {{g['index']}}: {{g['name']}} (UUID: {{g['uuid']}})")
    elif a.startswith("--query-gpu="):
        for g in d["gpus"]:
            print(", ".join(str(g[k]) for k in a.split("=", 1)[1].split(",")))
    elif a.startswith("--query-compute-apps="):
        for p in d["apps"]:
            print(", ".join(str(p[k]) for k in a.split("=", 1)[1].split(",")))
'''


def fake_nvidia_smi(
    bin_dir: Path,
    n: int = 8,
    *,
    name: str = "NVIDIA H100 80GB HBM3",
    cap: str = "9.0",
    total_mib: int = 81559,
    driver: str = "580.65.06",
    busy: dict[int, tuple[int, str, int]] | None = None,
    fail: bool = False,
    nvlink: bool = True,
    reserved_mib: int = 0,
) -> Path:
    """An executable ``nvidia-smi`` in ``bin_dir`` (put it first on PATH) for ``n`` GPUs
    of ``name`` / SM ``cap`` / ``total_mib``; ``busy``: GPU index -> (pid, process name,
    used MiB) of a compute process another user holds (its memory counts as used); ``nvlink``:
    ``nvlink --status`` lists active links (an SXM node) or nothing (PCIe); ``reserved_mib``: the
    driver's own memory per GPU (``memory.reserved``; free = total - reserved - used, as nvidia-smi).
    Every call's argv is appended to ``bin_dir/smi.calls``. Returns ``bin_dir``."""
    import sys

    bin_dir.mkdir(parents=True, exist_ok=True)
    busy = busy or {}
    gpus = []
    for i in range(n):
        used = busy[i][2] if i in busy else 3
        gpus.append(
            {
                "index": i,
                "uuid": f"GPU-{i:08x}-fake",
                "name": name,
                "compute_cap": cap,
                "memory.total": total_mib,
                "memory.free": total_mib - reserved_mib - used,
                "memory.used": used,
                "memory.reserved": reserved_mib,
                "driver_version": driver,
            }
        )
    apps = [
        {"pid": pid, "process_name": proc, "used_memory": mib, "gpu_uuid": f"GPU-{i:08x}-fake"}
        for i, (pid, proc, mib) in busy.items()
    ]
    (bin_dir / "smi.json").write_text(json.dumps({"gpus": gpus, "apps": apps, "fail": fail, "nvlink": nvlink}))
    exe = bin_dir / "nvidia-smi"
    exe.write_text(FAKE_SMI.format(python=sys.executable))
    exe.chmod(0o755)
    return bin_dir
