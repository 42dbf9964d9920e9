"""What travels to the lent device machine (one H200, python 3.12, 64 MiB in all: the tracked tree
plus the carried paths, /work/.library/device/README.md) fits, and holds what the device check
imports. The device runs ``scripts/device-check.sh`` with ``carry=["build/device"]``."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
LIMIT = 64 * 2**20
CARRY = REPO / "build" / "device"
# the files the device check reads besides pdsweep/ (tests/_fakesmi.py: the --device cpu dry run only)
NEEDED = ("scripts/device-check.sh", "scripts/device_check.py", "sweeps/models.yaml", "tests/_fakesmi.py")


def tracked() -> dict[str, int]:
    out = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True).stdout
    names = [n for n in out.decode().split("\0") if n]
    return {n: (REPO / n).stat().st_size for n in names if (REPO / n).is_file()}


def test_tracked_tree_plus_the_trimmed_cp312_wheel_fit_the_carry():
    wheels = sorted(CARRY.glob("nixl_cu13-*-cp312-cp312-*.whl"))
    if not wheels:
        pytest.skip("no trimmed cp312 wheel in build/device (docs/gpu-preflight.md: the device check)")
    assert len(wheels) == 1  # one version: two would both travel
    tree = sum(tracked().values())
    carried = sum(p.stat().st_size for p in CARRY.rglob("*") if p.is_file())
    assert wheels[0].stat().st_size < 16 * 2**20  # trimmed: no nixl_ep_*, executables, perftest
    assert tree + carried < LIMIT, f"tree {tree / 2**20:.2f} MiB + carry {carried / 2**20:.2f} MiB"


def test_the_device_check_reads_only_tracked_files_and_no_pydantic_module():
    files = tracked()
    for n in NEEDED:
        assert n in files, n
    # what the device check and `python -m pdsweep.xfer.bench` import (rank processes import less)
    code = (
        "import sys; sys.argv = ['x']; sys.path.insert(0, 'scripts'); import device_check, pdsweep.xfer.bench, "
        "pdsweep.xfer.light; print('\\n'.join(sorted(m.__file__ or '' for m in list(sys.modules.values()) "
        "if (m.__name__.split('.')[0] in ('pdsweep', 'pydantic', 'httpx', 'device_check')) and "
        "getattr(m, '__file__', None))))"
    )
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    loaded = [str(Path(f).resolve().relative_to(REPO)) for f in r.stdout.split()]
    assert "pdsweep/xfer/bench.py" in loaded and "pdsweep/plan/geometry.py" in loaded
    assert [f for f in loaded if f not in files] == []  # everything it imports travels
    assert not [f for f in loaded if f.startswith("pdsweep/sweepfile/")], loaded  # the pydantic schema stays out
