"""Parsing vLLM /metrics text, deltas, Prometheus-style quantiles and the transfer.json
summary. Metric names and buckets as in vLLM nixl/stats.py and v1/metrics/loggers.py.
Expected numbers are worked out by hand in the comments."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from fastapi import FastAPI
from fastapi.responses import PlainTextResponse

from pdsweep.deploy.appserver import AppServer
from pdsweep.measure.metrics import (
    Histogram,
    Snapshot,
    cell_transfer,
    delta,
    histogram_quantile,
    merge,
    parse,
    role_of,
    scrape_sync,
    summarize_transfer,
)

FIXTURES = Path(__file__).parent / "fixtures" / "vllm_cpu"
INF = float("inf")

# --- a decode instance before and after a phase (prometheus_client text format) ----------

DECODE_BEFORE = """\
# HELP python_gc_objects_collected_total Objects collected during gc
# TYPE python_gc_objects_collected_total counter
python_gc_objects_collected_total{generation="0"} 9270.0
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 0.0
# HELP vllm:request_success_total Count of successfully processed requests.
# TYPE vllm:request_success_total counter
vllm:request_success_total{engine="0",finished_reason="stop",model_name="m"} 1.0
vllm:request_success_total{engine="0",finished_reason="length",model_name="m"} 1.0
vllm:request_success_total{engine="0",finished_reason="abort",model_name="m"} 0.0
# HELP vllm:request_success_created Count of successfully processed requests.
# TYPE vllm:request_success_created gauge
vllm:request_success_created{engine="0",finished_reason="stop",model_name="m"} 1.7645e+09
# HELP vllm:nixl_xfer_time_seconds Histogram of transfer duration for NIXL KV Cache transfers.
# TYPE vllm:nixl_xfer_time_seconds histogram
vllm:nixl_xfer_time_seconds_bucket{engine="0",le="0.005",model_name="m"} 1.0
vllm:nixl_xfer_time_seconds_bucket{engine="0",le="0.01",model_name="m"} 2.0
vllm:nixl_xfer_time_seconds_bucket{engine="0",le="0.025",model_name="m"} 2.0
vllm:nixl_xfer_time_seconds_bucket{engine="0",le="0.05",model_name="m"} 2.0
vllm:nixl_xfer_time_seconds_bucket{engine="0",le="0.075",model_name="m"} 2.0
vllm:nixl_xfer_time_seconds_bucket{engine="0",le="0.1",model_name="m"} 2.0
vllm:nixl_xfer_time_seconds_bucket{engine="0",le="0.2",model_name="m"} 2.0
vllm:nixl_xfer_time_seconds_bucket{engine="0",le="0.3",model_name="m"} 2.0
vllm:nixl_xfer_time_seconds_bucket{engine="0",le="0.5",model_name="m"} 2.0
vllm:nixl_xfer_time_seconds_bucket{engine="0",le="0.75",model_name="m"} 2.0
vllm:nixl_xfer_time_seconds_bucket{engine="0",le="1.0",model_name="m"} 2.0
vllm:nixl_xfer_time_seconds_bucket{engine="0",le="5.0",model_name="m"} 2.0
vllm:nixl_xfer_time_seconds_bucket{engine="0",le="+Inf",model_name="m"} 2.0
vllm:nixl_xfer_time_seconds_count{engine="0",model_name="m"} 2.0
vllm:nixl_xfer_time_seconds_sum{engine="0",model_name="m"} 0.012
# HELP vllm:nixl_xfer_time_seconds_created Histogram of transfer duration for NIXL KV Cache transfers.
# TYPE vllm:nixl_xfer_time_seconds_created gauge
vllm:nixl_xfer_time_seconds_created{engine="0",model_name="m"} 1.7645e+09
# HELP vllm:nixl_post_time_seconds Histogram of transfer post time for NIXL KV Cache transfers.
# TYPE vllm:nixl_post_time_seconds histogram
vllm:nixl_post_time_seconds_bucket{engine="0",le="0.001",model_name="m"} 2.0
vllm:nixl_post_time_seconds_bucket{engine="0",le="0.005",model_name="m"} 2.0
vllm:nixl_post_time_seconds_bucket{engine="0",le="+Inf",model_name="m"} 2.0
vllm:nixl_post_time_seconds_count{engine="0",model_name="m"} 2.0
vllm:nixl_post_time_seconds_sum{engine="0",model_name="m"} 0.001
# HELP vllm:nixl_bytes_transferred Histogram of bytes transferred per NIXL KV Cache transfers.
# TYPE vllm:nixl_bytes_transferred histogram
vllm:nixl_bytes_transferred_bucket{engine="0",le="2048.0",model_name="m"} 0.0
vllm:nixl_bytes_transferred_bucket{engine="0",le="8192.0",model_name="m"} 0.0
vllm:nixl_bytes_transferred_bucket{engine="0",le="32768.0",model_name="m"} 0.0
vllm:nixl_bytes_transferred_bucket{engine="0",le="131072.0",model_name="m"} 2.0
vllm:nixl_bytes_transferred_bucket{engine="0",le="524288.0",model_name="m"} 2.0
vllm:nixl_bytes_transferred_bucket{engine="0",le="2.097152e+06",model_name="m"} 2.0
vllm:nixl_bytes_transferred_bucket{engine="0",le="+Inf",model_name="m"} 2.0
vllm:nixl_bytes_transferred_count{engine="0",model_name="m"} 2.0
vllm:nixl_bytes_transferred_sum{engine="0",model_name="m"} 262144.0
# HELP vllm:nixl_num_descriptors Histogram of number of descriptors per NIXL  KV Cache transfers.
# TYPE vllm:nixl_num_descriptors histogram
vllm:nixl_num_descriptors_bucket{engine="0",le="10.0",model_name="m"} 0.0
vllm:nixl_num_descriptors_bucket{engine="0",le="75.0",model_name="m"} 2.0
vllm:nixl_num_descriptors_bucket{engine="0",le="+Inf",model_name="m"} 2.0
vllm:nixl_num_descriptors_count{engine="0",model_name="m"} 2.0
vllm:nixl_num_descriptors_sum{engine="0",model_name="m"} 128.0
# HELP vllm:nixl_num_failed_transfers_total Number of failed NIXL KV Cache transfers.
# TYPE vllm:nixl_num_failed_transfers_total counter
vllm:nixl_num_failed_transfers_total{engine="0",model_name="m"} 0.0
# HELP vllm:nixl_num_failed_notifications_total Number of failed NIXL KV Cache notifications.
# TYPE vllm:nixl_num_failed_notifications_total counter
vllm:nixl_num_failed_notifications_total{engine="0",model_name="m"} 0.0
# HELP vllm:nixl_num_kv_expired_reqs_total Number of requests that had their KV expire.
# TYPE vllm:nixl_num_kv_expired_reqs_total counter
vllm:nixl_num_kv_expired_reqs_total{engine="0",model_name="m"} 0.0
# HELP vllm:time_to_first_token_seconds Histogram of time to first token in seconds.
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.02",model_name="m"} 0.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.04",model_name="m"} 0.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.06",model_name="m"} 0.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.08",model_name="m"} 0.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.1",model_name="m"} 0.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.25",model_name="m"} 0.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.5",model_name="m"} 0.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="+Inf",model_name="m"} 0.0
vllm:time_to_first_token_seconds_count{engine="0",model_name="m"} 0.0
vllm:time_to_first_token_seconds_sum{engine="0",model_name="m"} 0.0
# HELP vllm:request_time_per_output_token_seconds Histogram of time_per_output_token_seconds per request.
# TYPE vllm:request_time_per_output_token_seconds histogram
vllm:request_time_per_output_token_seconds_bucket{engine="0",le="0.05",model_name="m"} 0.0
vllm:request_time_per_output_token_seconds_bucket{engine="0",le="+Inf",model_name="m"} 0.0
vllm:request_time_per_output_token_seconds_count{engine="0",model_name="m"} 0.0
vllm:request_time_per_output_token_seconds_sum{engine="0",model_name="m"} 0.0
# HELP vllm:e2e_request_latency_seconds Histogram of e2e request latency in seconds.
# TYPE vllm:e2e_request_latency_seconds histogram
vllm:e2e_request_latency_seconds_bucket{engine="0",le="0.5",model_name="m"} 0.0
vllm:e2e_request_latency_seconds_bucket{engine="0",le="+Inf",model_name="m"} 0.0
vllm:e2e_request_latency_seconds_count{engine="0",model_name="m"} 0.0
vllm:e2e_request_latency_seconds_sum{engine="0",model_name="m"} 0.0
"""

# 8 more transfers (xfer-time bucket deltas 0.01:2, 0.025:4, 0.05:2), 4 requests; ITL
# appears only now (counts from zero).
DECODE_AFTER = """\
# HELP python_gc_objects_collected_total Objects collected during gc
# TYPE python_gc_objects_collected_total counter
python_gc_objects_collected_total{generation="0"} 9391.0
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 1.0
# HELP vllm:request_success_total Count of successfully processed requests.
# TYPE vllm:request_success_total counter
vllm:request_success_total{engine="0",finished_reason="stop",model_name="m"} 3.0
vllm:request_success_total{engine="0",finished_reason="length",model_name="m"} 3.0
vllm:request_success_total{engine="0",finished_reason="abort",model_name="m"} 0.0
# HELP vllm:request_success_created Count of successfully processed requests.
# TYPE vllm:request_success_created gauge
vllm:request_success_created{engine="0",finished_reason="stop",model_name="m"} 1.7645e+09
# HELP vllm:nixl_xfer_time_seconds Histogram of transfer duration for NIXL KV Cache transfers.
# TYPE vllm:nixl_xfer_time_seconds histogram
vllm:nixl_xfer_time_seconds_bucket{engine="0",le="0.005",model_name="m"} 1.0
vllm:nixl_xfer_time_seconds_bucket{engine="0",le="0.01",model_name="m"} 4.0
vllm:nixl_xfer_time_seconds_bucket{engine="0",le="0.025",model_name="m"} 8.0
vllm:nixl_xfer_time_seconds_bucket{engine="0",le="0.05",model_name="m"} 10.0
vllm:nixl_xfer_time_seconds_bucket{engine="0",le="0.075",model_name="m"} 10.0
vllm:nixl_xfer_time_seconds_bucket{engine="0",le="0.1",model_name="m"} 10.0
vllm:nixl_xfer_time_seconds_bucket{engine="0",le="0.2",model_name="m"} 10.0
vllm:nixl_xfer_time_seconds_bucket{engine="0",le="0.3",model_name="m"} 10.0
vllm:nixl_xfer_time_seconds_bucket{engine="0",le="0.5",model_name="m"} 10.0
vllm:nixl_xfer_time_seconds_bucket{engine="0",le="0.75",model_name="m"} 10.0
vllm:nixl_xfer_time_seconds_bucket{engine="0",le="1.0",model_name="m"} 10.0
vllm:nixl_xfer_time_seconds_bucket{engine="0",le="5.0",model_name="m"} 10.0
vllm:nixl_xfer_time_seconds_bucket{engine="0",le="+Inf",model_name="m"} 10.0
vllm:nixl_xfer_time_seconds_count{engine="0",model_name="m"} 10.0
vllm:nixl_xfer_time_seconds_sum{engine="0",model_name="m"} 0.172
# HELP vllm:nixl_xfer_time_seconds_created Histogram of transfer duration for NIXL KV Cache transfers.
# TYPE vllm:nixl_xfer_time_seconds_created gauge
vllm:nixl_xfer_time_seconds_created{engine="0",model_name="m"} 1.7645e+09
# HELP vllm:nixl_post_time_seconds Histogram of transfer post time for NIXL KV Cache transfers.
# TYPE vllm:nixl_post_time_seconds histogram
vllm:nixl_post_time_seconds_bucket{engine="0",le="0.001",model_name="m"} 10.0
vllm:nixl_post_time_seconds_bucket{engine="0",le="0.005",model_name="m"} 10.0
vllm:nixl_post_time_seconds_bucket{engine="0",le="+Inf",model_name="m"} 10.0
vllm:nixl_post_time_seconds_count{engine="0",model_name="m"} 10.0
vllm:nixl_post_time_seconds_sum{engine="0",model_name="m"} 0.009
# HELP vllm:nixl_bytes_transferred Histogram of bytes transferred per NIXL KV Cache transfers.
# TYPE vllm:nixl_bytes_transferred histogram
vllm:nixl_bytes_transferred_bucket{engine="0",le="2048.0",model_name="m"} 0.0
vllm:nixl_bytes_transferred_bucket{engine="0",le="8192.0",model_name="m"} 0.0
vllm:nixl_bytes_transferred_bucket{engine="0",le="32768.0",model_name="m"} 0.0
vllm:nixl_bytes_transferred_bucket{engine="0",le="131072.0",model_name="m"} 10.0
vllm:nixl_bytes_transferred_bucket{engine="0",le="524288.0",model_name="m"} 10.0
vllm:nixl_bytes_transferred_bucket{engine="0",le="2.097152e+06",model_name="m"} 10.0
vllm:nixl_bytes_transferred_bucket{engine="0",le="+Inf",model_name="m"} 10.0
vllm:nixl_bytes_transferred_count{engine="0",model_name="m"} 10.0
vllm:nixl_bytes_transferred_sum{engine="0",model_name="m"} 1.31072e+06
# HELP vllm:nixl_num_descriptors Histogram of number of descriptors per NIXL  KV Cache transfers.
# TYPE vllm:nixl_num_descriptors histogram
vllm:nixl_num_descriptors_bucket{engine="0",le="10.0",model_name="m"} 0.0
vllm:nixl_num_descriptors_bucket{engine="0",le="75.0",model_name="m"} 10.0
vllm:nixl_num_descriptors_bucket{engine="0",le="+Inf",model_name="m"} 10.0
vllm:nixl_num_descriptors_count{engine="0",model_name="m"} 10.0
vllm:nixl_num_descriptors_sum{engine="0",model_name="m"} 640.0
# HELP vllm:nixl_num_failed_transfers_total Number of failed NIXL KV Cache transfers.
# TYPE vllm:nixl_num_failed_transfers_total counter
vllm:nixl_num_failed_transfers_total{engine="0",model_name="m"} 0.0
# HELP vllm:nixl_num_failed_notifications_total Number of failed NIXL KV Cache notifications.
# TYPE vllm:nixl_num_failed_notifications_total counter
vllm:nixl_num_failed_notifications_total{engine="0",model_name="m"} 1.0
# HELP vllm:nixl_num_kv_expired_reqs_total Number of requests that had their KV expire.
# TYPE vllm:nixl_num_kv_expired_reqs_total counter
vllm:nixl_num_kv_expired_reqs_total{engine="0",model_name="m"} 0.0
# HELP vllm:time_to_first_token_seconds Histogram of time to first token in seconds.
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.02",model_name="m"} 0.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.04",model_name="m"} 0.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.06",model_name="m"} 1.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.08",model_name="m"} 2.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.1",model_name="m"} 2.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.25",model_name="m"} 4.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.5",model_name="m"} 4.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="+Inf",model_name="m"} 4.0
vllm:time_to_first_token_seconds_count{engine="0",model_name="m"} 4.0
vllm:time_to_first_token_seconds_sum{engine="0",model_name="m"} 0.4
# HELP vllm:inter_token_latency_seconds Histogram of inter-token latency in seconds.
# TYPE vllm:inter_token_latency_seconds histogram
vllm:inter_token_latency_seconds_bucket{engine="0",le="0.025",model_name="m"} 60.0
vllm:inter_token_latency_seconds_bucket{engine="0",le="+Inf",model_name="m"} 60.0
vllm:inter_token_latency_seconds_count{engine="0",model_name="m"} 60.0
vllm:inter_token_latency_seconds_sum{engine="0",model_name="m"} 1.2
# HELP vllm:request_time_per_output_token_seconds Histogram of time_per_output_token_seconds per request.
# TYPE vllm:request_time_per_output_token_seconds histogram
vllm:request_time_per_output_token_seconds_bucket{engine="0",le="0.05",model_name="m"} 4.0
vllm:request_time_per_output_token_seconds_bucket{engine="0",le="+Inf",model_name="m"} 4.0
vllm:request_time_per_output_token_seconds_count{engine="0",model_name="m"} 4.0
vllm:request_time_per_output_token_seconds_sum{engine="0",model_name="m"} 0.2
# HELP vllm:e2e_request_latency_seconds Histogram of e2e request latency in seconds.
# TYPE vllm:e2e_request_latency_seconds histogram
vllm:e2e_request_latency_seconds_bucket{engine="0",le="0.5",model_name="m"} 4.0
vllm:e2e_request_latency_seconds_bucket{engine="0",le="+Inf",model_name="m"} 4.0
vllm:e2e_request_latency_seconds_count{engine="0",model_name="m"} 4.0
vllm:e2e_request_latency_seconds_sum{engine="0",model_name="m"} 2.0
"""

# A prefill instance: one expired request; its own TTFT (prefill time) must not leak into
# the cell's latency figures.
PREFILL_BEFORE = """\
# TYPE vllm:nixl_num_notifications_after_expiry_total counter
vllm:nixl_num_notifications_after_expiry_total{engine="0",model_name="m"} 0.0
# TYPE vllm:nixl_num_kv_expired_reqs_total counter
vllm:nixl_num_kv_expired_reqs_total{engine="0",model_name="m"} 0.0
# TYPE vllm:nixl_num_failed_transfers_total counter
vllm:nixl_num_failed_transfers_total{engine="0",model_name="m"} 0.0
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.5",model_name="m"} 0.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="+Inf",model_name="m"} 0.0
vllm:time_to_first_token_seconds_count{engine="0",model_name="m"} 0.0
vllm:time_to_first_token_seconds_sum{engine="0",model_name="m"} 0.0
"""
PREFILL_AFTER = """\
# TYPE vllm:nixl_num_notifications_after_expiry_total counter
vllm:nixl_num_notifications_after_expiry_total{engine="0",model_name="m"} 3.0
# TYPE vllm:nixl_num_kv_expired_reqs_total counter
vllm:nixl_num_kv_expired_reqs_total{engine="0",model_name="m"} 1.0
# TYPE vllm:nixl_num_failed_transfers_total counter
vllm:nixl_num_failed_transfers_total{engine="0",model_name="m"} 0.0
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.5",model_name="m"} 0.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="+Inf",model_name="m"} 4.0
vllm:time_to_first_token_seconds_count{engine="0",model_name="m"} 4.0
vllm:time_to_first_token_seconds_sum{engine="0",model_name="m"} 40.0
"""

T_KEYS = [
    "num_transfers",
    "bytes",
    "xfer_time_s",
    "post_time_s",
    "gbps_xfer",
    "gbps_wall",
    "xfer_time_p50_s",
    "xfer_time_p90_s",
    "xfer_time_p99_s",
    "descriptors_per_transfer",
    "failed_transfers",
    "failed_notifications",
    "expired_reqs",
    "notifications_after_expiry",
    "kv_requests",
    "ttft_mean_s",
    "ttft_p50_s",
    "ttft_p99_s",
    "tpot_mean_s",
    "itl_mean_s",
    "e2e_mean_s",
    "num_requests",
]

# Hand-computed totals of (DECODE_AFTER - DECODE_BEFORE) + (PREFILL_AFTER - PREFILL_BEFORE), wall 2 s.
EXPECTED_T = {
    "num_transfers": 8,
    "bytes": 1048576,  # 1310720 - 262144 = 8 x 128 KiB
    "xfer_time_s": 0.16,  # 0.172 - 0.012
    "post_time_s": 0.008,
    "gbps_xfer": 1048576 / 0.16 / 1e9,  # 0.0065536
    "gbps_wall": 1048576 / 2.0 / 1e9,  # 0.000524288
    # xfer deltas (cumulative): 0.005:0, 0.01:2, 0.025:6, 0.05:8, ..., +Inf:8
    "xfer_time_p50_s": 0.0175,  # rank 4 in (0.01, 0.025]: 0.01 + 0.015 * (4-2)/4
    "xfer_time_p90_s": 0.04,  # rank 7.2 in (0.025, 0.05]: 0.025 + 0.025 * (7.2-6)/2
    "xfer_time_p99_s": 0.049,  # rank 7.92: 0.025 + 0.025 * 1.92/2
    "descriptors_per_transfer": 64.0,  # 512 / 8
    "failed_transfers": 0,
    "failed_notifications": 1,
    "expired_reqs": 1,  # from prefill
    "notifications_after_expiry": 3,  # from prefill: decode's READs notified after the lease expired
    "kv_requests": None,  # no proxy instance in these deltas: missing, never 0
    "ttft_mean_s": 0.1,  # decode only: 0.4 / 4 (prefill's 40 s / 4 excluded)
    "ttft_p50_s": 0.08,  # rank 2 in (0.06, 0.08]: 0.06 + 0.02 * 1/1
    "ttft_p99_s": 0.247,  # rank 3.96 in (0.1, 0.25]: 0.1 + 0.15 * 1.96/2
    "tpot_mean_s": 0.05,
    "itl_mean_s": 0.02,  # 1.2 / 60, ITL absent before: counts from zero
    "e2e_mean_s": 0.5,
    "num_requests": 4,
}


def _approx_equal(got: dict, want: dict) -> None:
    assert list(got) == list(want)
    for k, v in want.items():
        if v is None or isinstance(v, bool):
            assert got[k] is v, k
        else:
            assert got[k] == pytest.approx(v, rel=1e-9, abs=1e-12), k


# --- parse ------------------------------------------------------------------------------


def test_parse_keys_counters_without_total_and_keeps_colon_names() -> None:
    s = parse(DECODE_AFTER)
    assert s.counters["vllm:nixl_num_failed_notifications"] == 1.0
    assert "vllm:nixl_num_failed_notifications_total" not in s.counters
    assert s.counters["vllm:request_success"] == 6.0  # summed over finished_reason
    assert s.counters["python_gc_objects_collected"] == 9391.0
    assert s.gauges == {"vllm:num_requests_running": 1.0}  # *_created timestamps are not gauges
    assert s.labels == {"model_name": frozenset({"m"}), "engine": frozenset({"0"})}
    h = s.histograms["vllm:nixl_xfer_time_seconds"]
    assert h.count == 10 and h.sum == pytest.approx(0.172)
    assert h.bounds() == (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 5.0, INF)
    assert s.histograms["vllm:nixl_bytes_transferred"].bounds()[5] == 2097152.0


def test_parse_sums_label_sets_per_engine() -> None:
    text = """\
# TYPE vllm:nixl_num_failed_transfers_total counter
vllm:nixl_num_failed_transfers_total{engine="0",model_name="m"} 2.0
vllm:nixl_num_failed_transfers_total{engine="1",model_name="m"} 3.0
# TYPE vllm:nixl_xfer_time_seconds histogram
vllm:nixl_xfer_time_seconds_bucket{engine="0",le="0.01",model_name="m"} 1.0
vllm:nixl_xfer_time_seconds_bucket{engine="0",le="+Inf",model_name="m"} 2.0
vllm:nixl_xfer_time_seconds_count{engine="0",model_name="m"} 2.0
vllm:nixl_xfer_time_seconds_sum{engine="0",model_name="m"} 0.5
vllm:nixl_xfer_time_seconds_bucket{engine="1",le="0.01",model_name="m"} 3.0
vllm:nixl_xfer_time_seconds_bucket{engine="1",le="+Inf",model_name="m"} 3.0
vllm:nixl_xfer_time_seconds_count{engine="1",model_name="m"} 3.0
vllm:nixl_xfer_time_seconds_sum{engine="1",model_name="m"} 0.01
"""
    s = parse(text)
    assert s.counters == {"vllm:nixl_num_failed_transfers": 5.0}
    assert s.histograms["vllm:nixl_xfer_time_seconds"] == Histogram(((0.01, 4.0), (INF, 5.0)), 0.51, 5.0)
    assert s.labels["engine"] == frozenset({"0", "1"})


def test_parse_rejects_label_sets_with_different_buckets() -> None:
    text = """\
# TYPE h histogram
h_bucket{engine="0",le="1.0"} 1.0
h_bucket{engine="0",le="+Inf"} 1.0
h_count{engine="0"} 1.0
h_sum{engine="0"} 1.0
h_bucket{engine="1",le="2.0"} 1.0
h_bucket{engine="1",le="+Inf"} 1.0
h_count{engine="1"} 1.0
h_sum{engine="1"} 1.0
"""
    with pytest.raises(ValueError, match="bucket bounds differ"):
        parse(text)


def test_parse_empty_text() -> None:
    assert parse("") == Snapshot()


# --- delta ------------------------------------------------------------------------------


def test_delta_of_counters_and_histograms() -> None:
    d = delta(parse(DECODE_BEFORE), parse(DECODE_AFTER))
    assert d.counters["vllm:request_success"] == 4.0
    assert d.counters["vllm:nixl_num_failed_transfers"] == 0.0
    h = d.histograms["vllm:nixl_xfer_time_seconds"]
    assert h.count == 8 and h.sum == pytest.approx(0.16)
    assert [c for _, c in h.buckets] == [0, 2, 6, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8]
    assert d.gauges == {"vllm:num_requests_running": 1.0}  # gauges: the after value


def test_delta_metric_new_after_counts_from_zero() -> None:
    before, after = parse(DECODE_BEFORE), parse(DECODE_AFTER)
    assert "vllm:inter_token_latency_seconds" not in before.histograms
    d = delta(before, after)
    assert d.histograms["vllm:inter_token_latency_seconds"] == after.histograms["vllm:inter_token_latency_seconds"]
    d = delta(Snapshot(), after)
    assert d.counters == after.counters and d.histograms == after.histograms


RESTARTED = DECODE_AFTER.replace(
    'finished_reason="stop",model_name="m"} 3.0', 'finished_reason="stop",model_name="m"} 0.0'
)  # 6 -> 3 successes


def test_delta_counter_reset_raises() -> None:
    with pytest.raises(ValueError, match="counter reset: vllm:request_success went from 6.0 to 3.0"):
        delta(parse(DECODE_AFTER), parse(RESTARTED))


def test_delta_histogram_reset_raises() -> None:
    h1 = Histogram(((0.1, 5.0), (INF, 5.0)), 0.3, 5.0)
    h0 = Histogram(((0.1, 1.0), (INF, 1.0)), 0.01, 1.0)
    with pytest.raises(ValueError, match="counter reset: histogram x"):
        delta(Snapshot(histograms={"x": h1}), Snapshot(histograms={"x": h0}))


def test_delta_metric_gone_raises() -> None:
    with pytest.raises(ValueError, match="gone between scrapes"):
        delta(Snapshot(counters={"c": 1.0}), Snapshot())


# --- histogram_quantile -----------------------------------------------------------------

BUCKETS = [(0.1, 2.0), (0.5, 6.0), (1.0, 10.0), (INF, 10.0)]  # 2 in [0, .1], 4 in (.1, .5], 4 in (.5, 1]


@pytest.mark.parametrize(
    ("q", "want"),
    [
        (0.1, 0.05),  # rank 1 of 2 in [0, 0.1]
        (0.2, 0.1),  # rank 2: top of the first bucket
        (0.5, 0.4),  # rank 5: 0.1 + 0.4 * (5-2)/4
        (0.9, 0.875),  # rank 9: 0.5 + 0.5 * (9-6)/4
        (1.0, 1.0),
        (0.0, 0.0),
    ],
)
def test_quantile_interpolates_within_bucket(q: float, want: float) -> None:
    assert histogram_quantile(q, BUCKETS) == pytest.approx(want)


def test_quantile_skips_empty_buckets_and_caps_at_highest_finite_bound() -> None:
    buckets = [(0.001, 0.0), (0.005, 0.0), (0.01, 4.0), (0.025, 4.0), (5.0, 4.0), (INF, 8.0)]
    assert histogram_quantile(0.25, buckets) == pytest.approx(0.0075)  # rank 2 of 4 in (0.005, 0.01]
    assert histogram_quantile(0.99, buckets) == 5.0  # rank in +Inf bucket -> highest finite bound
    # unsorted input and a Histogram work the same
    assert histogram_quantile(0.5, list(reversed(BUCKETS))) == pytest.approx(0.4)
    assert histogram_quantile(0.5, Histogram(tuple(BUCKETS), 4.0, 10.0)) == pytest.approx(0.4)


def test_quantile_of_empty_histogram_is_none() -> None:
    assert histogram_quantile(0.5, [(0.1, 0.0), (1.0, 0.0), (INF, 0.0)]) is None
    assert histogram_quantile(0.5, [(INF, 3.0)]) is None  # no finite bucket to interpolate in


def test_quantile_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        histogram_quantile(1.5, BUCKETS)
    with pytest.raises(ValueError, match="Inf"):
        histogram_quantile(0.5, [(0.1, 1.0), (1.0, 2.0)])


# --- summarize_transfer / cell_transfer ----------------------------------------------------------


def _deltas() -> dict[str, Snapshot]:
    return {
        "prefill-0": delta(parse(PREFILL_BEFORE), parse(PREFILL_AFTER)),
        "decode-0": delta(parse(DECODE_BEFORE), parse(DECODE_AFTER)),
    }


def test_summarize_pd_phase_by_hand() -> None:
    t = summarize_transfer(_deltas(), wall_s=2.0)
    assert list(t) == T_KEYS
    _approx_equal(t, EXPECTED_T)
    assert isinstance(t["num_transfers"], int) and isinstance(t["bytes"], int)


def _hist(count: float, total: float) -> Histogram:
    return Histogram(((1.0, count), (INF, count)), total, count)


def test_gbps_arithmetic() -> None:
    d = Snapshot(
        histograms={"vllm:nixl_bytes_transferred": _hist(4, 1e9), "vllm:nixl_xfer_time_seconds": _hist(4, 0.5)}
    )
    t = summarize_transfer({"decode-0": d}, wall_s=4.0)
    assert t["gbps_xfer"] == pytest.approx(2.0)  # 1e9 B / 0.5 s
    assert t["gbps_wall"] == pytest.approx(0.25)  # 1e9 B / 4 s
    assert t["bytes"] == 1_000_000_000 and t["num_transfers"] == 4
    # two decode instances add up
    t2 = summarize_transfer({"decode-0": d, "decode-1": d}, wall_s=4.0)
    assert (t2["bytes"], t2["num_transfers"], t2["gbps_xfer"], t2["gbps_wall"]) == (2e9, 8, 2.0, 0.5)


def test_missing_metrics_are_none_never_zero() -> None:
    t = summarize_transfer({"decode-0": Snapshot()}, wall_s=1.0)
    assert all(v is None for v in t.values()), t
    t = summarize_transfer({}, wall_s=1.0)
    assert all(v is None for v in t.values())


def test_zero_transfers_give_none_ratios_and_zero_counts() -> None:
    zero = Histogram(((0.005, 0.0), (INF, 0.0)), 0.0, 0.0)
    names = [
        "vllm:nixl_xfer_time_seconds",
        "vllm:nixl_post_time_seconds",
        "vllm:nixl_bytes_transferred",
        "vllm:nixl_num_descriptors",
        "vllm:time_to_first_token_seconds",
    ]
    d = Snapshot(histograms={n: zero for n in names}, counters={"vllm:nixl_num_failed_transfers": 0.0})
    t = summarize_transfer({"decode-0": d}, wall_s=1.0)
    assert (t["num_transfers"], t["bytes"], t["failed_transfers"]) == (0, 0, 0)
    for k in (
        "gbps_xfer",
        "xfer_time_p50_s",
        "xfer_time_p99_s",
        "descriptors_per_transfer",
        "ttft_mean_s",
        "ttft_p50_s",
        "failed_notifications",
        "expired_reqs",
        "num_requests",
    ):
        assert t[k] is None, k
    assert t["gbps_wall"] == 0.0  # 0 bytes over a real wall time is a measured zero


def test_nixl_from_decode_latency_from_decode_or_single() -> None:
    busy = Snapshot(
        histograms={"vllm:nixl_xfer_time_seconds": _hist(3, 0.3), "vllm:e2e_request_latency_seconds": _hist(2, 4.0)},
        counters={"vllm:nixl_num_failed_transfers": 2.0},
    )
    t = summarize_transfer({"prefill-0": busy}, wall_s=1.0)
    assert t["num_transfers"] is None and t["e2e_mean_s"] is None
    assert t["failed_transfers"] == 2  # failures count wherever they happen
    t = summarize_transfer({"single-0": busy}, wall_s=1.0)
    assert t["num_transfers"] is None and t["e2e_mean_s"] == 2.0 and t["num_requests"] == 2


def test_unknown_instance_prefix_raises() -> None:
    assert role_of("decode-3") == "decode"
    with pytest.raises(ValueError, match="must start with"):
        summarize_transfer({"worker-0": Snapshot()}, 1.0)


def test_cell_transfer_phases_and_totals() -> None:
    pb, pa = parse(PREFILL_BEFORE), parse(PREFILL_AFTER)
    db, da = parse(DECODE_BEFORE), parse(DECODE_AFTER)
    phases = {
        "eval": {"prefill-0": (pb, pa, 1.9), "decode-0": (db, da, 2.0)},
        "load": {"prefill-0": (pa, pa, 3.0), "decode-0": (da, da, 3.0)},  # nothing happened
    }
    out = cell_transfer(phases)
    assert set(out) == {"phases", "totals"}
    ev = out["phases"]["eval"]
    assert ev["wall_s"] == 2.0
    _approx_equal(ev["totals"], EXPECTED_T)
    assert set(ev["instances"]) == {"prefill-0", "decode-0"}
    assert ev["instances"]["decode-0"]["role"] == "decode"
    assert ev["instances"]["decode-0"]["num_transfers"] == 8
    assert ev["instances"]["prefill-0"]["ttft_mean_s"] == pytest.approx(10.0)  # its own prefill time
    assert ev["instances"]["prefill-0"]["expired_reqs"] == 1
    ld = out["phases"]["load"]["totals"]
    assert ld["num_transfers"] == 0 and ld["gbps_xfer"] is None and ld["itl_mean_s"] is None
    tot = out["totals"]
    assert list(tot) == T_KEYS
    assert tot["num_transfers"] == 8 and tot["bytes"] == 1048576 and tot["expired_reqs"] == 1
    assert tot["gbps_wall"] == pytest.approx(1048576 / 5.0 / 1e9)  # walls add up: 2 + 3 s
    assert tot["xfer_time_p50_s"] == pytest.approx(0.0175)


def test_cell_transfer_propagates_counter_reset() -> None:
    with pytest.raises(ValueError, match="counter reset"):
        cell_transfer({"eval": {"decode-0": (parse(DECODE_AFTER), parse(RESTARTED), 1.0)}})


def test_merge_adds_phases() -> None:
    d = delta(parse(DECODE_BEFORE), parse(DECODE_AFTER))
    m = merge([d, d])
    assert m.histograms["vllm:nixl_xfer_time_seconds"].count == 16
    assert m.counters["vllm:request_success"] == 8.0


# --- scraping ---------------------------------------------------------------------------


def test_scrape_base_or_metrics_url() -> None:
    app = FastAPI()

    @app.get("/metrics")
    def metrics() -> PlainTextResponse:
        return PlainTextResponse(DECODE_AFTER)

    with AppServer(app) as srv:
        assert scrape_sync(srv.url) == DECODE_AFTER
        assert scrape_sync(srv.url + "/metrics") == DECODE_AFTER
        assert scrape_sync(srv.url + "/") == DECODE_AFTER
        with pytest.raises(httpx.HTTPStatusError):
            scrape_sync(srv.url + "/nope")


# --- real captures from a vllm-cpu 0.32.0 PD run ----------------------------------------
# Deliberately no skip: a missing capture fails here, so it cannot go unnoticed.

NIXL_HISTOGRAMS = [
    "vllm:nixl_xfer_time_seconds",
    "vllm:nixl_post_time_seconds",
    "vllm:nixl_bytes_transferred",
    "vllm:nixl_num_descriptors",
]
LATENCY_HISTOGRAMS = [
    "vllm:time_to_first_token_seconds",
    "vllm:request_time_per_output_token_seconds",
    "vllm:inter_token_latency_seconds",
    "vllm:e2e_request_latency_seconds",
]
NIXL_COUNTERS = [
    "vllm:nixl_num_failed_transfers",
    "vllm:nixl_num_failed_notifications",
    "vllm:nixl_num_kv_expired_reqs",
]


def _capture(name: str) -> str:
    path = FIXTURES / name
    assert path.is_file(), f"missing real vLLM capture {path} (from a vllm-cpu PD run)"
    return path.read_text()


def test_real_decode_capture_has_nixl_and_latency_histograms() -> None:
    snap = parse(_capture("decode.metrics.txt"))
    for name in NIXL_HISTOGRAMS + LATENCY_HISTOGRAMS:
        assert name in snap.histograms, f"{name} not in decode capture"
        assert snap.histograms[name].count > 0, f"{name} has count 0 on decode"
    for name in NIXL_COUNTERS:
        assert name in snap.counters, f"{name} not in decode capture"
    assert snap.labels.get("model_name") and snap.labels.get("engine")


def test_real_capture_summary_has_no_nulls() -> None:
    deltas = {
        "prefill-0": delta(Snapshot(), parse(_capture("prefill.metrics.txt"))),
        "decode-0": delta(Snapshot(), parse(_capture("decode.metrics.txt"))),
    }
    t = summarize_transfer(deltas, wall_s=1.0)
    assert [k for k, v in t.items() if v is None] == ["kv_requests"]  # counted by pdsweep's proxy, not vLLM
    assert t["num_transfers"] > 0 and t["bytes"] > 0 and t["gbps_xfer"] > 0
    assert t["failed_transfers"] == 0 and t["failed_notifications"] == 0


def test_ucx_transports_from_decode_logs(tmp_path):
    from pdsweep.measure.metrics import ucx_transports_from_logs

    table = """[1.1] [vm:1 :0]   | remote memory read by ucp_get*(multi) into host memory from host |
[1.1] [vm:1 :0]   +--------+-------------+------------+
[1.1] [vm:1 :0]   | 0..inf | zero-copy   | cma/memory |
[1.1] [vm:1 :0]   +--------+-------------+------------+
"""
    (tmp_path / "decode-0.log").write_text("INFO starting\n" + table)
    (tmp_path / "decode-1.log").write_text("no table here\n")
    assert ucx_transports_from_logs([tmp_path / "decode-0.log", tmp_path / "decode-1.log"]) == ["cma/memory"]
    assert ucx_transports_from_logs([tmp_path / "decode-1.log", tmp_path / "absent.log"]) is None


def test_proxy_kv_requests_counted_from_the_proxy_instance() -> None:
    text = (
        "# HELP pdsweep_proxy_kv_requests_total x\n# TYPE pdsweep_proxy_kv_requests_total counter\n"
        'pdsweep_proxy_kv_requests_total{endpoint="/v1/completions"} 5.0\n'
        'pdsweep_proxy_kv_requests_total{endpoint="/v1/chat/completions"} 2.0\n'
    )
    before = parse(text.replace("5.0", "1.0").replace("2.0", "0.0"))
    t = summarize_transfer({**_deltas(), "proxy": delta(before, parse(text))}, wall_s=2.0)
    assert t["kv_requests"] == 6 and t["num_transfers"] == 8  # proxy metrics never leak into NIXL figures
