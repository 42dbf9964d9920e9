"""What a load run of ``bench.num_prompts`` requests can judge: a percentile ``pQ`` of one repeat
is judged only when the repeat holds :data:`MIN_TAIL_REQUESTS` requests past it (issue 40). Used
by the plan (``pdsweep plan``/``validate`` print it) and by :func:`pdsweep.judge.perf.judged`."""

from __future__ import annotations

import math

from pdsweep.measure.repeats import PCTS

# Requests each repeat must hold beyond a percentile for it to be judged (issue 40). A repeat's
# pQ is an order statistic; with k requests past it, it moves by about one request's spacing
# when one tail request is early or late. k >= 30 is the usual floor for a sample quantile to
# be near-normal and stable (the order statistic's binomial count np(1-p) >= ~30; the same rule
# of thumb as the t interval's n >= 30), so repeat-to-repeat noise is the load's, not the
# sampling's: the p99 of 8 requests is their maximum, and on a shared host the maximum of two
# runs of one build differed 4x (docs/performance.md).
MIN_TAIL_REQUESTS = 30


def requests_for(q: int) -> int:
    """The fewest requests per repeat that judge percentile ``q``: ``MIN_TAIL_REQUESTS`` past it
    (p50: 60, p90: 300, p99: 3000)."""
    return math.ceil(MIN_TAIL_REQUESTS * 100 / (100 - q) - 1e-9)


# gate.perf families every figure of which is a percentile (pdsweep.measure.repeats.flatten_run, flatten_kv)
PERCENTILE_FAMILIES = ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms", "kv_xfer_ms")


def percentile_plan(num_prompts: int, perf: dict[str, float]) -> tuple[str, list[str]]:
    """What the verdict can judge of load runs of ``num_prompts`` requests (``bench.num_prompts``):
    a line for the user (which of p50/p90/p99 each repeat holds :data:`MIN_TAIL_REQUESTS` requests
    past, what the others need), and a warning per ``gate.perf`` family (``perf``: its keys) of
    :data:`PERCENTILE_FAMILIES` none of whose figures can then be judged."""
    qs = [int(p[1:]) for p in PCTS]
    ok = [f"p{q}" for q in qs if num_prompts >= requests_for(q)]
    need = "; ".join(f"p{q} needs {requests_for(q)}" for q in qs if num_prompts < requests_for(q))
    line = (
        f"perf verdicts: bench.num_prompts {num_prompts} judges {', '.join(ok) or 'no percentile'} "
        f"({MIN_TAIL_REQUESTS} requests past each judged percentile{'; ' + need if need else ''})"
    )
    if not ok:
        line += f": {', '.join(PERCENTILE_FAMILIES)} are not judged, only rates and means"
    warn = [
        f"gate.perf.{fam}: no {fam} figure can be judged: each is a percentile, and bench.num_prompts "
        f"{num_prompts} holds fewer than {MIN_TAIL_REQUESTS} requests past p50 (raise it to {requests_for(50)})"
        for fam in perf
        if fam in PERCENTILE_FAMILIES and not ok
    ]
    return line, warn
