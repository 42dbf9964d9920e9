"""Committed trained tiny checkpoints: training once, not on every CI run or first ``make sweep``.

Training a tiny model (:mod:`pdsweep.tiny.train`) costs 1-13 min of 2 cores and gives the
same weights every time for the same recipe. The trained checkpoints are therefore kept in
the repository under ``fixtures/tiny/<name>-<hash12>/`` (``config.json``, ``model.safetensors``,
tokenizer files, ``pdsweep-tiny.json``; 1-6 MB each), the directory name being the
checkpoint's cache key (:func:`pdsweep.tiny.checkpoints._fingerprint`: generator and trainer
versions, config parameters, recipe, task). ``fixtures/tiny/manifest.json`` lists each
file's sha256.

:func:`install` is called by :func:`pdsweep.tiny.checkpoints.checkpoint_dir` when the cache
lacks a checkpoint: a fixture with the same key is copied into the cache and verified by
sha256 (a mismatch raises ``UserError``: a corrupt fixture is never served). A recipe change
gives a new key, so a stale fixture is ignored and the checkpoint trains as before.

Refresh (retrain every trained catalogue entry whose fixture is missing or stale, drop stale
ones, rewrite the manifest)::

    make tiny-fixtures            # = python -m pdsweep.tiny.refresh [--retrain] [NAME...]

``--retrain`` trains again even where the cache or a fixture already has the checkpoint.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

from pdsweep.core.errors import UserError
from pdsweep.core.paths import REPO, sha256_file

ROOT = REPO / "fixtures" / "tiny"
MANIFEST = "manifest.json"
REFRESH = "make tiny-fixtures"
log = logging.getLogger(__name__)


def manifest(root: Path | None = None) -> dict[str, dict[str, str]]:
    """``{"<name>-<hash12>": {file: sha256}}`` from ``<root>/manifest.json`` ({} if none)."""
    path = (root or ROOT) / MANIFEST
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text())
    except ValueError as e:
        raise UserError(f"{path}: not valid JSON ({e}); regenerate it with `{REFRESH}`") from e


def verify(src: Path, files: dict[str, str], shown: Path | None = None) -> None:
    """Raise ``UserError`` unless ``src`` holds exactly ``files`` (name -> sha256); errors
    name ``shown`` (the committed fixture a copy came from), default ``src``."""
    shown = shown or src
    have = {p.name for p in src.iterdir() if p.is_file()}
    if have != set(files):
        raise UserError(
            f"tiny fixture {shown}: files {sorted(have)} differ from {MANIFEST}'s {sorted(files)}; "
            f"refresh with `{REFRESH}`"
        )
    for name, want in sorted(files.items()):
        got = sha256_file(src / name)
        if got != want:
            raise UserError(
                f"tiny fixture {shown / name}: sha256 {got[:16]}... != {MANIFEST}'s {want[:16]}...; "
                f"the fixture is corrupt or was edited: refresh with `{REFRESH}`"
            )


def install(final: Path, root: Path | None = None) -> bool:
    """Copy the fixture named ``final.name`` into ``final`` (its cache directory), verified.

    Returns False when no fixture has that key (the caller trains). The copy goes to a
    temporary sibling, is checked against the manifest's sha256 and renamed into place
    (atomic; a concurrent builder's result wins). Raises ``UserError`` when a fixture exists
    but is not in the manifest or fails its sha256.
    """
    root = root or ROOT
    src = root / final.name
    if not src.is_dir():
        return False
    files = manifest(root).get(final.name)
    if files is None:
        raise UserError(f"tiny fixture {src} is not in {root / MANIFEST}; refresh with `{REFRESH}`")
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}-", dir=final.parent))
    try:
        for name in files:
            shutil.copyfile(src / name, tmp / name)
        verify(tmp, files, shown=src)
        try:
            os.rename(tmp, final)
        except OSError:
            if not final.is_dir():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    log.info("tiny checkpoint %s: copied from fixture %s (sha256 verified)", final.name, src)
    return True
