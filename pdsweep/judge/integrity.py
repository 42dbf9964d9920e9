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
  and any ``unwritten`` decode block (a descriptor no WRITE of the request covered);
- the file's shape is not the plan's (:func:`plan_reasons`): a push ``mode`` in a pull cell, or a ``sample`` /
  ``sampled_out`` other than the plan's fraction (``PDSWEEP_KV_DIGEST_SAMPLE``; absent: every request).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

from pdsweep.core.faults import KV_DIGEST_ENV_VAR
from pdsweep.core.kvintegrity import integrity_reasons
from pdsweep.core.kvsample import SAMPLE_ENV_VAR, parse_fraction
from pdsweep.core.stats import num, obj
from pdsweep.judge.facts import CellFiles
from pdsweep.plan.instance import transfer_mode
from pdsweep.results import layout


def _instances(files: CellFiles) -> list[dict[str, Any]]:
    """cell.json's instance records (what the plan launched); none where the file or the list is damaged."""
    instances = obj(files.get(layout.CELL_FILE)).get("instances")
    return [i for i in instances if isinstance(i, dict)] if isinstance(instances, list) else []


def planned_push(files: CellFiles) -> bool:
    """The plan made this a push cell (an instance's ``--kv-transfer-config`` names ``NixlPushConnector``)."""
    return any(transfer_mode([str(a) for a in i.get("argv") or []]) == "push" for i in _instances(files))


def planned(files: CellFiles) -> bool:
    """The plan switched the KV digests on for this cell: cell.json instances' env, or its cell record on CPU
    (the plan digests every PD cell there, :func:`pdsweep.plan.instance.instance_env`; an instance env
    without the variable, e.g. a damaged cell.json, asks no less of a CPU PD cell)."""
    cell = obj(obj(files.get(layout.CELL_FILE)).get("cell"))
    if cell.get("platform") == "cpu" and cell.get("kind") not in (None, "ref"):
        return True
    return any(obj(i.get("env")).get(KV_DIGEST_ENV_VAR) == "1" for i in _instances(files))


def planned_sample(files: CellFiles) -> tuple[float | None, str]:
    """The fraction of requests the plan digests (cell.json instances' ``PDSWEEP_KV_DIGEST_SAMPLE``, absent: 1,
    every request) and how the plan says it; None for a value :func:`pdsweep.core.kvsample.parse_fraction` refuses."""
    envs = [obj(i.get("env")) for i in _instances(files)]
    raw = sorted({str(e[SAMPLE_ENV_VAR]) for e in envs if SAMPLE_ENV_VAR in e})
    try:
        return min((parse_fraction(r) for r in raw), default=1.0), f"{SAMPLE_ENV_VAR} {' '.join(raw) or 'absent'}"
    except ValueError:
        return None, f"{SAMPLE_ENV_VAR} {' '.join(raw)}"


def plan_reasons(integ: Any, where: str, push: bool, plan: tuple[float | None, str]) -> list[str]:
    """Where ``integ`` (transfer.json ``integrity``) is not what the plan asks of it: a ``mode`` in a pull cell
    (push's judge writes it, :mod:`pdsweep.core.kvpush`), or a ``sample``/``sampled_out`` other than the plan's
    fraction ``plan`` (:func:`planned_sample`; runs from before sampling carry neither: every request)."""
    if not isinstance(integ, dict) or integ.get("not_measured"):
        return []  # integrity_reasons says why
    out = []
    if not push and "mode" in integ:
        out.append(f"{where}: integrity: mode {_show(integ['mode'])} in a pull cell (allowed: no mode; the plan "
                   "launches NixlConnector)")  # fmt: skip
    fraction, said = plan
    sample, n_out = integ.get("sample", 1.0), integ.get("sampled_out", 0)
    whole = isinstance(n_out, int) and not isinstance(n_out, bool) and n_out >= 0
    if (
        fraction is None
        or num(sample) is None
        or not math.isclose(sample, fraction)
        or not whole
        or (fraction >= 1 and n_out)
    ):
        allowed = f"sample {fraction:g}" + (", sampled_out 0" if fraction == 1 else "") if fraction else "0 < f <= 1"
        out.append(
            f"{where}: integrity: sample {_show(sample)} with {_show(n_out)} request(s) sampled out, but the plan "
            f"digests {fraction if fraction is None else format(fraction, 'g')} of requests (cell.json {said}; "
            f"allowed: {allowed})"
        )
    return out


def _show(x: Any) -> str:
    return json.dumps(x, default=str)


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
        integ, where, push = tr.get("integrity"), files.where(layout.TRANSFER_FILE), planned_push(files)
        return plan_reasons(integ, where, push, planned_sample(files)) + integrity_reasons(integ, where, push)
