"""pdsweep.run.feasible: a sweep whose cells cannot pass (no reference, no expected score, a
required check disabled) is refused at validate; every shipped sweep can pass; an include that
replaces product cells is refused and an exclude that matches nothing warns (issue 15)."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
from _sweepfiles import SMALL, bad, good, write
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdsweep.cli import main
from pdsweep.core.errors import UserError
from pdsweep.judge.accuracy import load_expected
from pdsweep.plan.expand import expand, reference_of
from pdsweep.run.feasible import cannot_pass, feasibility_warnings
from pdsweep.sweepfile.sweep import load_sweep

REPO = Path(__file__).resolve().parent.parent


SHIPPED = sorted(p for p in (REPO / "sweeps").glob("*.yaml") if p.name != "models.yaml")


HC = [HealthCheck.function_scoped_fixture]


# a model without an expected pdsweep_arith score (trained tiny-llama has one)
UNSCORED = SMALL.replace("tiny-llama", "tiny-nemotron-h-g1")


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.name)
def test_every_shipped_sweep_can_pass_in_principle(path: Path) -> None:
    """Each PD cell not expected to fail has what each gate check needs: a reference cell
    in the plan for consistency, an expected score or a reference for every task."""
    plan = expand(load_sweep(path))
    s, ids = plan.loaded.sweep, {c.id for c in plan.cells}
    expected = load_expected()
    assert plan.pd_cells and cannot_pass(plan) == []
    for c in (c for c in plan.pd_cells if not c.expect_fail):
        ref = reference_of(c, plan.loaded).id  # the variant's `reference:` (e.g. base) where it names one
        if s.gate.require_consistency:
            assert s.eval.consistency.enabled and ref in ids, c.id
        if s.gate.require_accuracy:
            assert s.eval.tasks
            for t in s.eval.tasks:
                assert t in expected.get(c.model, {}) or ref in ids, (c.id, t)


def test_upstream_sweep_validates_without_contradiction(capsys) -> None:
    assert main(["validate", str(REPO / "sweeps" / "upstream-config-sweep.yaml")]) == 0
    assert "valid: 20 PD cells, 0 reference cells" in capsys.readouterr().out  # 20: + run_mamba_prefix_cache_test.sh


def test_consistency_without_reference_is_refused(tmp_path: Path, capsys) -> None:
    msg = bad(tmp_path, SMALL + "eval: {reference: false}\n", capsys)
    assert "gate.require_consistency is true but eval.reference is false" in msg


def test_consistency_required_but_disabled_is_refused(tmp_path: Path, capsys) -> None:
    msg = bad(tmp_path, SMALL + "eval: {consistency: {enabled: false}}\n", capsys)
    assert "gate.require_consistency is true but eval.consistency.enabled is false" in msg


def test_accuracy_without_expected_score_or_reference_is_refused(tmp_path: Path, capsys) -> None:
    msg = bad(
        tmp_path,
        UNSCORED + "eval: {reference: false, consistency: {enabled: false}}\ngate: {require_consistency: false}\n",
        capsys,
    )
    assert "model tiny-nemotron-h-g1: no expected score for task(s) pdsweep_arith" in msg


@given(st.booleans(), st.booleans(), st.booleans(), st.booleans(), st.booleans())
@settings(max_examples=32, deadline=None, suppress_health_check=HC)
def test_property_validate_refuses_exactly_the_contradictions(
    tmp_path: Path, reference: bool, probe: bool, req_con: bool, req_acc: bool, tasks: bool
) -> None:
    body = UNSCORED + (
        f"eval: {{reference: {str(reference).lower()}, tasks: {'[pdsweep_arith]' if tasks else '[]'}, "
        f"consistency: {{enabled: {str(probe).lower()}}}}}\n"
        f"gate: {{require_consistency: {str(req_con).lower()}, require_accuracy: {str(req_acc).lower()}}}\n"
    )
    root = Path(tempfile.mkdtemp(dir=tmp_path))
    plan = expand(load_sweep(write(root, body)))
    # tiny-nemotron-h-g1 has no expected score: accuracy can pass only against a reference
    contradiction = (req_con and not (probe and reference)) or (req_acc and not (tasks and reference))
    assert bool(cannot_pass(plan)) == contradiction


# ---------------------------------------------------------------- matrix semantics
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
