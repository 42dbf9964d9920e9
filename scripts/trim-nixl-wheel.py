"""Trim a nixl-cu13 (or nixl-cu12) wheel to what `pdsweep bench transfer` needs: the Python
bindings, NIXL's UCX backend plugin, UCX's transport modules and the shared libraries
those need (ELF ``DT_NEEDED`` closure, read with ``readelf -d``). The other backend plugins
(GDS, POSIX, OBJ/S3, Azure, libfabric, ...) and their libraries (AWS SDK, gRPC, ...) go, and so do
the expert-parallel package ``nixl_ep_*``, the bundled executables and UCX's perftest module,
so the wheel plus the tree fit the device machine's 64 MiB carry (scripts/device-check.sh).

    python scripts/trim-nixl-wheel.py nixl_cu13-1.5.1-cp311-cp311-manylinux_2_28_x86_64.whl build/device/

The wheel is fetched once where a registry is reachable:
``pip download --no-deps nixl-cu13==1.5.1 -d /tmp``. RECORD keeps the hashes of the kept
files (unchanged bytes), so ``pip install --no-deps`` accepts it.
"""

from __future__ import annotations

import re
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path, PurePosixPath

KEEP_PLUGINS = ("libplugin_UCX.so",)


def needed(path: Path) -> list[str]:
    """``DT_NEEDED`` sonames of an ELF file (``readelf -d``)."""
    out = subprocess.run(["readelf", "-d", str(path)], capture_output=True, text=True, check=True).stdout
    return re.findall(r"\(NEEDED\)\s+Shared library: \[([^\]]+)\]", out)


def trim(wheel: Path, out_dir: Path) -> Path:
    """Write the trimmed wheel (same file name) into ``out_dir``; returns its path."""
    with zipfile.ZipFile(wheel) as zin, tempfile.TemporaryDirectory() as tmp:
        names = zin.namelist()
        pkg = next(n.split("/")[0] for n in names if n.endswith("/_api.py") or n.endswith("_api.py"))
        # auditwheel's vendored libraries and meson-python's own (libnixl, plugins/), found by RPATH
        libs = (f"{pkg}.libs/", f".{pkg}.mesonpy.libs/")
        zin.extractall(tmp)
        root = Path(tmp)
        by_name = {PurePosixPath(n).name: n for n in names if n.startswith(libs)}
        roots = [n for n in names if n.startswith(f"{pkg}/") and n.endswith(".so")]
        roots += [n for n in names if n.startswith(libs) and PurePosixPath(n).name in KEEP_PLUGINS]  # dlopen'ed
        roots += [n for n in names if n.startswith(f"{pkg}.libs/ucx/")]  # UCX loads its transports by name
        keep, todo = set(), list(roots)
        while todo:
            n = todo.pop()
            if n in keep:
                continue
            keep.add(n)
            if ".so" in n and (root / n).is_file():
                todo += [by_name[s] for s in needed(root / n) if s in by_name]
        # not read by the bench: the expert-parallel package (nixl_ep_*: 3 torch-ABI builds, 26.6 MiB
        # compressed in the cp312 wheel), the example/telemetry executables and UCX's perftest module
        drop = (f"{pkg.replace('nixl_', 'nixl_ep_')}/", f"{pkg}.scripts/", f"{pkg}.libs/ucx/libucx_perftest")
        kept = [n for n in names if (not n.startswith(libs) or n in keep) and not n.startswith(drop)]
        record = next(n for n in names if n.endswith(".dist-info/RECORD"))
        out_dir.mkdir(parents=True, exist_ok=True)
        out = out_dir / wheel.name
        with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as zout:
            for n in kept:
                if n == record:
                    lines = zin.read(n).decode().splitlines()
                    body = "\n".join(x for x in lines if x.split(",")[0] in set(kept)) + "\n"
                    zout.writestr(n, body)
                else:
                    zout.write(root / n, n)
    dropped = len(names) - len(kept)
    print(
        f"{out}: {out.stat().st_size / 2**20:.1f} MiB (from {wheel.stat().st_size / 2**20:.1f} MiB; {dropped} files dropped)"
    )
    return out


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: trim-nixl-wheel.py WHEEL OUT_DIR")
    trim(Path(sys.argv[1]), Path(sys.argv[2]))
