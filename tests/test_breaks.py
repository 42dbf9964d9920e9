"""What a CI maintainer tried against today's KV integrity, lease drill and GPU sampling work and found
broken (docs/integrity.md): a damaged integrity that passed the gate, request ids whose whitespace hid
their digest lines, sweep values that crashed or said no allowed values."""

from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from _sweepfiles import sweep
from fixtures.make_runs import TR, case, pd, write_run
from test_kvdigest import read_one, wrapped

from pdsweep.cli import main
from pdsweep.core.errors import UserError
from pdsweep.core.kvintegrity import integrity_reasons
from pdsweep.core.kvlines import parse_landed, parse_writes
from pdsweep.core.stats import positive_t_interval
from pdsweep.engine import kvpushdigest
from pdsweep.engine.torchdigest import StorageMap, reference_digest
from pdsweep.judge import pareto
from pdsweep.judge.gate import FAIL, PASS, gate_run
from pdsweep.judge.pareto import Interval, Point, best
from pdsweep.judge.perf import NOISY, same_pair, verdict_of
from pdsweep.sweepfile.slo import parse_slo

REPO = Path(__file__).resolve().parents[1]
_KV = ["vllm", "serve", "m", "--kv-transfer-config", '{"kv_connector":"NixlConnector"}']
MATCHED = {"compared": 6, "matched": 6, "mismatched": 0, "missing": 0, "stale": 0, "first": {}}


def planned(**env: str) -> dict:
    """cell.json of a pull cell whose plan switched the digests on (``env``: more instance env)."""
    inst = [
        {"name": f"{r}-0", "role": r, "argv": _KV, "env": {"PDSWEEP_KV_DIGEST": "1", **env}}
        for r in ("prefill", "decode")
    ]
    return {"cell.json": {"instances": inst}}


@pytest.mark.parametrize(
    "counts",
    [{"compared": 0}, {"compared": 2}, {"compared": 9}],  # 6 matched: compared must be their sum
)
def test_counts_that_do_not_add_up_are_impossible(counts):
    reasons = integrity_reasons({**MATCHED, **counts}, "t")
    assert [r.split(" {")[0] for r in reasons] == ["t: integrity: impossible counts"]
    assert reasons[0].endswith("(allowed: whole numbers >= 0, compared = matched + mismatched + missing + stale)")


def gated(tmp_path: Path, name: str, integ: dict, **env: str):
    cell = pd("tiny-mla-mamba2", 2, 1)
    g = gate_run(write_run(tmp_path, name, [case(cell, planned(**env), {TR: {"integrity": integ}})])).cell(cell.id)
    return g.verdict, [r.split("transfer.json: ", 1)[-1] for r in g.reasons if "integrity" in r]


def test_a_pull_cells_integrity_in_push_shape_fails(tmp_path):
    assert gated(tmp_path, "ok", MATCHED) == (PASS, [])
    assert gated(tmp_path, "push", {**MATCHED, "mode": "push", "unwritten": 0}) == (
        FAIL,
        ['integrity: mode "push" in a pull cell (allowed: no mode; the plan launches NixlConnector)'],
    )


def test_requests_sampled_out_where_the_plan_digests_every_request_fail(tmp_path):
    cpu = {**MATCHED, "impl": ["sha256-64"], "sample": 0.01, "sampled_out": 190}
    assert gated(tmp_path, "cpu", cpu) == (
        FAIL,
        [
            "integrity: sample 0.01 with 190 request(s) sampled out, but the plan digests 1 of requests "
            "(cell.json PDSWEEP_KV_DIGEST_SAMPLE absent; allowed: sample 1, sampled_out 0)"
        ],
    )
    # a GPU cell sampled as planned passes; the file's own fraction never decides
    gpu = {**MATCHED, "sample": 0.25, "sampled_out": 30}
    assert gated(tmp_path, "gpu", gpu, PDSWEEP_KV_DIGEST_SAMPLE="0.25") == (PASS, [])
    verdict, reasons = gated(tmp_path, "gpu-low", {**gpu, "sample": 0.01}, PDSWEEP_KV_DIGEST_SAMPLE="0.25")
    assert verdict == FAIL and reasons[0].startswith(
        "integrity: sample 0.01 with 30 request(s) sampled out, but the plan"
    )
    # runs from before sampling carry neither field: every request, as planned
    assert gated(tmp_path, "old", MATCHED) == (PASS, [])


@pytest.mark.parametrize("req", ["cmpl\t7-0", "cmpl\xa07-0", "cmpl 7-0"])
def test_a_request_id_with_whitespace_keeps_its_landed_line(caplog, req):
    nixl = wrapped()
    text = read_one(nixl, bytearray(range(128)), caplog, notif=f"{req}:1".encode())
    assert [r["req"] for r in parse_landed(text)] == ["cmpl_7-0"]


def test_a_push_write_line_with_whitespace_in_its_request_ids_parses(monkeypatch):
    monkeypatch.setattr(kvpushdigest, "source_keys", lambda worker, blocks: ([], []))
    worker, rows = SimpleNamespace(engine_id="E", tp_rank=0), np.zeros((0, 3), dtype=np.uint64)
    line = kvpushdigest.write_line((worker, "cmpl\t7-0", "d\xa01", []), rows, rows, "agent-d")
    assert [(w["req"], w["dreq"]) for w in parse_writes(line)] == [("cmpl_7-0", "d_1")]


def test_a_null_nixl_extra_config_value_is_bad_input_not_a_traceback(tmp_path):
    with pytest.raises(
        UserError, match=r"kv_connector_extra_config.kv_lease_duration: null .*allowed: .*leave the key out"
    ):
        sweep(
            tmp_path,
            """serve_args:
  base: []
  x: {kv_transfer_extra: {kv_connector_extra_config: {kv_lease_duration: null}}}
matrix: {model: [tiny-llama], tp: [p1d1]}
""",
        )


@pytest.mark.parametrize(("value", "shown"), [("1e-3", "'1e-3'"), ("true", "True"), ('"0.5"', "'0.5'")])
def test_a_gpu_sample_that_is_no_number_names_the_allowed_values(tmp_path, capsys, value, shown):
    path = tmp_path / "s.yaml"
    path.write_text(
        f"name: s\nplatform: cuda\nmodels_file: {REPO / 'sweeps' / 'models.yaml'}\n"
        f"integrity: {{gpu: true, gpu_sample: {value}}}\nmatrix: {{model: [kimi-linear], tp: [p2d1]}}\n"
    )
    assert main(["validate", str(path), "--no-check-argv"]) == 2
    err = capsys.readouterr().err
    assert f"{path}:4: integrity.gpu_sample: {shown} is no number (allowed: 0 < gpu_sample <= 1" in err, err
    assert "Traceback" not in err


def test_a_gpu_flag_that_is_no_boolean_names_the_allowed_values(tmp_path, capsys):
    path = tmp_path / "s.yaml"
    path.write_text(
        f"name: s\nplatform: cuda\nmodels_file: {REPO / 'sweeps' / 'models.yaml'}\n"
        "integrity: {gpu: 1}\nmatrix: {model: [kimi-linear], tp: [p2d1]}\n"
    )
    assert main(["validate", str(path), "--no-check-argv"]) == 2
    assert f"{path}:4: integrity.gpu: 1 is no boolean (allowed: true, false)" in capsys.readouterr().err


def test_a_regions_torch_digest_is_its_own_whatever_is_batched_with_it_or_the_storage_size():
    """Prefill and decode batch different regions: an unaligned region of the same length beside it, or a
    storage whose size is no multiple of 4, turned a word-aligned region's digest into its bytewise one."""
    torch = pytest.importorskip("torch")
    want = reference_digest(bytes(range(8)))
    t = torch.arange(64, dtype=torch.uint8)
    assert StorageMap([t]).digest_many([(t.data_ptr(), 8), (t.data_ptr() + 2, 8)])[0] == want
    odd = torch.arange(63, dtype=torch.uint8)
    assert StorageMap([odd]).digest_many([(odd.data_ptr(), 8)]) == [want]


def test_a_pairing_with_a_side_missing_is_not_paired():
    """load.json ``pairing`` of one side damaged (``side`` gone): the front lines and perf verdicts took it for
    the ABBA pair (``side`` None != ``a``) and judged by the paired test."""
    assert same_pair({"id": "p1", "side": "a"}, {"id": "p1", "side": "b"})
    assert not same_pair({"id": "p1", "side": "a"}, {"id": "p1"})
    assert not same_pair({"id": "p1", "side": "a"}, {"id": "p1", "side": "c"})


def test_a_sweeps_env_cannot_switch_the_kv_digests_off(tmp_path):
    """``env: {x: {PDSWEEP_KV_DIGEST: "0"}}`` was kept by the plan (setdefault), so the CPU cell ran without
    digests and the gate's integrity check, which the plan's env switches on, asked nothing."""
    with pytest.raises(
        UserError, match=r"env.x.PDSWEEP_KV_DIGEST: PDSWEEP_KV_DIGEST is set by pdsweep .*use integrity.gpu"
    ):
        sweep(
            tmp_path,
            'env:\n  base: {}\n  x: {PDSWEEP_KV_DIGEST: "0"}\nmatrix: {model: [tiny-llama], tp: [p1d1], env: [x]}\n',
        )


def test_a_cpu_pd_cell_whose_cell_json_lost_the_digest_env_still_needs_integrity(tmp_path):
    """cell.json instances without PDSWEEP_KV_DIGEST (damaged) and transfer.json without integrity passed: the
    plan digests every PD cell on CPU, which the cell record (platform, kind) says too."""
    cell = pd("tiny-mla-mamba2", 2, 1, platform="cpu")
    bare = {
        "cell.json": {
            "instances": [{"name": f"{r}-0", "role": r, "argv": _KV, "env": {}} for r in ("prefill", "decode")]
        }
    }
    g = gate_run(write_run(tmp_path, "noenv", [case(cell, bare)])).cell(cell.id)
    assert (g.verdict, [r for r in g.reasons if "integrity" in r]) == (
        FAIL,
        [f"{cell.id}/transfer.json: integrity: not measured (integrity is null; the plan switched the KV digests on)"],
    )


def test_best_refuses_a_metric_twice_and_names_the_models_of_the_run(tmp_path, capsys):
    """``--slo ttft_p90=500,ttft_p90=1`` kept the last limit silently; ``--model nope`` said the run measured no
    bench phase although it had load points of other models."""
    with pytest.raises(UserError, match=r"--slo: ttft_p90 given twice \(500 and 1; allowed: one limit per metric\)"):
        parse_slo("ttft_p90=500,ttft_p90=1")
    pt = Point("c", "tiny-llama", "fixed", "p1d1 b32-32", 1, 2, Interval.of([10.0, 11.0]), None, {}, None, None)
    with pytest.raises(UserError, match=r"^--model nope: no load point of it \(allowed: tiny-llama\)$"):
        best([pt], {"ttft_p90": 500.0}, "nope")


def test_a_corrupt_1e308_throughput_is_no_traceback():
    """load.json ``output_tok_s`` 1e308 in one repeat: positive_t_interval's exp overflowed (best, report: exit 3)
    and the perf verdict divided by a 0 bound (compare: ZeroDivisionError)."""
    mean, lo, hi, scale = positive_t_interval([357.0, 1e308])
    assert (mean, lo, hi, scale) == (5e307, 0.0, math.inf, "log")
    assert verdict_of(1.0, 0.0, 2.0, 0.05, lower_better=False) == NOISY


def test_a_points_latency_is_unknown_when_a_repeat_lacks_it_or_is_negative():
    """One repeat's ttft_ms.p90 of -1 (or text) made the point's mean 65 ms (or the other repeat's alone) and so
    met ``--slo ttft_p90=100`` that the two real repeats (~111 ms) do not."""
    runs = [{"ttft_ms": {"p90": 131.7}}, {"ttft_ms": {"p90": 91.1}}]
    assert pareto._mean(runs, "ttft_p90") == pytest.approx(111.4)
    assert pareto._mean([runs[0], {"ttft_ms": {"p90": -1}}], "ttft_p90") is None
    assert pareto._mean([runs[0], {"ttft_ms": "x"}], "ttft_p90") is None
