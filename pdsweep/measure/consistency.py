"""Consistency probe: P->D greedy output against a single-instance reference.

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

MAX_ABS_DLOGPROB = 1.5  # nats; upstream test_hybrid_pd_consistency.py MAX_LOGPROB_DELTA
TOP_K = 5  # top logprobs the load phase asks for (near-tie check, pdsweep.measure.loadcheck)
DIFF_TP_MIN_MATCH_FRAC = 0.5  # different P/D TP: tokens may drift from half of max_tokens on


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


ENGINE_PATH_MAX_DLOGPROB = 0.05  # nats; the two paths of one instance measured 2e-6..4e-5 (fp32)


def engine_path_ok(check: dict[str, Any] | None) -> bool | None:
    """True when the single instance's decode path agrees with its plain path (every token
    equal, max |dlogprob| < ``ENGINE_PATH_MAX_DLOGPROB``: the same instance, so much tighter
    than the P->D bound); False when a token or a logprob differs; None when nothing could
    be compared (no check, a failed request, a missing logprob)."""
    if not check or check.get("error") or not check.get("plain_tokens"):
        return None
    if check.get("mismatched_positions"):
        return False
    d = check.get("max_abs_dlogprob")
    if d is None or check.get("missing_logprob_at") is not None:
        return None
    return d < ENGINE_PATH_MAX_DLOGPROB


TRIAGE_VERDICTS = ("none", "transfer", "engine", "both", "unknown")


def triage(rows: list[dict[str, Any]], tp_equal: bool = True) -> dict[str, Any]:
    """Where a P->D divergence lives, from the judged prompt rows (``verdict`` of PD vs
    reference, ``engine_path_ok`` of the reference's :func:`path_check`).

    ``none``: no prompt failed. ``transfer``: every failing prompt's reference decode
    path agrees with its plain path (the engine is self-consistent; only P->D differs).
    ``engine``: on every failing prompt the single instance already disagrees with
    itself along the decode path. ``both``: some of each. ``unknown``: a failing prompt
    has no usable path check (triage off, its requests failed) or failed without tokens to
    compare (a request error: a crash says nothing about where outputs diverge). With
    prefill TP != decode TP the reference runs at the decode TP only, so ``transfer`` also
    covers a fault of the prefill engine at its TP; the explanation says so.
    """
    failing = [r for r in rows if r.get("verdict") == "fail"]
    if not failing:
        return {"verdict": "none", "explanation": "P->D matches the single instance"}
    errored = [r["name"] for r in failing if r.get("error") or not r.get("pd_tokens") or not r.get("ref_tokens")]
    if errored:
        return {
            "verdict": "unknown",
            "explanation": f"requests failed or returned no tokens for {errored}: nothing to triage",
        }
    oks = [r.get("engine_path_ok") for r in failing]
    names = lambda pred: [r["name"] for r, ok in zip(failing, oks) if pred(ok)]  # noqa: E731
    if any(ok is None for ok in oks):
        v, why = "unknown", f"no single-instance path check for {names(lambda ok: ok is None)}"
    elif all(oks):
        v, why = (
            "transfer",
            (
                "the single instance's decode path agrees with its plain prefill path on "
                f"{names(bool)}; only P->D differs: the fault comes with the transfer"
                + (
                    ""
                    if tp_equal
                    else " (or with the prefill engine at its own TP, which the "
                    "reference at the decode TP does not run)"
                )
            ),
        )
    elif not any(oks):
        v, why = (
            "engine",
            (
                "the single instance's own decode path (one token over a pre-filled cache, "
                f"the path decode takes after a transfer) differs from its plain prefill path on "
                f"{names(lambda ok: not ok)}: the engine differs without any transfer"
            ),
        )
    else:
        v, why = (
            "both",
            (
                f"engine path inconsistent on {names(lambda ok: not ok)}, consistent on "
                f"{names(bool)} where P->D still differs"
            ),
        )
    return {"verdict": v, "explanation": why}


# ---------------------------------------------------------------- verdict
def thresholds_for(attention: str, ssm: str, tp_equal: bool) -> dict[str, Any]:
    """Pass thresholds for a model kind (catalogue ``attention``/``ssm``) and whether
    prefill and decode TP are equal.

    * ``max_abs_dlogprob`` = 1.5 nats over the matching positions, for every kind: the
      upstream bound (``test_hybrid_pd_consistency.py``) sized for the hybrid
      decode-kernel recompute of the last prompt token (observed < 0.25 nats) while a
      missing or stale transferred state moves logprobs by several nats. Pure attention
      P->D is closer still; the same bound keeps one rule.
    * ``min_match_frac``: tokens must be equal on the first ``ceil(frac * max_tokens)``
      positions. Equal TP: 1.0 (all of them; upstream ``test_edge_cases.py`` demands equal
      output for attention; hybrids get no token allowance: the logprob tolerance absorbs
      the kernel difference, and a flip would hide a drifting state). Different TP: 0.5
      (the KV was computed with another reduction order, so rounding may flip a late
      near-tie; on CPU plain TP2 vs TP1 already differs at token 6 of 12).
    """
    hybrid = ssm not in ("none", "", None)
    return {
        "max_abs_dlogprob": MAX_ABS_DLOGPROB,
        "min_match_frac": 1.0 if tp_equal else DIFF_TP_MIN_MATCH_FRAC,
        "compare": "token ids and top-1 logprobs (never decoded text)",
        "attention": attention,
        "ssm": ssm,
        "hybrid": hybrid,
        "tp_equal": tp_equal,
        "source": "vllm tests/v1/kv_connector/nixl_integration/test_hybrid_pd_consistency.py, test_edge_cases.py",
    }


def _judge_prompt(p: dict[str, Any], th: dict[str, Any], max_tokens: int) -> list[str]:
    where = f"prompt '{p['name']}' ({p.get('prompt_tokens')} tokens)"
    if p.get("error"):
        return [f"{where}: {p['error']}"]
    reasons = []
    pd, ref = p.get("pd_tokens") or [], p.get("ref_tokens") or []
    if not ref or not pd:
        reasons.append(f"{where}: no tokens (PD {len(pd)}, reference {len(ref)})")
    need = min(max_tokens, math.ceil(th["min_match_frac"] * max_tokens))
    first = p.get("first_divergence")
    if first is not None and first < need:
        a = pd[first] if first < len(pd) else "<end>"
        b = ref[first] if first < len(ref) else "<end>"
        reasons.append(
            f"{where}: tokens diverge at position {first} (PD {a!r} vs reference {b!r}); "
            f"{need} of {max_tokens} must match; exact-match rate {p.get('exact_match_rate', 0):.3f}"
        )
    compared = len(pd) if first is None else first
    d = p.get("max_abs_dlogprob")
    if p.get("missing_logprob_at") is not None:
        reasons.append(f"{where}: logprob missing at position {p['missing_logprob_at']}")
    elif compared > 0 and d is None:
        reasons.append(f"{where}: no logprobs to compare")
    elif d is not None and not d < th["max_abs_dlogprob"]:
        reasons.append(
            f"{where}: max |dlogprob| {d:.4f} nats at position {p.get('max_abs_dlogprob_at')} "
            f">= {th['max_abs_dlogprob']}"
        )
    return reasons


def judge_consistency(
    cell_id: str, reference_cell: str | None, probe_result: dict[str, Any], thresholds: dict[str, Any]
) -> dict[str, Any]:
    """The ``consistency.json`` body (``results/README.md``) from :func:`probe`'s result
    and :func:`thresholds_for`.

    A prompt fails on a request error, no tokens, a token divergence before
    ``ceil(min_match_frac * max_tokens)`` (equal TP: anywhere), a missing logprob, or
    ``max_abs_dlogprob >= max_abs_dlogprob`` over the matching positions. Every reason
    names the prompt, its length and the position. Verdict pass only if there is at
    least one prompt and none fails; no reference cell is a failure (nothing compared).
    ``triage`` (:func:`triage`) says whether a divergence lives in the transfer, the
    engine, or both; a failure that no prompt explains is triaged ``unknown``.
    """
    max_tokens = int(probe_result.get("max_tokens") or 0)
    prompts = probe_result.get("prompts") or []
    reasons: list[str] = []
    if reference_cell is None:
        reasons.append("no reference cell: nothing to compare against")
    if not prompts:
        reasons.append("no prompts probed")
    rows = []
    for p in prompts:
        r = _judge_prompt(p, thresholds, max_tokens)
        reasons += r
        rows.append({**p, "verdict": "fail" if r else "pass", "engine_path_ok": engine_path_ok(p.get("path_check"))})
    tri = triage(rows, bool(thresholds.get("tp_equal", True)))
    if reasons and tri["verdict"] == "none":
        tri = {"verdict": "unknown", "explanation": "the cell failed before any prompt could be compared"}
    return {
        "cell_id": cell_id,
        "reference_cell": reference_cell,
        "thresholds": {**thresholds, "max_tokens": max_tokens},
        "prompts": rows,
        "verdict": "fail" if reasons else "pass",
        "triage": tri,
        "reasons": reasons,
    }
