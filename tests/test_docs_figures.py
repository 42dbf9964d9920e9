"""The figures docs pages quote from `pdsweep plan` / `validate` agree with what those
commands compute today (other sweeps change: the figures are computed, never written here).
A page that quotes a stale figure fails with the page, the sentence and the computed value."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from fixtures.make_runs import pd, write_run

from pdsweep.core import kvsample as ks
from pdsweep.judge.gate import FAIL, NOT_RUNNABLE, gate_run
from pdsweep.plan.expand import expand
from pdsweep.run.dryrun import plan_dict
from pdsweep.sweepfile.sweep import load_sweep

REPO = Path(__file__).resolve().parents[1]
MISSION, CPU = REPO / "sweeps" / "hybrid-mla-mamba.yaml", REPO / "sweeps" / "cpu-smoke.yaml"
CPU_PARETO = REPO / "sweeps" / "cpu-pareto.yaml"


def sentence(page: str, pattern: str) -> tuple[str, ...]:
    """The groups of ``pattern`` in ``page`` (docs/x.md), as written; fails naming the page and pattern."""
    text = " ".join((REPO / page).read_text().split())  # sentences wrap: one space between words
    m = re.search(pattern, text)
    assert m, f"{page}: no sentence matches {pattern!r} (reworded? update this test with it)"
    return m.groups()


def quoted(page: str, pattern: str) -> tuple[int, ...]:
    return tuple(int(x) for x in sentence(page, pattern))


@pytest.fixture(scope="module")
def mission_plan() -> dict:
    return plan_dict(str(MISSION), 8)


@pytest.fixture(scope="module")
def made_mission_plan(mission_plan: dict) -> dict:
    """The mission plan with both builds made, as `make test` and a GPU node's `make sweep` have
    them: the chains depend on which expectations apply to the unfixed build (docs/gpu-reuse.md)."""
    if not (REPO / ".venv-unfixed" / "bin" / "python").exists():
        pytest.skip("the unfixed build is not made: `make baseline-env` (`make test` makes it)")
    return mission_plan


def test_gpu_reuse_figures(made_mission_plan: dict) -> None:
    sched, reuse = made_mission_plan["schedule"], made_mission_plan["reuse"]
    p8 = [x for x in sched["needs_more_gpus"] if ".p8d" in x["cell"]]
    computed = (
        len(sched["placements"]),
        len(p8),
        len(sched["needs_more_gpus"]) - len(p8),  # references only p8dX cells are compared with
        reuse["distinct"],
        reuse["per_cell"],
        reuse["schedule"]["instance_starts"],
    )
    page = quoted(
        "docs/gpu-reuse.md",
        r"On the mission sweep with 8 GPUs, (\d+) cells fit \(the (\d+) p8dX cells need 9-12 GPUs, and (\d+) "
        r"reference only they are compared with is not scheduled either: it would judge nothing\)\. "
        r"They use (\d+) distinct instances for (\d+) uses, and the plan makes (\d+) instance starts",
    )
    assert page == computed, "docs/gpu-reuse.md: (fit, p8dX, their references, distinct, uses, starts)"


def test_gpu_reuse_makespan_figures(made_mission_plan: dict) -> None:
    """docs/gpu-reuse.md's mission makespan on 8 GPUs (the schedule `run` follows) against
    upstream's fresh pair per PD config, in the plan's duration model (bench/test_sweep_reuse.py)."""
    from pdsweep.plan.startup import estimator

    ls = load_sweep(MISSION)
    est, cells = estimator(ls), {c.id: c for c in expand(ls).cells}
    placed = [cells[p["cell"]] for p in made_mission_plan["schedule"]["placements"]]
    upstream = sum(est(c) for c in placed if c.kind == "pd")
    ours = made_mission_plan["makespan"]["s"]
    got = sentence(
        "docs/gpu-reuse.md",
        r"takes ([\d.]+) h on the schedule `run` follows \(reuse dispatch\) against ([\d.]+) h "
        r"for upstream's fresh pair per configuration in the same model: \*\*([\d.]+)x\*\*",
    )
    assert got == (f"{ours / 3600:.2f}", f"{upstream / 3600:.2f}", f"{ours / upstream:.2f}")


def test_pareto_mission_load_figures(made_mission_plan: dict) -> None:
    """docs/pareto.md "On GPU nodes": the mission's load axis and its planned makespan on 8 GPUs."""
    b = load_sweep(MISSION).sweep.bench
    s = made_mission_plan["makespan"]["s"]
    got = quoted(
        "docs/pareto.md",
        r"every cell at concurrency (\d+), (\d+) and (\d+) \(`max_num_seqs` \d+\), (\d+) random prompts of (\d+) "
        r"tokens in and (\d+) out per run",
    )
    assert b.enabled and got == (*b.concurrencies, b.num_prompts, b.input_len, b.output_len)
    got_makespan = sentence("docs/pareto.md", r"planned makespan of (\d+) s \(([\d.]+) h\) on 8 GPUs")
    assert got_makespan == (f"{s:.0f}", f"{s / 3600:.2f}")


def test_pareto_cpu_plan_figures() -> None:
    """docs/pareto.md "On CPU": sweeps/cpu-pareto.yaml's planned makespan, cells and references."""
    plan = plan_dict(str(CPU_PARETO), 0)
    cells = plan["cells"]
    computed = (round(plan["makespan"]["s"]), len(cells), sum(c["kind"] == "ref" for c in cells))
    page = quoted("docs/pareto.md", r"puts the sweep at (\d+) s on paper \((\d+) cells, (\d+) of them single-instance")
    assert page == computed, "docs/pareto.md: (makespan s, cells, references) of sweeps/cpu-pareto.yaml"


def test_p8_cells_are_not_runnable_in_matrix_and_gate_docs(mission_plan: dict, tmp_path: Path) -> None:
    needs = mission_plan["schedule"]["needs_more_gpus"]
    p8 = [n for n in needs if ".p8d" in n["cell"]]
    assert quoted("docs/matrix.md", r"its (\d+) p8dX cells need 9-12 GPUs") == (len(p8),)
    assert all(
        ".ref-" in n["cell"] and n["reason"].startswith("reference of NOT-RUNNABLE") for n in needs if n not in p8
    )
    # what the gate makes of such a cell: NOT-RUNNABLE, FAIL only when all cells are required
    small, big = pd("tiny-llama", 1, 1), pd("kimi-linear", 8, 1)
    run = write_run(tmp_path, "r", [(small, {})], rejected=[(big, "needs-gpus", needs[0]["reason"])])
    assert gate_run(run).cell(big.id).verdict == NOT_RUNNABLE
    assert gate_run(run, require_all_cells=True).cell(big.id).verdict == FAIL
    matrix = " ".join((REPO / "docs/matrix.md").read_text().split())
    gate = " ".join((REPO / "docs/gate.md").read_text().split())
    assert "the gate lists them as NOT-RUNNABLE" in matrix and 'FAIL as "not run' not in matrix
    assert "too few GPUs for is NOT-RUNNABLE" in gate and "so is a valid cell the host had too few" not in gate


def test_readme_cpu_default_figures() -> None:
    plan = expand(load_sweep(CPU))
    pd_cells = [c for c in plan.cells if c.kind == "pd"]
    computed = (
        len(plan.cells),
        len(pd_cells),
        sum(c.fault != "none" for c in pd_cells),
        len(plan.cells) - len(pd_cells),
    )
    page = quoted(
        "README.md",
        r"CPU default \((\d+) cells: (\d+) PD, (\d+) of them fault drills, (\d+) single-instance references\)"
        r"\s+and (\d+) the plan rejects",
    )
    computed += (len(plan.rejected),)
    assert page == computed, "README.md: (cells, PD, fault drills, references, rejected) of sweeps/cpu-smoke.yaml"
    counters = set(re.findall(r"\[[1k]/(\d+)\]", (REPO / "README.md").read_text()))
    assert counters == {str(len(plan.cells))}, "README.md: the run's [i/N] counter counts every cell on CPU"


def test_cpu_isa_margin_figures() -> None:
    """docs/cpu.md "Same answers on every x86 host": each model's row is the committed measurement
    (tests/fixtures/isa_margins.json, gated by tests/test_isa_margins.py), and every gated model has one."""
    import json

    from pdsweep.measure.margins import ISA_ENVS

    fix = json.loads((REPO / "tests" / "fixtures" / "isa_margins.json").read_text())
    text = (REPO / "docs" / "cpu.md").read_text()
    rows = dict(re.findall(r"^\| (tiny-[\w-]+) \| (\d+ \|.*\|)$", text, re.M))
    assert set(rows) == set(fix["models"]), "docs/cpu.md: one margin row per gated model"
    for name, m in fix["models"].items():
        drift = max(fix["drift"][e]["max_logit_diff"][name] for e in ISA_ENVS)
        computed = (
            f"{m['tokens']} | {m['min_margin']:.3g} ({m['min_margin_at']}) | {drift:.1e} | "
            f"{int(m['min_margin'] / drift)} | {m['bf16_drift']:.2f} ({m['bf16_flipped_sequences']} flipped) |"
        )
        assert rows[name] == computed, f"docs/cpu.md: {name}'s margin row"
    ratio = min(
        int(m["min_margin"] / max(fix["drift"][e]["max_logit_diff"][n] for e in ISA_ENVS))
        for n, m in fix["models"].items()
    )
    assert quoted("docs/cpu.md", r"every gated model passes by (\d+)x or more") == (ratio // 10,)


def test_matrix_budget_and_shard_figures():
    """docs/matrix.md "The CI clock": cpu-smoke's makespan against --budget 10, and its two shards."""
    from pdsweep.plan.shards import JobArgs, Shard

    whole = plan_dict(str(CPU), 0, job_args=JobArgs(budget=10))
    s = whole["makespan"]["s"]
    assert quoted("docs/matrix.md", r"planned makespan (\d+) min \((\d+) s, the whole sweep") == (
        round(s / 60),
        round(s),
    )
    assert quoted("docs/matrix.md", r"split it: at least --shard i/(\d+)` \(cpu-smoke") == (
        whole["budget"]["shards_hint"],
    )
    parts = [plan_dict(str(CPU), 0, job_args=JobArgs(shard=Shard(i, 2))) for i in (1, 2)]
    got = quoted("docs/matrix.md", r"cpu-smoke in two: (\d+) \+ (\d+) cells, (\d+) s and (\d+) s against (\d+) s whole")
    want = (*(len(p["cells"]) for p in parts), *(round(p["makespan"]["s"]) for p in parts), round(s))
    assert got == want


def test_pairing_cost_figures():
    """docs/performance.md "Paired builds": what pairing by default adds to cpu-smoke's planned makespan."""
    from pdsweep.plan.pairing import PAIR_OVERHEAD_S

    d = plan_dict(str(CPU), 0)
    s, extra, per = d["makespan"]["s"], d["makespan"]["pairs_s"], PAIR_OVERHEAD_S["cpu"]
    assert len(d["pairs"]["pairs"]) == 1 and extra == per
    assert quoted("docs/performance.md", r"\+(\d+) s a pair \(measured below") == (per,)
    got = quoted(
        "docs/performance.md",
        r"Planned makespan (\d+) s unpaired \(`pair_builds: false`\), (\d+) s by default \(\+(\d+)\.(\d) %\); "
        r"pairing both would be (\d+) s \(\+(\d+)\.(\d) %\)",
    )
    unpaired = s - extra
    pct = [round(100 * x / unpaired, 1) for x in (extra, extra + per)]
    want = (round(unpaired), round(s), *divmod(round(pct[0] * 10), 10), round(s + per), *divmod(round(pct[1] * 10), 10))
    assert got == want


def test_integrity_gpu_sample_estimate_figures() -> None:
    """docs/integrity.md's estimate of the TTFT the GPU digests add (pdsweep.core.kvsample)."""
    got = sentence(
        "docs/integrity.md",
        r"is ~(\d+) GB/s .*?prefill writes KV at ~([\d.]+) GB/s .*? With every request digested that is ([\d.]+) % "
        r"of TTFT; the default `gpu_sample` ([\d.]+) keeps it at an estimated ([\d.]+) %, and 2 % allows ([\d.]+)\.",
    )
    computed = (
        f"{ks.ESTIMATED_DIGEST_GBPS:g}",
        f"{ks.ESTIMATED_PREFILL_KV_GBPS:g}",
        f"{100 * ks.ttft_share(1.0, ks.ESTIMATED_DIGEST_GBPS):.1f}",
        f"{ks.DEFAULT_GPU_SAMPLE:g}",
        f"{100 * ks.ttft_share(ks.DEFAULT_GPU_SAMPLE, ks.ESTIMATED_DIGEST_GBPS):.1f}",
        f"{ks.fraction_for(ks.ESTIMATED_DIGEST_GBPS):.3g}",
    )
    assert got == computed, "docs/integrity.md: (digest GB/s, prefill KV GB/s, share at 1, default, share, 2 % sample)"
