"""Instance reuse across cells (pdsweep.deploy.instances, schedule.reuse_order/lifecycle):
identity, the cpu-smoke plan's distinct instances, the prefix-cache reset between
cells (fake vLLM with vLLM's /reset_prefix_cache and prefix-cache counters), a shared
instance that died, and --no-reuse."""

from __future__ import annotations

import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest

from pdsweep.deploy import instances as inst
from pdsweep.deploy.instances import InstancePool, instance_id, instance_key, relocate
from pdsweep.deploy.launchers import LocalLauncher
from pdsweep.measure.metrics import parse
from pdsweep.plan.expand import expand
from pdsweep.plan.instance import InstanceSpec, Slot, instances
from pdsweep.plan.schedule import estimate_s, lifecycle, reuse_order
from pdsweep.results import layout
from pdsweep.run.context import RunOptions
from pdsweep.run.sweep import run_sweep
from pdsweep.sweepfile.sweep import load_sweep

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))
from test_run_fake import FAKE_PY, make_sweep, ours, status  # noqa: E402
from test_run_fake import tok as tok  # noqa: E402  (fixture)


@pytest.fixture(autouse=True)
def _real_python(monkeypatch):
    monkeypatch.setenv("PDSWEEP_REAL_PYTHON", sys.executable)


def smoke_specs() -> tuple[list, dict[str, list[InstanceSpec]]]:
    """cpu-smoke's cells and their instances as the run derives them (lane 0, 2 cores)."""
    ls = load_sweep(REPO / "sweeps" / "cpu-smoke.yaml")
    plan = expand(ls)
    slot = Slot(0, (), ls.sweep.defaults.port_base, (0, 1))
    return plan.cells, {c.id: instances(c, slot, ls, f"/models/{c.model}", f"/py/{c.build}") for c in plan.cells}


def test_key_ignores_ports_and_dev_mode_but_not_what_defines_the_instance():
    _, specs = smoke_specs()
    p = specs["tiny-llama.p1d1.b32-32.fixed"][0]
    assert instance_key(relocate(p, 24512)) == instance_key(p)
    moved = relocate(p, 24512)
    assert moved.port == 24512 and moved.env["VLLM_PORT"] == "24514" and moved.side_channel_port == 24520
    assert moved.env["VLLM_NIXL_SIDE_CHANNEL_PORT"] == "24520" and moved.env["VLLM_SERVER_DEV_MODE"] == "1"
    assert list(moved.argv)[list(moved.argv).index("--port") + 1] == "24512"
    unfixed = specs["tiny-llama.p1d1.b32-32.unfixed"][0]
    assert instance_key(unfixed) != instance_key(p)  # another build interpreter
    rope = specs["tiny-mla.p1d1.b32-32.fixed.env-rope-unpatched"][1]
    assert instance_key(rope) != instance_key(specs["tiny-mla.p1d1.b32-32.fixed"][1])  # another env
    # the GPUs it was given are where it runs, not what it is (it keeps them while shared) ...
    on_gpu = replace(p, gpus=(3,), env={**p.env, "CUDA_VISIBLE_DEVICES": "3"})
    assert instance_key(on_gpu) == instance_key(p)
    assert instance_key(replace(p, name="prefill-1")) != instance_key(p)  # ... but a second prefill is another
    assert instance_id(p).startswith("prefill.tiny-llama.tp1.")


def test_cpu_smoke_shares_six_instances_and_starts_each_distinct_one_once():
    cells, specs = smoke_specs()
    keys = {cid: [instance_key(s) for s in sp] for cid, sp in specs.items()}
    uses = sum(len(v) for v in keys.values())
    distinct = {k for v in keys.values() for k in v}
    assert (len(cells), uses, len(distinct)) == (29, 49, 43)
    # the decode of P TP1 and P TP2 is one instance (decode binds cores from the last one down)
    d11 = specs["tiny-llama.p1d1.b32-32.fixed"][1]
    assert d11.env["VLLM_CPU_OMP_THREADS_BIND"] == "1"
    assert instance_key(d11) == instance_key(specs["tiny-llama.p2d1.b32-32.fixed"][1])
    # p1d2's prefill is p1d1's: prefill digests every descriptor in KV_DIGEST_PARTS parts whatever the
    # cell (issue 58), so no per-cell env splits them (a per-cell PDSWEEP_KV_DIGEST_SPLIT did: 44 distinct)
    assert instance_key(specs["tiny-llama.p1d1.b32-32.fixed"][0]) == instance_key(
        specs["tiny-llama.p1d2.b32-32.fixed"][0]
    )
    ordered = reuse_order(cells, {c: set(v) for c, v in keys.items()})
    assert sorted(c.id for c in ordered) == sorted(c.id for c in cells)
    assert all(c.kind == "ref" for c in ordered[:8])
    rows = lifecycle(ordered, keys, {k: k for k in distinct})
    assert len(rows) == 43 and sorted(r["instance_id"] for r in rows) == sorted(distinct)  # each started once
    # a fault drill's instances are its own (PDSWEEP_FAULT_DRILL in their env): two kills, two READ faults
    drills = [c for c in keys if ".fault-" in c]
    assert len(drills) == 4
    for drill in drills:
        assert not {k for c, v in keys.items() if c != drill for k in v} & set(keys[drill])
    llama = [
        c.id
        for c in ordered
        if c.id.startswith("tiny-llama.p") and c.build == "fixed" and c.fault == "none" and c.env == "base"
    ]
    # p1d2 and p1d1 share prefill, p1d1 and p2d1 decode: the chain runs p1d2 -> p1d1 -> p2d1
    assert llama == ["tiny-llama.p1d2.b32-32.fixed", "tiny-llama.p1d1.b32-32.fixed", "tiny-llama.p2d1.b32-32.fixed"]
    shared = [r for r in rows if len(r["cells"]) > 1]
    assert len(shared) == 6 and all(r["stop_after"] == r["cells"][-1] for r in rows)


def test_plan_shows_which_instances_run_shares(capsys):
    SMOKE = REPO / "sweeps" / "cpu-smoke.yaml"
    from pdsweep.cli import main
    from pdsweep.run.dryrun import plan_dict

    cells, specs = smoke_specs()
    r = plan_dict(str(SMOKE), 0)["reuse"]
    keys = {cid: [instance_key(s) for s in sp] for cid, sp in specs.items()}
    assert (r["distinct"], r["per_cell"]) == (43, 49)
    # run's order: the build pair first (measured paired by default, its instances stopped after it), then the rest
    pair = ["tiny-llama.p1d1.b32-32.fixed", "tiny-llama.p1d1.b32-32.unfixed"]
    rest = [c for c in cells if c.id not in pair]
    assert r["order"] == pair + [c.id for c in reuse_order(rest, {c: set(v) for c, v in keys.items()})]
    shared = {x["instance_id"]: x["cells"] for x in r["instances"] if len(x["cells"]) > 1}
    assert len(shared) == 4 and len(r["instances"]) == 45  # the pair's decode is not kept for tiny-llama p2d1
    decode = [i for i in shared if i.startswith("decode.tiny-mla-mamba2.tp1.")]  # one decode for both P TPs
    assert [shared[i] for i in decode] == [
        ["tiny-mla-mamba2.p1d1.b128-128.fixed", "tiny-mla-mamba2.p2d1.b128-128.fixed"]
    ]
    assert main(["plan", str(SMOKE), "--no-check-argv"]) == 0
    assert "instance reuse: 43 distinct instances for 49 uses, 45 starts (4 shared" in capsys.readouterr().out


def test_gpu_makespan_model_with_packing_and_reuse_beats_sequential():
    from pdsweep.run.gpureuse import plan_order, record

    cells, specs = smoke_specs()
    cuda = [replace(c, platform="cuda") for c in cells]
    specs = {c.id: [replace(s, gpus=(0,) * s.tp) for s in specs[c.id]] for c in cells}  # one GPU per rank
    four, eight = (record(plan_order(cuda, specs, n, estimate_s)[1], estimate_s) for n in (4, 8))
    assert eight["sequential_s"] == sum(estimate_s(c) for c in cuda)
    assert 0 < eight["makespan_s"] <= four["makespan_s"] and eight["makespan_s"] < eight["sequential_s"]


def _hits(run: Path, cell: str, inst_name: str, phase: str) -> float:
    def total(tag: str) -> float:
        snap = parse((run / cell / "metrics" / f"{phase}.{inst_name}.{tag}.txt").read_text())
        return snap.counters["vllm:prefix_cache_hits"]

    return total("after") - total("before")


SHARED_PREFILL = "  model: [fake-gqa]\n  tp: [p1d1, p1d2]\n"


@pytest.mark.parametrize("reset", [True, False])
def test_cell_reusing_a_prefill_sees_no_prefix_cache_hits_from_the_previous_cell(tmp_path, tok, monkeypatch, reset):
    if not reset:  # the control: without the reset the same eval prompts hit the shared prefill's cache
        monkeypatch.setattr(inst, "reset_prefix_cache", lambda url, timeout_s=5.0: True)
    sweep = make_sweep(tmp_path, tok, matrix=SHARED_PREFILL, extra="  reference: false\n")
    run = run_sweep(sweep, RunOptions(out=tmp_path / "run", quiet=True))
    first, second = layout.read_json(run / "plan.json")["reuse"]["order"]
    assert {first, second} == {"fake-gqa.p1d1.b16-16.fixed", "fake-gqa.p1d2.b16-16.fixed"}
    idx = layout.read_json(run / "run.json")
    by_id = idx["instances"]["by_id"]
    assert sorted(v["starts"] for v in by_id.values()) == [1, 1, 1]  # P shared, two decodes
    st1, st2 = status(run, first), status(run, second)
    assert st1["status"] == st2["status"] == "ok"
    p1, p2 = st1["instances"][0], st2["instances"][0]
    assert p1["instance_id"] == p2["instance_id"] and (p1["reused"], p2["reused"]) == (False, True)
    assert by_id[p1["instance_id"]]["cells"] == [first, second]
    assert _hits(run, first, "prefill-0", "eval") == 0  # 8 distinct questions, a fresh cache
    if reset:
        assert by_id[p1["instance_id"]]["resets"] == 1
        assert _hits(run, second, "prefill-0", "eval") == 0
        assert "Resetting prefix cache" in (run / second / "logs" / "prefill-0.log").read_text()
    else:
        assert _hits(run, second, "prefill-0", "eval") > 0
    # each cell's log holds its own share of the shared instance's log, the instance log all of it
    whole = Path(p1["log"]).read_text()
    assert whole.startswith("fake vllm serve") and Path(p1["log"]).parent == run / "instances"
    assert not (run / second / "logs" / "prefill-0.log").read_text().startswith("fake vllm serve")
    assert not ours(tmp_path)  # nothing left running


def test_no_reuse_starts_one_deployment_per_cell(tmp_path, tok):
    sweep = make_sweep(tmp_path, tok, matrix=SHARED_PREFILL, extra="  reference: false\n")
    run = run_sweep(sweep, RunOptions(out=tmp_path / "run", quiet=True, skip_eval=True, reuse=False))
    idx = layout.read_json(run / "run.json")
    assert idx["reuse"] is False and "reuse" not in layout.read_json(run / "plan.json")
    assert sorted(idx["instances"]["by_id"].values(), key=lambda v: v["starts"])[-1]["starts"] == 2  # P twice
    for cell in ("fake-gqa.p1d1.b16-16.fixed", "fake-gqa.p1d2.b16-16.fixed"):
        assert (run / cell / "logs" / "prefill-0.log").read_text().startswith("fake vllm serve")
    assert not ours(tmp_path)


def fake_spec(tok: Path, name: str = "prefill-0") -> InstanceSpec:
    argv = (
        str(FAKE_PY),
        "-m",
        "vllm.entrypoints.cli.main",
        "serve",
        str(tok),
        "--served-model-name",
        "fake",
        "--port",
        "1",
        "--kv-transfer-config",
        '{"kv_role":"kv_producer"}',
    )
    return InstanceSpec(name, "prefill", 1, 1, 2, (), argv, {"VLLM_PORT": "3", "FAKE_STARTUP_S": "0.1"})


def _wait_up(url: str) -> None:
    import httpx

    for _ in range(100):
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise AssertionError(f"{url} never healthy")


def test_a_shared_instance_that_died_is_restarted_for_the_next_cell(tmp_path, tok):
    pool = InstancePool(LocalLauncher(), tmp_path / "instances", 24800 + (hash(str(tmp_path)) % 50) * 16)
    spec = fake_spec(tok)
    try:
        (a,) = pool.acquire("cell-a", [spec], tmp_path / "a")
        _wait_up(a.handle.url)
        pool.release("cell-a", [a], False, tmp_path / "a")
        (b,) = pool.acquire("cell-b", [spec], tmp_path / "b")  # alive: reused, its cache reset
        assert b.reused and b.handle.pid == a.handle.pid and pool.resets[b.instance_id] == 1
        pool.release("cell-b", [b], False, tmp_path / "b")
        import os
        import signal

        os.killpg(b.handle.pid, signal.SIGKILL)  # the shared instance dies between cells
        b.handle.proc.wait(timeout=10)
        before = (tmp_path / "instances" / f"{b.instance_id}.log").stat().st_size
        (c,) = pool.acquire("cell-c", [spec], tmp_path / "c")
        assert not c.reused and c.handle.pid != a.handle.pid and pool.starts[c.instance_id] == 2
        # the restart appends to the instance log: cell-c's share starts after the dead process's lines
        assert c.log_offset == before > 0, c.log_offset
        assert [e["event"] for e in pool.events if e["cell"] == "cell-c"][:4] == ["died", "restart", "stop", "start"]
        _wait_up(c.handle.url)
        pool.release("cell-c", [c], True, tmp_path / "c")  # a failed cell stops what it used
        assert not pool.live and not c.handle.alive()
        assert (tmp_path / "c" / "prefill-0.log").read_text().startswith("fake vllm serve")
    finally:
        pool.close()
    assert not ours(tmp_path)
