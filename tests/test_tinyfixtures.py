"""pdsweep.tiny.fixtures / refresh: trained tiny checkpoints are committed fixtures keyed by their
recipe hash, copied into the cache sha256-verified instead of trained (CI and a first make sweep
train nothing), refused when corrupt, ignored when stale; and the recipe still trains."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from pdsweep.core.errors import UserError
from pdsweep.core.paths import sha256_file
from pdsweep.sweepfile.catalogue import TrainSpec
from pdsweep.sweepfile.sweep import load_catalogue
from pdsweep.tiny import checkpoints as tinymodels
from pdsweep.tiny import fixtures, refresh
from pdsweep.tiny import train as tinytrain
from pdsweep.tiny.config import config_params

ROOT = Path(__file__).resolve().parent.parent
CATALOGUE = load_catalogue(ROOT / "sweeps" / "models.yaml")
TRAINED = sorted(refresh.trained_entries())  # weights_from entries copy another's checkpoint: no fixture
LLAMA = CATALOGUE.models["tiny-llama"]


def key(name: str, model=None) -> str:
    return tinymodels.checkpoint_dir(name, model or CATALOGUE.models[name], Path("/nonexistent"), create=False).name


@pytest.fixture
def fake_root(tmp_path, monkeypatch):
    """A fixtures root holding a small stand-in for tiny-llama's current fixture; training is
    forbidden (``_generate`` raises), so a checkpoint can only come from the fixture."""
    root = tmp_path / "fixtures"
    d = root / key("tiny-llama")
    d.mkdir(parents=True)
    (d / "model.safetensors").write_bytes(bytes(range(256)) * 64)
    (d / tinymodels.META_FILE).write_text(json.dumps({"name": "tiny-llama", "trained": {"accuracy": 1.0}}))
    (root / fixtures.MANIFEST).write_text(json.dumps({d.name: {p.name: sha256_file(p) for p in d.iterdir()}}, indent=2))
    monkeypatch.setattr(fixtures, "ROOT", root)

    def no_training(*a, **k):
        raise AssertionError("trained although a fixture exists")

    monkeypatch.setattr(tinymodels, "_generate", no_training)
    return d


def test_fixture_is_copied_and_verified_instead_of_trained(fake_root, tmp_path):
    got = tinymodels.checkpoint_dir("tiny-llama", LLAMA, tmp_path / "cache")
    assert got == tmp_path / "cache" / fake_root.name
    assert {p.name: p.read_bytes() for p in got.iterdir()} == {p.name: p.read_bytes() for p in fake_root.iterdir()}
    assert [p.name for p in (tmp_path / "cache").iterdir()] == [fake_root.name]  # no temp dir left


def test_corrupt_fixture_is_refused(fake_root, tmp_path):
    blob = bytearray((fake_root / "model.safetensors").read_bytes())
    blob[100] ^= 1
    (fake_root / "model.safetensors").write_bytes(bytes(blob))
    with pytest.raises(UserError, match=rf"{fake_root.name}/model.safetensors: sha256 \w+\.\.\. != manifest"):
        tinymodels.checkpoint_dir("tiny-llama", LLAMA, tmp_path / "cache")
    assert not list((tmp_path / "cache").iterdir())  # nothing half-copied in the cache


def test_fixture_missing_from_the_manifest_is_refused(fake_root, tmp_path):
    (fake_root.parent / fixtures.MANIFEST).write_text("{}")
    with pytest.raises(UserError, match=r"is not in .*manifest.json; refresh with `make tiny-fixtures`"):
        tinymodels.checkpoint_dir("tiny-llama", LLAMA, tmp_path / "cache")


def test_stale_fixture_is_ignored_and_the_recipe_trains(fake_root, tmp_path, monkeypatch):
    built = []
    monkeypatch.setattr(tinymodels, "_generate", lambda name, model, out: built.append(name) or (out / "x").touch())
    other = LLAMA.model_copy(update={"tiny": LLAMA.tiny.model_copy(update={"train": TrainSpec(steps=7)})})
    tinymodels.checkpoint_dir("tiny-llama", other, tmp_path / "cache")
    tinymodels.checkpoint_dir("tiny-llama", LLAMA, tmp_path / "nofix", fixtures=False)
    assert built == ["tiny-llama", "tiny-llama"]  # a changed recipe, and fixtures=False, train


def test_refresh_copies_the_build_drops_stale_and_writes_the_manifest(tmp_path, monkeypatch):
    cache, root = tmp_path / "cache", tmp_path / "fixtures"
    monkeypatch.setenv("PDSWEEP_CACHE", str(cache))
    built = cache / key("tiny-llama")
    built.mkdir(parents=True)
    (built / tinymodels.META_FILE).write_text("{}")
    (built / "model.safetensors").write_bytes(b"weights")
    (root / "tiny-llama-000000000000").mkdir(parents=True)  # an older recipe's fixture
    (root / "tiny-mla-000000000000").mkdir()  # another entry's: kept
    assert refresh.refresh(root=root, names=["tiny-llama"]) == [built.name]
    assert sorted(p.name for p in root.iterdir()) == sorted([built.name, "tiny-mla-000000000000", fixtures.MANIFEST])
    assert fixtures.manifest(root) == {
        built.name: {
            tinymodels.META_FILE: sha256_file(built / tinymodels.META_FILE),
            "model.safetensors": (sha256_file(built / "model.safetensors")),
        }
    }
    with pytest.raises(UserError, match=r"\['nope'\] are not trained catalogue entries"):
        refresh.refresh(root=root, names=["nope"])


# trained entries without a committed fixture yet (they train on first use, minutes): strict, so
# committing one (`make tiny-fixtures TINY_ARGS=<name>`) fails here until it leaves this set
NO_FIXTURE_YET: set[str] = set()


@pytest.mark.parametrize(
    "name",
    [
        pytest.param(n, marks=pytest.mark.xfail(strict=True, reason="no fixture committed yet"))
        if n in NO_FIXTURE_YET
        else n
        for n in TRAINED
    ],
)
def test_every_trained_entry_has_a_current_verified_fixture(name):
    """A recipe change (or a TRAINER_VERSION/GENERATOR_VERSION bump) without `make tiny-fixtures`
    fails here, instead of CI quietly training for minutes."""
    k = key(name)
    assert (fixtures.ROOT / k).is_dir(), f"no fixture {k} for the current recipe: run `make tiny-fixtures`"
    files = fixtures.manifest()[k]
    fixtures.verify(fixtures.ROOT / k, files)
    size = sum((fixtures.ROOT / k / f).stat().st_size for f in files)
    assert size < 10e6  # MBs, not GBs: the repository carries them (tiny-mla-mamba2: 8.7 MB)
    rec = json.loads((fixtures.ROOT / k / tinymodels.META_FILE).read_text())["trained"]
    assert rec["accuracy"] >= CATALOGUE.models[name].tiny.train.min_accuracy


def test_no_stale_fixture_is_committed():
    current = {key(n) for n in TRAINED}
    have = {p.name for p in fixtures.ROOT.iterdir() if p.is_dir()}
    assert have <= current and set(fixtures.manifest()) <= current


@pytest.mark.parametrize("name", TRAINED)
def test_the_recipe_still_trains(name, tmp_path):
    """A few steps of the catalogue recipe (its lr, batch, pairs, init) on a fresh random
    checkpoint lower the loss on a fixed batch: the trainer and model classes still work,
    without the minutes a full training costs."""
    import torch
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    m = CATALOGUE.models[name]
    rand = m.model_copy(update={"tiny": m.tiny.model_copy(update={"train": None})})
    d = tinymodels.checkpoint_dir(name, rand, tmp_path)
    params = config_params(name, m)
    tok = PreTrainedTokenizerFast.from_pretrained(d)
    torch.manual_seed(0)
    if m.tiny.kind == "mla_mamba2":
        model = tinytrain._mla_mamba2_model(params)
    else:
        model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)
    rng = random.Random(99)
    batch = [tinytrain._sample(tok, rng, 2) for _ in range(4)]
    width = max(len(i) for i, _ in batch)
    ids = torch.tensor([i + [0] * (width - len(i)) for i, _ in batch])
    labels = torch.tensor([lab + [-100] * (width - len(lab)) for _, lab in batch])

    def loss() -> float:
        with torch.no_grad():
            return float(model(input_ids=ids, labels=labels, use_cache=False).loss)

    recipe = m.tiny.train.model_copy(update={"steps": 8, "batch": 4, "check_every": 10**6})
    torch.manual_seed(recipe.seed)  # the init fit() starts from
    tinytrain._reinit(model, recipe.init_std)
    before = loss()
    rec = tinytrain.fit(model, tok, recipe, label=name)
    after = loss()
    assert rec["steps"] == 8 and after < 0.9 * before, (before, after)
