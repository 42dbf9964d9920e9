"""Issue 15, "fail closed everywhere": one section per kind of fault, each with the
reported examples and a hypothesis property that generates such inputs."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import pytest
from fixtures.make_runs import TR, case, pd, totals, write_run
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdsweep.accuracy import load_expected
from pdsweep.cli import main
from pdsweep.feasible import cannot_pass, preflight
from pdsweep.gate import FAIL, PASS, gate_run, impossible_totals
from pdsweep.plan import expand
from pdsweep.spec import load_sweep

REPO = Path(__file__).resolve().parent.parent
SHIPPED = sorted(p for p in (REPO / "sweeps").glob("*.yaml") if p.name != "models.yaml")

HC = [HealthCheck.function_scoped_fixture]


def write(tmp_path: Path, body: str, models: str | None = None) -> Path:
    (tmp_path / "models.yaml").write_text(models or (REPO / "sweeps" / "models.yaml").read_text())
    p = tmp_path / "s.yaml"
    p.write_text(body)
    return p


def bad(tmp_path: Path, body: str, capsys, models: str | None = None) -> str:
    """``pdsweep validate`` on ``body``: exit 2, no traceback; returns stderr."""
    assert main(["validate", str(write(tmp_path, body, models))]) == 2
    out = capsys.readouterr()
    assert "Traceback" not in out.err and out.err.startswith("error: ")
    return out.err


def good(tmp_path: Path, body: str, capsys, models: str | None = None) -> str:
    assert main(["validate", str(write(tmp_path, body, models))]) == 0, capsys.readouterr().err
    return capsys.readouterr().out


SMALL = "name: x\nplatform: cpu\nmatrix: {model: [tiny-llama], tp: [p1d1], block_size: [32]}\n"
CELL = pd("tiny-llama", 1, 1)
WHERE = f"{CELL.id}/{TR}"


# ---------------------------------------------------------------- 1. metric values that cannot be real
def gate_totals(root: Path, **t) -> tuple[str, tuple[str, ...]]:
    r = gate_run(write_run(root, "run", [case(CELL, totals(**t))])).cell(CELL.id)
    return r.verdict, r.reasons


@pytest.mark.parametrize("field, value, why", [
    ("failed_transfers", -1, "totals.failed_transfers = -1: negative (allowed: >= 0)"),
    ("failed_notifications", -3, "totals.failed_notifications = -3: negative (allowed: >= 0)"),
    ("num_transfers", 2.5, "totals.num_transfers = 2.5: a count must be a whole number"),
    ("bytes", "300", 'totals.bytes is "300": not a finite number'),
    ("failed_transfers", True, "totals.failed_transfers is true: not a finite number"),
    ("num_transfers", 10**400, "not a finite number"),
    ("gbps_xfer", -0.5, "totals.gbps_xfer = -0.5: negative (allowed: >= 0)"),
])
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
BAD = st.one_of(st.integers(max_value=-1), st.floats(max_value=-1e-9, allow_nan=False, allow_infinity=False),
                st.floats(min_value=0.01, max_value=1e6).filter(lambda x: x != int(x)),
                st.text(max_size=5), st.booleans(), st.integers(min_value=2**1100, max_value=2**1200))


@given(COUNTS, BAD)
@settings(max_examples=60, deadline=None)
def test_property_impossible_counts_are_named(field: str, value) -> None:
    (why,) = impossible_totals({field: value}, "c/transfer.json")
    assert why.startswith(f"c/transfer.json: totals.{field}")


@given(st.integers(1, 10**6), st.integers(1, 10**12))
@settings(max_examples=20, deadline=None, suppress_health_check=HC)
def test_property_plausible_counts_pass(tmp_path: Path, n: int, nbytes: int) -> None:
    root = Path(tempfile.mkdtemp(dir=tmp_path))
    assert gate_totals(root, num_transfers=n, bytes=nbytes) == (PASS, ())
    assert json.loads((root / "run" / CELL.id / TR).read_text())["totals"]["bytes"] == nbytes


# ---------------------------------------------------------------- 2. sweeps that cannot pass
@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.name)
def test_every_shipped_sweep_can_pass_in_principle(path: Path) -> None:
    """Each PD cell not expected to fail has what each gate check needs: a reference cell
    in the plan for consistency, an expected score or a reference for every task."""
    plan = expand(load_sweep(path))
    s, ids = plan.loaded.sweep, {c.id for c in plan.cells}
    expected = load_expected()
    assert plan.pd_cells and cannot_pass(plan) == []
    for c in (c for c in plan.pd_cells if not c.expect_fail):
        if s.gate.require_consistency:
            assert s.eval.consistency.enabled and c.reference(s.defaults.build).id in ids, c.id
        if s.gate.require_accuracy:
            assert s.eval.tasks
            for t in s.eval.tasks:
                assert t in expected.get(c.model, {}) or c.reference(s.defaults.build).id in ids, (c.id, t)


def test_upstream_sweep_validates_without_contradiction(capsys) -> None:
    assert main(["validate", str(REPO / "sweeps" / "upstream-config-sweep.yaml")]) == 0
    assert "valid: 19 PD cells, 0 reference cells" in capsys.readouterr().out


def test_consistency_without_reference_is_refused(tmp_path: Path, capsys) -> None:
    msg = bad(tmp_path, SMALL + "eval: {reference: false}\n", capsys)
    assert "gate.require_consistency is true but eval.reference is false" in msg


def test_consistency_required_but_disabled_is_refused(tmp_path: Path, capsys) -> None:
    msg = bad(tmp_path, SMALL + "eval: {consistency: {enabled: false}}\n", capsys)
    assert "gate.require_consistency is true but eval.consistency.enabled is false" in msg


def test_accuracy_without_expected_score_or_reference_is_refused(tmp_path: Path, capsys) -> None:
    msg = bad(tmp_path, SMALL + "eval: {reference: false, consistency: {enabled: false}}\n"
              "gate: {require_consistency: false}\n", capsys)
    assert "model tiny-llama: no expected score for task(s) pdsweep_arith" in msg


@given(st.booleans(), st.booleans(), st.booleans(), st.booleans(), st.booleans())
@settings(max_examples=32, deadline=None, suppress_health_check=HC)
def test_property_validate_refuses_exactly_the_contradictions(tmp_path: Path, reference: bool, probe: bool,
                                                              req_con: bool, req_acc: bool, tasks: bool) -> None:
    body = SMALL + (f"eval: {{reference: {str(reference).lower()}, tasks: {'[pdsweep_arith]' if tasks else '[]'}, "
                    f"consistency: {{enabled: {str(probe).lower()}}}}}\n"
                    f"gate: {{require_consistency: {str(req_con).lower()}, require_accuracy: {str(req_acc).lower()}}}\n")
    root = Path(tempfile.mkdtemp(dir=tmp_path))
    plan = expand(load_sweep(write(root, body)))
    # tiny-llama has no expected score: accuracy can pass only against a reference
    contradiction = (req_con and not (probe and reference)) or (req_acc and not (tasks and reference))
    assert bool(cannot_pass(plan)) == contradiction


# ---------------------------------------------------------------- 3. validate runs every check plan/run runs
def test_unknown_lm_eval_task_is_found_at_validate(tmp_path: Path, capsys) -> None:
    msg = bad(tmp_path, SMALL + "eval: {tasks: [gsm8k, gsm9k]}\n", capsys)
    assert "eval.tasks: unknown lm-eval task(s) ['gsm9k']" in msg


def test_unknown_pdsweep_task_needs_no_lm_eval_index(tmp_path: Path, capsys) -> None:
    assert "unknown lm-eval task(s) ['pdsweep_arithm']" in bad(tmp_path, SMALL + "eval: {tasks: [pdsweep_arithm]}\n",
                                                               capsys)


def test_empty_probe_lengths_are_refused(tmp_path: Path, capsys) -> None:
    assert "eval.consistency.lengths" in bad(tmp_path, SMALL + "eval: {consistency: {lengths: []}}\n", capsys)


def test_probe_length_beyond_the_context_is_found_at_validate(tmp_path: Path, capsys) -> None:
    msg = bad(tmp_path, SMALL + "eval: {consistency: {lengths: [100000]}}\n", capsys)
    assert "eval.consistency.lengths: 100000 tokens is outside 1..503" in msg and "tiny-llama.p1d1" in msg


def test_tiny_geometry_missing_names_the_real_catalogue(tmp_path: Path, capsys) -> None:
    models = ("models:\n  t:\n    tiny: {kind: llama}\n    architecture: LlamaForCausalLM\n"
              "    attention: gqa\n    num_layers: 2\n    platforms: {cpu: {}}\n")
    msg = bad(tmp_path, "name: x\nplatform: cpu\nmatrix: {model: [t], tp: [p1d1], block_size: [32]}\n", capsys, models)
    assert msg.startswith(f"error: {tmp_path / 'models.yaml'}: models.t: tiny checkpoint needs")


def test_build_python_that_does_not_exist_is_refused(tmp_path: Path, capsys) -> None:
    msg = bad(tmp_path, SMALL.replace("matrix:", "builds: {fixed: {python: /nope/bin/python}}\nmatrix:"), capsys)
    assert "builds.fixed.python: /nope/bin/python is not an executable file" in msg


def test_build_venv_not_built_yet_is_a_warning(tmp_path: Path, capsys) -> None:
    p = write(tmp_path, SMALL.replace("matrix:", "builds: {fixed: {venv: .venv-nope}}\nmatrix:"))
    assert main(["validate", str(p)]) == 0
    assert "warning: " in capsys.readouterr().err
    assert preflight(expand(load_sweep(p)), tasks=False)[0].endswith("until then cells of build fixed fail")
