"""Consistency probe, the evidence: P->D greedy output against a single-instance reference
(:func:`probe`, :func:`path_check`) and the per-position figures (:func:`compare`); the rules
(thresholds, verdict, triage) are :mod:`pdsweep.judge.consistency`'s.

Weight-independent (it needs no accuracy, only determinism), so it also runs on tiny
random-weight checkpoints, where lm-eval scores mean nothing. For each prompt it asks the
PD proxy and the reference instance for ``max_tokens`` greedy tokens with top-1 logprobs
and compares token ids and logprobs position by position.

Upstream rules it follows (vLLM ``tests/v1/kv_connector/nixl_integration/``):
``test_edge_cases.py`` (prompt shorter than a block, several blocks, near the maximum
length; P->D output must equal a single instance) and ``test_hybrid_pd_consistency.py``
(``test_pd_logprobs_match_single_instance``: top-1 logprob delta below
``MAX_LOGPROB_DELTA = 1.5`` nats, greedy, ``logprobs=1``, ``seed=0``; for hybrids the decode
instance recomputes the last prompt token with the decode kernel, so outputs are close but
not bit-identical, and decoded text is never compared).
"""

from __future__ import annotations

import logging
import math
import uuid
from typing import Any

from pdsweep.measure.endpoints import completions_url
from pdsweep.measure.prompts import Prompt

log = logging.getLogger(__name__)

TOP_K = 5  # top logprobs the load phase asks for (near-tie check, pdsweep.judge.load.near_tie)


# ---------------------------------------------------------------- probe
def _token(t: Any) -> int | str:
    """``"token_id:123"`` (vLLM ``return_tokens_as_token_ids``) -> 123; other strings as is."""
    if isinstance(t, str) and t.startswith("token_id:") and t[9:].lstrip("-").isdigit():
        return int(t[9:])
    return t


async def complete(
    client: Any,
    url: str,
    model: str,
    prompt: Prompt,
    max_tokens: int,
    cache_salt: str | None = None,
    top: list[dict[str, float]] | None = None,
) -> tuple[list[int | str], list[float | None]]:
    """One greedy completion of ``prompt`` (token ids) at ``url`` (the full
    ``/v1/completions`` URL) with an ``httpx.AsyncClient``: ``temperature=0, seed=0,
    logprobs=1``, plus the vLLM extensions ``ignore_eos`` (always ``max_tokens`` tokens)
    and ``return_tokens_as_token_ids``; ``cache_salt`` (vLLM) keeps the request off blocks
    cached for other salts. Returns ``(tokens, top-1 logprobs)``, tokens as
    ints where the server sent ``"token_id:N"``. ``top`` (a list, filled in place): ask for
    ``logprobs=TOP_K`` and append, per position, ``{str(token id): logprob}`` of the top
    ``TOP_K`` tokens (vLLM ``logprobs.top_logprobs``). Raises ``httpx.HTTPError`` on a failed
    request and ``ValueError``/``KeyError``/``IndexError`` on a malformed body."""
    body = {
        "model": model,
        "prompt": prompt.token_ids,
        "max_tokens": max_tokens,
        "temperature": 0,
        "seed": 0,
        "logprobs": 1 if top is None else TOP_K,
        "stream": False,
        "ignore_eos": True,
        "return_tokens_as_token_ids": True,
    }
    if cache_salt is not None:  # vLLM: no prefix-cache hit across salts
        body["cache_salt"] = cache_salt
    r = await client.post(url, json=body)
    r.raise_for_status()
    lp = r.json()["choices"][0].get("logprobs") or {}
    tokens, lps = lp.get("tokens"), lp.get("token_logprobs")
    if not isinstance(tokens, list) or not isinstance(lps, list) or len(tokens) != len(lps):
        raise ValueError("response has no logprobs.tokens/token_logprobs of equal length")
    if top is not None:
        for d in lp.get("top_logprobs") or []:
            top.append({str(_token(k)): float(v) for k, v in (d or {}).items() if isinstance(v, (int, float))})
    return [_token(t) for t in tokens], [float(x) if isinstance(x, (int, float)) else None for x in lps]


def compare(pd_tokens: list, pd_logprobs: list, ref_tokens: list, ref_logprobs: list) -> dict[str, Any]:
    """Position-wise comparison of two greedy continuations.

    ``exact_match_rate``: fraction of positions ``< min(len)`` with equal tokens (0.0 if
    either is empty). ``first_divergence``: first position with different tokens, else
    the shorter length if the lengths differ, else None. ``max_abs_dlogprob`` (nats) and
    ``max_abs_dlogprob_at``: over the positions before ``first_divergence`` only (after
    it the logprobs belong to different tokens); None when there is no such position or a
    logprob is missing there (``missing_logprob_at`` then names the position)."""
    n = min(len(pd_tokens), len(ref_tokens))
    same = [pd_tokens[i] == ref_tokens[i] for i in range(n)]
    first = next((i for i, s in enumerate(same) if not s), None)
    if first is None and len(pd_tokens) != len(ref_tokens):
        first = n
    upto = n if first is None else first
    worst, at, missing = None, None, None
    for i in range(upto):
        a, b = pd_logprobs[i], ref_logprobs[i]
        if a is None or b is None or not (math.isfinite(a) and math.isfinite(b)):
            missing = i
            worst = at = None
            break
        d = abs(a - b)
        if worst is None or d > worst:
            worst, at = d, i
    return {
        "exact_match_rate": (sum(same) / n) if n else 0.0,
        "first_divergence": first,
        "max_abs_dlogprob": worst,
        "max_abs_dlogprob_at": at,
        "missing_logprob_at": missing,
    }


async def probe(
    pd_url: str, ref_url: str, model: str, prompts: list[Prompt], max_tokens: int, timeout_s: float = 300.0
) -> dict[str, Any]:
    """Send every prompt to the PD proxy and to the reference instance (greedy:
    ``temperature=0, seed=0, logprobs=1, ignore_eos, return_tokens_as_token_ids``;
    one request at a time, so batching cannot change the numerics) and compare them.

    URLs: a server root, ``.../v1`` or the full ``/v1/completions`` URL. Returns
    ``{max_tokens, prompts: [{name, prompt_tokens, pd_tokens, ref_tokens, pd_logprobs,
    ref_logprobs, exact_match_rate, first_divergence, max_abs_dlogprob,
    max_abs_dlogprob_at, missing_logprob_at, error}]}`` (see :func:`compare`); a failed
    request (HTTP error, timeout, malformed body) is recorded in ``error`` (never raised)
    and fails the prompt in :func:`judge_consistency`.
    """
    import httpx

    out = []
    async with httpx.AsyncClient(timeout=timeout_s) as client:
        for p in prompts:
            row: dict[str, Any] = {
                "name": p.name,
                "prompt_tokens": p.num_tokens,
                "pd_tokens": [],
                "ref_tokens": [],
                "pd_logprobs": [],
                "ref_logprobs": [],
                "error": None,
            }
            side = "reference"
            try:
                row["ref_tokens"], row["ref_logprobs"] = await complete(
                    client, completions_url(ref_url), model, p, max_tokens
                )
                side = "PD"
                row["pd_tokens"], row["pd_logprobs"] = await complete(
                    client, completions_url(pd_url), model, p, max_tokens
                )
            except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError) as e:
                row["error"] = f"{side} request failed: {type(e).__name__}: {e}"
                log.warning("consistency prompt %s: %s", p.name, row["error"])
            row.update(compare(row["pd_tokens"], row["pd_logprobs"], row["ref_tokens"], row["ref_logprobs"]))
            out.append(row)
    return {"max_tokens": max_tokens, "prompts": out}


# ---------------------------------------------------------------- triage: engine or transfer
async def path_check(client: Any, url: str, model: str, prompt: Prompt, tokens: list, logprobs: list) -> dict[str, Any]:
    """Ask the single instance for every generated position again along its *plain* path.

    After a P->D transfer the decode instance computes the last prompt token against a
    cache that is already filled (vLLM's NIXL scheduler loads every prompt token and the
    scheduler recomputes the last one; for Mamba hybrids it loads all but the last,
    ``_prefill_backoff``): one query token over a pre-filled cache, i.e. the decode
    path. On the single instance, generated token ``tokens[k]`` (k >= 1) was computed
    along that same path, and a fresh request for ``prompt + tokens[:k]`` with
    ``max_tokens=1`` computes the same position along the plain prefill path. If the
    two disagree, the engine's own decode path already differs from its prefill path,
    and a P->D divergence is not evidence of a transfer fault. Every plain-path request
    carries its own ``cache_salt``: with prefix caching on, ``prompt + tokens[:k]`` would
    otherwise hit the blocks the first request cached (decode-written ones included) and
    recompute only its tail, i.e. take the decode path again.

    ``tokens``/``logprobs``: the instance's greedy answer to ``prompt`` (ints). Returns
    ``{plain_tokens, plain_logprobs, ...}`` with :func:`compare` of the decode-path tokens
    ``tokens[1:]`` against the plain answers, plus ``error`` (a failed request, never
    raised). Position 0 is left out: both answers come from the prefill path there.
    """
    import httpx

    plain_t: list[int | str] = []
    plain_lp: list[float | None] = []
    err = None
    ids = [t for t in tokens if isinstance(t, int)]
    if len(ids) != len(tokens):
        err = "reference tokens are not token ids (return_tokens_as_token_ids)"
    else:
        try:
            for k in range(1, len(tokens)):
                p = Prompt(f"{prompt.name}+{k}", prompt.token_ids + ids[:k], "")
                t, lp = await complete(client, url, model, p, 1, cache_salt=f"pdsweep-path-check-{uuid.uuid4().hex}")
                plain_t.append(t[0])
                plain_lp.append(lp[0])
        except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError) as e:
            err = f"plain-path request failed: {type(e).__name__}: {e}"
    cmp = compare(list(tokens[1:]), list(logprobs[1:]), plain_t, plain_lp) if not err else {}
    # positions are independent (teacher-forced): count every mismatch, not only the first
    mismatches = [k + 1 for k, (a, b) in enumerate(zip(tokens[1:], plain_t)) if a != b]
    return {
        "plain_tokens": plain_t,
        "plain_logprobs": plain_lp,
        "error": err,
        "mismatched_positions": mismatches,
        **cmp,
    }
