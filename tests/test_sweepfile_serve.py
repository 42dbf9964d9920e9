"""pdsweep.sweepfile.serve: a serve_args variant's kv_transfer_extra keys are known and bounded
(pdsweep.sweepfile.connector; issue 23)."""

from __future__ import annotations

from pathlib import Path

import pytest
from _sweepfiles import sweep

from pdsweep.cli import main
from pdsweep.core.errors import UserError

REPO = Path(__file__).resolve().parent.parent


SMALL = "name: x\nplatform: cpu\nmatrix: {model: [tiny-llama], tp: [p1d1], block_size: [32]}\n"


@pytest.mark.parametrize(
    "extra, why",
    [
        ("{engine_id: same}", "kv_transfer_extra: key(s) ['engine_id'] not allowed"),
        ("{kv_connector_extra_config: {kv_lease_duration: -5}}", "kv_connector_extra_config.kv_lease_duration"),
        ("{kv_connector_extra_config: {nonsense: 1}}", "key(s) ['nonsense'] unknown (allowed: kv_lease_duration"),
        ("{kv_port: 80}", "kv_transfer_extra.kv_port: Input should be greater than or equal to 1024"),
        ("{kv_load_failure_policy: maybe}", "kv_transfer_extra.kv_load_failure_policy"),
    ],
)
def test_connector_settings_known_and_bounded(tmp_path: Path, capsys, extra: str, why: str) -> None:
    (tmp_path / "models.yaml").write_text((REPO / "sweeps" / "models.yaml").read_text())
    body = SMALL.replace("matrix: {", f"serve_args:\n  base: []\n  x: {{kv_transfer_extra: {extra}}}\nmatrix: {{")
    (tmp_path / "s.yaml").write_text(body.replace("block_size: [32]}", "block_size: [32], serve_args: [x]}"))
    assert main(["validate", str(tmp_path / "s.yaml"), "--no-check-argv"]) == 2
    err = capsys.readouterr().err
    assert why in err and "Traceback" not in err, err


@pytest.mark.parametrize("key", ["kv_role", "kv_buffer_device", "kv_connector_module_path"])
def test_kv_transfer_extra_cannot_change_connector_role_or_buffer(tmp_path, key):
    with pytest.raises(
        UserError, match=rf"kv_transfer_extra: key\(s\) \['{key}'\] not allowed \(allowed: kv_connector, kv_port"
    ):
        sweep(
            tmp_path,
            f"""serve_args:
  base: []
  x: {{kv_transfer_extra: {{{key}: v}}}}
matrix: {{model: [tiny-llama], tp: [p1d1]}}
""",
        )
