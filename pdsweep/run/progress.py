"""Progress per cell and phase with elapsed time (rich); ``quiet`` prints one plain line
per cell start and end, for CI logs. Either way a cell whose phase has printed nothing for
:data:`HEARTBEAT_S` gets a ``still in <phase>`` line, so a log never sits silent for minutes
(startup of a big model, a long eval)."""

from __future__ import annotations

import threading
import time

from rich.console import Console

HEARTBEAT_S = 25.0  # a line per running cell at least this often (under 30 s)


class Progress:
    def __init__(self, total: int, quiet: bool = False, skipped: int = 0) -> None:
        self.total, self.quiet, self.done_n, self.started_n = total, quiet, 0, 0
        self.console = Console(stderr=True, highlight=False, soft_wrap=True)
        self.t0: dict[str, float] = {}
        self.lock = threading.Lock()
        self.current: dict[str, str] = {}  # running cell -> phase
        self.last: dict[str, float] = {}  # running cell -> when its last line was printed
        self._stop = threading.Event()
        if skipped:
            self.console.print(f"resume: {skipped} cell(s) already final, skipped")
        threading.Thread(target=self._heartbeat, name="progress-heartbeat", daemon=True).start()

    def _heartbeat(self) -> None:
        while not self._stop.wait(min(HEARTBEAT_S, 5.0)):
            with self.lock:
                t = time.monotonic()
                for cell, phase in self.current.items():
                    if t - self.last.get(cell, t) >= HEARTBEAT_S:
                        self.last[cell] = t
                        self.console.print(f"  {self._elapsed(cell)}  {cell}: still in {phase}")

    def _elapsed(self, cell: str) -> str:
        return f"{time.monotonic() - self.t0.get(cell, time.monotonic()):7.1f}s"

    def phase(self, cell: str, phase: str) -> None:
        with self.lock:
            self.current[cell], self.last[cell] = phase, time.monotonic()
            if cell not in self.t0:
                self.t0[cell], self.started_n = time.monotonic(), self.started_n + 1
                # starts count starts: a build pair (or GPU lanes) starts cells before any ends
                self.console.print(f"[{self.started_n}/{self.total}] {cell}: start")
            elif not self.quiet:
                self.console.print(f"  {self._elapsed(cell)}  {cell}: {phase}")

    def done(self, cell: str, status: str, reason: str | None, expect_fail: bool = False) -> None:
        """A cell's end line. ``expect_fail``: the sweep declares the cell ``expect: fail``; its
        line says so in yellow, "failed (expect: fail)" or "ok (expect: fail)" (a wrong answer
        is found by the gate's checks): the gate decides whether it is that failure (XFAIL)."""
        with self.lock:
            self.current.pop(cell, None)
            self.done_n += 1
            color = {"ok": "green", "failed": "red"}.get(status, "yellow")
            if expect_fail:
                color, status = "yellow", f"{status} (expect: fail)"
            why = f": {reason}" if reason else ""
            self.console.print(
                f"[{self.done_n}/{self.total}] {cell}: [{color}]{status}[/{color}] "
                f"after {self._elapsed(cell).strip()}{why}"
            )

    def close(self) -> None:
        self._stop.set()
