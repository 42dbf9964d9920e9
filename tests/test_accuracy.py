"""Accuracy stage: the offline arithmetic task, real lm-eval against a fake OpenAI server,
expected values, the two-proportion test and the verdict. No vLLM, no network."""

from __future__ import annotations

import os

# before anything imports datasets / huggingface_hub (they read these at import time)
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import json
import math
import re
from pathlib import Path

import pytest
import yaml
from _fakes import block_non_loopback, completion, serve
from fastapi import FastAPI, Request

from pdsweep.core.errors import UserError
from pdsweep.core.stats import two_proportion_p
from pdsweep.judge.accuracy import judge, load_expected
from pdsweep.measure.endpoints import completions_url
from pdsweep.measure.lmeval import api_extra_missing, run_lm_eval, task_result
from pdsweep.measure.tolerance import tolerance_at
from pdsweep.results.layout import read_json, write_json
from pdsweep.sweepfile.phases import EvalSpec
from pdsweep.tiny import arith

UPSTREAM = "vllm tests/v1/kv_connector/nixl_integration/test_accuracy.py"
needs_lm_eval_api = pytest.mark.skipif(
    bool(api_extra_missing()),
    reason=f"lm-eval API models need the 'api' extra (missing: {api_extra_missing()}): pip install 'lm-eval[api]'",
)
Q = re.compile(r"What is (\d+) ([-+*]) (\d+)\?")


def _solve(question: str) -> int:
    a, op, b = Q.search(question).groups()
    a, b = int(a), int(b)
    return {"+": a + b, "-": a - b, "*": a * b}[op]


# ---------------------------------------------------------------- offline task
def test_dataset_is_deterministic_distinct_and_correct(tmp_path):
    a = arith.write_dataset(tmp_path / "a.jsonl", n=200, seed=0)
    b = arith.write_dataset(tmp_path / "b.jsonl", n=200, seed=0)
    assert a.read_bytes() == b.read_bytes()
    rows = [json.loads(line) for line in a.read_text().splitlines()]
    assert len(rows) == 200 and len({r["question"] for r in rows}) == 200
    assert all(r["answer"] == str(_solve(r["question"])) for r in rows)
    assert {m for r in rows for m in "+-*" if f" {m} " in r["question"]} == set("+-*")
    assert arith.write_dataset(tmp_path / "c.jsonl", n=200, seed=1).read_bytes() != a.read_bytes()
    with pytest.raises(ValueError):
        arith.questions(0)


def test_template_fewshot_comes_from_the_generator():
    cfg = yaml.safe_load(arith.TEMPLATE.read_text())
    assert cfg["task"] == arith.TASK_NAME and cfg["dataset_path"] == "json"
    assert cfg["fewshot_config"]["samples"] == arith.questions(3, arith.FEWSHOT_SEED)
    assert cfg["filter_list"][0]["name"] == "strict-match"


def test_render_task_points_at_an_absolute_data_file(tmp_path):
    d = arith.render_task(tmp_path / "tasks", n=30, seed=5)
    cfg = yaml.safe_load((d / "pdsweep_arith.yaml").read_text())
    data = Path(cfg["dataset_kwargs"]["data_files"]["test"])
    assert data.is_absolute() and data == d / "arith.jsonl"
    assert len(data.read_text().splitlines()) == 30


def test_completions_url():
    assert completions_url("http://h:1") == "http://h:1/v1/completions"
    assert completions_url("http://h:1/v1/") == "http://h:1/v1/completions"
    assert completions_url("http://h:1/v1/completions") == "http://h:1/v1/completions"
    assert completions_url("http://h:1/v1/completions", chat=True) == "http://h:1/v1/chat/completions"
    assert completions_url("http://h:1/v1/chat/completions") == "http://h:1/v1/completions"


# ---------------------------------------------------------------- real lm-eval, fake server
def _completions_app(correct: set[str], seen: list[dict]) -> FastAPI:
    app = FastAPI()

    @app.post("/v1/completions")
    async def completions(req: Request) -> dict:
        body = await req.json()
        seen.append(body)
        question = Q.findall(body["prompt"])[-1]  # the last question (after the few-shot)
        q = f"What is {question[0]} {question[1]} {question[2]}?"
        ans = _solve(q) if q in correct else _solve(q) + 1
        return completion(f" {ans}\n\nQ: What is 1 + 1?", model=body["model"])

    return app


@needs_lm_eval_api
def test_lm_eval_scores_exactly_the_fraction_answered_correctly(tokenizer, tmp_path):
    limit = 20
    docs = arith.questions(arith.DEFAULT_N, arith.DEFAULT_SEED)[:limit]  # lm-eval takes the first `limit`
    correct = {d["question"] for i, d in enumerate(docs) if i % 4 != 0}  # 15 of 20
    seen: list[dict] = []
    spec = EvalSpec(tasks=["pdsweep_arith"], limit=limit, num_concurrent=4, max_retries=1, timeout_s=30, seed=7)
    with block_non_loopback(), serve(_completions_app(correct, seen)) as url:
        out = run_lm_eval(f"{url}/v1/completions", "fake-model", str(tokenizer), spec, tmp_path)

    r = out["pdsweep_arith"]
    assert r["metric"] == "exact_match,strict-match"
    assert r["value"] == 15 / 20 and r["n"] == 20
    # lm-eval's mean stderr: sample std (ddof 1) / sqrt(n)
    assert r["stderr"] == pytest.approx(math.sqrt(0.75 * 0.25 * 20 / 19 / 20))
    assert len(seen) == 20
    body = seen[0]
    assert body["model"] == "fake-model" and body["seed"] == 7 and body["temperature"] == 0
    assert body["max_tokens"] == 16 and isinstance(body["prompt"], str)  # task cap; text requests
    assert body["prompt"].startswith("Q: What is 7 + 3?\nA: 10\n\n") and body["prompt"].endswith("?\nA:")
    lm = tmp_path / "lm_eval"
    saved = json.loads((lm / "results.json").read_text())
    assert saved["results"]["pdsweep_arith"]["exact_match,strict-match"] == 0.75
    assert len((lm / "samples_pdsweep_arith.jsonl").read_text().splitlines()) == 20
    assert (lm / "tasks" / "pdsweep_arith.yaml").exists() and (lm / "tasks" / "arith.jsonl").exists()


@needs_lm_eval_api
def test_lm_eval_chat_endpoint_and_single_sample_stderr_na(tokenizer, tmp_path):
    seen: list[dict] = []
    app = FastAPI()

    @app.post("/v1/chat/completions")
    async def chat(req: Request) -> dict:
        body = await req.json()
        seen.append(body)
        ans = _solve(body["messages"][-1]["content"])
        return {
            "id": "c",
            "object": "chat.completion",
            "created": 0,
            "model": body["model"],
            "choices": [{"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": f"{ans}"}}],
        }

    spec = EvalSpec(tasks=["pdsweep_arith"], limit=1, num_concurrent=1, max_retries=1, timeout_s=30)
    with block_non_loopback(), serve(app) as url:
        out = run_lm_eval(f"{url}/v1/completions", "fake-chat", str(tokenizer), spec, tmp_path, chat=True)
    r = out["pdsweep_arith"]
    assert r["value"] == 1.0 and r["n"] == 1 and r["stderr"] == "N/A"  # one sample: no stderr
    assert len(seen) == 1 and seen[0]["messages"][-1]["role"] == "user"
    verdict = judge("c", out, None, None, 0.05, is_reference=True)
    assert verdict["tasks"]["pdsweep_arith"]["stderr"] == "N/A"
    assert read_json(write_json(tmp_path / "accuracy.json", verdict))["tasks"]["pdsweep_arith"]["stderr"] == "N/A"


def test_unknown_task_is_a_user_error(tokenizer, tmp_path):
    if api_extra_missing():
        with pytest.raises(UserError, match="lm-eval\\[api\\]"):
            run_lm_eval("http://127.0.0.1:9", "m", str(tokenizer), EvalSpec(), tmp_path)
        return
    # pdsweep_* names skip lm-eval's own (slow to scan) task index
    with pytest.raises(UserError, match="pdsweep_no_such_task"):
        run_lm_eval("http://127.0.0.1:9", "m", str(tokenizer), EvalSpec(tasks=["pdsweep_no_such_task"]), tmp_path)


# ---------------------------------------------------------------- lm-eval result parsing
def test_task_result_stderr_na_and_missing_values():
    res = {
        "results": {
            "pdsweep_arith": {
                "alias": "pdsweep_arith",
                "exact_match,strict-match": 1.0,
                "exact_match_stderr,strict-match": "N/A",
            }
        },
        "n-samples": {"pdsweep_arith": {"original": 200, "effective": 1}},
    }
    assert task_result(res, "pdsweep_arith") == {
        "metric": "exact_match,strict-match",
        "value": 1.0,
        "stderr": "N/A",
        "n": 1,
    }
    res["results"]["pdsweep_arith"]["exact_match,strict-match"] = float("nan")
    assert task_result(res, "pdsweep_arith")["value"] is None
    assert task_result({}, "gsm8k") == {"metric": "exact_match,strict-match", "value": None, "stderr": None, "n": None}
    other = {"results": {"arc_easy": {"acc,none": 0.5, "acc_stderr,none": 0.1, "acc_norm,none": 0.6}}}
    assert task_result(other, "arc_easy")["metric"] == "acc,none"


# ---------------------------------------------------------------- expected values
def test_expected_file_has_upstream_values():
    exp = load_expected()
    want = {
        "qwen3-0.6b": 0.41,
        "deepseek-vl2-tiny": 0.19,
        "deepseek-v2-lite-chat": 0.65,
        "gemma-3-4b-it": 0.74,
        "granite-4.0-h-tiny": 0.77,
        "qwen3.5-0.8b": 0.33,
        "gemma-4-e2b-it": 0.485,
        "jamba2-3b": 0.74,
    }
    for model, value in want.items():
        assert exp[model]["gsm8k"] == {"value": value, "tolerance": 0.05, "n": 1319, "source": UPSTREAM}
    assert not [m for m in exp if "kimi" in m]


@pytest.mark.parametrize(
    "text, match",
    [
        ("m:\n  gsm8k: {value: 0.4, tolerance: -1, source: s}\n", r"m\.gsm8k\.tolerance"),
        ("m:\n  gsm8k: {value: 0.4, tolerance: 0.05}\n", r"m\.gsm8k\.source"),
        ("m:\n  gsm8k: {value: 0.4, tolerance: 0.05, source: s, rtol: 1}\n", r"m\.gsm8k\.rtol"),
        ("m:\n  gsm8k: {value: 1.5, tolerance: 0.05, source: s}\n", r"m\.gsm8k\.value"),
        ("m: [1, 2\n", "malformed YAML"),
    ],
)
def test_bad_expected_file_names_file_and_field(tmp_path, text, match):
    p = tmp_path / "expected.yaml"
    p.write_text(text)
    with pytest.raises(UserError, match=match) as e:
        load_expected(p)
    assert str(p) in str(e.value)


def test_missing_expected_file(tmp_path):
    with pytest.raises(UserError, match="cannot read"):
        load_expected(tmp_path / "nope.yaml")


# ---------------------------------------------------------------- two-proportion test
def test_two_proportion_p_known_numbers():
    # 40/100 vs 50/100: pooled p = 0.45, se = sqrt(0.45 * 0.55 * (1/100 + 1/100)) = 0.0703562,
    # z = (0.40 - 0.50) / 0.0703562 = -1.421338, Phi(-1.421338) = 0.0776092
    assert two_proportion_p(40, 100, 50, 100) == pytest.approx(0.0776092, abs=1e-6)
    # 120/200 vs 150/200: pooled 0.675, se = 0.0468375, z = -3.202563, Phi = 0.000681
    assert two_proportion_p(120, 200, 150, 200) == pytest.approx(0.000681, abs=1e-6)
    # equal proportions: z = 0
    assert two_proportion_p(30, 100, 60, 200) == pytest.approx(0.5)
    # one-sided: PD better is far from significant, and the two tails add up to 1
    assert two_proportion_p(50, 100, 40, 100) == pytest.approx(1 - 0.0776092, abs=1e-6)


def test_two_proportion_p_edge_cases():
    assert two_proportion_p(0, 0, 10, 20) == 1.0 and two_proportion_p(5, 10, 0, 0) == 1.0
    assert two_proportion_p(20, 20, 30, 30) == 0.5  # all correct on both sides
    assert two_proportion_p(0, 20, 0, 30) == 0.5  # all wrong on both sides
    assert two_proportion_p(0, 20, 20, 20) < 1e-6  # PD all wrong, reference all right
    with pytest.raises(ValueError):
        two_proportion_p(11, 10, 1, 10)
    with pytest.raises(ValueError):
        two_proportion_p(-1, 10, 1, 10)


# ---------------------------------------------------------------- verdict
EXP = {"gsm8k": {"value": 0.41, "tolerance": 0.05, "source": UPSTREAM}}
M = "exact_match,strict-match"


def _res(value, n=200, stderr=0.03, task="gsm8k"):
    return {task: {"metric": M, "value": value, "stderr": stderr, "n": n}}


def _ref(value, n=200, task="gsm8k", cell="qwen3-0.6b-ref"):
    return {"cell_id": cell, "tasks": {task: {"metric": M, "value": value, "n": n}}, "verdict": "pass"}


def test_judge_pass_within_tolerance_and_reference():
    out = judge("pd", _res(0.42), EXP, _ref(0.43), 0.05)
    t = out["tasks"]["gsm8k"]
    assert out["verdict"] == "pass" and out["cell_id"] == "pd"
    assert t["verdict"] == "pass" and t["reasons"] == []
    how = "tolerance not scaled: calibration n None, run n 200"
    assert t["expected"] == {**EXP["gsm8k"], "tolerance_at_n": 0.05, "tolerance_how": how} and t["reference"] == {
        "cell_id": "qwen3-0.6b-ref",
        "value": 0.43,
        "n": 200,
    }
    assert 0.05 < t["p_value"] < 0.5


def test_judge_regression_beyond_tolerance():
    out = judge("pd", _res(0.30), EXP, None, 0.05)
    assert out["verdict"] == "fail"
    (reason,) = out["tasks"]["gsm8k"]["reasons"]
    assert "0.3000 outside expected 0.41 +/- 0.05" in reason and UPSTREAM in reason
    assert judge("pd", _res(0.455), EXP, None, 0.05)["verdict"] == "pass"
    assert judge("pd", _res(0.465), EXP, None, 0.05)["verdict"] == "fail"
    assert judge("pd", _res(0.355), EXP, None, 0.05)["verdict"] == "fail"


def test_judge_within_noise_of_reference():
    out = judge("pd", _res(0.70, n=100), None, _ref(0.74, n=100), 0.05)
    t = out["tasks"]["gsm8k"]
    assert out["verdict"] == "pass" and t["p_value"] == pytest.approx(0.2644, abs=1e-3)


def test_judge_significantly_below_reference():
    out = judge("pd", _res(0.60), None, _ref(0.75), 0.05)
    t = out["tasks"]["gsm8k"]
    assert out["verdict"] == "fail" and t["p_value"] == pytest.approx(0.000681, abs=1e-6)
    assert "significantly below reference qwen3-0.6b-ref" in t["reasons"][0]


def test_judge_lists_every_failed_check():
    out = judge("pd", _res(0.20), EXP, _ref(0.42), 0.05)
    reasons = out["tasks"]["gsm8k"]["reasons"]
    assert len(reasons) == 2 and "outside expected" in reasons[0] and "significantly below" in reasons[1]


@pytest.mark.parametrize("value", [None, float("nan"), float("inf")])
def test_judge_no_score_fails(value):
    out = judge("pd", _res(value), EXP, _ref(0.41), 0.05)
    assert out["verdict"] == "fail" and "no score" in out["tasks"]["gsm8k"]["reasons"][0]
    assert out["tasks"]["gsm8k"]["value"] is None


def test_judge_nothing_to_gate_against_fails_closed():
    out = judge("pd", _res(0.9, task="pdsweep_arith"), EXP, _ref(0.4), 0.05)  # neither covers the task
    assert out["verdict"] == "fail"
    assert "nothing to gate against" in out["tasks"]["pdsweep_arith"]["reasons"][0]


def test_judge_reference_problems_fail_closed():
    assert "has no score" in judge("pd", _res(0.4), None, _ref(None), 0.05)["tasks"]["gsm8k"]["reasons"][0]
    assert (
        "sample count unknown" in judge("pd", _res(0.4, n=None), None, _ref(0.4), 0.05)["tasks"]["gsm8k"]["reasons"][0]
    )
    assert judge("pd", {}, EXP, None, 0.05)["verdict"] == "fail"  # no tasks at all


def test_judge_reference_cell_itself():
    ok = judge("ref", _res(0.9, task="pdsweep_arith"), EXP, None, 0.05, is_reference=True)
    assert ok["verdict"] == "pass" and ok["tasks"]["pdsweep_arith"]["reasons"] == ["reference"]
    assert ok["tasks"]["pdsweep_arith"]["reference"] is None
    assert judge("ref", _res(0.41), EXP, None, 0.05, is_reference=True)["verdict"] == "pass"
    bad = judge("ref", _res(0.2), EXP, _ref(0.9), 0.05, is_reference=True)  # reference ignored
    assert bad["verdict"] == "fail" and len(bad["tasks"]["gsm8k"]["reasons"]) == 1
    assert bad["tasks"]["gsm8k"]["p_value"] is None


def test_judge_body_round_trips_through_write_json(tmp_path):
    body = judge("pd", {**_res(0.42), **_res(float("nan"), task="pdsweep_arith")}, EXP, _ref(0.43), 0.05)
    back = read_json(write_json(tmp_path / "accuracy.json", body))
    assert back["schema"] == 1 and back["verdict"] == "fail"
    assert back["tasks"]["gsm8k"]["verdict"] == "pass" and back["tasks"]["pdsweep_arith"]["value"] is None
    assert set(back["tasks"]["gsm8k"]) == {
        "metric",
        "value",
        "stderr",
        "n",
        "expected",
        "reference",
        "p_value",
        "verdict",
        "reasons",
    }


def test_the_tolerance_scales_to_the_runs_sample_size():
    """Qwen3-0.6B gsm8k 0.41 +/- 0.05 calibrated on the whole test set (n 1319), scored on 250:
    binomial SE sqrt(0.41 x 0.59 x (1/250 - 1/1319)) = 0.0280 extra, 3 of it in quadrature:
    +/- 0.0978. 0.33 fails at n 1319 and passes at n 250; 0.30 fails both; n >= 1319 unscaled."""
    exp = {"gsm8k": {"value": 0.41, "tolerance": 0.05, "n": 1319, "source": UPSTREAM}}
    assert tolerance_at(exp["gsm8k"], 250)[0] == pytest.approx(0.0978, abs=1e-4)
    assert tolerance_at(exp["gsm8k"], 1319) == (0.05, "")
    t = judge("pd", _res(0.33, n=250), exp, None, 0.05)["tasks"]["gsm8k"]
    assert t["verdict"] == "pass" and t["expected"]["tolerance_at_n"] == pytest.approx(0.0978, abs=1e-4)
    assert judge("pd", _res(0.33, n=1319), exp, None, 0.05)["verdict"] == "fail"
    (reason,) = judge("pd", _res(0.30, n=250), exp, None, 0.05)["tasks"]["gsm8k"]["reasons"]
    assert reason == (
        f"gsm8k: {M} 0.3000 outside expected 0.41 +/- 0.098 ({UPSTREAM}; tolerance 0.05 at n=1319 scaled "
        "to n=250: +/- 0.098 (binomial SE, 3 SE))"
    )


def test_every_expected_score_carries_its_sample_size(tmp_path):
    assert all(isinstance(t["n"], int) for tasks in load_expected().values() for t in tasks.values())
    p = tmp_path / "expected.yaml"
    p.write_text("m:\n  gsm8k: {value: 0.4, tolerance: 0.05, source: s}\n")
    with pytest.raises(UserError, match=r"m\.gsm8k\.n: Field required"):
        load_expected(p)
