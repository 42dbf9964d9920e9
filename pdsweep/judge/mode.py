"""The transfer mode a cell ran in, from what the plan launched: the ``--kv-transfer-config``
of each instance's recorded argv (cell.json ``instances[].argv``), never transfer.json's own
``transfer_mode`` claim. Push (``NixlPushConnector``, vLLM ``kv_connector/factory.py``):
prefill WRITEs (``nixl/push_worker.py``); pull (``NixlConnector``): decode READs
(``nixl/pull_worker.py``)."""

from __future__ import annotations

from collections import Counter

from pdsweep.core.stats import obj
from pdsweep.judge.facts import CellFiles, cell_from_dict, show
from pdsweep.plan.instance import roles, transfer_mode
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


def unlaunched_instances(files: CellFiles) -> list[str]:
    """A PD cell's planned instances (:func:`pdsweep.plan.instance.roles`: ``num_prefill`` prefill
    and ``num_decode`` decode) each recorded in cell.json with a connector in its argv, or why not."""
    cell = cell_from_dict(obj(files.get(layout.CELL_FILE)).get("cell"))
    if cell is None or cell.kind != "pd":
        return []
    insts = obj(files.get(layout.CELL_FILE)).get("instances")
    rows = [i for i in insts if isinstance(i, dict)] if isinstance(insts, list) else []
    seen = Counter(
        str(i.get("role")) for i in rows if isinstance(i.get("argv"), list) and transfer_mode(list(map(str, i["argv"])))
    )
    want = Counter(role for _, role, *_ in roles(cell))
    if seen == want:
        return []
    return [
        f"{files.where(layout.CELL_FILE)}: instances with a --kv-transfer-config argv: "
        f"{dict(sorted(seen.items())) or 'none'}; the cell plans {dict(sorted(want.items()))}"
    ]


def mode_disagrees(files: CellFiles) -> list[str]:
    """Why the transfer mode cannot be trusted: no recorded instance argv names a connector
    (fail closed), or transfer.json's ``transfer_mode`` differs from the launched mode (the file
    does not describe this cell)."""
    if lost := unlaunched_instances(files):
        return lost
    tr = files.get(layout.TRANSFER_FILE) or {}
    claimed, launched = tr.get("transfer_mode"), launched_mode(files)
    if launched is None:
        return [
            f"{files.where(layout.CELL_FILE)}: no instance argv with --kv-transfer-config recorded "
            "(instances[].argv): the transfer mode the cell was launched with is unknown"
        ]
    if claimed is None or claimed == launched:
        return []
    how = f"argv launched {launched}"
    return [
        f"{files.where(layout.TRANSFER_FILE)}: transfer_mode {show(claimed)}, but cell.json {how}: "
        "the transfer mode is the one the cell was launched with, not the file's claim"
    ]
