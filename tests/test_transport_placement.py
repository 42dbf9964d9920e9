"""The transport gate takes its expectation per placement (issue 39): ``gate.transports`` on
one host, ``gate.transports_cross_host`` when prefill and decode run on different hosts
(cell.json instances' ``node`` and ``host``); a cross-host cell with no expectation for it
fails closed."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fixtures.make_runs import case, pd, write_run

from pdsweep.judge.gate import gate_run
from pdsweep.results import layout
from pdsweep.sweepfile.gatespec import GateSpec

CELL = pd("tiny-llama", 1, 1)
_KV = ["vllm", "serve", "m", "--kv-transfer-config"]  # a PD cell's cell.json records its launched argv
TWO = [
    {"name": "prefill-0", "role": "prefill", "node": "pdsweep-n1", "host": "10.231.39.11",
     "argv": [*_KV, '{"kv_connector":"NixlConnector","kv_role":"kv_producer"}']},
    {"name": "decode-0", "role": "decode", "node": "pdsweep-n2", "host": "10.231.39.12",
     "argv": [*_KV, '{"kv_connector":"NixlConnector","kv_role":"kv_consumer"}']},
]  # fmt: skip
# two slurmd on one machine (tests/_slurm.py): two nodes, one address
ONE = [{**i, "host": "127.0.0.1"} for i in TWO]


def _gated(tmp_path: Path, insts: list[dict[str, Any]], used: list[str], gate: GateSpec) -> Any:
    patch = {layout.TRANSFER_FILE: {"ucx_transports": used}, layout.CELL_FILE: {"instances": insts}}
    return gate_run(write_run(tmp_path, "t", [case(CELL, patch)]), gate).cell(CELL.id)


def test_cross_host_cell_is_judged_by_the_cross_host_expectation(tmp_path: Path) -> None:
    gate = GateSpec(transports=["cma"], transports_cross_host=["tcp"])
    assert _gated(tmp_path / "a", TWO, ["tcp/pdsw-n2"], gate).verdict == "PASS"
    assert _gated(tmp_path / "b", ONE, ["cma/memory"], gate).verdict == "PASS"
    r = _gated(tmp_path / "c", ONE, ["tcp/lo"], gate)  # one host: tcp is still the fallback
    assert r.verdict == "FAIL"
    assert (
        f"{CELL.id}/transfer.json: KV READ over UCX transport(s) tcp/lo (fell back to tcp); expected: cma" in r.reasons
    )
    r = _gated(tmp_path / "d", TWO, ["cma/memory"], gate)
    assert r.verdict == "FAIL"
    assert (
        f"{CELL.id}/transfer.json: KV READ over UCX transport(s) cma/memory; "
        "expected: tcp (across hosts 10.231.39.11, 10.231.39.12)" in r.reasons
    )


def test_cross_host_cell_without_an_expectation_fails_closed(tmp_path: Path) -> None:
    r = _gated(tmp_path / "a", TWO, ["tcp/pdsw-n2"], GateSpec(transports=["cma"]))
    assert r.verdict == "FAIL"
    assert (
        f"{CELL.id}/transfer.json: prefill and decode ran on different hosts (10.231.39.11, 10.231.39.12) and "
        "the sweep names no transport for that (gate.transports_cross_host, e.g. [tcp]); gate.transports (cma) "
        "is for one host" in r.reasons
    )
    # only a cross-host expectation: a one-host cell is not held to it
    assert _gated(tmp_path / "b", ONE, ["cma/memory"], GateSpec(transports_cross_host=["tcp"])).verdict == "PASS"
    r = _gated(tmp_path / "c", TWO, [], GateSpec(transports_cross_host=["tcp"]))
    assert r.verdict == "FAIL" and "the UCX READ transport is unknown (expected: tcp" in r.reasons[0]


def test_gpu_read_over_tcp_names_the_nvlink_cause_and_the_remedy(tmp_path: Path) -> None:
    """One host, GPU buffers: a READ that fell back to tcp names why (UCX turns cuda_ipc GET off
    without NVLink, seen on one H200) and the sweep's `ucx:` line that fixes it."""
    gate = GateSpec(transports=["cuda_ipc"], transports_cross_host=["rc"])
    r = _gated(tmp_path / "a", ONE, ["tcp/lo"], gate)
    assert r.verdict == "FAIL"
    assert (
        f"{CELL.id}/transfer.json: KV READ over UCX transport(s) tcp/lo (fell back to tcp) (UCX turns cuda_ipc "
        "GET off on GPUs without NVLink (cuda_ipc_iface.c uct_cuda_ipc_iface_get_max_get_zcopy); add "
        '`ucx: {UCX_CUDA_IPC_ENABLE_GET_ZCOPY: "y"}` to the sweep); expected: cuda_ipc' in r.reasons
    )
    assert _gated(tmp_path / "b", ONE, ["cuda_ipc/cuda"], gate).verdict == "PASS"
    assert _gated(tmp_path / "c", TWO, ["rc_mlx5/mlx5_0:1"], gate).verdict == "PASS"
    # a CPU sweep's tcp fallback has nothing to do with cuda_ipc: no such hint
    r = _gated(tmp_path / "d", ONE, ["tcp/lo"], GateSpec(transports=["cma"]))
    assert not any("NVLink" in x for x in r.reasons)


def test_the_mission_sweep_expects_cuda_ipc_on_one_node() -> None:
    """sweeps/hybrid-mla-mamba.yaml fails a cell whose KV went over tcp (fail closed); without it a
    PCIe node's 0.06-0.68 GB/s tcp READs passed every check."""
    from pdsweep.sweepfile.sweep import load_sweep

    gate = load_sweep(Path(__file__).resolve().parents[1] / "sweeps" / "hybrid-mla-mamba.yaml").sweep.gate
    assert gate.transports == ["cuda_ipc"] and gate.transports_cross_host == ["rc"]
