"""Issue 37 (a): the CPU default's gated answers do not depend on the host's instruction set.

``tests/fixtures/isa_margins.json`` is ``python -m pdsweep.measure.margins`` run on an AMD EPYC with
AVX-512 and AVX512_BF16 (then ``--compare-runs`` for vLLM itself, docs/cpu.md "Same answers on
every x86 host"): for every model whose answers sweeps/cpu-smoke.yaml gates, the smallest top-1
minus top-2 logit over every greedy token of the consistency probe and the eval's questions, and
the largest logit change between torch's AVX-512 and forced-AVX2 kernels (ATEN_CPU_CAPABILITY,
MKL_ENABLE_INSTRUCTIONS, ONEDNN_MAX_CPU_ISA; and under qemu-user's Haswell CPUID for two models)
along the same tokens.

K = 10: a greedy token flips only if the top-2 gap closes, and a gap moves by at most twice the
largest logit change (2); the other 5x covers kernels the torch measurement does not run (vLLM's own
_C_AVX2 attention/RoPE/norm, measured separately in vLLM on the forced-AVX2 path) and other hosts'
rounding (Intel's MKL paths)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pdsweep.measure import margins
from pdsweep.sweepfile.sweep import load_catalogue

ROOT = Path(__file__).resolve().parent.parent
FIX = json.loads((ROOT / "tests" / "fixtures" / "isa_margins.json").read_text())
CATALOGUE = load_catalogue(ROOT / "sweeps" / "models.yaml")
K = 10


def drift(name: str) -> float:
    """The logit change the model's answers must survive: the measured ISA drift (torch, and vLLM's
    own cross-ISA top-1 logprob change where measured); for a model served in another dtype than
    fp32, the measured bf16-vs-fp32 drift too (the margins are fp32's)."""
    d = max(FIX["drift"][e]["max_logit_diff"][name] for e in margins.ISA_ENVS)
    d = max([d, FIX["models"][name]["rerun_drift"]] + [c["max_abs_dlogprob"] for c in vllm_cells(name)])
    d = max([d] + [c["max_logit_diff"][name] for c in FIX.get("cpuid", {}).values() if name in c["max_logit_diff"]])
    if CATALOGUE.models[name].dtype != "float32":
        d = max(d, FIX["models"][name]["bf16_drift"])
    return float(d)


def vllm_cells(name: str) -> list[dict]:
    return [c for cid, c in (FIX.get("vllm") or {}).get("cells", {}).items() if cid.split(".")[0] == name]


def test_the_measurement_covers_every_gated_model_with_todays_inputs():
    """A new gated model, cell block size or probe/eval setting needs a new measurement."""
    assert {n: m["inputs"] for n, m in FIX["models"].items()} == margins.gated()


def test_the_isa_paths_compared_really_differed():
    assert FIX["drift"]["default"]["capability"] == "AVX512"
    assert {FIX["drift"][e]["capability"] for e in margins.ISA_ENVS} == {"AVX2"}
    assert all(0 < v < 1e-4 for e in margins.ISA_ENVS for v in FIX["drift"][e]["max_logit_diff"].values())


@pytest.mark.parametrize("name", sorted(FIX["models"]))
def test_every_gated_greedy_token_has_a_margin_of_k_times_the_drift(name):
    m = FIX["models"][name]
    assert m["tokens"] >= m["sequences"] > 0
    assert m["min_margin"] >= K * drift(name), (
        f"{name}: smallest greedy margin {m['min_margin']} logits ({m['min_margin_at']}) < {K} x drift "
        f"{drift(name):.3g}: its answers may differ between x86 hosts"
    )


def test_a_real_avx2_only_cpuid_gives_the_same_greedy_tokens():
    """qemu-x86_64 -cpu Haswell: torch, MKL and oneDNN see no AVX-512 at all."""
    q = FIX["cpuid"]["qemu-haswell"]
    assert q["capability"] == "AVX2" and q["max_logit_diff"] and all(q["argmax_same"].values())


def test_vllm_on_its_avx2_path_gives_the_same_answers():
    """vLLM itself, forced onto _C_AVX2 (scripts/isa/avx2), against the AVX-512-BF16 run."""
    cells = (FIX.get("vllm") or {}).get("cells", {})
    assert cells, "no vLLM cross-ISA comparison in the fixture"
    for cid, c in cells.items():
        assert c["probe_tokens_equal"] and c["probe_prompts"] == 3, cid
        assert c.get("eval_answers_equal", True), cid


def test_committed_margins_reproduce_here(tmp_path):
    """The committed figures are real: tiny-llama's margins recomputed now (transformers, fp32)."""
    m = margins.margins("tiny-llama", margins.gated()["tiny-llama"], tmp_path)
    fix = FIX["models"]["tiny-llama"]
    assert m["min_margin"] == pytest.approx(fix["min_margin"], abs=1e-3)
    assert m["min_margin_at"] == fix["min_margin_at"]
    assert m["bf16_drift"] == pytest.approx(fix["bf16_drift"], rel=0.05)


@pytest.mark.skipif(
    "avx512f" not in Path("/proc/cpuinfo").read_text(), reason="needs an AVX-512 host to write the cache"
)
def test_forced_avx2_keeps_its_own_inductor_cache():
    """scripts/isa/avx2 gives the forced-AVX2 processes an Inductor cache of their own: torch's FX graph
    cache key holds no CPU vector ISA, and reusing an AVX-512 process's C++ made every TP 2 instance of
    the forced sweep fail (IndexError in VocabParallelEmbedding; docs/cpu.md)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "inductor_cache_isa", ROOT / "scripts" / "isa" / "inductor_cache_isa.py"
    )
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    first, second = mod.run(ROOT / "scripts" / "isa" / "avx2")
    assert first.startswith("isa=avx512") and first.endswith("bad=0"), first
    assert second == "isa=avx2 bad=0", second
