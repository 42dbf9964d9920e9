"""The report's KV integrity section (issue 58, docs/integrity.md): per PD cell whose plan switched
the KV digests on, what transfer.json ``integrity`` compared — blocks compared / matched /
mismatched / stale / missing (push: unwritten), the blocks counted apart, the digest and the
per-request cost — or why it was not measured. The gate judges these (``IntegrityCheck``); this
section shows the passing cells' figures too, so a PASS shows the bytes it rests on."""

from __future__ import annotations

from typing import Any

from pdsweep.core.errors import UserError
from pdsweep.judge.gate import GateResult
from pdsweep.results import layout

INTEGRITY_COLUMNS = (
    "cell",
    "verdict",
    "compared",
    "matched",
    "mismatched",
    "stale",
    "missing",
    "unwritten",
    "apart",
    "digest",
    "us/request",
)
INTEGRITY_NOTE = (
    "KV digests of every region decode may read (per request, layer group, prefill rank and block): prefill's "
    "when it offers (pull) or WRITEs (push) the blocks, decode's after the transfer and before its first "
    "decode step. apart: blocks not compared (decode's own prefix cache, READs that failed on purpose, "
    "requests sampled out); unwritten: push only. A cell without its figures here has no transfer.json "
    "(its status reason carries the digests' lines)."
)


def _n(x: Any) -> str:
    return str(x) if isinstance(x, int) and not isinstance(x, bool) else "-"


def integrity_rows(result: GateResult) -> list[tuple[str, ...]]:
    """Rows in :data:`INTEGRITY_COLUMNS` order for every cell whose transfer.json holds ``integrity``
    (a ``not_measured`` one as its reason); unreadable cells are left out (the gate fails them)."""
    rows: list[tuple[str, ...]] = []
    for c in result.cells:
        try:
            transfer = layout.CellDir.of(result.run_dir, c.cell_id).read(layout.TRANSFER_FILE)
        except UserError:
            continue
        integ = (transfer or {}).get("integrity") if isinstance(transfer, dict) else None
        if not isinstance(integ, dict):
            continue
        if integ.get("not_measured"):
            rows.append((c.cell_id, c.verdict, f"not measured: {integ['not_measured']}", *("-",) * 8))
            continue
        apart = sum(v for k in ("prefix_cached", "failed_on_purpose") if isinstance(v := integ.get(k), int))
        impl = ",".join(integ.get("impl") or []) or str(integ.get("source", "-")).split(" (")[0]
        sample = integ.get("sample")
        digest = f"{impl} (sample {sample:g})" if isinstance(sample, (int, float)) and sample < 1 else impl
        cost = (integ.get("cost") or {}).get("us_per_request")
        rows.append(
            (
                c.cell_id,
                c.verdict,
                *(_n(integ.get(k)) for k in ("compared", "matched", "mismatched", "stale", "missing", "unwritten")),
                str(apart) + (f" + {integ['sampled_out']} req sampled out" if integ.get("sampled_out") else ""),
                digest,
                f"{cost:.0f}" if isinstance(cost, (int, float)) else "-",
            )
        )
    return rows
