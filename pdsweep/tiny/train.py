"""Train a tiny checkpoint on ``pdsweep_arith`` so that accuracy means something on CPU.

Random weights score 0.000 on every task, so the accuracy gate had no teeth on the CPU
default. :func:`train_checkpoint` takes a checkpoint that :mod:`pdsweep.tiny.checkpoints` just
wrote (random weights, Hugging Face layout) and trains it in place, with plain torch on
the checkpoint's own transformers classes, on sequences drawn from the task's generator
(:func:`pdsweep.tiny.arith._question`) in the exact prompt format lm-eval sends
(``Q: ...\\nA: <answer>`` pairs joined by ``\\n\\n``: the 3-shot prompt is the 4th pair of
such a sequence). The loss covers the answer tokens and the newline that ends them.

``pdsweep_arith`` is a closed task: the model learns the generator's whole question
space (a few hundred questions), of which the eval's 200 are a sample. The point is not
generalisation but a model whose answers are right, so that a wrong KV byte or a lost SSM
state shows up as a wrong answer.

Deterministic: one seed for init and data, ``torch.set_num_threads(2)``; the recipe
(``tiny.train`` in ``sweeps/models.yaml``) and :data:`TRAINER_VERSION` are part of the
checkpoint's cache key. Training stops early once a held-in check of 64 eval questions
is all right twice in a row. Cost on 2 cores: 1-4 min per model.

The mla_mamba2 kind has no transformers class: :class:`MlaMamba2ForTraining` assembles
it from transformers' ``DeepseekV2`` decoder (embeddings, norms, dense MLP, MLA
attention) with ``NemotronHMamba2Mixer`` in place of attention on the mamba layers, the
same layer structure as ``pdsweep.engine.cpu_models.mla_mamba2`` in vLLM.
"""

from __future__ import annotations

import contextlib
import json
import logging
import random
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from pdsweep.core.errors import UserError
from pdsweep.sweepfile.catalogue import TrainSpec
from pdsweep.tiny import arith
from pdsweep.tiny.config import MLA_KEYS, SHAPE_KEYS, mamba2_mixer_config

log = logging.getLogger(__name__)

TRAINER_VERSION = 1  # bump to retrain every cached trained checkpoint
EVAL_SHOTS = 3  # the task template's num_fewshot
_CHECK_N = 64
PROGRESS_S = 20.0  # a progress line on stderr at least this often (never silent for 30 s)


def _fewshot_prefix() -> str:
    """The few-shot block lm-eval puts before every question (template samples)."""
    import yaml

    cfg = yaml.safe_load(arith.TEMPLATE.read_text())
    delim = cfg["fewshot_delimiter"]
    return "".join(f"Q: {s['question']}\nA: {s['answer']}{delim}" for s in cfg["fewshot_config"]["samples"])


def _sample(tok: Any, rng: random.Random, pairs: int) -> tuple[list[int], list[int]]:
    """One training sequence of ``pairs`` Q/A pairs joined by ``\\n\\n`` and ending in
    ``\\n``, tokenized as one text (as lm-eval's prompt is); labels are -100 except the
    answer tokens and the token after each answer (the newline generation stops at)."""
    text, spans = "", []
    for i in range(pairs):
        q, a = arith._question(rng)
        text += ("\n\n" if i else "") + f"Q: {q}\nA:"
        spans.append((len(text), len(text) + len(f" {a}")))
        text += f" {a}"
    enc = tok(text + "\n", return_offsets_mapping=True, add_special_tokens=False)
    ids, offsets = enc["input_ids"], enc["offset_mapping"]
    labels = [-100] * len(ids)
    for start, end in spans:
        inside = [j for j, (a, b) in enumerate(offsets) if a < end and b > start]
        for j in range(inside[0], min(inside[-1] + 2, len(ids))):
            labels[j] = ids[j]
    return ids, labels


def greedy_accuracy(model: Any, tok: Any, records: list[dict[str, Any]], max_new: int = 5) -> float:
    """Exact-match accuracy of greedy answers to ``records`` (``arith.questions`` rows)
    in the lm-eval prompt format, by full forwards (no KV cache, so it also holds for
    models whose layers ignore transformers' cache). Returns a fraction in [0, 1]."""
    import torch

    prefix, ok = _fewshot_prefix(), 0
    model.eval()
    with torch.no_grad():
        for r in records:
            ids = tok.encode(prefix + f"Q: {r['question']}\nA:")
            out: list[int] = []
            for _ in range(max_new):
                nxt = int(model(input_ids=torch.tensor([ids + out]), use_cache=False).logits[0, -1].argmax())
                if "\n" in tok.decode([nxt]):  # the task's stop sequence
                    break
                out.append(nxt)
            ok += tok.decode(out).strip() == r["answer"]
    model.train()
    return ok / len(records)


def answer_accuracy(model: Any, tok: Any, records: list[dict[str, Any]], batch: int = 64) -> float:
    """Greedy exact-match accuracy of ``records`` computed by teacher forcing: a greedy
    answer equals the gold one exactly when, along the gold tokens, every argmax is the gold
    token and the argmax after the answer contains the stop newline (digits are one token
    each, so no other tokenization of the answer exists). One batched forward per
    ``batch`` records instead of one per generated token. Returns a fraction in [0, 1]."""
    import torch

    prefix, ok = _fewshot_prefix(), 0
    model.eval()
    with torch.no_grad():
        for k in range(0, len(records), batch):
            rows = []
            for r in records[k : k + batch]:
                p = tok.encode(prefix + f"Q: {r['question']}\nA:")
                rows.append((p, tok.encode(prefix + f"Q: {r['question']}\nA: {r['answer']}")[len(p) :]))
            width = max(len(p) + len(a) for p, a in rows)
            ids = torch.tensor([p + a + [0] * (width - len(p) - len(a)) for p, a in rows])
            pred = model(input_ids=ids, use_cache=False).logits.argmax(-1)
            for j, (p, a) in enumerate(rows):
                got = pred[j, len(p) - 1 : len(p) + len(a)].tolist()  # predictions of a, then the stop
                ok += got[:-1] == a and "\n" in tok.decode(got[-1:])
    model.train()
    return ok / len(records)


def _reinit(model: Any, std: float) -> None:
    """Normal(0, std) for every Linear / Embedding weight, zero biases (GPT-2 style);
    Mamba2 A_log / D / dt_bias / conv keep transformers' init."""
    import torch

    for m in model.modules():
        if isinstance(m, (torch.nn.Linear, torch.nn.Embedding)):
            torch.nn.init.normal_(m.weight, 0.0, std)
            if isinstance(bias := getattr(m, "bias", None), torch.Tensor):  # Embedding has none
                torch.nn.init.zeros_(bias)


def fit(model: Any, tok: Any, recipe: TrainSpec, label: str = "tiny model") -> dict[str, Any]:
    """Train ``model`` (a transformers-style causal LM: ``model(input_ids, labels)`` gives
    ``.loss``) in place by ``recipe``. Returns ``{steps, loss, check_accuracy, seconds}``.
    Prints ``training <label>: step i/n loss ...`` to stderr every :data:`PROGRESS_S` s."""
    import torch

    torch.set_num_threads(2)
    torch.manual_seed(recipe.seed)
    _reinit(model, recipe.init_std)
    rng = random.Random(recipe.seed)
    check = arith.questions(arith.DEFAULT_N, arith.DEFAULT_SEED)[:_CHECK_N]
    opt = torch.optim.AdamW(model.parameters(), lr=recipe.lr, betas=(0.9, 0.98), weight_decay=0.0)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=recipe.lr, total_steps=recipe.steps, pct_start=0.05)
    model.train()
    t0, acc, perfect, loss, step = time.monotonic(), 0.0, 0, float("nan"), 0
    last = t0
    print(f"pdsweep: training {label}: up to {recipe.steps} steps", file=sys.stderr, flush=True)
    for step in range(1, recipe.steps + 1):
        batch = [_sample(tok, rng, recipe.pairs) for _ in range(recipe.batch)]
        width = max(len(ids) for ids, _ in batch)
        ids = torch.tensor([i + [0] * (width - len(i)) for i, _ in batch])
        labels = torch.tensor([lab + [-100] * (width - len(lab)) for _, lab in batch])
        out = model(input_ids=ids, labels=labels, use_cache=False)
        opt.zero_grad()
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        loss = float(out.loss.detach())
        if (now := time.monotonic()) - last >= PROGRESS_S:
            last = now
            msg = f"step {step}/{recipe.steps} loss {loss:.4f} check accuracy {acc:.3f} ({now - t0:.0f} s)"
            print(f"pdsweep: training {label}: {msg}", file=sys.stderr, flush=True)
        if step % recipe.check_every == 0:
            acc = answer_accuracy(model, tok, check)
            log.info("train step %d loss %.4f check accuracy %.3f (%.0f s)", step, loss, acc, time.monotonic() - t0)
            perfect = perfect + 1 if acc == 1.0 else 0
            if perfect == 2:
                break
    return {"steps": step, "loss": round(loss, 6), "check_accuracy": acc, "seconds": round(time.monotonic() - t0, 1)}


# ------------------------------------------------------------------ trainable models
def _mla_mamba2_model(params: dict[str, Any]) -> Any:
    """transformers DeepseekV2 with NemotronH Mamba2 mixers on the ``mamba`` layers."""
    import torch
    import transformers
    from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHMamba2Mixer

    n, types = params["num_hidden_layers"], params["layer_types"]
    common = {k: params[k] for k in (*SHAPE_KEYS, *MLA_KEYS)}
    model = transformers.DeepseekV2ForCausalLM(
        transformers.DeepseekV2Config(  # type: ignore[call-arg]  # rope_theta: legacy, via __post_init__(**kwargs)
            **common, first_k_dense_replace=n, rms_norm_eps=params["rms_norm_eps"], rope_theta=10000.0
        )
    )
    nh = transformers.NemotronHConfig(
        **{k: params[k] for k in SHAPE_KEYS},
        **mamba2_mixer_config(params),
        chunk_size=params["chunk_size"],
        use_conv_bias=params["use_conv_bias"],
        use_bias=params["use_bias"],
        layer_norm_epsilon=params["rms_norm_eps"],  # vLLM's MambaMixer2 norm takes rms_norm_eps
        time_step_min=0.0,
    )  # vLLM applies no lower dt limit

    class MixerAsAttention(torch.nn.Module):
        def __init__(self, idx: int) -> None:
            super().__init__()
            self.mixer = NemotronHMamba2Mixer(nh, layer_idx=idx)

        def forward(self, hidden_states: Any, **_: Any) -> tuple[Any, None]:
            return self.mixer(hidden_states), None

    for i, t in enumerate(types):
        if t == "mamba":
            model.model.layers[i].self_attn = MixerAsAttention(i)
    return model


@contextlib.contextmanager
def _fast_gdn_solve(kind: str) -> Iterator[None]:
    """For ``qwen3_next`` while training: transformers' CPU fallback of the GDN chunk rule
    (``modeling_qwen3_next.torch_chunk_gated_delta_rule``, used when flash-linear-attention is
    absent) solves its unit-lower-triangular UT system with ``torch.linalg.solve_triangular``
    against 128-wide right-hand sides, which took 459 ms a call on 2 cores (59% of a training
    step, batch 64; torch 2.13 CPU). Solving against the identity and multiplying gives the
    same values to float32 rounding (2e-6 on the solve; 4e-4 on a random-weight tiny-qwen3-next's
    logits) in 15-45 ms. Only inside that function; a no-op for other
    kinds, and for a transformers without that function (then training is slower, not wrong)."""
    import torch

    mod = sys.modules.get("transformers.models.qwen3_next.modeling_qwen3_next") if kind == "qwen3_next" else None
    orig = getattr(mod, "torch_chunk_gated_delta_rule", None)
    if mod is None or orig is None:
        yield
        return
    solve = torch.linalg.solve_triangular

    def via_inverse(a: Any, b: Any, *, upper: bool, left: bool = True, unitriangular: bool = False) -> Any:
        eye = torch.eye(a.shape[-1], dtype=a.dtype, device=a.device).expand_as(a)
        inv = solve(a, eye, upper=upper, left=True, unitriangular=unitriangular)
        return inv @ b if left else b @ inv

    def chunk_rule(*args: Any, **kwargs: Any) -> Any:
        torch.linalg.solve_triangular = via_inverse
        try:
            return orig(*args, **kwargs)
        finally:
            torch.linalg.solve_triangular = solve

    setattr(mod, "torch_chunk_gated_delta_rule", chunk_rule)  # noqa: B010  (the module's global, read at call time)
    try:
        yield
    finally:
        setattr(mod, "torch_chunk_gated_delta_rule", orig)  # noqa: B010


def _checkpoint_keys(key: str) -> str:
    """State-dict name in the trainable model -> name in the saved checkpoint."""
    return key.replace(".self_attn.mixer.", ".mixer.")


def train_checkpoint(out: Path, kind: str, params: dict[str, Any], recipe: TrainSpec) -> dict[str, Any]:
    """Train the checkpoint in ``out`` (written by ``tinymodels``) and overwrite its
    ``model.safetensors`` with the trained weights, same tensor names and shapes.

    Returns the training record (``fit``'s dict plus ``accuracy``: :func:`answer_accuracy` on all
    ``arith.DEFAULT_N`` eval questions). Raises ``UserError`` if that accuracy is below
    ``recipe.min_accuracy`` (fail closed: an untrained model would make every accuracy
    gate on it meaningless) and ``RuntimeError`` if the trained tensors do not match the
    checkpoint's names and shapes.
    """
    import torch
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast.from_pretrained(out)
    torch.manual_seed(recipe.seed)
    if kind == "mla_mamba2":
        model = _mla_mamba2_model(params)
    else:
        model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    with _fast_gdn_solve(kind):
        record = fit(model, tok, recipe, label=out.name.lstrip(".").rsplit("-", 1)[0])
        record["accuracy"] = answer_accuracy(model, tok, arith.questions(arith.DEFAULT_N, arith.DEFAULT_SEED))
    if record["accuracy"] < recipe.min_accuracy:
        raise UserError(
            f"tiny checkpoint {out.name}: training reached accuracy {record['accuracy']:.3f} on "
            f"{arith.TASK_NAME}, below tiny.train.min_accuracy {recipe.min_accuracy} "
            f"({json.dumps(record)}); raise tiny.train.steps in sweeps/models.yaml"
        )
    old = load_file(str(out / "model.safetensors"))
    new = {_checkpoint_keys(k): v.detach().contiguous() for k, v in model.state_dict().items()}
    if kind != "mla_mamba2" and any(k not in new for k in old):
        # transformers renames some keys on save (NemotronH: model.* in memory, backbone.* on disk, the
        # names vLLM's loader reads): take the names from its own save_pretrained
        with tempfile.TemporaryDirectory() as tmp:
            model.save_pretrained(tmp)
            new = load_file(str(Path(tmp) / "model.safetensors"))
    new = {k: v for k, v in new.items() if k in old}  # e.g. buffers (rotary inv_freq) are not saved
    bad = sorted(k for k in old if k not in new or new[k].shape != old[k].shape)
    if bad:
        raise RuntimeError(f"trained model does not match checkpoint {out}: {bad[:8]}")
    save_file(new, str(out / "model.safetensors"), metadata={"format": "pt"})
    log.info("trained %s: %s", out.name, record)
    return record
