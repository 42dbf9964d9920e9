"""The goodput a load point reports (issue 60) is vLLM's: a fake-vLLM run whose load phase drives the
real ``vllm bench serve`` in process (pdsweep.measure.benchserve; the fake build has no vLLM, so the
test lets this interpreter's drive the fake's HTTP) with the sweep's ``bench.goodput``,
then vLLM's own ``vllm.benchmarks.serve.calculate_metrics`` called here on the same per-request
outputs and the sweep's SLO gives, per repeat, the figure the point carries times the cell's ranks.

So that the SLO splits the requests, the client's request function adds 5 s to the TTFT and latency
of every other request it returns (a slow request, as vLLM's benchmark then sees and scores it)."""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any

import pytest
from _fakerun import PORT_BASE, make_sweep
from _fakerun import tok as tok

from pdsweep.judge.gate import gate_run
from pdsweep.judge.pareto import points
from pdsweep.measure import benchserve
from pdsweep.run.context import RunOptions
from pdsweep.run.sweep import run_sweep

serve = pytest.importorskip("vllm.benchmarks.serve", reason="vLLM's benchmark module (vllm bench serve)")
SLO_MS = {"ttft": 2500.0}  # the fake answers in ms; the padded requests take 5 s more
PAD_S = 5.0
PD = "fake-gqa.p1d1.b16-16.fixed"


@pytest.fixture(autouse=True)
def _real_python(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PDSWEEP_REAL_PYTHON", sys.executable)


def _record(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """Wrap vLLM's benchmark (its base URL and concurrency), its request function (every other
    output padded by :data:`PAD_S`) and calculate_metrics (its arguments and its goodput)."""
    calls: list[dict[str, Any]] = []
    now: dict[str, Any] = {}
    bench, calc = serve.benchmark, serve.calculate_metrics
    funcs = serve.ASYNC_REQUEST_FUNCS
    n = [0]

    async def benchmark(*a: Any, **kw: Any) -> Any:
        now.update(url=kw["base_url"], concurrency=kw["max_concurrency"])
        return await bench(*a, **kw)

    def calculate_metrics(input_requests, outputs, dur_s, tokenizer, selected_percentiles, goodput_config_dict):  # type: ignore[no-untyped-def]
        metrics, lens = calc(input_requests, outputs, dur_s, tokenizer, selected_percentiles, goodput_config_dict)
        calls.append({**now, "outputs": list(outputs), "requests": list(input_requests), "dur_s": dur_s,
                      "tokenizer": tokenizer, "slo": dict(goodput_config_dict)})  # fmt: skip
        return metrics, lens

    def padded(orig: Any) -> Any:
        async def request_func(*a: Any, **kw: Any) -> Any:
            out = await orig(*a, **kw)
            n[0] += 1
            if out.success and n[0] % 2 == 0:
                out.ttft += PAD_S
                out.latency += PAD_S
            return out

        return request_func

    monkeypatch.setattr(benchserve, "in_process_ok", lambda python: True)  # vLLM's client, the fake's HTTP
    monkeypatch.setattr(serve, "benchmark", benchmark)
    monkeypatch.setattr(serve, "calculate_metrics", calculate_metrics)
    for name in list(funcs):
        monkeypatch.setitem(funcs, name, padded(funcs[name]))
    return calls


def test_point_goodput_is_vllms_calculate_metrics(tmp_path: Path, tok: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _record(monkeypatch)
    sweep = make_sweep(
        tmp_path,
        tok,
        matrix="  model: [fake-gqa]\n  tp: [p1d1]\n",
        port_base=PORT_BASE + 300,
        extra="bench: {enabled: true, num_prompts: 8, input_len: 40, output_len: 4, concurrencies: [1, 4], "
        f"repeats: 2, workloads: [random], goodput: {{ttft: {SLO_MS['ttft']:g}}}}}\n"
        "gate: {require_accuracy: false}\n",
    )
    run = run_sweep(sweep, RunOptions(out=tmp_path / "run", quiet=True, skip_eval=True))
    g = gate_run(run)
    pts = {p.concurrency: p for p in points(run, g) if p.cell_id == PD}
    log = (run / PD / "logs" / "load-c4.r0.log").read_text()
    url = re.search(r"--base-url (\S+)", log).group(1)  # the PD cell's proxy, not its reference
    mine = [c for c in calls if c["url"] == url]
    assert sorted(c["concurrency"] for c in mine) == [1, 1, 4, 4] and all(c["slo"] == SLO_MS for c in mine)
    for conc, p in pts.items():
        want = []
        for c in (c for c in mine if c["concurrency"] == conc):  # vLLM's own arithmetic, called here
            m, _ = serve.calculate_metrics(
                c["requests"], c["outputs"], c["dur_s"], c["tokenizer"], [50.0, 90.0, 99.0], SLO_MS
            )
            assert 0 < m.request_goodput < m.request_throughput  # the SLO splits the requests
            want.append(m.request_goodput)
        assert p.goodput_per_gpu is not None and p.ranks == 2
        assert [v * p.ranks for v in p.goodput_per_gpu.values] == pytest.approx(want, rel=1e-9), conc
