"""The lease-expiry drill (issue 38 shape 1): sweeps/drills.yaml's cell holds 1 in 4 decode legs
longer than prefill's 1 s KV lease, with 8 prefill KV blocks, and must fail naming
``notifications_after_expiry`` and the wrong answers (tests/test_drills_real.py runs it); at 18
blocks with 1 in 8 legs held (``-1-in-8``) it must fail on stale blocks (issue 58)."""

import json
import re
from dataclasses import replace
from pathlib import Path

import pytest

from pdsweep.core.errors import UserError
from pdsweep.core.faults import LEASE_EXPIRY, NO_PROXY_FAULTS, ProxyFaults, lease_drill_every, sweep_fault
from pdsweep.deploy.proxy import _Proxy
from pdsweep.plan.expand import expand
from pdsweep.plan.instance import Slot, instances
from pdsweep.run.drills import armed, lease_drill_faults, lease_s
from pdsweep.sweepfile.sweep import load_sweep

REPO = Path(__file__).resolve().parent.parent


def _drill():
    ls = load_sweep(REPO / "sweeps" / "drills.yaml")
    cells = [c for c in expand(ls).cells if lease_drill_every(c.fault)]
    # the 8-block drill (answers go wrong) and, since issue 58, 18 blocks with 1 in 8 legs held (stale bytes)
    assert sorted((c.serve_args, c.fault) for c in cells) == [
        ("short-lease", LEASE_EXPIRY),
        ("short-lease-18", f"{LEASE_EXPIRY}-1-in-8"),
    ]
    return ls, next(c for c in cells if c.serve_args == "short-lease")


def test_drill_cell_gets_a_short_lease_few_prefill_blocks_and_a_longer_decode_delay():
    ls, cell = _drill()
    assert cell.expect_fail and cell.kind == "pd"
    assert lease_s(cell, ls) == 1
    f = lease_drill_faults(cell, ls, NO_PROXY_FAULTS)
    assert (f.decode_delay_s, f.decode_delay_every) == (6.0, 4)  # lease 1 s + 5 s, 1 in 4 legs
    prefill, decode = instances(cell, Slot(0, (), 20000), ls, "/m", "python")
    kv = json.loads(prefill.argv[prefill.argv.index("--kv-transfer-config") + 1])
    assert kv["kv_connector_extra_config"] == {"kv_lease_duration": 1}
    assert prefill.argv[prefill.argv.index("--num-gpu-blocks-override") + 1] == "8"
    assert decode.argv[decode.argv.index("--num-gpu-blocks-override") + 1] != "8"
    # the declared failure names all three: the stale-read counter, the stale blocks and the wrong answers
    parts = [
        "c/transfer.json: totals.notifications_after_expiry = 3 (allowed: 0): ...",
        "c/transfer.json: integrity: 12 stale block(s) of 116; first: request cmpl-1 group 0:kv prefill rank 0 block 2",
        "c/load.json: load workload 'random' at concurrency 4: 2 of 16 answers differ from the reference",
    ]
    assert re.search(cell.expect_match, "\n".join(parts))
    for i in range(3):  # none of them alone, nor any two, is the drill
        assert not re.search(cell.expect_match, "\n".join(parts[:i] + parts[i + 1 :]))


def test_other_cells_keep_the_runs_faults_and_a_long_lease_is_refused():
    ls, cell = _drill()
    base = ProxyFaults(scramble_every=3)
    assert lease_drill_faults(replace(cell, fault="none"), ls, base) is base
    with pytest.raises(UserError, match=r"kv_lease_duration is 30 s .*allowed: 1\.\.10"):
        lease_drill_faults(replace(cell, serve_args="base"), ls, NO_PROXY_FAULTS)  # vLLM's default lease

    def on_phase(p: str) -> None:
        pass

    assert armed(LEASE_EXPIRY, [], on_phase) is on_phase  # nothing killed: the proxy injects it


def test_proxy_holds_one_in_k_decode_legs_from_the_first():
    urls = (["http://127.0.0.1:1"], ["http://127.0.0.1:2"], 5.0)
    p = _Proxy(*urls, faults=ProxyFaults(decode_delay_s=6.0, decode_delay_every=4)).inject
    assert p is not None
    assert [p.delays_decode() for _ in range(9)] == [True, False, False, False, True, False, False, False, True]
    every = _Proxy(*urls, faults=ProxyFaults(decode_delay_s=0.5)).inject
    assert every is not None
    assert [every.delays_decode() for _ in range(3)] == [True, True, True]  # the perf-teeth slowdown
    assert _Proxy(*urls).inject is None  # no fault on: the hot path does no fault work
    with pytest.raises(ValueError, match="decode_delay_every must be >= 1, got 0"):
        ProxyFaults(decode_delay_s=1.0, decode_delay_every=0)


def test_one_in_k_variant_holds_fewer_legs_and_must_name_a_stale_block():
    ls, short = _drill()
    names = (LEASE_EXPIRY, f"{LEASE_EXPIRY}-1-in-8", "none", f"{LEASE_EXPIRY}-1-in-1", f"{LEASE_EXPIRY}-1-in-100")
    assert [lease_drill_every(f) for f in names] == [4, 8, None, None, None]
    assert sweep_fault(f"{LEASE_EXPIRY}-1-in-99") is sweep_fault(LEASE_EXPIRY)
    with pytest.raises(
        ValueError, match=r"unknown fault 'decode-after-lease-expiry-1-in-1' \(allowed: .*expiry-1-in-K"
    ):
        sweep_fault(f"{LEASE_EXPIRY}-1-in-1")
    cell = next(c for c in expand(ls).cells if c.fault.endswith("-1-in-8"))
    f = lease_drill_faults(cell, ls, NO_PROXY_FAULTS)
    assert (f.decode_delay_s, f.decode_delay_every) == (6.0, 8)  # lease 1 s + 5 s, 1 in 8 legs
    stale = (
        "c/transfer.json: integrity: 9 stale block(s) of 116; first: request cmpl-1 group 0:kv prefill rank 0 block 2"
    )
    counter = "c/transfer.json: totals.notifications_after_expiry = 3 (allowed: 0): ..."
    assert re.search(cell.expect_match, f"{counter}\n{stale}")
    assert not re.search(cell.expect_match, counter)  # late reads alone are not this drill: the bytes must be stale
    assert not re.search(cell.expect_match, stale)
