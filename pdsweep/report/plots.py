"""The report's plots (matplotlib, Agg through the object API: no pyplot state), each
written as a PNG under ``plots/`` and returned as its path (``None`` when there is nothing
to draw):

* ``accuracy.png``: accuracy per cell and task, with the expected band (value ±
  tolerance), the reference value and the cell's stderr; failed cells in red.
* ``heatmap_accuracy.png`` / ``heatmap_gbps.png``: prefill TP x decode TP per model (and
  build) for the first task's accuracy and for KV transfer GB/s; positions without a
  value (not run, rejected, crashed) are hatched and say ``n/a``.
* ``builds.png``: per compare key, one bar per build (a run with several builds) or per
  run (``compare_with``: A = that run, baseline; B = this run, candidate).

Both GB/s plots show transfer.json ``totals.gbps_xfer`` (GB/s, whole cell:
:data:`pdsweep.report.render.GBPS_CELL_NOTE`), not the load repeats' figure of ``perf.png``.

The per-cell plots (``accuracy.png``, ``builds.png``) draw at most :data:`PLOT_ROWS_MAX`
rows: in a bigger run only the rows with a cell that did not PASS (first ones), the title
saying how many rows were left out (the Cells table lists every cell). A 368-cell run drew
a 2 MB accuracy plot in about 10 s.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from matplotlib.colors import Normalize
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch, Rectangle

from pdsweep.judge.compare import SAME, CompareResult
from pdsweep.judge.flaky import FLAKY
from pdsweep.judge.gate import FAIL, NOT_RUNNABLE, PASS, SKIPPED, XFAIL, XPASS, CellResult, GateResult
from pdsweep.report.overview import id_parts, natural_key
from pdsweep.report.render import GBPS_CELL

COLORS = {
    PASS: "#2a7d2a",
    FAIL: "#c62828",
    XPASS: "#c62828",
    XFAIL: "#e08a00",
    SKIPPED: "#777777",
    NOT_RUNNABLE: "#777777",
    FLAKY: "#8e24aa",
}
BASELINE_BUILDS = ("unfixed", "baseline")  # in a run with several builds, the first of these is A
DPI = 110
T = TypeVar("T")
PLOT_ROWS_MAX = 60  # rows of a per-cell plot; past it, the non-PASS rows only
ACC_PAD = 0.05  # accuracy.png's x axis beyond 0..1


def _cap(rows: list[T], passed: Callable[[T], bool]) -> tuple[list[T], int]:
    """``rows`` as drawn: all of them up to :data:`PLOT_ROWS_MAX`, else the first
    ``PLOT_ROWS_MAX`` of those not ``passed``; with the number left out."""
    if len(rows) <= PLOT_ROWS_MAX:
        return rows, 0
    keep = [r for r in rows if not passed(r)][:PLOT_ROWS_MAX]
    return keep, len(rows) - len(keep)


# ---------------------------------------------------------------- helpers
def first_value(c: CellResult, task: str | None = None) -> float | None:
    tasks = [t for t in c.facts.tasks if task is None or t.task == task]
    return tasks[0].value if tasks else None


def ran_cells(result: GateResult) -> list[CellResult]:
    return [c for c in result.cells if c.verdict not in (SKIPPED, NOT_RUNNABLE)]


def tasks_of(cells: list[CellResult]) -> list[str]:
    return list(dict.fromkeys(t.task for c in cells for t in c.facts.tasks))


def _save(fig: Figure, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=DPI)
    return path


# ---------------------------------------------------------------- (a) accuracy per cell
def plot_accuracy(result: GateResult, path: Path) -> Path | None:
    """Dot plot per task: cells on y, accuracy on x (0-1). Returns None if no cell has a task."""
    cells = ran_cells(result)
    tasks = tasks_of(cells)
    if not tasks:
        return None
    cells, left_out = _cap(cells, lambda c: c.verdict == PASS)
    if not cells:
        return None
    note = f"; {left_out} PASS cells not drawn (Cells table)" if left_out else ""
    height = 1.6 + 0.3 * len(cells)
    fig = Figure(figsize=(11, height * len(tasks)), layout="constrained")
    for ax, task in zip(fig.subplots(len(tasks), 1, squeeze=False)[:, 0], tasks):
        ys = range(len(cells))[::-1]  # first cell on top
        for y, c in zip(ys, cells):
            s = next((t for t in c.facts.tasks if t.task == task), None)
            color = COLORS[c.verdict]
            if s and s.expected is not None and s.tolerance is not None:
                ax.barh(
                    y, 2 * s.tolerance, left=s.expected - s.tolerance, height=0.7, color="#4caf50", alpha=0.22, lw=0
                )
            if s and s.reference is not None:
                ax.plot(s.reference, y, marker="D", ms=6, mfc="none", mec="black", ls="none")
            if s is None or s.value is None:
                ax.text(0.01, y, "n/a", va="center", fontsize=8, color=color)
            else:  # the marker says whether the task passed; the label, whether the cell did
                err = s.stderr if isinstance(s.stderr, float) else None
                ok = s.verdict == "pass"
                ax.errorbar(
                    s.value,
                    y,
                    xerr=err,
                    fmt="o" if ok else "X",
                    ms=7,
                    capsize=3,
                    color=COLORS[PASS] if ok else COLORS[FAIL],
                )
            ax.text(
                1.01,
                y,
                c.verdict,
                transform=ax.get_yaxis_transform(),
                va="center",
                fontsize=8,
                color=color,
                fontweight="bold",
            )
        ax.set_yticks(list(ys), [c.cell_id for c in cells], fontsize=8)
        for label, c in zip(ax.get_yticklabels(), cells):
            label.set_color(COLORS[c.verdict] if c.verdict != PASS else "black")
        # padded past 0 and 1 so markers and bands there are drawn whole; the ticks stay 0..1
        ax.set_xlim(-ACC_PAD, 1 + ACC_PAD)
        ax.set_xticks([i / 5 for i in range(6)])
        ax.set_ylim(-0.7, len(cells) - 0.3)
        ax.set_xlabel(f"{task} accuracy")
        ax.grid(axis="x", alpha=0.3)
        ax.set_title(f"Accuracy per cell: {task} (label colour: cell verdict{note})", fontsize=10, loc="left")
    fig.legend(
        handles=[
            Patch(color="#4caf50", alpha=0.3, label="expected ± tolerance"),
            Line2D([], [], ls="none", marker="D", mfc="none", mec="black", label="reference"),
            Line2D([], [], ls="none", marker="o", color=COLORS[PASS], label="value ± stderr, task passed"),
            Line2D([], [], ls="none", marker="X", color=COLORS[FAIL], label="task failed"),
        ],
        loc="outside upper center",
        ncol=4,
        fontsize=8,
        frameon=False,
    )
    return _save(fig, path)


# ---------------------------------------------------------------- (b) heatmaps
def _heatmap_panels(
    result: GateResult, value: Callable[[CellResult], float | None]
) -> dict[str, list[tuple[CellResult, float | None]]]:
    panels: dict[str, list[tuple[CellResult, float | None]]] = {}
    for c in result.cells:
        f = c.facts
        if c.kind == "ref" or f.model is None or f.prefill_tp is None or f.decode_tp is None:
            continue
        panels.setdefault(f"{f.model} ({f.build})", []).append((c, None if c.verdict == SKIPPED else value(c)))
    return panels


FOLD_NOTE = (
    "A square marked 'min of N' folds the N cells at one prefill TP x decode TP position of a model and "
    "build (block sizes and variants: env, serve args, fault drills): it shows the lowest value among them; "
    "a cell without a value (failed before measuring, rejected) counts in N only, and the verdicts other than "
    "PASS among the N are written under the number"
)
FOLD_ITEMS = 8  # blocks or variants named per folded square before the rest is counted


def _named(xs: list[str]) -> str:
    xs = sorted(set(xs), key=natural_key)
    return ", ".join(xs[:FOLD_ITEMS]) + (f", … (+{len(xs) - FOLD_ITEMS})" if len(xs) > FOLD_ITEMS else "")


def heatmap_folds(result: GateResult) -> list[str]:
    """One line per heatmap square that folds several cells (:func:`plot_heatmap`): panel,
    position, count, and the block sizes and variants folded, e.g. ``tiny-llama (fixed) P TP1
    x D TP1: min of 6 cells: blocks b32-32; variants base, fault-kill-prefill-during-eval, ...``."""
    lines = []
    for title, cells in _heatmap_panels(result, lambda c: None).items():
        at: dict[tuple[int, int], list[CellResult]] = {}
        for c, _ in cells:
            at.setdefault((c.facts.prefill_tp or 0, c.facts.decode_tp or 0), []).append(c)
        for (p, d), here in sorted(at.items()):
            if len(here) > 1:
                parts = [id_parts(c) for c in here]
                blocks, variants = _named([x[2] for x in parts]), _named([x[4] or "base" for x in parts])
                lines.append(
                    f"{title} P TP{p} x D TP{d}: min of {len(here)} cells: blocks {blocks}; variants {variants}"
                )
    return lines


def plot_heatmap(
    result: GateResult,
    value: Callable[[CellResult], float | None],
    label: str,
    path: Path,
    vmax: float | None = None,
    fmt: str = ".2f",
) -> Path | None:
    """Prefill TP (rows) x decode TP (columns), one panel per model and build; PD cells only.

    Several cells at one position (block sizes, variants) show the lowest value and
    ``min of N`` (:data:`FOLD_NOTE`, said under the panels; :func:`heatmap_folds` lists them).
    Returns None when the run has no PD cell.
    """
    panels = _heatmap_panels(result, value)
    if not panels:
        return None
    values = [v for cells in panels.values() for _, v in cells if v is not None]
    norm = Normalize(0, vmax if vmax is not None else max(values, default=1.0) or 1.0)
    ncols = min(3, len(panels))
    nrows = math.ceil(len(panels) / ncols)
    fig = Figure(figsize=(3.6 * ncols + 1.2, 3.0 * nrows + 0.4), layout="constrained")
    axes = fig.subplots(nrows, ncols, squeeze=False).ravel()
    cmap = None
    folded: list[list[tuple[CellResult, float | None]]] = []  # every position's cells, all panels
    for ax, (title, cells) in zip(axes, panels.items()):
        ps = sorted({c.facts.prefill_tp or 0 for c, _ in cells})  # `or 0` for mypy: _heatmap_panels keeps set TPs
        ds = sorted({c.facts.decode_tp or 0 for c, _ in cells})
        grid: dict[tuple[int, int], list[tuple[CellResult, float | None]]] = {}
        for c, v in cells:
            grid.setdefault((ps.index(c.facts.prefill_tp or 0), ds.index(c.facts.decode_tp or 0)), []).append((c, v))
        folded += grid.values()
        image = [[math.nan] * len(ds) for _ in ps]
        for (i, j), here in grid.items():
            vals = [v for _, v in here if v is not None]
            image[i][j] = min(vals) if vals else math.nan
        im = ax.imshow(image, cmap="viridis", norm=norm, aspect="auto")
        cmap = im.cmap
        for i in range(len(ps)):
            for j in range(len(ds)):
                here = grid.get((i, j), [])
                v = image[i][j]
                bad = sorted({c.verdict for c, _ in here} - {PASS})
                if math.isnan(v):
                    ax.add_patch(
                        Rectangle((j - 0.5, i - 0.5), 1, 1, facecolor="#eeeeee", edgecolor="#9e9e9e", hatch="///", lw=0)
                    )
                    text, color = "n/a", "#444444"
                else:
                    r, g, b, _ = cmap(norm(v))
                    text, color = format(v, fmt), "black" if 0.299 * r + 0.587 * g + 0.114 * b > 0.5 else "white"
                if len(here) > 1:
                    text += f"\nmin of {len(here)}"
                if bad:
                    text += "\n" + "/".join(bad)
                ax.text(
                    j,
                    i,
                    text,
                    ha="center",
                    va="center",
                    fontsize=9,
                    color=color,
                    fontweight="bold" if bad else "normal",
                )
        ax.set_xticks(range(len(ds)), [f"D TP{d}" for d in ds])
        ax.set_yticks(range(len(ps)), [f"P TP{p}" for p in ps])
        ax.set_title(title, fontsize=10)
    for ax in axes[len(panels) :]:
        ax.set_visible(False)
    fig.colorbar(im, ax=axes[: len(panels)].tolist(), label=label, shrink=0.9)
    fig.suptitle(f"{label}: prefill TP x decode TP", fontsize=11)
    if any(len(here) > 1 for here in folded):
        fig.supxlabel(
            "min of N: the lowest value of the N cells at this position (block sizes, env / serve-args / "
            "fault-drill variants); the report lists them",
            fontsize=8,
        )
    return _save(fig, path)


# ---------------------------------------------------------------- (c) side by side
Series = tuple[list[str], list[tuple[str, list[CellResult | None]]]]


def build_series(result: GateResult) -> Series | None:
    """Names of the builds in ``result`` (baseline first) and, per compare key, each
    build's cell; None when the run has fewer than two builds."""
    cells = ran_cells(result)
    builds = list(dict.fromkeys(c.facts.build for c in cells if c.facts.build))
    if len(builds) < 2:
        return None
    base = next((b for b in BASELINE_BUILDS if b in builds), builds[0])
    builds = [base] + [b for b in builds if b != base]
    keys = list(dict.fromkeys(c.facts.compare_key or c.cell_id for c in cells))
    pick = {(c.facts.compare_key or c.cell_id, c.facts.build): c for c in cells}
    return builds, [(k, [pick.get((k, b)) for b in builds]) for k in keys]


def compare_series(cmp: CompareResult) -> Series:
    """A and B of a comparison as two series, one row per compare key."""
    return (
        [f"A: {cmp.a_name} (baseline)", f"B: {cmp.b_name} (candidate)"],
        [(c.key if c.verdict == SAME else f"{c.key} [{c.verdict}]", [c.a, c.b]) for c in cmp.cells],
    )


def hatch_label(verdicts: set[str]) -> str:
    """builds.png's legend entry for its hatched bars, naming the verdicts drawn hatched: every
    cell whose checks failed, an expected failure (XFAIL) as a FAIL, e.g. ``FAIL / XFAIL cell
    (checks failed)``."""
    return " / ".join(sorted(verdicts)) + " cell (checks failed)"


def plot_side_by_side(series: Series, path: Path) -> Path | None:
    """Grouped horizontal bars per compare key: accuracy (the first task) and GB/s, one bar
    per series; cells whose checks failed (FAIL, XFAIL) hatched with their verdict
    (:func:`hatch_label`), absent ones ``n/a``. None when the rows are capped
    (:data:`PLOT_ROWS_MAX`) and every one passed."""
    names, rows = series
    rows, left_out = _cap(rows, lambda r: all(c.verdict == PASS for c in r[1] if c is not None))
    if not rows:
        return None
    nb = len(names)
    fig = Figure(figsize=(12, 1.4 + 0.28 * nb * len(rows) + 0.15 * len(rows)), layout="constrained")
    axes = fig.subplots(1, 2, sharey=True)
    palette = ["#90a4ae", "#1e88e5", "#8e24aa", "#00897b"]
    bar = 0.8 / nb
    task = next(iter(tasks_of([c for _, cs in rows for c in cs if c])), None)
    metrics = (
        (f"accuracy ({task})", lambda c: first_value(c, task), "{:.3f}"),
        (GBPS_CELL, lambda c: c.facts.total("gbps_xfer"), "{:.3g}"),
    )
    hatched: set[str] = set()  # verdicts of the cells drawn hatched: checks failed (FAIL, XFAIL)
    for ax, (label, get, fmt) in zip(axes, metrics):
        top = max((get(c) or 0 for _, cs in rows for c in cs if c), default=0) or 1.0
        for r, (_, cs) in enumerate(rows):
            y0 = len(rows) - 1 - r
            for k, c in enumerate(cs):
                y = y0 + 0.4 - bar * (k + 0.5)
                v = get(c) if c else None
                if c is None or v is None:
                    why = "" if c is None else " (reference)" if c.kind == "ref" else f" ({c.verdict})"
                    ax.text(top * 0.01, y, f"n/a{why}", va="center", fontsize=7, color="#555555")
                    continue
                failed = not c.checks_passed
                if failed:
                    hatched.add(c.verdict)
                ax.barh(
                    y,
                    v,
                    height=bar * 0.9,
                    color=palette[k % len(palette)],
                    hatch="///" if failed else None,
                    edgecolor=COLORS[FAIL] if failed else "none",
                    lw=1 if failed else 0,
                )
                ax.text(
                    v + top * 0.01,
                    y,
                    fmt.format(v) + (f" {c.verdict}" if c.verdict != PASS else ""),
                    va="center",
                    fontsize=7,
                    color=COLORS[c.verdict] if failed else "black",
                )
        ax.set_xlim(0, top * 1.3)
        ax.set_xlabel(label)
        ax.grid(axis="x", alpha=0.3)
    axes[0].set_yticks(range(len(rows))[::-1], [k for k, _ in rows], fontsize=8)
    axes[0].set_ylim(-0.6, len(rows) - 0.4)
    fig.legend(
        handles=[Patch(color=palette[k % len(palette)], label=n) for k, n in enumerate(names)]
        + (
            [Patch(facecolor="white", edgecolor=COLORS[FAIL], hatch="///", label=hatch_label(hatched))]
            if hatched
            else []
        ),
        loc="outside upper center",
        ncol=nb + 1,
        fontsize=8,
        frameon=False,
    )
    if left_out:
        fig.suptitle(f"{left_out} rows where every cell passed not drawn (Cells table)", fontsize=9)
    return _save(fig, path)


# ---------------------------------------------------------------- report
