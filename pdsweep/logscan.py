"""Find the first Python exception in a ``vllm serve`` log, so a failed cell says which
instance died and how (exception, file:line, the failing source line), not only the HTTP
status the proxy saw. vLLM prefixes every line of a child's traceback with
``(Worker pid=N) ERROR <date> <time> [file.py:line] ``; that prefix is stripped first.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

_PREFIX = re.compile(r"^\((?P<proc>[^)]*)\)\s+(?:ERROR|WARNING|INFO|CRITICAL)\s+\S+\s+\S+\s+\[[^\]]*\]\s?")
_FILE = re.compile(r'^\s*File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<func>\S+)')
_EXC = re.compile(r"^(?P<exc>[A-Za-z_][\w.]*(?:Error|Exception|Exit|Interrupt|Warning))(?::\s?(?P<msg>.*))?$")
MAX_LINES = 200_000  # a log this long is not read further (the first error comes early)


@dataclass(frozen=True)
class LoggedException:
    """``exc``: the exception type; ``message`` (may be empty); where it was raised:
    ``file`` shortened to its path from ``vllm/`` or ``pdsweep/`` when it has one, ``line``,
    ``func``, ``source`` (the failing source line as logged); ``process`` ("Worker pid=N")."""

    exc: str
    message: str
    file: str
    line: int
    func: str
    source: str
    process: str

    def describe(self) -> str:
        what = f"{self.exc}: {self.message}" if self.message else self.exc
        src = f" ({self.source})" if self.source else ""
        proc = f" in {self.process}" if self.process else ""
        return f"{what} at {self.file}:{self.line} {self.func}{src}{proc}"


def _short(path: str) -> str:
    for anchor in ("/vllm/", "/pdsweep/", "/nixl"):
        i = path.rfind(anchor)
        if i >= 0:
            return path[i + 1:]
    return path


def first_exception(log_path: Path) -> LoggedException | None:
    """The first traceback's exception in ``log_path`` with its innermost frame; None when the
    log has no traceback (or cannot be read)."""
    try:
        f = open(log_path, errors="replace")
    except OSError:
        return None
    with f:
        in_tb, frame, source, proc = False, None, "", ""
        for n, raw in enumerate(f):
            if n > MAX_LINES:
                break
            m = _PREFIX.match(raw)
            text = raw[m.end():] if m else raw
            text = text.rstrip("\n")
            if text.startswith("Traceback (most recent call last):"):
                in_tb, frame, source, proc = True, None, "", (m.group("proc") if m else "")
                continue
            if not in_tb:
                continue
            fm = _FILE.match(text)
            if fm:
                frame, source = fm, ""
                continue
            if frame is not None and not source and text.startswith("    ") and text.strip() \
                    and not set(text.strip()) <= set("^~ "):
                source = text.strip()
                continue
            em = _EXC.match(text.strip())
            if em and frame is not None:
                return LoggedException(em.group("exc"), (em.group("msg") or "").strip()[:300],
                                       _short(frame.group("file")), int(frame.group("line")), frame.group("func"),
                                       source[:200], proc)
    return None
