"""``pdsweep bisect``: run one cell on a series of builds, in bisection order, and name the
first bad build.

The builds are ordered good -> bad: ``[good, *between, bad]``. Each step runs the cell (and
its reference) as a sweep of its own, the sweep's own build of that cell replaced by the
candidate (a named build of the sweep, ``venv:PATH`` or ``python:PATH``); a build is *good*
when every gate check of the cell passes (PASS, XPASS, or FLAKY: passed after a redeploy;
an expectation is not an outcome here, and a hang is not the build's verdict), else bad.
The ends are run too (a "good" end that fails, or a "bad" end that passes, is reported
instead of a first bad build). ``--all`` runs every build, for series
that need not be monotone (e.g. PR #49297's edits undone one at a time:
``pdsweep baseline-env --undo``). ``--resume`` finishes an interrupted bisection: each step
runs into a fixed directory (``out/NN-build/run``), and a step whose cell is already final
is read back, not run again.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from pdsweep.core.errors import UserError
from pdsweep.judge.gate import gate_run
from pdsweep.results import layout
from pdsweep.run.context import RunOptions
from pdsweep.run.sweep import run_sweep

GOOD = ("PASS", "XPASS", "FLAKY")  # every check passed (FLAKY: after a redeploy), whatever was expected


@dataclass(frozen=True)
class Step:
    """One build tried: its verdict (PASS/FAIL/...) and the cell's first reason."""

    build: str
    verdict: str
    good: bool
    reason: str = ""
    run_dir: str | None = None


@dataclass
class Bisection:
    """The builds in order, the steps run (in the order they ran) and the answer."""

    builds: list[str]
    steps: list[Step] = field(default_factory=list)

    def step(self, build: str) -> Step | None:
        return next((s for s in self.steps if s.build == build), None)

    @property
    def first_bad(self) -> str | None:
        """The first build (in series order) that is bad while the one before it is good;
        None when the ends do not disagree or a gap is untested."""
        for a, b in zip(self.builds, self.builds[1:]):
            sa, sb = self.step(a), self.step(b)
            if sa and sb and sa.good and not sb.good:
                return b
        return None

    def lines(self) -> list[str]:
        out = []
        for b in self.builds:
            s = self.step(b)
            out.append(
                f"  {b}: {'not run' if s is None else s.verdict + (' (' + cause(s.reason) + ')' if s.reason else '')}"
            )
        fb = self.first_bad
        good, bad = self.step(self.builds[0]), self.step(self.builds[-1])
        if good is not None and not good.good:
            head = f"bisect: the good end {self.builds[0]} fails: nothing to bisect"
        elif bad is not None and bad.good:
            head = f"bisect: the bad end {self.builds[-1]} passes: nothing to bisect"
        else:
            head = f"bisect: first bad build: {fb}" if fb else "bisect: no first bad build found"
        ran = [self.step(b) for b in self.builds]
        split = [
            f"  {word}: {', '.join(s.build for s in ran if s is not None and s.good is good) or 'none'}"
            for word, good in (("good", True), ("bad", False))
        ]
        return [head, *out, *split]


_BLAME = re.compile(r"\b(?:prefill|decode|single)-\d+ \((?:pid \d+|still running)[^)]*\)[^;]*")


def cause(reason: str, width: int = 200) -> str:
    """The part of a cell's reason that names its cause: an instance's own error
    (``decode-0 (still running): KeyError: ... at vllm/...py:330``) when the reason has one,
    else its start; cut to ``width`` characters."""
    m = _BLAME.search(reason)
    text = m.group(0) if m else reason
    return text if len(text) <= width else text[: width - 1] + "…"


def bisection_order(n: int, verdict: Callable[[int], bool], run_all: bool = False) -> None:
    """Drive ``verdict(i)`` (True = good) over indices 0..n-1: both ends first, then binary
    search between the last good and first bad (or every index with ``run_all``)."""
    if run_all:
        for i in range(n):
            verdict(i)
        return
    if not verdict(0) or verdict(n - 1):
        return
    lo, hi = 0, n - 1
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if verdict(mid):
            lo = mid
        else:
            hi = mid


def build_spec(sweep: dict[str, Any], build: str) -> dict[str, Any]:
    """The sweep-file spec of a candidate build: a named build of the sweep, or
    ``venv:PATH`` / ``python:PATH``. Raises ``UserError`` naming the allowed forms."""
    kind, _, path = build.partition(":")
    if kind in ("venv", "python") and path:
        return {kind: str(Path(path).absolute()), "description": f"bisect candidate {build}"}
    builds = sweep.get("builds") or {"fixed": {}}
    if build in builds:
        return dict(builds[build] or {})
    raise UserError(
        f"bisect: build {build!r}: not a build of the sweep ({', '.join(builds)}) nor venv:PATH/python:PATH"
    )


def derived_sweep(sweep_path: Path, cell_build: str, candidate: str, out: Path) -> Path:
    """``out/sweep.yaml``: the sweep with its build ``cell_build`` replaced by
    ``candidate``'s spec and ``models_file`` made absolute."""
    data = yaml.safe_load(sweep_path.read_text())
    data["models_file"] = str((sweep_path.parent / data.get("models_file", "models.yaml")).resolve())
    data.setdefault("builds", {"fixed": {}})[cell_build] = build_spec(data, candidate)
    return layout.write_text(out / "sweep.yaml", yaml.safe_dump(data, sort_keys=False))


def bisect(
    sweep_path: Path,
    cell_id: str,
    builds: list[str],
    out: Path,
    run_cell: Callable[[Path, str, Path, bool], tuple[str, str]],
    run_all: bool = False,
    resume: bool = False,
) -> Bisection:
    """Bisect ``cell_id`` (whose build part names the sweep build that is replaced) over
    ``builds`` (good first, bad last). ``run_cell(sweep, cell_id, run_dir, resume)`` runs
    the cell and returns (verdict, reason). Writes ``out/bisect.json``. Raises
    ``UserError`` for a repeated or unknown build, or (without ``resume``) a step
    directory that already holds a run."""
    if len(builds) < 2 or len(set(builds)) != len(builds):
        raise UserError("bisect: give a good and a bad build (and the builds between), each once")
    cell_build = cell_id.rsplit(".", 1)[-1]
    result = Bisection(list(builds))

    def verdict(i: int) -> bool:
        b = builds[i]
        step_dir = out / f"{i:02d}-{b.replace('/', '_').replace(':', '-')}"
        sweep = derived_sweep(sweep_path, cell_build, b, step_dir)
        v, reason = run_cell(sweep, cell_id, step_dir / "run", resume)
        s = Step(b, v, v in GOOD, reason, str(step_dir / "run"))
        result.steps.append(s)
        return s.good

    bisection_order(len(builds), verdict, run_all)
    layout.write_text(
        out / "bisect.json",
        json.dumps(
            {
                "cell": cell_id,
                "builds": builds,
                "first_bad": result.first_bad,
                "steps": [s.__dict__ for s in result.steps],
            },  # fmt: skip
            indent=2,
        ),
    )
    return result


def run_cell_for_real(sweep: Path, cell_id: str, run_dir: Path, resume: bool = False) -> tuple[str, str]:
    """Run ``cell_id`` (and its reference) with ``pdsweep run`` (``--resume``: a final
    cell is kept) and gate it."""
    run_sweep(str(sweep), RunOptions(out=run_dir, cells=cell_id, quiet=True, resume=resume and run_dir.exists()))
    c = gate_run(run_dir).cell(cell_id)
    return c.verdict, (c.reasons[0] if c.reasons else "")
