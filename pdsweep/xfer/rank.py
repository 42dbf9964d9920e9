"""The rank-process side of the transfer benchmark: one OS process per prefill rank and
per decode rank (``multiprocessing`` spawn), each with its own ``nixl_agent`` (UCX) whose
progress-thread delay is bounded (:func:`make_agent`). A rank gets everything it needs in
one typed, picklable config (:class:`PrefillRankConfig`, :class:`DecodeRankConfig`) and
talks to the parent (:mod:`pdsweep.xfer.session`) over a pipe: ``(command, argument)``
in, ``(kind, payload)`` out, ``("error", traceback)`` on any failure."""

from __future__ import annotations

import importlib
import os
import signal
import time
import traceback
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from pdsweep.plan.geometry import KVGeometry, Region
from pdsweep.plan.readplan import ReadPlan, handshake_ranks
from pdsweep.xfer.memory import SENTINEL, Buffer, RankLayout, Requests, pattern

DEFAULT_PROGRESS_DELAY_US = 1000


@dataclass(frozen=True)
class PrefillRankConfig:
    """One prefill rank: agent ``name``, the model's ``geometry``, this rank's buffer
    ``layout``, ``device`` (cpu | cuda) and CUDA ``gpu`` index (0 on cpu), the NIXL
    progress-thread ``delay_us`` (microseconds) and the pattern ``seed``."""

    name: str
    geometry: KVGeometry
    layout: RankLayout
    device: str
    gpu: int
    delay_us: int
    seed: int


@dataclass(frozen=True)
class DecodeRankConfig(PrefillRankConfig):
    """One decode rank: a prefill rank's fields plus its ``rank``, read ``plan`` and the
    ``requests``' page ids; per prefill rank, its buffer layout (``remote_layouts``) and
    CUDA device (``remote_dev``); ``remote_mem`` (``DRAM`` | ``VRAM``); ``ucx_log_dir``
    for UCX's protocol log (None: the caller set ``UCX_LOG_FILE``)."""

    rank: int
    plan: ReadPlan
    requests: Requests
    remote_layouts: dict[int, RankLayout]
    remote_dev: dict[int, int]
    remote_mem: str
    ucx_log_dir: str | None


# ---------------------------------------------------------------- NIXL agents
def make_agent(name: str, delay_us: int = DEFAULT_PROGRESS_DELAY_US, telemetry: bool = False) -> Any:
    """A ``nixl_agent`` with the UCX backend and a progress-thread delay of
    ``delay_us`` microseconds (``nixlAgentConfig.pthrDelay``; ``nixl_agent.__init__``
    in ``nixl_cu13/_api.py`` sets 0, so the config object is patched as it is built).
    Raises ``ValueError`` for ``delay_us < 1`` and ``RuntimeError`` when the bindings
    no longer have the field."""
    if delay_us < 1:
        raise ValueError("the progress-thread delay must be >= 1 us: 0 busy-spins a core (../shared/CPU.md)")
    import logging

    # the NIXL build for torch's CUDA major (scripts/device-check.sh sets it: nixl_cu12 beside a CUDA 12 torch)
    _api = importlib.import_module(f"{os.environ.get('PDSWEEP_NIXL_MODULE') or 'nixl_cu13'}._api")

    if not os.environ.get("NIXL_LOG_LEVEL"):
        logging.getLogger("nixl").setLevel(logging.WARNING)
    if not hasattr(_api.nixlBind.nixlAgentConfig(), "pthrDelay"):
        raise RuntimeError("nixl bindings have no nixlAgentConfig.pthrDelay; cannot bound the progress thread")
    real = _api.nixlBind.nixlAgent

    def build(agent_name: str, cfg: Any) -> Any:
        cfg.pthrDelay = delay_us
        return real(agent_name, cfg)

    _api.nixlBind.nixlAgent = build
    try:
        return _api.nixl_agent(name, _api.nixl_agent_config(backends=["UCX"], capture_telemetry=telemetry))
    finally:
        _api.nixlBind.nixlAgent = real


# ---------------------------------------------------------------- rank processes
def _serve(conn: Any, body: Any) -> None:
    """Run ``body()`` in a rank process; report an exception as ("error", traceback)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent stops us on Ctrl-C
    try:
        body()
    except (EOFError, BrokenPipeError):
        pass  # parent gone
    except BaseException:  # noqa: BLE001 - report everything to the parent
        try:
            conn.send(("error", traceback.format_exc()))
        except Exception:  # noqa: BLE001
            pass
    finally:
        conn.close()


def prefill_main(conn: Any, cfg: PrefillRankConfig) -> None:
    """Entry point of a prefill rank process: fill the cache with the pattern, serve
    reads until ``stop``, then report the notifications received."""

    def body() -> None:
        geom, lay = cfg.geometry, cfg.layout
        buf = Buffer(lay.nbytes, cfg.device, cfg.gpu)
        buf.host.fill(SENTINEL)
        for reg in geom.regions:
            u0, n = reg.shard(lay.tp, lay.rank)
            i = reg.index
            view = buf.host[lay.offsets[i] : lay.offsets[i] + lay.pool[i] * lay.page_bytes[i]]
            view.reshape(lay.pool[i], -1)[:] = pattern(
                i, np.arange(lay.pool[i]), u0 * reg.unit_bytes, (u0 + n) * reg.unit_bytes, cfg.seed
            )
        buf.push()
        agent = make_agent(cfg.name, cfg.delay_us)
        reg_descs = agent.register_memory([(buf.addr, buf.nbytes, buf.dev, "")], buf.mem)
        try:
            conn.send(("ready", {"name": cfg.name, "metadata": agent.get_agent_metadata(), "base": buf.addr}))
            serving, cpu0 = time.monotonic(), time.process_time()
            notifs: dict[str, list[str]] = {}

            def drain() -> None:
                for peer, msgs in agent.get_new_notifs().items():
                    notifs.setdefault(peer, []).extend(m.decode() for m in msgs)

            while not conn.poll(0.02):
                drain()
            msg, expected = conn.recv()
            assert msg == "stop"
            deadline = time.monotonic() + 3.0
            while sum(map(len, notifs.values())) < expected and time.monotonic() < deadline:
                drain()
                time.sleep(0.005)
            drain()
            conn.send(
                (
                    "notifs",
                    {"notifs": notifs, "cpu_s": time.process_time() - cpu0, "serving_s": time.monotonic() - serving},
                )
            )
        finally:
            agent.deregister_memory(reg_descs)

    _serve(conn, body)


class DecodeRank:
    """State of one decode rank process: agent, buffer, prepared descriptor lists."""

    def __init__(self, cfg: DecodeRankConfig):
        self.cfg = cfg
        self.geom, self.plan, self.lay, self.reqs = cfg.geometry, cfg.plan, cfg.layout, cfg.requests
        self.buf = Buffer(self.lay.nbytes, cfg.device, cfg.gpu)
        self.buf.reset()
        self.agent = make_agent(cfg.name, cfg.delay_us, telemetry=True)
        self.reg_descs = self.agent.register_memory([(self.buf.addr, self.buf.nbytes, self.buf.dev, "")], self.buf.mem)
        self.iteration = 0

    def connect(self, peers: dict[int, dict[str, Any]]) -> None:
        """Load peer metadata; prepare per-source local and remote descriptor lists
        (one descriptor per page per read, region-major like vLLM) and the per-request
        index lists into them."""
        self.names = {r: self.agent.add_remote_agent(p["metadata"]) for r, p in peers.items()}
        if isinstance(next(iter(self.names.values()), ""), bytes):
            self.names = {r: n.decode() for r, n in self.names.items()}
        self.handles: dict[int, tuple[Any, Any]] = {}
        self.index: dict[tuple[int, int], tuple[np.ndarray, np.ndarray]] = {}
        remote_lays = self.cfg.remote_layouts
        for rank in self.plan.transfers:
            reads = self.plan.reads_from(rank)
            loc, rem, bases = [], [], []
            base = 0
            for rd in reads:
                reg = self.geom.regions[rd.region]
                n = self.lay.pool[rd.region]
                pages = np.arange(n, dtype=np.uint64)
                laddr = self.lay.page_addr(self.buf.addr, rd.region, pages) + np.uint64(rd.local_offset)
                loc.append(self._descs(laddr, rd.nbytes, self.buf.dev))
                raddr = remote_lays[rank].page_addr(peers[rank]["base"], rd.region, pages) + np.uint64(rd.remote_offset)
                rem.append(self._descs(raddr, rd.nbytes, self.cfg.remote_dev[rank]))
                bases.append((base, reg))
                base += n
            lh = self.agent.prep_xfer_dlist("NIXL_INIT_AGENT", np.concatenate(loc), self.buf.mem)
            rh = self.agent.prep_xfer_dlist(self.names[rank], np.concatenate(rem), self.cfg.remote_mem)
            self.handles[rank] = (lh, rh)
            for q in range(len(self.reqs.decode_slots)):
                li: list[npt.ArrayLike] = []
                ri: list[npt.ArrayLike] = []
                for b, reg in bases:
                    if reg.per_request:
                        li.append([b + self.reqs.decode_slots[q]])
                        ri.append([b + self.reqs.prefill_slots[q]])
                    else:
                        li.append(b + np.asarray(self.reqs.decode_blocks[q]))
                        ri.append(b + np.asarray(self.reqs.prefill_blocks[q]))
                self.index[(q, rank)] = (np.concatenate(li).astype(np.int32), np.concatenate(ri).astype(np.int32))

    @staticmethod
    def _descs(addrs: np.ndarray, length: int, dev: int) -> np.ndarray:
        out = np.empty((len(addrs), 3), dtype=np.uint64)
        out[:, 0], out[:, 1], out[:, 2] = addrs, length, dev
        return out

    def iterate(self) -> dict[str, Any]:
        """Post every request's READs, send plan notifications, wait for DONE."""
        it, self.iteration = self.iteration, self.iteration + 1
        consumers = self.plan.notif_consumers
        xfers = []
        t0 = time.perf_counter()
        for q in range(len(self.reqs.decode_slots)):
            notif = f"req{q}-it{it}:{consumers}".encode()
            for rank in self.plan.transfers:
                lh, rh = self.handles[rank]
                li, ri = self.index[(q, rank)]
                h = self.agent.make_prepped_xfer("READ", lh, li, rh, ri, notif)
                if self.agent.transfer(h) == "ERR":
                    raise RuntimeError(f"NIXL READ from prefill rank {rank} failed to post")
                xfers.append(h)
            for rank in self.plan.notify_ranks:
                self.agent.send_notif(self.names[rank], notif)
        t_post = time.perf_counter()
        pending = list(xfers)
        while pending:
            still = []
            for h in pending:
                st = self.agent.check_xfer_state(h)
                if st == "ERR":
                    raise RuntimeError("NIXL READ failed (check_xfer_state returned ERR)")
                if st == "PROC":
                    still.append(h)
            pending = still
        t1 = time.perf_counter()
        descs = 0
        for h in xfers:
            descs += self.agent.get_xfer_telemetry(h).descCount
            self.agent.release_xfer_handle(h)
        return {"wall_s": t1 - t0, "post_s": t_post - t0, "nixl_descs": descs, "transfers": len(xfers)}

    def memcpy(self, nbytes: int, rounds: int = 3) -> float:
        """Best seconds of a host ``numpy.copyto`` of ``nbytes``."""
        src = np.full(max(nbytes, 1), 7, dtype=np.uint8)
        dst = np.empty_like(src)
        np.copyto(dst, src)
        best = float("inf")
        for _ in range(rounds):
            t0 = time.perf_counter()
            np.copyto(dst, src)
            best = min(best, time.perf_counter() - t0)
        return best

    def verify(self) -> dict[str, Any]:
        """Compare every byte of this rank's cache with what it should hold: for pages
        of a request, the prefill pattern of the units this rank holds; elsewhere the
        0xFF it started with. Mismatches are attributed to the prefill rank holding the
        unit (for replicated units, the first such rank of this rank's handshake
        group)."""
        host = self.buf.pull()
        P, D, d = self.plan.prefill_tp, self.plan.decode_tp, self.plan.decode_rank
        group = handshake_ranks(D, P, d)
        issues, stray, checked = [], 0, 0
        for reg in self.geom.regions:
            i = reg.index
            page = self.lay.page_bytes[i]
            start = self.lay.offsets[i]
            pool = host[start : start + self.lay.pool[i] * page].reshape(self.lay.pool[i], page)
            if reg.per_request:
                local, remote = list(self.reqs.decode_slots), list(self.reqs.prefill_slots)
            else:
                local = [b for q in self.reqs.decode_blocks for b in q]
                remote = [b for q in self.reqs.prefill_blocks for b in q]
            u0, n = reg.shard(D, d)
            got = pool[local]
            exp = pattern(i, np.asarray(remote), u0 * reg.unit_bytes, (u0 + n) * reg.unit_bytes, self.cfg.seed)
            bad = got != exp
            missing_cols = (bad & (got == SENTINEL)).sum(axis=0)
            bad_cols = bad.sum(axis=0)
            unused = np.setdiff1d(np.arange(self.lay.pool[i]), local)
            stray += int((pool[unused] != SENTINEL).sum())
            checked += pool.size
            if not bad_cols.any():
                continue
            owner = _column_owner(reg, P, D, d, group)
            for r in np.unique(owner):
                sel = owner == r
                miss, wrong = int(missing_cols[sel].sum()), int(bad_cols[sel].sum() - missing_cols[sel].sum())
                if miss or wrong:
                    issues.append(
                        {
                            "decode_rank": d,
                            "layer": reg.layer,
                            "kind": reg.kind,
                            "region": i,
                            "prefill_rank": int(r),
                            "missing_bytes": miss,
                            "wrong_bytes": wrong,
                            "expected_bytes": int(sel.sum()) * len(local),
                            "pages": int(bad[:, sel].any(axis=1).sum()),
                        }
                    )
        return {"issues": issues, "stray_bytes": stray, "checked_bytes": checked}

    def close(self) -> None:
        for lh, rh in getattr(self, "handles", {}).values():
            self.agent.release_dlist_handle(lh)
            self.agent.release_dlist_handle(rh)
        self.agent.deregister_memory(self.reg_descs)


def _column_owner(reg: Region, P: int, D: int, d: int, group: list[int]) -> np.ndarray:
    """Prefill rank owning each byte column of decode rank ``d``'s page of ``reg``."""
    u0, n = reg.shard(D, d)
    units = np.arange(u0, u0 + n)
    if P <= reg.units and reg.kind != "mla":
        owner_units = units // (reg.units // P)
    else:
        holders = [reg.holders(P, int(u)) for u in units]
        owner_units = np.array([next((r for r in hs if r in group), hs[0]) for hs in holders])
    return np.repeat(owner_units, reg.unit_bytes)


def decode_main(conn: Any, cfg: DecodeRankConfig) -> None:
    """Entry point of a decode rank process: run the parent's commands (``connect``,
    ``reset``, ``iterate``, ``memcpy``, ``verify``, ``stop``) one at a time."""

    def body() -> None:
        log_dir = cfg.ucx_log_dir
        if log_dir:
            os.environ["UCX_PROTO_INFO"] = "y"
            os.environ["UCX_LOG_FILE"] = os.path.join(log_dir, f"ucx-d{cfg.rank}.%p.log")
        dec = DecodeRank(cfg)
        try:
            conn.send(("ready", {"name": cfg.name}))
            while True:
                cmd, arg = conn.recv()
                if cmd == "connect":
                    dec.connect(arg)
                    conn.send(("ok", None))
                elif cmd == "reset":
                    dec.buf.reset()
                    conn.send(("ok", None))
                elif cmd == "iterate":
                    conn.send(("ok", dec.iterate()))
                elif cmd == "memcpy":
                    conn.send(("ok", dec.memcpy(arg)))
                elif cmd == "verify":
                    conn.send(("ok", dec.verify()))
                elif cmd == "stop":
                    conn.send(("ok", None))
                    return
                else:
                    raise ValueError(f"unknown command {cmd!r}")
        finally:
            dec.close()

    _serve(conn, body)
