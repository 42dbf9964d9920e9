"""The consistency probe's prompts (:mod:`pdsweep.measure.probe` sends them): lengths
that exercise the KV blocks the way upstream ``test_edge_cases.py`` does (shorter than one
block, several full blocks plus a partial one, near the maximum length), in text the tiny
models were trained on or the eval task's own Q/A format (:func:`probe_text`), tokenized with
the cell's own tokenizer.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pdsweep.core.errors import UserError
from pdsweep.sweepfile.phases import resolve_lengths
from pdsweep.tiny.arith import _question

log = logging.getLogger(__name__)


_WORDS = (
    "the a of and to in is that for on with as by at from this it be are was were an or "
    "cache block prefill decode transfer tensor layer state token prompt model engine queue "
    "river mountain window garden letter number signal station market orange silver yellow "
    "quickly slowly never always often under over between before after during without "
    "seven eleven twenty hundred thousand first second third last next every other"
).split()


@dataclass(frozen=True)
class Prompt:
    """A probe prompt: ``token_ids`` (sent as the completion prompt, so the length is
    exact, special tokens included) and ``text`` (their decoding, for reports)."""

    name: str
    token_ids: list[int] = field(repr=False)
    text: str = field(repr=False)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


def _load_tokenizer(path: str | Path, trust_remote_code: bool = False) -> tuple[Any, Any]:
    """(encode(text) -> ids with special tokens, decode(ids) -> text) from a local path.
    ``trust_remote_code``: the catalogue's, for a tokenizer class shipped as code
    (``auto_map``); without it such a tokenizer raises ``UserError`` (transformers refuses)."""
    path = Path(path)
    try:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True, trust_remote_code=trust_remote_code)
        return (lambda s: list(tok(s, add_special_tokens=True)["input_ids"])), tok.decode
    except ImportError:  # tokenizers only
        from tokenizers import Tokenizer

        t = Tokenizer.from_file(str(path / "tokenizer.json" if path.is_dir() else path))
        return (lambda s: t.encode(s, add_special_tokens=True).ids), t.decode
    except (OSError, ValueError) as e:
        hint = (
            "" if trust_remote_code else " (a tokenizer shipped as code needs trust_remote_code: true in models.yaml)"
        )
        raise UserError(f"{path}: cannot load tokenizer{hint}: {e}") from None


def _text(name: str, min_words: int) -> str:
    rng = random.Random(f"pdsweep-consistency:{name}")  # str seeds are stable across runs
    words: list[str] = []
    while len(words) < min_words:
        sentence = [rng.choice(_WORDS) for _ in range(rng.randint(6, 14))]
        words += [sentence[0].capitalize(), *sentence[1:-1], sentence[-1] + "."]
    return " ".join(words)


def _task_text(name: str, min_pairs: int) -> str:
    """``pdsweep_arith`` Q/A pairs in lm-eval's prompt format (``pdsweep.tiny.arith``), seeded
    by ``name``, ending in an open question (``...\nA:``): the next tokens are an answer,
    which a checkpoint trained on the task computes from the whole KV it holds."""
    rng = random.Random(f"pdsweep-consistency-task:{name}")
    pairs = []
    for _ in range(min_pairs):
        q, a = _question(rng)
        pairs.append(f"Q: {q}\nA: {a}")
    q, _ = _question(rng)
    return "\n\n".join([*pairs, f"Q: {q}\nA:"])


def probe_text(setting: str, trained_on_task: bool) -> str:
    """The probe text kind for ``ConsistencySpec.text``: ``auto`` is ``task`` for a
    checkpoint trained on ``pdsweep_arith`` (``tiny.train``), else ``prose``. Measured on
    trained tiny-llama with scrambled KV: prose prompts get one constant, confident token
    whatever the KV holds (blind), while task prompts answer from the KV."""
    if setting == "auto":
        return "task" if trained_on_task else "prose"
    return setting


def build_prompts(
    tokenizer_path: str | Path,
    block_size: int,
    max_model_len: int,
    lengths: Sequence[int | str],
    max_tokens: int = 8,
    text: str = "prose",
    trust_remote_code: bool = False,
) -> list[Prompt]:
    """Deterministic prompts of exact token counts (:func:`resolve_lengths`), a different
    seeded text per prompt (so no prompt is a prefix of another and prefix caching cannot
    mask a transfer), cut with the model's local tokenizer (special tokens such as BOS
    included in the count).

    ``text`` (:func:`probe_text`): ``prose`` is English-like text cut at the end;
    ``task`` is ``pdsweep_arith`` Q/A pairs cut at the *start* (after the special
    prefix tokens), so every prompt ends in an open question. ``trust_remote_code``: the
    catalogue entry's (:func:`_load_tokenizer`). Raises ``UserError`` for an
    unusable tokenizer path or lengths, ``ValueError`` for another ``text``."""
    if text not in ("prose", "task"):
        raise ValueError(f"consistency text {text!r}: expected 'prose' or 'task'")
    encode, decode = _load_tokenizer(tokenizer_path, trust_remote_code)
    special = encode("")  # what the tokenizer puts before any text (BOS), kept in front
    make = _text if text == "prose" else _task_text
    prompts = []
    for name, n in resolve_lengths(block_size, max_model_len, lengths, max_tokens):
        size = max(16, n) if text == "prose" else max(1, n // 8)
        need = n if text == "prose" else n + len(special)  # task: a full n-token tail after the prefix
        ids = encode(make(name, size))
        while len(ids) < need:  # tokenizers with long tokens: more text
            size *= 2
            ids = encode(make(name, size))
        keep = n - len(special)  # task: special prefix + the last `keep` text tokens
        ids = ids[:n] if text == "prose" or keep <= 0 else special + ids[len(ids) - keep :]
        prompts.append(Prompt(name=name, token_ids=ids, text=decode(ids)))
        log.debug("prompt %s: %d tokens (%s)", name, n, text)
    return prompts
