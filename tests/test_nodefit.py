"""The mission sweep fitted to the user's node (issue 35): per-cell memory fit on fake 8 x
H100 80 GB, H200 and B200 nodes (``pdsweep plan``, exit 0, runnable core cells fixed and
unfixed, the rest NOT-RUNNABLE with the arithmetic), and shared nodes
(``CUDA_VISIBLE_DEVICES`` as indices or UUIDs, MIG refused, GPUs whose memory a process
nvidia-smi does not list holds are left out)."""

from __future__ import annotations

import json

import pytest
from _fakes import fake_nvidia_smi

from pdsweep.cli import main
from pdsweep.core.errors import UserError
from pdsweep.plan.gpus import inventory, visible

SWEEP = "sweeps/hybrid-mla-mamba.yaml"
ARITH_H100 = (
    "model kimi-linear decode TP 1 (block 128, max_model_len 8192) does not fit: weights 91.3 GiB / TP 1 = "
    "91.3 GiB + KV of one request 0.10 GiB = 91.4 GiB per rank > 79.6 GiB (NVIDIA H100 80GB HBM3) x "
    "gpu_memory_utilization 0.8 = 63.7 GiB"
)
NODES = {  # name -> (fake nvidia-smi kwargs, core cells that must run, node shape in the header)
    "h100": (
        {},
        ["kimi-linear.p4d2.b128-128.fixed", "kimi-linear.p4d2.b128-128.unfixed"],
        "8 x NVIDIA H100 80GB HBM3 (79.6 GiB)",
    ),
    "h200": (
        {"name": "NVIDIA H200", "total_mib": 143771},
        [f"kimi-linear.{tp}.b128-128.{b}" for tp in ("p2d1", "p4d1", "p4d2") for b in ("fixed", "unfixed")],
        "8 x NVIDIA H200 (140.4 GiB)",
    ),
    "b200": (
        {"name": "NVIDIA B200", "cap": "10.0", "total_mib": 183359},
        [f"kimi-linear.{tp}.b128-128.{b}" for tp in ("p2d1", "p4d1", "p4d2") for b in ("fixed", "unfixed")],
        "8 x NVIDIA B200 (179.1 GiB)",
    ),
}


@pytest.fixture
def env(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))  # an empty HF cache: catalogue weights_gb decides
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.delenv("CUDA_DEVICE_ORDER", raising=False)
    monkeypatch.delenv("PDSWEEP_GPU_ARCH", raising=False)
    return monkeypatch


def plan_json(capsys, *extra: str, caplog=None) -> tuple[dict, str]:
    """The plan as JSON and what it warned (logged: pdsweep.run.dryrun)."""
    assert main(["plan", SWEEP, "--no-check-argv", "--format", "json", *extra]) == 0
    out = capsys.readouterr()
    return json.loads(out.out), out.err + (caplog.text if caplog else "")


@pytest.mark.parametrize("node", list(NODES))
def test_mission_sweep_fits_each_node(node, tmp_path, env, capsys, caplog):
    kw, core, shape = NODES[node]
    env.setenv("PATH", f"{fake_nvidia_smi(tmp_path / 'bin', **kw)}:{__import__('os').environ['PATH']}")
    d, err = plan_json(capsys, caplog=caplog)
    assert d["fitted_to"] == shape and d["gpus"] == 8
    placed = {p["cell"] for p in d["schedule"]["placements"]}
    assert set(core) <= placed, sorted(set(core) - placed)
    cells = {c["id"]: c for c in d["cells"]}
    assert all(cells[c]["expect_fail"] == c.endswith("unfixed") for c in core)  # fixed PASS, unfixed XFAIL
    reasons = {x["cell"]: x["reason"] for x in d["schedule"]["needs_more_gpus"]}
    assert reasons["kimi-linear.p8d1.b128-128.fixed"] == "needs 9 GPUs, host has 8"
    assert not placed & set(reasons)  # NOT-RUNNABLE cells are never scheduled
    if node == "h100":
        for c in ("p2d1", "p4d1"):
            for b in ("fixed", "unfixed"):
                assert reasons[f"kimi-linear.{c}.b128-128.{b}"] == ARITH_H100
        assert reasons["kimi-linear.ref-tp1.b128.fixed"].startswith("model kimi-linear single TP 1 ")
        assert "kimi-linear.ref-tp2.b128.fixed" in placed  # p4d2's reference runs too
        assert f"{ARITH_H100}: its cells are NOT-RUNNABLE here" in err
    else:
        assert not [r for r in reasons.values() if "does not fit" in r]


def test_cuda_visible_devices_is_the_set_pdsweep_uses(tmp_path, env, capsys, caplog):
    env.setenv(
        "PATH",
        f"{fake_nvidia_smi(tmp_path / 'bin', name='NVIDIA H200', total_mib=143771)}:{__import__('os').environ['PATH']}",
    )
    env.setenv("CUDA_VISIBLE_DEVICES", "2,3,4,5")
    d, err = plan_json(capsys, caplog=caplog)
    assert d["gpus"] == 4 and d["fitted_to"] == "4 x NVIDIA H200 (140.4 GiB)"
    used = {g for p in d["schedule"]["placements"] for g in p["gpus"]}
    assert used == {2, 3, 4, 5}
    envs = [i["env"] for c in d["cells"] for i in c.get("instances", [])]
    assert envs and {int(x) for e in envs for x in e["CUDA_VISIBLE_DEVICES"].split(",")} <= {2, 3, 4, 5}
    assert all(e["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID" for e in envs)  # nvidia-smi's indices are CUDA's
    assert "GPU 0 (GPU-00000000-fake) is not in CUDA_VISIBLE_DEVICES=2,3,4,5: left out" in err
    assert "kimi-linear.p4d2.b128-128.fixed" in {x["cell"] for x in d["schedule"]["needs_more_gpus"]}


def test_visible_uuids_mig_and_hidden_processes(tmp_path, monkeypatch):
    bin_dir = fake_nvidia_smi(tmp_path / "bin", busy={1: (4242, "python3", 20480)})
    # GPU 6: 30 GiB used, no compute process listed (another container's PID namespace)
    smi = json.loads((bin_dir / "smi.json").read_text())
    smi["gpus"][6]["memory.free"] = smi["gpus"][6]["memory.total"] - 30720
    smi["gpus"][6]["memory.used"] = 30720
    (bin_dir / "smi.json").write_text(json.dumps(smi))
    monkeypatch.setenv("PATH", f"{bin_dir}:{__import__('os').environ['PATH']}")
    inv = inventory()
    gpus, lines = visible(inv, {})
    assert [g.index for g in gpus] == [0, 2, 3, 4, 5, 7]
    assert lines == [
        "GPU 1 (GPU-00000001-fake) is in use by pid 4242 python3 (20480 MiB): left out of this run",
        "GPU 6 (GPU-00000006-fake) has 30720 MiB in use by a process nvidia-smi does not list (another "
        "container?): left out of this run",
    ]
    gpus, _ = visible(inv, {"CUDA_VISIBLE_DEVICES": "GPU-00000007-fake,GPU-00000003"})  # a unique prefix is enough
    assert [g.index for g in gpus] == [7, 3]
    gpus, _ = visible(inv, {"CUDA_VISIBLE_DEVICES": ""})
    assert gpus == ()
    with pytest.raises(UserError, match="MIG-1234 is a MIG instance; pdsweep places whole GPUs"):
        visible(inv, {"CUDA_VISIBLE_DEVICES": "MIG-1234"})
    with pytest.raises(UserError, match=r"CUDA_VISIBLE_DEVICES=9: '9' is not a GPU of this host; allowed: "):
        visible(inv, {"CUDA_VISIBLE_DEVICES": "9"})
    # mixed GPU models: indices are CUDA's fastest-first order unless CUDA_DEVICE_ORDER=PCI_BUS_ID
    smi["gpus"][0]["name"] = "NVIDIA H100 PCIe"
    (bin_dir / "smi.json").write_text(json.dumps(smi))
    mixed = inventory()
    with pytest.raises(UserError, match="export CUDA_DEVICE_ORDER=PCI_BUS_ID"):
        visible(mixed, {"CUDA_VISIBLE_DEVICES": "0,2"})
    gpus, _ = visible(mixed, {"CUDA_VISIBLE_DEVICES": "0,2", "CUDA_DEVICE_ORDER": "PCI_BUS_ID"})
    assert [g.index for g in gpus] == [0, 2]


def test_flashmla_pin_is_hopper_only_from_vllms_own_check(tmp_path, env, capsys):
    """vLLM's is_flashmla_dense_supported (vllm/v1/attention/ops/flashmla.py) refuses FLASHMLA off
    Hopper; the probe asks it for the target arch, so the pin is refused on sm100 with vLLM's
    reason, and the catalogue pins it for sm90 only (serve_args_by_arch)."""
    from pdsweep.plan import blocks
    from pdsweep.sweepfile.sweep import load_sweep

    kimi = load_sweep(SWEEP).catalogue.models["kimi-linear"]
    with pytest.raises(blocks.BackendError) as e:
        blocks.cuda_backend(kimi, 1, "sm100", blocks.Serve("bfloat16", "auto", 128, "FLASHMLA", True))
    assert "Reason: ['FlashMLA Dense is only supported on Hopper devices.']" in str(e.value)
    ok = blocks.cuda_backend(kimi, 1, "sm90", blocks.Serve("bfloat16", "auto", 128, "FLASHMLA", True))
    assert ok is not None and ok.backend.name == "FLASHMLA" and ok.backend.exact == (64,)
    for arch, pinned in (("sm90", True), ("sm100", False)):
        env.setenv("PDSWEEP_GPU_ARCH", arch)
        d, _ = plan_json(capsys, "--gpus", "8", "--cells", "kimi-linear.p2d1.b128-128.*")
        assert {r["rule"] for r in d["rejected"]} <= {
            "hybrid-prefix-caching",
            "nixl-support",
            "block-ratio",
            "handshake-compat",
        }
        # sm100: vLLM picks FLASHINFER_MLA_SPARSE at 16 heads per rank, FLASHMLA_SPARSE at 32/64: GLM only
        assert {r["cell"]["model"] for r in d["rejected"] if r["rule"] == "handshake-compat"} <= {"glm-5.3-flash-4l"}
        for c in d["cells"]:
            for i in c["instances"]:
                argv = " ".join(i["argv"])
                assert ("--attention-backend FLASHMLA" in argv) == pinned, (arch, c["id"])
                assert (i["blocks"]["backend"] == "FLASHMLA") == pinned and i["blocks"]["kernel"] in (32, 64)


def test_serve_args_by_arch_is_checked_like_serve_args(tmp_path):
    """A flag pdsweep sets (e.g. --port) is refused in serve_args_by_arch as in serve_args, naming
    file, field and flag; an arch key that is not smXY is refused by the schema."""
    from pdsweep.sweepfile.sweep import load_sweep

    sweep = tmp_path / "s.yaml"
    sweep.write_text(
        "name: s\nplatform: cuda\nmatrix:\n  model: [m]\n  tp: [p1d1]\n  block_size: [16]\n"
        "eval: {tasks: []}\ngate: {require_accuracy: false}\n"
    )
    for arch_args, want in (
        ("{sm90: [--port, '1']}", "models.yaml:7: models.m.serve_args_by_arch.sm90[0]: '--port' sets --port"),
        ("{h100: [--enforce-eager]}", "serve_args_by_arch"),
    ):
        (tmp_path / "models.yaml").write_text(
            "models:\n  m:\n    hf_id: x/y\n    architecture: X\n    attention: mla\n    num_layers: 1\n"
            f"    serve_args_by_arch: {arch_args}\n"
        )
        with pytest.raises(UserError) as e:
            load_sweep(sweep)
        assert want in str(e.value), str(e.value)


def test_unverified_gpu_facts_are_said_in_the_plan(tmp_path, env, capsys):
    """Issue 56: what vLLM cannot answer here is said per cell (plan.json ``unverified``) and in the text
    plan, never used silently: on a fake B200, CUTLASS_MLA (ahead of the sparse backends in vLLM's order)
    cannot be loaded on this CPU box, so GLM's backend is unverified; Kimi-Linear's facts are all vLLM's."""
    kw = NODES["b200"][0]
    env.setenv("PATH", f"{fake_nvidia_smi(tmp_path / 'bin', **kw)}:{__import__('os').environ['PATH']}")
    env.setenv("PDSWEEP_GPU_ARCH", "sm100")  # nvidia-smi's arch is read once per process (lru_cache)
    cutlass = (
        "CUTLASS_MLA (ahead in vLLM's order) not checkable here: AssertionError: Torch not compiled with CUDA enabled"
    )
    d, _ = plan_json(capsys, "--cells", "*.p1d1.b128-128.fixed")
    cells = {c["id"]: c for c in d["cells"]}
    assert f"prefill: {cutlass}" in cells["glm-5.3-flash-4l.p1d1.b128-128.fixed"]["unverified"]
    assert cells["kimi-linear.p1d1.b128-128.fixed"]["unverified"] == []
    assert main(["plan", SWEEP, "--no-check-argv", "--cells", "glm-5.3-flash-4l.p1d1.b128-128.fixed"]) == 0
    out = capsys.readouterr().out
    assert f"not vLLM's verdict here): {cutlass}: glm-5.3-flash-4l.p1d1.b128-128.fixed" in out
