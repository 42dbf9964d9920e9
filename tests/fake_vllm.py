"""A stand-in for ``vllm serve`` for orchestration tests: same CLI shape, /health,
/v1/models, /v1/completions (PD kv_transfer_params flow, greedy logprobs), and /metrics
with vLLM's ``vllm:nixl_*`` and latency metric names. Behaviour knobs (env; those that misbehave
are the fake faults of pdsweep's fault vocabulary, ``pdsweep.core.faults.FAKE_FAULTS``):

FAKE_STARTUP_S       seconds before /health answers 200 (default 0.3)
FAKE_BIND_AFTER_S    seconds before it binds its port (vLLM's imports; default 0)
FAKE_READY_FILE      /health answers 200 only once this file exists (readiness bench)
FAKE_EXIT_AT_STARTUP exit with this code during startup, after a log line
FAKE_BLOCK_SIZE      the block size vllm:cache_config_info reports (an engine that chose another)
FAKE_DIE_AFTER       hard-exit after this many completions (decode killed mid-run)
FAKE_SIGKILL_AFTER   SIGKILL itself after this many completions, only the instance whose
                     --kv-transfer-config contains FAKE_SIGKILL_ROLE (kv_producer / kv_consumer)
FAKE_FAILED_XFERS    add this to vllm:nixl_num_failed_transfers per PD request
FAKE_WRONG_EVERY     answer every Nth arithmetic question wrong (default: never)
FAKE_DIVERGE         decode (with KV) shifts its first generated token (lost KV shape)
FAKE_EXPIRED         prefill adds this to vllm:nixl_num_kv_expired_reqs per PD request
FAKE_SKIP_XFER_EVERY decode answers every Nth PD request without a transfer (silent recompute)
FAKE_STREAM_HANG     a streaming request never sends its first chunk
FAKE_HANG_AFTER      completions after this many never answer (a hung eval)
FAKE_HANG_ONCE_FILE  the first completion of any instance whose env names this file creates it
                     and never answers (a hang the next deployment does not repeat)
FAKE_LIFE_LOG        append a JSON line at start (pid, CUDA_VISIBLE_DEVICES, every port it
                     binds) and one at exit (after the server closed): lifetimes for GPU tests
FAKE_MODEL_KINDS     JSON {served name: [attention, has_ssm]}: the READs logged per request follow
                     vLLM's read plan for that kind (pdsweep.plan.readplan); else one from rank 0
FAKE_PR49297_UNDONE  decode follows the pre-#49297 read plan (readplan ``plan="unfixed"``): where it
                     asserts a single read (MLA + SSM at tp_ratio < 0), decode logs that assertion's
                     traceback and its process exits 1 on the first PD request, as that build's does

A prompt seen before counts its words as ``vllm:prefix_cache_hits`` (every prompt as
``vllm:prefix_cache_queries``); with ``VLLM_SERVER_DEV_MODE=1`` ``POST /reset_prefix_cache``
forgets them and answers ``{"success": true}``, as vLLM's dev route does.

``bench serve`` (as ``vllm bench serve``): sends ``--num-prompts`` completions to
``--base-url``, writes vLLM's result JSON and exits 0 even when requests failed, as vLLM
does; FAKE_BENCH_LOST (read from pdsweep's own env) drops that many requests as failed,
FAKE_BENCH_HANG makes it hang.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import re
import signal
import sys
import threading
import time
import zlib

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_REQ_IDS = itertools.count()


def _kv_digest_line(side: str, agent: str, req: str, prompt: str, order: object = (1, 2)) -> None:
    """pdsweep.engine.kvdigest's lines, when the plan switched the digests on (PDSWEEP_KV_DIGEST=1):
    prefill offers two blocks of 1 KiB, decode reads them with the same digests; ``order``: the
    ``remote_block_ids`` decode got (the proxy's scramble reverses them: the bytes match, the order not)."""
    if os.environ.get("PDSWEEP_KV_DIGEST") != "1":
        return
    digs = [f"{zlib.crc32(f'{prompt}{b}'.encode()):016x}" for b in (1, 2)]
    if side == "offer":
        d = ";".join(f"0/kv/{b}/0/{0x1000 * b:x}/1024/{g}" for b, g in zip((1, 2), digs))
        print(
            f"PDSWEEP_KV_OFFER agent={agent} engine={agent} rank=0 req={req} us=3 bytes=2048 split=1 d={d}", flush=True
        )
    else:
        d = ";".join(f"{0x1000 * b:x}/1024/{g}" for b, g in zip((1, 2), digs))
        ids = ",".join(str(b) for b in order) if isinstance(order, (list, tuple)) else "1,2"
        print(
            f"PDSWEEP_KV_LANDED agent={agent} req={req} state=DONE us=2 bytes=2048 tp_ratio=1 order=0:{ids} d={d}",
            flush=True,
        )


def bench(argv: list[str]) -> None:
    """``vllm bench serve`` stand-in: the result file's ``completed``/``failed`` as vLLM writes them."""
    import httpx

    p = argparse.ArgumentParser()
    for a in ("--base-url", "--endpoint", "--model", "--result-dir", "--result-filename"):
        p.add_argument(a)
    p.add_argument("--num-prompts", type=int, default=1)
    p.add_argument("--random-input-len", type=int, default=8)
    p.add_argument("--random-output-len", type=int, default=4)
    args, _ = p.parse_known_args(argv)
    if os.environ.get("FAKE_BENCH_HANG"):
        time.sleep(3600)
    lost = int(os.environ.get("FAKE_BENCH_LOST", "0"))
    done = 0
    for _ in range(args.num_prompts - lost):
        r = httpx.post(
            args.base_url + args.endpoint,
            timeout=30,
            json={
                "model": args.model,
                "prompt": " ".join(["w"] * args.random_input_len),
                "max_tokens": args.random_output_len,
            },
        )
        done += r.status_code == 200
    # vLLM's figures are counts over its benchmark_duration (calculate_metrics); the fake's duration is fixed, one
    # second per prompt, so that its repeats measure the same (the perf verdicts of fake runs say "same")
    dur, lat = float(max(1, args.num_prompts)), 1.0
    res = {
        "completed": done,
        "failed": args.num_prompts - done,
        "duration": dur,
        "request_throughput": done / dur,
        "output_throughput": done * args.random_output_len / dur,
        "total_output_tokens": done * args.random_output_len,
        **{f"{s}_{m}_ms": lat for s in ("mean", "median", "p90", "p99") for m in ("ttft", "tpot", "itl", "e2el")},
    }
    if args.num_prompts - done:
        print(f"WARNING: {args.num_prompts - done} requests failed", flush=True)
    with open(os.path.join(args.result_dir, args.result_filename), "w") as f:
        json.dump(res, f)


def main() -> None:
    argv = sys.argv[1:]
    if argv[:2] == ["bench", "serve"]:
        return bench(argv[2:])
    if argv and argv[0] == "serve":
        argv = argv[1:]
    p = argparse.ArgumentParser()
    p.add_argument("model")
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--kv-transfer-config", default=None)
    p.add_argument("--block-size", default="16")
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    args, _ = p.parse_known_args(argv)
    name = args.served_model_name or args.model
    print(
        f"fake vllm serve {name} on {args.port} kv={args.kv_transfer_config} "
        f"cuda={os.environ.get('CUDA_VISIBLE_DEVICES')}",
        flush=True,
    )
    life = os.environ.get("FAKE_LIFE_LOG")
    if life:
        _life(life, "start", name, args.port)
    code = os.environ.get("FAKE_EXIT_AT_STARTUP")
    if code:
        print("ValueError: fake startup failure: unrecognized argument --bogus", flush=True)
        sys.exit(int(code))

    reg = CollectorRegistry()
    lbl = ["model_name", "engine"]
    xfer = Histogram("vllm:nixl_xfer_time_seconds", "x", lbl, registry=reg, buckets=(0.001, 0.01, 0.1, 1))
    post = Histogram("vllm:nixl_post_time_seconds", "x", lbl, registry=reg, buckets=(0.001, 0.01, 0.1, 1))
    nbytes = Histogram("vllm:nixl_bytes_transferred", "x", lbl, registry=reg, buckets=(1e4, 1e5, 1e6, 1e7))
    ndesc = Histogram("vllm:nixl_num_descriptors", "x", lbl, registry=reg, buckets=(1, 10, 100, 1000))
    failed = Counter("vllm:nixl_num_failed_transfers", "x", lbl, registry=reg)
    failed_n = Counter("vllm:nixl_num_failed_notifications", "x", lbl, registry=reg)
    expired = Counter("vllm:nixl_num_kv_expired_reqs", "x", lbl, registry=reg)
    after_expiry = Counter("vllm:nixl_num_notifications_after_expiry", "x", lbl, registry=reg)
    ttft = Histogram("vllm:time_to_first_token_seconds", "x", lbl, registry=reg, buckets=(0.01, 0.1, 1))
    tpot = Histogram("vllm:request_time_per_output_token_seconds", "x", lbl, registry=reg, buckets=(0.01, 0.1, 1))
    itl = Histogram("vllm:inter_token_latency_seconds", "x", lbl, registry=reg, buckets=(0.01, 0.1, 1))
    e2e = Histogram("vllm:e2e_request_latency_seconds", "x", lbl, registry=reg, buckets=(0.01, 0.1, 1))
    for m in (failed, failed_n, expired, after_expiry):
        m.labels(name, "0").inc(0)
    # vLLM's CacheConfig info gauge (v1/metrics/loggers.py); FAKE_BLOCK_SIZE: what the "engine" really chose
    block = os.environ.get("FAKE_BLOCK_SIZE", args.block_size)
    Gauge("vllm:cache_config_info", "x", ["block_size", "engine"], registry=reg).labels(block, "0").set(1)

    pc_queries = Counter("vllm:prefix_cache_queries", "x", lbl, registry=reg)
    pc_hits = Counter("vllm:prefix_cache_hits", "x", lbl, registry=reg)
    cached: set[str] = set()
    t0 = time.monotonic()
    startup = float(os.environ.get("FAKE_STARTUP_S", "0.3"))
    state = {"n": 0, "q": 0}
    lock = threading.Lock()
    app = FastAPI()

    def _skip_xfer() -> bool:
        every = int(os.environ.get("FAKE_SKIP_XFER_EVERY", "0"))
        with lock:
            state["pd"] = state.get("pd", 0) + 1
            return bool(every) and state["pd"] % every == 0

    @app.get("/health")
    def health():
        ready = time.monotonic() - t0 >= startup
        gate = os.environ.get("FAKE_READY_FILE")
        if gate:
            ready = ready and os.path.exists(gate)
        return PlainTextResponse("", status_code=200 if ready else 503)

    if os.environ.get("VLLM_SERVER_DEV_MODE") == "1":

        @app.post("/reset_prefix_cache")
        def reset_prefix_cache():
            with lock:
                cached.clear()
            print("Resetting prefix cache...", flush=True)
            return {"success": True}

    @app.get("/metrics")
    def metrics():
        return PlainTextResponse(generate_latest(reg).decode())

    @app.get("/v1/models")
    def models():
        return {"object": "list", "data": [{"id": name, "object": "model"}]}

    @app.post("/v1/completions")
    async def completions(req: Request):
        body = await req.json()
        prompt = body.get("prompt", "")
        if isinstance(prompt, list):  # token ids (consistency probe) or a batch of one
            prompt = str(prompt) if prompt and isinstance(prompt[0], int) else prompt[0]
        kv = body.get("kv_transfer_params") or {}
        with lock:
            state["n"] += 1
            n = state["n"]
            words = len(prompt.split())
            pc_queries.labels(name, "0").inc(words)
            hit = prompt in cached  # decode with this prompt cached reads only its last (partial) block
            if hit:
                pc_hits.labels(name, "0").inc(words)
            cached.add(prompt)
        hang = os.environ.get("FAKE_HANG_AFTER")
        once = os.environ.get("FAKE_HANG_ONCE_FILE")
        if (hang and n > int(hang)) or (once and not os.path.exists(once) and not open(once, "w").close()):
            await asyncio.sleep(3600)
        die = os.environ.get("FAKE_DIE_AFTER")
        if die and n > int(die):
            os._exit(9)
        kill = os.environ.get("FAKE_SIGKILL_AFTER")
        if kill and n > int(kill) and os.environ.get("FAKE_SIGKILL_ROLE", "?") in (args.kv_transfer_config or ""):
            os.kill(os.getpid(), signal.SIGKILL)
        # decode answers from the KV it was handed: a stale handle gives the other prompt's answer
        src = kv.get("fake_prompt", prompt) if kv.get("do_remote_prefill") else prompt
        qs = re.findall(r"What is (\d+) ([-+*]) (\d+)\?", src)
        if qs:
            a, op, b = qs[-1]
            ans = {"+": int(a) + int(b), "-": int(a) - int(b), "*": int(a) * int(b)}[op]
            with lock:
                state["q"] += 1
                q = state["q"]
            every = int(os.environ.get("FAKE_WRONG_EVERY", "0"))
            if every and q % every == 0:
                ans += 1
            text = f" {ans}\n\nQ:"
        else:
            text = "".join(chr(97 + (zlib.crc32(src.encode()) + i) % 26) for i in range(8))
        max_tokens = int(body.get("max_tokens") or 16)
        tokens = [text[i : i + 1] for i in range(len(text))][:max_tokens]
        scrambled = kv.get("remote_block_ids") == [2, 1]  # the proxy's scramble reverses [1, 2]
        if kv.get("do_remote_prefill") and (os.environ.get("FAKE_DIVERGE") or scrambled):
            tokens[0] = "Z"
        out = {
            "id": "cmpl-fake",
            "object": "text_completion",
            "model": name,
            "choices": [
                {
                    "index": 0,
                    "text": "".join(tokens),
                    "finish_reason": "length",
                    "logprobs": {
                        "tokens": tokens,
                        "token_logprobs": [-0.1 * (i + 1) for i in range(len(tokens))],
                        "top_logprobs": None,
                        "text_offset": list(range(len(tokens))),
                    },
                }
            ],
            "usage": {
                "prompt_tokens": len(prompt.split()),
                "completion_tokens": len(tokens),
                "total_tokens": len(prompt.split()) + len(tokens),
            },
        }
        if kv.get("do_remote_decode"):
            expired.labels(name, "0").inc(int(os.environ.get("FAKE_EXPIRED", "0")))
            req = f"fake-{args.port}-{next(_REQ_IDS)}"
            _kv_digest_line("offer", f"fake-{args.port}", req, prompt)
            out["kv_transfer_params"] = {
                "remote_request_id": req,
                "do_remote_prefill": True,
                "do_remote_decode": False,
                "remote_engine_id": f"fake-{args.port}",
                "fake_prefill_tp": args.tensor_parallel_size,
                "remote_block_ids": [1, 2],
                "remote_host": os.environ.get("VLLM_NIXL_SIDE_CHANNEL_HOST", "localhost"),
                "remote_port": args.port,
                "fake_prompt": prompt,
            }
        elif kv.get("do_remote_prefill") and not _skip_xfer():
            lab = (name, "0")
            xfer.labels(*lab).observe(0.004)
            post.labels(*lab).observe(0.0005)
            nbytes.labels(*lab).observe(16384 if hit else 131072)
            ndesc.labels(*lab).observe(8)
            failed.labels(*lab).inc(int(os.environ.get("FAKE_FAILED_XFERS", "0")))
            # pdsweep.engine.readlog's lines: the READs vLLM's read plan posts per request for the model
            # kind FAKE_MODEL_KINDS names ({served name: [attention, has_ssm]}); else one from rank 0
            engine = kv.get("remote_engine_id", "fake")
            kind = json.loads(os.environ.get("FAKE_MODEL_KINDS", "{}")).get(name)
            split = {0: 1}
            if kind and os.environ.get("FAKE_PR49297_UNDONE"):
                if _unfixed_asserts(kind, int(kv.get("fake_prefill_tp") or 1), args.tensor_parallel_size):
                    if life:
                        _life(life, "end", name, args.port)
                    os._exit(1)
            if kind:
                from pdsweep.plan.readplan import expected_read_split

                split = expected_read_split(
                    kind[0], kind[1], int(kv.get("fake_prefill_tp") or 1), args.tensor_parallel_size
                )
            _kv_digest_line(
                "landed",
                kv.get("remote_engine_id", "fake"),
                kv.get("remote_request_id", "-"),
                kv.get("fake_prompt", ""),
                kv.get("remote_block_ids"),
            )
            for rank, k in split.items():
                for _ in range(k):
                    print(
                        f"PDSWEEP_NIXL_READ remote_engine={engine} remote_rank={rank} bytes=131072 descs=8", flush=True
                    )
        if not kv.get("do_remote_decode"):
            lab = (name, "0")
            ttft.labels(*lab).observe(0.02)
            tpot.labels(*lab).observe(0.005)
            itl.labels(*lab).observe(0.005)
            e2e.labels(*lab).observe(0.05)
        if body.get("stream"):
            return StreamingResponse(_sse(tokens, name), media_type="text/event-stream")
        return JSONResponse(out)

    async def _sse(tokens: list[str], model: str):
        if os.environ.get("FAKE_STREAM_HANG"):
            await asyncio.sleep(3600)
        for t in tokens:
            chunk = {
                "id": "cmpl-fake",
                "object": "text_completion",
                "model": model,
                "choices": [{"index": 0, "text": t, "finish_reason": None}],
            }
            yield f"data: {json.dumps(chunk)}\n\n"
        yield "data: [DONE]\n\n"

    if life:  # uvicorn re-raises the SIGTERM it captured once the server closed: end there

        def _end(signum, frame):
            _life(life, "end", name, args.port)
            sys.exit(0)

        signal.signal(signal.SIGTERM, _end)
        signal.signal(signal.SIGINT, _end)
    time.sleep(float(os.environ.get("FAKE_BIND_AFTER_S", "0")))  # vllm serve binds after its imports
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning", timeout_graceful_shutdown=1)
    if life:
        _life(life, "end", name, args.port)


def _unfixed_asserts(kind: list, prefill_tp: int, decode_tp: int) -> bool:
    """True, after logging the traceback, where pre-#49297 vLLM's decode worker asserts a single
    read (readplan ``plan="unfixed"``); the caller exits then, as that worker dies."""
    from pdsweep.plan.readplan import UnfixedPlanAsserts, layout_geometry, plans_for

    try:
        plans_for(layout_geometry(kind[0], kind[1], prefill_tp, decode_tp), prefill_tp, decode_tp, "unfixed", "builtin")
    except UnfixedPlanAsserts:
        print(
            "Traceback (most recent call last):\n"
            '  File "/fake/vllm/distributed/kv_transfer/kv_connector/v1/nixl/pull_worker.py", line 313, '
            "in _read_blocks_for_req\n"
            "    assert len(read_specs) == 1\n"
            "AssertionError",
            flush=True,
        )
        return True
    return False


def _life(path: str, event: str, name: str, port: int) -> None:
    ports = [port] + [int(os.environ[v]) for v in ("VLLM_PORT", "VLLM_NIXL_SIDE_CHANNEL_PORT") if v in os.environ]
    row = {"event": event, "pid": os.getpid(), "t": time.time(), "model": name, "ports": ports}
    row["gpus"] = os.environ.get("CUDA_VISIBLE_DEVICES")
    with open(path, "a") as f:  # one short write per line: O_APPEND keeps lines whole
        f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
