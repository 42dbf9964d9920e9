"""The noise-aware performance verdict of one cell in A (baseline) and B (candidate).

For each metric of the load phase's repeats (:func:`pdsweep.measure.repeats.series`: series
``c<C>`` per concurrency, ``kv`` for the KV transfer) the ratio B/A and its confidence
interval are turned into *badness*
(B/A for a latency, A/B for a rate) and judged against the metric's threshold ``t``
(``gate.perf[family]``, else ``gate.perf_default``):

==============  ==========================================================================
``regression``  the whole interval is worse than ``1 + t``
``improvement`` the whole interval is better than ``1 / (1 + t)``
``same``        the whole interval lies within ``[1 / (1 + t), 1 + t]``
``noisy``       the interval straddles a bound (or there is none: fewer than 2 repeats a
                side): too wide to decide at ``t``. Never a pass in silence: compare counts
                it and says so; ``gate.perf_noisy_fails`` makes it fail the comparison.
==============  ==========================================================================

The interval: *paired* when A's and B's repeats were interleaved (both load.json carry the same
``pairing.id``, :mod:`pdsweep.measure.paired`): the Student-t interval of the mean per-pair log
ratio (:func:`pdsweep.core.stats.paired_ratio_interval`; load drift hits both sides of a pair
and cancels); else the ratio of means over independent repeats
(:func:`pdsweep.core.stats.ratio_interval`). Each verdict carries ``detectable``: the smallest
slowdown an interval of its width would call a regression
(:func:`pdsweep.core.stats.detectable_slowdown`), the teeth of this run for that metric.

The wording is gated by those teeth: a ``regression`` (``improvement``) whose claimed change
(B/A, or A/B for a rate; its inverse for an improvement) is smaller than ``detectable`` is
``noisy`` instead (a ratio-of-means or bootstrap interval is not symmetric in log space, so
it can clear a bound while its width could not resolve the change it claims). And two builds of
*one* run measured unpaired (``unpaired_builds``: ``compare RUN RUN --a-build X --b-build Y``,
the report's build pairs) met different machine-load epochs minutes apart, a drift the
repeats' interval does not hold: only paired repeats (``bench.pair_builds``) give them a
``regression`` or ``improvement``; unpaired they are ``noisy``, saying so.

A metric A has and B lacks is a ``regression`` (fail closed: "metric missing in B").
The two-sided Mann-Whitney U p-value is reported next to each ratio, not judged.
vLLM's perf-eval (REGRESSION / NOISY / PASS against a baseline image) and AIPerf's
Student-t intervals over repeats are the models.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Any

from pdsweep.core.stats import b_over_a, detectable_slowdown, mann_whitney_p, obj
from pdsweep.measure.percentiles import requests_for
from pdsweep.measure.repeats import repeat_series
from pdsweep.sweepfile.gatespec import PERF_METRICS, GateSpec

REGRESSION, IMPROVEMENT, SAME, NOISY = "regression", "improvement", "same", "noisy"
PERF_VERDICTS = (REGRESSION, IMPROVEMENT, SAME, NOISY)
NOT_JUDGED = ("kv_gbps.sum",)  # vLLM's sum-of-durations figure: shown, never judged (vllm issue 48224)
OPT_IN = ("engine_cpu_ms",)  # judged only when gate.perf names the family


def family(metric: str) -> str:
    """``ttft_ms.p50`` -> ``ttft_ms`` (the ``gate.perf`` key)."""
    return metric.split(".", 1)[0]


def lower_is_better(metric: str) -> bool:
    """Latencies (``*_ms``) are better lower; rates (tokens/s, requests/s, GB/s) higher."""
    return family(metric).endswith("_ms")


def percentile_of(metric: str) -> int | None:
    """``ttft_ms.p90`` -> 90; None for a metric that is no percentile (``mean``, ``union`` ...)."""
    q = metric.rsplit(".", 1)[-1]
    return int(q[1:]) if q.startswith("p") and q[1:].isdigit() else None


def judged(metric: str, requests: int | None = None, named: tuple[str, ...] = ()) -> bool:
    """Whether ``metric`` gets a verdict: a ``gate.perf`` family (one of :data:`OPT_IN` only when
    in ``named``, the families ``gate.perf`` names), not vLLM's sum-of-durations GB/s,
    and a percentile ``pQ`` only when each repeat has
    :data:`pdsweep.measure.percentiles.MIN_TAIL_REQUESTS` requests beyond it
    (``requests >= requests_for(Q)``)."""
    if family(metric) not in PERF_METRICS or metric in NOT_JUDGED:
        return False
    if family(metric) in OPT_IN and family(metric) not in named:
        return False
    q = percentile_of(metric)
    if q is not None:
        return requests is not None and requests >= requests_for(q)
    return True


def _requests(load: dict[str, Any]) -> int | None:
    """The fewest requests of one load run (``num_prompts``) in a load.json; None when unknown."""
    raw = [r.get("num_prompts") for r in load.get("runs") or [] if isinstance(r, dict)]
    ns = [n for n in raw if isinstance(n, int) and not isinstance(n, bool)]
    return min(ns) if ns else None


@dataclass(frozen=True)
class PerfDelta:
    """One metric of one series: means of A and B, ``ratio`` = B/A with its interval
    ``[lo, hi]`` (None: fewer than 2 repeats a side), the ``threshold``, the ``verdict`` and
    why (``note``); ``n_a``/``n_b`` repeats, ``method`` of the interval (``welch``,
    ``bootstrap``, ``paired``), ``p_mw`` Mann-Whitney, ``detectable`` the smallest slowdown
    factor this interval's width calls a regression (None without an interval)."""

    series: str
    metric: str
    a: float | None
    b: float | None
    ratio: float | None
    lo: float | None
    hi: float | None
    threshold: float
    verdict: str
    n_a: int
    n_b: int
    method: str = ""
    p_mw: float | None = None
    note: str = ""
    detectable: float | None = None

    @property
    def name(self) -> str:
        return f"{self.series} {self.metric}"

    def describe(self) -> str:
        iv = "no interval" if self.lo is None else f"[{self.lo:.3f}, {self.hi:.3f}]"
        r = "n/a" if self.ratio is None else f"{self.ratio:.3f}x"
        det = "" if self.detectable is None else f", detects >= {self.detectable:.2f}x"
        how = ", paired" if self.method == "paired" else ""
        return (
            f"{self.name}: {r} {iv} (threshold {self.threshold:.0%}, n {self.n_a}/{self.n_b}{how}{det}) {self.verdict}"
            + (f": {self.note}" if self.note else "")
        )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def verdict_of(ratio: float | None, lo: float | None, hi: float | None, t: float, lower_better: bool) -> str:
    """The verdict of a B/A ratio interval at threshold ``t`` (module doc)."""
    if ratio is None or lo is None or hi is None or lo <= 0 or hi <= 0:  # a bound 0 (exp underflow): no claim
        return NOISY
    qlo, qhi = (lo, hi) if lower_better else (1 / hi, 1 / lo)
    if qlo > 1 + t:
        return REGRESSION
    if qhi < 1 / (1 + t):
        return IMPROVEMENT
    if qlo >= 1 / (1 + t) and qhi <= 1 + t:
        return SAME
    return NOISY


def unpaired_builds_claim_nothing(d: PerfDelta) -> PerfDelta:
    """A and B are two builds of one run: an unpaired interval claims no regression or
    improvement (module doc); ``d`` as ``noisy``, saying why."""
    if d.verdict in (REGRESSION, IMPROVEMENT) and d.method != "paired":
        return replace(d, verdict=NOISY, note=f"{d.verdict} {UNPAIRED_BUILDS}")
    return d


def judge_metric(
    series: str,
    metric: str,
    a: list[float],
    b: list[float],
    t: float,
    confidence: float = 0.95,
    paired: bool = False,
) -> PerfDelta:
    """Judge one metric from its per-repeat values in A and B (module doc). ``paired``: ``a[i]``
    and ``b[i]`` ran interleaved (equal lengths), judged by their per-pair ratios; unequal
    lengths fall back to the independent interval (two builds of one run:
    :func:`unpaired_builds_claim_nothing`)."""
    ratio, lo, hi, method = b_over_a(a, b, confidence, paired)
    v = verdict_of(ratio, lo, hi, t, lower_is_better(metric))
    det = detectable_slowdown(lo, hi, t)
    note = ""
    if v == NOISY:
        note = (
            f"fewer than 2 repeats a side ({len(a)}/{len(b)})"
            if lo is None
            else f"interval straddles the {t:.0%} threshold"
        )
    else:
        v, note = _within_teeth(v, ratio, det, lower_is_better(metric))
    mean = lambda xs: sum(xs) / len(xs) if xs else None  # noqa: E731
    return PerfDelta(
        series,
        metric,
        mean(a),
        mean(b),
        ratio,
        lo,
        hi,
        t,
        v,
        len(a),
        len(b),
        method,
        mann_whitney_p(a, b),
        note,
        det,
    )


UNPAIRED_BUILDS = (
    "not claimed: two builds of one run measured unpaired, minutes apart (machine-load drift between them is not "
    "in the interval; build pairs are measured paired unless bench.pair_builds: false or a side has no load phase)"
)


def _within_teeth(v: str, ratio: float | None, det: float | None, lower_better: bool) -> tuple[str, str]:
    """``(verdict, note)``: a ``regression``/``improvement`` whose claimed change is smaller than
    ``det`` (the smallest slowdown this interval's width resolves) becomes ``noisy`` (module doc)."""
    if v not in (REGRESSION, IMPROVEMENT) or ratio is None or ratio <= 0 or det is None:
        return v, ""
    worse = ratio if lower_better else 1 / ratio
    change = worse if v == REGRESSION else 1 / worse
    if change >= det:
        return v, ""
    return NOISY, f"{v} of {change:.2f}x not claimed: this interval resolves only >= {det:.2f}x"


def perf_deltas(
    load_a: dict[str, Any] | None, load_b: dict[str, Any] | None, gate: GateSpec, same_run: bool = False
) -> list[PerfDelta]:
    """Every judged metric of every series in A's load.json against B's (either None: no
    load phase; nothing to judge when A has none). Confidence: B's ``repeat_plan``, else 0.95.
    Paired (:func:`paired_with`) when both carry one ``pairing.id``. ``same_run``: A and B are
    two builds of one run (:func:`judge_metric`'s ``unpaired_builds``)."""
    if not load_a:
        return []
    sa, sb = repeat_series(load_a), repeat_series(load_b or {})
    requests = _requests(load_a)
    conf = ((load_b or {}).get("repeat_plan") or {}).get("confidence") or 0.95
    paired = paired_with(load_a, load_b)
    out = []
    for name, metrics in sa.items():
        for metric, xa in metrics.items():
            if not judged(metric, requests, tuple(gate.perf)):
                continue
            t = gate.perf.get(family(metric), gate.perf_default)
            xb = sb.get(name, {}).get(metric)
            if not xb:
                out.append(
                    PerfDelta(
                        name,
                        metric,
                        None,
                        None,
                        None,
                        None,
                        None,
                        t,
                        REGRESSION,
                        len(xa),
                        0,
                        note="metric missing in B",
                    )
                )
                continue
            d = judge_metric(name, metric, xa, xb, t, conf, paired)
            out.append(unpaired_builds_claim_nothing(d) if same_run else d)
    return out


def paired_with(load_a: dict[str, Any] | None, load_b: dict[str, Any] | None) -> bool:
    """Whether two load.json bodies are the two sides of one interleaved measurement: both carry
    ``pairing.id`` (:mod:`pdsweep.measure.paired`), equal, on opposite sides."""
    return same_pair((load_a or {}).get("pairing"), (load_b or {}).get("pairing"))


def same_pair(pa: Any, pb: Any) -> bool:
    """Whether two load.json ``pairing`` objects (``{id, side, ...}``, :mod:`pdsweep.measure.paired`;
    None or anything else: unpaired) are the two sides of one pair: one ``id``, sides ``a`` and ``b``
    (either case; a side missing or of another name: unpaired, never the paired test)."""
    pa, pb = obj(pa), obj(pb)
    return (
        bool(pa.get("id"))
        and pa.get("id") == pb.get("id")
        and {str(pa.get("side")).lower(), str(pb.get("side")).lower()} == {"a", "b"}
    )


def counts(deltas: list[PerfDelta]) -> dict[str, int]:
    return {v: sum(d.verdict == v for d in deltas) for v in PERF_VERDICTS}
