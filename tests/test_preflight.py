"""GPU-node preflight (pdsweep.run.preflight) on a fake 8-GPU SM90 80 GB node (fake
``nvidia-smi`` from tests/_fakes.py, a fake hub): a missing model, a model that does not
fit, a busy GPU and an old driver are each refused with one line, exit 2, before any
process starts; busy GPUs are never handed out."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

import pytest
from _fakes import block_non_loopback, fake_nvidia_smi

from pdsweep.cli import main
from pdsweep.core.errors import UserError
from pdsweep.plan.gpus import inventory
from pdsweep.plan.schedule import GpuPool, detect_gpu_ids, detect_gpus
from pdsweep.run import preflight as pf

KIMI = "moonshotai/Kimi-Linear-48B-A3B-Instruct"


class FakeHub:
    """repo id -> gated; a repo not in ``repos`` does not exist; ``down``: unreachable."""

    def __init__(self, repos: dict[str, bool], down: bool = False) -> None:
        self.repos, self.down, self.asked = repos, down, []

    def gated(self, repo_id: str, token: str | None) -> bool:
        self.asked.append(repo_id)
        if self.down:
            raise OSError("Connection refused")
        if repo_id not in self.repos:
            raise LookupError(repo_id)
        return self.repos[repo_id]

    def weights_bytes(self, repo_id: str, token: str | None) -> int | None:
        return None


@pytest.fixture
def node(tmp_path, monkeypatch):
    """A fake 8 x H100 80 GB (SM90, driver 580) first on PATH; no HF cache, no token."""
    monkeypatch.setenv("PATH", f"{fake_nvidia_smi(tmp_path / 'bin')}:{__import__('os').environ['PATH']}")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(pf, "_stored_token", lambda: None)
    monkeypatch.setattr(pf, "torch_cuda_version", lambda: "13.0")
    return tmp_path / "bin"


def write_sweep(tmp_path: Path, tp: str = "p2d1", hf_id: str = KIMI, marker: Path | None = None) -> Path:
    """A cuda sweep of one Kimi-Linear-shaped model (geometry of sweeps/models.yaml) whose
    build interpreter writes ``marker`` when a ``vllm serve`` is started with it."""
    marker = marker or tmp_path / "launched"
    py = tmp_path / "python"
    py.write_text(  # `-m vllm.entrypoints.cli.main serve`: record it; probes (-c ...) go to the real python
        f'#!/bin/sh\nif [ "$2" = vllm.entrypoints.cli.main ]; then echo "$@" >> {marker}; exit 1; fi\n'
        f'exec {sys.executable} "$@"\n'
    )
    py.chmod(0o755)
    (tmp_path / "models.yaml").write_text(f"""models:
  kimi-linear:
    hf_id: {hf_id}
    weights_gb: 98.0
    architecture: KimiLinearForCausalLM
    attention: mla
    ssm: kda
    num_layers: 27
    attention_layers: 7
    ssm_layers: 20
    num_attention_heads: 32
    mla: {{kv_lora_rank: 512, qk_rope_head_dim: 64}}
    ssm_state: {{num_heads: 32, head_dim: 128, state_dim: 128, conv_kernel: 4, conv_dim: 12288, state_dtype: float32}}
    max_model_len: 8192
    serve_args: [--attention-backend, FLASHMLA]  # as sweeps/models.yaml: SM90's default FLASH_ATTN_MLA is refused at p2d1
""")
    p = tmp_path / "sweep.yaml"
    p.write_text(f"""name: pf
platform: cuda
builds:
  fixed: {{python: {py}}}
defaults:
  gpu_memory_utilization: 0.8
serve_args:
  base: [--no-enable-prefix-caching]  # hetero-TP hybrid (rule hybrid-prefix-caching)
matrix:
  model: [kimi-linear]
  tp: [{tp}]
  block_size: [128]
  build: [fixed]
eval:
  reference: false
  tasks: []
  consistency: {{enabled: false}}
gate: {{require_consistency: false, require_accuracy: false}}
""")
    return p


def run_cli(sweep: Path, *extra: str) -> int:
    with block_non_loopback():
        return main(["run", str(sweep), "--out", str(sweep.parent / "run"), "--skip-eval", *extra])


def test_inventory_and_busy_gpu_left_out(tmp_path, monkeypatch, caplog):
    bin_dir = fake_nvidia_smi(tmp_path / "bin", busy={3: (4242, "python3", 20480)})
    monkeypatch.setenv("PATH", f"{bin_dir}:{__import__('os').environ['PATH']}")
    inv = inventory()
    assert [g.index for g in inv.gpus] == list(range(8))
    assert inv.gpus[0].compute_cap == "9.0" and inv.gpus[0].total_mib == 81559 and inv.driver == "580.65.06"
    assert [g.index for g in inv.gpus if g.busy] == [3]
    with caplog.at_level(logging.WARNING):
        ids = detect_gpu_ids()
    assert ids == (0, 1, 2, 4, 5, 6, 7) and detect_gpus() == 7
    assert "GPU 3 (GPU-00000003-fake) is in use by pid 4242 python3 (20480 MiB)" in caplog.text
    # the pool never hands out GPU 3, whatever the cells ask for
    pool = GpuPool(len(ids), 20000, ids=ids)
    taken = [g for g in pool.free]
    assert 3 not in taken and sorted(taken) == [0, 1, 2, 4, 5, 6, 7]


def test_driver_older_than_torch_cuda():
    assert pf.driver_problems("580.65.06", "13.0") == []
    assert pf.driver_problems("570.124.06", "12.8") == []
    (msg,) = pf.driver_problems("570.124.06", "13.0")
    assert "NVIDIA driver 570.124.06 is older than 580" in msg and "CUDA 13.x" in msg
    assert "upgrade the driver (pdsweep has no install route for it" in msg and "gpu-cu12" not in msg
    (msg,) = pf.driver_problems("470.82.01", "13.0")
    assert "no install route" in msg
    assert "CPU build" in pf.driver_problems("580.65.06", None)[0]
    assert "no known minimum driver" in pf.driver_problems("580.65.06", "14.0")[0]


def test_weights_resolution(tmp_path):
    from pdsweep.sweepfile.catalogue import ModelSpec

    def spec(**kw):
        return ModelSpec(architecture="X", attention="mla", num_layers=1, **kw)

    none = lambda repo: None  # noqa: E731 (no HF cache)
    hub = FakeHub({KIMI: False, "meta-llama/Llama-3.1-8B": True})
    w = pf.resolve_weights("k", spec(hf_id=KIMI, weights_gb=98.0), hub, {}, none)
    assert w.error is None and w.where == f"hub:{KIMI}" and w.nbytes == 98_000_000_000
    w = pf.resolve_weights("typo", spec(hf_id="moonshotai/Kimi-Linear-48B"), hub, {}, none)
    assert w.error == "model typo: moonshotai/Kimi-Linear-48B does not exist on the Hugging Face hub (misnamed hf_id?)"
    w = pf.resolve_weights("llama", spec(hf_id="meta-llama/Llama-3.1-8B"), hub, {}, none)
    assert "is gated on the hub and no HF_TOKEN is set" in w.error
    assert (
        pf.resolve_weights("llama", spec(hf_id="meta-llama/Llama-3.1-8B"), hub, {"HF_TOKEN": "x"}, none).error is None
    )
    w = pf.resolve_weights("k", spec(hf_id=KIMI), FakeHub({}, down=True), {}, none)
    assert "not in the HF cache and the hub is unreachable (Connection refused)" in w.error
    w = pf.resolve_weights("k", spec(hf_id=KIMI), hub, {"HF_HUB_OFFLINE": "1"}, none)
    assert "HF_HUB_OFFLINE" in w.error
    # a cached snapshot: no hub question; bytes from model.safetensors.index.json
    snap = tmp_path / "snap"
    snap.mkdir()
    (snap / "config.json").write_text("{}")
    (snap / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": 123456}}))
    asked = FakeHub({}, down=True)
    w = pf.resolve_weights("k", spec(hf_id=KIMI, weights_gb=98.0), asked, {}, lambda repo: snap)
    assert (w.where, w.nbytes, w.error, asked.asked) == (str(snap), 123456, None, [])
    assert pf.resolve_weights("p", spec(path=str(tmp_path / "nope")), hub, {}, none).error.endswith("does not exist")


def test_refuses_missing_model_before_anything_starts(tmp_path, node, monkeypatch, capsys):
    hub = FakeHub({})  # the hub knows no such repo
    monkeypatch.setattr(pf, "HfHub", lambda: hub)
    sweep = write_sweep(tmp_path, hf_id="moonshotai/Kimi-Linear-48B-Typo")
    assert run_cli(sweep) == 2
    err = capsys.readouterr().err
    assert "model kimi-linear: moonshotai/Kimi-Linear-48B-Typo does not exist on the Hugging Face hub" in err
    assert "nothing started" in err
    assert hub.asked == ["moonshotai/Kimi-Linear-48B-Typo"]
    assert not (tmp_path / "launched").exists() and not (tmp_path / "run").exists()


def test_cell_that_does_not_fit_is_not_runnable(tmp_path, node, monkeypatch, capsys):
    """Per-cell memory fit (issue 35): a cell whose instance does not fit is NOT-RUNNABLE with
    the arithmetic; the preflight does not refuse the sweep."""
    from pdsweep.plan.expand import expand
    from pdsweep.sweepfile.sweep import load_sweep

    ls = load_sweep(write_sweep(tmp_path, tp="p2d1"))  # decode at TP 1: 98 GB on one 80 GB GPU
    got = pf.preflight(ls, expand(ls).cells, hub=FakeHub({KIMI: False}))
    pd = next(c for c in expand(ls).cells if c.kind == "pd")
    line = got.unfit[pd.id]
    assert line.startswith("model kimi-linear decode TP 1 (block 128, max_model_len 8192) does not fit: ")
    assert "weights 91.3 GiB / TP 1 = 91.3 GiB" in line and "> 79.6 GiB (NVIDIA H100 80GB HBM3)" in line
    assert "gpu_memory_utilization 0.8 = 63.7 GiB" in line
    assert f"{line}: its cells are NOT-RUNNABLE here" in got.warnings
    assert not [w for w in got.warnings if "prefill TP 2" in w]  # 45.6 GiB per rank fits
    assert got.shape == "8 x NVIDIA H100 80GB HBM3 (79.6 GiB)"
    # TP 2 on both sides fits: the preflight passes, gives every GPU, nothing unfit
    ls = load_sweep(write_sweep(tmp_path, tp="p2d2"))
    ok = pf.preflight(ls, expand(ls).cells, hub=FakeHub({KIMI: False}))
    assert ok.gpu_ids == tuple(range(8)) and ok.weights["kimi-linear"].nbytes == 98_000_000_000 and ok.unfit == {}


def test_refuses_busy_gpu_and_old_driver(tmp_path, node, monkeypatch, capsys, caplog):
    monkeypatch.setattr(pf, "HfHub", lambda: FakeHub({KIMI: False}))
    fake_nvidia_smi(node, busy={5: (777, "other-user-train.py", 40000)})
    sweep = write_sweep(tmp_path, tp="p2d2")
    assert run_cli(sweep, "--gpus", "8") == 2
    err = capsys.readouterr().err
    assert "--gpus 8: only 7 of 8 free: GPU 5 (GPU-00000005-fake) is in use by pid 777 other-user-train.py" in err
    assert not (tmp_path / "launched").exists() and not (tmp_path / "run").exists()
    # without --gpus: GPU 5 is left out with a warning, the plan schedules on the other 7
    with block_non_loopback():
        assert main(["plan", str(sweep), "--preflight", "--no-check-argv", "--format", "json"]) == 0
    out = capsys.readouterr()
    d = json.loads(out.out)
    assert d["gpus"] == 7 and all(5 not in p["gpus"] for p in d["schedule"]["placements"])
    assert "GPU 5 (GPU-00000005-fake) is in use by pid 777 other-user-train.py (40000 MiB): left out" in caplog.text
    fake_nvidia_smi(node, driver="535.183.01")
    assert run_cli(sweep) == 2
    assert "NVIDIA driver 535.183.01 is older than 580, the minimum for CUDA 13.x" in capsys.readouterr().err
    assert not (tmp_path / "launched").exists() and not (tmp_path / "run").exists()


def test_failed_nvidia_smi_is_an_error(tmp_path, node, monkeypatch, capsys):
    monkeypatch.setattr(pf, "HfHub", lambda: FakeHub({KIMI: False}))
    fake_nvidia_smi(node, fail=True)
    ls = __import__("pdsweep.sweepfile.sweep", fromlist=["load_sweep"]).load_sweep(write_sweep(tmp_path))
    from pdsweep.plan.expand import expand

    with pytest.raises(UserError, match="nvidia-smi failed"):
        pf.preflight(ls, expand(ls).cells)


def test_a_node_without_nvlink_is_warned_that_kv_reads_would_go_over_tcp(tmp_path, node, monkeypatch):
    """One H200 without NVLink READ its KV over tcp/lo at 0.06-0.68 GB/s (UCX turns cuda_ipc GET off):
    the preflight says so before anything starts, naming the sweep line that fixes it; an SXM node
    (links active), or a sweep that sets the variable, gets no such line."""
    from pdsweep.plan.expand import expand
    from pdsweep.sweepfile.sweep import load_sweep

    def nvlink_lines(path: Path) -> list[str]:
        ls = load_sweep(path)
        got = pf.preflight(ls, expand(ls).cells, hub=FakeHub({KIMI: False}))
        return [w for w in got.warnings if "NVLink" in w]

    sweep = write_sweep(tmp_path, tp="p2d2")
    assert nvlink_lines(sweep) == []  # the fake 8 x H100 SXM: 18 active links per GPU
    fake_nvidia_smi(node, nvlink=False)  # a PCIe node: `nvidia-smi nvlink --status` prints nothing
    assert nvlink_lines(sweep) == [
        "no active NVLink on this host (`nvidia-smi nvlink --status` lists none): vLLM's KV READs between GPUs "
        "would run over tcp and fail the transport gate; UCX turns cuda_ipc GET off on GPUs without NVLink "
        '(cuda_ipc_iface.c uct_cuda_ipc_iface_get_max_get_zcopy); add `ucx: {UCX_CUDA_IPC_ENABLE_GET_ZCOPY: "y"}` '
        "to the sweep"
    ]
    text = sweep.read_text()
    sweep.write_text(text + 'ucx: {UCX_CUDA_IPC_ENABLE_GET_ZCOPY: "y"}\n')
    assert nvlink_lines(sweep) == []
    sweep.write_text(text)
    monkeypatch.setenv("UCX_CUDA_IPC_ENABLE_GET_ZCOPY", "y")
    assert nvlink_lines(sweep) == []
