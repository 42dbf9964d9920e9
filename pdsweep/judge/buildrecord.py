"""cell.json ``build``: what ran is recorded, and it is the build the plan named (issue 59). A
cell whose record names another build, or no vLLM version or interpreter, cannot say which vLLM
produced its results (fixed-vs-candidate would compare unknowns), so it fails."""

from __future__ import annotations

from pdsweep.core.stats import obj
from pdsweep.judge.facts import CellFiles, cell_from_dict, show
from pdsweep.results import layout

RECORDED = ("name", "python", "vllm_version")  # pdsweep.run.cell writes them from the build's own probe


class BuildRecordCheck:
    """cell.json ``build.name`` is the cell's build, with its ``python`` and ``vllm_version``."""

    name = "build-record"

    def applies(self, kind: str) -> bool:
        return True

    def fails(self, files: CellFiles) -> list[str]:
        cj = files.get(layout.CELL_FILE)
        cell = cell_from_dict(obj(cj).get("cell"))
        if cj is None or cell is None:
            return []  # CellFileCheck fails it
        b = obj(cj.get("build"))
        w = files.where(layout.CELL_FILE)
        out = [
            f"{w}: build.{k} is {show(b.get(k))} (missing: which vLLM ran is unknown)" for k in RECORDED if not b.get(k)
        ]
        if b.get("name") and b.get("name") != cell.build:
            out.append(f"{w}: build.name {show(b.get('name'))}, but the cell's build is {show(cell.build)}")
        return out
