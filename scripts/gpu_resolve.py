"""Resolve a GPU install route's FULL set against the package index, as pip on the node would.

The pip steps are the ones ``scripts/install-env.sh`` runs on a GPU node (taken from its dry run,
``PDSWEEP_INSTALL_DRY_RUN=1``, with the driver given), so this resolves exactly what ``make install``
installs: the steps with dependencies together in one ``pip install --dry-run --report``
(``--ignore-installed``, no ``--no-deps``), each ``--no-deps`` step on its own. The target is the node,
not this machine: ``--python-version``, ``--implementation cp`` and every manylinux platform up to
``--glibc`` (pip matches platform tags exactly, so a node's older manylinux tags are listed too),
``--only-binary=:all:`` (pip's rule for a foreign target). Wheel metadata is read with HTTP range
requests (``--use-feature=fast-deps``): the same metadata, without downloading GBs of CUDA wheels.

A requirement with no wheel but a pure-python sdist (lm-eval's ``rouge-score``, ``sqlitedict``,
``word2number``) is what pip on the node builds: it is built here (``pip wheel --no-binary``) and
offered with ``--find-links``; a build that is not ``py3-none-any`` is not used. Any other
"No matching distribution" is the answer: exit 1 naming the requirement.

    python scripts/gpu_resolve.py [--driver 580.65.06] [--python 3.12] [--glibc 2.31] [--report OUT]

Exit 0: one line ``gpu-resolve: cu13 route: N packages resolve ...``; 1: unresolvable (named);
2: the route itself refused (install-env.sh's message)."""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DROP = {"--quiet", "--disable-pip-version-check"}
# sdist-only on PyPI (pure python; lm-eval needs them): built before resolving, else pip backtracks
# through every lm-eval release for minutes before it says so
SDIST_ONLY = ("rouge-score", "sqlitedict", "word2number")
NO_MATCH = re.compile(r"No matching distribution found for (\S+)(.*)$", re.M)


def install_steps(driver: str, env_extra: dict[str, str]) -> tuple[str, list[list[str]]]:
    """(route, the pip install argument lists) of install-env.sh's dry run on a node with ``driver``.
    Raises SystemExit(2) with install-env's own message when it refuses the node."""
    import os

    env = {**os.environ, **env_extra, "PDSWEEP_INSTALL_DRY_RUN": "1", "PDSWEEP_TARGET": "gpu", "PDSWEEP_DRIVER": driver}
    r = subprocess.run(
        ["bash", "scripts/install-env.sh", "/nonexistent/venv"], cwd=REPO, env=env, text=True, capture_output=True
    )
    if r.returncode != 0:
        print(f"gpu-resolve: install-env.sh refused driver {driver}: {r.stderr.strip()}")
        raise SystemExit(2)
    route = re.search(r'"route": "(\w+)"', r.stdout)
    steps = []
    for line in r.stdout.splitlines():
        if line.startswith("+ ") and " -m pip install " in line and "--upgrade pip" not in line:
            steps.append([a for a in line.split(" -m pip install ", 1)[1].split() if a not in DROP])
    return (route.group(1) if route else "?"), steps


def target_args(python: str, glibc: str) -> list[str]:
    major, minor = (int(x) for x in glibc.split("."))
    plats = [f"manylinux_{major}_{m}_x86_64" for m in range(minor, 4, -1)]
    plats += ["manylinux2014_x86_64", "manylinux2010_x86_64", "manylinux1_x86_64", "linux_x86_64"]
    return [
        "--python-version",
        python,
        "--implementation",
        "cp",
        *(f"--platform={p}" for p in plats),
        "--only-binary=:all:",
    ]


def pip(args: list[str], timeout: float | None = None) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "pip", "--isolated", *args]
    return subprocess.run(cmd, cwd=REPO, text=True, capture_output=True, timeout=timeout)


def build_pure(req: str, into: Path) -> bool:
    """Build ``req`` from its sdist into ``into``; True when the wheel is pure python (py3-none-any)."""
    tmp = Path(tempfile.mkdtemp(dir=into))
    try:  # a pure-python sdist builds in seconds; a compiled one (Rust, C++) is not what we look for
        if pip(["wheel", "--quiet", "--no-deps", "--no-binary=:all:", "-w", str(tmp), req], timeout=120).returncode:
            return False
    except subprocess.TimeoutExpired:
        return False
    wheels = list(tmp.glob("*.whl"))
    if len(wheels) == 1 and wheels[0].name.endswith("-none-any.whl"):
        wheels[0].rename(into / wheels[0].name)
        return True
    return False


def resolve(args: list[str], target: list[str], report: Path, built: Path) -> tuple[str | None, list[str]]:
    """(None or the unresolvable requirement with pip's line, requirements built from sdists)."""
    made = [r for r in SDIST_ONLY if any(w.name.startswith(r.replace("-", "_")) for w in built.glob("*.whl"))]
    for _ in range(12):
        base = ["install", "--dry-run", "--ignore-installed", "--use-feature=fast-deps", "--report", str(report)]
        r = pip([*base, *target, "--find-links", str(built), *args])
        if r.returncode == 0:
            return None, made
        m = NO_MATCH.search(r.stderr)
        if m is None:
            tail = [x for x in r.stderr.splitlines() if x.startswith("ERROR")] or r.stderr.splitlines()[-3:]
            return " / ".join(tail), made
        req = m.group(1).strip()
        if req in made or not build_pure(req, built):
            return f"{req}{m.group(2)}: no wheel for the target on the index, nor a pure-python sdist", made
        made.append(req)
    return "gave up after 12 sdist builds", made


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--driver", default="580.65.06", help="the node's NVIDIA driver (picks the route)")
    p.add_argument("--python", default="3.12", help="the node's python X.Y")
    p.add_argument("--glibc", default="2.31", help="the node's glibc (ldd --version)")
    p.add_argument("--constraints", default=None, help="another constraints file for the route (GPU_CONSTRAINTS)")
    p.add_argument("--report", type=Path, default=None, help="pip's JSON report of the resolved set")
    a = p.parse_args()
    route, steps = install_steps(a.driver, {"GPU_CONSTRAINTS": a.constraints} if a.constraints else {})
    target = target_args(a.python, a.glibc)
    with tempfile.TemporaryDirectory() as td:
        built, rep = Path(td) / "built", a.report or Path(td) / "report.json"
        built.mkdir()
        for req in SDIST_ONLY:
            build_pure(req, built)
        deps = [x for s in steps if "--no-deps" not in s for x in s]
        problem, made = resolve(deps, target, rep, built)
        for s in (s for s in steps if "--no-deps" in s):
            problem = problem or resolve(s, target, Path(td) / "nodeps.json", built)[0]
        where = f"cp{a.python.replace('.', '')} manylinux_{a.glibc.replace('.', '_')}_x86_64"
        if problem:
            print(f"gpu-resolve: {route} route ({where}): UNRESOLVABLE: {problem}")
            return 1
        got = {i["metadata"]["name"].lower(): i["metadata"]["version"] for i in json.loads(rep.read_text())["install"]}
    key = " ".join(
        f"{n}=={got[n]}" for n in ("vllm", "torch", "nixl-cu13", "nixl-cu12", "flashinfer-python") if n in got
    )
    sdists = f"; built from sdists as pip on the node would: {', '.join(made)}" if made else ""
    print(f"gpu-resolve: {route} route ({where}): {len(got)} packages resolve: {key}{sdists}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
