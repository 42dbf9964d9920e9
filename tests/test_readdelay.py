"""The test-only KV-transfer slowdown (``PDSWEEP_READ_DELAY_MS``, pdsweep.engine.readdelay): a
READ posted late by a known delay, inside the interval the READ log times, switched per READ
through a file, with the bytes vLLM records unchanged."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from pdsweep.core.faults import ENGINE_OPTIONS, READ_DELAY_ENV_VAR
from pdsweep.core.logscan import nixl_read_records
from pdsweep.engine import readlog
from pdsweep.engine.readdelay import read_delay, wait
from pdsweep.engine.readlog import wrap_read_blocks, wrap_telemetry, wrap_transfer
from pdsweep.measure.kvtiming import read_stats

PREP_S = 0.005  # vLLM's _read_blocks preparing descriptors before it posts
POST_S = 0.010  # NIXL's transfer() blocking until the READ is done (seen on 2 cores: 2-5 ms)
XFER_US = int(POST_S * 1e6)  # NIXL's xferDuration of every fake READ: from the post, done as it returns


def _reads(delay, n: int, caplog) -> tuple[list[dict], list[float]]:
    """``n`` fake READs through the READ log's wrappers (one request each); the records parsed
    back from the log and each fake post's monotonic time minus the wrapper's t0."""
    posts: list[float] = []

    def nixl_transfer(self, handle):
        time.sleep(POST_S)
        return "PROC"

    transfer = wrap_transfer(nixl_transfer, readlog._POST_AT)

    def read_blocks(self, *, read_spec, request_id, dst_engine_id, **_):  # vLLM's: prepares and posts
        time.sleep(PREP_S)
        posts.append(time.monotonic())
        self._recving_transfers.setdefault(request_id, []).append(len(posts))
        transfer(None, len(posts))
        return True

    def telemetry(self, handle):
        return SimpleNamespace(totalBytes=4096, descCount=2, xferDuration=XFER_US)

    posted: dict = {}
    rb, tel = wrap_read_blocks(read_blocks, posted, delay), wrap_telemetry(telemetry, posted)
    worker = SimpleNamespace(_recving_transfers={})
    t0s = []
    with caplog.at_level(logging.INFO, logger="vllm.pdsweep.engine.readlog"):
        for i in range(n):
            assert rb(worker, read_spec=SimpleNamespace(remote_rank=0), request_id=f"r{i}", dst_engine_id="e") is True
            t0s.append(posted[i + 1][3])
            assert tel(None, i + 1).totalBytes == 4096  # what vLLM records is unchanged
    recs = nixl_read_records(caplog.text)
    caplog.clear()
    return recs, [p - t for p, t in zip(posts, t0s)]


def test_a_read_delay_grows_the_timed_read_by_that_much_and_a_file_switches_it(tmp_path: Path, caplog) -> None:
    knob = tmp_path / "delay_ms"  # absent: no delay
    delay = read_delay(f"@{knob}")
    base, base_post = _reads(delay, 5, caplog)
    knob.write_text("40\n")
    slow, slow_post = _reads(delay, 5, caplog)
    knob.write_text("0")
    again, _ = _reads(delay, 1, caplog)
    p50 = lambda recs: read_stats(recs)["xfer_ms_per_request"]["p50"]  # noqa: E731  ms, as load.json has it
    assert [r["bytes"] for r in base + slow] == [4096] * 10
    assert all(p < 0.025 for p in base_post) and all(0.045 <= p < 0.065 for p in slow_post)  # posted 40 ms late
    # the measured KV transfer time per request: t0 -> post (vLLM's 5 ms of preparing) + NIXL's 10 ms
    # from the post (counted once, though the post returned only when it was done); +40 ms with the delay
    assert (PREP_S + POST_S) * 1e3 <= p50(base) < (PREP_S + POST_S) * 1e3 + 4
    assert 40 <= p50(slow) - p50(base) < 50
    assert p50(again) < (PREP_S + POST_S) * 1e3 + 4
    assert readlog._POST_AT == {}  # each post time taken by its READ


def test_read_delay_values_and_their_errors(tmp_path: Path, caplog) -> None:
    assert read_delay(" 2.5 ")() == 0.0025 and read_delay("0")() == 0.0
    for bad in ("-1", "nan", "inf", "fast", "@"):
        with pytest.raises(ValueError):
            read_delay(bad)
    f = tmp_path / "ms"
    f.write_text("")
    assert read_delay(f"@{f}")() == 0.0  # empty: no delay
    f.write_text("-3")
    with caplog.at_level(logging.WARNING, logger="vllm.pdsweep.engine.readdelay"):
        assert read_delay(f"@{f}")() == 0.0
    assert "a delay in ms must be a finite number >= 0, got '-3'" in caplog.text
    waited = wait(0.0005)
    assert 0.0005 <= waited < 0.005
    kind = ENGINE_OPTIONS[READ_DELAY_ENV_VAR]
    assert kind.where == "engine" and "pdsweep.engine.readdelay" in kind.knobs


def test_the_plugin_installs_the_read_log_with_the_delay(monkeypatch, tmp_path: Path, caplog) -> None:
    from pdsweep.engine import vllm_plugin

    got = []
    monkeypatch.setattr(vllm_plugin, "install_nixl_read_log", lambda delay=None: got.append(delay) or True)
    monkeypatch.setenv(READ_DELAY_ENV_VAR, "7")
    assert vllm_plugin._install_nixl_read_log() and got[-1]() == 0.007
    monkeypatch.setenv(READ_DELAY_ENV_VAR, "-7")
    with caplog.at_level(logging.WARNING, logger="vllm.pdsweep.nixl_progress"):
        assert vllm_plugin._install_nixl_read_log() and got[-1] is None  # the log, without a bad delay
    assert f"ignoring {READ_DELAY_ENV_VAR}='-7'" in caplog.text
    monkeypatch.delenv(READ_DELAY_ENV_VAR)
    assert vllm_plugin._install_nixl_read_log() and got[-1] is None


def test_read_records_end_nixls_duration_after_the_post() -> None:
    line = "PDSWEEP_NIXL_READ remote_engine=e remote_rank=0 bytes=8 descs=1 req=r t0=10.000000 t1=10.100000 xfer_us={x}"
    [new] = nixl_read_records(line.format(x=500) + " tp=10.040000")
    assert (new["start_s"], round(new["end_s"], 6)) == (10.0, 10.0405)
    [old] = nixl_read_records(line.format(x=500))  # a log from before tp: t0 + NIXL's duration
    assert round(old["end_s"], 6) == 10.0005
    [none] = nixl_read_records(line.format(x=-1) + " tp=10.040000")  # no NIXL duration: until vLLM saw it DONE
    assert none["end_s"] == 10.1
