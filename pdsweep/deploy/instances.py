"""Instances shared across cells: identity, ports, prefix-cache reset, restart.

An instance is defined by what it runs: its role, TP, node and the exact argv and
environment of its ``vllm serve`` (model, build interpreter, block size, DP, serve args,
env), minus the ports it listens on and the GPUs it was given (``CUDA_VISIBLE_DEVICES``):
an instance keeps the GPUs it started on for every cell that shares it
(:mod:`pdsweep.run.gpureuse`). Two cells that need instances with the
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

from pdsweep.deploy.deployment import CellFailed, Use
from pdsweep.deploy.launchers import Handle, Launcher, port_free
from pdsweep.deploy.launchers.base import LaunchRequest
from pdsweep.deploy.portblocks import PortBlocks
from pdsweep.plan.instance import BLOCK_PORTS, InstanceSpec, place_block, ports_fit
from pdsweep.plan.schedule import lifecycle

log = logging.getLogger(__name__)

DEV_MODE_ENV = {"VLLM_SERVER_DEV_MODE": "1"}  # vllm/envs.py: registers /reset_prefix_cache
PORT_ENV = ("VLLM_PORT", "VLLM_NIXL_SIDE_CHANNEL_PORT")  # where it listens: not what it is
GPU_ENV = "CUDA_VISIBLE_DEVICES"  # which GPUs it got: not what it is (it keeps them while shared)
MAX_BLOCKS = 256
RESET_TRIES, RESET_WAIT_S = 5, 0.5
WATCH_POLL_S = 0.25  # a prestarted instance's /health poll: its recorded startup is late by up to this


def instance_key(spec: InstanceSpec) -> str:
    """Hex digest (16) of what defines ``spec``: role and its index in the cell, TP, node, argv with the ``--port``
    value blanked, env without :data:`PORT_ENV`, :data:`GPU_ENV` and :data:`DEV_MODE_ENV`
    (the GPU ids are where it runs, not what it is)."""
    argv = list(spec.argv)
    for i, a in enumerate(argv[:-1]):
        if a == "--port":
            argv[i + 1] = "<port>"
    env = {k: v for k, v in spec.env.items() if k not in PORT_ENV and k not in DEV_MODE_ENV and k != GPU_ENV}
    d = {
        "role": spec.role,
        "index": spec.name.rsplit("-", 1)[-1],  # two identical prefills of one cell are two instances
        "tp": spec.tp,
        "node": spec.node,
        "host": spec.host,
        "argv": argv,
        "env": env,
    }
    return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]


def served_name(spec: InstanceSpec) -> str:
    argv = list(spec.argv)
    return argv[argv.index("--served-model-name") + 1] if "--served-model-name" in argv else "model"


def instance_id(spec: InstanceSpec) -> str:
    """Stable, readable id: ``<role>.<served model>.tp<TP>.<key>`` (same in every run of
    the same configuration)."""
    return f"{spec.role}.{served_name(spec)}.tp{spec.tp}.{instance_key(spec)[:10]}"


def relocate(spec: InstanceSpec, base: int) -> InstanceSpec:
    """``spec`` listening on the port block at ``base`` (:func:`pdsweep.plan.instance.place_block`:
    the one port layout), with ``VLLM_SERVER_DEV_MODE=1``; its :func:`instance_key` is unchanged."""
    moved = place_block(spec, base)
    return replace(moved, env={**moved.env, **DEV_MODE_ENV})


def _start(launcher: Launcher, spec: InstanceSpec, log_path: Path) -> Handle:
    ports = tuple(p for p in (spec.port, spec.side_channel_port) if p)
    try:
        req = LaunchRequest(spec.name, spec.argv, spec.env, spec.port, log_path, ports, spec.host, spec.node or None)
        return launcher.start(req)
    except (OSError, ValueError) as e:
        raise CellFailed("start", f"{spec.name}: cannot start {spec.argv[0]}: {e}") from None


class Fresh:
    """One deployment per cell (``--no-reuse``): start every instance into the cell's
    ``logs/``, stop them all (in reverse order, one by one) when the cell ends."""

    def __init__(self, launcher: Launcher) -> None:
        self.launcher = launcher
        self.starts: dict[str, int] = {}
        self.launched: dict[int, float] = {}  # id(handle) -> monotonic launch time
        self.startups: list[dict[str, Any]] = []

    def acquire(self, cell_id: str, specs: list[InstanceSpec], log_dir: Path) -> list[Use]:
        uses: list[Use] = []
        try:
            for s in specs:
                h = _start(self.launcher, s, log_dir / f"{s.name}.log")
                self.launched[id(h)] = time.monotonic()
                iid = instance_id(s)
                self.starts[iid] = self.starts.get(iid, 0) + 1
                uses.append(Use(s, h, iid, False))
        except BaseException:
            self.release(cell_id, uses, True, log_dir)
            raise
        return uses

    def ready(self, cell_id: str, uses: list[Use]) -> None:
        """The cell found ``uses`` healthy just now: record each one's startup."""
        now = time.monotonic()
        for u in uses:
            t = self.launched.pop(id(u.handle), None)
            if t is not None:
                self.startups.append(_startup(u.spec, u.instance_id, cell_id, now - t))

    def release(self, cell_id: str, uses: list[Use], failed: bool, log_dir: Path) -> None:
        for u in reversed(uses):
            self.launcher.stop(u.handle)

    def record(self) -> dict[str, Any]:
        return {"by_id": {i: {"starts": n} for i, n in self.starts.items()}, "events": [], "startups": self.startups}


def _startup(spec: InstanceSpec, iid: str, cell: str, seconds: float) -> dict[str, Any]:
    """run.json ``instances.startups`` row: launch to healthy as the cell waiting for it saw
    it (an upper bound by up to one /health poll; for a prestarted instance, since its launch)."""
    return {
        "instance_id": iid,
        "model": served_name(spec),
        "role": spec.role,
        "tp": spec.tp,
        "gpus": list(spec.gpus),
        "cell": cell,
        "startup_s": round(seconds, 2),
    }


@dataclass
class Live:
    spec: InstanceSpec
    handle: Handle
    instance_id: str
    cells: list[str] = field(default_factory=list)
    busy: bool = False
    log_start: int = 0  # bytes already in the log when this process started (a restart appends)
    launched: float = field(default_factory=time.monotonic)
    healthy: bool = False  # a cell found it healthy (its startup is recorded)


class InstancePool:
    """Instances kept across cells, by :func:`instance_key`. Each pooled instance owns a
    block of :data:`BLOCK_PORTS` ports from ``port_base`` on (free blocks only; held until
    it has stopped) and logs to ``<instances_dir>/<instance id>.log``; each cell gets the
    bytes written while it used the instance in its own ``logs/<name>.log``.
    Thread-safe; stops run in background threads (:meth:`close` joins them)."""

    def __init__(self, launcher: Launcher, instances_dir: Path, port_base: int) -> None:
        self.launcher, self.dir, self.port_base = launcher, instances_dir, port_base
        self.live: dict[str, Live] = {}
        self.blocks = PortBlocks()  # this pool's port blocks (held until the instance has stopped)
        self.starts: dict[str, int] = {}
        self.resets: dict[str, int] = {}
        self.events: list[dict[str, Any]] = []  # start / use / reset / restart / died / stop, with times
        self.startups: list[dict[str, Any]] = []  # measured, per start (:meth:`ready`)
        self.lock = threading.Lock()
        self.stopper = cf.ThreadPoolExecutor(max_workers=4, thread_name_prefix="stop")
        self.t0 = time.monotonic()

    # ------------------------------------------------------------ starting
    def _event(self, kind: str, iid: str, cell: str | None, **kw: Any) -> None:
        with self.lock:
            self.events.append(
                {"event": kind, "instance_id": iid, "cell": cell, "t_s": round(time.monotonic() - self.t0, 2), **kw}
            )

    def _free_block(self) -> int:
        bases = (self.port_base + j * BLOCK_PORTS for j in range(MAX_BLOCKS))
        base = self.blocks.claim(
            (b for b in bases if ports_fit(b, BLOCK_PORTS)),
            lambda b: all(port_free(p) for p in range(b, b + BLOCK_PORTS)),
        )
        if base is None:
            raise CellFailed("start", f"no free block of {BLOCK_PORTS} ports from {self.port_base} on")
        return base

    def _launch(self, spec: InstanceSpec, cell: str | None) -> Live:
        key = instance_key(spec)
        with self.lock:
            base = self._free_block()
        s, iid = relocate(spec, base), instance_id(spec)
        self.dir.mkdir(parents=True, exist_ok=True)
        log_start = _size(self.dir / f"{iid}.log")
        t = time.monotonic()
        try:
            h = _start(self.launcher, s, self.dir / f"{iid}.log")
        except BaseException:
            with self.lock:
                self.blocks.release(base)
            raise
        live = Live(s, h, iid, log_start=log_start, launched=t)
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
                    live = self._launch(s, cell)
                except Exception as e:  # noqa: BLE001 -- recorded; the instance is started again when its cell comes
                    log.warning("%s: prestart of %s failed: %s", cell, s.name, e)
                    continue
                threading.Thread(target=self._watch, args=(live, cell), daemon=True, name="startup").start()

    def _watch(self, live: Live, cell: str) -> None:
        """Record prestarted ``live``'s startup when it first answers /health (its cell may come
        much later: on GPUs a cell waits for instances other cells use, :mod:`pdsweep.run.gpureuse`);
        gives up when it exits or leaves the pool."""
        while not live.healthy and live.handle.alive() and self.live.get(instance_key(live.spec)) is live:
            try:
                if httpx.get(f"{live.handle.url}/health", timeout=2.0).status_code == 200:
                    self._healthy(live, cell, time.monotonic())
                    return
            except httpx.HTTPError:
                pass
            time.sleep(WATCH_POLL_S)

    def _healthy(self, live: Live, cell: str, now: float) -> None:
        """``live`` answers /health: record its startup once (run.json ``instances.startups``)."""
        with self.lock:
            if live.healthy:
                return
            live.healthy = True
            self.startups.append(_startup(live.spec, live.instance_id, cell, now - live.launched))

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
                uses.append(
                    Use(
                        replace(live.spec, name=s.name),
                        replace(live.handle, name=s.name),
                        live.instance_id,
                        reused,
                        offset if reused else live.log_start,
                    )
                )
        except BaseException:
            self.release(cell_id, uses, True, log_dir)
            raise
        return uses

    def ready(self, cell_id: str, uses: list[Use]) -> None:
        """The cell found ``uses`` healthy just now (:func:`pdsweep.deploy.deployment.deploy`,
        before its first request): record the measured startup of each instance started since
        (run.json ``instances.startups``)."""
        now = time.monotonic()
        for u in uses:
            live = self.live.get(instance_key(u.spec))
            if live is not None:
                self._healthy(live, cell_id, now)

    def gpus_held(self, keys: set[str] | None = None) -> dict[int, str]:
        """GPU id -> instance key of every live instance (of ``keys`` only, when given)."""
        with self.lock:
            return {g: k for k, v in self.live.items() if keys is None or k in keys for g in v.spec.gpus}

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

    def keep_only(
        self, specs: list[InstanceSpec], cell: str | None = None, among: set[str] | None = None, wait: bool = False
    ) -> None:
        """Stop every idle instance that ``specs`` do not need (only those whose key is in
        ``among``, when given: one chain's); in the background, or until each has exited
        with ``wait`` (on GPUs: its memory is free before another instance takes the GPU)."""
        want = {instance_key(s) for s in specs}
        for key, live in list(self.live.items()):
            if key not in want and not live.busy and (among is None or key in among):
                self._stop(key, wait=wait, cell=cell)

    def stop(self, keys: set[str], cell: str | None = None) -> None:
        """Stop the idle instances of ``keys`` and wait until each has exited."""
        for key in [k for k, v in list(self.live.items()) if k in keys and not v.busy]:
            self._stop(key, wait=True, cell=cell)

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
                    self.blocks.release(live.spec.port)

        fut = self.stopper.submit(stop)
        if wait:
            fut.result()

    def close(self) -> None:
        """Stop every instance and wait until all have stopped."""
        for key in list(self.live):
            self._stop(key, wait=False)
        self.stopper.shutdown(wait=True)
        self.blocks.close()

    def record(self) -> dict[str, Any]:
        """run.json ``instances``: per instance id its starts, prefix-cache resets, the cells
        that used it (in order) and its log; plus every event with its time."""
        out: dict[str, Any] = {}
        for e in self.events:
            row = out.setdefault(
                e["instance_id"],
                {
                    "starts": self.starts.get(e["instance_id"], 0),
                    "resets": self.resets.get(e["instance_id"], 0),
                    "cells": [],
                    "log": str(self.dir / f"{e['instance_id']}.log"),
                },
            )
            if e["event"] == "use":
                row["cells"].append(e["cell"])
        return {"by_id": out, "events": list(self.events), "startups": list(self.startups)}


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


def reuse_record(cells: list, specs_of: dict[str, list[InstanceSpec]], prestart: bool = True) -> dict[str, Any]:
    """plan.json ``reuse`` (and ``pdsweep plan``'s): for ``cells`` in run order, which
    instance each uses, each start and stop (:func:`pdsweep.plan.schedule.lifecycle`), and
    distinct instances vs uses. ``specs_of``: cell id -> its instance specs (ports do not
    define an instance, so any slot gives the same identities)."""
    keys = {cid: [instance_key(s) for s in sp] for cid, sp in specs_of.items()}
    ids = {instance_key(s): instance_id(s) for sp in specs_of.values() for s in sp}
    return {
        "order": [c.id for c in cells],
        "cell_instances": {cid: {s.name: instance_id(s) for s in sp} for cid, sp in specs_of.items()},
        "instances": lifecycle(cells, keys, ids, prestart),
        "distinct": len(ids),
        "per_cell": sum(len(k) for k in keys.values()),
    }
