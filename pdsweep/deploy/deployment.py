"""One cell's deployment: start its instances, wait until ready, put the PD proxy in
front, prove one real PD request moves KV, and tear everything down.

Readiness is not "``/health`` says 200": a PD pair can be healthy while every PD
request fails (vLLM #42895, sglang #31295 in ../shared/BUGS.md). A cell is ready only
after one real request through the proxy returned tokens and the decode instances'
``vllm:nixl_*`` histograms recorded a transfer, and one streaming request delivered its
chunks and ``[DONE]``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import signal
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import httpx

from pdsweep.core.faults import NO_PROXY_FAULTS, ProxyFaults
from pdsweep.core.logscan import first_exception, read_fault_counts
from pdsweep.deploy.kvnote import integrity_note
from pdsweep.deploy.launchers import Handle, port_free, tail
from pdsweep.plan.expand import Cell
from pdsweep.plan.instance import InstanceSpec, Slot, transfer_mode

log = logging.getLogger(__name__)

HEALTH_POLL_S = 0.1  # readiness is detected within one poll of /health answering 200
READY_PROMPT = "Q: What is 1 + 1?\nA:"
NIXL_COUNT_METRIC = "vllm:nixl_xfer_time_seconds"


@dataclass
class Use:
    """One instance as one cell uses it: the spec it runs (real ports), a handle named
    as in the cell (``prefill-0``), and whether an earlier cell started it."""

    spec: InstanceSpec
    handle: Handle
    instance_id: str
    reused: bool
    log_offset: int = 0  # bytes of the instance log earlier cells used (0: started for this cell)

    def record(self) -> dict[str, Any]:
        """cell.json / status.json ``instances`` entry."""
        return {
            "name": self.spec.name,
            "instance_id": self.instance_id,
            "reused": self.reused,
            "log": str(self.handle.log_path),
            "port": self.spec.port,
        }


class Provider(Protocol):
    """Where a cell's instances come from (:func:`pdsweep.deploy.deployment.deploy`)."""

    def acquire(self, cell_id: str, specs: list[InstanceSpec], log_dir: Path) -> list[Use]: ...

    def ready(self, cell_id: str, uses: list[Use]) -> None: ...

    def release(self, cell_id: str, uses: list[Use], failed: bool, log_dir: Path) -> None: ...


class CellFailed(Exception):
    """A cell failed in ``phase``; ``log_tail`` holds the last lines of the culprit's log."""

    def __init__(self, phase: str, reason: str, log_tail: list[str] | None = None) -> None:
        super().__init__(f"{phase}: {reason}")
        self.phase, self.reason, self.log_tail = phase, reason, log_tail or []


class ReadyHang(CellFailed):
    """The first request through a ready deployment timed out: the engine hangs (no
    instance died, nothing answered wrong). The one failure ``defaults.ready_retries``
    redeploys for (``pdsweep.run.cell.run_cell``)."""


@dataclass
class Deployment:
    cell: Cell
    slot: Slot
    handles: list[Handle]
    uses: list[Use] = field(default_factory=list)  # which instance each handle is (pdsweep.deploy.instances)
    proxy: object | None = None
    proxy_log: Path | None = None
    log_dir: Path | None = None  # the cell's logs/ (a shared instance logs elsewhere)
    timings: dict[str, float] = field(default_factory=dict)

    @property
    def url(self) -> str:
        """Where clients send requests: the PD proxy, or the single reference instance."""
        return self.proxy.url if self.proxy is not None else self.handles[0].url  # type: ignore[attr-defined]

    def role(self, role: str) -> list[Handle]:
        return [h for h in self.handles if h.name.startswith(role + "-")]

    @property
    def decode_handles(self) -> list[Handle]:
        return self.role("decode") or self.role("single")

    @property
    def transfer_mode(self) -> str | None:
        """``"push"`` or ``"pull"`` from the instances' ``--kv-transfer-config``
        (:func:`pdsweep.plan.instance.transfer_mode`); None for a single instance."""
        modes = {transfer_mode(u.spec.argv) for u in self.uses} - {None}
        return "push" if "push" in modes else ("pull" if modes else None)

    @property
    def initiator_handles(self) -> list[Handle]:
        """The instances that post the NIXL transfers and count them in ``vllm:nixl_*``:
        prefill in push mode (WRITEs, nixl/push_worker.py), else decode (READs)."""
        return self.role("prefill") if self.transfer_mode == "push" else self.decode_handles


def culprits(handles: list[Handle]) -> list[str]:
    """For each instance that exited or logged a Python traceback: its name, how it ended
    (still running / exit code / signal) and the first exception with file:line
    (:func:`pdsweep.core.logscan.first_exception`). Empty when every instance looks healthy."""
    out = []
    for h in handles:
        rc, exc = h.returncode(), first_exception(h.log_path, h.log_start)
        if rc is None and exc is None:
            continue
        how = "still running" if rc is None else f"killed by signal {-rc}" if rc < 0 else f"exited with code {rc}"
        if rc == 0 and exc is not None:  # vLLM's terminate_if_errored (entrypoints/launchers/launcher.py)
            how += " after its engine died"  # stops the API server cleanly once its engine has died
        out.append(f"{h.name} ({how}): {exc.describe() if exc else 'no Python traceback in its log'}")
    return out


def hung(handles: list[Handle]) -> bool:
    """A request that timed out here is a hang (:class:`ReadyHang`): every instance still runs and
    none logged a traceback other than a NIXL error vLLM handled and went on from (it logs handshake
    and transfer failures with their traceback and keeps serving: ``_log_failure`` in vLLM's
    ``distributed/kv_transfer/kv_connector/v1/nixl/base_worker.py``). Any other traceback (the
    unfixed build's ``AssertionError``) or an exit is a crash, never retried."""
    for h in handles:
        if h.returncode() is not None:
            return False
        exc = first_exception(h.log_path, h.log_start)
        if exc is not None and not exc.exc.rsplit(".", 1)[-1].startswith("nixl"):
            return False
    return True


def ended(handles: list[Handle], phase: str) -> list[str]:
    """``<name> (pid N) killed by signal 9 (SIGKILL) during <phase>`` (or ``exited with code N``),
    plus the first exception of its log, for each instance that is no longer running."""
    out = []
    for h in handles:
        if (rc := h.returncode()) is None:
            continue
        if rc < 0:
            try:
                how = f"killed by signal {-rc} ({signal.Signals(-rc).name})"
            except ValueError:
                how = f"killed by signal {-rc}"
        else:
            how = f"exited with code {rc}"
        exc = first_exception(h.log_path, h.log_start)
        out.append(f"{h.name} (pid {h.pid}) {how} during {phase}" + (f": {exc.describe()}" if exc else ""))
    return out


class InstanceEnded(RuntimeError):
    """An instance of the deployment stopped running while a phase was under way: the phase
    stops at its next boundary (:func:`stop_if_ended`) and :func:`blame` names the instance."""


def stop_if_ended(handles: list[Handle], before: str) -> None:
    """Raise :class:`InstanceEnded` before ``before`` (a load run, a checked workload) when an
    instance of ``handles`` has ended. Its requests could only fail, or wait: a prefill keeps
    the KV blocks of every request whose decode never read them for the whole
    ``kv_lease_duration`` (vLLM nixl/pull_scheduler.py ``request_finished``), so once its cache
    is full new requests queue there until ``request_timeout_s`` (seen: a decode killed under
    load, prefill at 99.6 % KV use, requests timing out after 300 s each)."""
    if any(h.returncode() is not None for h in handles):
        raise InstanceEnded(f"stopped before {before}: an instance of the cell had ended")


def kv_load_failures(handles: list[Handle], phase: str) -> list[str]:
    """``<name> (pid N) failed K request(s) after a KV load failure (kv_load_failure_policy:
    fail) during <phase>`` for each decode instance whose log, from this use on
    (``log_start``), has vLLM's scheduler failing requests after a KV load failure
    (``v1/core/sched/scheduler.py`` ``_handle_invalid_blocks``)."""
    out = []
    for h in handles:
        if not h.name.startswith("decode"):
            continue
        try:
            with open(h.log_path, errors="replace") as f:
                f.seek(h.log_start)
                n = read_fault_counts(f.read())["failed_reqs"]
        except OSError:
            continue
        if n:
            out.append(
                f"{h.name} (pid {h.pid}) failed {n} request(s) after a KV load failure "
                f"(kv_load_failure_policy: fail) during {phase}"
            )
    return out


def blame(phase: str, error: BaseException, handles: list[Handle]) -> CellFailed | None:
    """A :class:`CellFailed` for ``error`` raised in ``phase`` that names first the instances that
    ended (:func:`ended`), e.g. ``prefill-0 (pid 4242) killed by signal 9 (SIGKILL) during eval;
    lm-eval: ...``, then decode instances that failed requests after a KV load failure
    (:func:`kv_load_failures`); None when every instance still runs and none did (the error
    stands as it is)."""
    found = ended(handles, phase) + kv_load_failures(handles, phase)
    if not found:
        return None
    why = error.reason if isinstance(error, CellFailed) else f"{type(error).__name__}: {error}"
    tails = [line for h in handles if h.returncode() is not None for line in tail(h.log_path, 20)]
    return CellFailed(phase, "; ".join([*found, why]), tails or getattr(error, "log_tail", None))


def _with_culprits(reason: str, handles: list[Handle]) -> str:
    """``reason`` (a request's failure: the HTTP wrapper) after the :func:`culprits`, the cause,
    so the first thing a summary row or CI log line shows is the instance's own error."""
    found = culprits(handles)
    return f"{'; '.join(found)}; {reason}" if found else reason


def wait_healthy(handles: list[Handle], timeout_s: float, stop: Callable[[], bool] = lambda: False) -> float:
    """Poll every instance's ``/health`` every ``HEALTH_POLL_S`` until all answer 200.

    Returns seconds waited. Raises ``CellFailed('start', ...)`` at once when a process
    exits (with its log tail), or when ``timeout_s`` passes.
    """
    t0 = time.monotonic()
    pending = {h.name: h for h in handles}
    with httpx.Client(timeout=2.0) as client:
        while pending:
            if stop():
                raise CellFailed("start", "interrupted")
            for name, h in list(pending.items()):
                rc = h.returncode()
                if rc is not None:
                    raise CellFailed("start", "; ".join(ended([h], "startup")), tail(h.log_path))
                try:
                    if client.get(f"{h.url}/health").status_code == 200:
                        del pending[name]
                        log.info("%s healthy after %.1f s", name, time.monotonic() - t0)
                except httpx.HTTPError:
                    pass
            if pending:
                if time.monotonic() - t0 > timeout_s:
                    names = ", ".join(f"{n} at {x.where}" for n, x in pending.items())
                    h = next(iter(pending.values()))
                    raise CellFailed("start", f"{names} not healthy after {timeout_s:.0f} s", tail(h.log_path))
                time.sleep(HEALTH_POLL_S)
    return time.monotonic() - t0


def nixl_transfer_count(handles: list[Handle]) -> int | None:
    """Sum of ``vllm:nixl_xfer_time_seconds`` sample counts over ``handles``' /metrics;
    None when no instance exposes the metric (fail closed)."""
    from prometheus_client.parser import text_string_to_metric_families

    total, seen = 0, False
    for h in handles:
        with httpx.Client(timeout=10, trust_env=False) as client:
            r = client.get(f"{h.url}/metrics")
            r.raise_for_status()
        for fam in text_string_to_metric_families(r.text):
            if fam.name == NIXL_COUNT_METRIC:
                seen = True
                total += sum(int(s.value) for s in fam.samples if s.name == f"{NIXL_COUNT_METRIC}_count")
    return total if seen else None


def streaming_request(dep: Deployment, model: str, timeout_s: float) -> None:
    """One streaming completion (SSE, the path ``vllm bench serve`` uses; vLLM issue 29369
    hung there) must deliver a text chunk and ``data: [DONE]`` within ``timeout_s`` seconds
    in all. Raises ``CellFailed('ready', ...)``."""
    deadline = time.monotonic() + timeout_s
    chunks, done = 0, False
    try:
        with httpx.stream(
            "POST",
            f"{dep.url}/v1/completions",
            timeout=timeout_s,
            json={"model": model, "prompt": READY_PROMPT, "max_tokens": 4, "temperature": 0, "stream": True},
        ) as r:
            if r.status_code != 200:
                r.read()
                raise CellFailed(
                    "ready",
                    _with_culprits(f"streaming request: HTTP {r.status_code}: {r.text[:500]}", dep.handles),
                    _tails(dep),
                )
            for line in r.iter_lines():
                if time.monotonic() > deadline:
                    raise httpx.ReadTimeout(f"no [DONE] within {timeout_s:g} s")
                data = line.removeprefix("data:").strip() if line.startswith("data:") else None
                if data == "[DONE]":
                    done = True
                    break
                if data:
                    choices = json.loads(data).get("choices") or [{}]
                    chunks += bool(choices[0].get("text"))
    except (httpx.HTTPError, httpx.StreamError) as e:
        raise CellFailed(
            "ready",
            _with_culprits(f"streaming request failed after {chunks} chunks: {type(e).__name__}: {e}", dep.handles),
            _tails(dep),
        ) from None
    except (ValueError, AttributeError, IndexError, TypeError) as e:
        raise CellFailed(
            "ready", f"streaming request: a chunk is not a completion: {type(e).__name__}: {e}", _tails(dep)
        ) from None
    if not (chunks and done):
        raise CellFailed(
            "ready",
            f"streaming request ended with {chunks} text chunks and {'a' if done else 'no'} [DONE]",
            _tails(dep),
        )


def first_request(dep: Deployment, model: str, timeout_s: float) -> None:
    """One real completion through the deployment; for PD cells the side that initiates
    transfers (:attr:`Deployment.initiator_handles`: decode, or prefill in push mode) must
    record a NIXL transfer; then one streaming completion (:func:`streaming_request`).
    Raises ``CellFailed('ready', ...)``."""
    try:
        r = httpx.post(
            f"{dep.url}/v1/completions",
            timeout=timeout_s,
            json={"model": model, "prompt": READY_PROMPT, "max_tokens": 4, "temperature": 0},
        )
    except httpx.HTTPError as e:
        hang = isinstance(e, httpx.TimeoutException) and hung(dep.handles)
        raise (ReadyHang if hang else CellFailed)(
            "ready", _with_culprits(f"first request failed: {type(e).__name__}: {e}", dep.handles), _tails(dep)
        ) from None
    if r.status_code != 200:
        # the PD proxy's own timeout (same request_timeout_s) can fire first: 504 "... timed out ..."
        hang = r.status_code == 504 and "timed out" in r.text and hung(dep.handles)
        why = f"first request: HTTP {r.status_code}: {r.text[:500]}"
        if dep.cell.kind == "pd" and not hang:  # what the KV digests saw (pdsweep.deploy.kvnote)
            why += "".join(f"; {n}" for n in integrity_note(dep.handles, push=dep.transfer_mode == "push"))
        raise (ReadyHang if hang else CellFailed)("ready", _with_culprits(why, dep.handles), _tails(dep))
    usage = r.json().get("usage") or {}
    if not usage.get("completion_tokens"):
        raise CellFailed("ready", f"first request returned no tokens: {r.text[:300]}", _tails(dep))
    if dep.cell.kind == "pd":
        n = nixl_transfer_count(dep.initiator_handles)
        if not n:
            who = "prefill (push mode: prefill WRITEs)" if dep.transfer_mode == "push" else "decode"
            msg = f"first PD request moved no KV: {who} {NIXL_COUNT_METRIC} count = {n}"
            raise CellFailed("ready", msg, _tails(dep))
    streaming_request(dep, model, timeout_s)


def _tails(dep: Deployment, n: int = 25) -> list[str]:
    out: list[str] = []
    for h in dep.handles:
        out += [f"[{h.name}] {line}" for line in tail(h.log_path, n)]
    if dep.proxy_log:
        out += [f"[proxy] {line}" for line in tail(dep.proxy_log, n)]
    return out


def taken_ports(specs: list[InstanceSpec], slot: Slot) -> list[int]:
    """Ports of ``slot`` (its proxy's, each instance's HTTP and side-channel base) that
    something else already holds on this host."""
    ports = [slot.proxy_port()] + [p for s in specs for p in (s.port, s.side_channel_port) if p]
    return [p for p in ports if not port_free(p)]


@contextlib.contextmanager
def _vllm_router(cell: Cell, dep: Deployment, slot: Slot, timeouts: Timeouts, faults: ProxyFaults) -> Iterator[Any]:
    """:class:`pdsweep.deploy.router.VllmRouterServer` for ``router: vllm-router``; raises
    ``CellFailed('ready')`` when it cannot start, or a fault switch is on (pdsweep's proxy only)."""
    from pdsweep.deploy.router import VllmRouterServer  # lazy: fastapi, httpx (CellFailed's importers stay light)

    if faults.active:
        raise CellFailed("ready", f"router vllm-router: the test-only faults {faults} exist only in pdsweep's proxy")
    srv = VllmRouterServer(
        [h.url for h in dep.role("prefill")],
        [h.url for h in dep.role("decode")],
        port=slot.proxy_port(),
        timeout_s=timeouts.request_s,
        log_path=dep.proxy_log,
        block_size=cell.decode_block_size,
    )
    try:
        srv.start()
    except (RuntimeError, OSError) as e:
        raise CellFailed("ready", str(e), _tails(dep)) from None
    try:
        yield srv
    finally:
        srv.stop()


@dataclass(frozen=True)
class Timeouts:
    startup_s: float  # every instance healthy within this, seconds
    request_s: float  # each readiness request, seconds


@dataclass(frozen=True)
class DeployRequest:
    """One cell's deployment: its instances ``specs`` on ``slot`` (the PD proxy on
    ``slot.proxy_port()``), their logs and the proxy's in ``log_dir``, its timeouts, and the
    faults the proxy injects (test-only, or a fault drill's)."""

    cell: Cell
    slot: Slot
    specs: list[InstanceSpec]
    log_dir: Path
    timeouts: Timeouts
    faults: ProxyFaults = NO_PROXY_FAULTS


@contextlib.contextmanager
def deploy(
    req: DeployRequest,
    provider: Provider,
    on_phase: Callable[[str], None] = lambda p: None,
    stop: Callable[[], bool] = lambda: False,
    on_uses: Callable[[list[Use]], None] = lambda u: None,
    timings: dict[str, float] | None = None,
) -> Iterator[Deployment]:
    """Get ``req.specs``' instances from ``provider`` (started for this cell, or shared with
    earlier cells: :mod:`pdsweep.deploy.instances`), make the cell ready, yield the
    :class:`Deployment`, and always give them back (also on exceptions and interrupts;
    a cell that failed gives them back as failed: the provider stops them). ``on_phase``
    hears "start" and "ready", ``stop`` ends the health wait early, ``on_uses`` learns which
    instances the cell got. ``timings`` (seconds: ``healthy_s``, ``first_request_s``) is the
    dict ``Deployment.timings`` fills, also for a cell that fails at its first request.

    Raises ``CellFailed`` for startup/readiness failures.
    """
    cell, slot, specs, log_dir, timeouts, faults = req.cell, req.slot, req.specs, req.log_dir, req.timeouts, req.faults
    dep = Deployment(cell, slot, [], log_dir=log_dir, timings={} if timings is None else timings)
    failed = True
    with contextlib.ExitStack() as stack:
        on_phase("start")  # the phase stays where it failed; teardown is not reported as the culprit
        t0 = time.monotonic()
        dep.uses = provider.acquire(cell.id, specs, log_dir)
        stack.callback(lambda: provider.release(cell.id, dep.uses, failed, log_dir))
        dep.handles = [u.handle for u in dep.uses]
        on_uses(dep.uses)
        wait_healthy(dep.handles, timeouts.startup_s, stop)
        dep.timings["healthy_s"] = round(time.monotonic() - t0, 3)
        provider.ready(cell.id, dep.uses)  # measured startups (run.json), also of a cell that fails next
        on_phase("ready")
        if cell.kind == "pd" and cell.router == "vllm-router":
            dep.proxy_log = log_dir / "router.log"
            dep.proxy = stack.enter_context(_vllm_router(cell, dep, slot, timeouts, faults))
        elif cell.kind == "pd":
            from pdsweep.deploy.proxy import ProxyServer  # lazy: fastapi, uvicorn, aiohttp

            dep.proxy_log = log_dir / "proxy.log"
            dep.proxy = stack.enter_context(
                ProxyServer(
                    prefill_urls=[h.url for h in dep.role("prefill")],
                    decode_urls=[h.url for h in dep.role("decode")],
                    port=slot.proxy_port(),
                    timeout_s=timeouts.request_s,
                    log_path=dep.proxy_log,
                    block_size=cell.decode_block_size,
                    faults=faults,
                )
            )
        t1 = time.monotonic()
        try:
            first_request(dep, cell.model, timeouts.request_s)
        finally:  # a cell whose decode dies on it ends here (pdsweep.plan.schedule.eval_s)
            dep.timings["first_request_s"] = round(time.monotonic() - t1, 3)
        yield dep
        failed = False
