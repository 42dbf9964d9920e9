"""Scheduler: disjoint GPUs and port lanes for concurrent cells; makespan ratio; the GPU count and
the pool's port range are bounded (issue 15)."""

from pathlib import Path
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdsweep.cli import main
from pdsweep.core.errors import UserError
from pdsweep.plan.expand import Cell, expand
from pdsweep.plan.instance import PORTS_PER_SLOT
from pdsweep.plan.schedule import GpuPool, pack
from pdsweep.sweepfile.sweep import load_sweep

SWEEPS = Path(__file__).resolve().parent.parent / "sweeps"


def overlap(a, b) -> bool:
    return a.start_s < b.end_s and b.start_s < a.end_s


def test_hybrid_on_8_gpus_packs_and_lists_too_big():
    plan = expand(load_sweep(SWEEPS / "hybrid-mla-mamba.yaml"))
    s = pack(plan.cells, 8)
    assert {c.id for c in s.too_big} >= {"kimi-linear.p8d1.b128-128.fixed", "kimi-linear.p8d4.b128-128.fixed"}
    assert all(c.num_gpus > 8 for c in s.too_big)
    assert len(s.placements) + len(s.too_big) == len(plan.cells)
    assert 0 < s.ratio < 0.6  # 1-5 GPU cells overlap on 8 GPUs
    assert s.to_dict()["needs_more_gpus"][0]["needs"] > 8


def test_cpu_runs_one_cell_at_a_time():
    plan = expand(load_sweep(SWEEPS / "cpu-smoke.yaml"))
    s = pack(plan.cells, 0)
    assert s.ratio == 1.0 and not s.too_big
    assert all(not overlap(a, b) for i, a in enumerate(s.placements) for b in s.placements[i + 1 :])
    assert [p.cell.kind for p in s.placements[:5]] == ["ref"] * 5  # references first


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.tuples(st.integers(1, 4), st.integers(1, 4), st.integers(1, 2)), min_size=1, max_size=25),
    st.integers(1, 16),
)
def test_concurrent_cells_never_share_gpus_or_ports(shapes, gpus):
    cells = [Cell(f"m{i}", p, d, 16, 16, 1, n, "cuda", "fixed") for i, (p, d, n) in enumerate(shapes)]
    s = pack(cells, gpus)
    assert len(s.placements) + len(s.too_big) == len(cells)
    for i, a in enumerate(s.placements):
        assert len(a.slot.gpus) == a.cell.num_gpus and max(a.slot.gpus) < gpus
        for b in s.placements[i + 1 :]:
            if overlap(a, b):
                assert not set(a.slot.gpus) & set(b.slot.gpus)
                assert abs(a.slot.port_base - b.slot.port_base) >= PORTS_PER_SLOT


def test_pool_release_returns_gpus_and_lane():
    pool = GpuPool(4, 20000)
    c = Cell("m", 2, 1, 16, 16, 1, 1, "cuda", "fixed")
    s1 = pool.try_acquire(c)
    assert s1.gpus == (0, 1, 2) and s1.index == 0
    assert pool.try_acquire(c) is None
    pool.release(s1)
    assert pool.try_acquire(c).gpus == (0, 1, 2)


def test_gpu_count_and_port_range(capsys) -> None:
    with pytest.raises(SystemExit) as e:
        main(["plan", str(SWEEPS / "cpu-smoke.yaml"), "--gpus", "-1"])
    assert e.value.code == 2 and "-1 GPUs: allowed 0..4096" in capsys.readouterr().err
    with pytest.raises(UserError, match="reach port 80199, past 65535"):
        GpuPool(301, 20000)
    assert GpuPool(8, 60000).port_base == 60000


def Need(n: int) -> SimpleNamespace:
    return SimpleNamespace(num_gpus=n)


def test_a_lane_without_gpus_leaves_every_gpu_free_and_comes_back():
    pool = GpuPool(4, 20000)
    slot = pool.try_acquire(Need(3))
    lane = pool.take_lane()  # run_dispatch's: GPUs go per instance
    assert slot is not None and lane.gpus == () and lane.index != slot.index and lane.port_base == 20200
    assert pool.try_acquire(Need(2)) is None and pool.try_acquire(Need(1)).gpus == (3,)
    pool.release(lane)
    assert pool.take_lane().index == lane.index


def test_pair_takes_both_slots_at_once_or_neither():
    cpu = GpuPool(0, 20000)
    a, b = (Cell("m", 1, 1, 16, 16, 1, 1, "cpu", build, platform="cpu") for build in ("fixed", "unfixed"))
    pair = cpu.try_acquire_both(a, b)  # on CPU the pair shares one claim of every core
    assert pair is not None and [s.index for s in pair] == [0, 1] and cpu.try_acquire(a) is None
    for s in pair:
        cpu.release(s)
    assert cpu.lanes == set() and not cpu.cpu_busy
    gpus = GpuPool(3, 20000)
    assert gpus.try_acquire_both(Need(2), Need(2)) is None  # 4 GPUs at once: neither side kept
    assert gpus.free == {0, 1, 2} and gpus.lanes == set()
    got = gpus.try_acquire_both(Need(2), Need(1))
    assert got is not None and [s.gpus for s in got] == [(0, 1), (2,)]
