"""pdsweep.sweepfile.connector: kv_transfer_extra.kv_connector is a NIXL connector only (issue 11)."""

from __future__ import annotations

from pathlib import Path

import pytest
from _sweepfiles import sweep

from pdsweep.core.errors import UserError

REPO = Path(__file__).resolve().parent.parent


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
