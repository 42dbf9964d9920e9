"""The PD proxy: one prefill leg, then one decode leg carrying the prefill's KV handle.

Flow of vLLM ``tests/v1/kv_connector/nixl_integration/toy_proxy_server.py``:

1. pick a prefill instance round-robin; send it the client's request with
   ``max_tokens=1`` (and ``max_completion_tokens=1``), ``stream=false``, no
   ``stream_options`` and ``kv_transfer_params`` = :data:`PREFILL_KV_PARAMS`, plus
   header ``X-Request-Id`` (one fresh id per client request, sent on both legs);
2. copy the ``kv_transfer_params`` of the prefill response into the client's request;
3. send that to a decode instance round-robin and relay its answer (SSE passthrough
   when the client asked for ``stream``).

Differences from upstream: upstream errors come back as HTTP errors (same status for
an upstream 4xx/5xx, 502 for connection errors, 504 for timeouts) with
``{"error": {"message", "stage"}}``; ``min_tokens`` is dropped from the prefill leg (it
must not exceed ``max_tokens=1`` there); the client's ``Authorization`` header is
forwarded instead of ``$OPENAI_API_KEY``; ``/metrics`` exposes the proxy's own counters.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import socket
import threading
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest

from pdsweep.deploy.faults import NO_FAULTS, Faults

log = logging.getLogger(__name__)

# What the prefill leg asks for: compute the prompt's KV, keep it for a remote decode.
PREFILL_KV_PARAMS: dict[str, Any] = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}
LATENCY_BUCKETS = (
    0.0005,
    0.001,
    0.002,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    120.0,
    300.0,
)
MAX_ERROR_BODY = 2000  # characters of an upstream error body quoted in our error message
KEEPALIVE_EXPIRY_S = 2.0  # below vLLM/uvicorn's 5 s keep-alive: never reuse a socket the server closes
SERVER_KEEPALIVE_S = 75  # above clients' idle timeouts (aiohttp in lm-eval: 15 s), so clients close first


class UpstreamError(Exception):
    """A failed leg: ``status`` is the HTTP status the client gets, ``stage`` the leg."""

    def __init__(self, status: int, stage: str, message: str) -> None:
        super().__init__(message)
        self.status, self.stage, self.message = status, stage, message


def error_response(status: int, stage: str, message: str) -> JSONResponse:
    """``{"error": {"message": str, "stage": str}}`` with HTTP ``status``."""
    return JSONResponse({"error": {"message": message, "stage": stage}}, status_code=status)


class _Metrics:
    """The proxy's own Prometheus metrics, in a private registry (one per app)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "pdsweep_proxy_requests", "Client requests by endpoint.", ["endpoint"], registry=self.registry
        )
        self.errors = Counter(
            "pdsweep_proxy_errors",
            "Failed client requests by endpoint and stage (request|prefill|decode|models).",
            ["endpoint", "stage"],
            registry=self.registry,
        )
        self.added = Histogram(
            "pdsweep_proxy_added_latency_seconds",
            "Time spent in the proxy outside the decode leg: prefill leg plus overhead.",
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.prefill = Histogram(
            "pdsweep_proxy_prefill_seconds",
            "Duration of the prefill leg.",
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.faults = Counter(
            "pdsweep_proxy_faults",
            "Test-only faults injected into decode legs (scramble|scramble_under_load|stale|decode_delay).",
            ["fault"],
            registry=self.registry,
        )
        self.kv_requests = Counter(
            "pdsweep_proxy_kv_requests",
            "PD requests answered by decode whose prompt (prefill usage.prompt_tokens) spans at least one KV block.",
            ["endpoint"],
            registry=self.registry,
        )


def _check_urls(role: str, urls: list[str]) -> list[str]:
    if not urls:
        raise ValueError(f"no {role} URL given")
    bad = [u for u in urls if not u.startswith(("http://", "https://"))]
    if bad:
        raise ValueError(f"{role} URLs must start with http:// or https://: {bad}")
    return [u.rstrip("/") for u in urls]


def _body_text(r: httpx.Response) -> str:
    text = r.text.strip()
    return text if len(text) <= MAX_ERROR_BODY else text[:MAX_ERROR_BODY] + "..."


class _Proxy:
    """State and request flow behind :func:`create_app`; one per app."""

    def __init__(
        self,
        prefill_urls: list[str],
        decode_urls: list[str],
        timeout_s: float,
        block_size: int = 16,
        faults: Faults = NO_FAULTS,
    ) -> None:
        self.prefill_urls = _check_urls("prefill", list(prefill_urls))
        self.decode_urls = _check_urls("decode", list(decode_urls))
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.timeout_s = float(timeout_s)
        if not block_size >= 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = int(block_size)
        self.faults = faults
        self._inflight = self._under_load = 0
        self._last_kv: Any = None
        self.metrics = _Metrics()
        self.client: httpx.AsyncClient | None = None
        self._next_prefill = 0
        self._next_decode = 0  # one event loop: plain counters are race-free
        self._decode_legs = 0  # decode legs started (faults.decode_delay_every)

    def new_client(self) -> httpx.AsyncClient:
        return httpx.AsyncClient(
            timeout=httpx.Timeout(self.timeout_s),
            trust_env=False,
            limits=httpx.Limits(
                max_connections=None, max_keepalive_connections=256, keepalive_expiry=KEEPALIVE_EXPIRY_S
            ),
        )

    def _client(self) -> httpx.AsyncClient:
        if self.client is None:  # app driven without its lifespan (e.g. ASGITransport)
            self.client = self.new_client()
        return self.client

    def pick(self, role: str) -> str:
        """Next instance of ``role`` (prefill|decode), round-robin."""
        if role == "prefill":
            url = self.prefill_urls[self._next_prefill % len(self.prefill_urls)]
            self._next_prefill += 1
        else:
            url = self.decode_urls[self._next_decode % len(self.decode_urls)]
            self._next_decode += 1
        return url

    async def send(self, stage: str, base: str, request: httpx.Request, stream: bool = False) -> httpx.Response:
        """Send ``request``; transport failures become :class:`UpstreamError` (502, 504 on timeout),
        and so does an upstream status >= 400 (same status)."""
        try:
            r = await self._client().send(request, stream=stream)
        except httpx.TimeoutException as e:
            raise UpstreamError(
                504, stage, f"{stage} {base}: timed out after {self.timeout_s:g} s ({type(e).__name__})"
            ) from None
        except httpx.HTTPError as e:
            raise UpstreamError(502, stage, f"{stage} {base}: {type(e).__name__}: {e}") from None
        if r.status_code >= 400:
            try:
                await r.aread()
            except httpx.HTTPError as e:
                raise UpstreamError(
                    r.status_code, stage, f"{stage} {base}: HTTP {r.status_code} ({type(e).__name__} reading the body)"
                ) from None
            finally:
                await r.aclose()
            raise UpstreamError(r.status_code, stage, f"{stage} {base}: {_body_text(r)}")
        return r

    async def prefill(
        self, path: str, body: dict[str, Any], headers: dict[str, str], chat: bool
    ) -> tuple[Any, int | None]:
        """Run the prefill leg; returns the response's ``kv_transfer_params`` (None only when
        ``drop_kv_transfer_params``) and its ``usage.prompt_tokens`` (None when absent).
        Raises :class:`UpstreamError` (stage ``prefill``)."""
        req = dict(body)  # only top-level keys change
        req["kv_transfer_params"] = dict(PREFILL_KV_PARAMS)
        req["stream"] = False
        req["max_tokens"] = 1
        if chat or "max_completion_tokens" in req:
            req["max_completion_tokens"] = 1
        req.pop("stream_options", None)
        req.pop("min_tokens", None)
        base = self.pick("prefill")
        client = self._client()
        r = await self.send("prefill", base, client.build_request("POST", base + path, json=req, headers=headers))
        try:
            data = r.json()
        except ValueError:
            raise UpstreamError(502, "prefill", f"prefill {base}: response is not JSON: {_body_text(r)}") from None
        kv = data.get("kv_transfer_params") if isinstance(data, dict) else None
        if kv is None and not self.faults.drop_kv_transfer_params:
            raise UpstreamError(502, "prefill", f"prefill {base}: prefill returned no kv_transfer_params")
        usage = data.get("usage") if isinstance(data.get("usage"), dict) else {}
        n = usage.get("prompt_tokens")
        return kv, n if isinstance(n, int) and not isinstance(n, bool) else None

    def decode_kv(self, kv: Any) -> Any:
        """The ``kv_transfer_params`` the decode leg gets: the prefill's own, unless a test-only
        fault is on: ``stale`` hands decode the *previous* request's (vllm 52234's stale-reference
        case) when it holds at least as many blocks per KV group (:func:`covers`; else, and for
        the first request, its own), ``scramble`` scrambles every one
        (:func:`scrambled`), ``scramble_every`` k scrambles 1 in k of the requests that arrive
        while another is in flight (corruption only under concurrency: the sequential probe
        never sees it). One event loop: the counters need no lock."""
        f = self.faults
        if f.stale_kv_transfer_params:
            prev, self._last_kv = self._last_kv, kv
            if prev is not None and covers(prev, kv):
                kv = prev
                self.metrics.faults.labels("stale").inc()
        if f.scramble_kv_block_ids:
            self.metrics.faults.labels("scramble").inc()
            return scrambled(kv)
        if f.scramble_every and self._inflight > 1:
            self._under_load += 1
            if self._under_load % f.scramble_every == 0:
                self.metrics.faults.labels("scramble_under_load").inc()
                return scrambled(kv)
        return kv

    def delays_decode(self) -> bool:
        """Whether this decode leg sleeps ``faults.decode_delay_s`` first: 1 in
        ``faults.decode_delay_every`` legs, from the first (counted here; one event loop)."""
        if not self.faults.decode_delay_s:
            return False
        self._decode_legs += 1
        if (self._decode_legs - 1) % self.faults.decode_delay_every:
            return False
        self.metrics.faults.labels("decode_delay").inc()
        return True

    async def completion(self, request: Request, endpoint: str, chat: bool) -> Response:
        self._inflight += 1
        try:
            return await self._completion(request, endpoint, chat)
        finally:
            self._inflight -= 1

    async def _completion(self, request: Request, endpoint: str, chat: bool) -> Response:
        t0 = time.perf_counter()
        m = self.metrics
        m.requests.labels(endpoint).inc()
        try:
            body = json.loads(await request.body())
        except ValueError as e:
            m.errors.labels(endpoint, "request").inc()
            return error_response(400, "request", f"request body is not JSON: {e}")
        if not isinstance(body, dict):
            m.errors.labels(endpoint, "request").inc()
            return error_response(400, "request", "request body must be a JSON object")
        req_id = str(uuid.uuid4())
        headers = {"X-Request-Id": req_id}
        auth = request.headers.get("authorization", "").strip()
        if len(auth.split()) > 1:  # lm-eval sends "Bearer " without a key: h11 refuses to forward that
            headers["Authorization"] = auth
        try:
            kv, prompt_tokens = await self.prefill(endpoint, body, headers, chat)
            t_prefill = time.perf_counter()
            m.prefill.observe(t_prefill - t0)
            body.pop("kv_transfer_params", None)
            if not self.faults.drop_kv_transfer_params:
                body["kv_transfer_params"] = self.decode_kv(kv)
            base = self.pick("decode")
            client = self._client()
            upstream = client.build_request("POST", base + endpoint, json=body, headers=headers)
            stream = bool(body.get("stream"))
            if self.delays_decode():  # test-only slowdown (bench/test_perf_teeth.py, the lease drill)
                await asyncio.sleep(self.faults.decode_delay_s)
            t_decode = time.perf_counter()
            r = await self.send("decode", base, upstream, stream=stream)
        except UpstreamError as e:
            m.errors.labels(endpoint, e.stage).inc()
            log.warning("%s %s failed (%d): %s", endpoint, req_id, e.status, e.message)
            return error_response(e.status, e.stage, e.message)
        m.added.observe(t_decode - t0)  # what follows is the decode leg (and the relay of its answer)
        if prompt_tokens is not None and prompt_tokens >= self.block_size:
            m.kv_requests.labels(endpoint).inc()  # decode must have read this request's KV (gate)
        media_type = r.headers.get("content-type", "application/json")
        if not stream:
            return Response(content=r.content, status_code=r.status_code, media_type=media_type)
        return StreamingResponse(
            self._relay(r, endpoint, req_id, base), status_code=r.status_code, media_type=media_type
        )

    async def _relay(self, r: httpx.Response, endpoint: str, req_id: str, base: str) -> AsyncIterator[bytes]:
        """Pass the decode stream through chunk by chunk; a broken stream ends with an SSE error event."""
        try:
            async for chunk in r.aiter_bytes():
                yield chunk
        except httpx.HTTPError as e:
            status = 504 if isinstance(e, httpx.TimeoutException) else 502
            msg = f"decode {base}: stream broken: {type(e).__name__}: {e}"
            self.metrics.errors.labels(endpoint, "decode").inc()
            log.warning("%s %s failed (%d): %s", endpoint, req_id, status, msg)
            if r.headers.get("content-type", "").startswith("text/event-stream"):
                err = {"error": {"message": msg, "stage": "decode", "code": status}}
                yield f"data: {json.dumps(err)}\n\n".encode()
        finally:
            await r.aclose()

    async def models(self) -> Response:
        m = self.metrics
        m.requests.labels("/v1/models").inc()
        base = self.decode_urls[0]
        try:
            r = await self.send("models", base, self._client().build_request("GET", base + "/v1/models"))
        except UpstreamError as e:
            m.errors.labels("/v1/models", e.stage).inc()
            return error_response(e.status, e.stage, e.message)
        return Response(
            content=r.content, status_code=r.status_code, media_type=r.headers.get("content-type", "application/json")
        )


def covers(old: Any, new: Any) -> bool:
    """Whether handle ``old`` lists at least as many ``remote_block_ids`` as ``new`` in every KV
    group (flat lists: one group). vLLM asserts it (``base_worker.py`` ``_apply_prefix_caching``,
    ``assert num_decode_blocks <= len(prefill_group)``) and the decode worker dies otherwise, so
    a stale handle that decode can actually read must cover the new request."""

    def groups(kv: Any) -> list[int] | None:
        ids = kv.get("remote_block_ids") if isinstance(kv, dict) else None
        if not isinstance(ids, list):
            return None
        return [len(g) for g in ids] if ids and isinstance(ids[0], list) else [len(ids)]

    a, b = groups(old), groups(new)
    return a is not None and b is not None and len(a) == len(b) and all(x >= y for x, y in zip(a, b))


def scrambled(kv: dict[str, Any] | None) -> dict[str, Any] | None:
    """``kv`` with ``remote_block_ids`` reversed (each group's list for hybrid KV caches):
    decode then reads the right blocks in the wrong order, i.e. KV that arrived wrong.
    Tests only: proves the consistency probe catches corrupted transfers. Keys carry
    their RoPE position, so attention over *full* blocks is order-invariant; what
    corrupts the output is the partial last block landing first (its empty slots read
    as tokens, the first block's tail lost): strongest for prompts of a few blocks."""
    if not kv or not isinstance(kv.get("remote_block_ids"), list):
        return kv
    ids = kv["remote_block_ids"]
    ids = [list(reversed(g)) for g in ids] if ids and isinstance(ids[0], list) else list(reversed(ids))
    return {**kv, "remote_block_ids": ids}


def create_app(
    prefill_urls: list[str],
    decode_urls: list[str],
    timeout_s: float = 300,
    block_size: int = 16,
    faults: Faults = NO_FAULTS,
) -> FastAPI:
    """The PD proxy as a FastAPI app (flow: vLLM ``toy_proxy_server.py``, see module doc).

    ``prefill_urls`` / ``decode_urls``: instance base URLs (``http://host:port``), used
    round-robin. ``timeout_s``: httpx timeout (connect, read, write, pool) of each upstream
    call. ``faults`` (tests only): :class:`Faults`.
    ``block_size``: the decode block size in tokens; a request answered by decode whose prefill ``usage.prompt_tokens``
    is >= it counts in ``pdsweep_proxy_kv_requests_total`` (vLLM's NIXL decode reads every
    such prompt's blocks: ``get_num_new_matched_tokens`` in nixl/pull_scheduler.py).

    Routes: ``POST /v1/completions``, ``POST /v1/chat/completions``, ``GET /v1/models``
    (first decode), ``GET /health`` (200 while the proxy is up), ``GET /metrics``
    (``pdsweep_proxy_requests_total{endpoint}``, ``pdsweep_proxy_errors_total{endpoint,stage}``,
    ``pdsweep_proxy_kv_requests_total{endpoint}``,
    histograms ``pdsweep_proxy_added_latency_seconds`` and ``pdsweep_proxy_prefill_seconds``).
    Errors: ``{"error": {"message", "stage"}}`` with the upstream status for an upstream
    4xx/5xx, 502 for a connection error or a prefill answer without ``kv_transfer_params``,
    504 for a timeout, 400 for a body that is not a JSON object.

    Raises ValueError for an empty or non-http(s) URL list, ``timeout_s <= 0`` or ``block_size < 1``.
    """
    proxy = _Proxy(prefill_urls, decode_urls, timeout_s, block_size, faults)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        proxy.client = proxy.new_client()
        try:
            yield
        finally:
            client, proxy.client = proxy.client, None
            await client.aclose()

    app = FastAPI(title="pdsweep PD proxy", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.proxy = proxy

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await proxy.completion(request, "/v1/completions", chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await proxy.completion(request, "/v1/chat/completions", chat=True)

    @app.get("/v1/models")
    async def models() -> Response:
        return await proxy.models()

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {"status": "ok", "prefill": proxy.prefill_urls, "decode": proxy.decode_urls}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(proxy.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app


def bind_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host:port`` (``port`` 0: a free one); raises OSError."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock


class AppServer:
    """Serve an ASGI ``app`` with uvicorn in a background thread; a context manager.

    ``port`` 0 picks a free port; ``.port`` and ``.url`` are set once started. Leaves the
    process's logging configuration alone. Raises OSError if the port cannot be bound and
    RuntimeError if the server does not start within ``startup_timeout_s``.
    """

    def __init__(
        self,
        app: Any,
        host: str = "127.0.0.1",
        port: int = 0,
        startup_timeout_s: float = 30.0,
        graceful_shutdown_s: float = 2.0,
    ) -> None:
        self.app, self.host, self.port = app, host, port
        self.startup_timeout_s, self.graceful_shutdown_s = startup_timeout_s, graceful_shutdown_s
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def start(self) -> AppServer:
        sock = bind_socket(self.host, self.port)
        self.port = sock.getsockname()[1]
        config = uvicorn.Config(
            self.app,
            host=self.host,
            port=self.port,
            log_config=None,
            log_level=None,
            access_log=False,
            lifespan="on",
            timeout_keep_alive=SERVER_KEEPALIVE_S,
            timeout_graceful_shutdown=max(1, round(self.graceful_shutdown_s)),
        )
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [sock]}, daemon=True, name=f"uvicorn-{self.port}"
        )
        self._thread.start()
        deadline = time.monotonic() + self.startup_timeout_s
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.stop()
                sock.close()
                raise RuntimeError(f"server on {self.url} did not start")
            time.sleep(0.005)
        return self

    def stop(self, timeout_s: float = 10.0) -> None:
        """Ask uvicorn to exit, wait for the thread (forcing exit after ``timeout_s / 2``)."""
        if self._server is None or self._thread is None:
            return
        self._server.should_exit = True
        self._thread.join(timeout_s / 2)
        if self._thread.is_alive():
            self._server.force_exit = True
            self._thread.join(timeout_s / 2)
        if self._thread.is_alive():
            log.error("uvicorn thread for %s did not stop", self.url)
        self._server = self._thread = None

    def __enter__(self) -> AppServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class ProxyServer(AppServer):
    """The PD proxy (:func:`create_app`) served in a background thread; used in-process by
    ``pdsweep run``. ``log_path``: also append this module's log records (and uvicorn's
    errors) to that file while the server runs.
    """

    def __init__(
        self,
        prefill_urls: list[str],
        decode_urls: list[str],
        host: str = "127.0.0.1",
        port: int = 0,
        timeout_s: float = 300,
        log_path: Path | None = None,
        block_size: int = 16,
        faults: Faults = NO_FAULTS,
    ) -> None:
        super().__init__(
            create_app(prefill_urls, decode_urls, timeout_s, block_size, faults),
            host,
            port,
        )
        self.log_path = Path(log_path) if log_path else None
        self._handler: logging.Handler | None = None
        self._saved_level = logging.NOTSET

    def start(self) -> ProxyServer:
        if self.log_path is not None and self._handler is None:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            self._handler = logging.FileHandler(self.log_path)
            self._handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
            self._saved_level = log.level
            if not log.isEnabledFor(logging.INFO):
                log.setLevel(logging.INFO)
            for name in (__name__, "uvicorn.error"):
                logging.getLogger(name).addHandler(self._handler)
        try:
            super().start()
        except BaseException:
            self._detach_log()
            raise
        proxy = self.app.state.proxy
        f = proxy.faults
        log.info(
            "PD proxy on %s: prefill %s, decode %s, timeout %g s%s",
            self.url,
            proxy.prefill_urls,
            proxy.decode_urls,
            proxy.timeout_s,
            ", DROPPING kv_transfer_params"
            if f.drop_kv_transfer_params
            else ", SCRAMBLING remote_block_ids"
            if f.scramble_kv_block_ids
            else f", SCRAMBLING 1 in {f.scramble_every} requests under load"
            if f.scramble_every
            else ", STALE kv_transfer_params (the previous request's)"
            if f.stale_kv_transfer_params
            else "",
        )
        return self

    def stop(self, timeout_s: float = 10.0) -> None:
        super().stop(timeout_s)
        self._detach_log()

    def _detach_log(self) -> None:
        if self._handler is not None:
            for name in (__name__, "uvicorn.error"):
                logging.getLogger(name).removeHandler(self._handler)
            self._handler.close()
            self._handler = None
            log.setLevel(self._saved_level)

    def __enter__(self) -> ProxyServer:
        return self.start()


def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Options of ``pdsweep proxy``: --prefill URL..., --decode URL..., --host, --port, --timeout."""
    parser.add_argument("--prefill", nargs="+", required=True, metavar="URL", help="prefill instance base URLs")
    parser.add_argument("--decode", nargs="+", required=True, metavar="URL", help="decode instance base URLs")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8192, help="port to bind (default 8192, as upstream)")
    parser.add_argument(
        "--timeout",
        type=float,
        default=300.0,
        metavar="S",
        help="timeout of each upstream call in seconds (default 300)",
    )
    return parser


def main(args: argparse.Namespace) -> int:
    """Run the proxy in the foreground until SIGINT/SIGTERM; returns the exit code (0).
    Raises UserError for bad URLs, a bad timeout or a port that cannot be bound."""
    from pdsweep.core.errors import UserError

    try:
        app = create_app(args.prefill, args.decode, args.timeout)
        sock = bind_socket(args.host, args.port)
    except (ValueError, OSError) as e:
        raise UserError(f"pdsweep proxy: {e}") from None
    server = uvicorn.Server(
        uvicorn.Config(
            app, host=args.host, port=sock.getsockname()[1], access_log=False, timeout_keep_alive=SERVER_KEEPALIVE_S
        )
    )
    log.info(
        "PD proxy listening on http://%s:%d (prefill %s, decode %s)",
        args.host,
        sock.getsockname()[1],
        args.prefill,
        args.decode,
    )
    server.run(sockets=[sock])
    return 0
