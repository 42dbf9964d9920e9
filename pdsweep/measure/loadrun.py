"""Load that checks what it serves, the evidence: pdsweep's async client sends a workload's
greedy requests (:mod:`pdsweep.measure.workloads`) at a concurrency and keeps every answer
(token ids and top-1 logprobs); :func:`pdsweep.judge.load.judge_load` compares each PD answer
with the single-instance reference's answer to the same prompt (sent once, sequentially) and
writes ``load_check.json``.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx

from pdsweep.measure.probe import complete
from pdsweep.measure.prompts import Prompt
from pdsweep.measure.workloads import LoadRequest

log = logging.getLogger(__name__)
PERCENTILES = (50, 90, 99)


def _pct(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"mean": None, **{f"p{p}": None for p in PERCENTILES}}
    import numpy as np

    a = np.asarray(values, dtype=float)
    return {"mean": float(a.mean()), **{f"p{p}": float(np.percentile(a, p)) for p in PERCENTILES}}


async def _drive(url: str, model: str, reqs: list[LoadRequest], concurrency: int, timeout_s: float) -> list[dict]:

    sem = asyncio.Semaphore(concurrency)
    done = {r.id: asyncio.Event() for r in reqs}
    t0 = time.perf_counter()
    limits = httpx.Limits(max_connections=concurrency + 2, max_keepalive_connections=concurrency + 2)
    async with httpx.AsyncClient(timeout=timeout_s, trust_env=False, limits=limits) as client:

        async def one(r: LoadRequest) -> dict[str, Any]:
            if r.after in done:  # multi-turn: the previous turn's answer first
                await done[r.after].wait()
            if (wait := r.at_s - (time.perf_counter() - t0)) > 0:  # trace replay
                await asyncio.sleep(wait)
            row: dict[str, Any] = {
                "id": r.id,
                "key": r.key,
                "pass": r.pass_no,
                "prompt_tokens": len(r.token_ids),
                "max_tokens": r.max_tokens,
                "tokens": [],
                "token_logprobs": [],
                "top_logprobs": [],
                "error": None,
            }
            async with sem:
                t = time.perf_counter()
                try:
                    row["tokens"], row["token_logprobs"] = await complete(
                        client, url, model, Prompt(r.id, r.token_ids, ""), r.max_tokens, top=row["top_logprobs"]
                    )
                except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError) as e:
                    row["error"] = f"request failed: {type(e).__name__}: {e}"
                row["e2el_ms"] = (time.perf_counter() - t) * 1000
            done[r.id].set()
            return row

        return list(await asyncio.gather(*(one(r) for r in reqs)))


@dataclass(frozen=True)
class WorkloadTarget:
    """Where a workload goes: the ``/v1/completions`` ``url``, the served ``model``, each
    request's ``timeout_s`` (seconds) and ``kv_bytes()`` (decode's cumulative NIXL bytes, or None)."""

    url: str
    model: str
    timeout_s: float
    kv_bytes: Callable[[], float | None] = lambda: None


def run_workload(
    target: WorkloadTarget, name: str, reqs: list[LoadRequest], concurrency: int, budget_s: float
) -> dict[str, Any]:
    """Send ``reqs`` to ``target`` at most ``concurrency`` at a time, pass by pass
    (``LoadRequest.pass_no``); ``target.kv_bytes()`` is read before the first pass and after
    each. Returns one ``load.json`` ``workloads`` entry: ``workload``, ``concurrency``,
    ``num_prompts``, ``completed``, ``errors``, ``wall_s``, ``req_s``, ``output_tok_s``,
    ``e2el_ms`` (mean/p50/p90/p99), ``kv_bytes_by_pass`` and the ``requests`` (tokens, logprobs,
    error). A failed request is recorded, never raised. Raises ``TimeoutError`` past ``budget_s``
    seconds."""
    url, model, timeout_s, kv_bytes = target.url, target.model, target.timeout_s, target.kv_bytes
    passes = sorted({r.pass_no for r in reqs})
    rows: list[dict[str, Any]] = []
    by_pass: list[float | None] = []
    t0 = time.monotonic()
    last = kv_bytes()
    for p in passes:
        left = budget_s - (time.monotonic() - t0)
        todo = [r for r in reqs if r.pass_no == p]
        rows += asyncio.run(asyncio.wait_for(_drive(url, model, todo, concurrency, timeout_s), max(left, 0.001)))
        now = kv_bytes()
        by_pass.append(now - last if now is not None and last is not None else None)
        last = now
    wall = time.monotonic() - t0
    ok = [r for r in rows if not r["error"]]
    out_toks = sum(len(r["tokens"]) for r in ok)
    return {
        "workload": name,
        "concurrency": concurrency,
        "num_prompts": len(rows),
        "completed": len(ok),
        "errors": len(rows) - len(ok),
        "wall_s": wall,
        "req_s": len(ok) / wall if wall > 0 else None,
        "output_tok_s": out_toks / wall if wall > 0 else None,
        "e2el_ms": _pct([r["e2el_ms"] for r in ok]),
        "kv_bytes_by_pass": by_pass,
        "requests": rows,
    }


def budget_s(reqs: list[LoadRequest], concurrency: int, timeout_s: float) -> float:
    """Seconds one workload run may take: ``120 + waves x timeout_s + the trace's last send
    offset``, ``waves = ceil(len(reqs) / concurrency)`` (multi-turn turns wait on each other:
    counted as one wave per request, the worst case)."""
    chained = any(r.after for r in reqs)
    waves = len(reqs) if chained else math.ceil(len(reqs) / concurrency)
    return 120.0 + waves * timeout_s + max((r.at_s for r in reqs), default=0.0)
