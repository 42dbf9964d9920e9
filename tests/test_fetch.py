"""``pdsweep fetch`` (pdsweep.run.fetch) against huggingface_hub's own API with the network cut:
``HfApi.model_info`` and ``snapshot_download`` are replaced by recording fakes. The disk is checked
before anything downloads, HF_HUB_OFFLINE refuses naming the missing repos, and the run preflight
lists a model not downloaded (``pdsweep run`` refuses it), saying to run it."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace as NS

import pytest

from pdsweep.core.errors import UserError
from pdsweep.run import fetch as F
from pdsweep.sweepfile.sweep import load_catalogue

REPO = Path(__file__).resolve().parents[1]
CAT = load_catalogue(REPO / "sweeps" / "models.yaml").models
MODELS = {k: CAT[k] for k in ("kimi-linear", "glm-5.3-flash-4l", "tiny-llama")}
KIMI, GLM = "moonshotai/Kimi-Linear-48B-A3B-Instruct", "JaredforReal/GLM-5.3-Flash-4L"


@pytest.fixture
def hub(monkeypatch, tmp_path):
    """huggingface_hub with no network: model_info lists files with sizes; downloads are recorded."""
    import huggingface_hub

    calls: list[tuple[str, object]] = []
    files = {
        KIMI: [("model-00001.safetensors", 60 * 10**9), ("model-00002.safetensors", 38 * 10**9), ("config.json", 5000)],
        GLM: [("model.safetensors", 20 * 10**9), ("tokenizer.json", 7 * 10**6), ("README.md", 10**4)],
    }

    class FakeApi:
        def model_info(self, repo, token=None, files_metadata=False, timeout=None):
            calls.append(("model_info", repo))
            assert files_metadata  # sizes are asked for
            return NS(siblings=[NS(rfilename=n, size=s) for n, s in files[repo]])

    def fake_download(**kw):
        calls.append(("download", kw["repo_id"]))
        return str(tmp_path / kw["repo_id"])

    monkeypatch.setattr(huggingface_hub, "HfApi", FakeApi)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_download)
    return calls


def no_cache(repo):
    return None


def test_fetch_sizes_then_checks_disk_then_downloads(hub, monkeypatch, tmp_path):
    monkeypatch.setattr(F, "free_bytes", lambda p: 200 * 10**9)

    def cache(repo):  # cached once downloaded (fetch checks each download is complete)
        return tmp_path / repo if ("download", repo) in hub else None

    got = F.fetch(MODELS, env={"HF_HUB_CACHE": str(tmp_path)}, cache=cache)
    assert [(m.model, m.nbytes) for m in got] == [("glm-5.3-flash-4l", 20_007_000_000), ("kimi-linear", 98_000_005_000)]
    assert hub == [("model_info", GLM), ("model_info", KIMI), ("download", GLM), ("download", KIMI)]


def test_fetch_refuses_before_any_download_when_the_disk_is_short(hub, monkeypatch, tmp_path):
    monkeypatch.setattr(F, "free_bytes", lambda p: 100 * 10**9)  # 118.0 GB x 1.05 needed
    with pytest.raises(UserError, match=r"123\.9 GB needed .* 100\.0 GB free under .*: nothing downloaded"):
        F.fetch(MODELS, env={"HF_HUB_CACHE": str(tmp_path)}, cache=no_cache)
    assert [c for c in hub if c[0] == "download"] == []


def test_fetch_offline_names_every_missing_repo_and_touches_no_hub(hub):
    with pytest.raises(UserError) as e:
        F.fetch(MODELS, env={"HF_HUB_OFFLINE": "1"}, cache=lambda r: Path("/x") if r == KIMI else None)
    assert (
        "HF_HUB_OFFLINE is set and 1 are not in the HF cache: model glm-5.3-flash-4l (JaredforReal/GLM-5.3-Flash-4L)"
        in str(e.value)
    )
    assert hub == []


def test_run_preflight_says_to_fetch_a_model_not_downloaded():
    from pdsweep.plan.expand import expand
    from pdsweep.run.preflight import preflight
    from pdsweep.sweepfile.sweep import load_sweep

    ls = load_sweep(REPO / "sweeps" / "hybrid-mla-mamba.yaml")
    cells = [c for c in expand(ls).cells if c.model == "glm-5.3-flash-4l"][:1]

    class Hub:
        def gated(self, repo_id, token):
            return False

        def weights_bytes(self, repo_id, token):
            return None

    out = preflight(ls, cells, hub=Hub(), inv=NS(error=None, gpus=[], driver=None), env={}, cache=no_cache)
    (msg,) = out.unfetched  # `pdsweep run` refuses it; `pdsweep plan --preflight` warns
    assert f"model glm-5.3-flash-4l: {GLM} is not in the HF cache: vLLM would download it at startup" in msg
    assert f"run `pdsweep fetch {ls.path}` first" in msg and msg in out.warnings


def test_fetch_eval_datasets_from_lm_evals_task_index_in_the_same_disk_check(hub, monkeypatch, tmp_path):
    """gsm8k's dataset (lm-eval's index: openai/gsm8k, main) is missing from the datasets cache:
    sized with HfApi.dataset_info, counted with the weights, refused offline by name."""
    pytest.importorskip("lm_eval")
    import datasets
    import huggingface_hub

    assert F.task_datasets(["gsm8k", "pdsweep_arith"]) == {"gsm8k": ("openai/gsm8k", "main")}
    ds = F.missing_datasets(["gsm8k"], cached=lambda path, name: False)
    assert [(m.kind, m.model, m.repo, m.config) for m in ds] == [("dataset", "gsm8k", "openai/gsm8k", "main")]
    assert F.missing_datasets(["gsm8k"], cached=lambda path, name: True) == []
    with pytest.raises(UserError, match=r"not in the HF cache: dataset gsm8k \(openai/gsm8k\)"):
        F.fetch({}, env={"HF_HUB_OFFLINE": "1"}, cache=no_cache, datasets=ds)

    loaded = []
    api = huggingface_hub.HfApi
    api.dataset_info = lambda self, repo, **kw: NS(siblings=[NS(rfilename="main/train.parquet", size=3 * 10**9)])
    monkeypatch.setattr(datasets, "load_dataset", lambda path, name=None: loaded.append((path, name)))
    monkeypatch.setattr(F, "free_bytes", lambda p: 10 * 10**9)  # 3.15 + 21.0 GB needed
    with pytest.raises(UserError, match=r"24\.2 GB needed .*openai/gsm8k 3\.0 GB"):
        F.fetch(
            {"glm-5.3-flash-4l": CAT["glm-5.3-flash-4l"]},
            env={"HF_HUB_CACHE": str(tmp_path)},
            cache=no_cache,
            datasets=ds,
        )
    assert loaded == [] and [c for c in hub if c[0] == "download"] == []
    monkeypatch.setattr(F, "free_bytes", lambda p: 30 * 10**9)
    F.fetch({}, env={"HF_HUB_CACHE": str(tmp_path)}, cache=no_cache, datasets=ds)
    assert loaded == [("openai/gsm8k", "main")]
