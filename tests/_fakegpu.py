"""A fake ``nvidia-smi`` for planning a GPU node on a CPU box: ``-L``, ``--query-gpu=index``,
``--query-gpu=compute_cap`` (and ``name``, ``memory.total``), ``--query-compute-apps`` (none)."""

from __future__ import annotations

import os
import stat
from pathlib import Path

SCRIPT = """#!/bin/sh
# fake nvidia-smi: {n} x {name}, compute capability {cap}
case "$*" in
  *--query-gpu=*)
    q=$(printf '%s\\n' "$@" | sed -n 's/^--query-gpu=//p')
    i=0
    while [ $i -lt {n} ]; do
      line=""
      for f in $(echo "$q" | tr ',' ' '); do
        case $f in
          index) v=$i ;; compute_cap) v={cap} ;; name) v="{name}" ;; memory.total) v="{mem} MiB" ;;
          uuid) v=GPU-fake-$i ;; *) v="[N/A]" ;;
        esac
        line="${{line:+$line, }}$v"
      done
      echo "$line"; i=$((i+1))
    done ;;
  *--query-compute-apps*) ;;
  *-L*) i=0; while [ $i -lt {n} ]; do echo "GPU $i: {name} (UUID: GPU-fake-$i)"; i=$((i+1)); done ;;
  *) echo "fake nvidia-smi: {n} x {name}" ;;
esac
"""


def fake_nvidia_smi(bin_dir: Path, n: int = 8, cap: str = "9.0", name: str = "NVIDIA H100 80GB HBM3") -> Path:
    """Write ``bin_dir/nvidia-smi`` (``n`` GPUs of compute capability ``cap``); returns ``bin_dir``."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    exe = bin_dir / "nvidia-smi"
    exe.write_text(SCRIPT.format(n=n, cap=cap, name=name, mem=81559))
    exe.chmod(exe.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return bin_dir


def path_with(bin_dir: Path) -> str:
    """``PATH`` with ``bin_dir`` first."""
    return f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}"
