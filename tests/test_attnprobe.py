"""vLLM's own attention backend choice and kernel blocks for a target GPU
(pdsweep.builds.attnprobe, pdsweep.plan.blocks), asked of the installed vLLM 0.32.0 on a CPU
box; the plan of the mission sweep on a fake 8-GPU SM90 node (fake nvidia-smi)."""

from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest
from _fakegpu import fake_nvidia_smi, path_with

from pdsweep.builds import attnprobe
from pdsweep.plan import blocks
from pdsweep.plan.blocks import effective_blocks
from pdsweep.plan.expand import expand
from pdsweep.sweepfile.sweep import load_catalogue, load_sweep

pytest.importorskip("vllm.platforms.interface")

REPO = Path(__file__).resolve().parent.parent
SWEEPS = REPO / "sweeps"
CAT = load_catalogue(SWEEPS / "models.yaml").models
MISSION = SWEEPS / "hybrid-mla-mamba.yaml"


def test_sm90_picks_flash_attn_mla_whose_kernel_block_is_the_logical_block(monkeypatch):
    # vllm/platforms/cuda.py _get_backend_priorities: FLASH_ATTN_MLA first on SM90, MultipleOf(16)
    k = CAT["kimi-linear"]
    got = [effective_blocks(k, "cuda", tp, ["--block-size", "128"], nixl=True) for tp in (1, 2, 4)]
    assert [(e.backend, e.logical, e.kernel, e.arch) for e in got] == [
        ("FLASH_ATTN_MLA", 1920, 1920, "sm90"),
        ("FLASH_ATTN_MLA", 1024, 1024, "sm90"),
        ("FLASH_ATTN_MLA", 512, 512, "sm90"),
    ]
    assert got[0].backend_source == f"vLLM {attnprobe.vllm_version()}"
    # SM100: FLASHINFER_MLA first, exact kernel blocks (32, 64): 64 at every TP
    monkeypatch.setenv(blocks.ARCH_ENV, "sm100")
    e = effective_blocks(k, "cuda", 2, ["--block-size", "128"], nixl=True)
    assert (e.backend, e.logical, e.kernel, e.arch) == ("FLASHINFER_MLA", 1024, 64, "sm100")
    # GQA on SM90: FLASH_ATTN (MultipleOf(16))
    monkeypatch.setenv(blocks.ARCH_ENV, "sm90")
    q = effective_blocks(CAT["qwen3.5-0.8b"], "cuda", 1, ["--block-size", "128"], nixl=True)
    assert (q.backend, q.kernel == q.logical) == ("FLASH_ATTN", True)


def test_vllm_refuses_a_pinned_backend_on_the_wrong_arch_or_attention(monkeypatch):
    pin = ["--block-size", "128", "--attention-backend", "FLASHMLA"]
    monkeypatch.setenv(blocks.ARCH_ENV, "sm120")  # FlashMLABackend.supports_compute_capability: 9, 10
    with pytest.raises(blocks.BackendError, match=r"FLASHMLA is not valid .*compute capability not supported.*sm120"):
        effective_blocks(CAT["kimi-linear"], "cuda", 1, pin, nixl=True)
    monkeypatch.setenv(blocks.ARCH_ENV, "sm90")
    with pytest.raises(blocks.BackendError, match=r"non-MLA not supported"):
        effective_blocks(CAT["qwen3.5-0.8b"], "cuda", 1, pin, nixl=True)


def _sweep(tmp_path: Path, models_text: str, body: str):
    (tmp_path / "models.yaml").write_text(models_text)
    (tmp_path / "s.yaml").write_text(body)
    return load_sweep(tmp_path / "s.yaml")


def test_unpinned_kimi_hetero_tp_cells_are_refused_with_nixls_message(tmp_path):
    models = (SWEEPS / "models.yaml").read_text()
    unpinned = models.replace("    serve_args_by_arch: {sm90: [--attention-backend, FLASHMLA]}\n", "", 1)
    assert unpinned != models
    body = "name: k\nserve_args: {base: [--no-enable-prefix-caching]}\nmatrix:\n  model: [kimi-linear]\n"
    body += "  tp: [p1d1, p2d1, p4d1, p1d2, p4d2]\n  block_size: [128]\n"
    plan = expand(_sweep(tmp_path, unpinned, body))
    rej = {r.cell.id: r for r in plan.rejected}
    assert set(rej) == {f"kimi-linear.{t}.b128-128.fixed" for t in ("p2d1", "p4d1", "p1d2")}
    r = rej["kimi-linear.p2d1.b128-128.fixed"]
    assert r.rule == "block-ratio"
    assert "'Local block size 1920 is not divisible by remote block size 1024 or vice versa.'" in r.reason
    assert "(FLASH_ATTN_MLA)" in r.reason and "on sm90" in r.reason
    # p4d2: 1024 is a multiple of 512, vLLM's handshake accepts it
    assert {c.id for c in plan.pd_cells} == {"kimi-linear.p1d1.b128-128.fixed", "kimi-linear.p4d2.b128-128.fixed"}
    # the catalogue's pin (FLASHMLA, 64-token kernel blocks) lets all of them through
    plan = expand(_sweep(tmp_path, models, body))
    assert plan.rejected == [] and len(plan.pd_cells) == 5


def test_pinned_backend_on_an_arch_vllm_refuses_is_a_plan_rule(tmp_path, monkeypatch):
    monkeypatch.setenv(blocks.ARCH_ENV, "sm120")
    body = "name: k\nserve_args: {base: [--no-enable-prefix-caching, --attention-backend, FLASHMLA]}\n"
    body += "matrix:\n  model: [kimi-linear]\n  tp: [p2d2]\n  block_size: [128]\n"
    plan = expand(_sweep(tmp_path, (SWEEPS / "models.yaml").read_text(), body))
    (r,) = plan.rejected
    assert r.rule == "attention-backend"
    assert "Selected backend AttentionBackendEnum.FLASHMLA is not valid" in r.reason
    assert "compute capability not supported" in r.reason
    # the catalogue pins FLASHMLA for sm90 only (serve_args_by_arch): on sm120 Kimi plans unpinned
    body = body.replace(", --attention-backend, FLASHMLA", "")
    assert expand(_sweep(tmp_path, (SWEEPS / "models.yaml").read_text(), body)).rejected == []


def test_fallback_table_matches_vllms_kernel_block_sizes():
    """The table used where vLLM cannot be asked equals each backend's
    get_supported_kernel_block_sizes() (CUTLASS_MLA does not import without CUDA torch)."""
    checked = 0
    for name, b in blocks.BACKENDS.items():
        out = attnprobe.select((9, 0), use_mla="MLA" in name, head_size=576, dtype="bfloat16", selected=name)
        sizes = out["backends"][0]["sizes"]
        if sizes is None:
            assert name == "CUTLASS_MLA"
            continue
        assert (tuple(sizes["exact"]), sizes["multiple_of"]) == (b.exact, b.multiple_of), name
        checked += 1
    assert checked == len(blocks.BACKENDS) - 1


def test_kernel_block_matches_vllm_select_common_block_size():
    sys.modules.setdefault("vllm._C_stable_libtorch", types.ModuleType("vllm._C_stable_libtorch"))
    from vllm.v1.attention.backend import MultipleOf
    from vllm.v1.attention.backends.registry import AttentionBackendEnum
    from vllm.v1.worker.utils import select_common_block_size

    checked = set()
    for name in ("TRITON_ATTN", "FLASHMLA", "CPU_MLA", "CPU_ATTN", "TURBOQUANT", "FLASHINFER_MLA"):
        try:
            cls = AttentionBackendEnum[name].get_class()
        except ImportError:
            continue
        sizes = cls.get_supported_kernel_block_sizes()
        mult = next((s.base for s in sizes if isinstance(s, MultipleOf)), None)
        ours = blocks.Backend(name, tuple(s for s in sizes if isinstance(s, int)), mult)
        checked.add(name)
        for logical in (16, 32, 64, 96, 128, 256, 544, 1024, 1920):
            try:
                want: int | str = select_common_block_size(logical, [cls])
            except ValueError as e:
                want = str(e)
            try:
                got: int | str = blocks.kernel_block(logical, ours)
            except ValueError as e:
                got = str(e)
            assert got == want, (name, logical)
    assert {"TRITON_ATTN", "FLASHMLA", "TURBOQUANT"} <= checked  # TURBOQUANT: several exact sizes


def test_plan_on_a_fake_8gpu_sm90_node_shows_vllms_backend_and_refuses_nothing_vllm_accepts(tmp_path, monkeypatch):
    from pdsweep.run.dryrun import plan_dict

    monkeypatch.delenv(blocks.ARCH_ENV)
    monkeypatch.setenv("PATH", path_with(fake_nvidia_smi(tmp_path / "bin", n=8, cap="9.0")))
    blocks._nvidia_smi_arch.cache_clear()
    try:
        d = plan_dict(str(MISSION), None)
    finally:
        blocks._nvidia_smi_arch.cache_clear()
    assert d["gpus"] == 8 and d["gpu_arch"] == {"arch": "sm90", "source": "nvidia-smi"}
    version = f"vLLM {attnprobe.vllm_version()}"
    seen = {}
    for c in d["cells"]:
        for i in c.get("instances", []):
            b = i["blocks"]
            seen[c["model"]] = b["backend"]
            if c["model"] in ("kimi-linear", "deepseek-v2-lite-chat", "qwen3.5-0.8b"):
                assert b["backend_source"] == version and b["arch"] == "sm90"
        if c["kind"] == "pd" and c["model"] == "kimi-linear":
            p, dd = c["blocks"]["prefill"], c["blocks"]["decode"]
            assert (p["backend"], p["kernel"], dd["kernel"]) == ("FLASHMLA", 64, 64)
        if c["kind"] == "pd" and "error" not in c["blocks"]:
            p, dd = c["blocks"]["prefill"], c["blocks"]["decode"]
            if p["kernel"] and dd["kernel"]:  # TransferTopology.block_size_ratio on the decode side
                assert dd["kernel"] % p["kernel"] == 0, c["id"]
    assert seen["kimi-linear"] == "FLASHMLA"
    assert seen["deepseek-v2-lite-chat"] == "FLASH_ATTN_MLA" and seen["qwen3.5-0.8b"] == "FLASH_ATTN"
    assert seen["glm-5.3-flash-4l"] == "FLASHINFER_MLA_SPARSE_SM90"  # sparse MLA (tests/test_glm_sparse.py)
    rules = {r["cell_id"]: r["rule"] for r in d["rejected"]}
    assert set(rules.values()) == {"nixl-support", "hybrid-prefix-caching", "block-ratio"}
    assert all(c.startswith("glm-5.3-flash-4l.") for c, rule in rules.items() if rule == "block-ratio")


def test_gpu_arch_flag(capsys):
    from pdsweep.cli import build_parser
    from pdsweep.commands.args import gpu_arch

    assert gpu_arch("SM100") == "sm100"
    with pytest.raises(SystemExit) as e:
        build_parser(["plan"]).parse_args(["plan", "x.yaml", "--gpu-arch", "hopper"])
    assert e.value.code == 2 and "expected smXY" in capsys.readouterr().err
    assert blocks.parse_arch("sm90") == (9, 0) and blocks.parse_arch("sm103") == (10, 3)


def test_close_probes_ends_the_probe_process_and_keeps_the_answers(tmp_path, monkeypatch):
    """The probe has imported vLLM (hundreds of MB): it must not outlive planning
    (run_sweep closes it; before, it lived as long as the process and a later test's
    leftover-vLLM check found it). Starts from no answer anywhere (an empty store, no
    in-memory answer, no probe): else the version comes from the checkout's .cache or an
    earlier test and no probe starts."""
    import psutil

    from pdsweep.builds import answers

    attnprobe.close_probes()
    monkeypatch.setenv(answers.CACHE_ENV, str(tmp_path))
    answers.forget()
    attnprobe._version.cache_clear()
    try:
        version = attnprobe.vllm_version()
        (probe,) = attnprobe._PROBES.values()
        assert psutil.pid_exists(probe.proc.pid)
        attnprobe.close_probes()
        assert probe.proc.returncode is not None and not attnprobe._PROBES
        assert attnprobe.vllm_version() == version and not attnprobe._PROBES  # cached: no new probe
    finally:
        answers.forget()  # later tests read the real store again


def test_a_stubbed_kernel_module_does_not_spoil_later_answers_of_the_process():
    # vLLM's FLASHINFER_MLA imports flashinfer (absent here: stubbed) before vllm/utils/flashinfer.py
    # registers a custom op; torch's register_fake walks sys.modules with inspect.getmodule, which raised
    # TypeError on a stub without __file__ halfway through that import, and every later load of an MLA
    # backend in the process then failed on registering vllm::flashinfer_concat_mla_k twice
    probe = attnprobe._Probe(sys.executable)
    try:
        q = dict(attnprobe._LAYER_DEFAULTS, use_mla=True, head_size=576, dtype="bfloat16", num_heads=16)
        first = probe.ask({**q, "capability": [12, 0], "selected": "FLASHINFER_MLA"})
        assert first["backends"][0]["unverified"] == [] and first["backends"][0]["sizes"]["exact"] == [32, 64], first
        later = probe.ask({**q, "capability": [9, 0]})
        assert all(b["sizes"] is not None for b in later["backends"] if b["name"] != "FLASH_ATTN_MLA_SPARSE"), later
        assert later["backends"][0]["name"] == "FLASH_ATTN_MLA" and later["backends"][0]["sizes"]["multiple_of"] == 16
    finally:
        probe.close()


def test_a_backend_class_that_cannot_load_here_is_never_valid(monkeypatch):
    """Issue 56: on a fake B200 with vLLM 0.34.0, CUTLASS_MLA's module allocates a CUDA buffer at import
    ("Torch not compiled with CUDA enabled" here) and was taken as valid: a sparse model got a dense backend.
    vLLM's selector skips a backend whose import raises (platforms/cuda.py get_valid_backends); on the node it
    may load and win, so the next valid backend is chosen and the unloadable one named in ``unverified``."""
    unloadable = {
        "name": "CUTLASS_MLA",
        "reasons": [],
        "sizes": None,
        "unverified": ["AssertionError: Torch not compiled with CUDA enabled"],
    }
    answer = {
        "priorities": ["CUTLASS_MLA", "FLASHMLA", "FLASHINFER_MLA_SPARSE"],
        "backends": [
            unloadable,
            {
                "name": "FLASHMLA",
                "reasons": ["sparse not supported"],
                "unverified": [],
                "sizes": {"exact": [64], "multiple_of": None},
            },
            {
                "name": "FLASHINFER_MLA_SPARSE",
                "reasons": [],
                "unverified": [],
                "sizes": {"exact": [], "multiple_of": 32},
            },
        ],
    }
    monkeypatch.setattr(attnprobe, "select", lambda *a, **k: answer)
    monkeypatch.setattr(attnprobe, "vllm_version", lambda *a: "0.34.0")
    serve = blocks.Serve("bfloat16", "auto", 128, None, True)
    got = blocks.cuda_backend(CAT["glm-5.3-flash-4l"], 4, "sm100", serve)
    assert got is not None and (got.backend.name, got.source) == ("FLASHINFER_MLA_SPARSE", "vLLM 0.34.0")
    assert got.unverified == (
        "CUTLASS_MLA (ahead in vLLM's order) not checkable here: AssertionError: Torch not compiled with CUDA enabled",
    )
    answer["backends"] = [unloadable, answer["backends"][1]]  # nothing valid that loads: the table, said unverified
    got = blocks.cuda_backend(CAT["glm-5.3-flash-4l"], 4, "sm100", serve)
    assert got is not None and got.source == "pdsweep table" and got.unverified[0].startswith("CUTLASS_MLA")
