"""The tiny checkpoints' tokenizer: a 512-token byte-level BPE trained on a built-in English +
arithmetic corpus (:func:`build_tokenizer`), and its remote-code variant (the shape of
Kimi-Linear's ``tokenization_kimi.py``, :func:`make_remote_code_tokenizer`)."""

from __future__ import annotations

import json
import random
from pathlib import Path

VOCAB_SIZE = 512
SPECIAL_TOKENS = ("<pad>", "<s>", "</s>")  # ids 0, 1, 2
PAD_ID, BOS_ID, EOS_ID = 0, 1, 2

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


def corpus() -> list[str]:
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
    tok.train_from_iterator(corpus(), trainer=trainer)
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
pdsweep.tiny.tokenizer: its vocabulary is in {REMOTE_VOCAB}, which only this class reads, so
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
