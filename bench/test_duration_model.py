"""The plan's duration model against a real sweep's measured phase times (issue 40 item 4).

Reads a finished run (``$PDSWEEP_BENCH_RUN``, else the newest ``results/*/run.json`` with
measured startups): each instance start (run.json ``instances.startups``, launch to
``/health`` 200) against :func:`pdsweep.plan.startup.startup_s` of its model and TP, each
cell's measured phases (status.json ``timings.measure_s``: eval, consistency, bench) against
:data:`pdsweep.plan.schedule.EVAL_S` (:data:`~pdsweep.plan.schedule.FIRST_REQUEST_S` for a cell
that :func:`~pdsweep.plan.schedule.dies_at_first_request`), and the run's wall time against
today's model of its cells in its order. Figures go to ``results/bench/summary.md``; skipped without a run.
"""

from __future__ import annotations

import os
import statistics
import sys
from pathlib import Path

import pytest

from pdsweep.results import layout

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "bench"))

from test_sweep_reuse import write_section  # noqa: E402


def _run() -> Path | None:
    if given := os.environ.get("PDSWEEP_BENCH_RUN"):
        return Path(given)
    runs = sorted(REPO.glob("results/*/run.json"), key=lambda p: p.stat().st_mtime, reverse=True)
    for r in runs:
        idx = layout.read_json_or_none(r)
        if idx and idx.get("finished") and (idx.get("instances") or {}).get("startups"):
            return r.parent
    return None


def modelled_s(run: Path, idx: dict) -> float:
    """The run's cells in its own order (plan.json ``reuse.order``, one at a time as on CPU) in
    today's model: :func:`pdsweep.plan.startup.estimator` for a cell starting any instance,
    :func:`pdsweep.plan.schedule.eval_s` for one whose instances were all up."""
    from pdsweep.plan.expand import expand
    from pdsweep.plan.schedule import eval_s
    from pdsweep.plan.startup import estimator
    from pdsweep.sweepfile.sweep import load_sweep

    ls = load_sweep(REPO / idx["sweep"])
    est, cells = estimator(ls), {c.id: c for c in expand(ls).cells}
    plan = layout.read_json(run / layout.PLAN_FILE)
    t, seen = 0.0, set[str]()
    for cid in plan["reuse"]["order"]:
        ids = set(plan["reuse"]["cell_instances"][cid].values())
        t += est(cells[cid]) if ids - seen else eval_s(cells[cid])
        seen |= ids
    return t


def test_duration_model_against_measured_phases(benchmark) -> None:
    from pdsweep.plan.expand import expand
    from pdsweep.plan.schedule import EVAL_S, FIRST_REQUEST_S, dies_at_first_request
    from pdsweep.plan.startup import startup_s
    from pdsweep.sweepfile.sweep import load_catalogue, load_sweep

    run = _run()
    if run is None:
        pytest.skip("no finished run with measured startups: set PDSWEEP_BENCH_RUN")
    idx = layout.read_json(run / layout.RUN_FILE)
    models = load_catalogue(REPO / "sweeps" / "models.yaml").models
    dies = {c.id for c in expand(load_sweep(REPO / idx["sweep"])).cells if dies_at_first_request(c)}

    def measured() -> tuple[list[tuple[float, float]], dict[bool, list[float]]]:
        starts = [
            (s["startup_s"], startup_s(models[s["model"]], idx["platform"], s["tp"]))
            for s in idx["instances"]["startups"]
            if s["model"] in models
        ]
        phases: dict[bool, list[float]] = {False: [], True: []}  # dies at its first PD request -> seconds
        for cid in idx["cells"]:
            st = layout.read_json_or_none(run / cid / "status.json") or {}
            what = "first_request_s" if cid in dies else "measure_s"  # a dying cell ends at its first request
            if (m := (st.get("timings") or {}).get(what)) is not None:
                phases[cid in dies].append(m)
        return starts, phases

    starts, by_kind = benchmark.pedantic(measured, rounds=1, iterations=1)
    phases, deaths = by_kind[False], by_kind[True]
    wall, est = idx["timings"]["wall_s"], modelled_s(run, idx)
    s_ratio = statistics.median(m / e for m, e in starts)
    p_ratio = statistics.median(phases) / EVAL_S[idx["platform"]]
    benchmark.extra_info.update(startup_ratio=s_ratio, phase_ratio=p_ratio, wall_s=wall, estimated_s=est)
    first = FIRST_REQUEST_S[idx["platform"]]
    write_section(
        f"Duration model vs measured phases ({run.name}, {idx['platform']})",
        [
            f"- instance startups: {len(starts)}, measured median {statistics.median(m for m, _ in starts):.1f} s, "
            f"model median {statistics.median(e for _, e in starts):.1f} s: measured/model {s_ratio:.2f}",
            f"- measured phases per cell (eval + consistency + bench): {len(phases)} cells, median "
            f"{statistics.median(phases):.1f} s vs EVAL_S {EVAL_S[idx['platform']]:.0f} s: {p_ratio:.2f}",
            f"- cells whose decode dies at the first PD request (pre-#49297 assert): {len(deaths)} cells, measured "
            + (f"{', '.join(f'{m:.1f}' for m in deaths)} s vs FIRST_REQUEST_S {first:.0f} s" if deaths else "none"),
            f"- run wall {wall:.0f} s vs today's model of its cells in its order {est:.0f} s: {wall / est:.2f}",
        ],
    )
    assert starts and phases
