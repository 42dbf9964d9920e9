"""The parent side of the transfer benchmark: :class:`TransferSession` spawns one
process per prefill and decode rank (:mod:`pdsweep.xfer.rank`), exchanges their NIXL
metadata, drives the timed iterations and always stops every process it started."""

from __future__ import annotations

import glob
import multiprocessing as mp
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pdsweep.measure.metrics import parse_ucx_proto_info
from pdsweep.plan.geometry import KVGeometry
from pdsweep.plan.readplan import ReadPlan, handshake_ranks
from pdsweep.xfer.memory import Requests, check_device, rank_layout
from pdsweep.xfer.rank import DEFAULT_PROGRESS_DELAY_US, DecodeRankConfig, PrefillRankConfig, decode_main, prefill_main


@dataclass(frozen=True)
class SessionOptions:
    """How a :class:`TransferSession` runs: cache memory on ``device`` (cpu | cuda), NIXL's
    progress-thread delay ``progress_delay_us`` (microseconds), ``timeout_s`` (seconds) per
    answer of a rank process, the pattern ``seed``."""

    device: str = "cpu"
    progress_delay_us: int = DEFAULT_PROGRESS_DELAY_US
    timeout_s: float = 120.0
    seed: int = 0


class TransferSession:
    """Prefill and decode rank processes for one configuration.

    Use as a context manager: entering spawns the ranks and exchanges metadata;
    leaving (also on exceptions and KeyboardInterrupt) stops them, terminating and then
    killing any that do not exit. Methods: :meth:`reset`, :meth:`iterate`,
    :meth:`memcpy`, :meth:`verify`, :meth:`notifications`.
    """

    def __init__(
        self,
        geometry: KVGeometry,
        prefill_tp: int,
        decode_tp: int,
        plans: list[ReadPlan],
        requests: Requests,
        opts: SessionOptions | None = None,
    ):
        o = opts or SessionOptions()
        self.geometry, self.P, self.D, self.plans, self.requests = geometry, prefill_tp, decode_tp, plans, requests
        self.device, self.delay_us, self.timeout_s, self.seed = o.device, o.progress_delay_us, o.timeout_s, o.seed
        for d, p in enumerate(plans):
            bad = [r for r in (*p.transfers, *p.notify_ranks) if not 0 <= r < prefill_tp]
            fits = (p.prefill_tp, p.decode_tp, p.decode_rank) == (prefill_tp, decode_tp, d)
            if not fits or bad or len(plans) != decode_tp:
                raise ValueError(
                    f"plan {d} does not fit prefill TP {prefill_tp} / decode TP {decode_tp} (bad ranks: {bad})"
                )
        self.procs: list[mp.process.BaseProcess] = []
        self.pconns: list[Any] = []
        self.dconns: list[Any] = []
        self.iterations = 0
        self.ucx_dir: str | None = None
        self.notifs: dict[int, dict[str, Any]] | None = None
        self.transport = "unknown"

    def _gpu(self, index: int) -> int:
        if self.device != "cuda":
            return 0
        import torch

        return index % torch.cuda.device_count()

    def __enter__(self) -> TransferSession:
        try:
            self._start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _spawn(self, target: Any, cfg: PrefillRankConfig) -> Any:
        ctx = mp.get_context("spawn")
        parent, child = ctx.Pipe()
        p = ctx.Process(target=target, args=(child, cfg), name=cfg.name, daemon=True)
        p.start()
        child.close()
        self.procs.append(p)
        return parent

    def _start(self) -> None:
        check_device(self.device)
        if not os.environ.get("UCX_LOG_FILE"):
            self.ucx_dir = tempfile.mkdtemp(prefix="pdsweep-ucx-")
        pool = (self.requests.attn_pool, self.requests.ssm_pool)
        p_lays = {r: rank_layout(self.geometry, self.P, r, *pool) for r in range(self.P)}
        tag = f"{os.getpid()}-{id(self) & 0xFFFF:x}"
        for r in range(self.P):
            pcfg = PrefillRankConfig(
                f"pdsweep-p{r}-{tag}", self.geometry, p_lays[r], self.device, self._gpu(r), self.delay_us, self.seed
            )
            self.pconns.append(self._spawn(prefill_main, pcfg))
        for d, plan in enumerate(self.plans):
            dcfg = DecodeRankConfig(
                f"pdsweep-d{d}-{tag}",
                self.geometry,
                rank_layout(self.geometry, self.D, d, *pool),
                self.device,
                self._gpu(self.P + d),
                self.delay_us,
                self.seed,
                rank=d,
                plan=plan,
                requests=self.requests,
                remote_layouts=p_lays,
                remote_dev={r: self._gpu(r) for r in range(self.P)},
                remote_mem="VRAM" if self.device == "cuda" else "DRAM",
                ucx_log_dir=self.ucx_dir,
            )
            self.dconns.append(self._spawn(decode_main, dcfg))
        peers = {r: self._recv(self.pconns[r], r, "prefill")[1] for r in range(self.P)}
        for d in range(self.D):
            self._recv(self.dconns[d], self.P + d, "decode")
        for d, plan in enumerate(self.plans):
            wanted = set(plan.transfers) | set(plan.notify_ranks) | set(handshake_ranks(self.D, self.P, d))
            self.dconns[d].send(("connect", {r: peers[r] for r in sorted(wanted)}))
        for d in range(self.D):
            self._recv(self.dconns[d], self.P + d, "decode")

    def _recv(self, conn: Any, proc_index: int, role: str) -> tuple[str, Any]:
        """Next message from a rank; raises ``RuntimeError`` on an error report, an
        exit, or ``timeout_s`` without a message."""
        proc = self.procs[proc_index]
        deadline = time.monotonic() + self.timeout_s
        while not conn.poll(0.1):
            if not proc.is_alive() and not conn.poll(0):
                raise RuntimeError(f"{role} rank process {proc.name} exited with code {proc.exitcode}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"{role} rank process {proc.name}: no answer within {self.timeout_s:.0f} s")
        try:
            kind, payload = conn.recv()
        except EOFError:
            raise RuntimeError(f"{role} rank process {proc.name} closed its pipe (exit code {proc.exitcode})") from None
        if kind == "error":
            raise RuntimeError(f"{role} rank process {proc.name} failed:\n{payload}")
        return kind, payload

    def _all_decode(self, cmd: str, arg: Any = None) -> list[Any]:
        for c in self.dconns:
            c.send((cmd, arg))
        return [self._recv(c, self.P + d, "decode")[1] for d, c in enumerate(self.dconns)]

    def reset(self) -> None:
        """Refill every decode cache with 0xFF (untimed preparation of an iteration)."""
        self._all_decode("reset")

    def iterate(self) -> list[dict[str, Any]]:
        """One timed iteration on all decode ranks at once: per rank ``wall_s`` (first
        post to last DONE), ``post_s``, ``nixl_descs`` (after NIXL merging) and
        ``transfers``."""
        self.iterations += 1
        return self._all_decode("iterate")

    def memcpy(self, nbytes_per_rank: list[int]) -> list[float]:
        """Best host-memcpy seconds per decode rank for its bytes, all ranks at once."""
        for c, n in zip(self.dconns, nbytes_per_rank):
            c.send(("memcpy", n))
        return [self._recv(c, self.P + d, "decode")[1] for d, c in enumerate(self.dconns)]

    def verify(self) -> list[dict[str, Any]]:
        """Per decode rank: ``issues`` (mismatched bytes by layer, kind, prefill rank),
        ``stray_bytes`` (written outside the request's pages), ``checked_bytes``."""
        return self._all_decode("verify")

    def notifications(self) -> dict[int, dict[str, Any]]:
        """Stop the prefill ranks; per rank ``notifs`` (messages by sender agent),
        ``cpu_s`` (process CPU seconds while serving) and ``serving_s`` (wall seconds
        from metadata sent to stop)."""
        if self.notifs is None:
            per_rank = {r: 0 for r in range(self.P)}
            for plan in self.plans:
                for r in set(plan.transfers) | set(plan.notify_ranks):
                    per_rank[r] += self.iterations * len(self.requests.decode_slots)
            for r, c in enumerate(self.pconns):
                c.send(("stop", per_rank[r]))
            self.notifs = {r: self._recv(c, r, "prefill")[1] for r, c in enumerate(self.pconns)}
        return self.notifs

    def ucx_transport(self) -> str:
        """UCX transports of the READ protocol (``UCX_PROTO_INFO``), or 'unknown'."""
        if not self.ucx_dir:
            return "unknown (UCX_LOG_FILE is set by the caller)"
        text = ""
        for f in sorted(glob.glob(os.path.join(self.ucx_dir, "ucx-d*.log"))):
            text += Path(f).read_text(errors="replace")
        found = parse_ucx_proto_info(text)
        return ", ".join(found) if found else "unknown"

    def close(self) -> None:
        """Stop every rank: polite stop, then terminate, then kill; always joins."""
        for c in self.dconns:
            try:
                c.send(("stop", None))
            except (OSError, ValueError):
                pass
        if self.notifs is None:
            for c in self.pconns:
                try:
                    c.send(("stop", 0))
                except (OSError, ValueError):
                    pass
        deadline = time.monotonic() + 5
        for p in self.procs:
            p.join(timeout=max(0.1, deadline - time.monotonic()))
        for p in self.procs:
            if p.is_alive():
                p.terminate()
                p.join(timeout=2)
            if p.is_alive():
                p.kill()
                p.join()
        for c in self.pconns + self.dconns:
            c.close()
        self.procs, self.pconns, self.dconns = [], [], []
        if self.ucx_dir:
            self.transport = self.ucx_transport()
            shutil.rmtree(self.ucx_dir, ignore_errors=True)
            self.ucx_dir = None
