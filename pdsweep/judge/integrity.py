"""The KV integrity gate: transfer.json ``integrity`` (:mod:`pdsweep.measure.integrity`, from the
digests of :mod:`pdsweep.engine.kvdigest`).

Applies to a PD cell whose plan switched the digests on (cell.json ``instances[].env``
``PDSWEEP_KV_DIGEST=1``: every PD instance on CPU, :func:`pdsweep.plan.instance.instances`);
what the file must hold comes from that, never from the file. Fails when

- ``integrity`` is absent or says ``not_measured``: "integrity: not measured (why)" (fail closed);
- nothing was compared (``compared`` 0 or ``matched`` 0), the READs failed on purpose aside;
- any block is ``mismatched``, ``stale`` or ``missing``: one reason each, naming the first
  request, group (``<index>:<kv|mla|ssm-conv|ssm-temporal>``), prefill rank and block (``missing``:
  also every group with the prefill ranks it is missing from);
- any READ NIXL refused to prepare (``refused_reads``): naming the block of the first descriptor
  whose decode and prefill lengths differ.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pdsweep.core.faults import KV_DIGEST_ENV_VAR
from pdsweep.core.stats import obj
from pdsweep.judge.facts import CellFiles, show
from pdsweep.results import layout

_WHAT = {
    "mismatched": "decode's bytes differ from what prefill offered",
    "stale": "decode read bytes prefill offered for another request (a reused block)",
    "missing": "prefill offered them, decode never read them (nor an equal replica from another prefill rank)",
}


def planned(files: CellFiles) -> bool:
    """The plan switched the KV digests on for this cell (cell.json instances' env)."""
    instances = obj(files.get(layout.CELL_FILE)).get("instances")
    return isinstance(instances, list) and any(
        obj(obj(i).get("env")).get(KV_DIGEST_ENV_VAR) == "1" for i in instances if isinstance(i, dict)
    )


def integrity_reasons(integ: Any, where: str) -> list[str]:
    """The reasons ``integ`` (transfer.json ``integrity``) fails; empty when it passes."""
    if not isinstance(integ, dict):
        return [f"{where}: integrity: not measured (integrity is {show(integ)}; the plan switched the KV digests on)"]
    if integ.get("not_measured"):
        return [f"{where}: integrity: not measured ({integ['not_measured']})"]
    counts = {k: integ.get(k) for k in ("compared", "matched", "mismatched", "missing", "stale")}
    if any(not isinstance(v, int) or isinstance(v, bool) or v < 0 for v in counts.values()):
        return [f"{where}: integrity: impossible counts {show(counts)} (allowed: whole numbers >= 0)"]
    out = []
    first = obj(integ.get("first"))
    if refused := integ.get("refused_reads"):
        f = obj(first.get("refused"))
        out.append(
            f"{where}: integrity: {refused} READ(s) NIXL refused to prepare (vLLM transfer_setup_failed); first: "
            f"request {f.get('request')} group {f.get('group')} prefill rank {f.get('prefill_rank')} block "
            f"{f.get('block')} (decode's descriptor {f.get('local_bytes')} B, prefill's {f.get('remote_bytes')} B): "
            "that KV never arrived"
        )
    for kind in ("mismatched", "stale", "missing"):
        if counts[kind]:
            f = obj(first.get(kind))
            out.append(
                f"{where}: integrity: {counts[kind]} {kind} block(s) of {counts['compared']}; first: request "
                f"{f.get('request')} group {f.get('group')} prefill rank {f.get('prefill_rank')} block {f.get('block')}"
                f" ({_WHAT[kind]})" + (_by_group(integ.get("missing_by_group")) if kind == "missing" else "")
            )
    if not out and not counts["matched"]:
        apart = f"{integ.get('failed_on_purpose', 0)} block(s) of failed READs"
        apart += f", {integ.get('unread_requests', 0)} unread request(s)"
        out.append(f"{where}: integrity: no block compared and matched ({apart}; allowed: matched > 0)")
    return out


def _by_group(by_group: Any) -> str:
    """``; missing (group: prefill ranks): 0:ssm-conv: 0,1; ...`` from ``missing_by_group``."""
    if not isinstance(by_group, dict) or not by_group:
        return ""
    parts = [f"{g}: {','.join(str(r) for r in ranks)}" for g, ranks in by_group.items() if isinstance(ranks, list)]
    return "; missing (group: prefill ranks): " + "; ".join(parts)


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
        return integrity_reasons(tr.get("integrity"), files.where(layout.TRANSFER_FILE))
