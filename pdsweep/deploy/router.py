"""``router: vllm-router``: the PD router users deploy (PyPI ``vllm-router``, Rust core; vLLM's
perf-eval recipes use it) instead of pdsweep's proxy, started as a subprocess with
``--vllm-pd-disaggregation --kv-connector nixl --prefill URL --decode URL``
(``vllm_router/router_args.py`` 0.1.17).

vllm-router's serving port has no Prometheus ``/metrics`` (0.1.17 answers "Only POST requests
are supported for transparent proxy"; its own metrics are on ``--prometheus-port``, default
29000, which pdsweep sets to a free port so concurrent routers do not collide), so a thin
counting passthrough of pdsweep's sits in front (:func:`create_passthrough_app`): it forwards
every request unchanged and keeps the proxy's request, error and ``kv_requests`` counters that
the transfer gate reads. The fault switches (scramble, stale, drop) exist only in pdsweep's
proxy.
"""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from pdsweep.deploy.appserver import AppServer, bind_socket
from pdsweep.deploy.launchers.base import own_group
from pdsweep.deploy.proxy_metrics import ProxyMetrics, error_response

ROUTERS = ("pdsweep", "vllm-router")
VLLM_ROUTER_VERSION = "0.1.17"  # the version pdsweep was tried with


def vllm_router_argv() -> list[str]:
    """How to run vllm-router: this interpreter's ``vllm_router`` package, else ``vllm-router``
    on PATH. Raises RuntimeError naming the install command when neither exists."""
    if importlib.util.find_spec("vllm_router") is not None:
        return [sys.executable, "-m", "vllm_router.launch_router"]
    exe = shutil.which("vllm-router")
    if exe:
        return [exe]
    raise RuntimeError(f"router vllm-router: not installed (pip install vllm-router=={VLLM_ROUTER_VERSION})")


def create_passthrough_app(upstream: str, timeout_s: float, block_size: int) -> FastAPI:
    """Forward ``POST /v1/completions``, ``/v1/chat/completions`` and ``GET /v1/models`` to
    ``upstream`` unchanged (SSE streamed through); count them in pdsweep's proxy metrics
    (``pdsweep_proxy_requests_total``, ``..._errors_total{stage="router"}``, and
    ``pdsweep_proxy_kv_requests_total`` for a non-streamed answer whose ``usage.prompt_tokens``
    >= ``block_size``). ``/health``: 200; ``/metrics``: those counters."""
    m = ProxyMetrics()
    app = FastAPI(title="pdsweep router passthrough", docs_url=None, redoc_url=None, openapi_url=None)
    client = httpx.AsyncClient(timeout=httpx.Timeout(timeout_s), trust_env=False)

    async def forward(request: Request, path: str) -> Response:
        m.requests.labels(path).inc()
        body = await request.body()
        try:
            stream = bool(request.method == "POST" and (await request.json()).get("stream"))
        except ValueError:
            stream = False
        up = client.build_request(
            request.method, upstream + path, content=body, headers={"content-type": "application/json"}
        )
        try:
            r = await client.send(up, stream=stream)
        except httpx.HTTPError as e:
            m.errors.labels(path, "router").inc()
            status = 504 if isinstance(e, httpx.TimeoutException) else 502
            return error_response(status, "router", f"router {upstream}: {type(e).__name__}: {e}")
        if r.status_code >= 400:
            m.errors.labels(path, "router").inc()
        media = r.headers.get("content-type", "application/json")
        if stream:

            async def relay() -> Any:
                try:
                    async for chunk in r.aiter_bytes():
                        yield chunk
                finally:
                    await r.aclose()

            return StreamingResponse(relay(), status_code=r.status_code, media_type=media)
        if r.status_code == 200 and path != "/v1/models":
            try:
                n = (r.json().get("usage") or {}).get("prompt_tokens")
            except (ValueError, AttributeError):
                n = None
            if isinstance(n, int) and n >= block_size:
                m.kv_requests.labels(path).inc()
        return Response(content=r.content, status_code=r.status_code, media_type=media)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await forward(request, "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await forward(request, "/v1/chat/completions")

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        return await forward(request, "/v1/models")

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {"status": "ok", "router": upstream}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(m.registry), media_type=CONTENT_TYPE_LATEST)

    return app


class VllmRouterServer:
    """vllm-router on a free port (log ``log_path``), pdsweep's counting passthrough on
    ``port``; ``.url`` is the passthrough's. A context manager like
    :class:`pdsweep.deploy.proxy.ProxyServer`. Raises RuntimeError when vllm-router is not
    installed, exits, or is not healthy within ``startup_timeout_s``."""

    def __init__(
        self,
        prefill_urls: list[str],
        decode_urls: list[str],
        port: int = 0,
        timeout_s: float = 300,
        log_path: Path | None = None,
        block_size: int = 16,
        startup_timeout_s: float = 60,
    ) -> None:
        self.prefill_urls, self.decode_urls = prefill_urls, decode_urls
        self.port, self.timeout_s, self.block_size = port, timeout_s, block_size
        self.log_path, self.startup_timeout_s = log_path, startup_timeout_s
        self.proc: subprocess.Popen[bytes] | None = None
        self.front: AppServer | None = None

    @property
    def url(self) -> str:
        return self.front.url if self.front else ""

    def start(self) -> VllmRouterServer:
        socks = [bind_socket("127.0.0.1", 0) for _ in range(2)]
        rport, mport = (s.getsockname()[1] for s in socks)
        for s in socks:
            s.close()
        argv = [*vllm_router_argv(), "--host", "127.0.0.1", "--port", str(rport)]
        argv += ["--prometheus-host", "127.0.0.1", "--prometheus-port", str(mport)]  # default 29000: shared
        argv += ["--vllm-pd-disaggregation", "--kv-connector", "nixl", "--policy", "round_robin"]
        for u in self.prefill_urls:
            argv += ["--prefill", u]
        for u in self.decode_urls:
            argv += ["--decode", u]
        log = open(self.log_path, "ab") if self.log_path else None
        try:  # the child keeps its own copy of the log descriptor
            out = log or subprocess.DEVNULL
            self.proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, **own_group())
        finally:
            if log:
                log.close()
        upstream = f"http://127.0.0.1:{rport}"
        deadline = time.monotonic() + self.startup_timeout_s
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vllm-router exited with code {self.proc.returncode}; see {self.log_path}")
            try:
                if httpx.get(upstream + "/health", timeout=2, trust_env=False).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"vllm-router not healthy within {self.startup_timeout_s:g} s; see {self.log_path}")
            time.sleep(0.2)
        self.front = AppServer(create_passthrough_app(upstream, self.timeout_s, self.block_size), port=self.port)
        self.front.start()
        return self

    def stop(self, timeout_s: float = 10.0) -> None:
        if self.front is not None:
            self.front.stop(timeout_s)
            self.front = None
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout_s)
        self.proc = None

    def __enter__(self) -> VllmRouterServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
