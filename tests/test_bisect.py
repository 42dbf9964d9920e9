"""``pdsweep bisect``: bisection order over builds, and one cell run for real on fake builds
(tests/fake_vllm.py) whose "bad" builds lose the KV (FAKE_DIVERGE)."""

from __future__ import annotations

import stat
import sys
from pathlib import Path

import pytest
from _fakes import build_tokenizer
from test_run_fake import FAKE_PY, make_sweep

from pdsweep.cli import main
from pdsweep.core.errors import UserError
from pdsweep.history.bisect import Bisection, Step, bisect, bisection_order, cause, run_cell_for_real


def test_bisection_runs_both_ends_then_halves() -> None:
    good = [True] * 6 + [False] * 4  # first bad: index 6
    seen: list[int] = []

    def verdict(i: int) -> bool:
        seen.append(i)
        return good[i]

    bisection_order(10, verdict)
    assert seen[:2] == [0, 9] and len(seen) <= 2 + 4 and {5, 6} <= set(seen)
    seen.clear()
    bisection_order(10, verdict, run_all=True)
    assert seen == list(range(10))


def test_first_bad_needs_a_tested_good_neighbour() -> None:
    b = Bisection(["g", "m", "b"], [Step("g", "PASS", True), Step("b", "FAIL", False)])
    assert b.first_bad is None  # m not run: no answer
    b.steps.append(Step("m", "FAIL", False, "decode died"))
    assert b.first_bad == "m" and "bisect: first bad build: m" in b.lines()[0]
    ends = Bisection(["g", "b"], [Step("g", "FAIL", False)])
    assert "the good end g fails" in ends.lines()[0]


def _bad_python(tmp: Path, name: str) -> Path:
    """A fake build whose decode loses the KV it was sent (its first token shifts)."""
    p = tmp / name
    p.write_text(f'#!/usr/bin/env bash\nexport FAKE_DIVERGE=1\nexec {FAKE_PY} "$@"\n')
    p.chmod(p.stat().st_mode | stat.S_IEXEC)
    return p


def test_bisect_names_the_first_bad_fake_build(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PDSWEEP_REAL_PYTHON", sys.executable)
    tok = build_tokenizer(tmp_path / "tok")
    sweep = make_sweep(tmp_path, tok, matrix="  model: [fake-gqa]\n  tp: [p1d1]\n  build: [fixed]\n  env: [base]")
    cell = "fake-gqa.p1d1.b16-16.fixed"
    builds = [f"python:{FAKE_PY}", f"python:{_bad_python(tmp_path, 'b1')}", f"python:{_bad_python(tmp_path, 'b2')}"]
    out = tmp_path / "bisect"
    result = bisect(sweep, cell, builds, out, run_cell_for_real)
    assert [s.build for s in result.steps] == [builds[0], builds[2], builds[1]]  # ends, then the middle
    assert [s.verdict for s in result.steps] == ["PASS", "FAIL", "FAIL"]
    assert result.first_bad == builds[1] and (out / "bisect.json").is_file()
    assert "consistency" in result.step(builds[1]).reason  # type: ignore[union-attr]
    with pytest.raises(UserError, match="already holds a run; pass --resume"):
        bisect(sweep, cell, builds, out, run_cell_for_real)
    status = next(out.glob("00-*/run")) / cell / "status.json"
    before = status.stat().st_mtime_ns
    again = bisect(sweep, cell, builds, out, run_cell_for_real, resume=True)
    assert [s.verdict for s in again.steps] == ["PASS", "FAIL", "FAIL"] and again.first_bad == builds[1]
    assert status.stat().st_mtime_ns == before  # the final step was read back, not rerun
    with pytest.raises(UserError, match="not a build of the sweep"):
        bisect(sweep, cell, ["fixed", "nosuch"], tmp_path / "x", run_cell_for_real)
    assert main(["bisect", str(tmp_path / "none.yaml"), "--cells", cell, "--good", "fixed", "--bad", "x"]) == 2


def test_a_cell_that_passed_after_a_redeploy_is_a_good_build(tmp_path: Path) -> None:
    sweep = tmp_path / "s.yaml"
    sweep.write_text("builds: {fixed: {}}\nmodels_file: models.yaml\n")

    def run_cell(_sweep: Path, _cell: str, run_dir: Path, _resume: bool) -> tuple[str, str]:
        return ("FLAKY", "attempt 1 hung") if run_dir.parent.name.startswith("00") else ("FAIL", "decode died")

    result = bisect(sweep, "m.p2d1.b16-16.fixed", ["fixed", "venv:/opt/bad"], tmp_path / "out", run_cell)
    assert result.steps[0].good and result.first_bad == "venv:/opt/bad"
    assert result.lines()[0] == "bisect: first bad build: venv:/opt/bad"


def test_each_step_names_its_cause_and_the_good_and_bad_builds_are_listed() -> None:
    reason = (
        'c/status.json: failed in phase ready: first request: HTTP 500: {"error":{"message":"decode ... '
        + "x" * 300
        + '"}}; decode-0 (still running): KeyError: (-2, 16) at vllm/distributed/kv_transfer/kv_connector/v1/nixl/'
        "pull_worker.py:330 _read_blocks_for_req (local_xfer_side_handle = ...) in Worker pid=9260"
    )
    assert cause(reason).startswith("decode-0 (still running): KeyError: (-2, 16) at vllm/")
    assert cause("prefill-0 (pid 7) killed by signal 9 (SIGKILL) during eval; lm-eval: 502") == (
        "prefill-0 (pid 7) killed by signal 9 (SIGKILL) during eval"
    )
    assert cause("no instance named " + "y" * 300) == "no instance named " + "y" * 181 + "…"
    b = Bisection(
        ["g", "m", "b"], [Step("g", "PASS", True), Step("m", "FLAKY", True), Step("b", "FAIL", False, reason)]
    )
    assert b.lines()[3] == f"  b: FAIL ({cause(reason)})"
    assert b.lines()[-2:] == ["  good: g, m", "  bad: b"]
