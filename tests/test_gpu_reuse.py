"""Instance reuse on GPUs (pdsweep.run.gpureuse, pdsweep.plan.dispatch, docs/gpu-reuse.md):
the mission plan (sweeps/hybrid-mla-mamba.yaml) run end to end on a fake 8-GPU node (a fake
``nvidia-smi`` on PATH, tests/fake_vllm.py as vLLM): instances are shared across cells, a
failed cell stops its instances, no two live instances share a GPU or a port (seen by the fake
servers themselves), measured startups (prestarted ones too) land in run.json; plus the
chains' first order, GPU assignment and startup estimate."""

from __future__ import annotations

import json
import os
import shutil
import stat
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from pdsweep.deploy.instances import instance_key
from pdsweep.judge.gate import gate_run
from pdsweep.plan.expand import expand
from pdsweep.plan.instance import InstanceSpec
from pdsweep.plan.reusepack import plan_chain, simulate, starts
from pdsweep.plan.schedule import EVAL_S, FIRST_REQUEST_S, dies_at_first_request, eval_s
from pdsweep.plan.startup import estimator, startup_s
from pdsweep.results import layout
from pdsweep.run.context import RunOptions
from pdsweep.run.gpureuse import assign
from pdsweep.run.sweep import run_sweep
from pdsweep.sweepfile.sweep import load_catalogue, load_sweep

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
MISSION = REPO / "sweeps" / "hybrid-mla-mamba.yaml"
sys.path.insert(0, str(HERE))
from test_run_fake import FAKE_PY  # noqa: E402
from test_run_fake import tok as tok  # noqa: E402  (fixture)

GPUS = 8
# 8 lanes of 200 ports, then 51 instance blocks of 16 (2416 ports): a range of its own per test
# process, below the kernel's ephemeral ports (32768-60999: a client connection can hold a lane's
# proxy port between two cells) and above cpu-smoke's (20000 on)
PORT_BASE = 24400 + (os.getpid() % 3) * 2700
EXPECT_KEYS = ("expect", "match", "reason", "ref", "without")  # fake vLLM reproduces no bug but PR #49297's

FAKE_SMI = """#!{python}
# fake nvidia-smi: {n} H100 80GB (SM90), idle, no compute processes
import sys
args = " ".join(sys.argv[1:])
if "--query-compute-apps" in args:
    sys.exit(0)
if "--query-gpu=" not in args:
    print("NVIDIA-SMI 580.65.06  Driver Version: 580.65.06  CUDA Version: 13.0")
    sys.exit(0)
fields = args.split("--query-gpu=")[1].split()[0].split(",")
val = {{"index": None, "compute_cap": "9.0", "name": "NVIDIA H100 80GB HBM3", "memory.total": "81559",
       "memory.used": "0", "memory.free": "81559", "driver_version": "580.65.06", "utilization.gpu": "0"}}
for i in range({n}):
    print(", ".join(str(i) if f == "index" else val.get(f, f"GPU-fake-{{i}}") for f in fields))
"""


@pytest.fixture(autouse=True)
def _real_python(monkeypatch):
    monkeypatch.setenv("PDSWEEP_REAL_PYTHON", sys.executable)


def fake_node(tmp_path: Path, monkeypatch) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    smi = bin_dir / "nvidia-smi"
    smi.write_text(FAKE_SMI.format(python=sys.executable, n=GPUS))
    smi.chmod(smi.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")


def mission_on_fakes(tmp_path: Path, tok: Path, life: Path) -> Path:
    """The mission sweep with both builds on the fake interpreter, every model served from the
    fake tokenizer dir (same catalogue geometry, so the same cells and rejections), expectations
    dropped but PR #49297's (its unfixed decode dies as that build's does: ``FAKE_PR49297_UNDONE``),
    a short pdsweep_arith eval skipped at run time, the probe kept."""
    sweep = yaml.safe_load(MISSION.read_text())
    cat0 = yaml.safe_load((REPO / "sweeps" / "models.yaml").read_text())
    shutil.copy(HERE / "fake_vllm.py", tmp_path / "fake_vllm.py")
    for b in sweep["builds"]:  # one fake interpreter per build: fixed and unfixed are other instances
        (tmp_path / b).mkdir()
        shutil.copy(FAKE_PY, tmp_path / b / "python")
    wrapper = (tmp_path / "unfixed" / "python").read_text()
    (tmp_path / "unfixed" / "python").write_text(wrapper.replace("\nhere=", "\nexport FAKE_PR49297_UNDONE=1\nhere=", 1))
    sweep["builds"] = {b: {"python": str(tmp_path / b / "python")} for b in sweep["builds"]}
    sweep["defaults"].update(startup_timeout_s=60, request_timeout_s=10, port_base=PORT_BASE)
    sweep["matrix"]["include"] = [
        {k: v for k, v in e.items() if k not in (("without",) if "vllm#49297" in e.get("without", ()) else EXPECT_KEYS)}
        for e in sweep["matrix"]["include"]
    ]
    kinds = {n: [m["attention"], m.get("ssm", "none") != "none"] for n, m in cat0["models"].items() if "attention" in m}
    sweep["env"] = {"base": {"FAKE_LIFE_LOG": str(life), "FAKE_MODEL_KINDS": json.dumps(kinds)}}
    sweep["matrix"]["env"] = ["base"]
    sweep["eval"] = {
        "tasks": ["pdsweep_arith"],
        "limit": 4,
        "max_retries": 0,
        "timeout_s": 10,
        "max_gen_toks": 8,
        "consistency": {"max_tokens": 4, "lengths": ["short", 40]},
    }
    # the fake vLLM logs no UCX protocol tables: the transport gate (cuda_ipc) is tests/test_transport_placement.py's
    gate = {k: v for k, v in sweep.get("gate", {}).items() if not k.startswith("transports")}
    sweep["gate"] = {**gate, "require_accuracy": False}
    sweep["bench"] = {"enabled": False}
    cat = yaml.safe_load((REPO / "sweeps" / "models.yaml").read_text())
    for m in cat["models"].values():
        if "hf_id" in m:
            m.pop("hf_id")
            m["path"] = str(tok)
    (tmp_path / "models.yaml").write_text(yaml.safe_dump(cat))
    p = tmp_path / "mission.yaml"
    p.write_text(yaml.safe_dump(sweep, sort_keys=False))
    return p


def lifetimes(life: Path) -> list[dict]:
    rows = [json.loads(x) for x in life.read_text().splitlines()]
    out: dict[int, dict] = {}
    for r in rows:
        d = out.setdefault(r["pid"], {"pid": r["pid"], "model": r["model"], "ports": r["ports"], "gpus": r["gpus"]})
        d[r["event"]] = r["t"]
    return list(out.values())


def test_mission_plan_on_a_fake_8_gpu_node_reuses_each_instance_once(tmp_path, tok, monkeypatch):
    fake_node(tmp_path, monkeypatch)
    life = tmp_path / "life.jsonl"
    path = mission_on_fakes(tmp_path, tok, life)
    real, fake = expand(load_sweep(MISSION)), expand(load_sweep(path))
    # the mission's cells, but for granite's n_groups-1 cells at prefill TP > decode TP: they run only as
    # declared expected failures (rule mamba2-groups), and the fake copy drops every expectation
    missing = {c.id for c in real.cells} - {c.id for c in fake.cells}
    assert {c.id for c in fake.cells} <= {c.id for c in real.cells}
    assert missing and all(c.startswith("granite-4.0-h-tiny.") for c in missing), missing
    assert {r.cell.id for r in fake.rejected if r.rule == "mamba2-groups"} == {c for c in missing if ".ref-" not in c}

    # no preflight: the fake node runs CPU torch and fake weights (tests/test_preflight.py covers it)
    run = run_sweep(path, RunOptions(out=tmp_path / "run", quiet=True, skip_eval=True, preflight=False))
    # vLLM's backend probe (it imported vLLM) ended with the planning, not at process exit
    from pdsweep.builds import attnprobe

    assert not attnprobe._PROBES
    index = layout.read_json(run / layout.RUN_FILE)
    plan = layout.read_json(run / layout.PLAN_FILE)
    assert index["reuse"] is True
    ran = [cid for cid, c in index["cells"].items() if c["status"] != "pending"]
    too_big = [r["cell_id"] for r in index["rejected"] if r["rule"] == layout.NEEDS_GPUS]
    # b64-128 runs as b128-128: vLLM raises both to one hybrid block per TP (pdsweep.plan.fold)
    assert index["folded"] == {"kimi-linear.p2d1.b64-128.fixed": "kimi-linear.p2d1.b128-128.fixed"}
    assert len(ran) == len(fake.cells) - len(too_big) - 1 and len(too_big) == 6 and all(".p8d" in c for c in too_big)
    # the unfixed MLA + SSM cells at tp_ratio < 0 (the fake's pre-#49297 decode dies on its assert), only they
    crash = {c.id for c in fake.cells if c.expect_fail and c.id in ran}
    assert crash == {
        "kimi-linear.p2d1.b128-128.unfixed",
        "kimi-linear.p4d1.b128-128.unfixed",
        "kimi-linear.p4d2.b128-128.unfixed",
        "glm-5.3-flash-4l.p4d1.b128-128.unfixed",  # GLM's p2d1 is refused (block-ratio), its p4d1 runs
    }
    # the plan's duration model ends exactly these at their first request (eval_s), and each cell records
    # how long that request took until decode died (status.json timings, kept for a cell failing there)
    assert {c.id for c in fake.cells if dies_at_first_request(c) and c.id in ran} == crash
    for cid in crash:
        st = layout.read_json(run / cid / layout.STATUS_FILE)
        assert st["phase"] == "ready" and 0 < st["timings"]["first_request_s"] < 10, (cid, st.get("timings"))
    bad = {
        cid: c["status"] for cid, c in index["cells"].items() if cid in ran and (c["status"] != "ok") != (cid in crash)
    }
    assert not bad, bad
    res = gate_run(run)
    # every other cell that ran passes; the 13 cells this node cannot (usefully) hold are NOT-RUNNABLE
    # (listed, not a pass, not a failure) and the rejected ones are SKIPPED
    verdicts = {c.cell_id: c.verdict for c in res.cells}
    why = {c.cell_id: c.message[:300] for c in res.cells if c.cell_id in ran and c.verdict not in ("PASS", "XFAIL")}
    assert {c: verdicts[c] for c in ran if verdicts[c] != "PASS"} == dict.fromkeys(crash, "XFAIL"), why
    assert {c.cell_id for c in res.cells if c.verdict == "NOT-RUNNABLE"} == set(too_big)
    assert "FAIL" not in verdicts.values() and res.passed
    assert not res.problems and sum(v == "SKIPPED" for v in verdicts.values()) == len(fake.rejected) > 0

    # instances shared across cells: fewer starts than uses; one restarts only when it was stopped for
    # room or ended by a failed cell (the plan's count is on estimated times, the run's on real ones)
    by_id, events = index["instances"]["by_id"], index["instances"]["events"]
    distinct, starts_run = plan["reuse"]["distinct"], sum(r["starts"] for r in by_id.values())
    assert len(by_id) == distinct >= 40 and distinct <= starts_run < plan["reuse"]["per_cell"]
    stopped = {(e["instance_id"], e["cell"]) for e in events if e["event"] == "stop"}
    # each crash stops every instance it used (run stops a failed cell's: one may be dead, as its decode is)
    for cid in crash:
        used = {i for i, r in by_id.items() if cid in r["cells"]}
        assert used and all((i, cid) in stopped for i in used), cid
    shared = [r for r in by_id.values() if len(r["cells"]) > 1]
    # 13: GLM p4d1 (run since GLM blocks include its indexer) shares its TP-4 prefill with no other cell
    assert len(shared) >= 13 and sum(len(r["cells"]) for r in by_id.values()) == plan["reuse"]["per_cell"] > distinct

    # as the fake servers saw it: every one exited; no two alive at once on one GPU or port
    procs = lifetimes(life)
    assert len(procs) == starts_run and all("end" in p for p in procs), [p for p in procs if "end" not in p]
    for i, a in enumerate(procs):
        gpus_a = set(a["gpus"].split(","))
        for b in procs[i + 1 :]:
            if a["start"] < b["end"] and b["start"] < a["end"]:
                assert not gpus_a & set(b["gpus"].split(",")), (a, b)
                assert not set(a["ports"]) & set(b["ports"]), (a, b)
    assert max(len(p["gpus"].split(",")) for p in procs) == 4
    # measured startups, one per start, each at least the fake's 0.3 s
    ups = index["instances"]["startups"]
    assert len(ups) == starts_run and {u["instance_id"] for u in ups} == set(by_id)
    assert all(0.3 <= u["startup_s"] < 60 for u in ups), ups[:3]

    # GPUs go per instance and cells run at once: GPUs served several instances one after the other,
    # and instances were up side by side
    per_gpu: dict[str, int] = {}
    for p in procs:
        for g in p["gpus"].split(","):
            per_gpu[g] = per_gpu.get(g, 0) + 1
    assert len(per_gpu) == GPUS and min(per_gpu.values()) >= 2
    assert max(sum(q["start"] < p["end"] and p["start"] < q["end"] for q in procs) for p in procs) >= 4


def _spec(name: str, tp: int, argv: str) -> InstanceSpec:
    return InstanceSpec(name, name.split("-")[0], tp, 1, None, tuple(range(tp)), (argv,), {})


def test_assign_keeps_live_gpus_and_never_doubles_one():
    p4, d2, d1 = _spec("prefill-0", 4, "p4"), _spec("decode-0", 2, "d2"), _spec("decode-0", 1, "d1")
    held = {4: instance_key(p4), 5: instance_key(p4), 6: instance_key(p4), 7: instance_key(p4)}
    assert assign(held, tuple(range(8)), [p4, d2]) == (4, 5, 6, 7, 0, 1)  # P4 keeps 4-7
    assert assign({**held, 0: instance_key(d1)}, tuple(range(8)), [p4, d2]) == (4, 5, 6, 7, 1, 2)
    assert assign({**held, 0: "x", 1: "y", 2: "z"}, tuple(range(8)), [p4, d2]) is None  # only GPU 3 free


def cells_of(*ids: str, failing: str = "") -> list:
    """Stand-in cells for the chain planner: id, expect_fail (ids in ``failing``), one GPU each."""
    return [
        SimpleNamespace(id=c, kind="pd", expect_fail=c in failing, expect_match=None, num_gpus=1, platform="cuda")
        for c in ids
    ]


def test_simulate_keeps_an_instance_needed_later_while_gpus_allow():
    order = cells_of("a", "b", "c")
    keys = {"a": ["P4", "D1"], "b": ["P4", "D2"], "c": ["P1", "D1"]}
    sizes = {"P4": 4, "D1": 1, "D2": 2, "P1": 1}
    n, stops, fresh = simulate(order, keys, sizes, capacity=7)  # P4 + D1 + D2 = 7: D1 stays up
    assert n == 4 and stops[0] == set() and stops[1] == {"P4", "D2"} and fresh == [True, True, True]
    n, stops, _ = simulate(order, keys, sizes, capacity=6)  # no room: D1 (used again) goes, restarts
    assert n == 5 and stops[0] == {"D1"}
    # two candidates: the one needed again furthest ahead stops (Belady)
    order = cells_of("a", "b", "c", "d")
    keys = {"a": ["A", "B"], "b": ["C"], "c": ["A"], "d": ["B"]}
    n, stops, _ = simulate(order, keys, {"A": 2, "B": 2, "C": 3}, capacity=5)
    assert stops[0] == {"B"} and n == 4


def test_an_expected_failure_ends_its_instances_and_comes_last_among_their_users():
    # run stops every instance of a failed cell (deploy), so the plan stops them after a cell expected to
    # fail (pre-#49297 decode dies on its assert): P, which e shares with a and b, starts again after e
    keys = {"a": ["P", "X"], "b": ["P", "Y"], "e": ["P"]}
    n, stops, _ = simulate(cells_of("a", "e", "b", failing="e"), keys, {}, capacity=8)
    assert n == 4 and stops[1] == {"P"}
    assert simulate(cells_of("a", "e", "b"), keys, {}, capacity=8)[0] == 3  # e passing ends nothing
    # the chain's order runs e after a and b: P starts once (the greedy counts the restart e would cause)
    chain = plan_chain(cells_of("a", "b", "e", failing="e"), keys, {"P": 1, "X": 1, "Y": 1}, max_gpus=8)
    assert [c.id for c in chain.cells][-1] == "e" and starts(chain, keys) == {"P": 1, "X": 1, "Y": 1}


def test_a_cell_dying_on_the_pre_49297_assert_costs_its_first_request_not_an_eval():
    # its decode dies at the cell's first PD request (deploy's first_request), so no eval runs: eval_s
    mission, cpu = load_sweep(MISSION), load_sweep(REPO / "sweeps" / "cpu-smoke.yaml")
    dying = {c.id for ls in (mission, cpu) for c in expand(ls).cells if dies_at_first_request(c)}
    assert dying == {
        *(f"kimi-linear.{tp}.b128-128.unfixed" for tp in ("p2d1", "p4d1", "p4d2", "p8d1", "p8d2", "p8d4")),
        "glm-5.3-flash-4l.p4d1.b128-128.unfixed",  # GLM's p2d1 is refused (block-ratio), its p4d1 runs
        "tiny-mla-mamba2.p2d1.b128-128.unfixed",  # cpu-smoke names the whole signature, file and line
    }
    cells = {c.id: c for c in expand(mission).cells}
    crash, twin = cells["kimi-linear.p2d1.b128-128.unfixed"], cells["kimi-linear.p2d1.b128-128.fixed"]
    # expected failures of another kind run their eval: granite's wrong conv state fails gsm8k
    assert cells["granite-4.0-h-tiny.p2d1.b128-128.unfixed"].expect_fail
    assert eval_s(cells["granite-4.0-h-tiny.p2d1.b128-128.unfixed"]) == EVAL_S["cuda"] == eval_s(twin)
    est = estimator(mission)
    assert eval_s(crash) == FIRST_REQUEST_S["cuda"] < EVAL_S["cuda"]
    assert est(crash) - est(twin) == FIRST_REQUEST_S["cuda"] - EVAL_S["cuda"]


def test_startup_estimated_from_weights():
    cat = load_catalogue(REPO / "sweeps" / "models.yaml")
    kimi = cat.models["kimi-linear"]
    assert kimi.weights_gb == 98
    assert startup_s(kimi, "cuda", 1) == pytest.approx(120 + 98 / 2)
    assert startup_s(kimi, "cuda", 4) == pytest.approx(120 + 98 / 8)
    assert startup_s(cat.models["glm-5.3-flash-4l"], "cuda", 1) == pytest.approx(120 + 20 / 2)
    assert startup_s(cat.models["deepseek-vl2-tiny"], "cuda", 1) == 300.0  # no size: the flat default
    with pytest.raises(ValueError, match="tp 0"):
        startup_s(kimi, "cuda", 0)
