"""pdsweep.tiny.checkpoints: checkpoints match the catalogue, are cached, and give peaked logits.

No vLLM here: transformers loads the checkpoints. Generation takes 1-15 s per model on
2 cores, so checkpoints are built once per session into a temporary cache, untrained
(``tiny.train`` dropped: training is tests/test_tinytrain.py's, on the shared cache).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from pdsweep.core.errors import UserError
from pdsweep.sweepfile.sweep import load_catalogue
from pdsweep.tiny.checkpoints import META_FILE, checkpoint_dir
from pdsweep.tiny.config import CPU_HEAD_SIZES, config_params
from pdsweep.tiny.tokenizer import VOCAB_SIZE, build_tokenizer

ROOT = Path(__file__).resolve().parent.parent
CATALOGUE = load_catalogue(ROOT / "sweeps" / "models.yaml")
TINY = sorted(n for n, m in CATALOGUE.models.items() if m.tiny is not None)
WITH_WEIGHTS = [n for n in TINY if CATALOGUE.models[n].tiny.kind != "kimi_linear"]
# pdsweep's own vLLM architecture (pdsweep/cpu_models): transformers cannot load it
HF_LOADABLE = [n for n in WITH_WEIGHTS if CATALOGUE.models[n].tiny.kind != "mla_mamba2"]
PROMPT = "Q: 12 + 7 = ?\nA:"


def untrained(name: str):
    """The catalogue entry with random weights (no ``tiny.train``)."""
    m = CATALOGUE.models[name]
    return m.model_copy(update={"tiny": m.tiny.model_copy(update={"train": None})})


@pytest.fixture(scope="session")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("tiny-cache")


@pytest.fixture(scope="session")
def ckpt(cache: Path):
    built: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in built:
            built[name] = checkpoint_dir(name, untrained(name), cache)
        return built[name]

    return get


def test_catalogue_has_every_kind():
    kinds = {CATALOGUE.models[n].tiny.kind for n in TINY}
    assert kinds == {"llama", "deepseek_v2", "nemotron_h", "qwen3_next", "kimi_linear", "mla_mamba2"}


@pytest.mark.parametrize("name", TINY)
def test_config_matches_catalogue(name, ckpt):
    m = CATALOGUE.models[name]
    cfg = json.loads((ckpt(name) / "config.json").read_text())
    assert cfg["architectures"] == [m.architecture]
    assert cfg["num_hidden_layers"] == m.num_layers
    assert cfg["num_attention_heads"] == m.num_attention_heads
    assert cfg["vocab_size"] == VOCAB_SIZE
    assert cfg["max_position_embeddings"] == m.max_model_len
    assert cfg["initializer_range"] == 0.2
    if m.attention == "mla":
        assert (cfg["kv_lora_rank"], cfg["qk_rope_head_dim"]) == (m.mla.kv_lora_rank, m.mla.qk_rope_head_dim)
    else:
        assert cfg["num_key_value_heads"] == m.num_kv_heads
        assert cfg["head_dim"] == m.attn.head_dim
        assert cfg["head_dim"] in CPU_HEAD_SIZES


def test_hybrid_layer_layouts(ckpt):
    nh = json.loads((ckpt("tiny-nemotron-h") / "config.json").read_text())
    assert nh["hybrid_override_pattern"] == "M*M-"
    assert nh["layers_block_type"] == ["linear_attention", "full_attention", "linear_attention", "mlp"]
    s = CATALOGUE.models["tiny-nemotron-h"].ssm_state
    assert (nh["mamba_num_heads"], nh["mamba_head_dim"], nh["ssm_state_size"]) == (s.num_heads, s.head_dim, s.state_dim)
    assert nh["n_groups"] == s.n_groups == 2  # B/C sharded at prefill TP 2
    assert json.loads((ckpt("tiny-nemotron-h-g1") / "config.json").read_text())["n_groups"] == 1

    qn = json.loads((ckpt("tiny-qwen3-next") / "config.json").read_text())
    assert qn["layer_types"] == ["linear_attention"] * 3 + ["full_attention"]
    assert qn["num_experts"] > 1  # vLLM refuses the dense Qwen3-Next variant
    g = CATALOGUE.models["tiny-qwen3-next"].ssm_state
    assert (qn["linear_num_value_heads"], qn["linear_key_head_dim"], qn["linear_value_head_dim"]) == (
        g.num_heads,
        g.head_dim,
        g.state_dim,
    )

    kl = json.loads((ckpt("tiny-kimi-linear") / "config.json").read_text())
    assert kl["linear_attn_config"]["kda_layers"] == [1, 2, 3]
    assert kl["linear_attn_config"]["full_attn_layers"] == [4]
    assert not (ckpt("tiny-kimi-linear") / "model.safetensors").exists()  # config only


def test_mla_mamba2_checkpoint(ckpt):
    """Hybrid MLA + Mamba2 (pdsweep.engine.cpu_models.mla_mamba2): a kimi_linear config (vLLM's
    use_mla) with NemotronH's Mamba2 fields; MLA weights only in attention layers, Mamba2
    mixers only in the others, dense MLPs everywhere."""
    from safetensors import safe_open

    d = ckpt("tiny-mla-mamba2")
    cfg = json.loads((d / "config.json").read_text())
    m = CATALOGUE.models["tiny-mla-mamba2"]
    assert cfg["model_type"] == "kimi_linear" and cfg["architectures"] == ["PdsweepMlaMamba2ForCausalLM"]
    assert cfg["layer_types"] == ["mamba", "full_attention", "mamba", "full_attention"]
    assert cfg["linear_attn_config"] == {"kda_layers": [1, 3], "full_attn_layers": [2, 4]}
    s = m.ssm_state
    assert (cfg["mamba_num_heads"], cfg["mamba_head_dim"], cfg["ssm_state_size"], cfg["n_groups"]) == (
        s.num_heads,
        s.head_dim,
        s.state_dim,
        s.n_groups,
    )
    assert cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"] == 576 and cfg["q_lora_rank"] is None
    with safe_open(str(d / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
        assert tuple(f.get_slice("model.layers.0.mixer.conv1d.weight").get_shape()) == (s.conv_dim, 1, s.conv_kernel)
    for i, kind in enumerate(cfg["layer_types"]):
        has_mla = f"model.layers.{i}.self_attn.kv_b_proj.weight" in keys
        has_mixer = f"model.layers.{i}.mixer.A_log" in keys
        assert (has_mla, has_mixer) == (kind == "full_attention", kind == "mamba"), i
        assert f"model.layers.{i}.mlp.gate_proj.weight" in keys


@pytest.mark.parametrize("name", WITH_WEIGHTS)
def test_weights_are_small_float32(name, ckpt):
    from safetensors import safe_open

    path = ckpt(name) / "model.safetensors"
    assert 0.5e6 < path.stat().st_size < 10e6
    with safe_open(str(path), "pt") as f:
        dtypes = {str(f.get_slice(k).get_dtype()) for k in f.keys()}
    assert dtypes == {"F32"}


def test_tokenizer_round_trip(tmp_path):
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    d = build_tokenizer(tmp_path / "tok")
    raw = Tokenizer.from_file(str(d / "tokenizer.json"))
    assert raw.get_vocab_size() == VOCAB_SIZE
    tok = AutoTokenizer.from_pretrained(str(d))
    ids = tok(PROMPT)["input_ids"]
    assert tok.decode(ids) == PROMPT
    pieces = tok.convert_ids_to_tokens(ids)
    assert pieces[:6] == ["Q", ":", "Ġ1", "2", "Ġ+", "Ġ7"]  # one digit per token, space kept
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (1, 2, 0)
    assert tok("The answer is 135.")["input_ids"] == raw.encode("The answer is 135.").ids


def test_idempotent_and_keyed_by_params(cache, ckpt):
    m = untrained("tiny-llama")
    first = ckpt("tiny-llama")
    before = {p.name: p.stat().st_mtime_ns for p in first.iterdir()}
    again = checkpoint_dir("tiny-llama", m, cache)
    assert again == first
    assert {p.name: p.stat().st_mtime_ns for p in again.iterdir()} == before
    assert json.loads((first / META_FILE).read_text())["seed"] == 0
    # another seed is another checkpoint, next to the first, with different weights
    other = checkpoint_dir("tiny-llama", m.model_copy(update={"tiny": m.tiny.model_copy(update={"seed": 1})}), cache)
    assert other != first and other.parent == first.parent
    assert (other / "model.safetensors").read_bytes() != (first / "model.safetensors").read_bytes()
    assert not [p for p in cache.iterdir() if p.name.startswith(".")]  # no temp dirs left


def test_same_seed_same_weights(tmp_path, ckpt):
    a = ckpt("tiny-llama") / "model.safetensors"
    b = checkpoint_dir("tiny-llama", untrained("tiny-llama"), tmp_path) / "model.safetensors"
    assert a.read_bytes() == b.read_bytes()


def test_cache_dir_from_env(tmp_path, monkeypatch):
    monkeypatch.setenv("PDSWEEP_CACHE", str(tmp_path / "envcache"))
    d = checkpoint_dir("tiny-kimi-linear", CATALOGUE.models["tiny-kimi-linear"])
    assert d.parent == tmp_path / "envcache"


@pytest.mark.parametrize("name", HF_LOADABLE)
def test_logits_are_peaked(name, ckpt):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    d = ckpt(name)
    tok = AutoTokenizer.from_pretrained(str(d))
    model = AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.float32).eval()
    ids = torch.tensor([tok(PROMPT)["input_ids"]])
    with torch.no_grad():
        logits = model(ids).logits[0, -1]
    assert torch.isfinite(logits).all()
    probs = logits.softmax(-1)
    # uniform (dummy weights) would be 1/512 ~ 0.002 and entropy ln(512) ~ 6.24
    assert probs.max().item() > 20 / VOCAB_SIZE
    entropy = -(probs * probs.clamp_min(1e-12).log()).sum().item()
    assert entropy < math.log(VOCAB_SIZE) - 1.0


def test_rejects_impossible_dims():
    m = CATALOGUE.models["tiny-llama"]
    bad = m.model_copy(update={"attn": m.attn.model_copy(update={"head_dim": 16})})
    with pytest.raises(UserError, match="head size"):
        config_params("tiny-llama", bad)
    mla = CATALOGUE.models["tiny-mla"]
    with pytest.raises(UserError, match="576"):
        config_params("tiny-mla", mla.model_copy(update={"mla": mla.mla.model_copy(update={"kv_lora_rank": 256})}))
    hy = CATALOGUE.models["tiny-mla-mamba2"]
    with pytest.raises(UserError, match="multiple of attention_layers"):  # would build no Mamba layer
        config_params("tiny-mla-mamba2", hy.model_copy(update={"attention_layers": 3, "ssm_layers": 1}))
    with pytest.raises(UserError, match="2\\*n_groups\\*state_dim"):
        config_params(
            "tiny-mla-mamba2", hy.model_copy(update={"ssm_state": hy.ssm_state.model_copy(update={"n_groups": 1})})
        )
    with pytest.raises(UserError, match="not a tiny checkpoint"):
        checkpoint_dir("qwen3-0.6b", CATALOGUE.models["qwen3-0.6b"])
