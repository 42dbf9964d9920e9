"""Statistics and number coercion shared by the judges (accuracy, compare) and the
readers of results files (facts): leaves, no pdsweep imports."""

from __future__ import annotations

import math
from typing import Any


def num(x: Any) -> float | None:
    """``x`` as a finite float, or None (null, NaN, inf, bool, string: not a number)."""
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return None
    try:
        return float(x) if math.isfinite(x) else None
    except OverflowError:  # an int beyond float range (e.g. 10**400 in a corrupt file)
        return None


def obj(x: Any) -> dict[str, Any]:
    """``x`` if it is a JSON object (dict), else ``{}``: a results file's field that may be missing or corrupt."""
    return x if isinstance(x, dict) else {}


def two_proportion_p(x1: int, n1: int, x2: int, n2: int) -> float:
    """One-sided p-value that proportion 1 (the PD cell, ``x1`` correct of ``n1``) is
    lower than proportion 2 (the reference, ``x2`` of ``n2``): pooled two-proportion
    z-test, ``z = (p1 - p2) / sqrt(p(1-p)(1/n1 + 1/n2))`` with ``p = (x1+x2)/(n1+n2)``,
    ``p-value = Phi(z)`` (normal lower tail). Small values mean "PD is worse".

    Edge cases: ``n1 == 0`` or ``n2 == 0`` -> 1.0 (no evidence; :func:`judge` fails a
    cell without samples on its own); pooled ``p`` of 0 or 1 (both all wrong, or both
    all correct: identical proportions, zero variance) -> 0.5, the value of ``z = 0``.
    Raises ``ValueError`` unless ``0 <= x <= n``.
    """
    for x, n in ((x1, n1), (x2, n2)):
        if n < 0 or x < 0 or x > n:
            raise ValueError(f"need 0 <= x <= n, got x={x}, n={n}")
    if n1 == 0 or n2 == 0:
        return 1.0
    pooled = (x1 + x2) / (n1 + n2)
    var = pooled * (1 - pooled) * (1 / n1 + 1 / n2)
    if var <= 0:
        return 0.5
    z = (x1 / n1 - x2 / n2) / math.sqrt(var)
    return 0.5 * math.erfc(-z / math.sqrt(2))


# ---------------------------------------------------------------- performance (repeats)
# scipy.stats does the statistics (t quantiles, bootstrap, Mann-Whitney); imported lazily so
# that reading results files stays cheap.


GPU_REPEATS = 3  # load repeats per concurrency when bench.repeats is not given


def planned_repeats(b: Any, platform: str) -> tuple[int, int, int]:
    """``(minimum, planned, bound)`` load repeats of a sweep's ``bench`` ``b`` (``repeats``,
    ``target_ci``, ``max_repeats``): ``bench.repeats`` (None: 3); with ``target_ci`` at least 2
    (the fewest with an interval) and at most ``max_repeats``. ``platform`` is the sweep's (CPU
    plans 2 at least when ``repeats`` is not given). The run (pdsweep.measure.repeats) repeats by
    it and the gate (pdsweep.judge.planned) holds a load.json to it."""
    planned = b.repeats or GPU_REPEATS
    if b.target_ci is not None:
        return min(2, planned), planned, max(planned, b.max_repeats)
    return (2 if b.repeats is None and platform == "cpu" else planned), planned, planned


def t_interval(xs: list[float], confidence: float = 0.95) -> tuple[float | None, float | None, float | None]:
    """Mean of ``xs`` and its two-sided Student-t confidence interval ``(mean, lo, hi)``
    (``scipy.stats.t.interval`` with the standard error of the mean, as AIPerf reports over
    repeated runs). ``lo``/``hi`` are None for fewer than 2 values; all None for none.
    Identical values give a zero-width interval."""
    vals = [v for v in (num(x) for x in xs) if v is not None]
    if not vals:
        return None, None, None
    mean = sum(vals) / len(vals)
    if len(vals) < 2:
        return mean, None, None
    from scipy import stats

    sem = float(stats.sem(vals))
    if sem == 0:
        return mean, mean, mean
    lo, hi = stats.t.interval(confidence, len(vals) - 1, loc=mean, scale=sem)
    return mean, float(lo), float(hi)


def positive_t_interval(
    xs: list[float], confidence: float = 0.95
) -> tuple[float | None, float | None, float | None, str]:
    """Mean of a figure that cannot be negative (tokens/s, requests/s, goodput) and a confidence
    interval that stays >= 0: ``(mean, lo, hi, scale)``. ``mean`` is the arithmetic mean (vLLM's
    per-run figures averaged, as :func:`t_interval`); the interval by ``scale``:

    * ``log`` -- every value > 0: the Student-t interval of the mean of ``log x``
      (``scipy.stats.t.interval`` with ``scipy.stats.sem`` of the logs), exponentiated: an interval
      of the geometric mean, positive and multiplicative, as :func:`ratio_interval` and
      :func:`paired_ratio_interval` take ratios on the log scale (a linear t interval of 2 repeats
      is mean +- 12.7 standard errors and goes below 0 once the two differ by a sixth);
    * ``clipped`` -- a value is 0 (no log: e.g. goodput 0 req/s, no request met the SLO): the
      linear :func:`t_interval` with ``lo`` raised to 0 (the output must say so);
    * ``linear`` -- a value is 0 and the linear interval stays >= 0, or a value is negative (not
      such a figure: a corrupt file), the linear :func:`t_interval` unchanged;
    * ``""`` -- fewer than 2 values: ``lo``/``hi`` None (all None for none).

    Identical values give a zero-width interval."""
    vals = [v for v in (num(x) for x in xs) if v is not None]
    mean, lo, hi = t_interval(vals, confidence)
    if mean is None or lo is None or hi is None:
        return mean, lo, hi, ""
    if min(vals) <= 0:
        clip = min(vals) == 0 and lo < 0
        return mean, (0.0 if clip else lo), hi, ("clipped" if clip else "linear")
    from scipy import stats

    logs = [math.log(v) for v in vals]
    sem = float(stats.sem(logs))
    if sem == 0:
        return mean, mean, mean, "log"
    llo, lhi = stats.t.interval(confidence, len(logs) - 1, loc=sum(logs) / len(logs), scale=sem)
    return mean, math.exp(float(llo)), _exp(float(lhi)), "log"


def _exp(x: float) -> float:
    """``e**x``, ``inf`` past float's range (a bound of a corrupt 1e308 tok/s, never an OverflowError)."""
    return math.exp(x) if x < 709.78 else math.inf


def ratio_interval(
    a: list[float], b: list[float], confidence: float = 0.95, method: str = "auto", seed: int = 0
) -> tuple[float | None, float | None, float | None, str]:
    """Ratio of means ``mean(b) / mean(a)`` and its confidence interval: ``(ratio, lo, hi, method)``.

    ``method``: ``welch`` -- Welch's t interval of the difference of log means
    (``scipy.stats.ttest_ind(log b, log a, equal_var=False).confidence_interval``), exponentiated:
    right for a handful of repeats of a positive, right-skewed figure; ``bootstrap`` --
    ``scipy.stats.bootstrap`` (independent samples, BCa, falling back to percentile) of the
    ratio of means: right from about 8 repeats a side; ``auto``: bootstrap from 8 a side,
    else welch. Fewer than 2 positive values on a side, or a mean <= 0: ``(ratio or None,
    None, None, method)``. Raises ``ValueError`` for another ``method``."""
    if method not in ("auto", "welch", "bootstrap"):
        raise ValueError(f"method must be auto, welch or bootstrap, got {method!r}")
    xa = [v for v in (num(x) for x in a) if v is not None]
    xb = [v for v in (num(x) for x in b) if v is not None]
    ma, mb = (sum(xa) / len(xa) if xa else None), (sum(xb) / len(xb) if xb else None)
    ratio = mb / ma if ma and mb is not None and ma > 0 else None
    if method == "auto":
        method = "bootstrap" if min(len(xa), len(xb)) >= 8 else "welch"
    if ratio is None or min(len(xa), len(xb)) < 2 or min(xa + xb) <= 0:
        return ratio, None, None, method
    import numpy as np
    from scipy import stats

    if method == "welch":
        la, lb = np.log(xa), np.log(xb)
        if np.var(la) == 0 and np.var(lb) == 0:  # no spread on either side: the ratio is exact
            return ratio, ratio, ratio, method
        ci = stats.ttest_ind(lb, la, equal_var=False).confidence_interval(confidence)
        return ratio, float(np.exp(ci.low)), float(np.exp(ci.high)), method
    res = stats.bootstrap(
        (np.asarray(xb), np.asarray(xa)),
        lambda y, x, axis=-1: np.mean(y, axis=axis) / np.mean(x, axis=axis),
        confidence_level=confidence,
        n_resamples=2000,
        method="BCa",
        random_state=np.random.default_rng(seed),
        vectorized=True,
    )
    lo, hi = float(res.confidence_interval.low), float(res.confidence_interval.high)
    if not (math.isfinite(lo) and math.isfinite(hi)):  # BCa degenerate (ties): percentile
        res = stats.bootstrap(
            (np.asarray(xb), np.asarray(xa)),
            lambda y, x, axis=-1: np.mean(y, axis=axis) / np.mean(x, axis=axis),
            confidence_level=confidence,
            n_resamples=2000,
            method="percentile",
            random_state=np.random.default_rng(seed),
            vectorized=True,
        )
        lo, hi = float(res.confidence_interval.low), float(res.confidence_interval.high)
    return ratio, lo, hi, method


def mann_whitney_p(a: list[float], b: list[float]) -> float | None:
    """Two-sided Mann-Whitney U p-value that ``a`` and ``b`` come from one distribution
    (``scipy.stats.mannwhitneyu``, exact for small samples); None with an empty side."""
    xa = [v for v in (num(x) for x in a) if v is not None]
    xb = [v for v in (num(x) for x in b) if v is not None]
    if not xa or not xb:
        return None
    from scipy import stats

    return float(stats.mannwhitneyu(xb, xa, alternative="two-sided").pvalue)


def union_seconds(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of ``(start, end)`` intervals (seconds): overlapping transfers
    count once. Bytes over this is the wall-clock rate of the transfers; bytes over the sum
    of durations (vLLM's NIXL "Throughput (MB/s)", vllm issue 48224) understates it by the
    mean number of transfers in flight. Raises ``ValueError`` for an interval ending
    before it starts."""
    total, end = 0.0, -math.inf
    for s, e in sorted(intervals):
        if e < s:
            raise ValueError(f"interval ends before it starts: ({s}, {e})")
        if s > end:
            total += e - s
            end = e
        elif e > end:
            total += e - end
            end = e
    return total


def paired_ratio_interval(
    a: list[float], b: list[float], confidence: float = 0.95
) -> tuple[float | None, float | None, float | None, str]:
    """Ratio B/A from paired repeats: ``a[i]`` and ``b[i]`` ran back to back (interleaved, one
    machine-load epoch per pair), so load drift cancels in ``d_i = log b_i - log a_i``.
    Returns ``(ratio, lo, hi, "paired")``: ``ratio = exp(mean d)`` (geometric mean of the per-pair
    ratios) and the Student-t interval of ``mean d``
    (``scipy.stats.ttest_1samp(d, 0).confidence_interval``), exponentiated (Kalibera and Jones,
    "Rigorous benchmarking in reasonable time", ISMM 2013: judge the paired differences).
    Pairs with a missing or non-positive value on either side are dropped; fewer than 2 pairs
    left: ``(ratio or None, None, None, "paired")``. Raises ``ValueError`` when ``a`` and ``b``
    differ in length (not paired)."""
    if len(a) != len(b):
        raise ValueError(f"paired values need equal lengths, got {len(a)} and {len(b)}")
    pairs = [(x, y) for x, y in ((num(p), num(q)) for p, q in zip(a, b)) if x and y and x > 0 and y > 0]
    d = [math.log(y / x) for x, y in pairs]
    ratio = math.exp(sum(d) / len(d)) if d else None
    if len(d) < 2:
        return ratio, None, None, "paired"
    if max(d) == min(d):  # no spread: the ratio is exact
        return ratio, ratio, ratio, "paired"
    from scipy import stats

    ci = stats.ttest_1samp(d, 0.0).confidence_interval(confidence)
    return ratio, math.exp(float(ci.low)), math.exp(float(ci.high)), "paired"


def b_over_a(
    a: list[float], b: list[float], confidence: float = 0.95, paired: bool = False
) -> tuple[float | None, float | None, float | None, str]:
    """B/A and its interval by the one rule the perf verdicts (:func:`pdsweep.judge.perf.judge_metric`)
    and compare's front lines (:func:`pdsweep.judge.pareto.front_changes`) share: ``(ratio, lo, hi,
    method)``. ``paired`` (``a[i]`` and ``b[i]`` ran interleaved, ABBA: ``bench.pair_builds``) with
    equal lengths: :func:`paired_ratio_interval` (``paired``: a paired t-test on the per-pair log
    ratios); else :func:`ratio_interval` ``auto`` (``welch``: Welch's t on the log values below 8
    repeats a side; ``bootstrap`` from 8), unequal lengths included."""
    if paired and len(a) == len(b):
        return paired_ratio_interval(a, b, confidence)
    return ratio_interval(a, b, confidence)


def detectable_slowdown(lo: float | None, hi: float | None, threshold: float) -> float | None:
    """The smallest slowdown factor an interval of this width judges a regression at
    ``threshold`` (a fraction): a ratio interval ``[lo, hi]`` has log half-width
    ``h = log(hi / lo) / 2``; centred on a slowdown ``s`` it clears ``1 + threshold`` once
    ``s >= (1 + threshold) * exp(h)``. A centred interval is the typical one, so a slowdown of
    exactly this size is caught about half the time; twice ``h`` above it, almost always.
    None without an interval (or a non-positive bound)."""
    if lo is None or hi is None or lo <= 0 or hi < lo:
        return None
    return (1 + threshold) * math.sqrt(hi / lo)
