"""Which P/D configuration to deploy: load points, their Pareto front and the best point under an SLO.

A *point* is one concurrency of one PD cell's load phase (``bench.concurrencies``, every repeat
of it: load.json ``runs``, :mod:`pdsweep.measure.repeats`). Its figures, each the mean over the
repeats with a Student-t interval that stays >= 0, taken on the log scale
(:func:`pdsweep.core.stats.positive_t_interval`; clipped at 0 and saying so when a repeat measured 0):

* ``tok_s_per_gpu``: vLLM's ``output_throughput`` (output tokens/s, ``vllm bench serve``) divided
  by the cell's ranks, prefill and decode counted (:attr:`pdsweep.plan.cell.Cell.num_ranks`: one
  GPU each on CUDA; on CPU the same count, so CPU fronts compare like with like);
* ``tok_s_per_user``: interactivity, ``1000 / TPOT p50`` (ms -> tokens/s), as InferenceX plots it;
* ``goodput_per_gpu``: vLLM's ``request_goodput`` (requests/s meeting ``bench.goodput``,
  ``vllm bench serve --goodput``) per rank, when the sweep set an SLO;
* latency percentiles ``ttft_p90`` ... ``e2el_p99`` (ms).

A point is *failed* (drawn, marked, never on the front, never recommended) when its own answers
under load were wrong, stale or missing (load_check.json at its concurrency), or its cell failed
the gate otherwise -- a transfer failure, a crash, an expected-to-fail drill
(:func:`pdsweep.judge.point_answers.point_failure`). A cell that answered wrong only at
concurrency 4 fails the gate, but its concurrency-1 point may be on the front.
The cell's ranks and identity come from plan.json, never from the results files.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pdsweep.core.errors import UserError
from pdsweep.core.stats import b_over_a, num, obj, positive_t_interval
from pdsweep.judge.facts import cell_from_dict, read_index
from pdsweep.judge.gate import GateResult
from pdsweep.judge.loadfigures import figure_problem, run_problems
from pdsweep.judge.perf import UNPAIRED_BUILDS, same_pair
from pdsweep.judge.point_answers import answers_at, point_failure
from pdsweep.sweepfile.slo import SLO_KEYS

CONFIDENCE = 0.95


@dataclass(frozen=True)
class Interval:
    """Mean over ``n`` repeats of a figure that cannot be negative and its two-sided 95 % Student-t
    interval, >= 0 (None below 2 repeats); ``scale``: how the interval was taken
    (:func:`pdsweep.core.stats.positive_t_interval`: ``log``, ``clipped`` at 0, ``linear``)."""

    mean: float
    lo: float | None
    hi: float | None
    n: int
    values: tuple[float, ...] = ()
    scale: str = ""

    @classmethod
    def of(cls, values: list[float]) -> Interval | None:
        mean, lo, hi, scale = positive_t_interval(values, CONFIDENCE)
        return None if mean is None else cls(mean, lo, hi, len(values), tuple(values), scale)

    def scaled(self, k: float) -> Interval:
        """Every figure times ``k`` > 0 (e.g. per GPU: ``1 / ranks``)."""
        lo, hi = (None, None) if self.lo is None or self.hi is None else (self.lo * k, self.hi * k)
        return Interval(self.mean * k, lo, hi, self.n, tuple(v * k for v in self.values), self.scale)

    def bracket(self) -> str:
        """`` [lo, hi]`` as the report and ``best`` print it, saying when ``lo`` was clipped at 0."""
        if self.lo is None:
            return ""
        return f" [{self.lo:.3g}, {self.hi:.3g}]" + (
            " (lower bound clipped at 0: a repeat measured 0)" if self.scale == "clipped" else ""
        )

    def show(self, unit: str) -> str:
        return f"{self.mean:.3g}{self.bracket()} {unit} (n={self.n})"


@dataclass(frozen=True)
class Point:
    """One concurrency of one PD cell (see the module docstring for the figures' units)."""

    cell_id: str
    model: str
    build: str
    config: str  # e.g. "p2d1 b128-128": what a user deploys
    concurrency: int
    ranks: int
    tok_s_per_gpu: Interval
    tok_s_per_user: float | None
    latency_ms: dict[str, float] = field(default_factory=dict)  # "ttft_p90" -> mean over repeats
    goodput_per_gpu: Interval | None = None
    failed: str | None = None  # why it is off the front (the gate's first reason for this point)
    answers: dict[str, int] | None = None  # its own answer check: load_check.json counts at this concurrency
    pairing: dict[str, Any] | None = None  # load.json ``pairing``: repeats interleaved with a partner cell's

    @property
    def label(self) -> str:
        return f"{self.cell_id} @ concurrency {self.concurrency}"


def points(run_dir: Path, result: GateResult) -> list[Point]:
    """Every load point of the run's PD cells (plan.json cells; cells that never ran give none)."""
    _, plan = read_index(run_dir)
    verdicts = {c.cell_id: c for c in result.cells}
    out: list[Point] = []
    for d in plan.get("cells") or []:
        cell = cell_from_dict(d)
        judged = verdicts.get(cell.id) if cell else None
        if cell is None or cell.kind != "pd" or judged is None:
            continue
        config = f"p{cell.prefill_tp}d{cell.decode_tp} b{cell.prefill_block_size}-{cell.decode_block_size}"
        for conc, runs in _runs_by_concurrency(judged.facts.load).items():
            tput = Interval.of([v for r in runs if (v := num(r.get("output_tok_s"))) is not None])
            if tput is None:
                continue
            lat = {k: v for k in SLO_KEYS if (v := _mean(runs, k)) is not None}
            tpot = lat.get("tpot_p50")
            good = Interval.of([v for r in runs if (v := num(r.get("goodput_req_s"))) is not None])
            out.append(
                Point(
                    cell.id, cell.model, cell.build, config, conc, cell.num_ranks,
                    tput.scaled(1 / cell.num_ranks), 1000 / tpot if tpot else None, lat,
                    good.scaled(1 / cell.num_ranks) if good else None,
                    point_failure(judged, conc) or _impossible(runs, f"{cell.id}/load.json: concurrency {conc}"),
                    answers_at(judged.facts.load_check, conc), obj(judged.facts.load).get("pairing"),
                )
            )  # fmt: skip
    return out


def _impossible(runs: list[dict[str, Any]], where: str) -> str | None:
    """The first impossible figure of a point's repeats (the gate's rule,
    :func:`pdsweep.judge.loadfigures.run_problems`), as a failure; None: every figure is possible."""
    bad = [p for i, r in enumerate(runs) for p in run_problems(r, f"{where} repeat {i}")]
    return f"FAIL: {bad[0]}" if bad else None


def _runs_by_concurrency(load: dict[str, Any]) -> dict[int, list[dict[str, Any]]]:
    by: dict[int, list[dict[str, Any]]] = {}
    for r in load.get("runs") or []:
        c = obj(r).get("concurrency")
        if isinstance(c, int) and not isinstance(c, bool):
            by.setdefault(c, []).append(r)
    return dict(sorted(by.items()))


def _mean(runs: list[dict[str, Any]], key: str) -> float | None:
    """The mean of latency ``key`` (``ttft_p90``, ms) over the repeats; None when a repeat lacks it or holds an
    impossible one (:func:`pdsweep.judge.loadfigures.figure_problem`, the gate's rule: a corrupt load.json's
    negative, NaN or inf TTFT; a point cannot meet an SLO on the other repeats or on such a figure)."""
    metric, _, pct = key.partition("_")
    vals = [obj(r.get(f"{metric}_ms")).get(pct) for r in runs]
    ok = [float(v) for v in vals if v is not None and figure_problem(v) is None]
    return sum(ok) / len(ok) if ok and len(ok) == len(vals) else None


def front(pts: list[Point], x: str = "tok_s_per_user") -> list[Point]:
    """The Pareto front of the points that did not fail: no other point has at least the
    throughput per GPU and at least ``x`` (``tok_s_per_user``, higher is better; or a latency
    key such as ``ttft_p90``, lower is better) with one of them strictly better. Sorted by ``x``."""

    def xval(p: Point) -> float | None:
        if x == "tok_s_per_user":
            return p.tok_s_per_user
        v = p.latency_ms.get(x)
        return None if v is None else -v

    ok = [((p.tok_s_per_gpu.mean, xv), p) for p in pts if not p.failed and (xv := xval(p)) is not None]
    keep = [p for a, p in ok if not any(b[0] >= a[0] and b[1] >= a[1] and b != a for b, _ in ok)]
    return sorted(keep, key=lambda p: xval(p) or 0.0)


@dataclass(frozen=True)
class Best:
    """:func:`best`'s answer: the ``choice`` (None: no point meets the SLO; then ``closest``),
    the ``runner_up`` (the best point of another configuration), and whether the two cannot be
    told apart (their intervals of the ranking figure overlap, or one has no interval)."""

    slo: dict[str, float]
    figure: str  # "goodput_per_gpu" or "tok_s_per_gpu"
    choice: Point | None
    runner_up: Point | None = None
    indistinct: bool = False
    closest: Point | None = None


def best(pts: list[Point], slo: dict[str, float], model: str | None = None) -> Best:
    """The configuration with the highest goodput per GPU (throughput per GPU when the run
    measured no goodput) among the points that did not fail and meet every SLO limit.
    The runner-up is the best point of a *different* configuration (cell). Raises ``UserError``
    when the run has no load point (for ``model``)."""
    pool = [p for p in pts if model is None or p.model == model]
    if not pool and pts:  # the run has load points, none of this model's
        raise UserError(f"--model {model}: no load point of it (allowed: {', '.join(sorted({p.model for p in pts}))})")
    if not pool:
        raise UserError(f"no load points{f' for model {model}' if model else ''}: the run measured no bench phase")
    figure = "goodput_per_gpu" if any(p.goodput_per_gpu for p in pool) else "tok_s_per_gpu"

    def rank(p: Point) -> Interval:
        return (p.goodput_per_gpu if figure == "goodput_per_gpu" else p.tok_s_per_gpu) or Interval(0.0, None, None, 0)

    meets = sorted(
        (p for p in pool if not p.failed and all(p.latency_ms.get(k, float("inf")) <= v for k, v in slo.items())),
        key=lambda p: rank(p).mean,
        reverse=True,
    )
    if not meets:
        ok = [p for p in pool if not p.failed] or pool
        closest = min(ok, key=lambda p: max(p.latency_ms.get(k, float("inf")) / v for k, v in slo.items()))
        return Best(slo, figure, None, closest=closest)
    choice = meets[0]
    runner = next((p for p in meets[1:] if p.cell_id != choice.cell_id), None)
    indistinct = False
    if runner is not None:
        a, b = rank(choice), rank(runner)
        indistinct = a.lo is None or b.hi is None or a.lo <= b.hi
    return Best(slo, figure, choice, runner, indistinct)


def describe(b: Best) -> list[str]:
    """:func:`best`'s answer as the lines ``pdsweep best`` prints."""
    unit = "req/s per GPU" if b.figure == "goodput_per_gpu" else "output tok/s per GPU"
    slo = ", ".join(f"{k} <= {v:g} ms" for k, v in b.slo.items())

    def line(tag: str, p: Point) -> str:
        fig = p.goodput_per_gpu if b.figure == "goodput_per_gpu" else p.tok_s_per_gpu
        lat = ", ".join(f"{k} {p.latency_ms[k]:.4g} ms" for k in b.slo if k in p.latency_ms)
        shown = fig.show(unit) if fig else "-"
        return f"{tag}: {p.config} ({p.build}) @ concurrency {p.concurrency}: {shown}; {lat}  [{p.cell_id}]"

    if b.choice is None:
        out = [f"no configuration meets the SLO ({slo})"]
        if b.closest is not None:
            out.append(line("closest", b.closest))
        return out
    out = [f"SLO {slo}", line("best", b.choice)]
    if b.runner_up is None:
        out.append("runner-up: none (no other configuration meets the SLO)")
    else:
        out.append(line("runner-up", b.runner_up))
        if b.indistinct:
            out.append(f"the two cannot be told apart: their 95 % intervals of {unit} overlap (or one has n < 2)")
    return out


TESTS = {
    "paired": "paired t-test on per-pair log ratios (repeats interleaved, ABBA)",
    "welch": "Welch t-test on log values (repeats not paired)",
    "bootstrap": "bootstrap of the ratio of means (repeats not paired)",
}


def front_changes(a: list[Point], b: list[Point], alpha: float = 0.05, same_run: bool = False) -> list[str]:
    """Where the front moved from run (or build) A to B, per model: each point on either front,
    matched by model, P/D configuration and concurrency, whose tok/s per GPU differs beyond noise,
    and points that joined or left the front. Empty: no front moved.

    Beyond noise: the ``1 - alpha`` interval of B/A excludes 1, by the perf verdicts' own rule
    (:func:`pdsweep.core.stats.b_over_a`): the paired t-test on per-pair log ratios when the two
    points' repeats ran interleaved (both load.json ``pairing`` one pair, :func:`pdsweep.judge.perf.same_pair`;
    ``bench.pair_builds``), else Welch's t-test on the log values (bootstrap from 8 repeats a side);
    needs n >= 2 on both sides. Each line names its test (:data:`TESTS`). ``same_run``: A and B are two
    builds of one run; measured unpaired, a move is shown but not claimed, as the perf verdicts say
    (:data:`pdsweep.judge.perf.UNPAIRED_BUILDS`)."""
    key = lambda p: (p.model, p.config, p.concurrency)  # noqa: E731
    pa, pb = {key(p): p for p in a}, {key(p): p for p in b}
    fa = {key(p) for m in {p.model for p in a} for p in front([q for q in a if q.model == m])}
    fb = {key(p) for m in {p.model for p in b} for p in front([q for q in b if q.model == m])}
    out = []
    for k in sorted(fa | fb):
        x, y = pa.get(k), pb.get(k)
        where = f"{k[0]}: {k[1]} @ concurrency {k[2]}"
        if x is None or y is None or x.failed or y.failed:
            side, pt = ("B", y) if k in fa else ("A", x)
            why = "not measured" if pt is None else "failed" if pt.failed else "dominated"
            out.append(f"{where}: {'left' if k in fa else 'joined'} the front ({side}: {why})")
            continue
        va, vb = x.tok_s_per_gpu.values, y.tok_s_per_gpu.values
        ratio, lo, hi, method = b_over_a(list(va), list(vb), 1 - alpha, same_pair(x.pairing, y.pairing))
        if ratio is None or lo is None or hi is None or lo <= 1 <= hi:
            continue
        out.append(
            f"{where}: {x.tok_s_per_gpu.mean:.3g} -> {y.tok_s_per_gpu.mean:.3g} tok/s per GPU "
            f"(B/A {ratio:.2f}x [{lo:.2f}, {hi:.2f}], {TESTS[method]}, n={len(va)}/{len(vb)})"
            + ("" if (k in fa) == (k in fb) else f"; {'left' if k in fa else 'joined'} the front")
            + (f"; {UNPAIRED_BUILDS}" if same_run and method != "paired" else "")
        )
    return out
