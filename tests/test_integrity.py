"""transfer.json ``integrity`` from the digest lines (pdsweep.core.kvintegrity) and its gate
(pdsweep.judge.integrity): matched, mismatched, stale, missing, replicas, parts, failed READs."""

from __future__ import annotations

import pytest
from fixtures.make_runs import TR, case, pd, write_run

from pdsweep.core.kvintegrity import integrity
from pdsweep.core.kvlines import LANDED_TAG, OFFER_TAG, PUSHED_TAG, WRITE_TAG
from pdsweep.judge.gate import FAIL, PASS, gate_run
from pdsweep.judge.integrity import integrity_reasons
from pdsweep.plan.expand import expand
from pdsweep.plan.instance import Slot, instances
from pdsweep.sweepfile.sweep import load_sweep


def offer(agent: str, rank: int, req: str, units: list[tuple], engine: str = "E", split: int = 1) -> str:
    d = ";".join(f"{g}/{k}/{b}/{i}/{a:x}/{n}/{dig}" for g, k, b, i, a, n, dig in units)
    return (
        f"INFO {OFFER_TAG} agent={agent} engine={engine} rank={rank} req={req} us=10 bytes=2048 split={split} d={d}\n"
    )


def landed(agent: str, req: str, reads: list[tuple], state: str = "DONE", fields: str = "") -> str:
    d = ";".join(f"{a:x}/{n}/{dig}" for a, n, dig in reads)
    return f"INFO {LANDED_TAG} agent={agent} req={req} state={state} us=5 bytes=1024{fields} d={d}\n"


# an MLA + SSM hybrid at P TP 2: rank 0 and 1 hold the same latent (a replica), their own SSM shards
P0 = [
    (0, "mla", 7, "0", 0x1000, 512, "aa"),
    (1, "ssm-conv", 3, "0", 0x9000, 256, "c0"),
    (1, "ssm-temporal", 3, "1", 0x9100, 256, "t0"),
]
P1 = [
    (0, "mla", 7, "0", 0x2000, 512, "aa"),
    (1, "ssm-conv", 3, "0", 0xA000, 256, "c1"),
    (1, "ssm-temporal", 3, "1", 0xA100, 256, "t1"),
]


def fixed_reads(conv1: str = "c1") -> str:
    """vLLM's fixed read plan: the latent once from rank 0, the SSM from both ranks."""
    return landed("p0", "r1", [(0x1000, 512, "aa"), (0x9000, 256, "c0"), (0x9100, 256, "t0")]) + landed(
        "p1", "r1", [(0xA000, 256, conv1), (0xA100, 256, "t1")]
    )


def test_fixed_plan_matches_with_the_latent_as_a_replica():
    got = integrity(offer("p0", 0, "r1", P0) + offer("p1", 1, "r1", P1), fixed_reads())
    assert (got["compared"], got["matched"], got["mismatched"], got["missing"], got["stale"]) == (6, 6, 0, 0, 0)
    assert got["replicated_descs"] == 1 and got["requests"] == 1 and got["first"] == {}
    assert got["cost"]["prefill_us"] == 20 and got["cost"]["decode_us"] == 10
    assert got["cost"]["prefill_us_per_mib"] == round(20 / (4096 / 2**20), 1)
    assert integrity_reasons(got, "c/transfer.json") == []


def test_one_prefill_rank_read_loses_the_ssm_shards_of_the_other():
    """The shape of vLLM PR #49297: decode read prefill rank 0 only."""
    decode = landed("p0", "r1", [(0x1000, 512, "aa"), (0x9000, 256, "c0"), (0x9100, 256, "t0")])
    got = integrity(offer("p0", 0, "r1", P0) + offer("p1", 1, "r1", P1), decode)
    assert (got["matched"], got["missing"]) == (4, 2)
    assert got["first"]["missing"] == {"request": "r1", "group": "1:ssm-conv", "prefill_rank": 1, "block": 3}
    (reason,) = integrity_reasons(got, "c/transfer.json")
    assert reason.startswith(
        "c/transfer.json: integrity: 2 missing block(s) of 6; first: request r1 group 1:ssm-conv prefill rank 1 block 3"
    )


def test_a_latent_that_differs_across_ranks_is_not_a_replica():
    p1 = [(0, "mla", 7, "0", 0x2000, 512, "bb"), *P1[1:]]
    got = integrity(offer("p0", 0, "r1", P0) + offer("p1", 1, "r1", p1), fixed_reads())
    assert got["missing"] == 1 and got["first"]["missing"]["group"] == "0:mla"


def test_a_changed_byte_is_mismatched_and_another_requests_bytes_are_stale():
    got = integrity(offer("p0", 0, "r1", P0) + offer("p1", 1, "r1", P1), fixed_reads(conv1="ff"))
    assert (got["mismatched"], got["stale"], got["matched"]) == (1, 0, 5)
    assert got["first"]["mismatched"] == {"request": "r1", "group": "1:ssm-conv", "prefill_rank": 1, "block": 3}
    # r2 reused rank 1's conv block after r1's lease expired; decode read r1 late and got r2's bytes
    r2 = [(1, "ssm-conv", 3, "0", 0xA000, 256, "c2")]
    got = integrity(offer("p0", 0, "r1", P0) + offer("p1", 1, "r1", P1) + offer("p1", 1, "r2", r2), fixed_reads("c2"))
    assert (got["stale"], got["mismatched"], got["unread_requests"]) == (1, 0, 1)
    assert "1 stale block(s)" in integrity_reasons(got, "t")[0]


def test_decode_ranks_reading_parts_of_a_block():
    """Decode TP 2 > prefill TP 1: each decode rank reads half of every descriptor."""
    units = [
        (0, "kv", 5, "0", 0x100, 64, "w"),
        (0, "kv", 5, "0.0", 0x100, 32, "h0"),
        (0, "kv", 5, "0.1", 0x120, 32, "h1"),
    ]
    text = offer("p0", 0, "r1", units, split=2)
    both = landed("p0", "r1", [(0x100, 32, "h0")]) + landed("p0", "r1", [(0x120, 32, "h1")])
    assert integrity(text, both)["matched"] == 1
    assert integrity(text, landed("p0", "r1", [(0x100, 32, "h0")]))["missing"] == 1
    assert (
        integrity(text, landed("p0", "r1", [(0x100, 32, "h0")]) + landed("p0", "r1", [(0x120, 32, "xx")]))["mismatched"]
        == 1
    )


def test_failed_reads_are_counted_apart_and_nothing_compared_fails():
    got = integrity(offer("p0", 0, "r1", P0), landed("p0", "r1", [], state="ERR"))
    assert (got["compared"], got["failed_on_purpose"], got["failed_reads"]) == (0, 3, 1)
    assert integrity_reasons(got, "t") == [
        "t: integrity: no block compared and matched (3 block(s) of failed READs, 0 unread request(s); allowed: matched > 0)"
    ]


@pytest.mark.parametrize(
    ("integ", "reason"),
    [
        (None, "t: integrity: not measured (integrity is null; the plan switched the KV digests on)"),
        ({"not_measured": "no offer"}, "t: integrity: not measured (no offer)"),
        ({"compared": 1, "matched": 1, "mismatched": -1, "missing": 0, "stale": 0}, "t: integrity: impossible counts"),
    ],
)
def test_fails_closed(integ, reason):
    assert integrity_reasons(integ, "t")[0].startswith(reason)


def test_no_offer_line_is_not_measured():
    got = integrity("nothing here", fixed_reads())
    assert got["not_measured"].startswith("no PDSWEEP_KV_OFFER line in the prefill logs")


# ---------------------------------------------------------------- the gate, end to end on a fixture run
_KV = ["vllm", "serve", "m", "--kv-transfer-config", '{"kv_connector":"NixlConnector"}']  # as the plan launches them
DIGESTS_ON = {
    "cell.json": {
        "instances": [
            {"name": f"{role}-0", "role": role, "argv": _KV, "env": {"PDSWEEP_KV_DIGEST": "1"}}
            for role in ("prefill", "decode")
        ]
    }
}
MATCHED = {"compared": 6, "matched": 6, "mismatched": 0, "missing": 0, "stale": 0, "first": {}}


def test_gate_fails_a_planned_cell_without_integrity_and_names_the_first_bad_block(tmp_path):
    cell = pd("tiny-mla-mamba2", 2, 1)
    assert (
        gate_run(write_run(tmp_path, "ok", [case(cell, DIGESTS_ON, {TR: {"integrity": MATCHED}})]))
        .cell(cell.id)
        .verdict
        == PASS
    )
    g = gate_run(write_run(tmp_path, "none", [case(cell, DIGESTS_ON)])).cell(cell.id)
    assert g.verdict == FAIL and list(g.reasons) == [
        f"{cell.id}/transfer.json: integrity: not measured (integrity is null; the plan switched the KV digests on)"
    ]
    bad = {
        **MATCHED,
        "matched": 4,
        "missing": 2,
        "first": {"missing": {"request": "r1", "group": "1:ssm-conv", "prefill_rank": 1, "block": 3}},
    }
    g = gate_run(write_run(tmp_path, "bad", [case(cell, DIGESTS_ON, {TR: {"integrity": bad}})])).cell(cell.id)
    assert g.verdict == FAIL and g.reasons[0].startswith(
        f"{cell.id}/transfer.json: integrity: 2 missing block(s) of 6; first: request r1 group 1:ssm-conv prefill rank 1 block 3"
    )
    # a plan without the digests (a GPU sweep today) asks nothing of the file
    assert gate_run(write_run(tmp_path, "gpu", [case(cell)])).cell(cell.id).verdict == PASS


def test_plan_switches_digests_on_for_cpu_pd_instances_and_asserts_off_on_decode_only():
    ls = load_sweep("sweeps/cpu-smoke.yaml")
    cells = {c.id: c for c in expand(ls).cells}

    def envs(cid: str) -> dict[str, dict[str, str]]:
        return {s.name: s.env for s in instances(cells[cid], Slot(0, (), 20000), ls, "/m", "python")}

    pd_env = envs("tiny-llama.p1d2.b32-32.fixed")
    assert {k: v.get("PDSWEEP_KV_DIGEST") for k, v in pd_env.items()} == {"prefill-0": "1", "decode-0": "1"}
    # prefill's env is the same for p1d1 and p1d2 (one shared instance): its parts are fixed, not per cell
    assert pd_env["prefill-0"] == envs("tiny-llama.p1d1.b32-32.fixed")["prefill-0"]
    assert "PDSWEEP_KV_DIGEST" not in envs("tiny-llama.ref-tp1.b32.fixed")["single-0"]
    off = envs("tiny-mla-mamba2.p2d1.b128-128.unfixed.asserts-off")
    assert off["decode-0"]["PYTHONOPTIMIZE"] == "1" and "PYTHONOPTIMIZE" not in off["prefill-0"]


def test_the_fake_vllm_logs_digests_that_match(monkeypatch, capsys):
    """tests/fake_vllm.py speaks pdsweep.engine.kvdigest's lines when the plan switches it on, so fake PD
    cells pass the integrity gate (and stay silent otherwise)."""
    import fake_vllm

    fake_vllm._kv_digest_line("offer", "fake-1", "fake-1-0", "Q: 1 + 1")
    assert capsys.readouterr().out == ""
    monkeypatch.setenv("PDSWEEP_KV_DIGEST", "1")
    fake_vllm._kv_digest_line("offer", "fake-1", "fake-1-0", "Q: 1 + 1")
    prefill = capsys.readouterr().out
    fake_vllm._kv_digest_line("landed", "fake-1", "fake-1-0", "Q: 1 + 1")
    got = integrity(prefill, capsys.readouterr().out)
    assert (got["compared"], got["matched"]) == (2, 2)


def test_a_read_nixl_refused_leaves_every_block_missing_and_names_the_descriptor():
    """vLLM 0.32.0 pre-fix, asserts off: decode's whole SSM conv descriptor (768 B) against prefill rank 0's
    shard (384 B); NIXL makeXferReq refuses the READ ("length mismatch"), vLLM stops posting READs for it."""
    refused = f"INFO {LANDED_TAG} agent=p0 req=r1 state=REFUSED us=0 bytes=0 d=9000/256/local512\n"
    got = integrity(offer("p0", 0, "r1", P0) + offer("p1", 1, "r1", P1), refused)
    assert (got["refused_reads"], got["missing"], got["matched"], got["failed_on_purpose"]) == (1, 6, 0, 0)
    assert got["missing_by_group"] == {"0:mla": [0, 1], "1:ssm-conv": [0, 1], "1:ssm-temporal": [0, 1]}
    assert got["first"]["refused"] == {
        "request": "r1", "group": "1:ssm-conv", "prefill_rank": 0, "block": 3, "remote_bytes": 256, "local_bytes": 512
    }  # fmt: skip
    reasons = integrity_reasons(got, "t")
    assert reasons[0] == (
        "t: integrity: 1 READ(s) NIXL refused to prepare (vLLM transfer_setup_failed); first: request r1 group "
        "1:ssm-conv prefill rank 0 block 3 (decode's descriptor 512 B, prefill's 256 B): that KV never arrived"
    )
    assert reasons[1].endswith("; missing (group: prefill ranks): 0:mla: 0,1; 1:ssm-conv: 0,1; 1:ssm-temporal: 0,1")


def test_a_cell_that_failed_measuring_carries_what_the_digests_saw(monkeypatch):
    """A failed cell writes no transfer.json: run_cell appends these reasons to its status reason."""
    import types

    from pdsweep.measure import phases

    refused = f"INFO {LANDED_TAG} agent=p0 req=r1 state=REFUSED us=0 bytes=0 d=9000/256/local512\n"
    integ = integrity(offer("p0", 0, "r1", P0) + offer("p1", 1, "r1", P1), refused)
    monkeypatch.setattr(phases, "read_split", lambda dep: {"integrity": integ})
    (first, missing) = phases.failed_cell_integrity(types.SimpleNamespace(transfer_mode="pull"))
    assert first.startswith("KV digests in the logs so far: integrity: 1 READ(s) NIXL refused to prepare")
    # a push cell too (its WRITE digests, pdsweep.core.kvpush): before push digests it said nothing
    assert phases.failed_cell_integrity(types.SimpleNamespace(transfer_mode="push"))[0] == first
    monkeypatch.setattr(phases, "read_split", lambda dep: {"integrity": {"not_measured": "x"}})
    assert phases.failed_cell_integrity(types.SimpleNamespace(transfer_mode="pull")) == []


def test_a_failed_first_request_carries_what_the_digests_saw(tmp_path):
    """pdsweep.deploy.kvnote: the unfixed asserts-off cell fails at its first request (HTTP 500), before any
    phase; the reason names the READ NIXL refused and the missing groups from the instances' logs."""
    import types

    from pdsweep.deploy.kvnote import integrity_note

    (tmp_path / "p.log").write_text("old lines\n" + offer("p0", 0, "r1", P0) + offer("p1", 1, "r1", P1))
    (tmp_path / "d.log").write_text(f"{LANDED_TAG} agent=p0 req=r1 state=REFUSED us=0 bytes=0 d=9000/256/local512\n")
    handles = [
        types.SimpleNamespace(name="prefill-0", log_path=tmp_path / "p.log", log_start=len("old lines\n")),
        types.SimpleNamespace(name="decode-0", log_path=tmp_path / "d.log", log_start=0),
    ]
    first, missing = integrity_note(handles, settle_s=0)
    assert first.startswith("KV digests: integrity: 1 READ(s) NIXL refused to prepare")
    assert missing.endswith("missing (group: prefill ranks): 0:mla: 0,1; 1:ssm-conv: 0,1; 1:ssm-temporal: 0,1")
    (tmp_path / "d.log").write_text("")
    assert integrity_note(handles[:1], settle_s=0)[0].startswith("KV digests: integrity: no block compared")


def test_push_cells_are_digested_and_gated_like_pull_cells(tmp_path):
    """Push mode (NixlPushConnector: prefill WRITEs): the plan switches the digests on for prefill and decode
    (pdsweep.engine.kvpushdigest), transfer.json integrity comes from the WRITE lines and the gate fails closed."""
    ls = load_sweep("sweeps/cpu-push.yaml")
    cell = next(c for c in expand(ls).cells if c.kind == "pd")
    envs = {s.name: s.env for s in instances(cell, Slot(0, (), 20000), ls, "/m", "python")}
    assert {k: v.get("PDSWEEP_KV_DIGEST") for k, v in envs.items()} == {"prefill-0": "1", "decode-0": "1"}
    push_argv = ["vllm", "serve", "m", "--kv-transfer-config", '{"kv_connector":"NixlPushConnector"}']
    planned = {"cell.json": {"instances": [{**i, "argv": push_argv} for i in DIGESTS_ON["cell.json"]["instances"]]}}
    g = gate_run(write_run(tmp_path, "push", [case(pd("tiny-mla-mamba2", 2, 1), planned)])).cell(
        pd("tiny-mla-mamba2", 2, 1).id
    )
    assert g.verdict == FAIL and g.reasons[-1].endswith(
        "integrity: not measured (integrity is null; the plan switched the KV digests on)"
    )
    # what the file must hold comes from the plan: a pull-shaped integrity in a push cell fails, push's passes
    cell = pd("tiny-mla-mamba2", 2, 1)
    wrong = gate_run(write_run(tmp_path, "pull-shaped", [case(cell, planned, {TR: {"integrity": MATCHED}})]))
    assert [r for r in wrong.cell(cell.id).reasons if "integrity" in r] == [
        f'{cell.id}/transfer.json: integrity: mode null in a push cell (allowed: "push")'
    ]
    pushed = {**MATCHED, "mode": "push", "unwritten": 0}
    ok = gate_run(write_run(tmp_path, "push-ok", [case(cell, planned, {TR: {"integrity": pushed}})])).cell(cell.id)
    assert [r for r in ok.reasons if "integrity" in r] == []


def test_a_push_cells_transfer_json_carries_integrity_from_the_write_digests(tmp_path):
    """pdsweep.measure.phases.read_split in push mode: prefill's WRITE lines against decode's landed lines."""
    import types

    from pdsweep.measure import phases

    (tmp_path / "p.log").write_text(
        f"{WRITE_TAG} agent=d0 engine=P rank=0 req=p-1 dreq=d-1 us=7 bytes=64 d=0/kv/3/0/e0/32/aa;0/kv/3/1/2e0/32/bb\n"
    )
    (tmp_path / "d.log").write_text(
        f"{PUSHED_TAG} agent=d0 req=d-1 state=DONE us=3 bytes=64 split=1 d=e0/32/aa;2e0/32/bb\n"
    )
    p, d = (types.SimpleNamespace(log_path=tmp_path / n) for n in ("p.log", "d.log"))
    dep = types.SimpleNamespace(
        transfer_mode="push",
        uses=[types.SimpleNamespace(handle=h, log_offset=0) for h in (p, d)],
        decode_handles=[d],
        role=lambda r: [p] if r == "prefill" else [d],
    )
    integ = phases.read_split(dep)["integrity"]
    assert (integ["mode"], integ["compared"], integ["matched"], integ["requests"]) == ("push", 1, 1, 1)
    assert integ["cost"]["prefill_us"] == 7 and integ["cost"]["decode_us"] == 3


def test_decodes_own_prefix_cache_hits_are_counted_apart_not_missing():
    """Found in the CPU default (2026-12-07): tiny-llama p1d1 reported 149 missing kv blocks, exactly
    its decode's vllm:prefix_cache_hits_total (4768 tokens / 32). Decode computed a request's leading
    blocks from its own prefix cache and READ only the rest; those are prefix_cached. A gap that is
    not a leading run, a whole request, or an SSM group stays missing."""
    units = [(0, "kv", b, "0", 0x1000 * b, 64, f"k{b}") for b in (5, 6, 7)]
    tail = landed("p0", "r1", [(0x6000, 64, "k6"), (0x7000, 64, "k7")])
    got = integrity(offer("p0", 0, "r1", units), tail)
    assert (got["matched"], got["missing"], got["prefix_cached"]) == (2, 0, 1)
    head = landed("p0", "r1", [(0x5000, 64, "k5"), (0x6000, 64, "k6")])  # the last block never read
    got = integrity(offer("p0", 0, "r1", units), head)
    assert (got["matched"], got["missing"], got["prefix_cached"]) == (2, 1, 0)
    assert got["first"]["missing"]["block"] == 7
    none = landed("p0", "r1", [(0x1, 64, "x")])  # read something else: every block missing, none excused
    assert integrity(offer("p0", 0, "r1", units), none)["prefix_cached"] == 0
    ssm = [(1, "ssm-conv", 3, "0", 0x9000, 256, "c0"), (1, "ssm-conv", 4, "0", 0x9100, 256, "c1")]
    got = integrity(offer("p0", 0, "r1", ssm), landed("p0", "r1", [(0x9100, 256, "c1")]))
    assert (got["missing"], got["prefix_cached"]) == (1, 0)


def test_decode_reading_prefills_blocks_out_of_order_is_mismatched_and_names_the_block():
    """The scrambled-KV drill: the proxy reverses remote_block_ids, so decode fills position 0 with
    prefill's block 6 and position 1 with block 5. Every byte equals prefill's at its address (the
    join by remote address matches); the READ's order (pdsweep.engine.kvdigest, ``order=``) does not."""
    units = [(0, "kv", b, "0", 0x1000 * b, 64, f"k{b}") for b in (5, 6)]
    reads = [(0x6000, 64, "k6"), (0x5000, 64, "k5")]
    assert (
        integrity(offer("p0", 0, "r1", units), landed("p0", "r1", reads, fields=" tp_ratio=1 order=0:5,6"))[
            "mismatched"
        ]
        == 0
    )
    got = integrity(offer("p0", 0, "r1", units), landed("p0", "r1", reads, fields=" tp_ratio=1 order=0:6,5"))
    assert (got["compared"], got["matched"], got["mismatched"], got["misplaced"]) == (2, 0, 2, 2)
    assert got["first"]["mismatched"] == {"request": "r1", "group": "0:kv", "prefill_rank": 0, "block": 5}
    assert got["first"]["misplaced"] == {
        "request": "r1", "group": "0:kv", "prefill_rank": 0, "block": 5, "read_instead": 6, "position": 0
    }  # fmt: skip
    assert integrity_reasons(got, "t") == [
        "t: integrity: 2 mismatched block(s) of 2; first: request r1 group 0:kv prefill rank 0 block 5 (decode's "
        "bytes differ from what prefill offered); 2 misplaced: decode filled request r1 group 0:kv prefill rank 0 "
        "block 5's position 0 with prefill block 6 (the READ's remote_block_ids out of the order prefill offered them)"
    ]


def test_only_positions_decode_read_count_as_misplaced():
    """Decode's prefix cache held position 0 (block 5), so it read positions 1-2 only: a scrambled
    [7, 6, 5] filled position 1 with block 6 (right) and position 2 with block 5 (wrong)."""
    units = [(0, "kv", b, "0", 0x1000 * b, 64, f"k{b}") for b in (5, 6, 7)]
    reads = [(0x6000, 64, "k6"), (0x5000, 64, "k5")]
    got = integrity(offer("p0", 0, "r1", units), landed("p0", "r1", reads, fields=" tp_ratio=1 order=0:7,6,5"))
    assert (got["misplaced"], got["first"]["misplaced"]["block"], got["first"]["misplaced"]["position"]) == (1, 7, 2)


def test_decode_tp_not_dividing_prefills_parts_is_not_measured():
    units = [
        (0, "kv", 5, "0", 0x100, 96, "w"),
        (0, "kv", 5, "0.0", 0x100, 48, "h0"),
        (0, "kv", 5, "0.1", 0x130, 48, "h1"),
    ]
    ok = integrity(offer("p0", 0, "r1", units, split=2), landed("p0", "r1", [(0x100, 48, "h0")], fields=" tp_ratio=2"))
    assert ok["missing"] == 1 and "not_measured" not in ok  # its sibling rank's half was never read
    got = integrity(offer("p0", 0, "r1", units, split=2), landed("p0", "r1", [(0x100, 32, "t0")], fields=" tp_ratio=3"))
    assert got["not_measured"].startswith("decode TP / prefill TP = 3 does not divide the parts prefill digests")


def test_the_report_shows_every_digested_cells_figures_passing_or_not(tmp_path):
    """report.md's "KV integrity" table: a PASS shows the bytes it rests on (compared = matched), a FAIL its
    stale block, a sampled GPU cell its digest and sample, a not-measured cell why."""
    from pdsweep.judge.gate import gate_run
    from pdsweep.report.html import write_report
    from pdsweep.report.integrity_section import INTEGRITY_COLUMNS, integrity_rows

    ok, bad, gpu, none = (pd(m, 2, 1) for m in ("tiny-mla-mamba2", "tiny-llama", "tiny-mla", "tiny-nemotron-h"))
    stale = {**MATCHED, "matched": 5, "stale": 1, "prefix_cached": 2, "cost": {"us_per_request": 612.4}}
    sampled = {**MATCHED, "impl": ["wsum-128"], "sample": 0.25, "sampled_out": 3}
    cases = [
        case(ok, DIGESTS_ON, {TR: {"integrity": MATCHED}}),
        case(bad, DIGESTS_ON, {TR: {"integrity": stale}}),
        case(gpu, DIGESTS_ON, {TR: {"integrity": sampled}}),
        case(none, DIGESTS_ON, {TR: {"integrity": {"not_measured": "no PDSWEEP_KV_OFFER line"}}}),
    ]
    run = write_run(tmp_path, "r", cases)
    rows = {r[0]: dict(zip(INTEGRITY_COLUMNS, r)) for r in integrity_rows(gate_run(run))}
    assert set(rows) == {ok.id, bad.id, gpu.id, none.id}
    assert (rows[ok.id]["verdict"], rows[ok.id]["compared"], rows[ok.id]["matched"]) == ("PASS", "6", "6")
    b = rows[bad.id]
    assert (b["verdict"], b["stale"], b["apart"], b["us/request"]) == ("FAIL", "1", "2", "612")
    assert (rows[gpu.id]["digest"], rows[gpu.id]["apart"]) == ("wsum-128 (sample 0.25)", "0 + 3 req sampled out")
    assert rows[none.id]["compared"] == "not measured: no PDSWEEP_KV_OFFER line"
    md = write_report(run, tmp_path / "report")["markdown"].read_text()
    assert "## KV integrity" in md and f"| {ok.id} | PASS | 6 | 6 | 0 | 0 | 0 | - | 0 | - | - |" in md
