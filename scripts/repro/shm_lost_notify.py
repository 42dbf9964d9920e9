"""Lost wake-ups in vLLM's shm-broadcast RPC, with vLLM's own MessageQueue (no model).

MultiprocExecutor's pattern: the engine broadcasts each RPC on one MessageQueue that every
worker reads (``collective_rpc``), each worker answers on a queue of its own that the engine
reads (``get_response``). A reader that found nothing spins ``busy_loop_s`` after its last
read (``SpinCondition.wait``: ``sched_yield``), then parks in ``zmq.Poller.poll`` until the
writer's ``notify()`` (a PUB socket, ``SNDHWM`` 1; readers SUB with ``CONFLATE``) or until
``SHM_READER_RECHECK_INTERVAL_MS`` (5000 in vLLM 0.32.0) when the notify is lost.

Each round trip here is one RPC after a random gap; one that takes >= 4 s waited out the
5 s recheck, i.e. a notify was lost. Variants (``--variants``, comma separated):

- ``spin1ms`` / ``spin10ms`` / ``spin1s``: readers' ``busy_loop_s`` (pdsweep's CPU default is
  1 ms: ``PDSWEEP_SHM_BUSY_LOOP_S``; vLLM's is 1 s);
- ``hwm``: ``spin1ms`` with the writers' PUB ``SNDHWM`` raised from 1 to 1000;
- ``noconflate``: ``spin1ms`` with the readers' SUB sockets made without ``CONFLATE``;
- ``recheck``: ``spin1ms`` with ``SHM_READER_RECHECK_INTERVAL_MS`` 20;
- ``pdsweep``: pdsweep's plugin (``patch_shm_busy_loop``: 1 ms spin, writers' ``SNDHWM`` 1000);
- ``trace``: ``spin1ms``, every notify and parked poll written to /tmp/shmtrace-*.json.

``--hogs N`` spinning processes compete for the cores, as engines, NIXL threads and the
load client do on a 2-core host. Prints one JSON line per variant.

    .venv/bin/python scripts/repro/shm_lost_notify.py --rpcs 300 --hogs 2
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import random
import statistics
import subprocess
import sys
import time


def _hog(stop) -> None:
    while not stop.is_set():
        pass


TRACE: list = []  # ("notify", address, t) / ("poll", address, t0, t1, notified): variant "trace"


def _trace(sb) -> None:
    """Record every notify and every parked poll (CLOCK_MONOTONIC is one clock for all processes)."""
    init, notify = sb.SpinCondition.__init__, sb.SpinCondition.notify

    def __init__(self, is_reader, context, notify_address, *a, **k):
        init(self, is_reader, context, notify_address, *a, **k)
        self.address = notify_address

    def wait(self, timeout_ms=None):
        t0 = time.monotonic()
        if t0 <= self.last_read + self.busy_loop_s:
            sb.sched_yield()
            return
        events = dict(self.poller.poll(timeout=timeout_ms))
        t1 = time.monotonic()
        got = self.local_notify_socket in events
        # after a timeout: is a notify waiting in the socket all the same (a wake-up zmq_poll missed)?
        pending = not got and bool(self.local_notify_socket.getsockopt(sb.zmq.EVENTS) & sb.zmq.POLLIN)
        if got or pending:
            self.local_notify_socket.recv(flags=sb.zmq.NOBLOCK, copy=False)
        TRACE.append(("poll", self.address, t0, t1, got, pending))

    def notify_(self):
        notify(self)
        TRACE.append(("notify", self.address, time.monotonic()))

    sb.SpinCondition.__init__, sb.SpinCondition.wait, sb.SpinCondition.notify = __init__, wait, notify_


def _dump_trace(tag: str) -> None:
    if TRACE:
        with open(f"/tmp/shmtrace-{tag}.json", "w") as f:
            json.dump(TRACE, f)


def _tune(variant: str) -> None:
    from vllm.distributed.device_communicators import shm_broadcast as sb

    if variant == "trace":
        _trace(sb)
    if variant == "pdsweep":  # what pdsweep's vLLM plugin does with PDSWEEP_SHM_BUSY_LOOP_S=0.001
        from pdsweep.engine.cpupatches import patch_shm_busy_loop

        assert patch_shm_busy_loop(0.001)

    if variant == "recheck":
        sb.SHM_READER_RECHECK_INTERVAL_MS = 20
    if variant == "noconflate":
        orig_nc = sb.SpinCondition.__init__

        def init_nc(self, is_reader, context, notify_address, *a, **k):  # readers' SUB without CONFLATE
            orig_nc(self, is_reader, context, notify_address, *a, **k)
            if is_reader:
                self.poller.unregister(self.local_notify_socket)
                self.local_notify_socket.close(linger=0)
                self.local_notify_socket = context.socket(sb.SUB)
                self.local_notify_socket.setsockopt_string(sb.SUBSCRIBE, "")
                self.local_notify_socket.connect(notify_address)
                self.poller.register(self.local_notify_socket, sb.zmq.POLLIN)

        sb.SpinCondition.__init__ = init_nc
    if variant == "hwm":
        orig = sb.SpinCondition.__init__

        def __init__(self, is_reader, context, notify_address, *a, **k):  # the writer's PUB keeps 1000, not 1
            orig(self, is_reader, context, notify_address, *a, **k)
            if not is_reader:  # a listener takes the options of bind time: bind again (no reader yet)
                self.local_notify_socket.unbind(notify_address)
                self.local_notify_socket.setsockopt(sb.zmq.SNDHWM, 1000)
                self.local_notify_socket.bind(notify_address)

        sb.SpinCondition.__init__ = __init__


def _busy(variant: str) -> float:
    return {"spin10ms": 0.01, "spin1s": 1.0}.get(variant, 0.001)  # the others: 1 ms


def _worker(rank: int, bcast, variant: str, out_q) -> None:
    from vllm.distributed.device_communicators.shm_broadcast import MessageQueue

    _tune(variant)
    rd = MessageQueue.create_from_handle(bcast, rank)
    rd._spin_condition.busy_loop_s = _busy(variant)
    resp = MessageQueue(1, 1)
    out_q.put(resp.export_handle())
    rd.wait_until_ready()
    resp.wait_until_ready()
    while True:
        msg = rd.dequeue(indefinite=True)
        resp.enqueue(msg)
        if msg is None:
            _dump_trace(f"worker{rank}")
            return


def run(variant: str, rpcs: int, workers: int, gap_ms: float, hogs: int, seed: int) -> dict:
    from vllm.distributed.device_communicators.shm_broadcast import MessageQueue

    _tune(variant)
    ctx = mp.get_context("spawn")
    bcast = MessageQueue(workers, workers)
    out_q = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, bcast.export_handle(), variant, out_q)) for r in range(workers)]
    for p in procs:
        p.start()
    handles = [out_q.get(timeout=120) for _ in procs]
    resps = [MessageQueue.create_from_handle(h, 0) for h in handles]
    for r in resps:
        r._spin_condition.busy_loop_s = _busy(variant)
    bcast.wait_until_ready()
    for r in resps:
        r.wait_until_ready()
    stop = ctx.Event()
    hog_procs = [ctx.Process(target=_hog, args=(stop,)) for _ in range(hogs)]
    for h in hog_procs:
        h.start()
    rng, lat = random.Random(seed), []
    t_all = time.monotonic()
    try:
        for i in range(rpcs):
            time.sleep(rng.uniform(0, gap_ms) / 1000)
            t = time.monotonic()
            bcast.enqueue(i)
            for r in resps:
                assert r.dequeue() == i
            lat.append(time.monotonic() - t)
        bcast.enqueue(None)
        for r in resps:
            r.dequeue()
    finally:
        _dump_trace("engine")
        stop.set()
        for p in [*procs, *hog_procs]:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    lat_ms = sorted(x * 1000 for x in lat)
    return {
        "variant": variant,
        "busy_loop_s": _busy(variant),
        "rpcs": rpcs,
        "hogs": hogs,
        "lost_wakeups": sum(x >= 4000 for x in lat_ms),
        "over_100ms": sum(x >= 100 for x in lat_ms),
        "p50_ms": round(statistics.median(lat_ms), 3),
        "p99_ms": round(lat_ms[int(0.99 * (len(lat_ms) - 1))], 1),
        "max_ms": round(lat_ms[-1], 1),
        "wall_s": round(time.monotonic() - t_all, 1),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variants", default="spin1ms,pdsweep,spin10ms,spin1s,hwm,noconflate,recheck")
    ap.add_argument("--rpcs", type=int, default=300)
    ap.add_argument("--workers", type=int, default=2, help="TP size of the engine (readers of the broadcast)")
    ap.add_argument("--gap-ms", type=float, default=5.0, help="the engine waits uniform(0, gap) between RPCs")
    ap.add_argument("--hogs", type=int, default=0)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    variants = a.variants.split(",")
    if len(variants) == 1:
        print(json.dumps(run(variants[0], a.rpcs, a.workers, a.gap_ms, a.hogs, a.seed)), flush=True)
        return
    for v in variants:  # each in a fresh interpreter: a variant's patches of vLLM stay in it
        argv = [sys.executable, __file__, "--variants", v, "--rpcs", str(a.rpcs), "--workers", str(a.workers)]
        argv += ["--gap-ms", str(a.gap_ms), "--hogs", str(a.hogs), "--seed", str(a.seed)]
        subprocess.run(argv, check=True)


if __name__ == "__main__":
    main()
