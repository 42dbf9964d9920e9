"""The statistics of the performance verdict on synthetic samples (scipy.stats), the
union-of-intervals KV GB/s on constructed overlapping READs, and the verdict rule."""

from __future__ import annotations

import random

import pytest

from pdsweep.core.logscan import nixl_read_records
from pdsweep.core.stats import mann_whitney_p, ratio_interval, t_interval, union_seconds
from pdsweep.judge.perf import IMPROVEMENT, NOISY, REGRESSION, SAME, judge_metric, verdict_of
from pdsweep.measure.kvtiming import read_stats


def test_t_interval_matches_the_student_t_formula() -> None:
    mean, lo, hi = t_interval([1.0, 2.0, 3.0], 0.95)
    # t_{0.975, 2} = 4.302653, sem = 1 / sqrt(3)
    assert mean == 2.0 and hi - mean == pytest.approx(4.302653 / 3**0.5, rel=1e-6) and lo == pytest.approx(4 - hi)
    assert t_interval([5.0]) == (5.0, None, None) and t_interval([]) == (None, None, None)
    assert t_interval([4.0, 4.0, 4.0]) == (4.0, 4.0, 4.0)


def test_ratio_interval_welch_and_bootstrap_cover_the_true_ratio() -> None:
    a, b = [10.0, 11.0, 9.0], [15.0, 16.5, 13.5]  # b = 1.5 a exactly
    ratio, lo, hi, method = ratio_interval(a, b)
    assert (ratio, method) == (1.5, "welch") and lo < 1.5 < hi and lo > 1.1 and hi < 2.0
    rng = random.Random(1)
    a = [rng.lognormvariate(0, 0.1) for _ in range(12)]
    b = [2 * rng.lognormvariate(0, 0.1) for _ in range(12)]
    ratio, lo, hi, method = ratio_interval(a, b)
    assert method == "bootstrap" and lo < 2 < hi and hi - lo < 0.5
    assert ratio_interval([1.0], [2.0])[1:3] == (None, None)  # one repeat a side: no interval
    assert ratio_interval([2.0, 2.0], [3.0, 3.0])[:3] == (1.5, 1.5, 1.5)  # no spread: exact
    with pytest.raises(ValueError, match="method must be"):
        ratio_interval(a, b, method="t")


def test_mann_whitney_exact_p() -> None:
    assert mann_whitney_p([1, 2, 3], [4, 5, 6]) == pytest.approx(0.1)  # exact: 2 / C(6, 3)
    assert mann_whitney_p([], [1.0]) is None


def test_union_of_overlapping_intervals_counts_overlap_once() -> None:
    assert union_seconds([(0, 1), (0.5, 2), (3, 4), (3.2, 3.5)]) == pytest.approx(3.0)
    assert union_seconds([]) == 0.0
    with pytest.raises(ValueError, match="ends before"):
        union_seconds([(2, 1)])


def _line(req: str, rank: int, nbytes: int, t0: float, xfer_us: int, t1: float | None = None) -> str:
    return (
        f"(Worker pid=1) INFO 12-01 10:00:00 [readlog.py:60] PDSWEEP_NIXL_READ remote_engine=e1 "
        f"remote_rank={rank} bytes={nbytes} descs=4 req={req} t0={t0:.6f} t1={(t1 or t0 + 1):.6f} xfer_us={xfer_us}\n"
    )


def test_union_gbps_of_four_reads_in_flight_is_four_times_vllms_sum_figure() -> None:
    # 4 READs of 1 GB each, all in flight over the same 1 s (2 requests x 2 prefill ranks),
    # plus a line of an older pdsweep without timing (left out)
    text = "".join(_line(f"r{i // 2}", i % 2, 10**9, 100.0, 1_000_000) for i in range(4))
    text += "PDSWEEP_NIXL_READ remote_engine=e1 remote_rank=0 bytes=5 descs=1\n"
    recs = nixl_read_records(text)
    assert len(recs) == 4 and recs[0]["end_s"] == pytest.approx(101.0)
    s = read_stats(recs)
    assert s["union_s"] == pytest.approx(1.0) and s["sum_s"] == pytest.approx(4.0)
    assert s["gbps_union"] == pytest.approx(4.0) and s["gbps_sum"] == pytest.approx(1.0)
    assert s["in_flight_mean"] == pytest.approx(4.0)
    assert (s["requests"], s["reads_per_request"], s["descriptors_per_request"]) == (2, 2.0, 8.0)
    assert s["xfer_ms_per_request"]["p50"] == pytest.approx(1000.0)
    assert s["by_prefill_rank"] == {
        "0": {
            "reads": 2,
            "bytes": 2 * 10**9,
            "descriptors": 8,
            "reads_per_request": 1.0,
            "descriptors_per_request": 4.0,
        },
        "1": {
            "reads": 2,
            "bytes": 2 * 10**9,
            "descriptors": 8,
            "reads_per_request": 1.0,
            "descriptors_per_request": 4.0,
        },
    }


def test_read_interval_falls_back_to_done_time_without_nixl_duration() -> None:
    (r,) = nixl_read_records(_line("x", 0, 8, 5.0, -1, t1=5.25))
    assert (r["start_s"], r["end_s"]) == (5.0, 5.25)


@pytest.mark.parametrize(
    ("ratio", "lo", "hi", "lower_better", "want"),
    [
        (1.30, 1.20, 1.40, True, REGRESSION),  # latency up, whole interval past 1.10
        (1.30, 1.05, 1.60, True, NOISY),  # straddles 1.10
        (1.02, 0.95, 1.08, True, SAME),  # inside [1/1.1, 1.1]
        (0.70, 0.60, 0.80, True, IMPROVEMENT),
        (0.70, 0.60, 0.80, False, REGRESSION),  # a rate down 30 %
        (1.02, None, None, True, NOISY),  # no interval
    ],
)
def test_verdict_rule(ratio: float, lo: float | None, hi: float | None, lower_better: bool, want: str) -> None:
    assert verdict_of(ratio, lo, hi, 0.10, lower_better) == want


def _draws(rng: random.Random, n: int, cv: float, scale: float = 1.0) -> list[float]:
    return [scale * rng.lognormvariate(0, cv) for _ in range(n)]


def test_false_alarms_and_teeth_on_synthetic_repeats() -> None:
    """3 repeats a side, 10 % run-to-run noise, threshold 10 %: pairs of one build raise (almost)
    no regression, a 50 % slowdown is a regression nearly always."""
    rng = random.Random(24)
    same = [judge_metric("c2", "ttft_ms.p50", _draws(rng, 3, 0.10), _draws(rng, 3, 0.10), 0.10) for _ in range(300)]
    alarms = sum(d.verdict == REGRESSION for d in same) / len(same)
    slow = [
        judge_metric("c2", "ttft_ms.p50", _draws(rng, 3, 0.10), _draws(rng, 3, 0.10, 1.5), 0.10) for _ in range(300)
    ]
    caught = sum(d.verdict == REGRESSION for d in slow) / len(slow)
    assert alarms <= 0.01, alarms
    assert caught >= 0.60, caught
    assert all(d.verdict != IMPROVEMENT for d in slow)
