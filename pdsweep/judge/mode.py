"""The transfer mode a cell ran in, from what the plan launched: the ``--kv-transfer-config``
of each instance's recorded argv (cell.json ``instances[].argv``), never transfer.json's own
``transfer_mode`` claim. Push (``NixlPushConnector``, vLLM ``kv_connector/factory.py``):
prefill WRITEs (``nixl/push_worker.py``); pull (``NixlConnector``): decode READs
(``nixl/pull_worker.py``)."""

from __future__ import annotations

from pdsweep.core.stats import obj
from pdsweep.judge.facts import CellFiles, show
from pdsweep.plan.instance import transfer_mode
from pdsweep.results import layout


def launched_mode(files: CellFiles) -> str | None:
    """``"push"`` when any recorded instance argv names the push connector, ``"pull"`` when
    they name another connector, None when cell.json records no instance argv."""
    insts = obj(files.get(layout.CELL_FILE)).get("instances")
    argvs = [i.get("argv") for i in insts if isinstance(i, dict)] if isinstance(insts, list) else []
    modes = {transfer_mode([str(a) for a in argv]) for argv in argvs if isinstance(argv, list)} - {None}
    return "push" if "push" in modes else ("pull" if modes else None)


def is_push(files: CellFiles) -> bool:
    """The cell's instances were launched with ``NixlPushConnector`` (:func:`launched_mode`)."""
    return launched_mode(files) == "push"


def mode_disagrees(files: CellFiles) -> list[str]:
    """A transfer.json whose ``transfer_mode`` differs from the launched mode (no recorded
    argv: pull, pdsweep's default ``NixlConnector``): the file does not describe this cell."""
    tr = files.get(layout.TRANSFER_FILE) or {}
    claimed, launched = tr.get("transfer_mode"), launched_mode(files)
    if claimed is None or claimed == (launched or "pull"):
        return []
    how = f"argv launched {launched}" if launched else "no instance argv recorded (pull, NixlConnector)"
    return [
        f"{files.where(layout.TRANSFER_FILE)}: transfer_mode {show(claimed)}, but cell.json {how}: "
        "the transfer mode is the one the cell was launched with, not the file's claim"
    ]
