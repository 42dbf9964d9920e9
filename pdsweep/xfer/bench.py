"""Real NIXL KV-transfer benchmark: prefill ranks serve, decode ranks READ by a plan.

One OS process per prefill rank and per decode rank (``multiprocessing`` spawn), each
with its own ``nixl_agent`` (UCX backend) whose progress-thread delay is set
(``nixlAgentConfig.pthrDelay``, microseconds; the Python ``nixl_agent`` hard-codes 0,
which busy-spins a core: ../shared/CPU.md). Agent metadata goes through pipes.

Prefill rank ``r`` fills every page of every region with a pattern of (region,
prefill page id, byte offset in the TP1 page), restricted to the units it holds
(:meth:`geometry.Region.shard`), so a byte's value says which layer, page and prefill
rank it belongs to. Pattern bytes are 0..254; decode memory starts as 0xFF, so an
unread byte is always seen. Decode ranks execute their :class:`readplan.ReadPlan` per
request with permuted page ids (NIXL merges contiguous descriptors: CPU.md), send the
plan's notifications, and verify every byte of their cache against the pattern.

Units: bytes, seconds, GB/s = 1e9 bytes/s. Transfer time is measured in each decode
rank from the first ``make_prepped_xfer`` to the last ``DONE``; the host memcpy
baseline copies the same number of bytes with ``numpy.copyto`` in the same processes.
"""

from __future__ import annotations

import argparse
import glob
import multiprocessing as mp
import os
import shutil
import signal
import statistics
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from ..spec import ModelSpec
from ..metrics import parse_ucx_proto_info
from .geometry import KVGeometry, Region, kv_geometry
from .readplan import PLANS, ReadPlan, UnfixedPlanAsserts, build_read_plan, handshake_ranks

DEFAULT_PROGRESS_DELAY_US = 1000
SENTINEL = 0xFF
_ALIGN = 4096
_M1 = np.uint64(0xFF51AFD7ED558CCD)
_M2 = np.uint64(0xC4CEB9FE1A85EC53)
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


# ---------------------------------------------------------------- pattern and layout
def pattern(region: int, pages: np.ndarray, start: int, stop: int, seed: int = 0) -> np.ndarray:
    """Bytes ``[start, stop)`` of the TP1 page ``pages`` (prefill page ids) of region
    ``region``: a ``(len(pages), stop - start)`` uint8 array, values 0..254 (never
    :data:`SENTINEL`). Deterministic in (seed, region, page, byte offset)."""
    pages = np.asarray(pages, dtype=np.uint64)
    w0, w1 = start // 4, (stop + 3) // 4
    keys = (np.uint64(seed) << np.uint64(48)) + (np.uint64(region) << np.uint64(24)) + pages
    x = keys[:, None] * _GOLDEN + np.arange(w0, w1, dtype=np.uint64)[None, :]
    x ^= x >> np.uint64(33)
    x *= _M1
    x ^= x >> np.uint64(33)
    x *= _M2
    x ^= x >> np.uint64(33)
    out = x.astype(np.uint32).view(np.uint8)[:, start - 4 * w0 : stop - 4 * w0]
    return np.ascontiguousarray(out % np.uint8(255))


@dataclass(frozen=True)
class RankLayout:
    """Where each region's page pool lies in one rank's buffer (bytes)."""

    tp: int
    rank: int
    offsets: tuple[int, ...]
    page_bytes: tuple[int, ...]
    pool: tuple[int, ...]
    nbytes: int

    def page_addr(self, base: int, region: int, page: np.ndarray | int) -> np.ndarray:
        return base + self.offsets[region] + np.asarray(page, dtype=np.uint64) * self.page_bytes[region]


def rank_layout(geometry: KVGeometry, tp: int, rank: int, attn_pool: int, ssm_pool: int) -> RankLayout:
    """Regions one after another, each ``pool x page_bytes``, 4 KiB aligned."""
    offsets, pages, pools, off = [], [], [], 0
    for reg in geometry.regions:
        n = ssm_pool if reg.per_request else attn_pool
        offsets.append(off)
        pages.append(reg.page_bytes(tp))
        pools.append(n)
        off += -(-n * reg.page_bytes(tp) // _ALIGN) * _ALIGN
    return RankLayout(tp, rank, tuple(offsets), tuple(pages), tuple(pools), off)


@dataclass(frozen=True)
class Requests:
    """Page ids per request: ``*_blocks[q]`` attention blocks, ``*_slots[q]`` SSM slot.
    Prefill ids are shared by all prefill ranks (one scheduler), decode ids by all
    decode ranks; both are random permutations of their pools."""

    prefill_blocks: tuple[tuple[int, ...], ...]
    decode_blocks: tuple[tuple[int, ...], ...]
    prefill_slots: tuple[int, ...]
    decode_slots: tuple[int, ...]
    attn_pool: int
    ssm_pool: int


def make_requests(requests: int, blocks: int, seed: int = 0) -> Requests:
    """``requests`` requests of ``blocks`` blocks each, from pools of
    ``requests * blocks + max(1, blocks // 2)`` blocks and ``requests + 1`` slots."""
    if requests < 1 or blocks < 1:
        raise ValueError(f"requests and blocks must be >= 1 (got {requests}, {blocks})")
    rng = np.random.default_rng(seed)
    attn_pool, ssm_pool = requests * blocks + max(1, blocks // 2), requests + 1
    pb, db = rng.permutation(attn_pool), rng.permutation(attn_pool)
    ps, ds = rng.permutation(ssm_pool), rng.permutation(ssm_pool)

    def split(a: np.ndarray) -> tuple[tuple[int, ...], ...]:
        return tuple(tuple(int(x) for x in a[q * blocks : (q + 1) * blocks]) for q in range(requests))

    prefill_slots, decode_slots = tuple(int(x) for x in ps[:requests]), tuple(int(x) for x in ds[:requests])
    return Requests(split(pb), split(db), prefill_slots, decode_slots, attn_pool, ssm_pool)


# ---------------------------------------------------------------- memory
class _Buffer:
    """One registered buffer: host numpy (DRAM) or a torch CUDA tensor (VRAM)."""

    def __init__(self, nbytes: int, device: str, gpu: int = 0):
        self.device, self.gpu = device, gpu
        if device == "cuda":
            import torch

            self.tensor = torch.empty(nbytes, dtype=torch.uint8, device=f"cuda:{gpu}")
            self.addr, self.mem, self.dev = self.tensor.data_ptr(), "VRAM", gpu
            self.host = np.empty(nbytes, dtype=np.uint8)  # staging image
        else:
            self.host = np.empty(nbytes, dtype=np.uint8)
            self.addr, self.mem, self.dev = self.host.ctypes.data, "DRAM", 0
        self.nbytes = nbytes

    def push(self) -> None:
        """Host image -> device (no-op for DRAM)."""
        if self.device == "cuda":
            import torch

            self.tensor.copy_(torch.from_numpy(self.host))
            torch.cuda.synchronize(self.gpu)

    def pull(self) -> np.ndarray:
        """Device -> host image; returns it."""
        if self.device == "cuda":
            import torch

            torch.cuda.synchronize(self.gpu)
            self.host[:] = self.tensor.cpu().numpy()
        return self.host

    def reset(self) -> None:
        if self.device == "cuda":
            self.tensor.fill_(SENTINEL)
        else:
            self.host.fill(SENTINEL)


def check_device(device: str) -> None:
    """Raise ``UserError`` when ``device`` cannot be used here (``cuda`` needs torch with
    CUDA and a visible GPU)."""
    from ..errors import UserError

    if device == "cpu":
        return
    if device != "cuda":
        raise UserError(f"device must be cpu or cuda, got {device!r}")
    try:
        import torch
    except ImportError:
        raise UserError("--device cuda needs torch with CUDA; torch is not importable") from None
    if not torch.cuda.is_available():
        raise UserError(f"--device cuda needs torch with CUDA; torch {torch.__version__} sees no CUDA device")


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

    from nixl_cu13 import _api

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


def _prefill_main(conn: Any, cfg: dict[str, Any]) -> None:
    def body() -> None:
        geom: KVGeometry = cfg["geometry"]
        lay: RankLayout = cfg["layout"]
        buf = _Buffer(lay.nbytes, cfg["device"], cfg["gpu"])
        buf.host.fill(SENTINEL)
        for reg in geom.regions:
            u0, n = reg.shard(lay.tp, lay.rank)
            i = reg.index
            view = buf.host[lay.offsets[i] : lay.offsets[i] + lay.pool[i] * lay.page_bytes[i]]
            view.reshape(lay.pool[i], -1)[:] = pattern(i, np.arange(lay.pool[i]), u0 * reg.unit_bytes,
                                                       (u0 + n) * reg.unit_bytes, cfg["seed"])
        buf.push()
        agent = make_agent(cfg["name"], cfg["delay_us"])
        reg_descs = agent.register_memory([(buf.addr, buf.nbytes, buf.dev, "")], buf.mem)
        try:
            conn.send(("ready", {"name": cfg["name"], "metadata": agent.get_agent_metadata(), "base": buf.addr}))
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
            conn.send(("notifs", {"notifs": notifs, "cpu_s": time.process_time() - cpu0,
                                  "serving_s": time.monotonic() - serving}))
        finally:
            agent.deregister_memory(reg_descs)

    _serve(conn, body)


class _Decode:
    """State of one decode rank process: agent, buffer, prepared descriptor lists."""

    def __init__(self, cfg: dict[str, Any]):
        self.cfg = cfg
        self.geom: KVGeometry = cfg["geometry"]
        self.plan: ReadPlan = cfg["plan"]
        self.lay: RankLayout = cfg["layout"]
        self.reqs: Requests = cfg["requests"]
        self.buf = _Buffer(self.lay.nbytes, cfg["device"], cfg["gpu"])
        self.buf.reset()
        self.agent = make_agent(cfg["name"], cfg["delay_us"], telemetry=True)
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
        remote_lays: dict[int, RankLayout] = self.cfg["remote_layouts"]
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
                rem.append(self._descs(raddr, rd.nbytes, self.cfg["remote_dev"][rank]))
                bases.append((base, reg))
                base += n
            lh = self.agent.prep_xfer_dlist("NIXL_INIT_AGENT", np.concatenate(loc), self.buf.mem)
            rh = self.agent.prep_xfer_dlist(self.names[rank], np.concatenate(rem), self.cfg["remote_mem"])
            self.handles[rank] = (lh, rh)
            for q in range(len(self.reqs.decode_slots)):
                li, ri = [], []
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
            exp = pattern(i, np.asarray(remote), u0 * reg.unit_bytes, (u0 + n) * reg.unit_bytes, self.cfg["seed"])
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
                    issues.append({
                        "decode_rank": d, "layer": reg.layer, "kind": reg.kind, "region": i, "prefill_rank": int(r),
                        "missing_bytes": miss, "wrong_bytes": wrong, "expected_bytes": int(sel.sum()) * len(local),
                        "pages": int(bad[:, sel].any(axis=1).sum()),
                    })
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


def _decode_main(conn: Any, cfg: dict[str, Any]) -> None:
    def body() -> None:
        log_dir = cfg["ucx_log_dir"]
        if log_dir:
            os.environ["UCX_PROTO_INFO"] = "y"
            os.environ["UCX_LOG_FILE"] = os.path.join(log_dir, f"ucx-d{cfg['rank']}.%p.log")
        dec = _Decode(cfg)
        try:
            conn.send(("ready", {"name": cfg["name"]}))
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


# ---------------------------------------------------------------- session (parent side)
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
        device: str = "cpu",
        progress_delay_us: int = DEFAULT_PROGRESS_DELAY_US,
        timeout_s: float = 120.0,
        seed: int = 0,
    ):
        self.geometry, self.P, self.D, self.plans, self.requests = geometry, prefill_tp, decode_tp, plans, requests
        self.device, self.delay_us, self.timeout_s, self.seed = device, progress_delay_us, timeout_s, seed
        for d, p in enumerate(plans):
            bad = [r for r in (*p.transfers, *p.notify_ranks) if not 0 <= r < prefill_tp]
            fits = (p.prefill_tp, p.decode_tp, p.decode_rank) == (prefill_tp, decode_tp, d)
            if not fits or bad or len(plans) != decode_tp:
                raise ValueError(f"plan {d} does not fit prefill TP {prefill_tp} / decode TP {decode_tp} "
                                 f"(bad ranks: {bad})")
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

    def _spawn(self, target: Any, cfg: dict[str, Any]) -> Any:
        ctx = mp.get_context("spawn")
        parent, child = ctx.Pipe()
        p = ctx.Process(target=target, args=(child, cfg), name=cfg["name"], daemon=True)
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
        common = {"geometry": self.geometry, "device": self.device, "delay_us": self.delay_us, "seed": self.seed}
        tag = f"{os.getpid()}-{id(self) & 0xFFFF:x}"
        for r in range(self.P):
            cfg = {**common, "name": f"pdsweep-p{r}-{tag}", "layout": p_lays[r], "gpu": self._gpu(r)}
            self.pconns.append(self._spawn(_prefill_main, cfg))
        for d, plan in enumerate(self.plans):
            cfg = {
                **common, "name": f"pdsweep-d{d}-{tag}", "rank": d, "plan": plan, "requests": self.requests,
                "layout": rank_layout(self.geometry, self.D, d, *pool), "remote_layouts": p_lays,
                "remote_dev": {r: self._gpu(r) for r in range(self.P)},
                "remote_mem": "VRAM" if self.device == "cuda" else "DRAM",
                "gpu": self._gpu(self.P + d), "ucx_log_dir": self.ucx_dir,
            }
            self.dconns.append(self._spawn(_decode_main, cfg))
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


# ---------------------------------------------------------------- public API
def plans_for(
    geometry: KVGeometry, prefill_tp: int, decode_tp: int, plan: str = "fixed", mapping: str = "auto"
) -> list[ReadPlan]:
    """One :class:`ReadPlan` per decode rank."""
    return [build_read_plan(geometry, prefill_tp, decode_tp, d, plan, mapping) for d in range(decode_tp)]  # type: ignore[arg-type]


def _plan_summary(plan: ReadPlan, geometry: KVGeometry, blocks: int) -> dict[str, Any]:
    return {
        "decode_rank": plan.decode_rank,
        "tp_ratio": plan.tp_ratio,
        "mapping": plan.mapping.impl,
        "attention_source_ranks": list(plan.mapping.attention_ranks),
        "ssm_source_ranks": list(plan.mapping.ssm_ranks),
        "read_ranks": list(plan.transfers),
        "notify_ranks": list(plan.notify_ranks),
        "bytes_per_request_by_rank": {str(r): plan.bytes_from(r, geometry, blocks) for r in plan.transfers},
        "descriptors_per_request": plan.descriptors_per_request(geometry, blocks),
        "upstream_notes": list(plan.upstream_notes),
    }


def run_transfer_bench(
    model_name: str,
    model: ModelSpec,
    prefill_tp: int,
    decode_tp: int,
    block_size: int = 16,
    blocks: int = 64,
    plan: str = "fixed",
    device: str = "cpu",
    verify: bool = True,
    *,
    requests: int = 1,
    iters: int = 5,
    warmup: int = 1,
    seed: int = 0,
    progress_delay_us: int = DEFAULT_PROGRESS_DELAY_US,
    mapping: str = "auto",
    timeout_s: float = 120.0,
) -> dict[str, Any]:
    """Run the NIXL benchmark for ``model`` at prefill/decode TP and return a JSON-able
    result: ``config``, ``plans`` (per decode rank), ``ranks`` (per-rank stats),
    ``gbps`` (all decode ranks' bytes / median slowest-rank wall time),
    ``memcpy_gbps`` (same bytes, host ``numpy.copyto``, ranks in parallel), ``ratio``,
    ``transport``, ``notifications`` and ``verification`` ``{ok, missing, wrong,
    stray_bytes, checked_bytes}`` (``ok`` is None when ``verify`` is False).

    ``blocks`` attention blocks of ``block_size`` tokens per request; each request also
    moves one SSM state page per SSM layer. Raises ``ValueError`` (bad model geometry,
    TP sizes, plan, device) and ``RuntimeError`` (NIXL or a rank process failed).
    """
    if plan not in PLANS:
        raise ValueError(f"plan must be one of {', '.join(PLANS)}, got {plan!r}")
    if iters < 1 or warmup < 0:
        raise ValueError("iters must be >= 1 and warmup >= 0")
    geometry = kv_geometry(model_name, model, block_size, (prefill_tp, decode_tp))
    plans = plans_for(geometry, prefill_tp, decode_tp, plan, mapping)
    reqs = make_requests(requests, blocks, seed)
    nbytes = bytes_per_rank(plans, geometry, blocks, requests)
    runs: list[list[dict[str, Any]]] = []
    with TransferSession(geometry, prefill_tp, decode_tp, plans, reqs, device, progress_delay_us, timeout_s, seed) as s:
        for i in range(warmup + iters):
            s.reset()
            out = s.iterate()
            if i >= warmup:
                runs.append(out)
        memcpy_s = s.memcpy(nbytes)
        checks = s.verify() if verify else None
        notifs = s.notifications()
    transport = s.transport
    stats = transfer_stats(plans, geometry, blocks, requests, runs, memcpy_s)
    read_ranks = {r for p in plans for r in p.transfers}
    notifications = {
        str(r): {
            "received": sum(len(v) for v in notifs[r]["notifs"].values()),
            "read": r in read_ranks,
            # CPU seconds per wall second while serving: a busy-spinning progress thread is ~1.0
            "cpu_fraction": round(notifs[r]["cpu_s"] / notifs[r]["serving_s"], 3) if notifs[r]["serving_s"] else None,
        }
        for r in range(prefill_tp)
    }
    result: dict[str, Any] = {
        "config": {
            "model": model_name, "prefill_tp": prefill_tp, "decode_tp": decode_tp, "block_size": block_size,
            "blocks": blocks, "requests": requests, "plan": plan, "device": device, "iters": iters, "warmup": warmup,
            "seed": seed, "progress_delay_us": progress_delay_us, "mapping": plans[0].mapping.impl,
            "tp_ratio": plans[0].tp_ratio,
            "bytes_per_rank": {"prefill": geometry.rank_bytes(prefill_tp), "decode": geometry.rank_bytes(decode_tp)},
        },
        "plans": [_plan_summary(p, geometry, blocks) for p in plans],
        **stats,
        "transport": transport,
        "notifications": notifications,
        "notified_without_read": sorted(int(r) for r, v in notifications.items() if v["received"] and not v["read"]),
    }
    result["verification"] = summarise_verification(checks)
    return result


def bytes_per_rank(plans: list[ReadPlan], geometry: KVGeometry, blocks: int, requests: int) -> list[int]:
    """Bytes each decode rank reads per iteration (``requests`` requests)."""
    return [sum(p.bytes_from(r, geometry, blocks) for r in p.transfers) * requests for p in plans]


def transfer_stats(
    plans: list[ReadPlan],
    geometry: KVGeometry,
    blocks: int,
    requests: int,
    runs: list[list[dict[str, Any]]],
    memcpy_s: list[float],
) -> dict[str, Any]:
    """Throughput from timed iterations (``runs[i][decode_rank]`` as returned by
    :meth:`TransferSession.iterate`) and per-rank memcpy seconds: ``gbps`` (all
    ranks' bytes / median slowest-rank wall), ``memcpy_gbps`` (same bytes / slowest
    rank's memcpy), ``ratio``, ``wall_s_median``, ``bytes_per_iteration`` and per-rank
    ``ranks``."""
    nbytes = bytes_per_rank(plans, geometry, blocks, requests)
    total = sum(nbytes)
    wall = statistics.median(max(r["wall_s"] for r in run) for run in runs)
    gbps = total / wall / 1e9 if wall > 0 else float("nan")
    memcpy_gbps = total / max(memcpy_s) / 1e9 if max(memcpy_s) > 0 else float("nan")
    ranks = []
    for d, p in enumerate(plans):
        w = statistics.median(run[d]["wall_s"] for run in runs)
        ndesc = p.descriptors_per_request(geometry, blocks)
        ranks.append({
            "decode_rank": d,
            "bytes_per_iteration": nbytes[d],
            "transfers_per_request": len(p.transfers),
            "descriptors_per_request": ndesc,
            "nixl_descriptors_per_request": runs[-1][d]["nixl_descs"] / requests,
            "wall_s": [run[d]["wall_s"] for run in runs],
            "post_s_median": statistics.median(run[d]["post_s"] for run in runs),
            "gbps": nbytes[d] / w / 1e9 if w > 0 else float("nan"),
            "us_per_descriptor": w / (ndesc * requests) * 1e6 if ndesc else float("nan"),
            "memcpy_gbps": nbytes[d] / memcpy_s[d] / 1e9 if memcpy_s[d] > 0 else float("nan"),
        })
    return {
        "ranks": ranks,
        "bytes_per_iteration": total,
        "wall_s_median": wall,
        "gbps": gbps,
        "memcpy_gbps": memcpy_gbps,
        "ratio": gbps / memcpy_gbps if memcpy_gbps == memcpy_gbps and memcpy_gbps else float("nan"),
    }


def summarise_verification(checks: list[dict[str, Any]] | None) -> dict[str, Any]:
    """Merge :meth:`TransferSession.verify` output: ``{ok, missing, wrong, stray_bytes,
    checked_bytes}``; ``missing``/``wrong`` entries are ``{decode_rank, layer, kind,
    prefill_rank, pages, bytes}``. ``ok`` is None when ``checks`` is None."""
    if checks is None:
        return {"ok": None, "missing": [], "wrong": [], "stray_bytes": None, "checked_bytes": 0}
    issues = [i for c in checks for i in c["issues"]]
    missing = [
        {k: i[k] for k in ("decode_rank", "layer", "kind", "prefill_rank", "pages")} | {"bytes": i["missing_bytes"]}
        for i in issues if i["missing_bytes"]
    ]
    wrong = [
        {k: i[k] for k in ("decode_rank", "layer", "kind", "prefill_rank", "pages")} | {"bytes": i["wrong_bytes"]}
        for i in issues if i["wrong_bytes"]
    ]
    stray = sum(c["stray_bytes"] for c in checks)
    return {
        "ok": not missing and not wrong and stray == 0,
        "missing": missing,
        "wrong": wrong,
        "stray_bytes": stray,
        "checked_bytes": sum(c["checked_bytes"] for c in checks),
    }


# ---------------------------------------------------------------- CLI
def add_cli_args(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``pdsweep bench transfer``."""
    parser.add_argument("--model", required=True, help="catalogue model name, e.g. kimi-linear")
    parser.add_argument("--prefill-tp", type=int, default=1)
    parser.add_argument("--decode-tp", type=int, default=1)
    parser.add_argument("--block-size", type=int, default=16, help="tokens per KV block (default 16)")
    parser.add_argument("--blocks", type=int, default=64, help="attention blocks per request (default 64)")
    parser.add_argument("--requests", type=int, default=1, help="requests per iteration (default 1)")
    parser.add_argument("--iters", type=int, default=5, help="timed iterations (default 5)")
    parser.add_argument("--plan", choices=PLANS, default="fixed",
                        help="vLLM read plan: fixed (PR #49297), unfixed (its parent: refuses MLA+SSM at tp_ratio < 0 "
                             "with its assert), unfixed-asserts-off (hypothetical single read)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="cache memory: cpu (DRAM) or cuda (VRAM via torch)")
    parser.add_argument("--verify", action=argparse.BooleanOptionalAction, default=True,
                        help="check every destination byte")
    parser.add_argument("--mapping", choices=("auto", "vllm", "builtin"), default="auto",
                        help="source-rank rule: vLLM's compute_tp_mapping (auto: when importable) or pdsweep's copy")
    parser.add_argument("--progress-delay-us", type=int, default=DEFAULT_PROGRESS_DELAY_US,
                        help="NIXL progress-thread delay in microseconds (>= 1)")
    parser.add_argument("--json", type=Path, metavar="FILE", help="write the result as JSON")
    parser.add_argument("--models", "--sweep", dest="models", type=Path, metavar="FILE", default=None,
                        help="model catalogue, or a sweep file naming one (default sweeps/models.yaml)")


def _find_model(path: Path | None, name: str) -> ModelSpec:
    from ..errors import UserError
    from ..spec import load_catalogue, load_sweep

    if path is None:
        path = Path("sweeps/models.yaml")
        if not path.exists():
            path = Path(__file__).resolve().parents[2] / "sweeps" / "models.yaml"
    import yaml

    try:
        is_sweep = "matrix" in (yaml.safe_load(Path(path).read_text()) or {})
    except (OSError, yaml.YAMLError):
        is_sweep = False
    cat = load_sweep(path).catalogue if is_sweep else load_catalogue(path)
    if name not in cat.models:
        raise UserError(f"{path}: unknown model '{name}' (allowed: {', '.join(cat.models)})")
    return cat.models[name]


def _fmt_gbps(x: float) -> str:
    return "n/a" if x != x else f"{x:.2f}"


def main(args: argparse.Namespace) -> int:
    """Run the benchmark, print a summary; returns 0 when verification passes (or is
    off). Raises ``GateFailed`` when it fails or the unfixed plan refuses (exit 1),
    ``UserError`` on bad input (exit 2); a rank process that fails raises
    ``RuntimeError`` (exit 3, with its traceback). Codes: :func:`pdsweep.errors.run_main`."""
    from ..errors import GateFailed, UserError
    from ..layout import write_json

    check_device(args.device)
    model = _find_model(args.models, args.model)
    try:
        res = run_transfer_bench(
            args.model, model, args.prefill_tp, args.decode_tp, args.block_size, args.blocks, args.plan,
            args.device, args.verify, requests=args.requests, iters=args.iters,
            progress_delay_us=args.progress_delay_us, mapping=args.mapping,
        )
    except UnfixedPlanAsserts as e:  # what the unfixed build does: a failed verdict, not bad input
        print(f"refused before reading: {e}")
        raise GateFailed("bench transfer: the read plan refuses this TP pair (as the unfixed build does)") from None
    except ValueError as e:  # a TP pair or geometry the read plans cannot have
        raise UserError(str(e)) from None
    c = res["config"]
    print(f"{c['model']} prefill TP {c['prefill_tp']} -> decode TP {c['decode_tp']} (tp_ratio {c['tp_ratio']}), "
          f"plan {c['plan']}, block_size {c['block_size']}, {c['blocks']} blocks x {c['requests']} request(s), "
          f"device {c['device']}, mapping {c['mapping']}")
    for p in res["plans"]:
        print(f"  decode rank {p['decode_rank']}: reads ranks {p['read_ranks']} "
              f"(attention {p['attention_source_ranks']}, SSM {p['ssm_source_ranks']}), notifies {p['notify_ranks']}")
        for note in p["upstream_notes"]:
            print(f"    note: {note}")
    for r in res["ranks"]:
        print(f"  decode rank {r['decode_rank']}: {r['bytes_per_iteration'] / 2**20:.2f} MiB/iter, "
              f"{r['transfers_per_request']} transfers and {r['descriptors_per_request']} descriptors per request "
              f"({r['nixl_descriptors_per_request']:.0f} after NIXL merging), "
              f"{r['us_per_descriptor']:.2f} us/descriptor, "
              f"{_fmt_gbps(r['gbps'])} GB/s")
    print(f"transfer: {_fmt_gbps(res['gbps'])} GB/s, host memcpy {_fmt_gbps(res['memcpy_gbps'])} GB/s, "
          f"ratio {res['ratio']:.2f}x memcpy, UCX transport: {res['transport']}")
    cpu = {r: n["cpu_fraction"] for r, n in res["notifications"].items()}
    print(f"prefill ranks: notifications received {[n['received'] for n in res['notifications'].values()]}, "
          f"CPU fraction (progress delay {c['progress_delay_us']} us) {cpu}")
    if res["notified_without_read"]:
        print(f"prefill ranks notified without being read: {res['notified_without_read']}")
    v = res["verification"]
    if args.json:
        write_json(args.json, res)
        print(f"wrote {args.json}")
    if v["ok"] is None:
        print("verification: skipped (--no-verify)")
        return 0
    if v["ok"]:
        print(f"verification: OK, {v['checked_bytes']} bytes checked")
        return 0
    print(f"verification: FAILED ({v['checked_bytes']} bytes checked, {v['stray_bytes']} stray bytes)")
    for what in ("missing", "wrong"):
        by_rank: dict[int, list[dict[str, Any]]] = {}
        for i in v[what]:
            by_rank.setdefault(i["prefill_rank"], []).append(i)
        for r, items in sorted(by_rank.items()):
            kinds = sorted({i["kind"] for i in items})
            print(f"  {what} from prefill rank {r}: {sum(i['bytes'] for i in items)} bytes in "
                  f"{len({(i['decode_rank'], i['layer']) for i in items})} layer(s) ({', '.join(kinds)})")
    for what in ("missing", "wrong"):
        for i in v[what]:
            print(f"  {what.upper()}: decode rank {i['decode_rank']} layer {i['layer']} ({i['kind']}) "
                  f"from prefill rank {i['prefill_rank']}: {i['bytes']} bytes in {i['pages']} page(s)")
    raise GateFailed(f"bench transfer: verification FAILED ({v['stray_bytes']} stray bytes)")


def _cli(argv: list[str] | None = None) -> int:
    from ..errors import run_main

    parser = argparse.ArgumentParser(prog="python -m pdsweep.xfer.bench", description=__doc__.splitlines()[0])
    add_cli_args(parser)
    args = parser.parse_args(argv)
    return run_main(lambda: main(args))


if __name__ == "__main__":
    sys.exit(_cli())
