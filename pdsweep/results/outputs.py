"""Output paths of gate, compare and report never land on a run's own result files
(issue 23): ``gate RUN --summary RUN/run.json`` would replace the index the next gate
reads. Outputs may go at the top of a run directory (the defaults: junit.xml,
summary.md, report.md, plots/), never onto run.json / plan.json nor into a cell's
directory."""

from __future__ import annotations

from pathlib import Path

from pdsweep.core.errors import UserError
from pdsweep.results import layout

PROTECTED = (layout.RUN_FILE, layout.PLAN_FILE)


def refuse_results_path(run_dir: Path, path: Path, flag: str) -> None:
    """Raise ``UserError`` naming ``flag`` when ``path`` (a file or an output directory)
    is run.json/plan.json of ``run_dir`` or lies inside one of its cell directories."""
    run, p = layout.resolved(run_dir), layout.resolved(path)
    if p.parent == run and p.name in PROTECTED:
        raise UserError(f"{flag} {path}: is the run's own {p.name}; writing it would destroy the run")
    try:
        rel = p.relative_to(run)
    except ValueError:
        return
    if not rel.parts:
        return
    top = run / rel.parts[0]
    if top.is_dir() and any((top / name).exists() for name in (layout.STATUS_FILE, layout.CELL_FILE)):
        raise UserError(
            f"{flag} {path}: inside cell directory {top.name} of run {run_dir}: it would overwrite that "
            "cell's results; write it outside the cell directories"
        )
