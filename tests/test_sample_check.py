"""Issue 59 leftovers: ``integrity: {gpu: true, gpu_sample: F}`` with ``F x N`` below one expected digested
request per PD cell (``N``: the requests the plan sends each PD cell) is refused at validate/plan, naming the
figure and the smallest ``F`` that expects one. Before: validate passed it and each cell failed at run time
as "integrity: not measured"."""

from __future__ import annotations

from pathlib import Path

import pytest

from pdsweep.cli import main
from pdsweep.plan.expand import expand
from pdsweep.run.samplecheck import planned_requests, sample_problems
from pdsweep.sweepfile.integrityspec import IntegritySpec
from pdsweep.sweepfile.phases import EvalSpec
from pdsweep.sweepfile.sweep import load_sweep

REPO = Path(__file__).resolve().parents[1]
MISSION = REPO / "sweeps" / "hybrid-mla-mamba.yaml"
# the mission sweep's N: probe 3 prompts, gsm8k limit 250, load at 3 concurrencies of 64 checked random
# prompts + vllm bench serve's 320 x 3 repeats (the GPU default)
COUNTED = "probe 3, eval 1 task(s) x limit 250, load 3072 (1024 at each of 3 concurrencies)"


def problems(fraction: float, **eval_change) -> tuple[list[str], list[str]]:
    ls = load_sweep(MISSION)
    ev = ls.sweep.eval.model_copy(update=eval_change) if eval_change else ls.sweep.eval
    s = ls.sweep.model_copy(update={"integrity": IntegritySpec(gpu=True, gpu_sample=fraction), "eval": ev})
    return sample_problems(expand(ls.model_copy(update={"sweep": s})))


def test_the_plan_counts_the_requests_of_every_pd_cell():
    assert planned_requests(load_sweep(MISSION).sweep) == (3325, COUNTED.split(", "), True)


def test_a_sample_expecting_no_digested_request_is_refused_with_the_smallest_that_expects_one():
    errors, warnings = problems(1e-4)
    assert errors == [
        f"{MISSION}: integrity.gpu_sample: 0.0001 x 3325 PD requests per cell ({COUNTED}) = 0.333 expected "
        "digested requests, below 1: the cells' KV integrity would be 'not measured' (allowed: gpu_sample >= "
        "0.000301, which expects at least one digested request)"
    ]
    assert warnings == []
    assert problems(0.000301) == ([], [])  # 0.000301 x 3325 = 1.0008
    assert problems(0.25) == ([], [])  # the default


def test_without_eval_limit_the_plan_cannot_count_lm_eval_and_says_so():
    errors, warnings = problems(1e-4, limit=None)
    assert errors == []
    assert warnings == [
        f"{MISSION}: integrity.gpu_sample: 0.0001 x 3075 PD requests per cell (probe 3, load 3072 (1024 at each "
        "of 3 concurrencies)) = 0.307 expected digested requests, below 1: the cells' KV integrity would be 'not "
        "measured', unless lm-eval sends more (eval.tasks without eval.limit: the plan cannot count them); "
        "gpu_sample >= 0.000326 samples at least one request of the counted ones"
    ]
    assert EvalSpec().limit is None  # the sweep default: such sweeps are common


@pytest.mark.parametrize("command", ["validate", "plan"])
def test_validate_and_plan_refuse_it_exit_2(tmp_path, capsys, command):
    text = MISSION.read_text().replace("\nname: ", f"\nmodels_file: {REPO / 'sweeps' / 'models.yaml'}\nname: ", 1)
    path = tmp_path / "s.yaml"
    path.write_text(text + "integrity: {gpu: true, gpu_sample: 0.0001}\n")
    argv = [command, str(path)] + (["--no-check-argv"] if command == "validate" else [])
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"{path}: integrity.gpu_sample: 0.0001 x 3325 PD requests per cell" in err, err
    assert "Traceback" not in err
