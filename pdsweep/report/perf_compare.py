"""Rendering of the performance verdicts of a comparison (:mod:`pdsweep.judge.perf`): the
markdown table (a section of compare.md) and a JUnit file with one testcase per cell and
metric (``regression`` a failure, ``noisy`` a skip -- or a failure with
``gate.perf_noisy_fails`` -- so CI counts it)."""

from __future__ import annotations

import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path

from pdsweep.judge.compare import CompareResult
from pdsweep.judge.perf import NOISY, PERF_VERDICTS, REGRESSION
from pdsweep.results import layout

COMPARE_JUNIT = "compare-junit.xml"
PERF_COLUMNS = (
    "cell",
    "metric",
    "A",
    "B",
    "B/A",
    "interval",
    "method",
    "threshold",
    "n A/B",
    "p (MWU)",
    "verdict",
    "detects",
)


def _v(x: float | None, fmt: str = ".4g") -> str:
    return "—" if x is None else format(x, fmt)


def perf_rows(result: CompareResult) -> list[tuple[str, ...]]:
    """One row per judged metric of every compared cell, in :data:`PERF_COLUMNS` order."""
    return [
        (
            c.label,
            d.name,
            _v(d.a),
            _v(d.b),
            "—" if d.ratio is None else f"{d.ratio:.3f}x",
            "—" if d.lo is None else f"[{d.lo:.3f}, {d.hi:.3f}]",
            d.method or "—",
            f"{d.threshold:.0%}",
            f"{d.n_a}/{d.n_b}",
            _v(d.p_mw, ".2g"),
            f"**{d.verdict}**" if d.verdict in (REGRESSION, NOISY) else d.verdict,
            "—" if d.detectable is None else f">= {d.detectable:.2f}x",
        )
        for c in result.cells
        for d in c.perf
    ]


def perf_counts(result: CompareResult) -> dict[str, int]:
    return {v: sum(d.verdict == v for c in result.cells for d in c.perf) for v in PERF_VERDICTS}


def perf_headline(result: CompareResult) -> str:
    """One loud line: metric verdict counts and whether ``noisy`` fails (``gate.perf_noisy_fails``);
    when every judged metric is noisy (and noisy does not fail), perf is left out of the headline,
    saying so: no counts that read as a verdict."""
    n = perf_counts(result)
    if not any(n.values()):
        return "performance: no load repeats to judge"
    if n[NOISY] == sum(n.values()) and not result.noisy_fails:
        return (
            f"performance: left out: all {n[NOISY]} judged metric(s) are noisy (undecided at their thresholds, "
            "no verdict at this run's noise; the table below and the smallest detectable slowdown say why)"
        )
    fails = "fails the comparison" if result.noisy_fails else "does not fail it (gate.perf_noisy_fails: false)"
    return (
        f"performance: {n[REGRESSION]} regression, {n['improvement']} improvement, {n['same']} same, "
        f"{n[NOISY]} noisy metric(s) -- noisy is undecided at the threshold and {fails}"
    )


def pairing_line(result: CompareResult) -> str | None:
    """Which compared cells were measured paired (both load.json with one ``pairing.id``: their
    load repeats interleaved in ABBA order, :mod:`pdsweep.measure.paired`), e.g. ``measured
    paired (load repeats interleaved, ABBA; paired t interval): 1 of 2 cells with load repeats:
    <label>; unpaired: <label>``; None when none was."""
    judged = [c for c in result.cells if c.perf]
    paired = [c.label for c in judged if any(d.method == "paired" for d in c.perf)]
    if not paired:
        return None
    alone = [c.label for c in judged if c.label not in paired]
    return (
        f"measured paired (load repeats interleaved, ABBA; paired t interval): {len(paired)} of {len(judged)} "
        f"cells with load repeats: {', '.join(paired)}" + (f"; unpaired: {', '.join(alone)}" if alone else "")
    )


def perf_teeth(result: CompareResult) -> str:
    """Per judged metric, the smallest slowdown this comparison could have called a regression
    (:attr:`pdsweep.judge.perf.PerfDelta.detectable`; the largest over cells: detectable in every
    one), one line, naming the interval methods (``paired`` when the repeats were interleaved);
    metrics without an interval are listed as such."""
    worst: dict[str, float | None] = {}
    methods: set[str] = set()
    for c in result.cells:
        for d in c.perf:
            prev = worst.get(d.name, 0.0)
            worst[d.name] = None if d.detectable is None or prev is None else max(prev, d.detectable)
            methods |= {d.method} if d.method else set()
    if not worst:
        return "smallest detectable slowdown: no load repeats to judge"
    parts = [f"{k} {'no interval' if v is None else f'>= {v:.2f}x'}" for k, v in sorted(worst.items())]
    how = f"; {'/'.join(sorted(methods))} intervals" if methods else ""
    return f"smallest detectable slowdown (this run's noise{how}): " + ", ".join(parts)


PERF_LEGEND = (
    "B/A with its confidence interval (the method column says which). Regression / improvement: the whole "
    "interval beyond the metric's threshold; same: the whole interval within it; noisy: it straddles a bound. "
    "Latencies are worse higher, rates worse lower. "
    "Detects: the smallest slowdown an interval this wide calls a regression. p (MWU): two-sided Mann-Whitney "
    "U test over the repeats, null hypothesis: A's and B's values come from one distribution; shown, not judged."
)
# the interval each method column value stands for (pdsweep.judge.perf.judge_metric)
METHODS = {
    "paired": "A and B repeats interleaved (bench.pair_builds): t interval of the per-pair log ratios",
    "welch": "repeats not paired, fewer than 8 a side: Welch t interval of the log means",
    "bootstrap": "repeats not paired, 8 or more a side: bootstrap interval of the ratio of means",
    "": "no interval (metric missing in B)",
}


def perf_methods(result: CompareResult) -> str:
    """The interval methods the rows of :func:`perf_rows` use, each with its row count and meaning
    (:data:`METHODS`), e.g. ``Method here: welch (5 of 5 rows: repeats not paired, ...)``."""
    n = Counter(d.method for c in result.cells for d in c.perf)
    total = sum(n.values())
    used = [f"{m or '—'} ({k} of {total} rows: {METHODS.get(m, 'unknown method')})" for m, k in n.most_common()]
    return "Method here: " + "; ".join(used) + "." if used else ""


def perf_legend(result: CompareResult) -> str:
    """:data:`PERF_LEGEND` followed by :func:`perf_methods`: the legend of this comparison's table."""
    return " ".join(x for x in (PERF_LEGEND, perf_methods(result)) if x)


def write_compare_junit(result: CompareResult, path: Path) -> Path:
    """JUnit XML of the performance verdicts: ``<testcase classname="pdsweep.compare.<cell>"
    name="<series> <metric>">``; returns ``path``."""
    cases = [(c, d) for c in result.cells for d in c.perf]
    n = perf_counts(result)
    failures = n[REGRESSION] + (n[NOISY] if result.noisy_fails else 0)
    suite = ET.Element(
        "testsuite",
        name=f"pdsweep.compare.{result.b_name}",
        tests=str(len(cases)),
        failures=str(failures),
        errors="0",
        skipped=str(0 if result.noisy_fails else n[NOISY]),
    )
    for c, d in cases:
        case = ET.SubElement(suite, "testcase", classname=f"pdsweep.compare.{c.key}", name=d.name)
        if d.verdict == REGRESSION or (d.verdict == NOISY and result.noisy_fails):
            ET.SubElement(case, "failure", message=d.describe(), type=d.verdict)
        elif d.verdict == NOISY:
            ET.SubElement(case, "skipped", message=d.describe())
    root = ET.Element("testsuites")
    root.append(suite)
    ET.indent(root)
    return layout.write_text(
        path, '<?xml version="1.0" encoding="utf-8"?>\n' + ET.tostring(root, encoding="unicode") + "\n"
    )
