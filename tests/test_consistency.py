"""Consistency probe against fake PD / reference servers with controlled tokens and
logprobs. No vLLM, no network."""

from __future__ import annotations

import asyncio
import zlib
from collections.abc import Callable

import pytest
from _fakes import block_non_loopback, completion, serve
from fastapi import FastAPI, HTTPException, Request

from pdsweep.core.errors import UserError
from pdsweep.judge.consistency import MAX_ABS_DLOGPROB as MAX_ABS_DLOGPROB_PD
from pdsweep.judge.consistency import judge_consistency, thresholds_for
from pdsweep.measure.probe import compare, probe
from pdsweep.measure.prompts import Prompt, build_prompts, probe_text, resolve_lengths
from pdsweep.results.layout import read_json, write_json

MAX_TOKENS = 8
# (prompt token ids) -> (token ids, top-1 logprobs)
Behaviour = Callable[[list[int]], tuple[list[int], list[float]]]


@pytest.fixture(scope="module")
def prompts(tokenizer) -> list[Prompt]:
    return build_prompts(
        tokenizer, block_size=16, max_model_len=512, lengths=["short", "blocks", "long", 41], max_tokens=MAX_TOKENS
    )


def ref_behaviour(ids: list[int]) -> tuple[list[int], list[float]]:
    """Deterministic per prompt: tokens from the prompt length, logprobs in (-3, -0.1)."""
    n = len(ids)
    return [(n * 7 + i * 13) % 250 + 2 for i in range(MAX_TOKENS)], [
        -0.1 - ((n + i) % 29) / 10 for i in range(MAX_TOKENS)
    ]


def _app(behaviour: Behaviour, seen: list[dict] | None = None, fail: bool = False) -> FastAPI:
    app = FastAPI()

    @app.post("/v1/completions")
    async def completions(req: Request) -> dict:
        body = await req.json()
        if seen is not None:
            seen.append(body)
        if fail:
            raise HTTPException(status_code=500, detail="decode engine died")
        toks, lps = behaviour(body["prompt"])
        lp = {
            "tokens": [f"token_id:{t}" for t in toks],
            "token_logprobs": lps,
            "top_logprobs": [{f"token_id:{t}": x} for t, x in zip(toks, lps)],
            "text_offset": list(range(len(toks))),
        }
        return completion("".join(f"<{t}>" for t in toks), model=body["model"], logprobs=lp)

    return app


def _run(pd: Behaviour, prompts: list[Prompt], *, pd_fail: bool = False, seen: list[dict] | None = None) -> dict:
    with block_non_loopback(), serve(_app(pd, seen, fail=pd_fail)) as pd_url, serve(_app(ref_behaviour)) as ref_url:
        return asyncio.run(probe(f"{pd_url}/v1/completions", ref_url, "tiny", prompts, MAX_TOKENS, timeout_s=30))


def _alter(which: int, tokens_from: int | None = None, dlogprob: float = 0.0, at: int | None = None) -> Behaviour:
    """PD = reference, except for prompts of length ``which`` (-1: all): tokens replaced
    from ``tokens_from`` on, ``dlogprob`` added at position ``at`` (None: everywhere)."""

    def pd(ids: list[int]) -> tuple[list[int], list[float]]:
        toks, lps = ref_behaviour(ids)
        if which in (-1, len(ids)):
            if tokens_from is not None:
                toks = toks[:tokens_from] + [t + 1 for t in toks[tokens_from:]]
            lps = [x + (dlogprob if at in (None, i) else 0.0) for i, x in enumerate(lps)]
        return toks, lps

    return pd


def _judge(result: dict, attention="gqa", ssm="none", tp_equal=True) -> dict:
    return judge_consistency("cell", "ref-cell", result, thresholds_for(attention, ssm, tp_equal))


# ---------------------------------------------------------------- prompts
def test_prompt_lengths(prompts):
    assert [(p.name, p.num_tokens) for p in prompts] == [("short", 15), ("blocks", 56), ("long", 503), ("len41", 41)]
    assert all(p.token_ids[0] == 0 for p in prompts)  # BOS counted
    ids = [tuple(p.token_ids) for p in prompts]
    assert not any(a != b and b[: len(a)] == a for a in ids for b in ids)  # no prompt is a prefix of another


def test_prompts_are_deterministic(tokenizer, prompts):
    again = build_prompts(tokenizer, 16, 512, ["short", "blocks", "long", 41], max_tokens=MAX_TOKENS)
    assert [p.token_ids for p in again] == [p.token_ids for p in prompts]


def test_task_prompts_keep_bos_and_end_in_an_open_question(tokenizer):
    task = build_prompts(tokenizer, 16, 512, ["short", "blocks", "long", 41], MAX_TOKENS, text="task")
    assert [(p.name, p.num_tokens) for p in task] == [("short", 15), ("blocks", 56), ("long", 503), ("len41", 41)]
    assert all(p.token_ids[0] == 0 and p.token_ids.count(0) == 1 for p in task)  # BOS once, in front
    assert all(p.text.endswith("?\nA:") for p in task), [p.text[-20:] for p in task]
    assert all("What is" in p.text for p in task) and task[2].text.count("Q: What is") >= 10, [p.text for p in task]
    ids = [tuple(p.token_ids) for p in task]
    assert not any(a != b and b[: len(a)] == a for a in ids for b in ids)
    again = build_prompts(tokenizer, 16, 512, ["short", "blocks", "long", 41], MAX_TOKENS, text="task")
    assert [p.token_ids for p in again] == [p.token_ids for p in task]
    with pytest.raises(ValueError, match="expected 'prose' or 'task'"):
        build_prompts(tokenizer, 16, 512, ["short"], MAX_TOKENS, text="poetry")


def test_probe_text_auto_follows_training():
    assert probe_text("auto", True) == "task" and probe_text("auto", False) == "prose"
    assert probe_text("prose", True) == "prose" and probe_text("task", False) == "task"


def test_resolve_lengths_edges():
    assert resolve_lengths(16, 40, ["short", "blocks", "long"], 8) == [("short", 15), ("blocks", 31), ("long", 31)]
    assert resolve_lengths(1, 100, ["short", 5, 5], 8) == [("short", 1), ("len5", 5)]
    with pytest.raises(UserError, match="outside 1..503"):
        resolve_lengths(16, 512, [600], 8)
    with pytest.raises(UserError, match="no room"):
        resolve_lengths(16, 8, ["short"], 8)
    with pytest.raises(UserError, match="unknown entry"):
        resolve_lengths(16, 512, ["huge"], 8)


def test_bad_tokenizer_path(tmp_path):
    with pytest.raises(UserError, match="cannot load tokenizer"):
        build_prompts(tmp_path / "nope", 16, 512, ["short"])


# ---------------------------------------------------------------- compare / thresholds
def test_compare():
    c = compare([1, 2, 3, 4], [-1, -1, -1, -1], [1, 2, 9, 4], [-1, -1.5, -3, -1])
    assert c["first_divergence"] == 2 and c["exact_match_rate"] == 0.75
    assert c["max_abs_dlogprob"] == 0.5 and c["max_abs_dlogprob_at"] == 1  # position 2 not compared
    c = compare([1, 2], [-1, -1], [1, 2, 3], [-1, -1, -1])
    assert c["first_divergence"] == 2 and c["exact_match_rate"] == 1.0
    c = compare([5], [-1], [6], [-1])
    assert c["first_divergence"] == 0 and c["max_abs_dlogprob"] is None
    c = compare([1, 2], [-1, None], [1, 2], [-1, -1])
    assert c["missing_logprob_at"] == 1 and c["max_abs_dlogprob"] is None
    assert compare([], [], [], [])["exact_match_rate"] == 0.0


def test_thresholds():
    eq = thresholds_for("gqa", "none", True)
    assert eq["max_abs_dlogprob"] == 1.5 and eq["min_match_frac"] == 1.0 and not eq["hybrid"]
    hy = thresholds_for("mla", "kda", False)
    assert hy["max_abs_dlogprob"] == 1.5 and hy["min_match_frac"] == 0.5 and hy["hybrid"]


# ---------------------------------------------------------------- probe against fake servers
def test_identical_passes(prompts, tmp_path):
    seen: list[dict] = []
    result = _run(_alter(-1), prompts, seen=seen)
    out = _judge(result)
    assert out["verdict"] == "pass" and out["reasons"] == []
    for p in out["prompts"]:
        assert p["first_divergence"] is None and p["exact_match_rate"] == 1.0 and p["max_abs_dlogprob"] == 0.0
        assert len(p["pd_tokens"]) == MAX_TOKENS and all(isinstance(t, int) for t in p["pd_tokens"])
    body = seen[0]
    assert body["temperature"] == 0 and body["seed"] == 0 and body["logprobs"] == 1
    assert body["max_tokens"] == MAX_TOKENS and body["prompt"] == prompts[0].token_ids
    back = read_json(write_json(tmp_path / "consistency.json", out))
    assert back["verdict"] == "pass" and back["reference_cell"] == "ref-cell"
    assert back["thresholds"]["max_abs_dlogprob"] == 1.5 and back["thresholds"]["max_tokens"] == MAX_TOKENS


def test_divergence_at_token_zero_fails_naming_prompt_and_position(prompts):
    # CPU.md: DeepSeek-V2 MLA, 41-token prompt wrong from the first token through P->D
    out = _judge(_run(_alter(41, tokens_from=0), prompts), attention="mla")
    assert out["verdict"] == "fail" and len(out["reasons"]) == 1
    (reason,) = out["reasons"]
    assert "prompt 'len41' (41 tokens)" in reason and "diverge at position 0" in reason
    row = next(p for p in out["prompts"] if p["name"] == "len41")
    assert row["first_divergence"] == 0 and row["exact_match_rate"] == 0.0 and row["max_abs_dlogprob"] is None
    assert [p["verdict"] for p in out["prompts"]] == ["pass", "pass", "pass", "fail"]


def test_logprob_delta_2_fails(prompts):
    out = _judge(_run(_alter(15, dlogprob=2.0, at=3), prompts))
    assert out["verdict"] == "fail"
    (reason,) = out["reasons"]
    assert "prompt 'short' (15 tokens)" in reason and "2.0000 nats at position 3" in reason


def test_hybrid_small_delta_passes(prompts):
    out = _judge(_run(_alter(-1, dlogprob=0.1), prompts), ssm="mamba2")
    assert out["verdict"] == "pass"
    assert all(p["max_abs_dlogprob"] == pytest.approx(0.1) for p in out["prompts"])


def test_hybrid_drift_after_six_tokens_fails(prompts):
    # CPU.md: NemotronH 1P1D, one prompt drifts after 6 tokens every time
    out = _judge(_run(_alter(56, tokens_from=6, dlogprob=0.05), prompts), ssm="mamba2")
    assert out["verdict"] == "fail"
    (reason,) = out["reasons"]
    assert "prompt 'blocks' (56 tokens)" in reason and "position 6" in reason and "8 of 8 must match" in reason
    row = next(p for p in out["prompts"] if p["name"] == "blocks")
    assert row["exact_match_rate"] == 0.75 and row["max_abs_dlogprob"] == pytest.approx(0.05)


def test_different_tp_allows_late_drift_only(prompts):
    late = _judge(_run(_alter(56, tokens_from=6), prompts), tp_equal=False)
    assert late["verdict"] == "pass"
    early = _judge(_run(_alter(56, tokens_from=2), prompts), tp_equal=False)
    assert early["verdict"] == "fail" and "4 of 8 must match" in early["reasons"][0]


def test_pd_request_failure_fails(prompts):
    out = _judge(_run(_alter(-1), prompts[:1], pd_fail=True))
    assert out["verdict"] == "fail"
    assert "prompt 'short' (15 tokens): PD request failed" in out["reasons"][0] and "500" in out["reasons"][0]


def test_nothing_probed_or_no_reference_fails():
    th = thresholds_for("gqa", "none", True)
    assert judge_consistency("c", "r", {"max_tokens": 8, "prompts": []}, th)["verdict"] == "fail"
    assert "no reference cell" in judge_consistency("c", None, {"max_tokens": 8, "prompts": []}, th)["reasons"][0]


# ---------------------------------------------------------------- triage: transfer / engine / both
def _next(prefix: list[int]) -> tuple[int, float]:
    """A self-consistent greedy 'model': the next token depends on the whole prefix."""
    h = zlib.crc32(bytes(str(prefix), "ascii"))
    return h % 250 + 2, -0.1 - (h % 17) / 10


def autoregressive(broken_decode: bool = False) -> Behaviour:
    """Generation token by token. ``broken_decode``: positions >= 1 (computed one token over a
    pre-filled cache, the path decode takes after a transfer) come out shifted, while a fresh
    request (plain prefill path) is right: a deliberately broken engine path."""

    def run(ids: list[int]) -> tuple[list[int], list[float]]:
        seq, toks, lps = list(ids), [], []
        for i in range(MAX_TOKENS):
            t, lp = _next(seq)
            if broken_decode and i > 0:
                t = t % 250 + 3
            toks.append(t)
            lps.append(lp)
            seq.append(t)
        return toks, lps

    return run


def _triage_run(pd: Behaviour, ref: Behaviour, prompts: list[Prompt]) -> dict:
    """The PD cell's probe, the reference cell's probe + path check, merged as the judge does."""
    from pdsweep.judge.verdicts import merge_probes

    async def ref_probe(url: str) -> dict:
        import httpx

        from pdsweep.measure.probe import complete, path_check

        rows = []
        async with httpx.AsyncClient(timeout=30) as client:
            for p in prompts:
                t, lp = await complete(client, url, "tiny", p, MAX_TOKENS)
                rows.append(
                    {
                        "name": p.name,
                        "prompt_tokens": p.num_tokens,
                        "tokens": t,
                        "token_logprobs": lp,
                        "path_check": await path_check(client, url, "tiny", p, t, lp),
                    }
                )
        return {"max_tokens": MAX_TOKENS, "prompts": rows}

    def as_raw(res: dict) -> dict:
        return {
            "max_tokens": MAX_TOKENS,
            "prompts": [
                {
                    "name": r["name"],
                    "prompt_tokens": r["prompt_tokens"],
                    "tokens": r["pd_tokens"],
                    "token_logprobs": r["pd_logprobs"],
                    "error": r["error"],
                }
                for r in res["prompts"]
            ],
        }

    with block_non_loopback(), serve(_app(pd)) as pd_url, serve(_app(ref)) as ref_url:
        pd_raw = as_raw(asyncio.run(probe(f"{pd_url}/v1/completions", ref_url, "tiny", prompts, MAX_TOKENS, 30)))
        ref_raw = asyncio.run(ref_probe(f"{ref_url}/v1/completions"))
    return _judge(merge_probes(pd_raw, ref_raw), attention="mla")


def test_path_check_of_a_consistent_engine_passes(prompts):
    out = _triage_run(autoregressive(), autoregressive(), prompts)
    assert out["verdict"] == "pass" and out["triage"]["verdict"] == "none"
    for p in out["prompts"]:
        pc = p["path_check"]
        assert pc["mismatched_positions"] == [] and pc["max_abs_dlogprob"] == 0.0
        assert len(pc["plain_tokens"]) == MAX_TOKENS - 1 and p["engine_path_ok"] is True


def test_transfer_fault_is_triaged_transfer(prompts):
    def lost_kv(ids: list[int]) -> tuple[list[int], list[float]]:  # decode saw another prompt
        return autoregressive()(ids[:-1] + [ids[-1] + 1])

    out = _triage_run(lost_kv, autoregressive(), prompts)
    assert out["verdict"] == "fail" and out["triage"]["verdict"] == "transfer"
    assert "only P->D differs" in out["triage"]["explanation"]


def test_broken_engine_path_is_triaged_engine(prompts):
    # the single instance's decode path is broken; PD computes position 0 along it too
    def pd(ids: list[int]) -> tuple[list[int], list[float]]:
        toks, lps = autoregressive(broken_decode=True)(ids)
        return [toks[0] % 250 + 3, *toks[1:]], lps

    out = _triage_run(pd, autoregressive(broken_decode=True), prompts)
    assert out["verdict"] == "fail" and out["triage"]["verdict"] == "engine"
    for p in out["prompts"]:
        assert p["engine_path_ok"] is False
        assert p["path_check"]["mismatched_positions"] == list(range(1, MAX_TOKENS))


def test_mixed_is_triaged_both_and_missing_check_unknown():
    from pdsweep.judge.consistency import triage

    tok = {"pd_tokens": [1], "ref_tokens": [2], "error": None}
    rows = [
        {"name": "a", "verdict": "fail", "engine_path_ok": True, **tok},
        {"name": "b", "verdict": "fail", "engine_path_ok": False, **tok},
        {"name": "c", "verdict": "pass", "engine_path_ok": None, **tok},
    ]
    assert triage(rows)["verdict"] == "both"
    assert triage(rows[:1] + [{"name": "d", "verdict": "fail", "engine_path_ok": None, **tok}])["verdict"] == "unknown"
    assert triage(rows[2:])["verdict"] == "none"
    # a PD request that failed (decode crashed, timed out) has nothing to triage: never 'transfer'
    crashed = {
        "name": "e",
        "verdict": "fail",
        "engine_path_ok": True,
        "pd_tokens": [],
        "ref_tokens": [2],
        "error": "PD request failed: ReadTimeout",
    }
    assert triage(rows[:1] + [crashed])["verdict"] == "unknown"
    # with different P/D TP the reference does not run the prefill engine's TP: said so
    assert "prefill engine at its own TP" in triage(rows[:1], tp_equal=False)["explanation"]
    th = thresholds_for("gqa", "none", True)
    assert judge_consistency("c", None, {"max_tokens": 8, "prompts": []}, th)["triage"]["verdict"] == "unknown"


def test_engine_path_check_is_tighter_than_pd_and_fails_closed():
    from pdsweep.judge.consistency import ENGINE_PATH_MAX_DLOGPROB, engine_path_ok

    ok = {"plain_tokens": [5, 6], "mismatched_positions": [], "missing_logprob_at": None}
    assert engine_path_ok({**ok, "max_abs_dlogprob": 1e-5}) is True
    assert engine_path_ok({**ok, "max_abs_dlogprob": 0.3}) is False  # fine for P->D, not for one instance
    assert ENGINE_PATH_MAX_DLOGPROB < MAX_ABS_DLOGPROB_PD
    assert engine_path_ok({**ok, "max_abs_dlogprob": None, "missing_logprob_at": 1}) is None  # never 'engine'
    assert engine_path_ok({**ok, "max_abs_dlogprob": 0.0, "error": "plain-path request failed"}) is None
    assert engine_path_ok(None) is None


def test_plain_path_requests_bypass_the_prefix_cache(prompts):
    """Each plain-path request carries its own cache_salt: with prefix caching on,
    prompt + tokens[:k] would otherwise reuse the first request's blocks (decode path again)."""
    import httpx

    from pdsweep.measure.probe import complete, path_check

    seen: list[dict] = []

    async def go(url: str) -> dict:
        async with httpx.AsyncClient(timeout=30) as client:
            t, lp = await complete(client, url, "tiny", prompts[0], MAX_TOKENS)
            return await path_check(client, url, "tiny", prompts[0], t, lp)

    with block_non_loopback(), serve(_app(autoregressive(), seen)) as url:
        pc = asyncio.run(go(f"{url}/v1/completions"))
    assert pc["error"] is None and len(seen) == MAX_TOKENS
    assert "cache_salt" not in seen[0]  # the reference's own answer: the normal path
    salts = [b["cache_salt"] for b in seen[1:]]
    assert len(set(salts)) == MAX_TOKENS - 1 and all(b["max_tokens"] == 1 for b in seen[1:])
