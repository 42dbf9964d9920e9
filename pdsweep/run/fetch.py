"""``pdsweep fetch``: download the weights a sweep needs once, before any instance starts, so
the startup budgets (:mod:`pdsweep.plan.startup`) cover loading, not downloading.

For every hub model the sweep's cells use (catalogue ``hf_id``; ``path:`` and tiny models are
local) that is not in the HF cache or only partly (:mod:`pdsweep.run.hubcache`: every shard, no
interrupted download; ``huggingface_hub.scan_cache_dir``): its size from the hub (``HfApi.model_info(...,
files_metadata=True)``: the sizes of the files :data:`PATTERNS` selects, bytes), then the free
disk of the HF cache (``huggingface_hub.constants.HF_HUB_CACHE``, ``shutil.disk_usage``) is
checked against the total BEFORE anything is downloaded, then ``huggingface_hub.snapshot_download``
fetches each (its own progress bars; one line per repo here; a partial snapshot is resumed), and a
snapshot still partial afterwards is refused (``UserError``). ``make sweep`` and ``make nightly`` run it
before ``pdsweep run``, which refuses a model not fetched. ``HF_HUB_OFFLINE=1``: refused,
naming every missing repo. Errors raise ``UserError`` (exit 2).

Eval datasets: each lm-eval task of ``eval.tasks`` (pdsweep's own ``pdsweep_*`` are local) names
its dataset in lm-eval's task index (``TaskManager().task_index``: ``dataset_path``,
``dataset_name``); one not in the ``datasets`` cache (``datasets.load_dataset`` under
``HF_DATASETS_OFFLINE=1`` finds it or raises) is sized by ``HfApi.dataset_info(...,
files_metadata=True)``, counted in the same disk check, and loaded once with
``datasets.load_dataset`` (its cache, its progress bars), which is what lm-eval reads later.
"""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from pdsweep.core.errors import UserError
from pdsweep.run import hubcache
from pdsweep.run.preflight import hf_cache_dir

# what vLLM reads of a checkpoint (weights, configs, tokenizer, remote code)
PATTERNS = ("*.safetensors", "*.json", "*.py", "*.txt", "*.model", "*.tiktoken", "tokenizer*")
HEADROOM = 1.05  # 5 % over the listed bytes: partial files and metadata during the download


@dataclass(frozen=True)
class Missing:
    """A catalogue model (or eval task, ``kind="dataset"``) not local: ``repo`` on the hub,
    ``config`` (a dataset's ``dataset_name``), ``nbytes`` to fetch."""

    model: str
    repo: str
    nbytes: int | None = None
    kind: str = "model"
    config: str | None = None


def task_datasets(tasks: list[str]) -> dict[str, tuple[str, str | None]]:
    """``{task: (dataset_path, dataset_name)}`` of lm-eval tasks (``TaskManager().task_index``;
    groups expanded to their tasks); pdsweep's ``pdsweep_*`` tasks and tasks without a hub
    dataset are left out. Nothing is downloaded."""
    from lm_eval.tasks import TaskManager

    tasks = [t for t in tasks if not t.startswith("pdsweep_")]
    if not tasks:
        return {}
    index = TaskManager().task_index
    out: dict[str, tuple[str, str | None]] = {}
    todo = list(tasks)
    while todo:
        name = todo.pop()
        e = index.get(name)
        cfg = (e.cfg or {}) if e is not None else {}
        if e is not None and e.kind.name in ("GROUP", "TAG"):
            todo += [str(t) for t in (cfg.get("task") or sorted(e.tags)) if not isinstance(t, dict)]
        elif cfg.get("dataset_path"):
            out[name] = (str(cfg["dataset_path"]), cfg.get("dataset_name"))
    return out


def _dataset_cached(path: str, name: str | None) -> bool:
    """Whether ``datasets`` loads ``path``/``name`` from its cache alone (``HF_DATASETS_OFFLINE``)."""
    import datasets  # type: ignore[import-untyped]  # datasets ships no type information

    old = datasets.config.HF_DATASETS_OFFLINE
    datasets.config.HF_DATASETS_OFFLINE = True
    try:
        datasets.load_dataset(path, name)
        return True
    except Exception:  # noqa: BLE001 - not cached (or not loadable offline): to fetch
        return False
    finally:
        datasets.config.HF_DATASETS_OFFLINE = old


def missing_datasets(tasks: list[str], cached: Callable[[str, str | None], bool] = _dataset_cached) -> list[Missing]:
    """The eval datasets of ``tasks`` not in the ``datasets`` cache."""
    return [
        Missing(task, path, kind="dataset", config=name)
        for task, (path, name) in sorted(task_datasets(tasks).items())
        if not cached(path, name)
    ]


def missing_models(models: Mapping[str, Any], cache: Callable[[str], Path | None] = hf_cache_dir) -> list[Missing]:
    """The hub models of ``models`` (catalogue name -> ``ModelSpec``) not in the HF cache."""
    return [
        Missing(name, m.hf_id)
        for name, m in sorted(models.items())
        if m.hf_id and m.tiny is None and not cache(m.hf_id)
    ]


def _partial(m: Missing) -> str:
    """``": a partial snapshot ... (missing: ...)"`` for a model partly in the cache, else ``""``."""
    why = hubcache.not_fetched(m.repo) if m.kind == "model" else ""
    return f": {why}" if why.startswith("a partial") else ""


def _offline(env: Mapping[str, str]) -> bool:
    return env.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on")


def repo_bytes(repo: str, token: str | None, kind: str = "model") -> int:
    """Bytes of the files of ``repo`` that :data:`PATTERNS` select (``HfApi.model_info`` with
    ``files_metadata``); a dataset: all its files (``HfApi.dataset_info``). Raises
    ``UserError`` naming the repo when the hub cannot say."""
    from fnmatch import fnmatch

    from huggingface_hub import HfApi

    try:
        api = HfApi()
        if kind == "dataset":
            d = api.dataset_info(repo, token=token, files_metadata=True, timeout=30)
            return sum(f.size or 0 for f in d.siblings or [])
        info = api.model_info(repo, token=token, files_metadata=True, timeout=30)
    except Exception as e:  # noqa: BLE001 - any hub failure: the repo cannot be sized, refuse
        raise UserError(f"pdsweep fetch: {repo}: the hub cannot list its files ({str(e).splitlines()[0]})") from None
    files = info.siblings or []
    return sum(f.size or 0 for f in files if any(fnmatch(f.rfilename.split("/")[-1], p) for p in PATTERNS))


def cache_root(env: Mapping[str, str]) -> Path:
    """The HF hub cache directory (``HF_HUB_CACHE`` / ``HF_HOME``, huggingface_hub.constants)."""
    from huggingface_hub import constants

    return Path(env.get("HF_HUB_CACHE") or constants.HF_HUB_CACHE)


def free_bytes(path: Path) -> int:
    """Free bytes of the filesystem holding ``path`` (its nearest existing parent)."""
    p = path
    while not p.exists() and p != p.parent:
        p = p.parent
    return shutil.disk_usage(p).free


def fetch(
    models: Mapping[str, Any],
    env: Mapping[str, str] | None = None,
    download: Callable[..., Any] | None = None,
    cache: Callable[[str], Path | None] = hf_cache_dir,
    datasets: list[Missing] | None = None,
) -> list[Missing]:
    """Download the missing hub models of ``models`` and the ``datasets`` (:func:`missing_datasets`);
    returns what was fetched (with bytes).
    Order: missing repos, offline refusal, sizes, the disk check, then the downloads. Raises
    ``UserError`` offline (naming every missing repo), when a size is unknown, or when the
    cache's disk has less free space than the total (bytes, GB)."""
    env = os.environ if env is None else env
    todo = missing_models(models, cache) + list(datasets or [])
    if not todo:
        return []
    names = ", ".join(f"{m.kind} {m.model} ({m.repo}{_partial(m)})" for m in todo)
    if _offline(env):
        raise UserError(
            f"pdsweep fetch: HF_HUB_OFFLINE is set and {len(todo)} are not in the HF cache: {names}; "
            "fetch them on a machine with hub access (`pdsweep fetch SWEEP`) and copy the cache, or give `path:`"
        )
    token = env.get("HF_TOKEN")
    sized = [replace(m, nbytes=repo_bytes(m.repo, token, m.kind)) for m in todo]
    need = int(sum(m.nbytes or 0 for m in sized) * HEADROOM)
    root = cache_root(env)
    free = free_bytes(root)
    if free < need:
        raise UserError(
            f"pdsweep fetch: {need / 1e9:.1f} GB needed for {names} "
            f"({', '.join(f'{m.repo} {(m.nbytes or 0) / 1e9:.1f} GB' for m in sized)}, +5 %), "
            f"{free / 1e9:.1f} GB free under {root}: nothing downloaded"
        )
    from huggingface_hub import snapshot_download

    dl = download or snapshot_download
    if any(m.kind == "dataset" for m in sized):
        from datasets import load_dataset
    for i, m in enumerate(sized, 1):
        partial = hubcache.snapshot(m.repo, root).path is not None if m.kind == "model" else False
        print(
            f"[{i}/{len(sized)}] {m.kind} {m.model}: {m.repo}, {(m.nbytes or 0) / 1e9:.1f} GB"
            + (" (resuming a partial snapshot)" if partial else ""),
            file=sys.stderr,
            flush=True,
        )
        if m.kind == "dataset":
            load_dataset(m.repo, m.config)
            continue
        dl(repo_id=m.repo, allow_patterns=list(PATTERNS), token=token, cache_dir=str(root))
        if cache(m.repo) is None:  # still partial (a shard the index maps but the hub lacks, a failed blob)
            raise UserError(
                f"pdsweep fetch: model {m.model}: {m.repo} is {hubcache.not_fetched(m.repo, root)} after the "
                "download: refused (vLLM would download the rest inside the startup budget); rerun `pdsweep fetch` "
                "to resume it"
            )
    return sized


def sweep_models(ls: Any, cells: list[Any]) -> dict[str, Any]:
    """Catalogue entries (name -> ``ModelSpec``) of the models ``cells`` use."""
    used = {c.model for c in cells}
    return {n: m for n, m in ls.catalogue.models.items() if n in used}
