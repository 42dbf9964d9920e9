"""pdsweep.xfer: cache geometry, vLLM read plans (fixed / pre-#49297), the NIXL bench."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from pdsweep.measure.metrics import parse_ucx_proto_info
from pdsweep.plan.geometry import kv_geometry, layer_positions
from pdsweep.plan.readplan import (
    build_read_plan,
    builtin_tp_mapping,
    handshake_ranks,
    tp_ratio,
    vllm_available,
    vllm_tp_mapping,
)
from pdsweep.sweepfile.catalogue import ModelSpec
from pdsweep.sweepfile.sweep import load_catalogue
from pdsweep.xfer import memory, rank
from pdsweep.xfer.bench import BenchConfig, run_transfer_bench
from pdsweep.xfer.session import TransferSession

ROOT = Path(__file__).resolve().parents[1]
CAT = load_catalogue(ROOT / "sweeps" / "models.yaml")
KIMI = CAT.models["kimi-linear"]
TP_PAIRS = [(1, 1), (2, 1), (4, 1), (4, 2), (2, 2), (1, 2), (2, 4)]


def geom(name: str, block_size: int = 16, tps: tuple[int, ...] = ()):
    return kv_geometry(name, CAT.models[name], block_size, tps)


# ---------------------------------------------------------------- geometry
def test_kimi_linear_bytes_by_hand():
    g = geom("kimi-linear", 16, (1, 2))
    # MLA latent: (512 + 64) elements x 16 tokens x 2 bytes (bf16), replicated
    assert [r.page_bytes(1) for r in g.regions if r.kind == "mla"] == [18432] * 7
    assert [r.page_bytes(2) for r in g.regions if r.kind == "mla"] == [18432] * 7
    # KDA conv (3*32*128 / TP, 4 - 1) bf16; recurrent (32 / TP, 128, 128) fp32
    conv = [r for r in g.regions if r.kind == "conv"]
    rec = [r for r in g.regions if r.kind == "recurrent"]
    assert len(conv) == len(rec) == 20
    assert conv[0].page_bytes(1) == 12288 * 3 * 2 == 73728
    assert conv[0].page_bytes(2) == 36864
    assert rec[0].page_bytes(1) == 32 * 128 * 128 * 4 == 2097152
    assert rec[0].page_bytes(2) == 1048576
    assert g.rank_bytes(1) == {"attention_per_block": 129024, "ssm_per_request": 20 * (73728 + 2097152)}
    assert g.rank_bytes(2, 1) == {"attention_per_block": 129024, "ssm_per_request": 20 * (36864 + 1048576)}
    assert conv[0].shard(2, 1) == (6144, 6144)
    assert rec[0].shard(2, 1) == (16, 16)


def test_kimi_linear_layer_positions_match_config():
    attn, ssm = layer_positions(27, 7, 20)
    assert attn == [3, 7, 11, 15, 19, 23, 26]  # 1-based 4, 8, ..., 24, 27
    assert len(ssm) == 20 and not set(ssm) & set(attn)


def test_gqa_heads_per_rank_at_least_one():
    g = geom("tiny-llama", 16)
    k = g.regions[0]
    assert (k.kind, k.units) == ("k", 2)
    # 2 x (2 heads / TP, at least 1) x 32 head_dim x 16 tokens x 4 bytes per layer
    assert g.rank_bytes(1)["attention_per_block"] == 2 * 2 * (2 * 32 * 16 * 4)
    assert g.rank_bytes(4)["attention_per_block"] == 2 * 2 * (1 * 32 * 16 * 4)
    assert [k.shard(4, r) for r in range(4)] == [(0, 1), (0, 1), (1, 1), (1, 1)]


@pytest.mark.parametrize(
    ("name", "field"),
    [("jamba2-3b", "ssm_state"), ("deepseek-vl2-tiny", "attn"), ("ling-2.5", "ssm_state")],
)
def test_missing_geometry_names_the_field(name, field):
    with pytest.raises(ValueError, match=f"'{field}' is missing"):
        geom(name)


def test_missing_mla_and_layer_counts():
    mla = ModelSpec(hf_id="x/y", architecture="X", attention="mla", num_layers=2)
    with pytest.raises(ValueError, match="'mla' is missing"):
        kv_geometry("x", mla, 16)
    hybrid = KIMI.model_copy(update={"attention_layers": None})
    with pytest.raises(ValueError, match="'attention_layers' is missing"):
        kv_geometry("kimi-nolayers", hybrid, 16)


def test_tp_must_divide_ssm_heads():
    with pytest.raises(ValueError, match="num_heads=32 is not divisible by TP 3"):
        geom("kimi-linear", 16, (3,))


# ---------------------------------------------------------------- read plans
def test_tp_ratio_follows_vllm_sign_convention():
    assert tp_ratio(prefill_tp=2, decode_tp=1) == -2
    assert tp_ratio(prefill_tp=2, decode_tp=4) == 2
    assert tp_ratio(prefill_tp=1, decode_tp=1) == 1
    with pytest.raises(ValueError, match="multiple"):
        tp_ratio(prefill_tp=3, decode_tp=2)
    assert handshake_ranks(2, 4, 1) == [2, 3]
    assert handshake_ranks(4, 2, 3) == [1]


def test_fixed_p2d1_reads_mla_once_and_ssm_from_both_ranks():
    g = geom("kimi-linear", 16, (2, 1))
    p = build_read_plan(g, 2, 1, 0, "fixed", mapping="builtin")
    assert p.tp_ratio == -2
    assert p.transfers == (0, 1)
    mla = [r for r in p.reads if r.kind == "mla"]
    assert len(mla) == 7 and {r.remote_rank for r in mla} == {0}
    assert all((r.local_offset, r.remote_offset, r.nbytes) == (0, 0, 18432) for r in mla)
    for kind, half in (("conv", 36864), ("recurrent", 1048576)):
        reads = [r for r in p.reads if r.kind == kind]
        assert len(reads) == 40
        assert {(r.remote_rank, r.local_offset, r.remote_offset, r.nbytes) for r in reads} == {
            (0, 0, 0, half),
            (1, half, 0, half),
        }
    assert p.notify_ranks == ()  # each READ carries the notification
    assert p.bytes_from(1, g, 64) == 20 * (36864 + 1048576)
    assert p.bytes_from(0, g, 64) == 7 * 64 * 18432 + 20 * (36864 + 1048576)
    assert p.descriptors_per_request(g, 64) == 7 * 64 + 40 + 40
    assert not p.upstream_notes


def test_unfixed_refuses_mla_ssm_at_negative_tp_ratio_with_its_assert():
    from pdsweep.plan.readplan import UNFIXED_ASSERT, UnfixedPlanAsserts

    g = geom("kimi-linear", 16, (2, 1))
    with pytest.raises(UnfixedPlanAsserts, match=r"assert len\(read_specs\) == 1.*source ranks \[0, 1\]"):
        build_read_plan(g, 2, 1, 0, "unfixed", mapping="builtin")
    assert UNFIXED_ASSERT == "assert len(read_specs) == 1"
    pure_mla = geom("deepseek-v2-lite-chat", 16, (2, 1))  # one source rank: the assert holds
    assert build_read_plan(pure_mla, 2, 1, 0, "unfixed", mapping="builtin").transfers == (0,)


def test_unfixed_asserts_off_p2d1_misses_rank1_ssm_and_notifies_it():
    g = geom("kimi-linear", 16, (2, 1))
    p = build_read_plan(g, 2, 1, 0, "unfixed-asserts-off", mapping="builtin")
    assert p.transfers == (0,)
    assert p.reads_from(1) == []
    ssm = [r for r in p.reads if r.kind in ("conv", "recurrent")]
    assert len(ssm) == 40 and all(r.local_offset == 0 for r in ssm)
    covered = {r.region: r.nbytes for r in ssm}
    assert all(covered[reg.index] == reg.page_bytes(1) // 2 for reg in g.regions if reg.is_ssm)
    assert p.notify_ranks == (1,)  # told the request was read, though nothing was
    assert any("assert" in n for n in p.upstream_notes)


@pytest.mark.parametrize("name", ["kimi-linear", "qwen3-0.6b", "tiny-nemotron-h", "deepseek-v2-lite-chat"])
def test_p1d1_identical_in_both_plans(name):
    g = geom(name, 16, (1,))
    fixed = build_read_plan(g, 1, 1, 0, "fixed", mapping="builtin")
    unfixed = build_read_plan(g, 1, 1, 0, "unfixed", mapping="builtin")
    assert fixed.reads == unfixed.reads and fixed.transfers == unfixed.transfers == (0,)
    assert fixed.notify_ranks == unfixed.notify_ranks == ()
    assert all(
        r.local_offset == r.remote_offset == 0 and r.nbytes == g.regions[r.region].page_bytes(1) for r in fixed.reads
    )


def test_non_mla_p2d1_reads_attention_from_both_ranks():
    g = geom("qwen3-0.6b", 16, (2, 1))
    p = build_read_plan(g, 2, 1, 0, "fixed", mapping="builtin")
    half = 4 * 128 * 16 * 2  # 8 heads / 2 ranks x head_dim x tokens x bf16
    for kind in ("k", "v"):
        reads = [r for r in p.reads if r.kind == kind and r.layer == 0]
        assert sorted((r.remote_rank, r.local_offset, r.nbytes) for r in reads) == [(0, 0, half), (1, half, half)]
    assert build_read_plan(g, 2, 1, 0, "unfixed", mapping="builtin").reads == p.reads  # #49297 is MLA-only


def test_vllm_rejects_replicated_kv_without_mla_or_ssm():
    with pytest.raises(ValueError, match="_validate_remote_agent_handshake"):
        build_read_plan(geom("tiny-llama", 16, (4, 1)), 4, 1, 0, "fixed", mapping="builtin")


def _check_exact_cover(g, p, P, D, d):
    """Every local byte of every region is read exactly once, from the remote byte
    holding the same TP1 offset (the ground truth of geometry.Region.shard)."""
    for reg in g.regions:
        reads = [r for r in p.reads if r.region == reg.index]
        cover = np.zeros(reg.page_bytes(D), dtype=int)
        for r in reads:
            cover[r.local_offset : r.local_offset + r.nbytes] += 1
            local_global = reg.shard(D, d)[0] * reg.unit_bytes + r.local_offset
            remote_global = reg.shard(P, r.remote_rank)[0] * reg.unit_bytes + r.remote_offset
            assert local_global == remote_global, (reg, r)
            assert r.remote_offset + r.nbytes <= reg.page_bytes(P)
        assert (cover == 1).all(), (reg.layer, reg.kind, np.unique(cover))


@pytest.mark.parametrize(
    "name",
    ["kimi-linear", "tiny-kimi-linear", "tiny-nemotron-h", "tiny-qwen3-next", "qwen3-0.6b", "deepseek-v2-lite-chat"],
)
@pytest.mark.parametrize(("P", "D"), TP_PAIRS)
def test_fixed_plan_covers_every_byte_from_the_right_rank(name, P, D):
    g = geom(name, 16, (P, D))
    for d in range(D):
        _check_exact_cover(g, build_read_plan(g, P, D, d, "fixed", mapping="builtin"), P, D, d)


def test_exact_cover_check_fails_for_unfixed():
    g = geom("kimi-linear", 16, (2, 1))
    with pytest.raises(AssertionError):
        _check_exact_cover(g, build_read_plan(g, 2, 1, 0, "unfixed-asserts-off", mapping="builtin"), 2, 1, 0)


@pytest.mark.parametrize(
    "name", ["kimi-linear", "tiny-nemotron-h", "qwen3-0.6b", "tiny-llama", "deepseek-v2-lite-chat"]
)
def test_builtin_mapping_equals_vllm_compute_tp_mapping(name):
    if not vllm_available():  # checked here, not at collection: importing vLLM takes ~10 s
        pytest.skip("vLLM's compute_tp_mapping is not importable")
    for P, D in TP_PAIRS:
        g = geom(name, 16, (P, D))
        for d in range(D):
            ours, theirs = builtin_tp_mapping(g, P, D, d), vllm_tp_mapping(g, P, D, d)
            assert (ours.attention_ranks, ours.ssm_ranks, ours.all_source_ranks) == (
                theirs.attention_ranks,
                theirs.ssm_ranks,
                theirs.all_source_ranks,
            ), (P, D, d)
            assert ours.rank_to_attention_slot == theirs.rank_to_attention_slot
            assert (ours.rank_offset_factor, ours.local_consumers) == (
                theirs.rank_offset_factor,
                theirs.local_consumers,
            )


# ---------------------------------------------------------------- pattern, attribution, UCX parsing
def test_pattern_is_sliceable_and_never_sentinel():
    pages = np.array([0, 5, 9])
    full = memory.pattern(3, pages, 0, 1003)
    assert full.shape == (3, 1003) and full.max() < memory.SENTINEL
    np.testing.assert_array_equal(memory.pattern(3, pages, 7, 501), full[:, 7:501])  # unaligned slice
    assert (memory.pattern(4, pages, 0, 1003) != full).mean() > 0.9  # other region
    assert (full[0] != full[1]).mean() > 0.9  # other page


def test_column_owner_attributes_ssm_and_mla():
    g = geom("kimi-linear", 16, (2, 1))
    conv = next(r for r in g.regions if r.kind == "conv")
    owner = rank._column_owner(conv, 2, 1, 0, [0, 1])
    assert (owner[:36864] == 0).all() and (owner[36864:] == 1).all()
    mla = g.regions[0]
    assert set(rank._column_owner(mla, 4, 2, 1, [2, 3]).tolist()) == {2}


def test_parse_ucx_proto_info():
    text = """[1.1] [vm:1 :0]   +--------+-------------+------------+
[1.1] [vm:1 :0]   | D intra-node cfg#1                          |
[1.1] [vm:1 :0]   | remote memory read by ucp_get*(multi) into host memory from host |
[1.1] [vm:1 :0]   +--------+-------------+------------+
[1.1] [vm:1 :0]   | Range  | Description |   Config   |
[1.1] [vm:1 :0]   +--------+-------------+------------+
[1.1] [vm:1 :0]   | 0..8k  | zero-copy   | cma/memory |
[1.1] [vm:1 :0]   | 8k..inf| zero-copy   | tcp/lo     |
[1.1] [vm:1 :0]   +--------+-------------+------------+
[1.1] [vm:1 :0]   | active message by ucp_am_send*(egr) from host memory |
[1.1] [vm:1 :0]   | 0..inf | short | posix/memory |
"""
    assert parse_ucx_proto_info(text) == ["cma/memory", "tcp/lo"]
    assert parse_ucx_proto_info("nothing here") == []


def test_make_agent_refuses_zero_delay():
    with pytest.raises(ValueError, match="busy-spins"):
        rank.make_agent("x", 0)


# ---------------------------------------------------------------- real NIXL
nixl = pytest.mark.nixl


def _nixl():
    pytest.importorskip("nixl_cu13._api", reason="nixl_cu13 (NIXL Python bindings) is not installed")


@nixl
def test_nixl_fixed_verifies_and_unfixed_reports_missing_ssm_shards():
    _nixl()
    model = CAT.models["tiny-kimi-linear"]
    ok = run_transfer_bench(
        BenchConfig("tiny-kimi-linear", model, 2, 1, blocks=4, plan="fixed", iters=1, mapping="builtin")
    )
    v = ok["verification"]
    assert v["ok"] is True and v["missing"] == [] and v["wrong"] == [] and v["stray_bytes"] == 0
    assert v["checked_bytes"] > 0 and ok["gbps"] > 0 and ok["memcpy_gbps"] > 0
    assert ok["ranks"][0]["transfers_per_request"] == 2
    assert ok["notified_without_read"] == []

    from pdsweep.plan.readplan import UnfixedPlanAsserts

    with pytest.raises(UnfixedPlanAsserts):  # what the unfixed build does: no read at all
        run_transfer_bench(
            BenchConfig("tiny-kimi-linear", model, 2, 1, blocks=4, plan="unfixed", iters=1, mapping="builtin")
        )
    bad = run_transfer_bench(
        BenchConfig("tiny-kimi-linear", model, 2, 1, blocks=4, plan="unfixed-asserts-off", iters=1, mapping="builtin")
    )
    v = bad["verification"]
    assert v["ok"] is False and v["wrong"] == []
    # 3 KDA layers; per layer rank 1 holds half of conv (384*3*4 B) and recurrent (4*32*32*4 B)
    got = sorted((m["layer"], m["kind"], m["prefill_rank"], m["bytes"]) for m in v["missing"])
    ssm_layers = layer_positions(4, 1, 3)[1]
    assert got == sorted(
        [(layer, "conv", 1, 2304) for layer in ssm_layers] + [(layer, "recurrent", 1, 8192) for layer in ssm_layers]
    )
    assert bad["notified_without_read"] == [1]
    assert bad["notifications"]["1"]["received"] == 2  # warmup + 1 iteration, no read


@nixl
def test_nixl_verifier_catches_misplaced_shards():
    """A plan that writes rank 1's SSM shard over rank 0's: rank-0 bytes are wrong,
    rank-1 bytes missing, nothing else."""
    _nixl()
    import dataclasses

    g = geom("tiny-kimi-linear", 16, (2, 1))
    good = build_read_plan(g, 2, 1, 0, "fixed", mapping="builtin")
    moved = tuple(dataclasses.replace(r, local_offset=0) if r.remote_rank == 1 else r for r in good.reads)
    moved = tuple(r for r in moved if not (r.remote_rank == 0 and r.kind in ("conv", "recurrent")))
    plan = dataclasses.replace(good, reads=moved)
    reqs = memory.make_requests(1, 4)
    with TransferSession(g, 2, 1, [plan], reqs) as s:
        s.reset()
        s.iterate()
        checks = s.verify()
    issues = checks[0]["issues"]
    assert {(i["kind"], i["prefill_rank"]) for i in issues if i["wrong_bytes"]} == {("conv", 0), ("recurrent", 0)}
    assert {(i["kind"], i["prefill_rank"]) for i in issues if i["missing_bytes"]} == {("conv", 1), ("recurrent", 1)}
    assert sum(i["wrong_bytes"] for i in issues) > 0.95 * 3 * (2304 + 8192)  # ~1/255 of bytes match by chance
    assert all(i["layer"] in layer_positions(4, 1, 3)[1] for i in issues)


@nixl
def test_nixl_session_stops_every_rank_on_errors():
    """An exception in the caller and a failing rank both leave no process behind."""
    _nixl()
    import dataclasses

    g = geom("tiny-kimi-linear", 16, (2, 1))
    plan = build_read_plan(g, 2, 1, 0, "fixed", mapping="builtin")
    reqs = memory.make_requests(1, 2)
    procs = []
    with pytest.raises(KeyError, match="boom"):
        with TransferSession(g, 2, 1, [plan], reqs) as s:
            procs = list(s.procs)
            raise KeyError("boom")
    assert len(procs) == 3 and not any(p.is_alive() for p in procs)

    with pytest.raises(ValueError, match="bad ranks: \\[7\\]"):
        TransferSession(g, 2, 1, [dataclasses.replace(plan, transfers=(0, 1, 7))], reqs)

    # a READ outside prefill rank 1's registered memory: the decode rank fails in NIXL
    far = tuple(dataclasses.replace(r, remote_offset=1 << 40) if r.remote_rank == 1 else r for r in plan.reads)
    session = TransferSession(g, 2, 1, [dataclasses.replace(plan, reads=far)], reqs)
    with pytest.raises(RuntimeError, match="decode rank process .* failed"):
        with session:
            procs = list(session.procs)
            session.iterate()
    assert session.procs == [] and session.dconns == [] and not any(p.is_alive() for p in procs)


@nixl
def test_nixl_cli_exit_codes(tmp_path):
    _nixl()
    base = [
        sys.executable,
        "-m",
        "pdsweep.xfer.bench",
        "--model",
        "tiny-kimi-linear",
        "--prefill-tp",
        "2",
        "--decode-tp",
        "1",
        "--blocks",
        "2",
        "--iters",
        "1",
        "--mapping",
        "builtin",
    ]
    out = tmp_path / "r.json"
    ok = subprocess.run(
        base + ["--plan", "fixed", "--json", str(out)], capture_output=True, text=True, cwd=ROOT, timeout=300
    )
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert "verification: OK" in ok.stdout and out.exists()
    refused = subprocess.run(base + ["--plan", "unfixed"], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert refused.returncode == 1, refused.stdout + refused.stderr
    assert "refused before reading" in refused.stdout and "assert len(read_specs) == 1" in refused.stdout
    bad = subprocess.run(
        base + ["--plan", "unfixed-asserts-off"], capture_output=True, text=True, cwd=ROOT, timeout=300
    )
    assert bad.returncode == 1, bad.stdout + bad.stderr
    assert "missing from prefill rank 1" in bad.stdout and "(recurrent) from prefill rank 1: 8192 bytes" in bad.stdout


def test_cli_bad_model_is_a_user_error():
    r = subprocess.run(
        [sys.executable, "-m", "pdsweep.xfer.bench", "--model", "no-such-model"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert r.returncode == 2 and "unknown model 'no-such-model'" in r.stderr
