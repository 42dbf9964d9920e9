"""What the PD proxy adds to a request: p50 of ``POST /v1/completions`` through the
proxy vs straight to the same fake vLLM on loopback.

Both proxy legs (prefill and decode) point at one fake, so a proxied request costs two
direct requests plus the proxy's own work: ``added_p50 = p50(proxy) - 2 * p50(direct)``.
Target: <= 1 ms (issue 40). On the 2-core box with nothing else heavy running: 0.72-0.81 ms with
httpx and FastAPI routes (2.50 ms in the issue's run, on a loaded box), 0.066-0.071 ms with the
aiohttp client and the plain ASGI hot path (pdsweep/deploy/proxy.py), whose thread spends
0.33-0.38 ms CPU per request. Rounds interleave one proxied and two direct requests so that load from
other processes on this box hits both sides alike. Run: ``pytest bench/``.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI, Request

from pdsweep.deploy.appserver import bind_socket
from pdsweep.deploy.proxy import ProxyServer

TARGET_ADDED_P50_S = 0.001
ROUNDS = 400
WARMUP_ROUNDS = 50
BODY = {"model": "m", "prompt": "Q: What is 1 + 1?\nA:", "max_tokens": 4, "temperature": 0}


def fake_vllm() -> FastAPI:
    """Answers like vLLM's /v1/completions, with kv_transfer_params on a prefill leg."""
    app = FastAPI()

    @app.post("/v1/completions")
    async def completions(request: Request) -> dict[str, Any]:
        body = await request.json()
        out: dict[str, Any] = {
            "id": "cmpl-1",
            "object": "text_completion",
            "model": body.get("model"),
            "choices": [{"index": 0, "text": " 2", "finish_reason": "length", "logprobs": None}],
            "usage": {"prompt_tokens": 12, "completion_tokens": 4, "total_tokens": 16},
        }
        if (body.get("kv_transfer_params") or {}).get("do_remote_decode"):
            out["kv_transfer_params"] = {
                "do_remote_prefill": True,
                "do_remote_decode": False,
                "remote_engine_id": "e",
                "remote_block_ids": [1, 2],
                "remote_host": "127.0.0.1",
                "remote_port": 5559,
            }
        return out

    return app


# The fake runs in its own process, as vLLM does: in a thread it would contend for the
# GIL with the proxy and inflate the proxy's time. The proxy runs in-process (a thread),
# as in ``pdsweep run``.
CHILD = """
import socket, sys, uvicorn
sys.path.insert(0, {bench_dir!r})
from test_proxy_overhead import fake_vllm
sock = socket.socket(fileno={fd})
uvicorn.Server(uvicorn.Config(fake_vllm(), log_level="warning", access_log=False)).run(sockets=[sock])
"""


@pytest.fixture(scope="module")
def fake_url() -> Iterator[str]:
    sock = bind_socket("127.0.0.1", 0)
    sock.listen(128)
    code = CHILD.format(bench_dir=str(Path(__file__).parent), fd=sock.fileno())
    proc = subprocess.Popen([sys.executable, "-c", code], pass_fds=[sock.fileno()])
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    sock.close()  # the child holds it now
    try:
        httpx.post(url + "/v1/completions", json=BODY, timeout=60, trust_env=False).raise_for_status()
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


@pytest.fixture(scope="module")
def servers(fake_url: str) -> Iterator[tuple[str, str]]:
    with ProxyServer([fake_url], [fake_url]) as proxy:
        yield fake_url, proxy.url


def thread_cpu_s(name: str) -> float | None:
    """CPU seconds (user + system) of this process's thread ``name`` (Linux ``/proc``), else None:
    the proxy's own cost per request, which other processes' load does not inflate as it does wall time."""
    t = next((t for t in threading.enumerate() if t.name == name), None)
    try:
        stat = Path(f"/proc/self/task/{t.native_id}/stat").read_text() if t and t.native_id else ""
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[-1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK") if len(fields) > 12 else None


def test_proxy_added_latency_p50(benchmark: Any, servers: tuple[str, str]) -> None:
    fake_url, proxy_url = servers
    thread = f"uvicorn-{proxy_url.rsplit(':', 1)[1]}"
    proxied: list[float] = []
    direct: list[float] = []
    paired: list[float] = []

    with httpx.Client(trust_env=False, timeout=30) as client:

        def post(url: str) -> float:
            t0 = time.perf_counter()
            r = client.post(url + "/v1/completions", json=BODY)
            dt = time.perf_counter() - t0
            assert r.status_code == 200, r.text
            return dt

        def one_round() -> None:
            p, d1, d2 = post(proxy_url), post(fake_url), post(fake_url)
            proxied.append(p)
            direct.extend((d1, d2))
            paired.append(p - d1 - d2)

        for _ in range(WARMUP_ROUNDS):
            one_round()
        for samples in (proxied, direct, paired):
            samples.clear()
        cpu0 = thread_cpu_s(thread)
        benchmark.pedantic(one_round, rounds=ROUNDS, iterations=1)
        while len(proxied) < ROUNDS:  # --benchmark-disable runs the function only once
            one_round()
        cpu1 = thread_cpu_s(thread)

    proxy_p50 = statistics.median(proxied)
    direct_p50 = statistics.median(direct)
    added_p50 = proxy_p50 - 2 * direct_p50
    benchmark.extra_info.update(
        {
            "rounds": len(proxied),
            "proxy_p50_ms": proxy_p50 * 1e3,
            "direct_p50_ms": direct_p50 * 1e3,
            "added_p50_ms": added_p50 * 1e3,  # the target: <= 1 ms
            "paired_added_p50_ms": statistics.median(paired) * 1e3,
            "vs_one_direct_p50_ms": (proxy_p50 - direct_p50) * 1e3,  # prefill hop counted as overhead too
            "proxy_p90_ms": statistics.quantiles(proxied, n=10)[-1] * 1e3,
            "target_ms": TARGET_ADDED_P50_S * 1e3,
            "proxy_cpu_per_request_ms": (cpu1 - cpu0) / len(proxied) * 1e3 if cpu0 is not None and cpu1 else -1.0,
        }
    )
    print(" ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in benchmark.extra_info.items()))
    assert added_p50 <= TARGET_ADDED_P50_S, (
        f"proxy adds {added_p50 * 1e3:.2f} ms p50 (proxy {proxy_p50 * 1e3:.2f} ms, direct "
        f"{direct_p50 * 1e3:.2f} ms); target {TARGET_ADDED_P50_S * 1e3:.0f} ms"
    )
