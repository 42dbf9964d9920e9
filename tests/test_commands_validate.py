"""pdsweep validate runs every check plan and run run: eval tasks, probe lengths, tiny geometry,
build interpreters (issue 15)."""

from __future__ import annotations

import sys
from pathlib import Path

from _sweepfiles import SMALL, bad, write

from pdsweep.cli import main
from pdsweep.plan.expand import expand
from pdsweep.run.feasible import feasibility_warnings
from pdsweep.sweepfile.sweep import load_sweep

REPO = Path(__file__).resolve().parent.parent


def test_unknown_lm_eval_task_is_found_at_validate(tmp_path: Path, capsys) -> None:
    msg = bad(tmp_path, SMALL + "eval: {tasks: [gsm8k, gsm9k]}\n", capsys)
    assert "eval.tasks: unknown lm-eval task(s) ['gsm9k']" in msg


def test_unknown_pdsweep_task_needs_no_lm_eval_index(tmp_path: Path, capsys) -> None:
    assert "unknown lm-eval task(s) ['pdsweep_arithm']" in bad(
        tmp_path, SMALL + "eval: {tasks: [pdsweep_arithm]}\n", capsys
    )


def test_empty_probe_lengths_are_refused(tmp_path: Path, capsys) -> None:
    assert "eval.consistency.lengths" in bad(tmp_path, SMALL + "eval: {consistency: {lengths: []}}\n", capsys)


def test_probe_length_beyond_the_context_is_found_at_validate(tmp_path: Path, capsys) -> None:
    msg = bad(tmp_path, SMALL + "eval: {consistency: {lengths: [100000]}}\n", capsys)
    assert "eval.consistency.lengths: 100000 tokens is outside 1..503" in msg and "tiny-llama.p1d1" in msg


def test_tiny_geometry_missing_names_the_real_catalogue(tmp_path: Path, capsys) -> None:
    models = (
        "models:\n  t:\n    tiny: {kind: llama}\n    architecture: LlamaForCausalLM\n"
        "    attention: gqa\n    num_layers: 2\n    platforms: {cpu: {}}\n"
    )
    msg = bad(tmp_path, "name: x\nplatform: cpu\nmatrix: {model: [t], tp: [p1d1], block_size: [32]}\n", capsys, models)
    assert msg.startswith(f"error: {tmp_path / 'models.yaml'}: models.t: tiny checkpoint needs")


def test_build_python_that_does_not_exist_is_refused(tmp_path: Path, capsys) -> None:
    msg = bad(tmp_path, SMALL.replace("matrix:", "builds: {fixed: {python: /nope/bin/python}}\nmatrix:"), capsys)
    assert "builds.fixed.python: /nope/bin/python is not an executable file" in msg


def test_build_venv_not_built_yet_is_a_warning(tmp_path: Path, capsys) -> None:
    p = write(tmp_path, SMALL.replace("matrix:", "builds: {fixed: {venv: .venv-nope}}\nmatrix:"))
    assert main(["validate", str(p)]) == 0
    assert "warning: " in capsys.readouterr().err
    assert feasibility_warnings(expand(load_sweep(p)), tasks=False)[0].endswith(
        "`make sweep` builds it first, or `make baseline-env`); a `pdsweep run` before then fails the cells of build fixed"
    )


def test_a_relative_venv_is_the_sweep_files_not_the_working_directorys(tmp_path: Path, capsys, monkeypatch) -> None:
    """Issue 59 case 1: a relative builds.X.venv missing beside the sweep file is missing, even when
    the working directory (or pdsweep's checkout) has one of that name; validate warns, run refuses."""
    import pytest

    from pdsweep.core.errors import UserError
    from pdsweep.plan.builds import build_python

    other = tmp_path / "elsewhere"
    (other / ".venv-x" / "bin").mkdir(parents=True)
    (other / ".venv-x" / "bin" / "python").symlink_to(sys.executable)
    monkeypatch.chdir(other)
    (tmp_path / "sweeps").mkdir()
    p = write(tmp_path / "sweeps", SMALL.replace("matrix:", "builds: {fixed: {venv: .venv-x}}\nmatrix:"))
    assert main(["validate", str(p), "--no-check-argv"]) == 0
    want = f"builds.fixed.venv: {tmp_path}/sweeps/.venv-x/bin/python does not exist yet"
    assert want in capsys.readouterr().err
    with pytest.raises(UserError, match=r"builds\.fixed\.venv: .*/sweeps/\.venv-x/bin/python does not exist"):
        build_python(load_sweep(p), "fixed")
    (tmp_path / "sweeps" / ".venv-x").symlink_to(other / ".venv-x")  # beside the sweep file: found
    assert build_python(load_sweep(p), "fixed") == str(tmp_path / "sweeps" / ".venv-x" / "bin" / "python")


def test_validate_and_plan_say_which_percentiles_the_perf_verdict_judges(tmp_path: Path, capsys) -> None:
    """Issue 40: a percentile is judged with 30 requests past it; validate and plan say which ones
    bench.num_prompts allows, and warn about a gate.perf family none of whose figures can be judged."""
    few = write(
        tmp_path,
        SMALL + "bench: {enabled: true, num_prompts: 59, budget_s: 600}\ngate: {perf: {ttft_ms: 0.05, req_s: 0.1}}\n",
    )
    assert main(["validate", str(few), "--no-check-argv"]) == 0
    out = capsys.readouterr()
    assert (
        "perf verdicts: bench.num_prompts 59 judges no percentile (30 requests past each judged percentile; " in out.out
    )
    assert (
        "p50 needs 60; p90 needs 300; p99 needs 3000): ttft_ms, tpot_ms, itl_ms, e2el_ms, kv_xfer_ms are not" in out.out
    )
    assert out.err.count("warning: gate.perf.") == 1  # req_s is a rate: judged at any size
    assert "warning: gate.perf.ttft_ms: no ttft_ms figure can be judged: each is a percentile" in out.err
    assert "(raise it to 60)" in out.err
    enough = write(
        tmp_path, SMALL + "bench: {enabled: true, num_prompts: 300, budget_s: 600}\ngate: {perf: {ttft_ms: 0.05}}\n"
    )
    assert main(["plan", str(enough), "--no-check-argv"]) == 0
    out = capsys.readouterr()
    assert (
        "perf verdicts: bench.num_prompts 300 judges p50, p90 (30 requests past each judged percentile; p99 needs 3000)\n"
        in out.out
    )
    assert "warning" not in out.err
    write(tmp_path, SMALL)  # no load phase: nothing to say
    assert main(["validate", str(tmp_path / "s.yaml"), "--no-check-argv"]) == 0
    assert "perf verdicts" not in capsys.readouterr().out


def test_plan_json_carries_pairs_and_percentiles_and_loads_the_sweep_once(monkeypatch, capsys) -> None:
    """``pdsweep plan`` shows the pairs ``run`` will interleave (``bench.pair_builds``) and the
    judged percentiles, in the table and in ``--format json``, from one load of the sweep."""
    import json

    import pdsweep.sweepfile.sweep as spec
    from pdsweep.run import dryrun

    loads: list[str] = []
    real = spec.load_sweep
    counted = lambda p, *a, **k: loads.append(str(p)) or real(p, *a, **k)  # noqa: E731
    monkeypatch.setattr(spec, "load_sweep", counted)
    monkeypatch.setattr(dryrun, "load_sweep", counted)
    sweep = str(REPO / "tests/fixtures/sweeps/cpu-paired.yaml")
    assert main(["plan", sweep, "--no-check-argv", "--format", "json"]) == 0
    d = json.loads(capsys.readouterr().out)
    pair = {"a": "tiny-llama.p1d1.b32-32.fixed", "b": "tiny-llama.p1d1.b32-32.unfixed"}
    assert d["pairs"] == {
        "pairs": [pair],
        "alone": {},
        "how": "bench.pair_builds: true",
        "overhead_s": 41.0,
        "first_s": None,
    }
    assert d["perf"]["line"].startswith("perf verdicts: bench.num_prompts 8 judges no percentile")
    assert main(["plan", sweep, "--no-check-argv"]) == 0
    out = capsys.readouterr().out
    assert f"  pair {pair['a']} (a) + {pair['b']} (b)\n" in out and "perf verdicts: bench.num_prompts 8" in out
    assert loads == [sweep, sweep]  # once per command
