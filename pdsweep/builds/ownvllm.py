"""A build is what its own files are (issue 59): ``pdsweep builds make`` refuses a wheel or
source tree that installs no ``vllm`` package (with ``--deps-from`` the other venv's vLLM would
answer the version probe, and a sweep would run it under the new label), and checks that the
vLLM the made build imports lives in the build's own site-packages. The marker then records
that path and the sha256 of each NIXL connector file there
(``vllm/distributed/kv_transfer/kv_connector/v1/nixl/*.py``, ``nixl_connector.py`` before the
split), so cell.json says which connector code ran."""

from __future__ import annotations

import json
import subprocess
import zipfile
from pathlib import Path
from typing import Any

from pdsweep.core.errors import UserError
from pdsweep.core.paths import sha256_file

CONNECTOR = "distributed/kv_transfer/kv_connector/v1"  # under the vllm package
CONNECTOR_GLOBS = (f"{CONNECTOR}/nixl_connector.py", f"{CONNECTOR}/nixl/**/*.py")
_WHERE = (
    "import importlib.util, json, sysconfig\n"
    "s = importlib.util.find_spec('vllm')\n"
    "loc = list(s.submodule_search_locations)[0] if s and s.submodule_search_locations else None\n"
    "print('PDSWEEP_OWN ' + json.dumps({'vllm': loc, 'site': sysconfig.get_paths()['purelib']}))"
)


def _tops(names: list[str]) -> list[str]:
    return sorted({n.split("/")[0] for n in names if not n.split("/")[0].endswith((".dist-info", ".data"))})


def check_input(wheel: Path | None, source: Path | None) -> None:
    """Refuse a ``wheel`` that is not a zip archive or holds no ``vllm/__init__.py``, and a
    ``source`` tree without ``vllm/__init__.py``, naming what they hold. Raises ``UserError``."""
    if wheel is not None:
        try:
            with zipfile.ZipFile(wheel) as z:
                names = z.namelist()
        except (zipfile.BadZipFile, OSError) as e:
            raise UserError(f"--wheel {wheel}: not a wheel (a zip archive): {e}") from None
        if "vllm/__init__.py" not in names:
            raise UserError(
                f"--wheel {wheel}: holds no vllm package (it holds: {', '.join(_tops(names)) or 'nothing'}): "
                "a build must install its own vLLM"
            )
    if source is not None and not (source / "vllm" / "__init__.py").is_file():
        try:
            held = sorted(p.name for p in source.iterdir() if not p.name.startswith("."))[:12]
        except OSError:
            held = []
        raise UserError(
            f"--source {source}: not a vLLM source tree (no vllm/__init__.py; it holds: {', '.join(held) or 'nothing'})"
        )


def own_vllm(python: str, dest: Path) -> dict[str, Any]:
    """``{"vllm_path", "nixl_connector_files": {path under vllm/: sha256}}`` of the build at
    ``dest`` (interpreter ``python``). Raises ``UserError`` when it imports no vLLM or one
    outside its own site-packages (e.g. the ``--deps-from`` venv's)."""
    try:
        proc = subprocess.run([python, "-c", _WHERE], capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise UserError(f"cannot run {python} to find the vLLM it imports: {e}") from None
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("PDSWEEP_OWN ")), None)
    where = json.loads(line.split(" ", 1)[1]) if line else {}
    if not where.get("vllm"):
        raise UserError(f"the build {dest} imports no vllm package: {proc.stderr.strip()[-300:]}")
    pkg, site = Path(where["vllm"]).resolve(), Path(where["site"]).resolve()
    if pkg.parent != site:
        raise UserError(
            f"the build {dest} imports vLLM from {pkg}, not from its own site-packages {site}: "
            "the wheel or source tree installed no vLLM of its own"
        )
    files = sorted({f for g in CONNECTOR_GLOBS for f in pkg.glob(g) if f.is_file()})
    return {"vllm_path": str(pkg), "nixl_connector_files": {str(f.relative_to(pkg)): sha256_file(f) for f in files}}
