"""pdsweep.judge.transfer: metric values in transfer.json that cannot be real fail the cell naming
the field (issue 15); the read pattern, reads_by_prefill_rank against vLLM's read plan
(pdsweep.plan.readplan), fails a hybrid p2d1 cell whose decode read one prefill rank (issue 23)."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import pytest
from fixtures.make_runs import HYBRID, TR, case, edit, one, pd, totals, write_run
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdsweep.cli import main
from pdsweep.judge.gate import FAIL, PASS, gate_run
from pdsweep.judge.transfer import impossible_totals
from pdsweep.results import layout

HC = [HealthCheck.function_scoped_fixture]


CELL = pd("tiny-llama", 1, 1)
WHERE = f"{CELL.id}/{TR}"


# ---------------------------------------------------------------- metric values that cannot be real
def gate_totals(root: Path, **t) -> tuple[str, tuple[str, ...]]:
    r = gate_run(write_run(root, "run", [case(CELL, totals(**t))])).cell(CELL.id)
    return r.verdict, r.reasons


@pytest.mark.parametrize(
    "field, value, why",
    [
        ("failed_transfers", -1, "totals.failed_transfers = -1: negative (allowed: >= 0)"),
        ("failed_notifications", -3, "totals.failed_notifications = -3: negative (allowed: >= 0)"),
        ("num_transfers", 2.5, "totals.num_transfers = 2.5: a count must be a whole number"),
        ("bytes", "300", 'totals.bytes is "300": not a finite number'),
        ("failed_transfers", True, "totals.failed_transfers is true: not a finite number"),
        ("num_transfers", 10**400, "not a finite number"),
        ("gbps_xfer", -0.5, "totals.gbps_xfer = -0.5: negative (allowed: >= 0)"),
    ],
)
def test_impossible_transfer_values_fail_the_cell(tmp_path: Path, field: str, value, why: str) -> None:
    verdict, reasons = gate_totals(tmp_path, **{field: value})
    assert verdict == FAIL
    assert any(r.startswith(f"{WHERE}: totals.{field}") and why in r for r in reasons), reasons


def test_huge_integer_in_results_is_a_verdict_not_a_traceback(tmp_path: Path) -> None:
    run = write_run(tmp_path, "run", [case(CELL)])
    path = run / CELL.id / TR
    path.write_text(path.read_text().replace('"failed_transfers": 0', '"failed_transfers": ' + "9" * 400))
    assert gate_run(run).cell(CELL.id).verdict == FAIL


COUNTS = st.sampled_from(["num_transfers", "bytes", "failed_transfers", "failed_notifications", "expired_reqs"])
BAD = st.one_of(
    st.integers(max_value=-1),
    st.floats(max_value=-1e-9, allow_nan=False, allow_infinity=False),
    st.floats(min_value=0.01, max_value=1e6).filter(lambda x: x != int(x)),
    st.text(max_size=5),
    st.booleans(),
    st.integers(min_value=2**1100, max_value=2**1200),
)


@given(COUNTS, BAD)
@settings(max_examples=60, deadline=None)
def test_property_impossible_counts_are_named(field: str, value) -> None:
    (why,) = impossible_totals({field: value}, "c/transfer.json")
    assert why.startswith(f"c/transfer.json: totals.{field}")


@given(st.integers(1, 10**6), st.integers(1, 10**12))
@settings(max_examples=20, deadline=None, suppress_health_check=HC)
def test_property_plausible_counts_pass(tmp_path: Path, n: int, nbytes: int) -> None:
    root = Path(tempfile.mkdtemp(dir=tmp_path))
    assert gate_totals(root, num_transfers=n, kv_requests=n, bytes=nbytes) == (PASS, ())
    assert json.loads((root / "run" / CELL.id / TR).read_text())["totals"]["bytes"] == nbytes


# ---------------------------------------------------------------- the read pattern
def drop_rank(run: Path, cell, rank: str) -> None:
    edit(run / cell.id / TR, lambda d: d["reads_by_prefill_rank"].pop(rank))


def test_hybrid_p2d1_with_one_prefill_ranks_reads_removed_fails_naming_the_read_pattern(tmp_path: Path) -> None:
    run, r = one(tmp_path)
    assert r.verdict == PASS
    drop_rank(run, HYBRID, "1")  # decode read prefill rank 0 only: the signature of the bug #49297 fixed
    r = gate_run(run).cell(HYBRID.id)
    assert r.verdict == FAIL
    assert r.reasons == (
        f"{HYBRID.id}/{TR}: read pattern of p2d1 mla+kda (tp_ratio -2): vLLM's read plan reads prefill ranks "
        "{0: 1, 1: 1} READs per request, seen {0: 100} READs (reads_by_prefill_rank): decode did not read every "
        "rank it must (the split vLLM PR #49297 fixed)",
    )
    assert main(["gate", str(run)]) == 1


def test_read_pattern_proportions_and_missing_split(tmp_path: Path) -> None:
    run, r = one(tmp_path / "a")
    edit(run / HYBRID.id / TR, lambda d: d["reads_by_prefill_rank"]["1"].update(reads=3))  # 3 of 100 requests
    assert "read pattern of p2d1" in gate_run(run).cell(HYBRID.id).reasons[0]
    r = one(tmp_path / "b", {TR: {"reads_by_prefill_rank": None}})[1]
    assert r.verdict == FAIL and "reads_by_prefill_rank is null (metric missing" in r.reasons[0]
    run, r = one(tmp_path / "c", {layout.CELL_FILE: {"model": {"ssm": "none"}}})  # pure MLA
    assert r.verdict == FAIL and "vLLM's read plan reads prefill ranks {0: 1} READs per request" in r.reasons[0]
    drop_rank(run, HYBRID, "1")
    assert gate_run(run).cell(HYBRID.id).verdict == PASS  # pure MLA at tp_ratio < 0 reads one rank
