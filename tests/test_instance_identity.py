"""One owner of an instance's identity (issue 34 item 4): argv, env and ports from
pdsweep.plan.instance, in one port layout for a cell's slot and a pooled instance's block; a
serve-args variant's kv_transfer_extra merged into the --kv-transfer-config JSON (issue 11)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from _sweepfiles import sweep

from pdsweep.core.errors import UserError
from pdsweep.deploy.instances import relocate
from pdsweep.plan.expand import expand
from pdsweep.plan.instance import (
    BLOCK_PORTS,
    MAX_INSTANCES,
    PORTS_PER_SLOT,
    SIDE_CHANNEL_PORTS,
    Slot,
    check_ports,
    instances,
)
from pdsweep.sweepfile.sweep import load_sweep

SMOKE = Path(__file__).resolve().parent.parent / "sweeps" / "cpu-smoke.yaml"


def test_a_slot_holds_the_proxy_and_one_block_per_instance_in_the_pooled_layout() -> None:
    assert (BLOCK_PORTS, SIDE_CHANNEL_PORTS, MAX_INSTANCES, PORTS_PER_SLOT) == (16, 8, 12, 200)
    slot = Slot(2, (), 20400)
    assert [slot.block(k) for k in (0, 1, MAX_INSTANCES - 1)] == [20408, 20424, 20584]
    assert slot.block(MAX_INSTANCES - 1) + BLOCK_PORTS == slot.port_base + PORTS_PER_SLOT  # the last block fits
    ls = load_sweep(SMOKE)
    cell = next(c for c in expand(ls).cells if c.kind == "pd" and c.num_prefill + c.num_decode == 2)
    specs = instances(cell, slot, ls, "/m", "/py")
    got = [(s.port, int(s.env["VLLM_PORT"]), s.side_channel_port) for s in specs]
    assert got == [(20408, 20410, 20416), (20424, 20426, 20432)]
    assert slot.proxy_port() == 20400 and 20400 not in {p for g in got for p in g}
    # a pooled instance's block (deploy.instances.relocate) has the same offsets
    for k, s in enumerate(specs):
        moved = relocate(s, slot.block(k))
        assert (moved.port, moved.env["VLLM_PORT"], moved.side_channel_port) == (s.port, s.env["VLLM_PORT"], got[k][2])


def test_one_range_check_for_every_port_block() -> None:
    check_ports(65336, 200, "lane")  # ends at 65535
    with pytest.raises(UserError, match="lane: 200 ports from 65337 reach port 65536, past 65535"):
        check_ports(65337, 200, "lane")


def kv_json(spec) -> dict:
    argv = list(spec.argv)
    return json.loads(argv[argv.index("--kv-transfer-config") + 1])


def test_kv_transfer_extra_is_merged_into_pdsweeps_json(tmp_path):
    ls = sweep(
        tmp_path,
        """defaults: {prefill_block_size: 32, decode_block_size: 32, kv_lease_duration_s: 600}
serve_args:
  base: []
  fail-policy: {kv_transfer_extra: {kv_load_failure_policy: recompute, kv_connector_extra_config: {num_threads: 2}}}
matrix: {model: [tiny-llama], tp: [p1d1], serve_args: [fail-policy]}
""",
        head="name: t\nplatform: cpu\n",
    )
    (cell,) = expand(ls).pd_cells
    pre, dec = instances(cell, Slot(0, (), 20000), ls, "/m", "python")
    assert kv_json(pre) == {
        "kv_connector": "NixlConnector",
        "kv_role": "kv_producer",
        "kv_buffer_device": "cpu",
        "kv_connector_extra_config": {"kv_lease_duration": 600, "num_threads": 2},
        "kv_load_failure_policy": "recompute",
    }
    assert kv_json(dec)["kv_role"] == "kv_consumer" and kv_json(dec)["kv_load_failure_policy"] == "recompute"
