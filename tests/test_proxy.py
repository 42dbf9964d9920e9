"""PD proxy against fake vLLM instances (FastAPI apps served by uvicorn in threads).

The flow under test is vLLM's tests/v1/kv_connector/nixl_integration/toy_proxy_server.py:
prefill leg with max_tokens=1 / stream=false / do_remote_decode, decode leg with the
prefill's kv_transfer_params, round-robin on both sides, SSE passthrough.
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import json
import socketserver
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from prometheus_client.parser import text_string_to_metric_families

from pdsweep.core.errors import UserError
from pdsweep.core.faults import ProxyFaults
from pdsweep.deploy.appserver import AppServer
from pdsweep.deploy.proxy import PREFILL_KV_PARAMS, ProxyServer, add_cli_args, create_app, main

HANG_GUARD_S = 10  # a fake that waits on the test gives up after this long (never a hang)
N_CHUNKS = 5


class Fake:
    """A fake vLLM instance: records each request; behaviour set through attributes."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.release = threading.Event()
        self.reset()
        self.app = self._build()
        self.server: AppServer | None = None

    def reset(self) -> None:
        self.release.set()  # ends a wait left over from the previous test
        self.release = threading.Event()  # set by the test to end a wait
        self.requests: list[dict[str, Any]] = []  # {"path", "body", "headers"}
        self.status = 200  # answer this status with an error body instead
        self.kv = True  # prefill answers carry kv_transfer_params
        self.wait = False  # block every request until ``release``
        self.wait_after_first_chunk = False  # streaming: block after chunk 0 until ``release``
        self.stream_ended = threading.Event()  # set when a streamed answer ends (finished or cancelled)

    @property
    def url(self) -> str:
        assert self.server is not None
        return self.server.url

    async def _until_released(self) -> None:
        release, deadline = self.release, time.monotonic() + HANG_GUARD_S
        while not release.is_set() and time.monotonic() < deadline:
            await asyncio.sleep(0.01)

    def _build(self) -> FastAPI:
        app = FastAPI()

        async def handle(request: Request) -> Any:
            body = await request.json()
            self.requests.append({"path": request.url.path, "body": body, "headers": dict(request.headers)})
            if self.wait:
                await self._until_released()
            if self.status != 200:
                return JSONResponse({"error": {"message": f"{self.name} says boom"}}, status_code=self.status)
            kvp = body.get("kv_transfer_params") or {}
            n = len(self.requests)
            if kvp.get("do_remote_decode"):  # prefill leg
                out: dict[str, Any] = {
                    "id": f"{self.name}-{n}",
                    "choices": [{"text": "x"}],
                    "usage": {"prompt_tokens": len(str(body.get("prompt", "")).split())},
                }
                if self.kv:
                    out["kv_transfer_params"] = {
                        "do_remote_prefill": True,
                        "do_remote_decode": False,
                        "remote_engine_id": self.name,
                        "remote_block_ids": [n, n + 1],
                        "remote_host": "127.0.0.1",
                        "remote_port": 5559,
                        "remote_request_id": request.headers.get("x-request-id"),
                    }
                return out
            if body.get("stream"):
                return StreamingResponse(self._sse(n), media_type="text/event-stream")
            return {
                "id": f"{self.name}-{n}",
                "choices": [{"text": f"decoded by {self.name}"}],
                "echo_kv": body.get("kv_transfer_params"),
            }

        app.post("/v1/completions")(handle)
        app.post("/v1/chat/completions")(handle)

        @app.get("/v1/models")
        async def models() -> dict[str, Any]:
            return {"object": "list", "data": [{"id": f"model-of-{self.name}"}]}

        return app

    async def _sse(self, n: int) -> Any:
        try:
            for i in range(N_CHUNKS):
                yield f"data: {json.dumps({'i': i, 'by': self.name, 'n': n})}\n\n"
                if i == 0 and self.wait_after_first_chunk:
                    await self._until_released()
            yield "data: [DONE]\n\n"
        finally:
            self.stream_ended.set()


class _Closer(socketserver.BaseRequestHandler):
    def handle(self) -> None:  # read the request, then hang up without answering
        self.request.recv(65536)


@pytest.fixture(scope="module")
def _fake_servers() -> Iterator[dict[str, Fake]]:
    out = {n: Fake(n) for n in ("prefill-0", "prefill-1", "decode-0", "decode-1")}
    try:
        for f in out.values():
            f.server = AppServer(f.app).start()
        yield out
    finally:
        for f in out.values():
            f.release.set()
            if f.server is not None:
                f.server.stop()


@pytest.fixture
def fakes(_fake_servers: dict[str, Fake]) -> Iterator[dict[str, Fake]]:
    """prefill-0/1 and decode-0/1 fakes, each on its own free port, reset for each test."""
    for f in _fake_servers.values():
        f.reset()
    yield _fake_servers
    for f in _fake_servers.values():
        f.release.set()


def _proxy(
    fakes: dict[str, Fake], prefill=("prefill-0", "prefill-1"), decode=("decode-0", "decode-1"), **kw: Any
) -> ProxyServer:
    return ProxyServer([fakes[n].url for n in prefill], [fakes[n].url for n in decode], **kw)


def _client(timeout: float = 10) -> httpx.Client:
    return httpx.Client(timeout=timeout, trust_env=False)


@pytest.fixture(autouse=True, scope="module")
def no_leftover_threads() -> Iterator[None]:
    before = {t.ident for t in threading.enumerate()}
    yield
    left = [t.name for t in threading.enumerate() if t.ident not in before and t.is_alive()]
    assert not left, f"threads left behind: {left}"


def test_prefill_leg_then_decode_leg_with_prefill_kv(fakes: dict[str, Fake]) -> None:
    body = {"model": "m", "prompt": "hello", "max_tokens": 50, "temperature": 0}
    with _proxy(fakes) as px, _client() as c:
        r = c.post(f"{px.url}/v1/completions", json=body)
    assert r.status_code == 200, r.text
    (pre,) = fakes["prefill-0"].requests
    (dec,) = fakes["decode-0"].requests
    assert pre["body"] == {**body, "max_tokens": 1, "stream": False, "kv_transfer_params": PREFILL_KV_PARAMS}
    assert pre["body"]["kv_transfer_params"] == {
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "remote_engine_id": None,
        "remote_block_ids": None,
        "remote_host": None,
        "remote_port": None,
    }
    assert "max_completion_tokens" not in pre["body"]
    rid = pre["headers"]["x-request-id"]
    assert rid and dec["headers"]["x-request-id"] == rid
    expected_kv = {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_engine_id": "prefill-0",
        "remote_block_ids": [1, 2],
        "remote_host": "127.0.0.1",
        "remote_port": 5559,
        "remote_request_id": rid,
    }
    assert dec["body"] == {**body, "kv_transfer_params": expected_kv}
    assert r.json() == {"id": "decode-0-1", "choices": [{"text": "decoded by decode-0"}], "echo_kv": expected_kv}


def test_chat_prefill_caps_completion_tokens_and_drops_stream_options(fakes: dict[str, Fake]) -> None:
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": "hi"}],
        "max_completion_tokens": 30,
        "stream": True,
        "stream_options": {"include_usage": True},
        "min_tokens": 5,
    }
    with _proxy(fakes) as px, _client() as c:
        r = c.post(f"{px.url}/v1/chat/completions", json=body)
    assert r.status_code == 200
    pre = fakes["prefill-0"].requests[0]
    dec = fakes["decode-0"].requests[0]
    assert pre["path"] == dec["path"] == "/v1/chat/completions"
    assert pre["body"]["max_tokens"] == 1 and pre["body"]["max_completion_tokens"] == 1
    assert pre["body"]["stream"] is False
    assert "stream_options" not in pre["body"] and "min_tokens" not in pre["body"]
    assert dec["body"]["stream"] is True and dec["body"]["stream_options"] == {"include_usage": True}
    assert dec["body"]["max_completion_tokens"] == 30 and "max_tokens" not in dec["body"]


def test_authorization_forwarded_only_with_a_key(fakes: dict[str, Fake]) -> None:
    with _proxy(fakes, prefill=("prefill-0",), decode=("decode-0",)) as px:
        for auth in ("Bearer ", "Bearer sk-1"):  # lm-eval sends "Bearer " when no key is set
            conn = http.client.HTTPConnection("127.0.0.1", px.port, timeout=10)
            try:
                conn.request(
                    "POST",
                    "/v1/completions",
                    body=json.dumps({"prompt": "p", "max_tokens": 2}),
                    headers={"Content-Type": "application/json", "Authorization": auth},
                )
                assert conn.getresponse().status == 200
            finally:
                conn.close()
    for f in (fakes["prefill-0"], fakes["decode-0"]):
        assert [r["headers"].get("authorization") for r in f.requests] == [None, "Bearer sk-1"]


def test_each_request_gets_its_own_request_id(fakes: dict[str, Fake]) -> None:
    with _proxy(fakes) as px, _client() as c:
        for _ in range(3):
            assert c.post(f"{px.url}/v1/completions", json={"prompt": "p", "max_tokens": 2}).status_code == 200
    ids = [r["headers"]["x-request-id"] for n in ("prefill-0", "prefill-1") for r in fakes[n].requests]
    assert len(set(ids)) == 3


def test_concurrent_requests_keep_their_own_kv(fakes: dict[str, Fake]) -> None:
    """Under concurrency each decode leg carries the KV handle of its own prefill leg."""
    n = 24
    with _proxy(fakes) as px, _client() as c, ThreadPoolExecutor(8) as pool:
        rs = list(
            pool.map(lambda i: c.post(f"{px.url}/v1/completions", json={"prompt": f"p{i}", "max_tokens": 2}), range(n))
        )
    assert [r.status_code for r in rs] == [200] * n
    decoded = [r for name in ("decode-0", "decode-1") for r in fakes[name].requests]
    assert len(decoded) == n
    for r in decoded:
        assert r["body"]["kv_transfer_params"]["remote_request_id"] == r["headers"]["x-request-id"]
    prompts = {
        r["body"]["prompt"]: r["headers"]["x-request-id"]
        for name in ("prefill-0", "prefill-1")
        for r in fakes[name].requests
    }
    assert {r["body"]["prompt"]: r["headers"]["x-request-id"] for r in decoded} == prompts


def test_round_robin_over_two_prefill_and_two_decode(fakes: dict[str, Fake]) -> None:
    with _proxy(fakes) as px, _client() as c:
        served = [
            c.post(f"{px.url}/v1/completions", json={"prompt": f"p{i}", "max_tokens": 2}).json() for i in range(4)
        ]
    assert [s["id"].rsplit("-", 1)[0] for s in served] == ["decode-0", "decode-1", "decode-0", "decode-1"]
    assert [s["echo_kv"]["remote_engine_id"] for s in served] == ["prefill-0", "prefill-1", "prefill-0", "prefill-1"]
    for n in fakes:
        assert len(fakes[n].requests) == 2, n
    assert [r["body"]["prompt"] for r in fakes["prefill-1"].requests] == ["p1", "p3"]


def test_streaming_passes_sse_chunks_through_in_order(fakes: dict[str, Fake]) -> None:
    dec = fakes["decode-0"]
    dec.wait_after_first_chunk = True  # the rest only comes after the client saw chunk 0
    events = []
    with _proxy(fakes) as px, _client(timeout=HANG_GUARD_S / 2) as c:
        with c.stream("POST", f"{px.url}/v1/completions", json={"prompt": "p", "max_tokens": 8, "stream": True}) as r:
            assert r.status_code == 200
            assert r.headers["content-type"].startswith("text/event-stream")
            for line in r.iter_lines():
                if not line:
                    continue
                events.append(line)
                if len(events) == 1:
                    dec.release.set()  # a proxy that buffered the whole stream would time out here
    expected = [f"data: {json.dumps({'i': i, 'by': 'decode-0', 'n': 1})}" for i in range(N_CHUNKS)]
    assert events == expected + ["data: [DONE]"]
    assert fakes["prefill-0"].requests[0]["body"]["stream"] is False


def test_stream_stalling_mid_way_ends_with_an_error_event(fakes: dict[str, Fake]) -> None:
    fakes["decode-0"].wait_after_first_chunk = True  # never released: the decode stream stalls
    with _proxy(fakes, timeout_s=0.3) as px, _client() as c:
        with c.stream("POST", f"{px.url}/v1/completions", json={"prompt": "p", "max_tokens": 8, "stream": True}) as r:
            events = [line for line in r.iter_lines() if line]
        metrics = _samples(c.get(f"{px.url}/metrics").text)
    assert r.status_code == 200  # headers were already sent when the stream broke
    assert events[0] == f"data: {json.dumps({'i': 0, 'by': 'decode-0', 'n': 1})}"
    assert len(events) == 2 and "data: [DONE]" not in events
    err = json.loads(events[1].removeprefix("data: "))["error"]
    assert err["stage"] == "decode" and err["code"] == 504 and "stream broken: SocketTimeoutError" in err["message"]
    assert metrics[("pdsweep_proxy_errors_total", (("endpoint", "/v1/completions"), ("stage", "decode")))] == 1


def test_client_hanging_up_mid_stream_ends_the_decode_stream(fakes: dict[str, Fake]) -> None:
    """A client gone mid-stream closes the decode leg (vLLM then aborts the request) instead of
    the proxy waiting on decode until its read timeout."""
    dec = fakes["decode-0"]
    dec.wait_after_first_chunk = True  # never released: decode stalls after chunk 0
    with _proxy(fakes, timeout_s=60) as px, _client() as c:
        with c.stream("POST", f"{px.url}/v1/completions", json={"prompt": "p", "max_tokens": 8, "stream": True}) as r:
            first = next(line for line in r.iter_lines() if line)
        t0 = time.monotonic()  # the client has hung up
        assert dec.stream_ended.wait(HANG_GUARD_S / 2), "decode stream still open after the client left"
        elapsed = time.monotonic() - t0
    assert first == f"data: {json.dumps({'i': 0, 'by': 'decode-0', 'n': 1})}"
    assert elapsed < 2, f"decode stream closed only after {elapsed:.1f} s"  # hang guard, not a performance target


@pytest.mark.parametrize("status", [400, 500])
def test_prefill_error_status_and_message_come_back(fakes: dict[str, Fake], status: int) -> None:
    fakes["prefill-0"].status = status
    with _proxy(fakes) as px, _client() as c:
        r = c.post(f"{px.url}/v1/completions", json={"prompt": "p", "max_tokens": 2})
    assert r.status_code == status
    err = r.json()["error"]
    assert err["stage"] == "prefill"
    assert err["message"].startswith(f"prefill {fakes['prefill-0'].url}: ")
    assert "prefill-0 says boom" in err["message"]
    assert not fakes["decode-0"].requests


def test_prefill_without_kv_transfer_params_is_502(fakes: dict[str, Fake]) -> None:
    fakes["prefill-0"].kv = False
    with _proxy(fakes) as px, _client() as c:
        r = c.post(f"{px.url}/v1/completions", json={"prompt": "p", "max_tokens": 2})
    assert r.status_code == 502
    assert r.json()["error"]["stage"] == "prefill"
    assert "prefill returned no kv_transfer_params" in r.json()["error"]["message"]
    assert not fakes["decode-0"].requests


@pytest.mark.parametrize("stream", [False, True])
def test_decode_error_status_comes_back(fakes: dict[str, Fake], stream: bool) -> None:
    fakes["decode-0"].status = 503
    with _proxy(fakes) as px, _client() as c:
        r = c.post(f"{px.url}/v1/completions", json={"prompt": "p", "max_tokens": 2, "stream": stream})
    assert r.status_code == 503
    assert r.json()["error"]["stage"] == "decode"
    assert "decode-0 says boom" in r.json()["error"]["message"]


@pytest.mark.parametrize("stream", [False, True])
def test_decode_killed_gives_502_quickly(fakes: dict[str, Fake], stream: bool) -> None:
    dead = Fake("decode-dead")
    dead.server = AppServer(dead.app).start()
    dead_url = dead.url
    dead.server.stop()  # killed: its port now refuses connections
    with ProxyServer([fakes["prefill-0"].url], [dead_url], timeout_s=60) as px, _client(timeout=30) as c:
        t0 = time.monotonic()
        r = c.post(f"{px.url}/v1/completions", json={"prompt": "p", "max_tokens": 2, "stream": stream})
        elapsed = time.monotonic() - t0
    assert r.status_code == 502
    assert r.json()["error"]["stage"] == "decode"
    assert r.json()["error"]["message"].startswith(f"decode {dead_url}: ClientConnectorError")
    assert elapsed < 5, f"no fast failure: {elapsed:.1f} s"  # hang guard, not a performance target


def test_decode_hanging_up_gives_502_quickly(fakes: dict[str, Fake]) -> None:
    srv = socketserver.ThreadingTCPServer(("127.0.0.1", 0), _Closer)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    try:
        url = f"http://127.0.0.1:{srv.server_address[1]}"
        with ProxyServer([fakes["prefill-0"].url], [url], timeout_s=60) as px, _client(timeout=30) as c:
            t0 = time.monotonic()
            r = c.post(f"{px.url}/v1/completions", json={"prompt": "p", "max_tokens": 2})
            elapsed = time.monotonic() - t0
    finally:
        srv.shutdown()
        srv.server_close()
        t.join(5)
    assert r.status_code == 502
    assert r.json()["error"]["stage"] == "decode"
    assert "ServerDisconnectedError" in r.json()["error"]["message"]
    assert elapsed < 5, f"no fast failure: {elapsed:.1f} s"


@pytest.mark.parametrize("stage", ["prefill", "decode"])
def test_upstream_timeout_gives_504(fakes: dict[str, Fake], stage: str) -> None:
    fakes[f"{stage}-0"].wait = True  # answers only when released (at teardown)
    with _proxy(fakes, timeout_s=0.3) as px, _client() as c:
        r = c.post(f"{px.url}/v1/completions", json={"prompt": "p", "max_tokens": 2})
    assert r.status_code == 504
    err = r.json()["error"]
    assert err["stage"] == stage
    assert "timed out after 0.3 s" in err["message"]


def _samples(text: str) -> dict[tuple[str, tuple], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }


def test_metrics_count_requests_errors_and_latency(fakes: dict[str, Fake]) -> None:
    with _proxy(fakes, prefill=("prefill-0",)) as px, _client() as c:
        for _ in range(2):
            assert c.post(f"{px.url}/v1/completions", json={"prompt": "p", "max_tokens": 2}).status_code == 200
        assert c.post(f"{px.url}/v1/chat/completions", json={"messages": [], "max_tokens": 2}).status_code == 200
        fakes["prefill-0"].status = 500
        assert c.post(f"{px.url}/v1/completions", json={"prompt": "p"}).status_code == 500
        assert c.post(f"{px.url}/v1/completions", content=b"{not json").status_code == 400
        r = c.get(f"{px.url}/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    s = _samples(r.text)
    comp = (("endpoint", "/v1/completions"),)
    assert s[("pdsweep_proxy_requests_total", comp)] == 4
    assert s[("pdsweep_proxy_requests_total", (("endpoint", "/v1/chat/completions"),))] == 1
    assert s[("pdsweep_proxy_errors_total", (("endpoint", "/v1/completions"), ("stage", "prefill")))] == 1
    assert s[("pdsweep_proxy_errors_total", (("endpoint", "/v1/completions"), ("stage", "request")))] == 1
    assert s[("pdsweep_proxy_added_latency_seconds_count", ())] == 3
    assert s[("pdsweep_proxy_prefill_seconds_count", ())] == 3
    assert s[("pdsweep_proxy_added_latency_seconds_sum", ())] >= s[("pdsweep_proxy_prefill_seconds_sum", ())] > 0


def test_metrics_registry_is_private_per_app() -> None:
    a, b = create_app(["http://p:1"], ["http://d:1"]), create_app(["http://p:1"], ["http://d:1"])
    a.state.proxy.metrics.requests.labels("/v1/completions").inc()
    assert b.state.proxy.metrics.requests.labels("/v1/completions")._value.get() == 0


def test_drop_kv_transfer_params_removes_them_from_decode_leg(fakes: dict[str, Fake]) -> None:
    fakes["prefill-0"].kv = False  # not needed either when dropping
    with _proxy(fakes, faults=ProxyFaults(drop_kv_transfer_params=True)) as px, _client() as c:
        r = c.post(
            f"{px.url}/v1/completions", json={"prompt": "p", "max_tokens": 2, "kv_transfer_params": {"from": "client"}}
        )
    assert r.status_code == 200
    assert fakes["prefill-0"].requests[0]["body"]["kv_transfer_params"] == PREFILL_KV_PARAMS
    assert "kv_transfer_params" not in fakes["decode-0"].requests[0]["body"]
    assert r.json()["echo_kv"] is None


def test_health_and_models_from_first_decode(fakes: dict[str, Fake]) -> None:
    with _proxy(fakes) as px, _client() as c:
        assert c.get(f"{px.url}/health").status_code == 200
        for _ in range(2):
            assert c.get(f"{px.url}/v1/models").json()["data"] == [{"id": "model-of-decode-0"}]


def test_completion_routes_answer_other_methods_with_405(fakes: dict[str, Fake]) -> None:
    with _proxy(fakes) as px, _client() as c:
        assert [c.get(f"{px.url}{p}").status_code for p in ("/v1/completions", "/v1/chat/completions")] == [405, 405]
        assert c.get(f"{px.url}/v1/nothing").status_code == 404
    assert not fakes["prefill-0"].requests


def test_proxy_server_picks_free_port_and_stops_cleanly(tmp_path, fakes: dict[str, Fake]) -> None:
    log_path = tmp_path / "proxy.log"
    with _proxy(fakes, log_path=log_path) as px:
        assert px.port > 0 and px.url == f"http://127.0.0.1:{px.port}"
        with _client() as c:
            assert c.get(f"{px.url}/health").status_code == 200
            fakes["prefill-0"].status = 500
            c.post(f"{px.url}/v1/completions", json={"prompt": "p"})
    with _client(timeout=2) as c, pytest.raises(httpx.ConnectError):
        c.get(f"{px.url}/health")
    assert not [t for t in threading.enumerate() if t.name == f"uvicorn-{px.port}"]
    text = log_path.read_text()
    assert "PD proxy on" in text and "prefill-0 says boom" in text


def test_create_app_rejects_bad_urls() -> None:
    with pytest.raises(ValueError, match="no prefill URL"):
        create_app([], ["http://d:1"])
    with pytest.raises(ValueError, match="http://"):
        create_app(["p:1"], ["http://d:1"])
    with pytest.raises(ValueError, match="timeout_s"):
        create_app(["http://p:1"], ["http://d:1"], timeout_s=0)


def test_cli_args_and_user_errors() -> None:
    parser = add_cli_args(argparse.ArgumentParser())
    args = parser.parse_args(["--prefill", "http://a:1", "http://b:2", "--decode", "http://c:3"])
    assert (args.prefill, args.decode, args.host, args.port, args.timeout) == (
        ["http://a:1", "http://b:2"],
        ["http://c:3"],
        "127.0.0.1",
        8192,
        300.0,
    )
    with pytest.raises(UserError, match="must start with http"):
        main(parser.parse_args(["--prefill", "a:1", "--decode", "http://c:3"]))
    with AppServer(FastAPI()) as busy, pytest.raises(UserError, match="pdsweep proxy"):
        main(parser.parse_args(["--prefill", "http://a:1", "--decode", "http://c:3", "--port", str(busy.port)]))


def test_kv_requests_count_prompts_spanning_a_block(fakes: dict[str, Fake]) -> None:
    from pdsweep.measure.metrics import PROXY_KV_REQUESTS, parse

    with _proxy(fakes, block_size=4) as px, _client() as c:
        for words in (3, 4, 10):  # one word = one prompt token in the fake
            assert (
                c.post(f"{px.url}/v1/completions", json={"model": "m", "prompt": " ".join(["w"] * words)}).status_code
                == 200
            )
        fakes["decode-0"].status = fakes["decode-1"].status = 500  # decode fails: no KV was read for it
        assert c.post(f"{px.url}/v1/completions", json={"model": "m", "prompt": "a b c d e"}).status_code == 500
        snap = parse(c.get(f"{px.url}/metrics").text)
    assert snap.counters[PROXY_KV_REQUESTS] == 2


def test_block_size_must_be_positive() -> None:
    with pytest.raises(ValueError, match="block_size must be >= 1"):
        create_app(["http://p:1"], ["http://d:1"], block_size=0)


def test_decode_delay_sleeps_before_each_decode_leg(fakes: dict[str, Fake]) -> None:
    """The perf verdict's injected slowdown (bench/test_perf_teeth.py): the delay lands between
    the prefill answer and the decode leg, so it shows in the proxy's added latency."""
    with _proxy(fakes, faults=ProxyFaults(decode_delay_s=0.3)) as px, _client() as c:
        for _ in range(2):
            assert c.post(f"{px.url}/v1/completions", json={"prompt": "p", "max_tokens": 2}).status_code == 200
        added = px.app.state.proxy.metrics.added
    assert len(fakes["decode-0"].requests) + len(fakes["decode-1"].requests) == 2
    assert added._sum.get() >= 0.6
    with pytest.raises(ValueError, match="decode_delay_s must be >= 0"):
        ProxyFaults(decode_delay_s=-1)


def test_a_proxy_with_a_log_file_keeps_its_warnings_off_the_console(fakes: dict[str, Fake], tmp_path) -> None:
    """``pdsweep run``'s proxy writes the cell's logs/proxy.log: a failed request's WARNING goes
    there, not to the console (a drill's hundred of them); without a file (``pdsweep proxy``), and
    once the last filed proxy stops, the console gets them again."""
    import io
    import logging

    dead = Fake("decode-dead")
    dead.server = AppServer(dead.app).start()
    dead_url = dead.url
    dead.server.stop()
    console = io.StringIO()
    handler = logging.StreamHandler(console)
    logging.getLogger().addHandler(handler)
    try:
        kw = {"timeout_s": 60, "log_path": tmp_path / "proxy.log"}
        with ProxyServer([fakes["prefill-0"].url], [dead_url], **kw) as px, _client(timeout=30) as c:
            assert c.post(f"{px.url}/v1/completions", json={"prompt": "p", "max_tokens": 2}).status_code == 502
        with ProxyServer([fakes["prefill-0"].url], [dead_url], timeout_s=60) as px, _client(timeout=30) as c:
            assert c.post(f"{px.url}/v1/completions", json={"prompt": "q", "max_tokens": 2}).status_code == 502
    finally:
        logging.getLogger().removeHandler(handler)
    filed = (tmp_path / "proxy.log").read_text()
    assert filed.count("failed (502)") == 1 and "WARNING pdsweep.deploy.proxy" in filed
    assert console.getvalue().count("failed (502)") == 1  # the second proxy's only
