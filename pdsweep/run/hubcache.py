"""Whether a hub model's snapshot in the HF cache is complete: what vLLM would load without
downloading anything (so an instance's startup budget holds no download).

Read with huggingface_hub's own cache scan (``scan_cache_dir``: repos, revisions, the files each
snapshot links, the repo's ``blobs/``), never by walking paths by hand. The newest revision
holding ``config.json`` is the candidate (the one vLLM's ``snapshot_download(local_files_only)``
resolves through ``refs/main``); it is complete when

- its weights are all there: every shard ``model.safetensors.index.json`` maps
  (``weight_map``), or a ``model.safetensors`` without an index; a snapshot with no
  ``*.safetensors`` at all holds no weights;
- no download of the repo was interrupted: no ``blobs/*.incomplete`` (``huggingface_hub``
  writes a blob there first and renames it when its bytes are in; ``snapshot_download`` resumes it).

A partial snapshot is not counted as cached: ``pdsweep fetch`` resumes it, ``pdsweep run`` refuses it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Snapshot:
    """``path``: the snapshot directory (None: nothing with a config.json is cached);
    ``missing``: why it is partial, one entry per gap ([] when complete)."""

    path: Path | None
    missing: tuple[str, ...] = ()

    @property
    def complete(self) -> bool:
        return self.path is not None and not self.missing


def cache_dir(env: Mapping[str, str] | None = None) -> Path:
    """The HF hub cache (``HF_HUB_CACHE``, else ``huggingface_hub.constants.HF_HUB_CACHE``), read at call time."""
    from huggingface_hub import constants

    env = os.environ if env is None else env
    return Path(env.get("HF_HUB_CACHE") or constants.HF_HUB_CACHE)


def _gaps(files: set[str], snapshot: Path) -> list[str]:
    """The weight files a snapshot lacks (``files``: the names it links, relative paths)."""
    index = "model.safetensors.index.json"
    if index in files:
        try:
            shards = set(json.loads((snapshot / index).read_text())["weight_map"].values())
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return [f"{index} unreadable"]
        return sorted(shards - files)
    if not any(f.endswith(".safetensors") for f in files):
        return ["no *.safetensors (weights never downloaded)"]
    return []


def snapshot(repo_id: str, root: Path | None = None) -> Snapshot:
    """The :class:`Snapshot` of model ``repo_id`` in the cache at ``root`` (default :func:`cache_dir`)."""
    from huggingface_hub import scan_cache_dir
    from huggingface_hub.errors import CacheNotFound

    try:
        info = scan_cache_dir(root or cache_dir())
    except (CacheNotFound, OSError):
        return Snapshot(None)
    for repo in info.repos:
        if repo.repo_id != repo_id or repo.repo_type != "model":
            continue
        revs = sorted(repo.revisions, key=lambda r: r.last_modified, reverse=True)
        rev: Any = next((r for r in revs if any(f.file_name == "config.json" for f in r.files)), None)
        if rev is None:
            return Snapshot(None)
        files = {str(f.file_path.relative_to(rev.snapshot_path)) for f in rev.files}
        gaps = _gaps(files, Path(rev.snapshot_path))
        partial = sorted(p.name for p in (Path(repo.repo_path) / "blobs").glob("*.incomplete"))
        if partial:
            gaps.append(f"{len(partial)} interrupted download(s) in blobs/ (*.incomplete)")
        return Snapshot(Path(rev.snapshot_path), tuple(gaps))
    return Snapshot(None)


def not_fetched(repo_id: str, root: Path | None = None) -> str:
    """Why ``repo_id`` is not loadable from the cache: ``"not in the HF cache"`` or
    ``"a partial snapshot in the HF cache (missing: ...)"``; ``""`` when complete."""
    s = snapshot(repo_id, root)
    if s.complete:
        return ""
    if s.path is None:
        return "not in the HF cache"
    return f"a partial snapshot in the HF cache at {s.path} (missing: {', '.join(s.missing)})"
