"""Plan-level checks of the gate's former blind spots (issue 11, item 4): the kv-transfer
JSON a sweep may extend but not replace, eval tasks a kv_consumer cannot serve, phase
budgets, side-channel port ranges and the reference's serve args."""

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


@pytest.mark.parametrize(
    "arg",
    [
        '--kv-transfer-config={"kv_connector":"LMCacheConnectorV1","kv_role":"kv_both"}',
        "--kv-transfer-config.kv_role=kv_both",
        "--kv_transfer_config",
    ],
)
def test_serve_args_replacing_the_kv_transfer_config_are_refused(tmp_path, arg):
    with pytest.raises(UserError) as e:
        sweep(
            tmp_path,
            f"""serve_args:
  base: []
  other: {{decode: ['{arg}']}}
matrix: {{model: [tiny-llama], tp: [p1d1]}}
""",
        )
    msg = str(e.value)
    # refused by the spec's cell-defining-flag guard (pdsweep.spec.guards) before the
    # kv_transfer_extra check: either names the file, line, field and the arg
    assert "s.yaml:6: serve_args.other.decode" in msg and arg.split("=")[0][:18] in msg
    assert "defines the cell" in msg and "kv_transfer_extra" in msg and "connector and role cannot change" in msg


@pytest.mark.parametrize("value", ["LMCacheConnectorV1", "v"])
def test_kv_connector_is_a_nixl_connector_only(tmp_path, value):
    with pytest.raises(
        UserError, match=rf"kv_transfer_extra.kv_connector: .*'NixlConnector' or 'NixlPushConnector'.*{value}"
    ):
        sweep(
            tmp_path,
            f"""serve_args:
  base: []
  x: {{kv_transfer_extra: {{kv_connector: {value}}}}}
matrix: {{model: [tiny-llama], tp: [p1d1]}}
""",
        )


def test_push_connector_is_a_serve_args_axis_value(tmp_path):
    """kv_connector NixlPushConnector reaches the instances' --kv-transfer-config; the plan
    rejects the cell naming why pdsweep cannot judge push yet (rule push-evidence), and an
    unfixed build's push cell with the unfixed-scope reason."""
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
matrix: {model: [tiny-llama], tp: [p1d1], serve_args: [base, push], build: [fixed, unfixed]}
""",
    )
    plan = expand(ls)
    rej = {r.cell.id: (r.rule, r.reason) for r in plan.rejected}
    ok = {c.id: c for c in plan.pd_cells}
    assert sorted(ok) == ["tiny-llama.p1d1.b32-32.fixed", "tiny-llama.p1d1.b32-32.unfixed"]
    rule, reason = rej["tiny-llama.p1d1.b32-32.fixed.push"]
    assert rule == "push-evidence" and reason.startswith("push mode (NixlPushConnector): prefill WRITEs the KV")
    assert "decode vllm:nixl_xfer_time_seconds count = 0" in reason
    rule, reason = rej["tiny-llama.p1d1.b32-32.unfixed.push"]
    assert rule == "unfixed-scope" and "push connector (NixlPushConnector)" in reason
    push = next(r.cell for r in plan.rejected if r.cell.id == "tiny-llama.p1d1.b32-32.fixed.push")
    assert kv_transfer_config(push, "decode", ls)["kv_connector"] == "NixlPushConnector"
    assert kv_transfer_config(ok["tiny-llama.p1d1.b32-32.fixed"], "prefill", ls)["kv_connector"] == "NixlConnector"


@pytest.mark.parametrize("key", ["kv_role", "kv_buffer_device", "kv_connector_module_path"])
def test_kv_transfer_extra_cannot_change_connector_role_or_buffer(tmp_path, key):
    with pytest.raises(
        UserError, match=rf"kv_transfer_extra: key\(s\) \['{key}'\] not allowed \(allowed: kv_connector, kv_port"
    ):
        sweep(
            tmp_path,
            f"""serve_args:
  base: []
  x: {{kv_transfer_extra: {{{key}: v}}}}
matrix: {{model: [tiny-llama], tp: [p1d1]}}
""",
        )


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
    from pdsweep.spec.sweep import BenchSpec, Defaults, EvalSpec

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


def test_reference_serve_args_must_exist(tmp_path):
    with pytest.raises(
        UserError,
        match=r"s.yaml:6: serve_args.x.reference: unknown serve_args 'nope' "
        r"\(allowed: base, x\)",
    ):
        sweep(tmp_path, "serve_args:\n  base: []\n  x: {reference: nope}\nmatrix: {model: [tiny-llama], tp: [p1d1]}\n")
