"""pdsweep.sweepfile.catalogue: a negative layer count is refused (issue 15)."""

from __future__ import annotations

from pathlib import Path

from _sweepfiles import SMALL, bad

REPO = Path(__file__).resolve().parent.parent


def test_negative_ssm_layers_is_refused(tmp_path: Path, capsys) -> None:
    models = (
        (REPO / "sweeps" / "models.yaml")
        .read_text()
        .replace("  tiny-llama:\n", "  tiny-llama:\n    ssm_layers: -3\n", 1)
    )
    assert "models.tiny-llama.ssm_layers: Input should be greater than or equal to 0" in bad(
        tmp_path, SMALL, capsys, models
    )
