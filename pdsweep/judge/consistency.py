"""PD-vs-single-instance consistency, judged: :class:`ConsistencyCheck` (consistency.json's
verdict and triage) and :class:`ConsistencyRecompute` (each prompt's figures recomputed from
its token ids and logprobs, :func:`pdsweep.measure.consistency.compare`, and the verdict from
them, :func:`~pdsweep.measure.consistency.judge_consistency` with the thresholds of
:func:`~pdsweep.measure.consistency.thresholds_for`).
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
from pdsweep.measure.consistency import compare, judge_consistency, thresholds_for
from pdsweep.results import layout


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
