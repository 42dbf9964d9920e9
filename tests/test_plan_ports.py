"""pdsweep.plan.ports: the NIXL side-channel ports an instance binds, per the installed vLLM
(one per DP rank, or one per DP rank x TP rank), against the ports reserved per instance (issue 11)."""

import pytest
from _sweepfiles import sweep

from pdsweep.core.errors import UserError
from pdsweep.plan.expand import expand

DP_MATRIX = """platform: cuda
matrix:
  model: [deepseek-v2-lite-chat]
  tp: [p8d8]
  block_size: [64]
  decode_dp: [2, 8]
"""


def _dp_plan(tmp_path, monkeypatch, per_engine: bool):
    from pdsweep.plan import ports

    monkeypatch.setattr(ports, "per_engine_listener", lambda python: per_engine)
    return expand(sweep(tmp_path, DP_MATRIX, head="name: t\n"))


def test_side_channel_ranges_follow_the_installed_vllm(tmp_path, monkeypatch):
    import sys

    from pdsweep.plan.ports import per_engine_listener, side_channel_width

    assert per_engine_listener(sys.executable)  # vLLM 0.32: base_scheduler.py, + data_parallel_index
    assert side_channel_width(sys.executable, 2, 8) == 2
    plan = _dp_plan(tmp_path, monkeypatch, per_engine=True)
    # one port per DP rank: DP 2 and DP 8 fit the 8 reserved per instance (DP > 8 is refused
    # by the spec's bound, which names the same vLLM rule)
    assert [c.id for c in plan.pd_cells] == [
        "deepseek-v2-lite-chat.p8d8.b64-64.fixed.ddp2",
        "deepseek-v2-lite-chat.p8d8.b64-64.fixed.ddp8",
    ]
    assert not plan.rejected
    with pytest.raises(UserError, match=r"decode_dp\[1\]: Input should be less than or equal to 8"):
        sweep(tmp_path, DP_MATRIX.replace("[2, 8]", "[2, 16]"), head="name: t\n")


def test_dp2_tp8_decode_overlaps_where_vllm_binds_per_rank(tmp_path, monkeypatch):
    plan = _dp_plan(tmp_path, monkeypatch, per_engine=False)
    assert not plan.pd_cells
    assert [r.reason.split(" (one per")[0] for r in plan.rejected] == [
        "decode instance 1 (DP 2 x TP 8) binds 16 NIXL side-channel ports",
        "decode instance 1 (DP 8 x TP 8) binds 64 NIXL side-channel ports",
    ]
    assert all("more than the 8 reserved per instance" in r.reason for r in plan.rejected)
