"""Host-wide claims on port blocks, so two ``pdsweep run`` on one host never pick the same one.

A block's ports are checked free (``bind``) before pdsweep hands them out, but ``vllm serve``
binds its HTTP port only after its imports and its NIXL side channel only once its KV cache
exists: tens of seconds on a CPU host in which a second run with the same
``defaults.port_base`` sees the block free and starts on it too (one of the two instances
then dies with ``EADDRINUSE``). A claim is an ``flock`` on ``<dir>/port-<base>.lock``, held
from the claim until the block is released; the kernel drops it when the process exits, so a
killed run leaves no stale claim. ``<dir>``: ``$PDSWEEP_PORT_LOCK_DIR``, else
``/tmp/pdsweep-port-locks`` (one per host; sticky and world-writable like ``/tmp`` so runs
of different users see each other's claims). Claims are per block start: runs of one sweep
(the same layout) exclude each other exactly; a block already listening is seen by the bind
check whatever its layout. Under ``--launcher slurm`` the ports are on other nodes, whose
allocation is the run's own.
"""

from __future__ import annotations

import fcntl
import os
import threading
import weakref
from pathlib import Path

LOCK_DIR_ENV = "PDSWEEP_PORT_LOCK_DIR"
DEFAULT_LOCK_DIR = "/tmp/pdsweep-port-locks"


def lock_dir() -> Path:
    """Where claims live: ``$PDSWEEP_PORT_LOCK_DIR`` or :data:`DEFAULT_LOCK_DIR`."""
    return Path(os.environ.get(LOCK_DIR_ENV) or DEFAULT_LOCK_DIR)


class HostClaims:
    """This process's claims on port blocks of the host, by block start port. Thread-safe."""

    def __init__(self, directory: Path | None = None) -> None:
        self.dir = directory if directory is not None else lock_dir()
        self.fds: dict[int, int] = {}
        self.lock = threading.Lock()
        # a claims object dropped without close() (a run that raised) still lets go of its flocks
        weakref.finalize(self, _close_all, self.fds)

    def claim(self, base: int) -> bool:
        """Claim the block starting at ``base``: True when this process now holds it (or held
        it already), False when another process (another run) holds it. Raises ``OSError``
        when the lock directory cannot be created or opened."""
        with self.lock:
            if base in self.fds:
                return True
            if not self.dir.is_dir():
                self.dir.mkdir(parents=True, exist_ok=True)
                os.chmod(self.dir, 0o1777)  # like /tmp: every user's runs claim here
            fd = os.open(self.dir / f"port-{base}.lock", os.O_RDONLY | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                return False
            self.fds[base] = fd
            return True

    def close(self) -> None:
        """Give up every claim (a run's end: nothing of it may keep a block from the next run)."""
        with self.lock:
            _close_all(self.fds)

    def drop(self, base: int) -> None:
        """Give up the claim on ``base`` (none held: nothing happens)."""
        with self.lock:
            fd = self.fds.pop(base, None)
        if fd is not None:
            os.close(fd)  # closes the open file description: the flock goes with it


def _close_all(fds: dict[int, int]) -> None:
    while fds:
        os.close(fds.popitem()[1])
