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
FAKE_SMI = '''#!{python}
"""Fake nvidia-smi: answers -L, --query-gpu= and --query-compute-apps= from smi.json."""
import json, sys
from pathlib import Path
d = json.loads((Path(__file__).parent / "smi.json").read_text())
with open(Path(__file__).parent / "smi.calls", "a") as f:
    f.write(" ".join(sys.argv[1:]) + "\\n")
if d.get("fail"):
    sys.exit("NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver")
for a in sys.argv[1:]:
    if a == "-L":
        for g in d["gpus"]:
            print(f"GPU {{g['index']}}: {{g['name']}} (UUID: {{g['uuid']}})")
    elif a.startswith("--query-gpu="):
        for g in d["gpus"]:
            print(", ".join(str(g[k]) for k in a.split("=", 1)[1].split(",")))
    elif a.startswith("--query-compute-apps="):
        for p in d["apps"]:
            print(", ".join(str(p[k]) for k in a.split("=", 1)[1].split(",")))
'''


def fake_nvidia_smi(
    bin_dir: Path,
    n: int = 8,
    *,
    name: str = "NVIDIA H100 80GB HBM3",
    cap: str = "9.0",
    total_mib: int = 81559,
    driver: str = "580.65.06",
    busy: dict[int, tuple[int, str, int]] | None = None,
    fail: bool = False,
) -> Path:
    """An executable ``nvidia-smi`` in ``bin_dir`` (put it first on PATH) for ``n`` GPUs
    of ``name`` / SM ``cap`` / ``total_mib``; ``busy``: GPU index -> (pid, process name,
    used MiB) of a compute process another user holds (its memory counts as used).
    Every call's argv is appended to ``bin_dir/smi.calls``. Returns ``bin_dir``."""
    import sys

    bin_dir.mkdir(parents=True, exist_ok=True)
    busy = busy or {}
    gpus = []
    for i in range(n):
        used = busy[i][2] if i in busy else 3
        gpus.append(
            {
                "index": i,
                "uuid": f"GPU-{i:08x}-fake",
                "name": name,
                "compute_cap": cap,
                "memory.total": total_mib,
                "memory.free": total_mib - used,
                "driver_version": driver,
            }
        )
    apps = [
        {"pid": pid, "process_name": proc, "used_memory": mib, "gpu_uuid": f"GPU-{i:08x}-fake"}
        for i, (pid, proc, mib) in busy.items()
    ]
    (bin_dir / "smi.json").write_text(json.dumps({"gpus": gpus, "apps": apps, "fail": fail}))
    exe = bin_dir / "nvidia-smi"
    exe.write_text(FAKE_SMI.format(python=sys.executable))
    exe.chmod(0o755)
    return bin_dir
