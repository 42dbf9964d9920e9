"""Can a GPU sweep's KV digest sample see a request? Checked at validate/plan (issue 59).

``integrity: {gpu: true, gpu_sample: F}`` digests a request when the CRC-32 of its prefill request id
falls below ``F x 2**32`` (:func:`pdsweep.core.kvsample.sampled`): over ``N`` PD requests a cell expects
``F x N`` digested ones. Below 1 the cell most likely digests none, and the gate fails it at run time as
"integrity: not measured". :func:`sample_problems` refuses such an ``F`` with the figure and the smallest
``F`` that expects one request (``1 / N``).

``N`` is what the plan sends every PD cell of the sweep through the PD proxy, counted from the sweep file
alone, a lower bound: the consistency probe's prompts (``eval.consistency.lengths``), lm-eval's
``eval.tasks x eval.limit`` (lm-eval may send more than one request per document), and the load phase at
each of ``bench.concurrencies``: each workload's checked prompts (``random``: ``num_prompts``;
``shared-prefix``: ``num_prompts x passes``; ``multi-turn``: one per conversation at least; the others,
whose count depends on the served model's lengths or a trace file: one at least,
:func:`pdsweep.measure.workloads.build`) and, with a ``random`` workload, ``vllm bench serve``'s
``bench.num_prompts`` per repeat (the fewest repeats :func:`pdsweep.core.stats.planned_repeats`
allows). The plan cannot count an lm-eval task without ``eval.limit`` (its size is its dataset's,
which validate does not load): then ``F x N`` below 1 is a warning that says so, not a refusal.
"""

from __future__ import annotations

import math

from pdsweep.core.stats import planned_repeats
from pdsweep.plan.expand import Plan
from pdsweep.plan.pushrules import uses_push
from pdsweep.results.layout import probe_prompt_name
from pdsweep.sweepfile.sweep import Sweep


def planned_requests(s: Sweep) -> tuple[int, list[str], bool]:
    """``(N, parts, eval_counted)``: the PD requests every PD cell of ``s`` sends at least (module doc), the
    parts as ``probe 3``, ``eval 1 task x limit 20``, ``load ...``; ``eval_counted`` False when a task has no
    ``eval.limit`` (its requests are not in ``N``)."""
    parts, n = [], 0
    c = s.eval.consistency
    if c.enabled:
        probe = len(dict.fromkeys(map(probe_prompt_name, c.lengths)))
        n += probe
        parts.append(f"probe {probe}")
    counted = not s.eval.tasks or s.eval.limit is not None
    if s.eval.tasks and s.eval.limit is not None:
        n += len(s.eval.tasks) * s.eval.limit
        parts.append(f"eval {len(s.eval.tasks)} task(s) x limit {s.eval.limit}")
    b = s.bench
    if b.enabled:
        per_point = 0
        for w in b.workloads:
            k = w.num_prompts or b.num_prompts
            per_point += {"random": k, "shared-prefix": k * w.passes, "multi-turn": k}.get(w.name, 1)
        if any(w.name == "random" for w in b.workloads):
            per_point += b.num_prompts * planned_repeats(b, s.platform)[0]
        load = per_point * len(b.concurrencies)
        n += load
        parts.append(f"load {load} ({per_point} at each of {len(b.concurrencies)} concurrencies)")
    return n, parts, counted


def sample_problems(plan: Plan) -> tuple[list[str], list[str]]:
    """(errors, warnings): ``integrity.gpu_sample`` expecting fewer than one digested request per PD cell
    that digests on GPU (pull cells of a cuda sweep with ``integrity.gpu``), naming the figure ``F x N``
    and the smallest ``F`` that expects one; a warning instead where ``N`` leaves lm-eval out (module doc)."""
    ls = plan.loaded
    s, f = ls.sweep, ls.sweep.integrity.gpu_sample
    digesting = [c for c in plan.pd_cells if s.platform != "cpu" and not uses_push(c, ls.catalogue.models[c.model], ls)]
    if not s.integrity.gpu or f >= 1 or not digesting:
        return [], []
    n, parts, counted = planned_requests(s)
    if f * n >= 1:
        return [], []
    smallest = _up(1 / n) if n else 1.0
    head = (
        f"{ls.path}: integrity.gpu_sample: {f:g} x {n} PD requests per cell ({', '.join(parts) or 'none'}) = "
        f"{f * n:.3g} expected digested requests, below 1: the cells' KV integrity would be 'not measured'"
    )
    if not counted:
        return [], [
            f"{head}, unless lm-eval sends more (eval.tasks without eval.limit: the plan cannot count them); "
            f"gpu_sample >= {smallest:g} samples at least one request of the counted ones"
        ]
    return [f"{head} (allowed: gpu_sample >= {smallest:g}, which expects at least one digested request)"], []


def _up(x: float) -> float:
    """``x`` (0 < x <= 1) rounded up to 3 significant digits: a fraction ``F`` with ``F x N >= 1`` for ``x = 1/N``."""
    scale = 10.0 ** (math.floor(math.log10(x)) - 2)
    return min(1.0, math.ceil(x / scale - 1e-9) * scale)
