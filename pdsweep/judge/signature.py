"""An expected failure explains only what its ``match:`` signature names (issue 59): the
signature is searched in the gate's reasons, the status reason and the failing instance's log
tail, and a lost result (a results file missing or unreadable, a metric missing) must itself
match it, or the cell is FAIL listing what the expectation does not explain: a drill whose
expectation names the UCX transport does not hide a deleted accuracy.json."""

from __future__ import annotations

import re
from typing import Any

from pdsweep.judge.facts import CellFiles
from pdsweep.sweepfile.matrix import TRIVIAL_TEXTS

LOST_MARK = "(metric missing"  # TransferCheck, ReadPatternCheck: a value the file should hold


def signature_matches(pattern: str, reasons: list[str], status: dict[str, Any]) -> bool:
    """``pattern`` (a ``match:`` regex) found in the reasons, status reason or log tail; an
    unusable pattern, or one that matches a trivial text such as the empty string
    (:data:`~pdsweep.sweepfile.matrix.TRIVIAL_TEXTS`, refused by validate), never matches (fail closed)."""
    text = "\n".join([*reasons, str(status.get("reason") or ""), *map(str, status.get("log_tail") or [])])
    try:
        rx = re.compile(pattern)
    except re.error:
        return False
    return not any(rx.search(t) for t in TRIVIAL_TEXTS) and rx.search(text) is not None


def unexplained_losses(pattern: str, reasons: list[str], files: CellFiles) -> list[str]:
    """The reasons that report a lost result (:meth:`CellFiles.problem` of a file, or a
    missing metric) and that ``pattern`` does not match on their own."""
    lost = {files.problem(name) for name in files.problems}
    return [r for r in reasons if (r in lost or LOST_MARK in r) and not signature_matches(pattern, [r], {})]
