"""Load workloads as data: each ``bench.workloads`` entry becomes a list of greedy requests
(exact token ids), the same list on the PD cell and on its single-instance reference, so
every answer under load has a reference answer (:mod:`pdsweep.judge.load`).

Workloads (``WorkloadSpec.name``):

* ``random``: ``num_prompts`` distinct seeded prompts of ``input_len`` tokens.
* ``shared-prefix``: prompts sharing their first ``prefix_len`` tokens (prefix caching on
  prefill and decode); ``passes: 2`` sends them twice (the second pass should read fewer KV
  bytes: upstream ``run_mamba_prefix_cache_test.sh``).
* ``multi-turn``: ``num_prompts`` conversations of ``turns`` turns; turn k+1's prompt is turn
  k's prompt plus new tokens, sent after turn k's answer (the KV of turn k is reused). The
  extension is fixed text, not the model's answer, so the reference gets the same prompts.
* ``partial-blocks``: lengths ``m*B-1, m*B, m*B+1`` (m = 1..3) of the *effective* decode
  block B read back from the instances (:func:`pdsweep.measure.phases.probe_block`).
* ``chunk-boundary``: lengths ``m*C-1, m*C, m*C+1`` (m = 1..3) of the prefill's chunk C
  (``chunk_tokens``, the prefill's ``--max-num-batched-tokens``): each prompt ends one token
  before, on, or one token after a chunked-prefill boundary, so a KV read that starts before
  the last chunk's forward pass finished (SGLang PR 33970) answers wrong exactly there; every
  answer is checked against the reference, which prefills unchunked.
* ``long-context``: lengths at the cap ``max_model_len - output_len - 1`` and just below.
* ``trace``: replay of a Mooncake-format JSONL trace (``timestamp`` ms, ``input_length``,
  ``output_length``, ``hash_ids``: one block of ``trace_block_tokens`` tokens per id, equal
  ids = equal tokens, as in Mooncake's ``FAST25`` traces); :data:`SHIPPED_TRACE` by default.
"""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pdsweep.core.errors import UserError
from pdsweep.measure.prompts import _load_tokenizer, _task_text, _text
from pdsweep.sweepfile.phases import BenchSpec, WorkloadSpec

SHIPPED_TRACE = Path(__file__).resolve().parent / "traces" / "mini_mooncake.jsonl"
TRACE_FIELDS = ("timestamp", "input_length", "output_length", "hash_ids")


@dataclass(frozen=True)
class LoadRequest:
    """One greedy request: ``token_ids`` (the prompt, special tokens included), ``max_tokens``;
    ``after``: id of the request whose answer must arrive first (multi-turn); ``at_s``: send
    offset in seconds (trace replay); ``pass_no``: pass of a repeated workload."""

    id: str
    token_ids: list[int] = field(repr=False)
    max_tokens: int
    after: str | None = None
    at_s: float = 0.0
    pass_no: int = 0

    @property
    def key(self) -> str:
        """Prompt identity (token ids and ``max_tokens``): reference answers are looked up by it."""
        raw = json.dumps([self.token_ids, self.max_tokens]).encode()
        return hashlib.sha256(raw).hexdigest()[:16]


class _Tokens:
    """Seeded token runs of exact lengths from the probe's text kind (``prose``/``task``)."""

    def __init__(self, tokenizer_path: str | Path, text: str, trust_remote_code: bool = False) -> None:
        self.encode, _ = _load_tokenizer(tokenizer_path, trust_remote_code)
        self.special = self.encode("")
        self.task = text == "task"
        self.make: Callable[[str, int], str] = _task_text if self.task else _text

    def run(self, seed: str, n: int) -> list[int]:
        """``n`` text tokens (no special prefix) seeded by ``seed``; task text keeps the tail
        (it ends in an open question), prose the head."""
        if n <= 0:
            return []
        size = max(16, n) if not self.task else max(1, n // 8)
        while True:
            ids = self.encode(self.make(f"load:{seed}", size))[len(self.special) :]
            if len(ids) >= n:
                return ids[len(ids) - n :] if self.task else ids[:n]
            size *= 2

    def prompt(self, seed: str, n: int) -> list[int]:
        """A prompt of exactly ``n`` tokens: the special prefix (BOS) then text."""
        return (self.special + self.run(seed, n - len(self.special)))[: max(n, 1)]


def read_trace(path: str | Path) -> list[dict[str, Any]]:
    """Rows of a Mooncake-format JSONL trace. Raises ``UserError`` naming the file, line and
    field for a row that is not an object with int ``timestamp``/``input_length``/
    ``output_length`` >= 0 (lengths >= 1) and a list of int ``hash_ids``."""
    path = Path(path)
    try:
        lines = path.read_text().splitlines()
    except OSError as e:
        raise UserError(f"bench.workloads trace {path}: cannot read: {e}") from None
    rows = []
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError as e:
            raise UserError(f"{path}:{i}: not JSON: {e}") from None
        if not isinstance(row, dict):
            raise UserError(f"{path}:{i}: a row must be an object with fields {', '.join(TRACE_FIELDS)}")
        for k in TRACE_FIELDS[:3]:
            v = row.get(k)
            if not isinstance(v, int) or isinstance(v, bool) or v < (0 if k == "timestamp" else 1):
                raise UserError(f"{path}:{i}: field '{k}' must be an int >= {0 if k == 'timestamp' else 1}, got {v!r}")
        ids = row.get("hash_ids")
        if not isinstance(ids, list) or not all(isinstance(h, int) and not isinstance(h, bool) for h in ids):
            raise UserError(f"{path}:{i}: field 'hash_ids' must be a list of ints, got {ids!r}")
        rows.append(row)
    if not rows:
        raise UserError(f"{path}: no trace rows")
    return rows


def make_trace(n: int = 24, block_tokens: int = 16, seed: int = 0) -> list[dict[str, Any]]:
    """A small Mooncake-format trace (how :data:`SHIPPED_TRACE` was made): ``n`` requests
    ~0.2 s apart, 2-6 blocks of ``block_tokens`` each, a third of them reusing the first 2
    blocks of an earlier request (prefix hits), outputs of 4-12 tokens."""
    rng = random.Random(seed)
    rows: list[dict[str, Any]] = []
    next_id, t = 0, 0
    for _ in range(n):
        blocks = rng.randint(2, 6)
        ids: list[int] = []
        if rows and rng.random() < 1 / 3:
            ids = list(rng.choice(rows)["hash_ids"][:2])
        while len(ids) < blocks:
            ids.append(next_id)
            next_id += 1
        inp = blocks * block_tokens - rng.randint(0, block_tokens - 1)  # the last block partial
        rows.append({"timestamp": t, "input_length": inp, "output_length": rng.randint(4, 12), "hash_ids": ids})
        t += rng.randint(50, 350)
    return rows


def build(
    w: WorkloadSpec,
    bench: BenchSpec,
    tokenizer_path: str | Path,
    block: int,
    max_model_len: int,
    text: str,
    trust_remote_code: bool = False,
) -> list[LoadRequest]:
    """The requests of workload ``w`` (sizes unset in ``w`` come from ``bench``); ``block``: the
    effective decode block in tokens; ``trust_remote_code``: the catalogue's, for a tokenizer
    shipped as code. Raises ``UserError`` when the model's ``max_model_len`` leaves no room for a
    prompt, for a bad trace file, or for a tokenizer that cannot be loaded."""
    out_len = w.output_len or bench.output_len
    cap = max_model_len - out_len - 1
    if cap < 2:
        raise UserError(
            f"bench.workloads {w.name}: max_model_len {max_model_len} leaves no room for a prompt and "
            f"output_len {out_len}"
        )
    n = w.num_prompts or bench.num_prompts
    length = min(w.input_len or bench.input_len, cap)
    tok = _Tokens(tokenizer_path, text, trust_remote_code)
    name = w.name
    reqs: list[LoadRequest] = []
    if name == "random":
        reqs = [LoadRequest(f"{name}/{i}", tok.prompt(f"{name}:{i}", length), out_len) for i in range(n)]
    elif name == "shared-prefix":
        plen = min(w.prefix_len or max(1, 3 * length // 4), length - 1)
        prefix = tok.prompt("prefix", plen)
        for p in range(w.passes):
            reqs += [
                LoadRequest(f"{name}/p{p}.{i}", prefix + tok.run(f"suffix:{i}", length - plen), out_len, pass_no=p)
                for i in range(n)
            ]
    elif name == "multi-turn":
        first = max(2, length // w.turns)
        step = max(1, (length - first) // (w.turns - 1))
        for c in range(n):
            ids = tok.prompt(f"conv{c}:0", first)
            for t in range(w.turns):
                if t:
                    ids = ids + tok.run(f"conv{c}:{t}", step)
                if len(ids) > cap:
                    break
                prev = f"{name}/c{c}.t{t - 1}" if t else None
                reqs.append(LoadRequest(f"{name}/c{c}.t{t}", ids, out_len, after=prev))
    elif name == "partial-blocks":
        lengths = sorted({m * block + d for m in (1, 2, 3) for d in (-1, 0, 1) if 1 < m * block + d <= cap})
        reqs = [LoadRequest(f"{name}/len{k}", tok.prompt(f"{name}:{k}", k), out_len) for k in lengths]
    elif name == "chunk-boundary":
        c = w.chunk_tokens or 0  # the spec requires it (WorkloadSpec._chunk)
        lengths = sorted({m * c + d for m in (1, 2, 3) for d in (-1, 0, 1) if 1 < m * c + d <= cap})
        if not lengths:
            raise UserError(
                f"bench.workloads chunk-boundary: chunk_tokens {c} leaves no prompt length <= {cap} "
                f"(max_model_len {max_model_len} - output_len {out_len} - 1)"
            )
        reqs = [LoadRequest(f"{name}/len{k}", tok.prompt(f"{name}:{k}", k), out_len) for k in lengths]
    elif name == "long-context":
        lengths = sorted({max(2, cap - i * max(1, block // 2)) for i in range(min(n, 4))}, reverse=True)
        reqs = [LoadRequest(f"{name}/len{k}", tok.prompt(f"{name}:{k}", k), out_len) for k in lengths]
    elif name == "trace":
        rows = read_trace(w.trace or SHIPPED_TRACE)[: w.num_prompts or None]
        t0 = rows[0]["timestamp"]
        for i, row in enumerate(rows):
            ids = list(tok.special)
            for h in row["hash_ids"]:
                ids += tok.run(f"hash:{h}", w.trace_block_tokens)
            k = min(row["input_length"], cap)
            ids = (ids + tok.run(f"trace-pad:{i}", k - len(ids)))[:k]
            at = (row["timestamp"] - t0) / 1000.0 * w.time_scale
            reqs.append(LoadRequest(f"{name}/{i}", ids, min(row["output_length"], out_len), at_s=at))
    return reqs
