"""Retrain and refresh the committed tiny fixtures (:mod:`pdsweep.tiny.fixtures`): one command,
``make tiny-fixtures`` (``python -m pdsweep.tiny.refresh [--retrain] [NAME...]``)."""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import sys
import tempfile
from pathlib import Path

from pdsweep.core.errors import UserError
from pdsweep.core.paths import REPO, sha256_file
from pdsweep.sweepfile.catalogue import ModelSpec
from pdsweep.sweepfile.sweep import load_catalogue
from pdsweep.tiny.checkpoints import checkpoint_dir, default_cache_dir
from pdsweep.tiny.fixtures import MANIFEST, ROOT, manifest


def trained_entries(catalogue_path: Path | None = None) -> dict[str, ModelSpec]:
    """Catalogue entries with ``tiny.train`` (the ones worth a fixture), by name; an entry with
    ``tiny.weights_from`` copies that entry's checkpoint (seconds) and needs none of its own."""
    cat = load_catalogue(catalogue_path or REPO / "sweeps" / "models.yaml")
    return {
        n: m
        for n, m in sorted(cat.models.items())
        if m.tiny is not None and m.tiny.train is not None and m.tiny.weights_from is None
    }


def refresh(retrain: bool = False, root: Path | None = None, names: list[str] | None = None) -> list[str]:
    """Make ``root`` hold one current fixture per trained catalogue entry (or ``names``).

    Builds each checkpoint through ``checkpoint_dir`` in a scratch cache (``retrain``) or the
    default one, copies it under its key, removes the entry's stale fixtures and rewrites the
    manifest. Returns the fixture directory names written.
    """
    root = root or ROOT
    root.mkdir(parents=True, exist_ok=True)
    entries = trained_entries()
    unknown = sorted(set(names or []) - set(entries))
    if unknown:
        raise UserError(f"tiny fixtures: {unknown} are not trained catalogue entries (allowed: {sorted(entries)})")
    old, out = manifest(root), []
    scratch = Path(tempfile.mkdtemp(prefix="pdsweep-fixtures-")) if retrain else default_cache_dir()
    try:
        for name, model in entries.items():
            if names and name not in names:
                continue
            built = checkpoint_dir(name, model, scratch, fixtures=not retrain)
            for stale in root.glob(f"{name}-*"):
                if stale.is_dir() and stale.name != built.name and stale.name[len(name) + 1 :].isalnum():
                    shutil.rmtree(stale)
                    old.pop(stale.name, None)
            dest = root / built.name
            if dest.resolve() != built.resolve():
                shutil.rmtree(dest, ignore_errors=True)
                shutil.copytree(built, dest)
            old[built.name] = {p.name: sha256_file(p) for p in sorted(dest.iterdir()) if p.is_file()}
            out.append(built.name)
            print(f"tiny fixture {dest}: {sum(p.stat().st_size for p in dest.iterdir()) / 1e6:.1f} MB", flush=True)
    finally:
        if retrain:
            shutil.rmtree(scratch, ignore_errors=True)
    (root / MANIFEST).write_text(json.dumps(dict(sorted(old.items())), indent=2) + "\n")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m pdsweep.tiny.refresh", description="retrain and refresh fixtures/tiny/"
    )
    ap.add_argument("names", nargs="*", help="trained catalogue entries (default: all)")
    ap.add_argument("--retrain", action="store_true", help="train again even if cached or committed")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    try:
        refresh(args.retrain, names=args.names)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
