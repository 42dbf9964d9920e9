"""Stale reads gated (issue 36 item 5, issue 38 shape 1): vLLM's
``vllm:nixl_num_notifications_after_expiry`` is recorded per cell in transfer.json and the
transfer gate holds it at 0, failing closed when the build registers it and it is missing."""

from typing import Any

from pdsweep.builds.fixprobes import NOTIFS_AFTER_EXPIRY
from pdsweep.judge.facts import CellFiles
from pdsweep.judge.transfer import TransferCheck
from pdsweep.measure.metrics import parse, summarize_transfer
from pdsweep.results import layout

W = "c/transfer.json"
OK = {
    "num_transfers": 10,
    "bytes": 4096,
    "failed_transfers": 0,
    "failed_notifications": 0,
    "expired_reqs": 0,
    "notifications_after_expiry": 0,
    "kv_requests": 10,
}


def _fails(totals: dict[str, Any], fixes: dict[str, Any] | None = None) -> list[str]:
    cell_json: dict[str, Any] = {"cell": {"fault": "none"}}
    if fixes is not None:
        cell_json["build"] = {"fixes": fixes}
    files = CellFiles("c", {layout.TRANSFER_FILE: {"totals": totals}, layout.CELL_FILE: cell_json})
    return TransferCheck().fails(files)


def test_prefill_counter_is_summed_into_the_cells_totals() -> None:
    text = (
        "# TYPE vllm:nixl_num_notifications_after_expiry_total counter\n"
        'vllm:nixl_num_notifications_after_expiry_total{engine="0",model_name="m"} 3.0\n'
    )
    t = summarize_transfer({"prefill-0": parse(text), "prefill-1": parse(text.replace("3.0", "2.0"))}, wall_s=1.0)
    assert t["notifications_after_expiry"] == 5
    assert summarize_transfer({"decode-0": parse("")}, wall_s=1.0)["notifications_after_expiry"] is None  # never 0


def test_gate_holds_notifications_after_expiry_at_zero() -> None:
    assert _fails(OK) == []
    assert _fails({**OK, "notifications_after_expiry": 2}) == [
        f"{W}: totals.notifications_after_expiry = 2 (allowed: 0): decode read KV blocks after prefill's "
        f"lease on them expired ({NOTIFS_AFTER_EXPIRY}; the blocks may have been reused: stale reads)"
    ]


def test_missing_counter_fails_unless_the_build_lacks_it() -> None:
    missing = [f"{W}: totals.notifications_after_expiry is null (metric missing: {NOTIFS_AFTER_EXPIRY})"]
    gone = {**OK, "notifications_after_expiry": None}
    assert _fails(gone) == missing  # build not probed: fail closed
    assert _fails(gone, {NOTIFS_AFTER_EXPIRY: True}) == missing  # the build registers it
    assert _fails(gone, {NOTIFS_AFTER_EXPIRY: None}) == missing  # unreadable: unknown, fail closed
    assert _fails(gone, {NOTIFS_AFTER_EXPIRY: False}) == []  # a build before the counter
    assert _fails({k: v for k, v in OK.items() if k != "notifications_after_expiry"}) == missing


def test_real_vllm_cpu_capture_exposes_the_counter() -> None:
    from pathlib import Path

    text = (Path(__file__).parent / "fixtures" / "vllm_cpu" / "decode.metrics.txt").read_text()
    assert parse(text).counters["vllm:nixl_num_notifications_after_expiry"] == 0.0
