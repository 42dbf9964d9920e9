"""The pydantic-free catalogue reader the lent device uses (pdsweep.xfer.light) reads every model of
the shipped catalogues, and the geometry it gives equals the pydantic schema's. CI's failing run of
2026-12-07 (GLM's ``mla.index_kpool``, added to sweeps/models.yaml but not to the light reader)
surfaced only on the device dry run, which needs the cp312 wheels; this runs in the unit tier."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from pdsweep.plan.geometry import kv_geometry
from pdsweep.sweepfile.sweep import load_catalogue
from pdsweep.xfer.light import load_model

REPO = Path(__file__).resolve().parents[1]
CATALOGUE = REPO / "sweeps" / "models.yaml"
NAMES = sorted((yaml.safe_load(CATALOGUE.read_text()) or {})["models"])


@pytest.mark.parametrize("name", NAMES)
def test_light_reader_gives_the_schemas_geometry(name):
    light = load_model(CATALOGUE, name)
    full = load_catalogue(CATALOGUE).models[name]
    for bs in (16, 128):
        try:
            want = kv_geometry(name, full, bs)
        except ValueError as e:  # a model the catalogue gives no geometry for: the same refusal
            with pytest.raises(ValueError, match=re.escape(str(e))):
                kv_geometry(name, light, bs)  # type: ignore[arg-type]
            continue
        assert kv_geometry(name, light, bs) == want  # type: ignore[arg-type]


def test_light_reader_names_file_field_and_allowed_values(tmp_path):
    bad = tmp_path / "models.yaml"
    bad.write_text(
        "models:\n  m:\n    attention: mla\n    num_layers: 2\n    mla: {kv_lora_rank: 8, qk_rope_head_dim: 4, rank: 1}\n"
    )
    with pytest.raises(
        ValueError, match=r"models.yaml: models.m.mla: unknown field\(s\) rank \(allowed: .*index_kpool"
    ):
        load_model(bad, "m")
    bad.write_text(
        "models:\n  m:\n    attention: mla\n    num_layers: 2\n    mla: {kv_lora_rank: 8, qk_rope_head_dim: 4, sparse: 1}\n"
    )
    with pytest.raises(ValueError, match=r"models.m.mla.sparse: expected true or false, got 1"):
        load_model(bad, "m")
