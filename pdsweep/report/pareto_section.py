"""The report's "Which P/D configuration" section (:mod:`pdsweep.judge.pareto`): per model, the
front plot (``plots/front_<model>.png``: output tok/s per GPU against tok/s per user, every load
point coloured by its P/D pair, failed points marked x, one front line per build), the table of the
front's points, and the recommendation for each SLO of the sweep's ``bench.slos``."""

from __future__ import annotations

import html
import re
from dataclasses import dataclass
from pathlib import Path

from matplotlib.figure import Figure
from matplotlib.lines import Line2D

from pdsweep.core.errors import UserError
from pdsweep.core.stats import obj
from pdsweep.judge.facts import read_index
from pdsweep.judge.gate import GateResult
from pdsweep.judge.pareto import Point, best, describe, front, points
from pdsweep.report.render import md_table
from pdsweep.sweepfile.slo import parse_slo

FRONT_COLUMNS = (
    "model",
    "build",
    "P/D",
    "concurrency",
    "tok/s per GPU (95 % CI)",
    "tok/s per user",
    "TTFT p90 ms",
    "answers right",
    "cell",
)
FRONT_NOTE = (
    "One point per PD cell and load concurrency (vllm bench serve, mean over the load repeats): output "
    "tokens/s per GPU (the cell's prefill and decode ranks counted) against tokens/s per user (1000 / TPOT p50). "
    "The 95 % intervals are Student-t intervals taken on the log scale, so they stay above 0 (clipped at 0, "
    "and saying so, where a repeat measured 0). "
    "The front holds the points no other point beats on both; a point whose own answers under load were wrong "
    "or stale (load_check.json at its concurrency), or whose cell failed otherwise (a transfer failure, a crash, "
    "an expected-to-fail drill), is drawn as x and is never on it."
)
MARKERS = "os^Dv<>P*h"


@dataclass(frozen=True)
class FrontSection:
    """The section's parts: ``plots`` (name -> PNG), the front table's ``rows``, the SLO ``recs``."""

    plots: dict[str, Path]
    rows: list[tuple[str, ...]]
    recs: list[str]

    def markdown(self) -> str:
        if not self.rows:
            return ""
        lines = ["", "## Which P/D configuration", "", FRONT_NOTE, "", md_table(FRONT_COLUMNS, self.rows), ""]
        return "\n".join(lines + (["```", *self.recs, "```", ""] if self.recs else []))

    def html(self, table: str) -> str:
        if not self.rows:
            return ""
        recs = f"<pre>{html.escape(chr(10).join(self.recs))}</pre>" if self.recs else ""
        return f"<h2>Which P/D configuration</h2><p>{html.escape(FRONT_NOTE)}</p>{table}{recs}"


def front_section(run_dir: Path, result: GateResult, pdir: Path) -> FrontSection:
    """Plots, front table and recommendations of the run (all empty without load points)."""
    pts = pareto_points(run_dir, result)
    return FrontSection(plot_fronts(pts, pdir), front_rows(pts), recommendations(run_dir, pts) if pts else [])


def pareto_points(run_dir: Path, result: GateResult) -> list[Point]:
    """The run's load points; none for a run without a readable plan.json."""
    try:
        return points(run_dir, result)
    except UserError:
        return []


def front_rows(pts: list[Point]) -> list[tuple[str, ...]]:
    """Rows in :data:`FRONT_COLUMNS` order: each model's and build's front, best throughput first."""
    rows: list[tuple[str, ...]] = []
    for (model, build), group in sorted(_groups(pts).items()):
        for p in sorted(front(group), key=lambda p: -p.tok_s_per_gpu.mean):
            t = p.tok_s_per_gpu
            rows.append(
                (model, build, p.config, str(p.concurrency), f"{t.mean:.3g}{t.bracket()}", _g(p.tok_s_per_user),
                 _g(p.latency_ms.get("ttft_p90")), _answers(p.answers), p.cell_id)
            )  # fmt: skip
    return rows


def _answers(a: dict[str, int] | None) -> str:
    """A point's own answer check as the table shows it: right of checked at its concurrency."""
    return "-" if a is None else f"{a['checked'] - a['wrong']} of {a['checked']}"


def recommendations(run_dir: Path, pts: list[Point]) -> list[str]:
    """For each SLO of run.json's ``bench.slos`` and each model: :func:`pdsweep.judge.pareto.describe`'s lines."""
    index, _ = read_index(run_dir)
    out = []
    for text in obj(index.get("bench")).get("slos") or []:
        for model in sorted({p.model for p in pts}):
            out.append(f"{model}, SLO {text}:")
            out += [f"  {line}" for line in describe(best(pts, parse_slo(text), model))]
    return out


def plot_fronts(pts: list[Point], pdir: Path) -> dict[str, Path]:
    """One PNG per model (``front_<model>.png``); {} without load points."""
    made = {}
    for model in sorted({p.model for p in pts}):
        mine = [p for p in pts if p.model == model]
        configs = sorted({p.config for p in mine})
        fig = Figure(figsize=(8, 5.5), layout="constrained")
        ax = fig.subplots()
        for i, cfg in enumerate(configs):
            for p in (p for p in mine if p.config == cfg):
                t, x = p.tok_s_per_gpu, p.tok_s_per_user
                if x is None:  # no TPOT: no interactivity to draw it at
                    continue
                err = None if t.lo is None or t.hi is None else [[t.mean - t.lo], [t.hi - t.mean]]
                ax.errorbar(
                    x, t.mean, yerr=err, fmt="x" if p.failed else MARKERS[i % len(MARKERS)],
                    color=f"C{i}", ms=8 if p.failed else 6, capsize=2, mew=2 if p.failed else 1,
                )  # fmt: skip
                ax.annotate(
                    f"c{p.concurrency}",
                    (x, t.mean),
                    xytext=(4, 4),
                    textcoords="offset points",
                    fontsize=7,
                )
        for j, (_build, group) in enumerate(sorted(_by_build(mine).items())):
            f = front(group)
            ax.plot([p.tok_s_per_user or 0.0 for p in f], [p.tok_s_per_gpu.mean for p in f], ls="-" if j == 0 else "--",
                    color="black", lw=1, alpha=0.7)  # fmt: skip
        handles = [
            Line2D([], [], ls="none", marker=MARKERS[i % len(MARKERS)], color=f"C{i}", label=c)
            for i, c in enumerate(configs)
        ]
        handles += [
            Line2D([], [], ls="-" if j == 0 else "--", color="black", label=f"front: {b}")
            for j, b in enumerate(sorted(_by_build(mine)))
        ]
        handles.append(
            Line2D([], [], ls="none", marker="x", color="gray", mew=2, label="cell did not PASS (off the front)")
        )
        ax.legend(handles=handles, fontsize=8, loc="best")
        ax.set_xlabel("tokens/s per user (1000 / TPOT p50)")
        ax.set_ylabel("output tokens/s per GPU (95 % interval over repeats)")
        ax.set_title(f"{model}: throughput per GPU vs interactivity, one point per cell and concurrency", fontsize=10)
        ax.grid(alpha=0.3)
        path = pdir / f"front_{re.sub(r'[^A-Za-z0-9_.-]', '_', model)}.png"
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=110)
        made[f"front_{model}"] = path
    return made


def _groups(pts: list[Point]) -> dict[tuple[str, str], list[Point]]:
    out: dict[tuple[str, str], list[Point]] = {}
    for p in pts:
        out.setdefault((p.model, p.build), []).append(p)
    return out


def _by_build(pts: list[Point]) -> dict[str, list[Point]]:
    out: dict[str, list[Point]] = {}
    for p in pts:
        out.setdefault(p.build, []).append(p)
    return out


def _g(x: float | None) -> str:
    return "-" if x is None else f"{x:.3g}"
