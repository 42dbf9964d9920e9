"""pdsweep.tiny.train: trained tiny checkpoints answer pdsweep_arith, fail closed, are keyed
by their recipe.

The trained checkpoints live in the default cache (the one the integration tests and
``make sweep`` use), copied there from their committed fixture (fixtures/tiny/, see
tests/test_tinyfixtures.py) when one matches the recipe, else trained once (1-4 min per model
on 2 cores).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from pdsweep.core.errors import UserError
from pdsweep.sweepfile.catalogue import TrainSpec
from pdsweep.sweepfile.sweep import load_catalogue
from pdsweep.tiny import arith
from pdsweep.tiny import checkpoints as tinymodels
from pdsweep.tiny import train as tinytrain
from pdsweep.tiny.config import config_params
from pdsweep.tiny.tokenizer import build_tokenizer

ROOT = Path(__file__).resolve().parent.parent
CATALOGUE = load_catalogue(ROOT / "sweeps" / "models.yaml")
TRAINED = sorted(n for n, m in CATALOGUE.models.items() if m.tiny is not None and m.tiny.train is not None)
SWEEP_ONLY = {"tiny-mla"}  # trained models no real-vLLM test of make test serves


def test_the_mission_models_are_trained():
    assert {"tiny-llama", "tiny-mla", "tiny-mla-mamba2", "tiny-nemotron-h"} <= set(TRAINED)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast.from_pretrained(build_tokenizer(tmp_path_factory.mktemp("tok")))


def test_sample_is_the_eval_format_with_answer_labels(tokenizer):
    ids, labels = tinytrain._sample(tokenizer, random.Random(3), 3)
    text = tokenizer.decode(ids)
    pairs = text.rstrip("\n").split("\n\n")
    assert len(pairs) == 3 and all(p.startswith("Q: What is ") and "?\nA: " in p for p in pairs)
    answers = [p.split("A: ")[1] for p in pairs]
    for p, a in zip(pairs, answers):  # the generator's own answers
        x, op, y = p.split("?")[0].split()[3:6]
        assert int(a) == {"+": int(x) + int(y), "-": int(x) - int(y), "*": int(x) * int(y)}[op]
    # labelled: each answer and the newline after it, nothing of the questions
    assert "".join(tokenizer.decode([i]) for i, lab in zip(ids, labels) if lab != -100) == "".join(
        f" {a}\n" for a in answers
    )
    assert len(ids) == len(labels)


def test_few_shot_prefix_is_the_template():
    prefix = tinytrain._fewshot_prefix()
    assert prefix.startswith("Q: What is 7 + 3?\nA: 10\n\n") and prefix.count("\n\nQ:") == 2
    assert prefix.endswith("\n\n")


def test_recipe_is_part_of_the_cache_key(tmp_path):
    m = CATALOGUE.models["tiny-llama"]
    a = tinymodels.checkpoint_dir("tiny-llama", m, tmp_path, create=False)
    more = m.model_copy(update={"tiny": m.tiny.model_copy(update={"train": TrainSpec(steps=7)})})
    untrained = m.model_copy(update={"tiny": m.tiny.model_copy(update={"train": None})})
    b = tinymodels.checkpoint_dir("tiny-llama", more, tmp_path, create=False)
    c = tinymodels.checkpoint_dir("tiny-llama", untrained, tmp_path, create=False)
    assert len({a, b, c}) == 3


def test_undertrained_checkpoint_is_refused(tmp_path):
    """Fail closed: a model that cannot answer would make every accuracy gate on it void."""
    m = CATALOGUE.models["tiny-llama"]
    short = m.model_copy(update={"tiny": m.tiny.model_copy(update={"train": TrainSpec(steps=3, batch=4)})})
    with pytest.raises(UserError, match=r"training reached accuracy 0\.\d+ on pdsweep_arith, below"):
        tinymodels.checkpoint_dir("tiny-llama", short, tmp_path)
    assert not list(tmp_path.iterdir())  # nothing half-written in the cache


def test_mla_mamba2_trainable_model_matches_the_checkpoint_layout(tmp_path):
    """The training model (transformers DeepSeek-V2 + NemotronH Mamba2 mixers) has exactly the
    tensors, names and shapes the vLLM model loads (pdsweep/engine/cpu_models/mla_mamba2.py)."""
    from safetensors import safe_open

    m = CATALOGUE.models["tiny-mla-mamba2"]
    rand = m.model_copy(update={"tiny": m.tiny.model_copy(update={"train": None})})
    d = tinymodels.checkpoint_dir("tiny-mla-mamba2", rand, tmp_path)
    model = tinytrain._mla_mamba2_model(config_params("tiny-mla-mamba2", m))
    ours = {tinytrain._checkpoint_keys(k): tuple(v.shape) for k, v in model.state_dict().items()}
    with safe_open(str(d / "model.safetensors"), "pt") as f:
        theirs = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    assert {k: ours.get(k) for k in theirs} == theirs
    assert "model.layers.0.mixer.A_log" in theirs and "model.layers.1.self_attn.kv_b_proj.weight" in theirs


@pytest.mark.integration  # trains on first use (minutes), in the cache the vLLM runs share
@pytest.mark.parametrize("name", TRAINED)
def test_trained_checkpoint_answers_the_task(name):
    """Trained in the shared cache: the record says >= min_accuracy on all 200 eval
    questions, and the weights on disk reproduce it (transformers, greedy)."""
    import torch
    from transformers import AutoTokenizer

    m = CATALOGUE.models[name]
    if name in SWEEP_ONLY and not (tinymodels.checkpoint_dir(name, m, create=False) / tinymodels.META_FILE).exists():
        pytest.skip(
            f"{name} is trained by `make sweep` (~10 min on 2 cores); make test's real-vLLM cells do "
            "not use it, so CI does not train it (45-minute budget)"
        )
    d = tinymodels.checkpoint_dir(name, m)
    meta = json.loads((d / tinymodels.META_FILE).read_text())
    rec = meta["trained"]
    assert rec["accuracy"] >= m.tiny.train.min_accuracy and rec["steps"] <= m.tiny.train.steps
    # a remote-code tokenizer (tiny.tokenizer: remote_code) loads only through its shipped class
    tok = AutoTokenizer.from_pretrained(d, trust_remote_code=m.trust_remote_code)
    if m.tiny.kind == "mla_mamba2":
        from safetensors.torch import load_file

        model = tinytrain._mla_mamba2_model(meta["params"])
        state = {k: v for k, v in load_file(str(d / "model.safetensors")).items()}
        missing = model.load_state_dict(
            {k.replace(".mixer.", ".self_attn.mixer."): v for k, v in state.items()}, strict=False
        ).missing_keys
        assert all("rotary" in k or "inv_freq" in k for k in missing), missing
    else:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)
    qs = arith.questions(arith.DEFAULT_N, arith.DEFAULT_SEED)[-40:]  # the end of the eval set
    greedy = tinytrain.greedy_accuracy(model, tok, qs)
    assert greedy >= m.tiny.train.min_accuracy
    assert tinytrain.answer_accuracy(model, tok, qs) == greedy  # teacher forcing = greedy decoding


def test_fast_gdn_solve_same_values_through_an_identity_solve(monkeypatch):
    """Training tiny-qwen3-next on CPU: transformers' GDN chunk rule solves its UT system against
    the identity and multiplies (459 ms -> 15 ms a call at batch 64 on 2 cores), same values; the
    rule is restored after, and other kinds are left alone."""
    import torch
    import transformers.models.qwen3_next.modeling_qwen3_next as q

    orig = q.torch_chunk_gated_delta_rule
    torch.manual_seed(0)
    b, t, h, d = 2, 70, 2, 16  # 70 tokens: two chunks of 64, the second padded
    query, key, value = (torch.randn(b, t, h, d) for _ in range(3))
    g, beta = -torch.rand(b, t, h), torch.rand(b, t, h)
    want, _ = orig(query, key, value, g=g, beta=beta, use_qk_l2norm_in_kernel=True)
    rhs: list[tuple[int, ...]] = []
    real = torch.linalg.solve_triangular

    def spy(a, rhs_, **kw):
        rhs.append(tuple(rhs_.shape[-2:]))
        return real(a, rhs_, **kw)

    monkeypatch.setattr(torch.linalg, "solve_triangular", spy)
    with tinytrain._fast_gdn_solve("llama"):
        assert q.torch_chunk_gated_delta_rule is orig
    with tinytrain._fast_gdn_solve("qwen3_next"):
        assert q.torch_chunk_gated_delta_rule is not orig
        got, _ = q.torch_chunk_gated_delta_rule(query, key, value, g=g, beta=beta, use_qk_l2norm_in_kernel=True)
    assert q.torch_chunk_gated_delta_rule is orig and torch.linalg.solve_triangular is spy
    assert rhs == [(64, 64), (64, 64)]  # both solves against the 64x64 identity, never the 16-wide values
    assert torch.allclose(got, want, atol=1e-5) and got.shape == (b, t, h, d)


def test_nemotron_h_trained_weights_keep_the_checkpoint_names(tmp_path):
    """NemotronH's weights are model.* in memory and backbone.* on disk (the names vLLM loads):
    the trained weights are written under the checkpoint's own names, changed by training."""
    from safetensors.torch import load_file

    m = CATALOGUE.models["tiny-nemotron-h"]
    one_step = TrainSpec(steps=1, batch=2, check_every=1000, min_accuracy=0.0)
    d = tinymodels.checkpoint_dir(
        "tiny-nemotron-h", m.model_copy(update={"tiny": m.tiny.model_copy(update={"train": None})}), tmp_path
    )
    before = load_file(str(d / "model.safetensors"))
    rec = tinytrain.train_checkpoint(d, "nemotron_h", config_params("tiny-nemotron-h", m), one_step)
    after = load_file(str(d / "model.safetensors"))
    assert rec["steps"] == 1 and sorted(after) == sorted(before) and "backbone.embeddings.weight" in after
    assert not after["backbone.embeddings.weight"].equal(before["backbone.embeddings.weight"])
