"""Test helpers for the accuracy and consistency tests: a tiny local BPE tokenizer and
an in-process OpenAI-compatible FastAPI server on 127.0.0.1 (uvicorn in a thread).

Nothing here touches the network beyond loopback; :func:`block_non_loopback` makes that
an assertion (any other connect raises).
"""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from fastapi import FastAPI

from pdsweep.deploy.appserver import AppServer

CORPUS = [
    "Q: What is 17 + 25?\nA: 42",
    "The quick brown fox jumps over the lazy dog near the river bank.",
    "Prefill and decode run on different instances; the KV cache moves over NIXL.",
    "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu",
    "0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 + - * = ?",
] * 20


def build_tokenizer(out_dir: Path, vocab_size: int = 300) -> Path:
    """A byte-level BPE tokenizer saved as ``tokenizer.json`` + ``tokenizer_config.json``
    (loadable with ``transformers.AutoTokenizer.from_pretrained(out_dir)``, offline).
    ``<s>`` is prepended by the post-processor. Returns ``out_dir``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer=trainer)
    bos = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", bos)])
    tok.save(str(out_dir / "tokenizer.json"))
    (out_dir / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": "<s>",
                "eos_token": "</s>",
                "model_max_length": 4096,
            }
        )
    )
    return out_dir


@contextlib.contextmanager
def serve(app: FastAPI) -> Iterator[str]:
    """Run ``app`` on 127.0.0.1 (ephemeral port) in a thread (:class:`pdsweep.deploy.appserver.AppServer`,
    the proxy's own server); yields ``http://127.0.0.1:PORT``. The server is stopped and the
    thread joined on exit."""
    with AppServer(app, startup_timeout_s=20) as srv:
        name = f"uvicorn-{srv.port}"
        yield srv.url
    assert not [t for t in threading.enumerate() if t.name == name], "fake server thread did not stop"


@contextlib.contextmanager
def block_non_loopback() -> Iterator[None]:
    """Make any socket connect to a non-loopback address raise (no hub, no internet)."""
    real = socket.socket.connect

    def guarded(self, address):  # type: ignore[no-untyped-def]
        host = address[0] if isinstance(address, tuple) else address
        if isinstance(host, str) and host not in ("127.0.0.1", "::1", "localhost") and "/" not in host:
            raise OSError(f"test network guard: connect to {address!r} refused")
        return real(self, address)

    socket.socket.connect = guarded  # type: ignore[method-assign]
    try:
        yield
    finally:
        socket.socket.connect = real  # type: ignore[method-assign]


def completion(text: str, model: str = "fake", logprobs: dict | None = None) -> dict:
    """An OpenAI /v1/completions response body with one choice."""
    return {
        "id": "cmpl-fake",
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [{"index": 0, "text": text, "logprobs": logprobs, "finish_reason": "length"}],
        "usage": {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0},
    }


# ---------------------------------------------------------------- fake nvidia-smi
# in its own module (no FastAPI): the device check's dry run imports it on a bare python 3.12
from _fakesmi import FAKE_SMI, fake_nvidia_smi  # noqa: E402, F401
