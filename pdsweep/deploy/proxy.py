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

Hot path: the two completion routes are a plain ASGI handler in front of FastAPI (no routing,
request or response objects) and the upstream client is one ``aiohttp`` session (C HTTP
parser, keep-alive pool); httpx/httpcore/h11 cost 3x the CPU per request (issue 40). The
test-only faults (:mod:`pdsweep.deploy.proxy_faults`) run only when one is on.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import uvicorn
from fastapi import FastAPI
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.routing import Route

from pdsweep.core.errors import UserError
from pdsweep.core.faults import NO_PROXY_FAULTS, ProxyFaults
from pdsweep.deploy.appserver import (
    SERVER_KEEPALIVE_S,
    AppServer,
    Receive,
    Scope,
    Send,
    bind_socket,
    disconnected,
    read_body,
    respond,
)
from pdsweep.deploy.proxy_faults import FaultInjector
from pdsweep.deploy.proxy_metrics import ProxyMetrics, error_body, error_response

log = logging.getLogger(__name__)
# in-process proxies writing a log file (pdsweep run: the cell's logs/proxy.log): while any runs,
# this module's records go to those files only, not to pdsweep's console (a fault drill's or a
# crashed decode's failed requests made a hundred WARNING lines there; the cell's reason names the cause)
_FILED = [0]
_FILED_LOCK = threading.Lock()

# What the prefill leg asks for: compute the prompt's KV, keep it for a remote decode.
PREFILL_KV_PARAMS: dict[str, Any] = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}
MAX_ERROR_BODY = 2000  # characters of an upstream error body quoted in our error message
KEEPALIVE_EXPIRY_S = 2.0  # below vLLM/uvicorn's 5 s keep-alive: never reuse a socket the server closes
ENDPOINTS = {"/v1/completions": False, "/v1/chat/completions": True}  # path -> chat
JSON = "application/json"


class UpstreamError(Exception):
    """A failed leg: ``status`` is the HTTP status the client gets, ``stage`` the leg."""

    def __init__(self, status: int, stage: str, message: str) -> None:
        super().__init__(message)
        self.status, self.stage, self.message = status, stage, message


def _check_urls(role: str, urls: list[str]) -> list[str]:
    if not urls:
        raise ValueError(f"no {role} URL given")
    bad = [u for u in urls if not u.startswith(("http://", "https://"))]
    if bad:
        raise ValueError(f"{role} URLs must start with http:// or https://: {bad}")
    return [u.rstrip("/") for u in urls]


def _body_text(raw: bytes) -> str:
    text = raw.decode(errors="replace").strip()
    return text if len(text) <= MAX_ERROR_BODY else text[:MAX_ERROR_BODY] + "..."


class _Proxy:
    """State and request flow behind :func:`create_app`; one per app, one event loop (plain
    counters are race-free)."""

    def __init__(
        self,
        prefill_urls: list[str],
        decode_urls: list[str],
        timeout_s: float,
        block_size: int = 16,
        faults: ProxyFaults = NO_PROXY_FAULTS,
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
        self.metrics = m = ProxyMetrics()
        self.inject = FaultInjector(faults, m.faults) if faults.active else None  # None: no fault work
        self.session: aiohttp.ClientSession | None = None
        self._next_prefill = self._next_decode = 0

    def new_session(self) -> aiohttp.ClientSession:
        """The upstream client: keep-alive pool without a connection limit; ``timeout_s`` bounds
        connecting and each wait for bytes (as httpx's connect/read timeouts)."""
        return aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=KEEPALIVE_EXPIRY_S),
            timeout=aiohttp.ClientTimeout(total=None, connect=self.timeout_s, sock_read=self.timeout_s),
            trust_env=False,
        )

    def _session(self) -> aiohttp.ClientSession:
        if self.session is None:  # app driven without its lifespan
            self.session = self.new_session()
        return self.session

    async def close(self) -> None:
        session, self.session = self.session, None
        if session is not None:
            await session.close()

    async def send(
        self, stage: str, base: str, url: str, data: bytes | None, headers: dict[str, str], read: bool = True
    ) -> tuple[aiohttp.ClientResponse, bytes]:
        """POST ``data`` (GET when None) to ``url``; with ``read``, the whole body is read (and
        the connection released). Transport failures become :class:`UpstreamError` (502, 504 on
        timeout), and so does an upstream status >= 400 (same status)."""
        r: aiohttp.ClientResponse | None = None
        try:
            method = "GET" if data is None else "POST"
            r = await self._session().request(method, url, data=data, headers=headers)
            if r.status >= 400 or read:
                body = await r.read()
                r.release()
                if r.status >= 400:
                    raise UpstreamError(r.status, stage, f"{stage} {base}: {_body_text(body)}")
                return r, body
            return r, b""
        except asyncio.TimeoutError as e:  # aiohttp's ServerTimeoutError, ConnectionTimeoutError
            if r is not None:
                r.release()
            how = f"HTTP {r.status}, " if r is not None and r.status >= 400 else ""
            msg = f"{stage} {base}: {how}timed out after {self.timeout_s:g} s ({type(e).__name__})"
            raise UpstreamError(504, stage, msg) from None
        except aiohttp.ClientError as e:
            if r is not None:
                r.release()
            status = r.status if r is not None and r.status >= 400 else 502
            raise UpstreamError(status, stage, f"{stage} {base}: {type(e).__name__}: {e}") from None

    async def prefill(
        self, path: str, body: dict[str, Any], headers: dict[str, str], chat: bool
    ) -> tuple[Any, int | None]:
        """Run the prefill leg; returns the response's ``kv_transfer_params`` (None only when
        ``drop_kv_transfer_params``) and its ``usage.prompt_tokens`` (None when absent).
        Raises :class:`UpstreamError` (stage ``prefill``)."""
        req = dict(body)  # only top-level keys change
        req["kv_transfer_params"] = PREFILL_KV_PARAMS
        req["stream"] = False
        req["max_tokens"] = 1
        if chat or "max_completion_tokens" in req:
            req["max_completion_tokens"] = 1
        req.pop("stream_options", None)
        req.pop("min_tokens", None)
        base = self.prefill_urls[self._next_prefill % len(self.prefill_urls)]
        self._next_prefill += 1
        _, raw = await self.send("prefill", base, base + path, json.dumps(req).encode(), headers)
        try:
            data = json.loads(raw)
        except ValueError:
            raise UpstreamError(502, "prefill", f"prefill {base}: response is not JSON: {_body_text(raw)}") from None
        kv = data.get("kv_transfer_params") if isinstance(data, dict) else None
        if kv is None and not self.faults.drop_kv_transfer_params:
            raise UpstreamError(502, "prefill", f"prefill {base}: prefill returned no kv_transfer_params")
        usage = data.get("usage") if isinstance(data, dict) else None
        n = usage.get("prompt_tokens") if isinstance(usage, dict) else None
        return kv, n if isinstance(n, int) and not isinstance(n, bool) else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """ASGI app of ``POST /v1/completions`` and ``/v1/chat/completions``."""
        inject = self.inject
        if inject is not None:
            inject.inflight += 1
        try:
            await self._completion(scope, receive, send)
        finally:
            if inject is not None:
                inject.inflight -= 1

    async def _completion(self, scope: Scope, receive: Receive, send: Send) -> None:
        t0 = time.perf_counter()
        endpoint: str = scope["path"]
        m = self.metrics
        m.requests.labels(endpoint).inc()
        try:
            body = json.loads(await read_body(receive))
        except ConnectionError:
            return  # the client hung up before its body arrived: nothing to answer
        except ValueError as e:
            m.errors.labels(endpoint, "request").inc()
            return await respond(send, 400, error_body("request", f"request body is not JSON: {e}"))
        if not isinstance(body, dict):
            m.errors.labels(endpoint, "request").inc()
            return await respond(send, 400, error_body("request", "request body must be a JSON object"))
        req_id = str(uuid.uuid4())
        headers = {"X-Request-Id": req_id, "Content-Type": JSON}
        for k, v in scope["headers"]:
            if k == b"authorization":  # lm-eval sends "Bearer " without a key: not forwarded
                auth = v.decode("latin-1").strip()
                if len(auth.split()) > 1:
                    headers["Authorization"] = auth
        stream = bool(body.get("stream"))
        try:
            kv, prompt_tokens = await self.prefill(endpoint, body, headers, ENDPOINTS[endpoint])
            t_prefill = time.perf_counter()
            m.prefill.observe(t_prefill - t0)
            body.pop("kv_transfer_params", None)
            if not self.faults.drop_kv_transfer_params:
                body["kv_transfer_params"] = kv if self.inject is None else self.inject.decode_kv(kv)
            base = self.decode_urls[self._next_decode % len(self.decode_urls)]
            self._next_decode += 1
            if self.inject is not None and self.inject.delays_decode():  # test-only slowdown
                await asyncio.sleep(self.faults.decode_delay_s)
            t_decode = time.perf_counter()
            r, raw = await self.send("decode", base, base + endpoint, json.dumps(body).encode(), headers, not stream)
        except UpstreamError as e:
            m.errors.labels(endpoint, e.stage).inc()
            log.warning("%s %s failed (%d): %s", endpoint, req_id, e.status, e.message)
            return await respond(send, e.status, error_body(e.stage, e.message))
        m.added.observe(t_decode - t0)  # what follows is the decode leg (and the relay of its answer)
        if prompt_tokens is not None and prompt_tokens >= self.block_size:
            m.kv_requests.labels(endpoint).inc()  # decode must have read this request's KV (gate)
        media_type = r.headers.get("content-type", JSON)
        if not stream:
            return await respond(send, r.status, raw, media_type)
        await self._stream(r, endpoint, req_id, base, receive, send)

    async def _stream(
        self, r: aiohttp.ClientResponse, endpoint: str, req_id: str, base: str, receive: Receive, send: Send
    ) -> None:
        """Pass the decode stream through chunk by chunk; a broken stream ends with an SSE error
        event; a client that hangs up ends the relay (and the decode request with it)."""
        headers = [(b"content-type", r.headers.get("content-type", JSON).encode())]
        relay = asyncio.ensure_future(self._relay(r, endpoint, req_id, base, send, headers))
        gone = asyncio.ensure_future(disconnected(receive))
        clean = False
        try:
            await asyncio.wait({relay, gone}, return_when=asyncio.FIRST_COMPLETED)
            clean = relay.done() and not relay.cancelled() and relay.exception() is None
        finally:
            gone.cancel()
            relay.cancel()  # no-op once done
            if not clean:
                r.close()  # the decode connection goes: vLLM aborts the request
            with contextlib.suppress(asyncio.CancelledError):
                await relay
            r.release()

    async def _relay(
        self, r: aiohttp.ClientResponse, endpoint: str, req_id: str, base: str, send: Send, headers: list
    ) -> None:
        await send({"type": "http.response.start", "status": r.status, "headers": headers})
        try:
            async for chunk in r.content.iter_any():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            status = 504 if isinstance(e, asyncio.TimeoutError) else 502
            msg = f"decode {base}: stream broken: {type(e).__name__}: {e}"
            self.metrics.errors.labels(endpoint, "decode").inc()
            log.warning("%s %s failed (%d): %s", endpoint, req_id, status, msg)
            if r.headers.get("content-type", "").startswith("text/event-stream"):
                err = {"error": {"message": msg, "stage": "decode", "code": status}}
                await send({"type": "http.response.body", "body": f"data: {json.dumps(err)}\n\n".encode()})
                return
        await send({"type": "http.response.body", "body": b""})

    async def models(self) -> Response:
        m = self.metrics
        m.requests.labels("/v1/models").inc()
        base = self.decode_urls[0]
        try:
            r, raw = await self.send("models", base, base + "/v1/models", None, {})
        except UpstreamError as e:
            m.errors.labels("/v1/models", e.stage).inc()
            return error_response(e.status, e.stage, e.message)
        return Response(content=raw, status_code=r.status, media_type=r.headers.get("content-type", JSON))


class _HotPath:
    """ASGI middleware: the completion routes go straight to the :class:`_Proxy` ASGI app; every other
    request (and any other method on those paths) to the FastAPI app."""

    def __init__(self, app: Any, proxy: _Proxy) -> None:
        self.app, self.proxy = app, proxy

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST" and scope["path"] in ENDPOINTS:
            return await self.proxy(scope, receive, send)
        await self.app(scope, receive, send)


def create_app(
    prefill_urls: list[str],
    decode_urls: list[str],
    timeout_s: float = 300,
    block_size: int = 16,
    faults: ProxyFaults = NO_PROXY_FAULTS,
) -> FastAPI:
    """The PD proxy as a FastAPI app (flow: vLLM ``toy_proxy_server.py``, see module doc).

    ``prefill_urls`` / ``decode_urls``: instance base URLs (``http://host:port``), used
    round-robin. ``timeout_s``: upstream timeout in seconds (connecting, and each wait for
    bytes). ``faults`` (tests only): :class:`pdsweep.core.faults.ProxyFaults`.
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
        proxy.session = proxy.new_session()
        try:
            yield
        finally:
            await proxy.close()

    app = FastAPI(title="pdsweep PD proxy", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.proxy = proxy
    app.add_middleware(_HotPath, proxy=proxy)
    for path in ENDPOINTS:  # served by _HotPath; the routes give other methods FastAPI's 405
        app.router.routes.append(Route(path, proxy, methods=["POST"]))

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


class ProxyServer(AppServer):
    """The PD proxy (:func:`create_app`) served in a background thread; used in-process by
    ``pdsweep run``. ``log_path``: also append this module's log records (and uvicorn's
    errors) to that file while the server runs.
    """

    def __init__(
        self,
        prefill_urls: list[str],
        decode_urls: list[str],
        port: int = 0,
        timeout_s: float = 300,
        log_path: Path | None = None,
        block_size: int = 16,
        faults: ProxyFaults = NO_PROXY_FAULTS,
    ) -> None:
        super().__init__(
            create_app(prefill_urls, decode_urls, timeout_s, block_size, faults),
            port=port,
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
            with _FILED_LOCK:
                _FILED[0] += 1
                log.propagate = False
        try:
            super().start()
        except BaseException:
            self._detach_log()
            raise
        proxy = self.app.state.proxy
        log.info(
            "PD proxy on %s: prefill %s, decode %s, timeout %g s%s",
            self.url,
            proxy.prefill_urls,
            proxy.decode_urls,
            proxy.timeout_s,
            proxy.faults.describe(),
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
            with _FILED_LOCK:
                _FILED[0] -= 1
                log.propagate = _FILED[0] == 0

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
