"""pdsweep.sweepfile.matrix: 'expect: fail' needs 'match:', and every shipped expected failure names its
signature (issue 23); conflicting include entries are errors (issue 15)."""

from __future__ import annotations

from pathlib import Path

import pytest
from _sweepfiles import bad

from pdsweep.cli import main

REPO = Path(__file__).resolve().parent.parent


def test_validate_refuses_expect_fail_without_match(tmp_path: Path, capsys) -> None:
    (tmp_path / "models.yaml").write_text((REPO / "sweeps" / "models.yaml").read_text())
    body = (
        "name: x\nplatform: cpu\nmatrix:\n  model: [tiny-llama]\n  tp: [p1d1]\n  block_size: [32]\n"
        "  include:\n    - {model: tiny-llama, tp: p1d1, block_size: 32, expect: fail, reason: r}\n"
    )
    (tmp_path / "s.yaml").write_text(body)
    assert main(["validate", str(tmp_path / "s.yaml"), "--no-check-argv"]) == 2
    assert "'expect: fail' needs 'match:'" in capsys.readouterr().err
    (tmp_path / "s.yaml").write_text(body.replace("reason: r}", "reason: r, match: any}"))
    assert main(["validate", str(tmp_path / "s.yaml"), "--no-check-argv"]) == 0, capsys.readouterr().err


def test_every_shipped_expected_failure_names_its_signature() -> None:
    import yaml

    for path in sorted((REPO / "sweeps").glob("*.yaml")):
        inc = ((yaml.safe_load(path.read_text()) or {}).get("matrix") or {}).get("include") or []
        for e in inc:
            if isinstance(e, dict) and e.get("expect") == "fail":
                assert e.get("match"), (path.name, e)


MATRIX = "name: x\nplatform: cpu\nmatrix:\n  model: [tiny-llama, tiny-mla]\n  tp: [p1d1]\n  block_size: [32]\n"


@pytest.mark.parametrize(
    "entry, why",
    [
        ("{model: tiny-llama, tp: p1d1, prefill_tp: 2}", "include[0]: give 'tp' or 'prefill_tp'/'decode_tp', not both"),
        ("{model: tiny-llama, block_size: 32, decode_block_size: 64}", "include[0]: give 'block_size' or"),
        (
            "{model: tiny-llama, reason: flaky}",
            "include[0]: 'reason' explains an expected failure: it needs 'expect: fail'",
        ),
        ("{model: tiny-llama, ref: 'vllm#1'}", "include[0]: 'ref' explains an expected failure"),
    ],
)
def test_conflicting_include_entries_are_errors(tmp_path: Path, capsys, entry: str, why: str) -> None:
    assert why in bad(tmp_path, MATRIX + f"  include:\n    - {entry}\n", capsys)
