"""Instances shared across cells: identity, ports, prefix-cache reset, restart.

An instance is defined by what it runs: its role, TP, GPU set, node and the exact argv and
environment of its ``vllm serve`` (model, build interpreter, block size, DP, serve args,
env), minus the ports it happens to listen on. Two cells that need instances with the
same :func:`instance_key` share one process (:class:`InstancePool`); ``--no-reuse`` gives
every cell its own (:class:`Fresh`, the sequential approach).

Between two cells a shared instance's prefix cache is emptied with vLLM's
``POST /reset_prefix_cache`` (vllm/entrypoints/serve/dev/cache/api_router.py
``reset_prefix_cache``, registered by vllm/entrypoints/launchers/api_server/routers.py
only when ``VLLM_SERVER_DEV_MODE=1``, vllm/envs.py), so every pooled instance is started
with that variable. A reset that does not answer ``{"success": true}`` (vLLM refuses while
blocks are held, e.g. by a KV lease for a request decode never read) restarts the
instance instead. A shared instance that exited or stopped answering ``/health`` is
restarted for the next cell that needs it; a cell that failed stops the instances it used
(they are not trusted by the next cell).
"""

from __future__ import annotations

import concurrent.futures as cf
import hashlib
import json
import logging
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import httpx

from .deploy import CellFailed, Use, check_ports
from .launchers import Handle, Launcher, port_free
from .plan import PORTS_PER_SLOT, InstanceSpec, Slot

log = logging.getLogger(__name__)

DEV_MODE_ENV = {"VLLM_SERVER_DEV_MODE": "1"}  # vllm/envs.py: registers /reset_prefix_cache
PORT_ENV = ("VLLM_PORT", "VLLM_NIXL_SIDE_CHANNEL_PORT")  # where it listens: not what it is
BLOCK_PORTS = 16  # per pooled instance: http, spare, VLLM_PORT..+5, side channel..+7
VLLM_PORT_OFFSET, SIDE_CHANNEL_OFFSET = 2, 8
MAX_BLOCKS = 256
RESET_TRIES, RESET_WAIT_S = 5, 0.5


def instance_key(spec: InstanceSpec) -> str:
    """Hex digest (16) of what defines ``spec``: role, TP, GPU set, node, argv with the
    ``--port`` value blanked, env without :data:`PORT_ENV` and :data:`DEV_MODE_ENV`."""
    argv = list(spec.argv)
    for i, a in enumerate(argv[:-1]):
        if a == "--port":
            argv[i + 1] = "<port>"
    env = {k: v for k, v in spec.env.items() if k not in PORT_ENV and k not in DEV_MODE_ENV}
    d = {"role": spec.role, "tp": spec.tp, "gpus": list(spec.gpus), "node": spec.node, "host": spec.host,
         "argv": argv, "env": env}
    return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]


def served_name(spec: InstanceSpec) -> str:
    argv = list(spec.argv)
    return argv[argv.index("--served-model-name") + 1] if "--served-model-name" in argv else "model"


def instance_id(spec: InstanceSpec) -> str:
    """Stable, readable id: ``<role>.<served model>.tp<TP>.<key>`` (same in every run of
    the same configuration)."""
    return f"{spec.role}.{served_name(spec)}.tp{spec.tp}.{instance_key(spec)[:10]}"


def relocate(spec: InstanceSpec, base: int) -> InstanceSpec:
    """``spec`` listening on the port block at ``base`` (:data:`BLOCK_PORTS` ports: HTTP at
    ``base``, ``VLLM_PORT`` at +2, the NIXL side channel at +8), with
    ``VLLM_SERVER_DEV_MODE=1``; its :func:`instance_key` is unchanged."""
    argv = list(spec.argv)
    argv[argv.index("--port") + 1] = str(base)
    env = {**spec.env, **DEV_MODE_ENV, "VLLM_PORT": str(base + VLLM_PORT_OFFSET)}
    side = None
    if spec.side_channel_port is not None:
        side = base + SIDE_CHANNEL_OFFSET
        env["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(side)
    return replace(spec, port=base, side_channel_port=side, argv=tuple(argv), env=env)


def _start(launcher: Launcher, spec: InstanceSpec, log_path: Path) -> Handle:
    ports = tuple(p for p in (spec.port, spec.side_channel_port) if p)
    try:
        return launcher.start(spec.name, list(spec.argv), spec.env, spec.port, log_path, ports, host=spec.host,
                              node=spec.node or None)
    except (OSError, ValueError) as e:
        raise CellFailed("start", f"{spec.name}: cannot start {spec.argv[0]}: {e}") from None


class Fresh:
    """One deployment per cell (``--no-reuse``): start every instance into the cell's
    ``logs/``, stop them all (in reverse order, one by one) when the cell ends."""

    def __init__(self, launcher: Launcher) -> None:
        self.launcher = launcher
        self.starts: dict[str, int] = {}

    def acquire(self, cell_id: str, specs: list[InstanceSpec], log_dir: Path) -> list[Use]:
        uses: list[Use] = []
        try:
            for s in specs:
                h = _start(self.launcher, s, log_dir / f"{s.name}.log")
                iid = instance_id(s)
                self.starts[iid] = self.starts.get(iid, 0) + 1
                uses.append(Use(s, h, iid, False))
        except BaseException:
            self.release(cell_id, uses, True, log_dir)
            raise
        return uses

    def release(self, cell_id: str, uses: list[Use], failed: bool, log_dir: Path) -> None:
        for u in reversed(uses):
            self.launcher.stop(u.handle)

    def record(self) -> dict[str, Any]:
        return {"by_id": {i: {"starts": n} for i, n in self.starts.items()}, "events": []}


@dataclass
class Live:
    spec: InstanceSpec
    handle: Handle
    instance_id: str
    cells: list[str] = field(default_factory=list)
    busy: bool = False
    log_start: int = 0  # bytes already in the log when this process started (a restart appends)


class InstancePool:
    """Instances kept across cells, by :func:`instance_key`. Each pooled instance owns a
    block of :data:`BLOCK_PORTS` ports from ``port_base`` on (free blocks only; held until
    it has stopped) and logs to ``<instances_dir>/<instance id>.log``; each cell gets the
    bytes written while it used the instance in its own ``logs/<name>.log``.
    Thread-safe; stops run in background threads (:meth:`close` joins them)."""

    def __init__(self, launcher: Launcher, instances_dir: Path, port_base: int) -> None:
        self.launcher, self.dir, self.port_base = launcher, instances_dir, port_base
        self.live: dict[str, Live] = {}
        self.blocks: set[int] = set()
        self.starts: dict[str, int] = {}
        self.resets: dict[str, int] = {}
        self.events: list[dict[str, Any]] = []  # start / use / reset / restart / died / stop, with times
        self.lock = threading.Lock()
        self.stopper = cf.ThreadPoolExecutor(max_workers=4, thread_name_prefix="stop")
        self.t0 = time.monotonic()

    # ------------------------------------------------------------ starting
    def _event(self, kind: str, iid: str, cell: str | None, **kw: Any) -> None:
        with self.lock:
            self.events.append({"event": kind, "instance_id": iid, "cell": cell,
                                "t_s": round(time.monotonic() - self.t0, 2), **kw})

    def _free_block(self) -> int:
        for j in range(MAX_BLOCKS):
            base = self.port_base + j * BLOCK_PORTS
            if base in self.blocks or base + BLOCK_PORTS > 65535:
                continue
            if all(port_free(p) for p in range(base, base + BLOCK_PORTS)):
                self.blocks.add(base)
                return base
        raise CellFailed("start", f"no free block of {BLOCK_PORTS} ports from {self.port_base} on")

    def _launch(self, spec: InstanceSpec, cell: str | None) -> Live:
        key = instance_key(spec)
        with self.lock:
            base = self._free_block()
        s, iid = relocate(spec, base), instance_id(spec)
        self.dir.mkdir(parents=True, exist_ok=True)
        log_start = _size(self.dir / f"{iid}.log")
        try:
            h = _start(self.launcher, s, self.dir / f"{iid}.log")
        except BaseException:
            with self.lock:
                self.blocks.discard(base)
            raise
        live = Live(s, h, iid, log_start=log_start)
        with self.lock:
            self.live[key] = live
            self.starts[iid] = self.starts.get(iid, 0) + 1
        self._event("start", iid, cell, port=base)
        return live

    def prestart(self, specs: list[InstanceSpec], cell: str) -> None:
        """Start the instances of ``specs`` (cell ``cell``'s) that are not up yet, without
        waiting for them (while the current cell measures). A failure is left to that
        cell, which starts the instance again and records why it fails."""
        for s in specs:
            if instance_key(s) not in self.live:
                try:
                    self._launch(s, cell)
                except Exception as e:
                    log.warning("%s: prestart of %s failed: %s", cell, s.name, e)

    def _usable(self, live: Live, cell: str, timeout_s: float = 5.0) -> bool:
        """True when ``live`` runs and, if an earlier cell used it, answers /health and
        had its prefix cache reset (:func:`reset_prefix_cache`)."""
        if not live.handle.alive():
            self._event("died", live.instance_id, cell, returncode=live.handle.returncode())
            return False
        if not live.cells:  # prestarted for this cell, maybe still starting: deploy waits for it
            return True
        try:
            if httpx.get(f"{live.handle.url}/health", timeout=timeout_s).status_code != 200:
                return False
        except httpx.HTTPError:
            return False
        ok = reset_prefix_cache(live.handle.url, timeout_s)
        self.resets[live.instance_id] = self.resets.get(live.instance_id, 0) + ok
        self._event("reset" if ok else "reset-failed", live.instance_id, cell)
        return ok

    def acquire(self, cell_id: str, specs: list[InstanceSpec], log_dir: Path) -> list[Use]:
        """The cell's instances: each a live instance with the same key (alive, healthy,
        prefix cache reset), else a new start (a live one that fails the check is
        stopped first); handles carry the cell's names (``prefill-0``). Raises
        ``CellFailed('start')`` when one cannot be started (the cell's others are stopped)."""
        uses: list[Use] = []
        try:
            for s in specs:
                key = instance_key(s)
                live = self.live.get(key)
                offset = _size(live.handle.log_path) if live is not None else 0  # the reset is this cell's
                if live is not None and not self._usable(live, cell_id):
                    self._event("restart", live.instance_id, cell_id)
                    self._stop(key, wait=True, cell=cell_id)
                    live = None
                reused = live is not None and bool(live.cells)
                live = live or self._launch(s, cell_id)
                self._event("use", live.instance_id, cell_id, reused=reused)
                live.cells.append(cell_id)
                live.busy = True
                # a cell's share of the log: from its reset on (reused), else from this process's start
                uses.append(Use(replace(live.spec, name=s.name), replace(live.handle, name=s.name),
                                live.instance_id, reused, offset if reused else live.log_start))
        except BaseException:
            self.release(cell_id, uses, True, log_dir)
            raise
        return uses

    # ------------------------------------------------------------ stopping
    def release(self, cell_id: str, uses: list[Use], failed: bool, log_dir: Path) -> None:
        """The cell is done with ``uses``: copy each instance's log bytes of this cell to
        ``log_dir/<name>.log``; a failed cell stops them all (and waits)."""
        for u in uses:
            _copy_slice(u.handle.log_path, u.log_offset, log_dir / f"{u.spec.name}.log")
            live = self.live.get(instance_key(u.spec))
            if live is not None:
                live.busy = False
        if failed:
            for u in uses:
                self._stop(instance_key(u.spec), wait=True, cell=cell_id)

    def keep_only(self, specs: list[InstanceSpec], cell: str | None = None) -> None:
        """Stop (in the background) every idle instance that ``specs`` do not need."""
        want = {instance_key(s) for s in specs}
        for key, live in list(self.live.items()):
            if key not in want and not live.busy:
                self._stop(key, wait=False, cell=cell)

    def _stop(self, key: str, wait: bool, cell: str | None = None) -> None:
        with self.lock:
            live = self.live.pop(key, None)
        if live is None:
            return
        self._event("stop", live.instance_id, cell)

        def stop() -> None:
            try:
                self.launcher.stop(live.handle)
            finally:
                with self.lock:
                    self.blocks.discard(live.spec.port)

        fut = self.stopper.submit(stop)
        if wait:
            fut.result()

    def close(self) -> None:
        """Stop every instance and wait until all have stopped."""
        for key in list(self.live):
            self._stop(key, wait=False)
        self.stopper.shutdown(wait=True)

    def record(self) -> dict[str, Any]:
        """run.json ``instances``: per instance id its starts, prefix-cache resets, the cells
        that used it (in order) and its log; plus every event with its time."""
        out: dict[str, Any] = {}
        for e in self.events:
            row = out.setdefault(e["instance_id"], {"starts": self.starts.get(e["instance_id"], 0),
                                                    "resets": self.resets.get(e["instance_id"], 0),
                                                    "cells": [], "log": str(self.dir / f"{e['instance_id']}.log")})
            if e["event"] == "use":
                row["cells"].append(e["cell"])
        return {"by_id": out, "events": list(self.events)}


def reset_prefix_cache(url: str, timeout_s: float = 5.0) -> bool:
    """``POST {url}/reset_prefix_cache`` until it answers ``{"success": true}``
    (:data:`RESET_TRIES` tries, :data:`RESET_WAIT_S` apart: vLLM refuses while blocks are
    held). False when it never does or the route is absent (no ``VLLM_SERVER_DEV_MODE``)."""
    for i in range(RESET_TRIES):
        try:
            r = httpx.post(f"{url}/reset_prefix_cache", timeout=timeout_s)
            if r.status_code == 200 and r.json().get("success") is True:
                return True
            if r.status_code == 404:
                return False
        except (httpx.HTTPError, ValueError):
            pass
        if i + 1 < RESET_TRIES:
            time.sleep(RESET_WAIT_S)
    return False


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def _copy_slice(src: Path, offset: int, dst: Path) -> None:
    """Append the bytes of ``src`` from ``offset`` on to ``dst`` (a cell's share of a
    shared instance's log); nothing when ``src`` is ``dst``."""
    if src == dst:
        return
    try:
        with open(src, "rb") as f:
            f.seek(offset)
            data = f.read()
    except OSError:
        return
    dst.parent.mkdir(parents=True, exist_ok=True)
    with open(dst, "ab") as out:
        out.write(data)


class AltBlocks:
    """Alternate port blocks for a lane whose ports another process on the host holds:
    blocks of ``PORTS_PER_SLOT`` from lane :data:`ALT_BLOCKS_FROM` on, each held by one
    running cell (thread-safe; one per run, no module state)."""

    def __init__(self) -> None:
        self.claimed: set[int] = set()
        self.lock = threading.Lock()

    def free_slot(self, slot: Slot, make_specs, proxy_only: bool = False) -> tuple[Slot, list]:
        """``slot`` if none of its ports is taken (``proxy_only``: its proxy port, when the
        instances get their ports elsewhere, :class:`pdsweep.instances.InstancePool`), else
        the same slot on the first free alternate block. Raises ``CellFailed('start')``
        when no block is free."""
        specs = make_specs(slot)
        if not check_ports([] if proxy_only else specs, slot):
            return slot, specs
        with self.lock:
            for j in range(ALT_BLOCKS_FROM, ALT_BLOCKS_FROM + 64):
                base = slot.port_base - slot.index * PORTS_PER_SLOT + j * PORTS_PER_SLOT
                if base + PORTS_PER_SLOT > 65535 or base in self.claimed:
                    continue
                alt = replace(slot, port_base=base)
                specs = make_specs(alt)
                if not check_ports([] if proxy_only else specs, alt):
                    self.claimed.add(base)
                    return alt, specs
        raise CellFailed("start", f"no free block of {PORTS_PER_SLOT} ports found near {slot.port_base}")

    def release(self, slot: Slot) -> None:
        with self.lock:
            self.claimed.discard(slot.port_base)


ALT_BLOCKS_FROM = 64  # alternates start past any lane a run can use


def reuse_record(cells: list, specs_of: dict[str, list[InstanceSpec]], prestart: bool = True) -> dict[str, Any]:
    """plan.json ``reuse`` (and ``pdsweep plan``'s): for ``cells`` in run order, which
    instance each uses, each start and stop (:func:`pdsweep.schedule.lifecycle`), and
    distinct instances vs uses. ``specs_of``: cell id -> its instance specs (ports do not
    define an instance, so any slot gives the same identities)."""
    from .schedule import lifecycle

    keys = {cid: [instance_key(s) for s in sp] for cid, sp in specs_of.items()}
    ids = {instance_key(s): instance_id(s) for sp in specs_of.values() for s in sp}
    return {"order": [c.id for c in cells],
            "cell_instances": {cid: {s.name: instance_id(s) for s in sp} for cid, sp in specs_of.items()},
            "instances": lifecycle(cells, keys, ids, prestart),
            "distinct": len(ids), "per_cell": sum(len(k) for k in keys.values())}
