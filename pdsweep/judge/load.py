"""Load, judged. :func:`judge_load` writes ``load_check.json`` at the end of a run: each PD answer
under load against the single-instance reference's answer to the same prompt. Rule per answer
(the consistency probe's, :func:`pdsweep.measure.probe.compare` and
:func:`pdsweep.judge.consistency.judge_prompt`): equal TP: every token equal and |dlogprob| <
1.5 nats; different TP: the first half of the tokens. ``stale``: a wrong answer equal to the
reference answer of *another* prompt (vllm 52234: the previous prompt's answer,
``nixl_num_failed_transfers`` 0); a flip between two near-equal tokens is a near-tie
(:func:`near_tie`).

The gate's checks: :class:`LoadCheck` (load.json: the ``vllm bench serve`` repeats completed without
errors, figures present and possible) and :class:`LoadAnswersCheck` (``load_check.json``,
:func:`judge_load`: a PD cell fails when any answer under load differs from the
reference's, is stale, failed, or has no reference answer; each reason gives the count,
concurrency, first example and triage).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pdsweep.core.stats import num
from pdsweep.judge.consistency import judge_prompt, thresholds_for
from pdsweep.judge.facts import (
    CellFiles,
    show,
)
from pdsweep.judge.loadfigures import run_problems
from pdsweep.measure.probe import compare
from pdsweep.results import layout

TIE_NATS = 0.1  # nats: 2.5x the largest PD-vs-reference top-1 logprob delta on matching positions seen on CPU


def near_tie(pd: dict[str, Any], ref: dict[str, Any], cmp: dict[str, Any]) -> dict[str, Any] | None:
    """Whether an answer's first divergence is a flip between two near-equal tokens: at that
    position each side's chosen token is within ``TIE_NATS`` of the other's in **both** top-k
    distributions (``top_logprobs``, :data:`pdsweep.measure.probe.TOP_K`), and the top-1
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
        where = answers_where(s["workload"], s["concurrency"])
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


def answers_where(workload: Any, concurrency: Any) -> str:
    """How a load_check.json reason names its (workload, concurrency) pair; :data:`ANSWERS_WHERE`
    reads it back (pdsweep.judge.point_answers: each load point's own answer check)."""
    return f"load workload '{workload}' at concurrency {concurrency}"


# a reason of one (workload, concurrency) pair, as :func:`answers_where` wrote it
ANSWERS_WHERE = re.compile(r"^load workload '(?P<workload>[^']*)' at concurrency (?P<concurrency>\d+)(?=[: ]|$)")


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
        why = judge_prompt({**p, "ref_tokens": rr["tokens"], **cmp}, thresholds, int(row["max_tokens"]))
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


@dataclass(frozen=True)
class LoadCheck:
    """load.json (the bench phase, ``vllm bench serve``): every run completed all its
    prompts with no failed request, and generated output: ``output_tokens`` (vllm bench
    serve's ``total_output_tokens``; where a load.json predates it, ``output_tok_s``) above 0.
    ``vllm bench serve`` exits 0 even when every request failed (it only warns), so its own
    exit code proves nothing, and a run of 0 output tokens is a failed run, never a fast one
    (srt-slurm issue 429: every transfer failed, the benchmark printed "Total generated
    tokens: 0" and reported success). Every figure of a run must be possible by vLLM's own
    arithmetic (:func:`pdsweep.judge.loadfigures.run_problems`: finite, >= 0, throughputs =
    counts / duration). ``required``: the sweep's ``bench.enabled`` (frozen in
    run.json); a load.json present is checked either way."""

    required: bool = False
    name: str = "load"
    concurrencies: tuple[int, ...] = ()  # run.json bench.concurrencies, when a `random` workload was planned
    num_prompts: int | None = None  # run.json bench.num_prompts: each vllm bench serve run's request count
    repeats: tuple[int, int] | None = None  # fewest, most runs per concurrency (run.json bench.repeats, platform)

    def applies(self, kind: str) -> bool:
        return True

    def fails(self, files: CellFiles) -> list[str]:
        body = files.get(layout.LOAD_FILE)
        if body is None:
            missing = files.problems.get(layout.LOAD_FILE, "missing") == "missing"
            return [files.problem(layout.LOAD_FILE)] if self.required or not missing else []
        w = files.where(layout.LOAD_FILE)
        runs = body.get("runs")
        if runs == [] and body.get("workloads"):  # no `random` workload: no vllm bench serve run
            return []
        if not isinstance(runs, list) or not runs:
            return [f"{w}: no load runs"]
        out = planned_runs(runs, self.concurrencies, self.num_prompts, w) + planned_repeats_of(runs, self.repeats, w)
        for i, r in enumerate(runs):
            r = r if isinstance(r, dict) else {}
            out += run_problems(r, f"{w}: runs.{i} (concurrency {show(r.get('concurrency'))})")
            conc, want = r.get("concurrency"), num(r.get("num_prompts"))
            done, errors = num(r.get("completed")), num(r.get("errors"))
            if want is None or done is None or errors is None:
                out.append(
                    f"{w}: concurrency {show(conc)}: num_prompts/completed/errors is "
                    f"{show(r.get('num_prompts'))}/{show(r.get('completed'))}/{show(r.get('errors'))} "
                    "(missing)"
                )
            elif errors > 0 or done < want:
                out.append(
                    f"{w}: concurrency {show(conc)}: {errors:g} load requests failed, completed {done:g} "
                    f"of num_prompts {want:g} (vllm bench serve exits 0 regardless)"
                )
            else:
                out += _no_output(r, w, conc)
        return out


def planned_runs(runs: list[Any], concurrencies: tuple[int, ...], num_prompts: int | None, w: str) -> list[str]:
    """What the plan asked of load.json ``runs`` (run.json's frozen ``bench``, never the file's own
    counts): a run at every planned concurrency, none at another, each of ``num_prompts`` requests."""
    rows = [r for r in runs if isinstance(r, dict)]
    seen = {r.get("concurrency") for r in rows}
    out = [
        f"{w}: no load run at concurrency {c} (bench.concurrencies {list(concurrencies)} in run.json)"
        for c in concurrencies
        if c not in seen
    ]
    if concurrencies:
        out += [
            f"{w}: a load run at concurrency {show(c)}, which bench.concurrencies {list(concurrencies)} does not plan"
            for c in sorted(seen - set(concurrencies), key=str)
        ]
    if num_prompts is not None:
        out += [
            f"{w}: concurrency {show(r.get('concurrency'))}: num_prompts {show(r.get('num_prompts'))}, "
            f"bench.num_prompts {num_prompts} in run.json"
            for r in rows
            if num(r.get("num_prompts")) != num_prompts
        ]
    return out


def planned_repeats_of(runs: list[Any], repeats: tuple[int, int] | None, w: str) -> list[str]:
    """What the plan's repeats ask of load.json ``runs`` (each repeat runs every concurrency once,
    :func:`pdsweep.measure.phases.run_load`): the same number of runs at every concurrency, within
    ``repeats`` (fewest, most: :func:`pdsweep.core.stats.planned_repeats`), their ``repeat`` indices
    0..n-1 each once (a lone run of a load.json before repeats may carry none)."""
    by: dict[Any, list[Any]] = {}
    for r in runs:
        if isinstance(r, dict):
            by.setdefault(r.get("concurrency"), []).append(r.get("repeat"))
    out = []
    if len({len(v) for v in by.values()}) > 1:
        counts = ", ".join(f"{show(c)}: {len(v)}" for c, v in by.items())
        out.append(f"{w}: runs per concurrency differ ({counts}): every repeat runs every concurrency once")
    for c, idx in by.items():
        n = len(idx)
        if repeats is not None and not repeats[0] <= n <= repeats[1]:
            want = f"{repeats[0]}" if repeats[0] == repeats[1] else f"{repeats[0]}..{repeats[1]}"
            out.append(f"{w}: concurrency {show(c)}: {n} run(s), the plan repeats the load phase {want} times "
                       "(bench.repeats in run.json)")  # fmt: skip
        whole = all(isinstance(i, int) and not isinstance(i, bool) for i in idx)
        if idx != [None] and not (whole and sorted(idx) == list(range(n))):
            out.append(f"{w}: concurrency {show(c)}: repeat indices {show(idx)} (allowed: 0..{n - 1}, each once)")
    return out


def _no_output(r: dict[str, Any], w: str, conc: Any) -> list[str]:
    """Why a load run that completed every prompt generated nothing: ``output_tokens`` 0, or
    (no ``output_tokens`` recorded) ``output_tok_s`` 0; both missing fails closed."""
    tokens, rate = num(r.get("output_tokens")), num(r.get("output_tok_s"))
    if tokens is None and rate is None:
        return [f"{w}: concurrency {show(conc)}: output_tokens and output_tok_s missing (nothing shows output)"]
    if (tokens if tokens is not None else rate) == 0:
        what = f"output_tokens {tokens:g}" if tokens is not None else f"output_tok_s {rate:g}"
        return [
            f"{w}: concurrency {show(conc)}: 0 output tokens ({what}) with every request 'completed': "
            "nothing was generated (a failed run, not a fast one)"
        ]
    return []


@dataclass(frozen=True)
class LoadAnswersCheck:
    """``required``: the run's ``bench.enabled`` and ``bench.check`` (frozen in run.json): then
    a missing load_check.json fails the PD cell (fail closed); otherwise one present is
    still checked."""

    required: bool = False
    name: str = "load_answers"
    planned: tuple[tuple[str, int], ...] = ()  # (workload, concurrency) of run.json bench: each must be checked

    def applies(self, kind: str) -> bool:
        return kind == "pd"

    def fails(self, files: CellFiles) -> list[str]:
        body = files.get(layout.LOAD_CHECK_FILE)
        if body is None:
            missing = files.problems.get(layout.LOAD_CHECK_FILE, "missing") == "missing"
            return [files.problem(layout.LOAD_CHECK_FILE)] if self.required or not missing else []
        w = files.where(layout.LOAD_CHECK_FILE)
        if body.get("verdict") == "pass" and not body.get("reasons"):
            return answers_against_plan(body, self.planned, w)
        return [f"{w}: {r}" for r in body.get("reasons") or []] or [f"{w}: verdict {body.get('verdict')!r}"]


def answers_against_plan(body: dict[str, Any], planned: tuple[tuple[str, int], ...], w: str) -> list[str]:
    """A passing load_check.json, recomputed from its counts against the plan: every planned
    (workload, concurrency) checked at least one answer, with no wrong, errored or unmatched one
    (:func:`judge_load`'s rule)."""
    rows = {(e.get("workload"), e.get("concurrency")): e for e in body.get("workloads") or [] if isinstance(e, dict)}
    out = []
    for name, conc in planned:
        e = rows.get((name, conc))
        if e is None:
            out.append(f"{w}: {answers_where(name, conc)} missing (bench in run.json)")
            continue
        counts = {k: num(e.get(k)) for k in ("checked", "wrong", "errors", "unmatched")}
        if counts["checked"] is None or counts["checked"] < 1 or any(counts[k] != 0 for k in counts if k != "checked"):
            shown = ", ".join(f"{k} {show(e.get(k))}" for k in counts)
            out.append(f"{w}: {answers_where(name, conc)}: {shown} with verdict pass")
    return out
