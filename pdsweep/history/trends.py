"""Sustained changes in a cell's history, and the build difference behind each.

A metric's run ``k`` starts a change when its value lies outside the noise band of the
runs of the current regime before it (at most ``window`` of them, at least
``min_history``): ``|x_k - median| > max(rel * |median|, z * 1.4826 * MAD)``, and, when the
run recorded an interval, that interval excludes the median too. The change is
*sustained* when every later run up to the next change stays outside the band on the
same side; a run that falls back inside is a transient and not reported. A change in the
latest run is ``new``; one that later runs confirmed is ``lasting``. After a change the
regime restarts at its first run. Verdicts change when a cell goes from passing (PASS,
XFAIL, SKIPPED) to failing or back, judged the same way (``new`` or ``lasting``).
The robust band is the median/MAD rule (scipy.stats.median_abs_deviation with
``scale='normal'``), so one earlier outlier does not widen it.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from scipy.stats import median_abs_deviation

from pdsweep.history.store import Point

OK_VERDICTS = ("PASS", "XFAIL", "SKIPPED")


@dataclass(frozen=True)
class Change:
    """The first run of a sustained change of one cell's metric (or verdict)."""

    cell_id: str
    metric: str  # "verdict" for a verdict change
    first: Point  # the first run of the new regime
    last_good: Point  # the run before it
    before: float | None  # the old regime's median (None for verdicts)
    after: float | None
    direction: str  # "up" | "down" | "fail" | "fix"
    runs_since: int  # runs of the new regime so far, the first included
    build_diff: tuple[str, ...]

    @property
    def status(self) -> str:
        return "new" if self.runs_since == 1 else "lasting"

    @property
    def ratio(self) -> float | None:
        if self.before in (None, 0) or self.after is None:
            return None
        return self.after / self.before

    def describe(self) -> str:
        """One line: what changed, since which run, and the build difference."""
        when = f"{self.first.run_name or self.first.run_key} ({self.first.started[:19]})"
        lasted = "new in the latest run" if self.status == "new" else f"lasting {self.runs_since} runs"
        if self.metric == "verdict":
            what = f"verdict {self.last_good.verdict} -> {self.first.verdict}"
        else:
            unit = f" {self.first.unit}" if self.first.unit else ""
            what = f"{self.metric} {self.before:.4g} -> {self.after:.4g}{unit} ({self.ratio:.2f}x)"
        build = "; ".join(self.build_diff) or "no build difference (same vLLM, fixes, pdsweep and config)"
        return f"{self.cell_id}: {what} since {when}, {lasted}; build: {build}"


def build_diff(a: Point, b: Point) -> tuple[str, ...]:
    """What differs between two runs' builds of one cell: vLLM version and commit, NIXL,
    fix probes (``fix X present -> absent``), the patched files, pdsweep's commit, the
    configuration hash."""
    out = []
    for k in ("vllm_version", "vllm_commit", "nixl_version", "pdsweep_commit", "config_hash", "patched_sha"):
        x, y = a.build.get(k), b.build.get(k)
        if x != y and k != "fixes":
            short = (lambda v: v[:12] if isinstance(v, str) and len(v) > 12 else v) if k != "vllm_version" else str
            out.append(f"{k.replace('_', ' ')} {short(x)} -> {short(y)}")
    fa, fb = _fixes(a), _fixes(b)
    for fix in sorted(set(fa) | set(fb)):
        if fa.get(fix) != fb.get(fix):
            out.append(f"fix {fix} {_present(fa.get(fix))} -> {_present(fb.get(fix))}")
    return tuple(out)


def _fixes(p: Point) -> dict[str, bool | None]:
    import json

    raw = p.build.get("fixes")
    try:
        v = json.loads(raw) if isinstance(raw, str) else raw
    except ValueError:
        return {}
    return v if isinstance(v, dict) else {}


def _present(v: bool | None) -> str:
    return {True: "present", False: "absent"}.get(v, "unknown")  # type: ignore[arg-type]


def _outside(p: Point, base: list[float], rel: float, z: float) -> int:
    """+1 / -1 when ``p`` lies above / below the noise band of ``base``, else 0."""
    assert p.value is not None
    med = statistics.median(base)
    band = max(rel * abs(med), z * float(median_abs_deviation(base, scale="normal")))
    if abs(p.value - med) <= band:
        return 0
    if p.lo is not None and p.hi is not None and p.lo <= med <= p.hi:
        return 0  # the run's own interval still holds the old median: not decided
    return 1 if p.value > med else -1


def metric_changes(
    cell_id: str,
    metric: str,
    points: list[Point],
    rel: float = 0.10,
    z: float = 3.0,
    window: int = 10,
    min_history: int = 3,
) -> list[Change]:
    """Sustained changes of one metric series (see the module docstring). ``rel``: the
    smallest relative change reported; ``z``: robust standard deviations of the band."""
    changes: list[Change] = []
    start = 0  # first run of the current regime
    k = start + min_history
    while k < len(points):
        base = [p.value for p in points[max(start, k - window) : k] if p.value is not None]
        side = _outside(points[k], base, rel, z) if len(base) >= min_history else 0
        if side == 0:
            k += 1
            continue
        j = k + 1  # runs that keep the change
        while j < len(points) and _outside(points[j], base, rel, z) == side:
            j += 1
        if j < len(points) and j == k + 1 and _outside(points[j], base, rel, z) == 0:
            k += 1  # a transient: the next run is back in the band
            continue
        after = statistics.median([p.value for p in points[k:j] if p.value is not None])
        changes.append(
            Change(
                cell_id,
                metric,
                points[k],
                points[k - 1],
                statistics.median(base),
                after,
                "up" if side > 0 else "down",
                j - k,
                build_diff(points[k - 1], points[k]),
            )
        )
        start, k = k, k + min_history
    return changes


def verdict_changes(cell_id: str, points: list[Point]) -> list[Change]:
    """Sustained passing <-> failing transitions of a cell's verdict."""
    ok = [p.verdict in OK_VERDICTS for p in points]
    changes = []
    k = 1
    while k < len(points):
        if ok[k] == ok[k - 1]:
            k += 1
            continue
        j = k + 1
        while j < len(points) and ok[j] == ok[k]:
            j += 1
        if j < len(points) and j == k + 1:
            k += 2  # one run off and back: a transient (FLAKY-like), not a change
            continue
        changes.append(
            Change(
                cell_id,
                "verdict",
                points[k],
                points[k - 1],
                None,
                None,
                "fix" if ok[k] else "fail",
                j - k,
                build_diff(points[k - 1], points[k]),
            )
        )
        k = j
    return changes
