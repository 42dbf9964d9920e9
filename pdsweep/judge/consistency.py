"""PD-vs-single-instance consistency, judged. The rules: :func:`thresholds_for` (per model
kind and TP equality), :func:`judge_consistency` (the ``consistency.json`` body, each prompt
by :func:`judge_prompt`) and :func:`triage` (transfer, engine or both, from the reference's
:func:`~pdsweep.measure.probe.path_check`, :func:`engine_path_ok`). Upstream: vLLM
``tests/v1/kv_connector/nixl_integration/test_hybrid_pd_consistency.py`` (``MAX_LOGPROB_DELTA``)
and ``test_edge_cases.py``.

The gate's checks: :class:`ConsistencyCheck` (consistency.json's verdict and triage) and
:class:`ConsistencyRecompute` (each prompt's figures recomputed from its token ids and
logprobs, :func:`pdsweep.measure.probe.compare`, and the verdict from them).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from pdsweep.core.stats import num, obj
from pdsweep.judge.facts import (
    CellFiles,
    cell_from_dict,
    show,
    worst_prompt,
)
from pdsweep.measure.probe import compare
from pdsweep.results import layout

MAX_ABS_DLOGPROB = 1.5  # nats; upstream test_hybrid_pd_consistency.py MAX_LOGPROB_DELTA


DIFF_TP_MIN_MATCH_FRAC = 0.5  # different P/D TP: tokens may drift from half of max_tokens on


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


def judge_prompt(p: dict[str, Any], th: dict[str, Any], max_tokens: int) -> list[str]:
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
        r = judge_prompt(p, thresholds, max_tokens)
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


class ConsistencyCheck:
    """consistency.json (PD cells): verdict pass over at least one prompt."""

    name = "consistency"

    def applies(self, kind: str) -> bool:
        return kind != "ref"

    def fails(self, files: CellFiles) -> list[str]:
        con = files.get(layout.CONSISTENCY_FILE)
        if con is None:
            return [files.problem(layout.CONSISTENCY_FILE)]
        w = files.where(layout.CONSISTENCY_FILE)
        if con.get("verdict") == "pass":
            return [] if con.get("prompts") else [f"{w}: no prompts compared"]
        why = [str(r) for r in con.get("reasons") or []] or [
            f"verdict {show(con.get('verdict'))} (worst prompt: {worst_prompt(con.get('prompts')) or 'none'})"
        ]
        tri = obj(con.get("triage"))
        if tri.get("verdict") not in (None, "none"):
            why.append(f"triage {tri['verdict']}: {tri.get('explanation')}")
        return [f"{w}: {r}" for r in why]


@dataclass(frozen=True)
class ConsistencyRecompute:
    """consistency.json (PD cells): recorded per-prompt figures and verdict must be what the
    prompts' tokens and logprobs give."""

    name: str = "consistency-recompute"

    def applies(self, kind: str) -> bool:
        return kind != "ref"

    def fails(self, files: CellFiles) -> list[str]:
        con = files.get(layout.CONSISTENCY_FILE)
        if con is None or con.get("verdict") != "pass" or not con.get("prompts"):
            return []  # ConsistencyCheck fails it
        w = files.where(layout.CONSISTENCY_FILE)
        out: list[str] = []
        rows = []
        for i, p in enumerate(con.get("prompts") or []):
            p = p if isinstance(p, dict) else {}
            name = str(p.get("name") or f"#{i}")
            err = p.get("error")
            # only what the verdict is recomputed from: tokens, logprobs, a request error
            row = {"name": name, "prompt_tokens": p.get("prompt_tokens"), "error": str(err) if err else None}
            row.update(pd_tokens=[], ref_tokens=[])
            pd_t, ref_t = p.get("pd_tokens"), p.get("ref_tokens")
            if isinstance(pd_t, list) and isinstance(ref_t, list):
                row.update(pd_tokens=pd_t, ref_tokens=ref_t)
                pd_lp, ref_lp = _logprobs(p.get("pd_logprobs"), pd_t), _logprobs(p.get("ref_logprobs"), ref_t)
                again = compare(pd_t, pd_lp, ref_t, ref_lp)
                for key in ("exact_match_rate", "first_divergence", "max_abs_dlogprob"):
                    if not _same(p.get(key), again[key]):
                        out.append(
                            f"{w}: prompt '{name}': recorded {key} {show(p.get(key))}, recomputed "
                            f"{show(again[key])} from its tokens and logprobs"
                        )
                row.update(again)
            rows.append(row)
        cell = cell_from_dict((files.get(layout.CELL_FILE) or {}).get("cell"))
        model = (files.get(layout.CELL_FILE) or {}).get("model")
        model = model if isinstance(model, dict) else {}
        th = obj(con.get("thresholds"))
        tp_equal = cell is None or cell.prefill_tp == cell.decode_tp
        thresholds = thresholds_for(str(model.get("attention")), str(model.get("ssm") or "none"), tp_equal)
        max_tokens = th.get("max_tokens")
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 0:
            max_tokens = max((len(r.get("ref_tokens") or []) for r in rows), default=0)
        again = judge_consistency(
            files.cell_id, con.get("reference_cell"), {"max_tokens": max_tokens, "prompts": rows}, thresholds
        )
        if again["verdict"] != "pass":
            out.append(f"{w}: recorded verdict pass, recomputed fail: " + "; ".join(again["reasons"]))
        return out


def _logprobs(lp: Any, tokens: list) -> list:
    """The recorded logprobs, or ``None`` per token (recomputed as missing: fail closed)."""
    if isinstance(lp, list) and len(lp) == len(tokens):
        return [num(x) for x in lp]
    return [None] * len(tokens)


def _same(a: Any, b: Any) -> bool:
    if a is None or b is None:
        return a is None and b is None
    x, y = num(a), num(b)
    return x is not None and y is not None and math.isclose(x, y, rel_tol=1e-9, abs_tol=1e-12)
