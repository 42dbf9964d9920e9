"""Issue 15, "fail closed everywhere", the sections of modules whose test files are still to be
named: metric values that cannot be real (pdsweep.judge.transfer), matrix semantics
(pdsweep.plan.expand), the compare key (pdsweep.plan.cell) and the GPU pool's port range
(pdsweep.plan.schedule). The issue's other sections are in the test file of their module
(test_run_feasible, test_commands_validate, test_spec_yamlfile, test_spec_guards, test_spec_axes,
test_spec_catalogue, test_results_layout, test_results_outputs, test_judge_gate, test_judge_facts,
test_core_errors)."""

from __future__ import annotations

import dataclasses
import json
import tempfile
from pathlib import Path

import pytest
from _sweepfiles import bad, good, write
from fixtures.make_runs import TR, case, pd, totals, write_run
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdsweep.cli import main
from pdsweep.core.errors import UserError
from pdsweep.judge.gate import FAIL, PASS, gate_run
from pdsweep.judge.transfer import impossible_totals
from pdsweep.plan.expand import expand
from pdsweep.run.feasible import feasibility_warnings
from pdsweep.spec.sweep import load_sweep

REPO = Path(__file__).resolve().parent.parent

HC = [HealthCheck.function_scoped_fixture]


CELL = pd("tiny-llama", 1, 1)
WHERE = f"{CELL.id}/{TR}"


# ---------------------------------------------------------------- 1. metric values that cannot be real
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


# ---------------------------------------------------------------- 5. names, ids and paths


def test_compare_key_drops_only_the_build_part() -> None:
    c = dataclasses.replace(pd("m.fixed", 1, 1, "fixed"), serve_args="fixed")
    assert (c.id, c.compare_key) == ("m.fixed.p1d1.b16-16.fixed.fixed", "m.fixed.p1d1.b16-16.fixed")


# ---------------------------------------------------------------- 7. bounds


def test_gpu_count_and_port_range(capsys) -> None:
    from pdsweep.plan.schedule import GpuPool

    with pytest.raises(SystemExit) as e:
        main(["plan", str(REPO / "sweeps" / "cpu-smoke.yaml"), "--gpus", "-1"])
    assert e.value.code == 2 and "-1 GPUs: allowed 0..4096" in capsys.readouterr().err
    with pytest.raises(UserError, match="reach port 80199, past 65535"):
        GpuPool(301, 20000)
    assert GpuPool(8, 60000).port_base == 60000


# ---------------------------------------------------------------- 8. matrix semantics
MATRIX = "name: x\nplatform: cpu\nmatrix:\n  model: [tiny-llama, tiny-mla]\n  tp: [p1d1]\n  block_size: [32]\n"


def test_include_that_replaces_axis_cells_is_an_error(tmp_path: Path, capsys) -> None:
    msg = bad(tmp_path, MATRIX + "  include:\n    - {model: tiny-llama, num_decode: 2}\n", capsys)
    assert "matrix.include[0] sets num_decode (not an axis) on 1 product combination(s)" in msg
    assert "make num_decode an axis" in msg


def test_include_that_adds_a_cell_or_an_expectation_is_fine(tmp_path: Path, capsys) -> None:
    body = MATRIX + (
        "  include:\n    - {model: tiny-mla, tp: p1d1, expect: fail, reason: known, match: x}\n"
        "    - {model: tiny-nemotron-h, tp: p1d1, block_size: 64}\n"
    )
    assert "valid: 3 PD cells" in good(tmp_path, body, capsys)


def test_exclude_matching_nothing_warns(tmp_path: Path, capsys) -> None:
    p = write(tmp_path, MATRIX + "  exclude:\n    - {model: tiny-llama, tp: p2d1}\n")
    assert main(["validate", str(p)]) == 0
    assert "matrix.exclude[0] {'model': 'tiny-llama', 'tp': 'p2d1'} matches no combination" in capsys.readouterr().err


@given(
    st.sampled_from(["tiny-llama", "tiny-mla", "tiny-qwen3-next"]),
    st.sampled_from(
        [("num_decode", 2), ("decode_dp", 2), ("kv_buffer_device", "cpu"), ("serve_args", "base"), ("expect", "fail")]
    ),
)
@settings(max_examples=15, deadline=None, suppress_health_check=HC)
def test_property_an_include_never_silently_replaces_a_cell(tmp_path: Path, model: str, kv: tuple) -> None:
    """Either the include's cell-defining keys leave every product cell in the plan (added or
    extended with an expectation), or validate refuses it."""
    key, value = kv
    extra = ", reason: r, match: any" if key == "expect" else ""
    body = MATRIX + f"  include:\n    - {{model: {model}, {key}: {value}{extra}}}\n"
    root = Path(tempfile.mkdtemp(dir=tmp_path))
    plan = expand(load_sweep(write(root, body)))
    product = {f"{m}.p1d1.b32-32.fixed" for m in ("tiny-llama", "tiny-mla")}
    ids = {c.id for c in plan.cells} | {r.cell.id for r in plan.rejected}
    try:
        feasibility_warnings(plan, tasks=False)
    except UserError as e:
        assert "replaces those cells" in str(e) and not product <= ids
    else:
        assert product <= ids
