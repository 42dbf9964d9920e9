"""Progress per cell and phase with elapsed time (rich); ``quiet`` prints one plain line
per cell start and end, for CI logs."""

from __future__ import annotations

import threading
import time

from rich.console import Console


class Progress:
    def __init__(self, total: int, quiet: bool = False, skipped: int = 0) -> None:
        self.total, self.quiet, self.done_n = total, quiet, 0
        self.console = Console(stderr=True, highlight=False, soft_wrap=True)
        self.t0: dict[str, float] = {}
        self.lock = threading.Lock()
        if skipped:
            self.console.print(f"resume: {skipped} cell(s) already final, skipped")

    def _elapsed(self, cell: str) -> str:
        return f"{time.monotonic() - self.t0.get(cell, time.monotonic()):7.1f}s"

    def phase(self, cell: str, phase: str) -> None:
        with self.lock:
            if cell not in self.t0:
                self.t0[cell] = time.monotonic()
                self.console.print(f"[{self.done_n + 1}/{self.total}] {cell}: start")
            elif not self.quiet:
                self.console.print(f"  {self._elapsed(cell)}  {cell}: {phase}")

    def done(self, cell: str, status: str, reason: str | None) -> None:
        with self.lock:
            self.done_n += 1
            color = {"ok": "green", "failed": "red"}.get(status, "yellow")
            why = f": {reason}" if reason else ""
            self.console.print(f"[{self.done_n}/{self.total}] {cell}: [{color}]{status}[/{color}] "
                               f"after {self._elapsed(cell).strip()}{why}")

    def close(self) -> None:
        pass
