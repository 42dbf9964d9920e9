"""Load that checks what it serves: pdsweep's async client sends a workload's greedy requests
(:mod:`pdsweep.measure.workloads`) at a concurrency and keeps every answer (token ids and
top-1 logprobs); the judge compares each PD answer with the single-instance reference's
answer to the same prompt (sent once, sequentially) and writes ``load_check.json``.

Rule per answer (the consistency probe's, :func:`pdsweep.measure.consistency.compare` and
``_judge_prompt``): equal TP: every token equal and |dlogprob| < 1.5 nats; different TP: the
first half of the tokens. ``stale``: a wrong answer equal to the reference answer of
*another* prompt (vllm 52234: the previous prompt's answer, ``nixl_num_failed_transfers`` 0).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from pdsweep.measure.consistency import _judge_prompt, compare, complete, thresholds_for
from pdsweep.measure.prompts import Prompt
from pdsweep.measure.workloads import LoadRequest
from pdsweep.results import layout

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


# ---------------------------------------------------------------- judge
TIE_NATS = 0.1  # nats: 2.5x the largest PD-vs-reference top-1 logprob delta on matching positions seen on CPU


def near_tie(pd: dict[str, Any], ref: dict[str, Any], cmp: dict[str, Any]) -> dict[str, Any] | None:
    """Whether an answer's first divergence is a flip between two near-equal tokens: at that
    position each side's chosen token is within ``TIE_NATS`` of the other's in **both** top-k
    distributions (``top_logprobs``, :data:`pdsweep.measure.consistency.TOP_K`), and the top-1
    logprobs before it agree within ``TIE_NATS``. Greedy decoding of a flat distribution (a
    random-weight model's ~6-13 % top-1) flips on the hybrid decode kernel's recompute of the last
    prompt token or on batching, while a wrong or stale KV moves logprobs by nats. Returns the
    position, both tokens and the four logprobs, or None (not a near-tie, or no top logprobs:
    fail closed)."""
    i = cmp.get("first_divergence")
    prior = cmp.get("max_abs_dlogprob")
    tops_pd, tops_ref = pd.get("top_logprobs") or [], ref.get("top_logprobs") or []
    if i is None or i >= min(len(tops_pd), len(tops_ref), len(pd["tokens"]), len(ref["tokens"])):
        return None
    if i > 0 and (prior is None or prior > TIE_NATS):
        return None
    a, b = str(pd["tokens"][i]), str(ref["tokens"][i])
    pa, pb, ra, rb = tops_pd[i].get(a), tops_pd[i].get(b), tops_ref[i].get(a), tops_ref[i].get(b)
    if None in (pa, pb, ra, rb):
        return None
    if pa - pb > TIE_NATS or rb - ra > TIE_NATS:
        return None
    return {
        "position": i,
        "pd_token": pd["tokens"][i],
        "ref_token": ref["tokens"][i],
        "pd_logprobs": [pa, pb],
        "ref_logprobs": [ra, rb],
        "tie_nats": TIE_NATS,
    }


def _first_example(row: dict[str, Any], ref: dict[str, Any], conc: Any, triage: str) -> dict[str, Any]:
    pos = row.get("first_divergence")
    return {
        "prompt": row["id"],
        "prompt_tokens": row.get("prompt_tokens"),
        "concurrency": conc,
        "position": pos,
        "pd_tokens": row.get("tokens", []),
        "ref_tokens": ref.get("tokens", []),
        "reason": row.get("reason"),
        "triage": triage,
    }


def judge_load(
    cell_id: str,
    reference_cell: str | None,
    pd: dict[str, Any],
    ref: dict[str, Any] | None,
    thresholds: dict[str, Any],
    probe_triage: str | None = None,
    prefix_caching: bool | None = None,
    block_tokens: int | None = None,
) -> dict[str, Any]:
    """The ``load_check.json`` body: per ``(workload, concurrency)`` of ``pd``'s ``workloads``:
    ``checked`` (answers compared), ``wrong``, ``stale`` (wrong and equal to another prompt's
    reference answer, which it names), ``errors`` (failed requests), ``unmatched`` (no
    reference answer for that prompt), ``near_ties`` (answers whose first divergence is a flip
    between two near-equal tokens, :func:`near_tie`: counted and shown, not wrong), and the
    first wrong, stale and near-tie example (prompt id,
    position, tokens, concurrency, triage). Triage of a stale answer is ``transfer`` (decode
    answered from another request's KV); of another wrong answer the cell's consistency-probe
    triage (``probe_triage``) when the probe failed, else ``unknown``. Verdict ``fail`` on any wrong, error or
    unmatched answer, no reference, or no workload; ``reasons`` say why.

    ``prefix_reuse`` (workloads sent in 2+ passes): decode's NIXL bytes per pass
    (``vllm:nixl_bytes_transferred`` sum deltas) and whether a later pass moved fewer than the
    first, as upstream ``run_mamba_prefix_cache_test.sh`` asserts; with ``prefix_caching``
    (decode's, from cell.json) anything else fails, missing figures included, unless every
    repeated prompt is shorter than one decode KV block (``block_tokens``, decode's effective
    block from cell.json: vLLM raises a hybrid's attention block to hold an SSM state page,
    e.g. 288 tokens for tiny-qwen3-next), when no block can be reused (verdict ``not expected``)."""
    ref_rows: dict[str, dict[str, Any]] = {}
    for w in (ref or {}).get("workloads") or []:
        for r in w.get("requests") or []:
            if not r.get("error") and r.get("tokens"):
                ref_rows.setdefault(r["key"], r)
    reasons: list[str] = []
    if ref is None or reference_cell is None:
        reasons.append("no reference cell load answers: nothing to compare against")
    entries = pd.get("workloads") or []
    if not entries:
        reasons.append("no load workloads ran")
    out = []
    for w in entries:
        s = _check_answers(w, ref_rows, thresholds, probe_triage)
        where = f"load workload '{s['workload']}' at concurrency {s['concurrency']}"
        if len(w.get("kv_bytes_by_pass") or []) >= 2:
            longest = max((int(r.get("prompt_tokens") or 0) for r in w.get("requests") or []), default=0)
            pr = _prefix_reuse(w["kv_bytes_by_pass"], prefix_caching, block_tokens, longest)
            s["prefix_reuse"] = pr
            if pr["verdict"] in ("not fewer", "no figures"):
                reasons.append(f"{where}: prefix reuse: {pr['explanation']}")
        reasons += _answer_reasons(s, where)
        out.append(s)
    return {
        "cell_id": cell_id,
        "reference_cell": reference_cell,
        "thresholds": thresholds,
        "workloads": out,
        "verdict": "fail" if reasons else "pass",
        "reasons": reasons,
    }


def _check_answers(
    w: dict[str, Any], ref_rows: dict[str, dict[str, Any]], thresholds: dict[str, Any], probe_triage: str | None
) -> dict[str, Any]:
    """One workload's answers at one concurrency against the reference's (``ref_rows`` by
    request key): the counts and first examples :func:`judge_load` documents."""

    conc = w.get("concurrency")
    s: dict[str, Any] = {"workload": w.get("workload"), "concurrency": conc, "checked": 0, "wrong": 0, "stale": 0}
    s.update(errors=0, unmatched=0, first_wrong=None, first_stale=None, near_ties=0, first_near_tie=None)
    answers: dict[tuple[str, ...], str] = {}  # tokens of every reference answer of this workload -> its prompt id
    for r in ref_rows.values():
        if r["id"].split("/")[0] == w.get("workload"):
            answers.setdefault(tuple(map(str, r["tokens"])), r["id"])
    for row in w.get("requests") or []:
        if row.get("error"):
            s["errors"] += 1
            continue
        rr = ref_rows.get(row.get("key"))
        if rr is None:
            s["unmatched"] += 1
            continue
        s["checked"] += 1
        cmp = compare(row["tokens"], row["token_logprobs"], rr["tokens"], rr["token_logprobs"])
        p = {"name": row["id"], "prompt_tokens": row.get("prompt_tokens"), "pd_tokens": row["tokens"]}
        why = _judge_prompt({**p, "ref_tokens": rr["tokens"], **cmp}, thresholds, int(row["max_tokens"]))
        if not why:
            continue
        tie = near_tie(row, rr, cmp)
        if tie is not None:  # a flip between two near-equal tokens, not a wrong answer
            s["near_ties"] += 1
            if s["first_near_tie"] is None:
                s["first_near_tie"] = {"prompt": row["id"], "concurrency": conc, **tie}
            continue
        s["wrong"] += 1
        row = {**row, **cmp, "reason": why[0]}
        other = answers.get(tuple(map(str, row["tokens"])))
        if other is not None and other != rr["id"]:
            s["stale"] += 1
            if s["first_stale"] is None:
                s["first_stale"] = {**_first_example(row, rr, conc, "transfer"), "equals_reference_of": other}
        if s["first_wrong"] is None:
            probe = probe_triage if probe_triage not in (None, "none") else "unknown"  # a passing probe says nothing
            tri = "transfer" if other is not None and other != rr["id"] else probe
            s["first_wrong"] = _first_example(row, rr, conc, tri)
    return s


def _answer_reasons(s: dict[str, Any], where: str) -> list[str]:
    """Why one workload's answers fail (:func:`_check_answers`' counts); empty: they pass."""
    reasons = []
    if s["wrong"]:
        ex = s["first_wrong"]
        reasons.append(
            f"{where}: {s['wrong']} of {s['checked']} answers differ from the reference; first: "
            f"prompt {ex['prompt']} ({ex['prompt_tokens']} tokens) at position {ex['position']}: "
            f"PD {ex['pd_tokens'][: (ex['position'] or 0) + 3]} vs reference "
            f"{ex['ref_tokens'][: (ex['position'] or 0) + 3]} (triage: {ex['triage']})"
        )
    if s["stale"]:
        ex = s["first_stale"]
        reasons.append(
            f"{where}: {s['stale']} stale answers (equal to another prompt's reference answer); first: "
            f"prompt {ex['prompt']} answered like {ex['equals_reference_of']}"
        )
    if s["errors"]:
        reasons.append(f"{where}: {s['errors']} requests failed (nothing to check)")
    if s["unmatched"]:
        reasons.append(f"{where}: {s['unmatched']} prompts have no reference answer")
    if not s["checked"] and not s["errors"]:
        reasons.append(f"{where}: no answer checked")
    return reasons


def _prefix_reuse(
    by_pass: list[Any], prefix_caching: bool | None, block_tokens: int | None = None, longest_prompt: int = 0
) -> dict[str, Any]:
    out: dict[str, Any] = {"kv_bytes_by_pass": by_pass, "prefix_caching": prefix_caching, "block_tokens": block_tokens}
    if not prefix_caching:
        return {**out, "verdict": "not expected", "explanation": "decode runs without prefix caching"}
    if block_tokens and 0 < longest_prompt < block_tokens:  # vLLM caches full blocks only
        why = (
            f"the repeated prompts (at most {longest_prompt} tokens) are shorter than one decode KV block "
            f"({block_tokens} tokens): no full block to reuse"
        )
        return {**out, "verdict": "not expected", "explanation": why}
    if any(not isinstance(b, (int, float)) for b in by_pass):
        why = f"decode's vllm:nixl_bytes_transferred figures per pass are {by_pass} (missing)"
        return {**out, "verdict": "no figures", "explanation": why}
    first, later = by_pass[0], by_pass[1:]
    if first > 0 and all(b < first for b in later):
        why = f"later passes moved {later} KV bytes, fewer than the first pass's {first:g}"
        return {**out, "verdict": "fewer", "explanation": why}
    why = (
        f"the repeated prompts moved {later} KV bytes after {first:g} on the first pass: decode has prefix "
        "caching, so a later pass must move fewer (upstream run_mamba_prefix_cache_test.sh)"
    )
    return {**out, "verdict": "not fewer", "explanation": why}


def _block_tokens(planned: dict[str, Any], seen: dict[str, Any]) -> int | None:
    """Decode's effective logical block (tokens): vLLM's own (cell.json ``blocks[name].runtime``,
    from ``vllm:cache_config_info``) when scraped, else the plan's (``instances[].blocks.logical``)."""
    for n in ((seen.get("runtime") or {}).get("logical"), planned.get("logical")):
        if isinstance(n, int) and not isinstance(n, bool) and n > 0:
            return n
    return None


def judge_cell_load(run_dir: Path, cell_id: str, meta: dict[str, Any], ls: Any) -> dict[str, Any] | None:
    """Judge one PD cell's ``load.json`` answers against its reference cell's and write
    ``load_check.json``; None (nothing written) when the cell has no checked load or the sweep
    turned ``bench.check`` off."""

    if not ls.sweep.bench.check:
        return None
    cdir = layout.CellDir.of(run_dir, cell_id)
    pd = cdir.read(layout.LOAD_FILE)
    if pd is None or "workloads" not in pd:
        return None
    cell, ref_id = meta["cell"], meta.get("reference_cell")
    ok = ref_id and layout.cell_status(run_dir, ref_id) == "ok"
    ref = layout.CellDir.of(run_dir, str(ref_id)).read(layout.LOAD_FILE) if ok else None
    model = ls.catalogue.models[cell["model"]]
    th = thresholds_for(model.attention, model.ssm, cell["prefill_tp"] == cell["decode_tp"])
    cons = cdir.read(layout.CONSISTENCY_FILE) or {}
    cj = cdir.read(layout.CELL_FILE) or {}
    decodes = [i for i in cj.get("instances") or [] if str(i.get("name", "")).startswith("decode")]
    dec = [i.get("blocks") or {} for i in decodes]
    caching = all(b.get("prefix_caching") is True for b in dec) if dec else None
    seen: dict[str, Any] = cj["blocks"] if isinstance(cj.get("blocks"), dict) else {}
    sizes = [_block_tokens(i.get("blocks") or {}, seen.get(str(i.get("name"))) or {}) for i in decodes]
    block = min((n for n in sizes if n is not None), default=None)
    tri = (cons.get("triage") or {}).get("verdict")
    body = judge_load(cell_id, ref_id if ref else None, pd, ref, th, tri, caching, block)
    layout.write_json(cdir.file(layout.LOAD_CHECK_FILE), body)
    return body
