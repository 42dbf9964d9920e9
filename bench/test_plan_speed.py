"""Planning the largest shipped matrix: target < 1 s (expand + validate + schedule)."""

from pathlib import Path

from pdsweep.plan.expand import expand
from pdsweep.plan.schedule import pack
from pdsweep.sweepfile.sweep import load_sweep

SWEEPS = Path(__file__).resolve().parent.parent / "sweeps"


def _largest() -> Path:
    sizes = {p: len(expand(load_sweep(p)).cells) for p in SWEEPS.glob("*.yaml") if p.name != "models.yaml"}
    return max(sizes, key=sizes.get)


def test_plan_largest_matrix(benchmark):
    path = _largest()

    def plan():
        p = expand(load_sweep(path))
        return pack(p.cells, 8)

    sched = benchmark(plan)
    benchmark.extra_info["sweep"] = path.name
    benchmark.extra_info["cells"] = len(sched.placements) + len(sched.too_big)
    assert benchmark.stats.stats.max < 1.0
