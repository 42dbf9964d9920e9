"""Where pdsweep's own files are: :data:`REPO`, the repository root (default results,
checkpoint cache and accuracy-task paths are under it); :func:`sha256_file`, the one file
digest (unfixed-baseline patched files, tiny-checkpoint fixtures)."""

import hashlib
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def sha256_file(path: Path) -> str:
    """Hex sha256 of a file's bytes, read in 1 MiB chunks. Raises ``OSError``."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()
