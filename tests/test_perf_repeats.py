"""Repeats of the load phase (pdsweep.measure.repeats) around a fake run_load: every
repeat's raw figures kept, convergence on target_ci, the CPU budget, per-repeat KV figures."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from pdsweep.core.stats import planned_repeats
from pdsweep.measure.repeats import Probes, run_repeats
from pdsweep.sweepfile.phases import BenchSpec


def _ls(platform: str = "cuda", **bench: Any) -> Any:
    return SimpleNamespace(sweep=SimpleNamespace(platform=platform, bench=BenchSpec(enabled=True, **bench)))


class FakeLoad:
    """run_load stand-in: writes vLLM's result file, returns one run per call with the next
    TTFT of ``ttfts``; appends timed READ lines to ``log``; advances ``clock`` by ``step_s``."""

    def __init__(self, ttfts: list[float], log: Path | None = None, step_s: float = 10.0) -> None:
        self.ttfts, self.log, self.step_s, self.now, self.calls = list(ttfts), log, step_s, 0.0, 0

    def clock(self) -> float:
        return self.now

    def __call__(self, ls: Any, cell: Any, dep: Any, mpath: str, cdir: Path) -> dict[str, Any]:
        ttft = self.ttfts[self.calls]
        self.calls += 1
        self.now += self.step_s
        (cdir / "logs" / "load-c2.json").write_text(json.dumps({"mean_ttft_ms": ttft}))
        (cdir / "logs" / "load-c2.log").write_text("bench log\n")
        if self.log is not None:
            with open(self.log, "a") as f:
                for k in range(2):  # two READs of 1e9 bytes, overlapping half
                    t0 = 10.0 * self.calls + 0.5 * k
                    f.write(
                        f"PDSWEEP_NIXL_READ remote_engine=e remote_rank={k} bytes=1000000000 descs=3 "
                        f"req=r{self.calls} t0={t0:.6f} t1={t0 + 2:.6f} xfer_us=1000000\n"
                    )
        run = {
            "concurrency": 2,
            "num_prompts": 8,
            "ttft_ms": {"mean": ttft, "p50": ttft, "p90": ttft, "p99": ttft},
            "tpot_ms": {"mean": 5.0, "p50": 5.0, "p90": 5.0, "p99": 5.0},
            "output_tok_s": 100.0,
            "req_s": 1.0,
            "completed": 8,
            "errors": 0,
        }
        return {"runs": [run]}


@pytest.fixture
def cdir(tmp_path: Path) -> Path:
    (tmp_path / "logs").mkdir()
    return tmp_path


def test_three_repeats_keep_every_raw_figure_and_their_interval(cdir: Path) -> None:
    log = cdir / "decode.log"
    log.write_text("PDSWEEP_NIXL_READ remote_engine=e remote_rank=0 bytes=1 descs=1 req=old t0=1.0 t1=2.0 xfer_us=1\n")
    fake = FakeLoad([100.0, 110.0, 90.0], log)
    body = run_repeats(_ls(), None, None, "m", cdir, fake, Probes((log,), clock=fake.clock))
    assert fake.calls == 3 and [r["repeat"] for r in body["runs"]] == [0, 1, 2]
    assert [r["ttft_ms"]["p50"] for r in body["runs"]] == [100.0, 110.0, 90.0]
    for i, ttft in enumerate((100.0, 110.0, 90.0)):  # vLLM's own result file of each repeat, kept
        assert body["runs"][i]["raw_file"] == f"logs/load-c2.r{i}.json"
        assert json.loads((cdir / "logs" / f"load-c2.r{i}.json").read_text()) == {"mean_ttft_ms": ttft}
    ttft = body["summary"]["c2"]["ttft_ms.p50"]
    assert (ttft["mean"], ttft["n"], ttft["values"]) == (100.0, 3, [100.0, 110.0, 90.0])
    assert ttft["hi"] - 100.0 == pytest.approx(4.302653 * 10 / 3**0.5, rel=1e-5)  # t_{.975,2} x sd/sqrt(3)
    # each repeat's KV figures from its own READ lines only (the line logged before is not counted)
    kv = [r["kv"] for r in body["repeats"]]
    assert [k["reads"] for k in kv] == [2, 2, 2] and kv[0]["union_s"] == pytest.approx(1.5)
    assert kv[0]["gbps_union"] == pytest.approx(2 / 1.5) and kv[0]["gbps_sum"] == pytest.approx(1.0)
    assert body["summary"]["kv"]["kv_gbps.union"]["values"] == pytest.approx([2 / 1.5] * 3)
    assert body["repeat_plan"]["run"] == 3 and body["repeat_plan"]["stop_reason"] == "planned repeats done"


def test_target_ci_stops_once_converged(cdir: Path) -> None:
    fake = FakeLoad([100.0, 100.5, 100.2, 100.1, 100.3])
    body = run_repeats(_ls(target_ci=0.05, max_repeats=5), None, None, "m", cdir, fake, Probes(clock=fake.clock))
    assert fake.calls == 2 and body["repeat_plan"]["stop_reason"].startswith("converged")


def test_target_ci_is_bounded_by_max_repeats(cdir: Path) -> None:
    fake = FakeLoad([100.0, 200.0, 50.0, 150.0, 80.0, 1.0])
    body = run_repeats(_ls(target_ci=0.01, max_repeats=4), None, None, "m", cdir, fake, Probes(clock=fake.clock))
    assert fake.calls == 4 and body["repeat_plan"]["stop_reason"].startswith("max_repeats 4 reached")


def test_cpu_default_stops_at_its_budget_with_at_least_two(cdir: Path) -> None:
    fake = FakeLoad([100.0] * 3, step_s=100.0)
    body = run_repeats(_ls("cpu", repeats_budget_s=250), None, None, "m", cdir, fake, Probes(clock=fake.clock))
    assert fake.calls == 2 and body["repeat_plan"]["stop_reason"].startswith("CPU budget")
    fake = FakeLoad([100.0] * 3, step_s=10.0)
    assert len(run_repeats(_ls("cpu"), None, None, "m", cdir, fake, Probes(clock=fake.clock))["repeats"]) == 3


def test_planned_repeats() -> None:
    assert planned_repeats(BenchSpec(), "cuda") == (3, 3, 3)
    assert planned_repeats(BenchSpec(), "cpu") == (2, 3, 3)
    assert planned_repeats(BenchSpec(repeats=5), "cpu") == (5, 5, 5)
    assert planned_repeats(BenchSpec(target_ci=0.05, max_repeats=7), "cuda") == (2, 3, 7)


def test_each_repeat_records_engine_cpu_ms_per_completed_request(cdir: Path) -> None:
    fake = FakeLoad([100.0, 110.0])
    used = iter([5.0, 5.8, 5.8, 7.0])  # engine CPU seconds before and after each repeat
    body = run_repeats(_ls(repeats=2), None, None, "m", cdir, fake, Probes(cpu_s=lambda: next(used), clock=fake.clock))
    cpu = [r["cpu"] for r in body["repeats"]]
    assert [c["requests"] for c in cpu] == [8, 8]
    assert [c["ms_per_request"] for c in cpu] == pytest.approx([800 / 8, 1200 / 8])
    assert body["summary"]["cpu"]["engine_cpu_ms.per_request"]["values"] == pytest.approx([100.0, 150.0])
    gone = run_repeats(_ls(repeats=1), None, None, "m", cdir, FakeLoad([1.0]), Probes(cpu_s=lambda: None))
    assert gone["repeats"][0]["cpu"] is None and "cpu" not in gone["summary"]  # unknown, never 0
