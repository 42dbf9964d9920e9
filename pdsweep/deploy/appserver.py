"""Serving an ASGI app in-process: :class:`AppServer` (uvicorn in a background thread, with
uvloop and httptools when installed: uvicorn's ``auto``) and :func:`bind_socket`; plain ASGI
helpers (:func:`read_body`, :func:`respond`, :func:`disconnected`). Used by the PD
proxy (:mod:`pdsweep.deploy.proxy`), the vllm-router passthrough and the tests' fake servers."""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

import uvicorn

log = logging.getLogger(__name__)
Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]
SERVER_KEEPALIVE_S = 75  # above clients' idle timeouts (aiohttp in lm-eval: 15 s), so clients close first


async def read_body(receive: Receive) -> bytes:
    """The whole request body; raises ConnectionError when the client hung up first."""
    chunks = []
    while True:
        m = await receive()
        if m["type"] == "http.disconnect":
            raise ConnectionError("client disconnected")
        chunks.append(m.get("body", b""))
        if not m.get("more_body"):
            return b"".join(chunks)


async def respond(send: Send, status: int, body: bytes, media_type: str = "application/json") -> None:
    """Send one whole response: ``status``, ``body`` (bytes) as ``media_type``."""
    headers = [(b"content-type", media_type.encode()), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


async def disconnected(receive: Receive) -> None:
    """Return once the client has hung up (``http.disconnect``)."""
    while (await receive())["type"] != "http.disconnect":
        pass


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
