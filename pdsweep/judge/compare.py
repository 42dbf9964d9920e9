"""Compare two runs cell by cell. **A = baseline, B = candidate**; ratios are B/A.

Cells line up by ``compare_key`` (the planned cell's id without the build; never cell.json's own), so a fixed and an
unfixed run of the same sweep match; within one key, identical ids pair first. Each pair
gets a verdict and an asv-style mark:

=================  ====  =======================================================
``regression``     ``-``  B worse: passed in A and fails in B, an accuracy task
                          significantly lower (one-sided two-proportion test at
                          ``alpha``), consistency pass -> fail, or more failed
                          transfers / notifications than A
``improvement``    ``+``  the mirror image, with nothing worse
``same``           `` ``  neither
``not-comparable`` ``x``  ``config_hash`` differs (something but the build changed)
``only-in-A``      ``<``  no match in B (or rejected in B)
``only-in-B``      ``>``  no match in A (or rejected in A)
=================  ====  =======================================================

Performance is judged per metric from the load phase's repeats by
:mod:`pdsweep.judge.perf` (``regression`` / ``improvement`` / ``same`` / ``noisy``, with the
ratio B/A and its interval): a perf regression makes the cell a ``regression``; ``noisy``
metrics are counted (``noisy_metrics``) and fail the comparison only with
``gate.perf_noisy_fails``. The single-run GB/s, TTFT and TPOT ratios of transfer.json are
still shown. :func:`compare_runs` gates both runs with :func:`pdsweep.judge.gate.gate_run`.

Fail closed: an ``only-in-A`` cell (B lost it, or rejected it) fails the comparison like a
regression unless ``allow_missing``; two runs of different sweeps (run.json
``sweep_name``) are refused unless ``allow_other_sweep`` (then the result says so).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pdsweep.core.errors import GateFailed, UserError
from pdsweep.core.stats import two_proportion_p
from pdsweep.judge.facts import CellFacts, TaskScore
from pdsweep.judge.flaky import FLAKY
from pdsweep.judge.gate import NOT_RUNNABLE, PASS, SKIPPED, CellResult, GateResult, gate_run
from pdsweep.judge.perf import NOISY, PerfDelta, perf_deltas
from pdsweep.results import layout
from pdsweep.sweepfile.gatespec import GateSpec

REGRESSION, IMPROVEMENT, SAME = "regression", "improvement", "same"
NOT_COMPARABLE, ONLY_A, ONLY_B = "not-comparable", "only-in-A", "only-in-B"
MARKS = {REGRESSION: "-", IMPROVEMENT: "+", SAME: " ", NOT_COMPARABLE: "x", ONLY_A: "<", ONLY_B: ">"}
DIRECTION = "A = baseline, B = candidate; ratios are B/A"


@dataclass(frozen=True)
class TaskDelta:
    """One accuracy task in A and B. ``p_lower``/``p_higher``: one-sided p-values that
    B is lower/higher than A (None when a value or sample count is missing)."""

    task: str
    a: float | None
    b: float | None
    p_lower: float | None = None
    p_higher: float | None = None

    @property
    def delta(self) -> float | None:
        return None if self.a is None or self.b is None else self.b - self.a

    def to_dict(self) -> dict[str, Any]:
        return {
            "task": self.task,
            "a": self.a,
            "b": self.b,
            "delta": self.delta,
            "p_lower": self.p_lower,
            "p_higher": self.p_higher,
        }


@dataclass(frozen=True)
class CellComparison:
    """One compare key: A's and B's gate results (None where absent), the verdict and why."""

    key: str
    verdict: str
    a: CellResult | None
    b: CellResult | None
    tasks: tuple[TaskDelta, ...] = ()
    gbps_ratio: float | None = None
    ttft_ratio: float | None = None
    tpot_ratio: float | None = None
    reasons: tuple[str, ...] = ()
    perf: tuple[PerfDelta, ...] = ()  # per-metric performance verdicts (pdsweep.judge.perf)

    @property
    def noisy(self) -> list[PerfDelta]:
        return [d for d in self.perf if d.verdict == NOISY]

    @property
    def label(self) -> str:
        """The key, plus the builds compared (``A-build -> B-build``) so that fixed and
        unfixed rows of one key are told apart."""
        ids = [x.cell_id for x in (self.a, self.b) if x is not None]
        builds = [i[len(self.key) + 1 :] if i.startswith(self.key + ".") else i.rsplit(".", 1)[-1] for i in ids]
        shown = " -> ".join(dict.fromkeys(builds)) if builds else ""
        return f"{self.key} ({shown})" if shown else self.key

    @property
    def mark(self) -> str:
        return MARKS[self.verdict]

    def to_dict(self) -> dict[str, Any]:
        def side(r: CellResult | None) -> dict[str, Any] | None:
            return (
                None
                if r is None
                else {
                    "cell_id": r.cell_id,
                    "verdict": r.verdict,
                    "status": r.facts.status,
                    "consistency": r.facts.consistency,
                    "config_hash": r.facts.config_hash,
                    "failed_transfers": r.facts.total("failed_transfers"),
                    "failed_notifications": r.facts.total("failed_notifications"),
                }
            )

        return {
            "key": self.key,
            "verdict": self.verdict,
            "mark": self.mark,
            "a": side(self.a),
            "b": side(self.b),
            "tasks": [t.to_dict() for t in self.tasks],
            "gbps_ratio": self.gbps_ratio,
            "ttft_ratio": self.ttft_ratio,
            "tpot_ratio": self.tpot_ratio,
            "reasons": list(self.reasons),
            "perf": [d.to_dict() for d in self.perf],
        }


@dataclass(frozen=True)
class CompareResult:
    """A (baseline) against B (candidate): one :class:`CellComparison` per compare key,
    in A's order then B's new keys."""

    a: Path
    b: Path
    a_name: str
    b_name: str
    alpha: float
    cells: tuple[CellComparison, ...]
    allow_missing: bool = False  # only-in-A cells do not fail the comparison
    sweeps: tuple[str | None, str | None] = (None, None)  # run.json sweep_name of A and B
    problems: tuple[str, ...] = ()  # an empty or unrunnable side, nothing paired: never NO REGRESSION
    noisy_fails: bool = False  # gate.perf_noisy_fails: a noisy metric fails the comparison
    notes: tuple[str, ...] = ()  # what was left out and why (never a failure)

    @property
    def noisy(self) -> list[CellComparison]:
        """Cells with a ``noisy`` performance metric (undecided at the threshold)."""
        return [c for c in self.cells if c.noisy]

    @property
    def noisy_metrics(self) -> int:
        return sum(len(c.noisy) for c in self.cells)

    @property
    def other_sweep(self) -> bool:
        """A and B are runs of different (or unnamed) sweeps (compared on request only)."""
        return self.sweeps[0] is None or self.sweeps[0] != self.sweeps[1]

    def by_verdict(self, verdict: str) -> list[CellComparison]:
        return [c for c in self.cells if c.verdict == verdict]

    @property
    def regressions(self) -> list[CellComparison]:
        return self.by_verdict(REGRESSION)

    @property
    def missing(self) -> list[CellComparison]:
        """Cells of A that B lacks (or rejected): failures unless ``allow_missing``."""
        return [] if self.allow_missing else self.by_verdict(ONLY_A)

    @property
    def failures(self) -> list[CellComparison]:
        """Regressions, then the missing cells that count as failures (and the noisy ones
        with ``noisy_fails``)."""
        noisy = [c for c in self.noisy if c.verdict != REGRESSION] if self.noisy_fails else []
        return self.regressions + self.missing + noisy

    @property
    def regressed(self) -> bool:
        """True when any cell regressed or went missing from B, or a side had nothing to
        compare (:attr:`problems`; the CLI exits 1)."""
        return bool(self.failures or self.problems)

    def cell(self, key: str) -> CellComparison:
        """The comparison of compare key ``key``; raises ``KeyError``."""
        for c in self.cells:
            if c.key == key:
                return c
        raise KeyError(key)

    def raise_for_verdict(self) -> None:
        """Raise :class:`~pdsweep.core.errors.GateFailed` listing the regressions, if any."""
        if self.regressed:
            lines = [f"- {p}" for p in self.problems]
            lines += [f"- {c.key}: {'; '.join(c.reasons)}" for c in self.regressions]
            lines += [
                f"- {c.key}: only in A ({'; '.join(c.reasons)}); pass --allow-missing if intended" for c in self.missing
            ]
            if self.noisy_fails:
                lines += [f"- {c.key}: noisy: {'; '.join(d.describe() for d in c.noisy)}" for c in self.noisy]
            raise GateFailed(
                f"compare: {len(self.regressions)} regression(s), {len(self.missing)} cell(s) "
                f"missing in {self.b_name} against {self.a_name}"
                + (f", {self.noisy_metrics} noisy metric(s) (gate.perf_noisy_fails)" if self.noisy_fails else "")
                + ":\n"
                + "\n".join(lines)
            )

    def to_dict(self) -> dict[str, Any]:
        counts = {v: len(self.by_verdict(v)) for v in MARKS}
        return {
            "a": str(self.a),
            "b": str(self.b),
            "a_name": self.a_name,
            "b_name": self.b_name,
            "direction": DIRECTION,
            "alpha": self.alpha,
            "counts": counts,
            "noisy_cells": len(self.noisy),
            "noisy_metrics": self.noisy_metrics,
            "noisy_fails": self.noisy_fails,
            "regressed": self.regressed,
            "allow_missing": self.allow_missing,
            "problems": list(self.problems),
            "sweeps": list(self.sweeps),
            "other_sweep": self.other_sweep,
            "cells": [c.to_dict() for c in self.cells],
        }


# ---------------------------------------------------------------- judging one pair
def _ratio(b: float | None, a: float | None) -> float | None:
    return None if a is None or b is None or a <= 0 else b / a


def task_deltas(a: tuple[TaskScore, ...], b: tuple[TaskScore, ...]) -> list[TaskDelta]:
    """Per task present in A or B: values and one-sided two-proportion p-values."""
    ta, tb = {t.task: t for t in a}, {t.task: t for t in b}
    out = []
    for name in dict.fromkeys([*ta, *tb]):
        x, y = ta.get(name), tb.get(name)
        lower = higher = None
        if x and y and x.value is not None and y.value is not None and x.n and y.n and x.n > 0 and y.n > 0:
            ka, kb = round(x.value * x.n), round(y.value * y.n)
            if 0 <= ka <= x.n and 0 <= kb <= y.n:
                lower, higher = two_proportion_p(kb, y.n, ka, x.n), two_proportion_p(ka, x.n, kb, y.n)
        out.append(TaskDelta(name, x.value if x else None, y.value if y else None, lower, higher))
    return out


def _counter_changes(a: CellResult, b: CellResult) -> tuple[list[str], list[str]]:
    worse, better = [], []
    for key in ("failed_transfers", "failed_notifications"):
        fa, fb = a.facts.total(key), b.facts.total(key)
        if fb is not None and fb > (fa or 0):
            worse.append(f"new {key.replace('_', ' ')}: {'null' if fa is None else f'{fa:g}'} -> {fb:g}")
        elif fa and fb == 0:
            better.append(f"no more {key.replace('_', ' ')}: {fa:g} -> 0")
    return worse, better


def _consistency(f: CellFacts) -> str:
    """A side's consistency verdict, or why it has none (no consistency.json: e.g. the cell
    failed before its consistency phase), never ``None``."""
    if f.consistency:
        return f.consistency
    failed = f.status not in (None, "ok") and f.phase
    return "— (not measured" + (f": {f.status} in phase {f.phase}" if failed else "") + ")"


def judge_pair(
    key: str, a: CellResult, b: CellResult, alpha: float, gate: GateSpec | None = None, same_run: bool = False
) -> CellComparison:
    """Compare one cell of A with its match in B (see the module doc for the rules);
    ``gate``: the perf thresholds (None: defaults); ``same_run``: A and B are two builds of one
    run (unpaired perf then claims nothing, :mod:`pdsweep.judge.perf`)."""
    if {a.verdict, b.verdict} & {SKIPPED, NOT_RUNNABLE}:  # not run on one side: nothing to compare
        if a.verdict == b.verdict:
            return CellComparison(
                key, SAME, a, b, reasons=("rejected in both" if a.verdict == SKIPPED else "not runnable here in both",)
            )
        skipped = a if a.verdict in (SKIPPED, NOT_RUNNABLE) else b
        side = ONLY_B if skipped is a else ONLY_A
        return CellComparison(
            key, side, a, b, reasons=(f"rejected in {'A' if skipped is a else 'B'}: {skipped.message}",)
        )
    fa, fb = a.facts, b.facts
    ratios = dict(
        gbps_ratio=_ratio(fb.total("gbps_xfer"), fa.total("gbps_xfer")),
        ttft_ratio=_ratio(fb.total("ttft_mean_s"), fa.total("ttft_mean_s")),
        tpot_ratio=_ratio(fb.total("tpot_mean_s"), fa.total("tpot_mean_s")),
    )
    tasks = tuple(task_deltas(fa.tasks, fb.tasks))
    perf = tuple(perf_deltas(fa.load, fb.load, gate or GateSpec(), same_run))
    if fa.config_hash and fb.config_hash and fa.config_hash != fb.config_hash:
        return CellComparison(
            key,
            NOT_COMPARABLE,
            a,
            b,
            tasks,
            **ratios,
            reasons=(f"config_hash differs: {fa.config_hash} -> {fb.config_hash}",),
            perf=perf,
        )
    worse, better = _counter_changes(a, b)
    if a.checks_passed and not b.checks_passed:
        worse.insert(0, f"was passing, now {b.verdict}: {b.reasons[0] if b.reasons else 'no reason'}")
    elif b.checks_passed and not a.checks_passed:
        better.insert(0, f"was {a.verdict}, now passes")
    if b.verdict == FLAKY and a.verdict != FLAKY:  # pdsweep.judge.flaky: passed only after a redeploy
        worse.append(f"now FLAKY: {'; '.join(b.reasons)}")
    elif a.verdict == FLAKY and b.verdict == PASS:
        better.append("no longer FLAKY: passed without a redeploy")
    for t in tasks:
        if t.a is not None and t.b is None:
            worse.append(f"{t.task}: no score in B (A: {t.a:.3f})")
        elif t.p_lower is not None and t.p_lower < alpha:
            worse.append(f"{t.task}: {t.a:.3f} -> {t.b:.3f}, significantly lower (p={t.p_lower:.2g} < {alpha})")
        elif t.p_higher is not None and t.p_higher < alpha:
            better.append(f"{t.task}: {t.a:.3f} -> {t.b:.3f}, significantly higher (p={t.p_higher:.2g} < {alpha})")
        elif t.a is not None and t.b is not None and t.b < t.a and t.p_lower is None:
            worse.append(f"{t.task}: {t.a:.3f} -> {t.b:.3f}, lower and untestable (sample count missing)")
    if a.kind != "ref" and (fa.consistency == "pass") != (fb.consistency == "pass"):
        (worse if fa.consistency == "pass" else better).append(f"consistency {_consistency(fa)} -> {_consistency(fb)}")
    worse += [f"perf {d.describe()}" for d in perf if d.verdict == REGRESSION]
    better += [f"perf {d.describe()}" for d in perf if d.verdict == IMPROVEMENT]
    verdict = REGRESSION if worse else IMPROVEMENT if better else SAME
    return CellComparison(key, verdict, a, b, tasks, **ratios, reasons=tuple(worse or better), perf=perf)


def _key(c: CellResult) -> str:
    return c.facts.compare_key or c.cell_id


def compare_cells(
    a: list[CellResult], b: list[CellResult], alpha: float, gate: GateSpec | None = None, same_run: bool = False
) -> list[CellComparison]:
    """Pair A's and B's cells by compare key (identical ids first, then in order) and judge each
    pair; ``same_run``: A and B come from one run (:func:`judge_pair`)."""
    out = []
    for key in dict.fromkeys([*map(_key, a), *map(_key, b)]):
        xs, ys = [c for c in a if _key(c) == key], [c for c in b if _key(c) == key]
        same = [(x, y) for x in xs for y in ys if x.cell_id == y.cell_id]
        xs = [x for x in xs if all(x is not p for p, _ in same)]
        ys = [y for y in ys if all(y is not q for _, q in same)]
        for x, y in same + list(zip(xs, ys)):
            out.append(judge_pair(key, x, y, alpha, gate, same_run))
        out += [CellComparison(key, ONLY_A, x, None, reasons=("no match in B",)) for x in xs[len(ys) :]]
        out += [CellComparison(key, ONLY_B, None, y, reasons=("no match in A",)) for y in ys[len(xs) :]]
    return out


def compare_results(
    a: GateResult,
    b: GateResult,
    alpha: float | None = None,
    allow_missing: bool = False,
    sweeps: tuple[str | None, str | None] = (None, None),
    notes: tuple[str, ...] = (),
) -> CompareResult:
    """Compare two gated runs (``alpha`` default: B's gate alpha); ``notes`` go to the result.
    Two sides from one run directory (two builds of it) judge perf as :func:`judge_pair` says."""
    alpha = b.gate.alpha if alpha is None else alpha
    same_run = Path(a.run_dir).resolve() == Path(b.run_dir).resolve()
    cells = tuple(compare_cells(list(a.cells), list(b.cells), alpha, b.gate, same_run))
    problems = [f"{side} {p}" for side, r in (("A", a), ("B", b)) for p in r.problems]
    for side, r in (("A", a), ("B", b)):
        if not any(c.verdict != SKIPPED for c in r.cells):
            problems.append(f"{side} ({r.run_dir}) has no cell that was meant to run: nothing to compare")
    if not problems and not any(c.a is not None and c.b is not None for c in cells):
        problems.append(f"no cell of A ({a.run_dir}) has a counterpart in B ({b.run_dir}): nothing was compared")
    return CompareResult(
        a.run_dir,
        b.run_dir,
        a.run_name,
        b.run_name,
        alpha,
        cells,
        allow_missing,
        sweeps,
        tuple(problems),
        b.gate.perf_noisy_fails,
        notes,
    )


def only_build(result: GateResult, build: str | None) -> GateResult:
    """``result`` with only the PD cells of ``build`` (cell.json ``build.name``; None: all)
    and every reference cell: references run on the default build whatever the PD cell's
    build, so each side keeps its own (``compare RUN RUN --a-build fixed --b-build unfixed``
    pairs each reference with itself). Raises ``UserError`` when no PD cell has that build,
    naming the builds the run has."""
    if build is None:
        return result
    cells = tuple(c for c in result.cells if c.facts.build == build or c.kind == "ref")
    if not any(c.kind != "ref" and c.facts.build == build for c in cells):
        have = sorted({c.facts.build for c in result.cells if c.facts.build})
        raise UserError(
            f"{result.run_dir}: no cell of build {build!r} (builds in this run: {', '.join(have) or 'none'})"
        )
    return dataclasses.replace(result, cells=cells)


def sweep_name(run_dir: Path) -> str | None:
    """run.json ``sweep_name`` of a run (None when absent or not a string)."""
    name = (layout.read_json_or_none(Path(run_dir) / layout.RUN_FILE) or {}).get("sweep_name")
    return name if isinstance(name, str) and name else None


def compare_runs(
    a: Path,
    b: Path,
    gate: GateSpec | None = None,
    allow_missing: bool = False,
    allow_other_sweep: bool = False,
    a_build: str | None = None,
    b_build: str | None = None,
) -> CompareResult:
    """Gate runs ``a`` (baseline) and ``b`` (candidate) and compare them cell by cell;
    ``a_build`` / ``b_build`` keep only that build's cells on each side, so that one run
    holding both builds compares fixed (A) against unfixed (B): ``pdsweep compare RUN RUN
    --a-build fixed --b-build unfixed`` (its reference cells, the same on both sides, are
    left out and counted in ``notes``). Raises ``UserError`` when either has no readable
    run.json, a named build has no cell, or they are runs of different sweeps (run.json
    ``sweep_name``; unnamed counts as different) and ``allow_other_sweep`` is not set."""
    ra, rb = gate_run(Path(a), gate), gate_run(Path(b), gate)  # gate None: each run's own settings
    sweeps = (sweep_name(a), sweep_name(b))
    if (sweeps[0] is None or sweeps[0] != sweeps[1]) and not allow_other_sweep:
        raise UserError(
            f"compare: {a} is a run of sweep {sweeps[0] or '(unnamed)'} and {b} of sweep "
            f"{sweeps[1] or '(unnamed)'} (run.json sweep_name): cells would not line up; pass "
            "--allow-other-sweep to compare them anyway"
        )
    fa, fb = only_build(ra, a_build), only_build(rb, b_build)
    notes: tuple[str, ...] = ()
    if Path(a).resolve() == Path(b).resolve() and a_build != b_build:
        # one run, two builds: its reference cells are on both sides, each would be compared with itself
        refs = sum(c.kind == "ref" for c in fa.cells)
        fa, fb = (dataclasses.replace(r, cells=tuple(c for c in r.cells if c.kind != "ref")) for r in (fa, fb))
        if refs:
            notes = (
                f"{refs} reference cell(s) not compared: A and B are one run, so each is the same cell on both sides",
            )
    return compare_results(fa, fb, gate.alpha if gate else None, allow_missing, sweeps, notes)
