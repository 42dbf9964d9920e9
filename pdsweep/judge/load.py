"""Load, judged: :class:`LoadCheck` (load.json: the ``vllm bench serve`` repeats completed without
errors, figures present and possible) and :class:`LoadAnswersCheck` (``load_check.json``,
:mod:`pdsweep.measure.loadcheck`: a PD cell fails when any answer under load differs from the
reference's, is stale, failed, or has no reference answer; each reason gives the count,
concurrency, first example and triage).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pdsweep.core.stats import num
from pdsweep.judge.facts import (
    CellFiles,
    show,
)
from pdsweep.results import layout


@dataclass(frozen=True)
class LoadCheck:
    """load.json (the bench phase, ``vllm bench serve``): every run completed all its
    prompts with no failed request, and generated output: ``output_tokens`` (vllm bench
    serve's ``total_output_tokens``; where a load.json predates it, ``output_tok_s``) above 0.
    ``vllm bench serve`` exits 0 even when every request failed (it only warns), so its own
    exit code proves nothing, and a run of 0 output tokens is a failed run, never a fast one
    (srt-slurm issue 429: every transfer failed, the benchmark printed "Total generated
    tokens: 0" and reported success). ``required``: the sweep's ``bench.enabled`` (frozen in
    run.json); a load.json present is checked either way."""

    required: bool = False
    name: str = "load"
    concurrencies: tuple[int, ...] = ()  # run.json bench.concurrencies, when a `random` workload was planned
    num_prompts: int | None = None  # run.json bench.num_prompts: each vllm bench serve run's request count

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
        out = planned_runs(runs, self.concurrencies, self.num_prompts, w)
        for r in runs:
            r = r if isinstance(r, dict) else {}
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


def planned_answers(bench: dict[str, Any]) -> tuple[tuple[str, int], ...]:
    """(workload, concurrency) pairs a PD cell's load_check.json must hold: every ``bench.workloads``
    entry at every ``bench.concurrencies`` point (:func:`pdsweep.measure.phases.run_checked`)."""
    works, concs = bench.get("workloads"), bench.get("concurrencies")
    if not isinstance(works, list) or not isinstance(concs, list):
        return ()
    names = [x.get("name") if isinstance(x, dict) else x for x in works]
    return tuple((str(n), c) for n in names for c in concs if isinstance(c, int))


def load_plan(bench: dict[str, Any]) -> dict[str, Any]:
    """:class:`LoadCheck`'s ``concurrencies`` and ``num_prompts`` from run.json ``bench`` (the
    sweep's :class:`~pdsweep.sweepfile.phases.BenchSpec`, frozen): ``vllm bench serve`` runs once per
    concurrency when a ``random`` workload is planned (:func:`pdsweep.measure.phases.run_load`);
    a run.json without ``bench.workloads`` predates them and planned ``random``."""
    works = bench.get("workloads")
    names = [x.get("name") if isinstance(x, dict) else x for x in works] if isinstance(works, list) else ["random"]
    if bench.get("enabled") is not True or "random" not in names:
        return {}
    concs = bench.get("concurrencies")
    n = bench.get("num_prompts")
    return {
        "concurrencies": tuple(c for c in concs if isinstance(c, int)) if isinstance(concs, list) else (),
        "num_prompts": n if isinstance(n, int) and not isinstance(n, bool) else None,
    }


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
    (:func:`pdsweep.measure.loadcheck.judge_load`'s rule)."""
    rows = {(e.get("workload"), e.get("concurrency")): e for e in body.get("workloads") or [] if isinstance(e, dict)}
    out = []
    for name, conc in planned:
        e = rows.get((name, conc))
        if e is None:
            out.append(f"{w}: load workload '{name}' at concurrency {conc} missing (bench in run.json)")
            continue
        counts = {k: num(e.get(k)) for k in ("checked", "wrong", "errors", "unmatched")}
        if counts["checked"] is None or counts["checked"] < 1 or any(counts[k] != 0 for k in counts if k != "checked"):
            shown = ", ".join(f"{k} {show(e.get(k))}" for k in counts)
            out.append(f"{w}: load workload '{name}' at concurrency {conc}: {shown} with verdict pass")
    return out
