"""``pdsweep builds tonight VLLM --sweep SWEEP --out FILE``: the build ``make nightly VLLM=...``
tests, its unfixed twin, and the sweep pointed at both.

``VLLM`` is a version of ``--dist`` on the index (``0.34.1.dev12+gabc1234``), a wheel file or
URL (``*.whl``, ``https://...``) or a vLLM source tree (a directory). The build is
:func:`pdsweep.builds.make.make_build` (keyed venv under ``--root``, reused when its inputs are
unchanged); the twin is :func:`pdsweep.builds.baseline.make_baseline_env` on the build's own
interpreter (PR #49297 undone by code shape, ``<build>-unfixed``). ``--out`` gets a copy of the
sweep whose builds point at them (an overlay: ``builds:`` rewritten, ``models_file`` and
``models_overlay`` made absolute, every other field as written, the sweep's ``name`` kept so that
the nightly compares against the last green run of the same sweep): the build with neither
``venv`` nor ``python`` (the interpreter running pdsweep: the pinned release) becomes tonight's
build, every unfixed build (:meth:`pdsweep.sweepfile.serve.BuildSpec.is_unfixed`) its twin;
other builds are kept. ``FILE.json`` beside it records what was asked and both builds' markers
(``make nightly`` copies it to ``RUN/tonight.json``; every cell.json records its build's
provenance as well).

Raises :class:`~pdsweep.core.errors.UserError` (exit 2) for a sweep without such a build, a
spec that is none of the three, or a build or twin that cannot be made (the builders' own
messages: no wheel on the index, a vLLM whose NIXL files match no known shape, ...).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import yaml

from pdsweep.builds.baseline import make_baseline_env
from pdsweep.builds.make import DISTS, fetch_wheel, make_build
from pdsweep.core.errors import EXIT_OK, UserError, run_main
from pdsweep.sweepfile.serve import BuildSpec
from pdsweep.sweepfile.sweep import load_sweep

WHEEL, SOURCE, VERSION = "wheel", "source", "version"


def spec_kind(spec: str) -> str:
    """What ``VLLM=spec`` names: ``source`` (an existing directory), ``wheel`` (a ``.whl`` file
    or a URL) or ``version`` (anything else that looks like a PEP 440 version). Raises
    :class:`UserError` naming the spec and the three forms."""
    if Path(spec).is_dir():
        return SOURCE
    if spec.endswith(".whl") or "://" in spec:
        if "://" not in spec and not Path(spec).is_file():
            raise UserError(f"VLLM={spec}: no such wheel file")
        return WHEEL
    if spec and spec[0].isdigit() and " " not in spec:
        return VERSION
    raise UserError(f"VLLM={spec!r}: allowed: a version (0.34.0), a wheel file or URL (*.whl), a source tree (DIR)")


def overlay(sweep_path: Path, build: Path, twin: Path, provenance: str) -> dict[str, Any]:
    """The sweep YAML at ``sweep_path`` (raw mapping) with its builds pointed at ``build`` and
    ``twin`` (venv directories) as the module doc says. Raises :class:`UserError` when no build
    of the sweep is the interpreter running pdsweep."""
    loaded = load_sweep(sweep_path)  # validates: the overlay of a bad sweep is refused here, named
    raw = yaml.safe_load(sweep_path.read_text())
    builds: dict[str, Any] = {}
    replaced = []
    for name, b in loaded.sweep.builds.items():
        if b.is_unfixed(name):
            builds[name] = {"venv": str(twin), "unfixed": True, "description": f"{provenance}, PR #49297 undone"}
            replaced.append(name)
        elif b.venv is None and b.python is None:
            builds[name] = {"venv": str(build), "description": provenance}
            replaced.append(name)
        else:
            builds[name] = _absolute(b, Path.cwd())
    if not any(not loaded.sweep.builds[n].is_unfixed(n) for n in replaced):
        raise UserError(
            f"{sweep_path}: builds: no build runs the interpreter of pdsweep (neither venv nor python): "
            f"nothing for VLLM= to replace (builds: {', '.join(loaded.sweep.builds)})"
        )
    raw["builds"] = builds
    raw["models_file"] = str(loaded.catalogue_path)
    if loaded.sweep.models_overlay:
        raw["models_overlay"] = [str((sweep_path.parent / m).resolve()) for m in loaded.sweep.models_overlay]
    return raw


def _absolute(b: BuildSpec, base: Path) -> dict[str, Any]:
    """A kept build with its venv/python path made absolute (the overlay lives elsewhere)."""
    d = b.model_dump(exclude_none=True)
    for k in ("venv", "python"):
        if k in d:
            d[k] = str((base / d[k]).absolute())
    return d


def make_tonight(args: argparse.Namespace) -> dict[str, Any]:
    """Make the build and its twin, write the overlay and its record; the record (module doc)."""
    kind = spec_kind(args.vllm)
    wheel = source = None
    if kind == SOURCE:
        source = Path(args.vllm).absolute()
    else:
        wheel = fetch_wheel(args.vllm, Path(args.root) / "wheels", args.dist, args.index_url, args.extra_index_url)
    dest, marker = make_build(
        wheel=wheel,
        source=source,
        root=Path(args.root),
        deps_from=args.deps_from,
        constraints=args.constraints,
        index=(args.index_url, args.extra_index_url),
    )
    twin = dest.with_name(dest.name + "-unfixed")
    make_baseline_env(str(dest / "bin" / "python"), twin)
    prov = marker.get("provenance") or {}
    words = f"tonight: {prov.get('vllm_dist') or 'vllm'} {prov.get('vllm_version')} ({kind} {args.vllm})"
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    raw = overlay(Path(args.sweep), dest, twin, words)
    out.write_text(f"# generated by pdsweep builds tonight from {args.sweep}: do not edit\n" + yaml.safe_dump(raw))
    load_sweep(out)  # the overlay itself must load: fail here, not in the run
    twin_marker = json.loads((twin / "pdsweep-baseline.json").read_text())
    record = {
        "vllm": args.vllm,
        "kind": kind,
        "sweep": str(Path(args.sweep)),
        "overlay": str(out),
        "build": {"venv": str(dest), "marker": {k: v for k, v in marker.items() if k != "reused"}},
        "unfixed": {"venv": str(twin), "provenance": twin_marker.get("provenance")},
        "reused": bool(marker.get("reused")),
    }
    out.with_suffix(".json").write_text(json.dumps(record, indent=2))
    return record


def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Options of ``pdsweep builds tonight``."""
    p = parser
    p.add_argument("vllm", metavar="VLLM", help="a version, a wheel file or URL, or a vLLM source tree")
    p.add_argument("--sweep", required=True, help="the sweep to point at the build and its unfixed twin")
    p.add_argument("--out", required=True, help="where the generated sweep goes (FILE.json beside it: the record)")
    p.add_argument("--dist", choices=DISTS, default="vllm", help="distribution of a version (default vllm)")
    p.add_argument("--index-url", default=None)
    p.add_argument("--extra-index-url", default=None)
    p.add_argument("--deps-from", default=None, metavar="PYTHON", help="as for pdsweep builds make")
    p.add_argument("--constraints", type=Path, default=None, help="as for pdsweep builds make")
    p.add_argument("--root", type=Path, default=Path(".cache/builds"), help="where builds go (default .cache/builds)")
    return parser


def main(args: argparse.Namespace) -> int:
    """Make both builds and the overlay; print one line each (``UserError``: exit 2)."""
    rec = make_tonight(args)
    prov = rec["build"]["marker"].get("provenance") or {}
    print(f"tonight's build ({'reused' if rec['reused'] else 'made'}): {rec['build']['venv']}")
    print(f"  vllm {prov.get('vllm_version')} commit {prov.get('vllm_commit')} nixl {prov.get('nixl_version')}")
    print(f"its unfixed twin: {rec['unfixed']['venv']}")
    print(f"  {rec['unfixed']['provenance']}")
    print(f"sweep: {rec['overlay']} (record: {Path(rec['overlay']).with_suffix('.json')})")
    return EXIT_OK


if __name__ == "__main__":
    ns = add_cli_args(argparse.ArgumentParser(prog="python -m pdsweep.commands.tonight")).parse_args()
    sys.exit(run_main(lambda: main(ns)))
