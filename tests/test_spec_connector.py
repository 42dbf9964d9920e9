"""pdsweep.spec.connector: kv_transfer_extra.kv_connector is a NIXL connector only (issue 11)."""

from __future__ import annotations

from pathlib import Path

import pytest

from pdsweep.core.errors import UserError
from pdsweep.spec.sweep import load_sweep

REPO = Path(__file__).resolve().parent.parent


HEAD = """name: t
platform: cpu
defaults: {prefill_block_size: 32, decode_block_size: 32}
"""


def sweep(tmp_path: Path, body: str, head: str = HEAD):
    (tmp_path / "models.yaml").write_text((REPO / "sweeps" / "models.yaml").read_text())
    p = tmp_path / "s.yaml"
    p.write_text(head + body)
    return load_sweep(p)


@pytest.mark.parametrize("value", ["LMCacheConnectorV1", "v"])
def test_kv_connector_is_a_nixl_connector_only(tmp_path, value):
    with pytest.raises(
        UserError, match=rf"kv_transfer_extra.kv_connector: .*'NixlConnector' or 'NixlPushConnector'.*{value}"
    ):
        sweep(
            tmp_path,
            f"""serve_args:
  base: []
  x: {{kv_transfer_extra: {{kv_connector: {value}}}}}
matrix: {{model: [tiny-llama], tp: [p1d1]}}
""",
        )
