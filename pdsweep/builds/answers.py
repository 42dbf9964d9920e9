"""Answers of an interpreter's vLLM kept on disk, so planning a sweep asks vLLM each question
once per vLLM install, not once per plan: the backend probe (:mod:`pdsweep.builds.attnprobe`)
and the ``vllm serve`` argv check (:mod:`pdsweep.builds.argcheck`) both import vLLM, which
costs 10 s or more on a 2-core box before the first answer.

A store is one JSON file per (kind, install, asking code) under :func:`cache_dir`
(``$PDSWEEP_PROBE_CACHE``, default ``.cache/pdsweep/probes`` in the working directory), named by the install's
:func:`fingerprint`: the interpreter path plus path, size and mtime of vLLM's
``__init__.py``, ``_version.py`` and ``vllm*.dist-info/RECORD`` in its site-packages, and by
a digest of the probe's code. A reinstall or upgrade changes the fingerprint, a changed probe
the digest, so old answers are never read for a new vLLM or a mended probe; an interpreter
whose vLLM cannot be found on disk gets no store (every question asked live).
"""

from __future__ import annotations

import atexit
import hashlib
import json
import os
import threading
from functools import lru_cache
from pathlib import Path
from typing import Any

CACHE_ENV = "PDSWEEP_PROBE_CACHE"


def cache_dir() -> Path:
    """``$PDSWEEP_PROBE_CACHE``, else ``.cache/pdsweep/probes`` under the working directory
    (docs/matrix.md; never pdsweep's install checkout, which another clone may be)."""
    return Path(os.environ.get(CACHE_ENV) or Path.cwd() / ".cache" / "pdsweep" / "probes")


@lru_cache(maxsize=16)
def fingerprint(python: str) -> str | None:
    """Hex digest (16) naming the vLLM install ``python`` imports, read from disk (never by
    running it): ``<venv>/lib/python3*/site-packages/vllm``. None when there is none there."""
    files: list[Path] = []
    for site in sorted(Path(python).parent.parent.glob("lib/python3*/site-packages")):
        init = site / "vllm" / "__init__.py"
        if init.is_file():
            files += [init, site / "vllm" / "_version.py", *sorted(site.glob("vllm*.dist-info/RECORD"))]
    if not files:
        return None
    h = hashlib.sha256(python.encode())
    for f in files:
        if f.is_file():
            st = f.stat()
            h.update(f"{f}:{st.st_size}:{st.st_mtime_ns}".encode())
    return h.hexdigest()[:16]


class Store:
    """One kind of answer of one vLLM install: a dict loaded from and saved to one JSON file
    (atomically; a concurrent writer may drop entries, which are then asked again)."""

    def __init__(self, path: Path | None) -> None:
        self.path, self.lock, self.dirty = path, threading.Lock(), False
        self.data: dict[str, Any] = {}
        if path is not None and path.is_file():
            try:
                self.data = json.loads(path.read_text())
            except (OSError, ValueError):
                self.data = {}  # unreadable: ask again and overwrite

    def get(self, key: str) -> Any:
        with self.lock:
            return self.data.get(key)

    def put(self, key: str, value: Any) -> None:
        with self.lock:
            self.data[key] = value
            self.dirty = True

    def save(self) -> None:
        with self.lock:
            if self.path is None or not self.dirty:
                return
            try:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
                tmp.write_text(json.dumps(self.data, sort_keys=True))
                os.replace(tmp, self.path)
                self.dirty = False
            except OSError:
                pass  # a read-only checkout: answers stay in memory for this process


_STORES: dict[tuple[str, str, str, str], Store] = {}
_LOCK = threading.Lock()


def store(kind: str, python: str, code: str) -> Store:
    """The :class:`Store` of ``kind`` answers of ``python``'s vLLM given by the probe ``code``
    (its source: answers of other code are not read; memory only when ``python`` has no
    :func:`fingerprint`)."""
    key = (kind, python, str(cache_dir()), code)
    with _LOCK:
        if key not in _STORES:
            fp = fingerprint(python)
            digest = hashlib.sha256(code.encode()).hexdigest()[:8]
            _STORES[key] = Store(cache_dir() / f"{kind}-{fp}-{digest}.json" if fp else None)
        return _STORES[key]


def cold(kind: str, python: str, code: str) -> bool:
    """True when ``python``'s vLLM has no ``kind`` answer of probe ``code`` kept (its first
    plan, or no store): every question of a plan will then go to vLLM."""
    st = store(kind, python, code)
    with st.lock:
        return not st.data


def save_all() -> None:
    """Write every store with new answers (also at exit)."""
    with _LOCK:
        stores = list(_STORES.values())
    for s in stores:
        s.save()


def forget() -> None:
    """Drop the in-memory stores (saved first), so the next question reads the disk again."""
    save_all()
    with _LOCK:
        _STORES.clear()


atexit.register(save_all)
