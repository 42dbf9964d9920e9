"""The KV integrity gate: transfer.json ``integrity`` (:mod:`pdsweep.core.kvintegrity`, from the
digests of :mod:`pdsweep.engine.kvdigest`).

Applies to a PD cell whose plan switched the digests on (cell.json ``instances[].env``
``PDSWEEP_KV_DIGEST=1``: every PD pull instance on CPU, and on GPU where the sweep opts in,
:func:`pdsweep.plan.instance.instances`);
what the file must hold comes from that, never from the file. Fails when

- ``integrity`` is absent or says ``not_measured``: "integrity: not measured (why)" (fail closed);
- nothing was compared (``compared`` 0 or ``matched`` 0), the READs failed on purpose aside;
- any block is ``mismatched``, ``stale`` or ``missing``: one reason each, naming the first
  request, group (``<index>:<kv|mla|ssm-conv|ssm-temporal>``), prefill rank and block (``missing``:
  also every group with the prefill ranks it is missing from);
- any READ NIXL refused to prepare (``refused_reads``): naming the block of the first descriptor
  whose decode and prefill lengths differ;
- push cells (``NixlPushConnector``, :mod:`pdsweep.core.kvpush`): the same counts over prefill's WRITEs,
  and any ``unwritten`` decode block (a descriptor no WRITE of the request covered).
"""

from __future__ import annotations

from dataclasses import dataclass

from pdsweep.core.faults import KV_DIGEST_ENV_VAR
from pdsweep.core.kvintegrity import integrity_reasons
from pdsweep.core.stats import obj
from pdsweep.judge.facts import CellFiles
from pdsweep.plan.instance import transfer_mode
from pdsweep.results import layout


def planned_push(files: CellFiles) -> bool:
    """The plan made this a push cell (an instance's ``--kv-transfer-config`` names ``NixlPushConnector``)."""
    instances = obj(files.get(layout.CELL_FILE)).get("instances")
    return isinstance(instances, list) and any(
        transfer_mode([str(a) for a in obj(i).get("argv") or []]) == "push" for i in instances if isinstance(i, dict)
    )


def planned(files: CellFiles) -> bool:
    """The plan switched the KV digests on for this cell (cell.json instances' env)."""
    instances = obj(files.get(layout.CELL_FILE)).get("instances")
    return isinstance(instances, list) and any(
        obj(obj(i).get("env")).get(KV_DIGEST_ENV_VAR) == "1" for i in instances if isinstance(i, dict)
    )


@dataclass(frozen=True)
class IntegrityCheck:
    """transfer.json ``integrity`` of a PD cell whose plan switched the digests on (module doc)."""

    name: str = "integrity"

    def applies(self, kind: str) -> bool:
        return kind != "ref"

    def fails(self, files: CellFiles) -> list[str]:
        tr = files.get(layout.TRANSFER_FILE)
        if tr is None or not planned(files):
            return []  # TransferCheck fails a missing transfer.json
        return integrity_reasons(tr.get("integrity"), files.where(layout.TRANSFER_FILE), planned_push(files))
