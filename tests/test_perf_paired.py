"""Paired (interleaved) performance verdicts, the smallest detectable slowdown, engine CPU time
per request (pdsweep.core.stats, pdsweep.judge.perf, pdsweep.measure.repeats)."""

from __future__ import annotations

import math
import subprocess
import sys
import time

import pytest

from pdsweep.core.stats import detectable_slowdown, paired_ratio_interval
from pdsweep.judge.perf import NOISY, REGRESSION, SAME, judge_metric, paired_with, perf_deltas
from pdsweep.measure.repeats import engine_cpu_s, repeat_series
from pdsweep.sweepfile.sweep import GateSpec

# machine-load epochs: each pair of repeats shares one (x1 .. x3), as on a shared host
EPOCHS = [1.0, 2.6, 1.3, 0.8, 2.1, 1.6]
JITTER = [1.01, 0.99, 1.02, 0.98, 1.0, 1.01]


def _load(values: list[float], pairing: dict | None = None, cpu: list[float] | None = None) -> dict:
    body: dict = {
        "runs": [
            {"concurrency": 2, "num_prompts": 60, "ttft_ms": {"p50": v}, "repeat": i} for i, v in enumerate(values)
        ],
        "repeats": [{"repeat": i, "cpu": {"ms_per_request": c} if cpu else None} for i, c in enumerate(cpu or values)],
    }
    if pairing:
        body["pairing"] = pairing
    return body


def test_paired_interval_is_the_t_interval_of_log_ratios():
    a, b = [100.0, 200.0, 150.0], [110.0, 230.0, 160.0]
    ratio, lo, hi, method = paired_ratio_interval(a, b)
    d = [math.log(110 / 100), math.log(230 / 200), math.log(160 / 150)]
    mean = sum(d) / 3
    sd = math.sqrt(sum((x - mean) ** 2 for x in d) / 2)
    h = 4.302652729911275 * sd / math.sqrt(3)  # t(0.975, 2)
    assert method == "paired"
    assert ratio == pytest.approx(math.exp(mean))
    assert lo == pytest.approx(math.exp(mean - h)) and hi == pytest.approx(math.exp(mean + h))
    assert paired_ratio_interval([1.0, 2.0], [1.5, 3.0])[1:3] == (1.5, 1.5)  # no spread: exact
    assert paired_ratio_interval([1.0], [2.0]) == (2.0, None, None, "paired")
    with pytest.raises(ValueError, match="equal lengths"):
        paired_ratio_interval([1.0, 2.0], [1.0])


def test_load_epochs_shared_by_a_pair_cancel_when_paired_and_drown_the_unpaired_verdict():
    a = [100 * e * j for e, j in zip(EPOCHS, JITTER)]
    b = [125 * e / j for e, j in zip(EPOCHS, JITTER)]  # a 25 % slowdown under the same epochs
    paired = judge_metric("c2", "ttft_ms.p50", a, b, 0.10, paired=True)
    unpaired = judge_metric("c2", "ttft_ms.p50", a, b, 0.10)
    assert paired.method == "paired" and paired.verdict == REGRESSION and paired.lo > 1.1
    assert paired.ratio == pytest.approx(1.25, rel=0.02)
    assert unpaired.method == "welch" and unpaired.verdict == NOISY
    same = judge_metric("c2", "ttft_ms.p50", a, [100 * e / j for e, j in zip(EPOCHS, JITTER)], 0.10, paired=True)
    assert same.verdict == SAME  # one build against itself under the same epochs
    # the teeth of each: the paired interval detects 1.13x here, the unpaired one 1.95x
    assert paired.detectable == pytest.approx(1.1 * math.sqrt(paired.hi / paired.lo))
    assert paired.detectable == pytest.approx(1.1345, abs=1e-3) and unpaired.detectable == pytest.approx(
        1.951, abs=1e-3
    )


def test_detectable_slowdown_is_the_threshold_times_the_log_half_width():
    assert detectable_slowdown(0.8, 1.25, 0.10) == pytest.approx(1.1 * 1.25)  # h = log 1.25
    assert detectable_slowdown(1.0, 1.0, 0.05) == pytest.approx(1.05)
    assert detectable_slowdown(None, 2.0, 0.1) is None and detectable_slowdown(1.2, 1.1, 0.1) is None


def test_perf_deltas_pair_two_sides_of_one_interleaved_measurement_only():
    a = [100 * e * j for e, j in zip(EPOCHS, JITTER)]
    b = [125 * e / j for e, j in zip(EPOCHS, JITTER)]
    la, lb = _load(a, {"id": "x", "side": "a"}), _load(b, {"id": "x", "side": "b"})
    assert paired_with(la, lb) and not paired_with(la, _load(b, {"id": "y", "side": "b"}))
    assert not paired_with(la, _load(b)) and not paired_with(la, _load(b, {"id": "x", "side": "a"}))
    d = {x.name: x for x in perf_deltas(la, lb, GateSpec())}["c2 ttft_ms.p50"]
    assert (d.method, d.verdict) == ("paired", REGRESSION)
    d = {x.name: x for x in perf_deltas(_load(a), _load(b), GateSpec())}["c2 ttft_ms.p50"]
    assert (d.method, d.verdict) == ("welch", NOISY)


def test_engine_cpu_per_request_is_judged_only_when_gate_perf_names_it():
    la = _load([100.0] * 3, cpu=[10.0, 10.2, 9.9])
    lb = _load([100.0] * 3, cpu=[15.0, 15.1, 14.8])
    assert repeat_series(la)["cpu"]["engine_cpu_ms.per_request"] == [10.0, 10.2, 9.9]
    assert "cpu engine_cpu_ms.per_request" not in {d.name for d in perf_deltas(la, lb, GateSpec())}
    named = {d.name: d for d in perf_deltas(la, lb, GateSpec(perf={"engine_cpu_ms": 0.1}))}
    assert named["cpu engine_cpu_ms.per_request"].verdict == REGRESSION
    assert named["cpu engine_cpu_ms.per_request"].ratio == pytest.approx(44.9 / 30.1)


def test_engine_cpu_seconds_count_the_children_of_an_instance():
    burn = "import time\nt=time.process_time()\nwhile time.process_time()-t<0.6: pass\ntime.sleep(30)"
    parent = subprocess.Popen(
        [
            sys.executable,
            "-c",
            f"import subprocess,sys,time\nsubprocess.Popen([sys.executable,'-c',{burn!r}])\ntime.sleep(30)",
        ]
    )
    try:
        deadline = time.monotonic() + 20
        while (engine_cpu_s([parent.pid]) or 0) < 0.6 and time.monotonic() < deadline:
            time.sleep(0.2)
        used = engine_cpu_s([parent.pid])
        assert used is not None and used >= 0.6  # the child's busy loop, not the sleeping parent
    finally:
        import psutil

        for c in psutil.Process(parent.pid).children(recursive=True):
            c.kill()
        parent.kill()
        parent.wait()
    assert engine_cpu_s([parent.pid]) is None  # gone: unknown, never 0
