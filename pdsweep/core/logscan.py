"""Find the first Python exception in a ``vllm serve`` log, so a failed cell says which
instance died and how (exception, file:line, the failing source line), not only the HTTP
status the proxy saw. vLLM prefixes every line of a child's traceback with
``(Worker pid=N) ERROR <date> <time> [file.py:line] ``; that prefix is stripped first.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pdsweep.core.logtags import NIXL_READ_TAG, NIXL_WRITE_TAG, READ_FAULT_TAG

_PREFIX = re.compile(r"^\((?P<proc>[^)]*)\)\s+(?:ERROR|WARNING|INFO|CRITICAL)\s+\S+\s+\S+\s+\[[^\]]*\]\s?")
_FILE = re.compile(r'^\s*File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<func>\S+)')
# the exception line of a traceback: a dotted name, optionally ": message", not indented
_EXC = re.compile(r"^(?P<exc>[A-Za-z_][\w.]*)(?::\s?(?P<msg>.*))?$")
_SHUTDOWN = "[shutdown]"  # vLLM's teardown log lines; tracebacks after them are the teardown's
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
            return path[i + 1 :]
    return path


def first_exception(log_path: Path, start: int = 0) -> LoggedException | None:
    """The first traceback's exception in ``log_path`` from byte ``start`` on (where this process
    began writing: a redeployed instance appends to its earlier attempt's log) with its innermost
    frame; None when the log has no traceback before vLLM's teardown (``[shutdown]`` lines: every
    instance that pdsweep stops logs an ``EngineDeadError`` then), or cannot be read. Tracebacks of
    different processes interleave in one log: each process prefix is parsed on its own."""
    try:
        f = open(log_path, errors="replace")
        f.seek(start)
    except (OSError, ValueError):
        return None
    state: dict[str, list] = {}  # process -> [frame match | None, source line]
    with f:
        for n, raw in enumerate(f):
            if n > MAX_LINES:
                break
            m = _PREFIX.match(raw)
            proc = m.group("proc") if m else ""
            text = (raw[m.end() :] if m else raw).rstrip("\n")
            if _SHUTDOWN in raw:
                return None  # teardown started: what follows is pdsweep stopping the instance
            if text.startswith("Traceback (most recent call last):"):
                state[proc] = [None, ""]
                continue
            st = state.get(proc)
            if st is None:
                continue
            fm = _FILE.match(text)
            if fm:
                st[0], st[1] = fm, ""
                continue
            if text.startswith("  "):  # the frame's source line, carets, or other indented detail
                if st[0] is not None and not st[1] and text.strip() and not set(text.strip()) <= set("^~ "):
                    st[1] = text.strip()
                continue
            em = _EXC.match(text.strip())
            frame = st[0]
            del state[proc]  # an unindented line ends this process's traceback either way
            if em and frame is not None:
                return LoggedException(
                    em.group("exc"),
                    (em.group("msg") or "").strip()[:300],
                    _short(frame.group("file")),
                    int(frame.group("line")),
                    frame.group("func"),
                    st[1][:200],
                    proc,
                )
    return None


# ------------------------------------------------------------------ NIXL READs per prefill rank
# One line per completed READ on a decode worker, logged by pdsweep.engine.readlog (the vLLM plugin,
# PDSWEEP_NIXL_READ_LOG=1): the prefill rank it read from and NIXL's own telemetry of it.
_READ = re.compile(
    NIXL_READ_TAG + r" remote_engine=(?P<engine>\S+) remote_rank=(?P<rank>\d+) "
    r"bytes=(?P<bytes>\d+) descs=(?P<descs>\d+)"
    r"(?: req=(?P<req>\S+) t0=(?P<t0>[\d.]+) t1=(?P<t1>[\d.]+) xfer_us=(?P<xfer_us>-?\d+)(?: tp=(?P<tp>[\d.]+))?)?"
)
# One line per completed WRITE on a prefill worker in push mode (PDSWEEP_NIXL_WRITE_LOG=1): the
# prefill rank that wrote (local_rank), the decode rank written to, NIXL's telemetry of it
_WRITE = re.compile(
    NIXL_WRITE_TAG + r" local_rank=(?P<local>\d+) remote_engine=(?P<engine>\S+) remote_rank=(?P<rank>\d+) "
    r"bytes=(?P<bytes>\d+) descs=(?P<descs>\d+)"
)
# The READ-failure drill (pdsweep.engine.readfault): one line per READ reported failed
_READ_FAULT = re.compile(READ_FAULT_TAG + r" read=\d+ every=\d+")
# vLLM's scheduler after a KV load failure (v1/core/sched/scheduler.py _handle_invalid_blocks)
_KV_LOAD_RECOVERED = re.compile(r"Recovered from KV load failure: (\d+) request\(s\) rescheduled")
_KV_LOAD_FAILED = re.compile(r"Failing (\d+) request\(s\) due to KV load failure")
# vLLM's NIXL worker on a failed READ (nixl/base_worker.py get_finished); the request goes to the
# scheduler as failed_recving, whose _handle_failed_recving recomputes it under
# kv_load_failure_policy recompute (num_computed_tokens = 0) without a log line of its own
_KV_LOAD_SKIPPED = re.compile(r"Skipping KV post-processing for failed request (\S+)")
# vLLM logs the TransferTopology of each prefill engine at the handshake (nixl/base_worker.py)
_TOPOLOGY = re.compile(r"Transfer plan: TransferTopology\((?P<body>[^)]*)\)")


def nixl_reads_by_rank(text: str) -> dict[str, dict[str, int]]:
    """Completed READs in a decode log, per prefill (remote) TP rank, summed over the
    prefill engines it read from: ``{"0": {"reads", "bytes", "descriptors", "engines"}}``
    (bytes: NIXL ``get_xfer_telemetry().totalBytes``); empty when no READ line is logged."""
    out: dict[str, dict[str, int]] = {}
    engines: dict[str, set[str]] = {}
    for m in _READ.finditer(text):
        r = out.setdefault(m.group("rank"), {"reads": 0, "bytes": 0, "descriptors": 0, "engines": 0})
        r["reads"] += 1
        r["bytes"] += int(m.group("bytes"))
        r["descriptors"] += int(m.group("descs"))
        engines.setdefault(m.group("rank"), set()).add(m.group("engine"))
    for rank, r in out.items():
        r["engines"] = len(engines[rank])
    return dict(sorted(out.items(), key=lambda kv: int(kv[0])))


def nixl_writes_by_rank(text: str) -> dict[str, dict[str, int]]:
    """Completed push WRITEs in prefill logs, per prefill (local) TP rank, summed over the decode
    ranks and engines written to: ``{"0": {"writes", "bytes", "descriptors", "decode_ranks"}}``
    (``decode_ranks``: distinct decode ranks written to; bytes: NIXL ``totalBytes``); empty when
    no WRITE line is logged (:mod:`pdsweep.engine.readlog`)."""
    out: dict[str, dict[str, int]] = {}
    targets: dict[str, set[tuple[str, str]]] = {}
    for m in _WRITE.finditer(text):
        r = out.setdefault(m.group("local"), {"writes": 0, "bytes": 0, "descriptors": 0, "decode_ranks": 0})
        r["writes"] += 1
        r["bytes"] += int(m.group("bytes"))
        r["descriptors"] += int(m.group("descs"))
        targets.setdefault(m.group("local"), set()).add((m.group("engine"), m.group("rank")))
    for rank, r in out.items():
        r["decode_ranks"] = len({d for _, d in targets[rank]})
    return dict(sorted(out.items(), key=lambda kv: int(kv[0])))


def read_fault_counts(text: str) -> dict[str, int]:
    """From a decode log: ``injected`` READ failures (:data:`READ_FAULT_TAG` lines); ``failed_loads``,
    the distinct requests whose KV load vLLM's NIXL worker reported failed (``failed_recving``:
    recomputed on decode under ``kv_load_failure_policy: recompute``, failed under ``fail``); the
    requests vLLM's scheduler ``recovered_reqs`` on its invalid-block path
    (``_handle_invalid_blocks``) and ``failed_reqs`` (``fail``), summed over its log lines."""
    return {
        "injected": len(_READ_FAULT.findall(text)),
        "failed_loads": len(set(_KV_LOAD_SKIPPED.findall(text))),
        "recovered_reqs": sum(int(n) for n in _KV_LOAD_RECOVERED.findall(text)),
        "failed_reqs": sum(int(n) for n in _KV_LOAD_FAILED.findall(text)),
    }


def transfer_topologies(text: str) -> list[dict[str, int | str]]:
    """The distinct ``TransferTopology(...)`` plans a decode log names, fields parsed
    (``tp_ratio``, ``local_tp``, ``remote_tp``, ``remote_block_len``, ...; ints where they are)."""
    seen: list[dict[str, int | str]] = []
    for m in _TOPOLOGY.finditer(text):
        plan: dict[str, int | str] = {}
        for part in m.group("body").split(","):
            key, _, val = part.strip().partition("=")
            if key:
                plan[key] = int(val) if val.lstrip("-").isdigit() else val
        if plan not in seen:
            seen.append(plan)
    return seen


def nixl_read_records(text: str) -> list[dict[str, Any]]:
    """Each completed READ line of a decode log that carries timing (pdsweep >= the repeats
    of issue 24): ``{rank, engine, req, bytes, descs, start_s, end_s, posted_s, xfer_us}``. The
    interval starts at ``t0`` (vLLM asked to read) and ends NIXL's ``xferDuration`` after the
    post: ``tp + xfer_us`` (``tp``: the READ posted, :mod:`pdsweep.engine.readlog`), ``t0 +
    xfer_us`` on lines without ``tp``, ``t1`` (vLLM saw it DONE) when NIXL gave no duration.
    ``posted_s`` (s; ``tp``, None on lines without it) and ``xfer_us`` (us; -1: NIXL gave none)
    as logged. Lines without timing are left out."""
    out = []
    for m in _READ.finditer(text):
        if m.group("t0") is None:
            continue
        t0, xfer = float(m.group("t0")), int(m.group("xfer_us"))
        posted = float(m.group("tp")) if m.group("tp") else t0
        end = posted + xfer / 1e6 if xfer >= 0 else float(m.group("t1"))
        out.append(
            {
                "rank": m.group("rank"),
                "engine": m.group("engine"),
                "req": m.group("req"),
                "bytes": int(m.group("bytes")),
                "descs": int(m.group("descs")),
                "start_s": t0,
                "end_s": max(end, t0),
                "posted_s": float(m.group("tp")) if m.group("tp") else None,
                "xfer_us": xfer,
            }
        )
    return out
