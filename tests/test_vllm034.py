"""vLLM 0.34.0 (constraints/gpu.txt) on paper: the attention/block probe and the argv
check's parser lookup run against the 0.34.0 wheel's own code, through a build made with
``pdsweep builds make --wheel vllm-0.34.0-cp38-abi3-manylinux_2_28_x86_64.whl --deps-from
.venv/bin/python`` (the CUDA wheel's Python code over this venv's torch; ~35 s, 239 MB
download). Opt-in: set PDSWEEP_VLLM034_PYTHON to that build's bin/python (tests never
download)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from pdsweep.builds import attnprobe

PY = os.environ.get("PDSWEEP_VLLM034_PYTHON")
REPO = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.skipif(not PY, reason="PDSWEEP_VLLM034_PYTHON: a vLLM 0.34.0 build's python (module doc)")
pytest.importorskip("vllm.platforms.interface")


@pytest.mark.parametrize(("use_mla", "head_size"), [(True, 576), (False, 128)])
@pytest.mark.parametrize("cap", [(9, 0), (10, 0)])
def test_backend_choice_and_kernel_blocks_of_034_are_those_of_the_installed_vllm(use_mla, head_size, cap) -> None:
    assert PY is not None
    assert attnprobe.vllm_version(PY) == "0.34.0"
    kw = dict(use_mla=use_mla, head_size=head_size, dtype="bfloat16", block_size=128)
    new = attnprobe.select(cap, python=PY, **kw)
    old = attnprobe.select(cap, python=sys.executable, **kw)
    assert new["priorities"] and new["priorities"] == old["priorities"]
    assert [(b["name"], b["sizes"], b["reasons"]) for b in new["backends"]] == [
        (b["name"], b["sizes"], b["reasons"]) for b in old["backends"]
    ]


def test_argcheck_finds_the_serve_parser_of_034() -> None:
    """The 0.34.0 probe finds ``make_arg_parser`` in ``vllm.entrypoints.common.cli_args``; the
    CUDA wheel may not build it on a CPU box ("Failed to infer device type"), which names it."""
    from pdsweep.builds import argcheck
    from pdsweep.core.errors import UserError

    assert PY is not None
    try:
        argcheck.check_argv(["serve", "/m", "--block-size", "16"], PY)  # a verdict: the parser was built
    except UserError as e:
        assert "vllm.entrypoints.common.cli_args.make_arg_parser" in str(e), str(e)


# ---------------------------------------------------------------- issue 56: every GPU fact vLLM's, or named unverified
# The mission plan on fake 8-GPU nodes, made by each build's own interpreter (``python -m pdsweep plan``: the
# plan asks the vLLM of the interpreter it runs in). Cells per node and vLLM build, as docs/gpu-nodes.md and
# docs/baseline.md quote them.
BUILDS = {"0.34.0": PY, "0.33.0": os.environ.get("PDSWEEP_VLLM033_PYTHON")}
NODE_SMI = {
    "h100": {},
    "h200": {"name": "NVIDIA H200", "total_mib": 143771},
    "b200": {"name": "NVIDIA B200", "cap": "10.0", "total_mib": 183359},
}
CELLS = {(v, n): c for v in ("0.34.0", "0.33.0") for n, c in (("h100", 46), ("h200", 46), ("b200", 44))}
KDA_MLA = ("kimi-linear", "glm-5.3-flash-4l")  # the models whose blocks vLLM's own code answers here


def plan_with(version: str, node: str, tmp: Path, cache: Path) -> dict:
    import json
    import subprocess

    from _fakesmi import fake_nvidia_smi

    python = BUILDS[version]
    if not python:
        pytest.skip(f"PDSWEEP_VLLM0{version.split('.')[1]}_PYTHON: a vLLM {version} build's python (module doc)")
    smi = fake_nvidia_smi(tmp / node, **NODE_SMI[node])
    env = {
        **os.environ,
        "PATH": f"{smi}:{os.environ['PATH']}",
        "PYTHONPATH": str(REPO),
        "HF_HOME": str(tmp / "hf"),
        "PDSWEEP_PROBE_CACHE": str(cache),
    }
    for k in ("CUDA_VISIBLE_DEVICES", "PDSWEEP_GPU_ARCH"):
        env.pop(k, None)
    cmd = [python, "-m", "pdsweep", "plan", "sweeps/hybrid-mla-mamba.yaml", "--no-check-argv", "--format", "json"]
    out = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout)


@pytest.fixture(scope="module")
def probe_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("probes")


@pytest.mark.parametrize("node", list(NODE_SMI))
@pytest.mark.parametrize("version", list(BUILDS))
def test_plan_blocks_of_kda_hybrids_are_vllms_own_on_each_node(version, node, tmp_path, probe_cache) -> None:
    """No ``blocks_source: pdsweep`` (nor ``unverified``) for a model vLLM's code answers: the hybrid block
    call runs on vLLM's default VllmConfig (0.34.0 reads use_flashinfer_replayssm), GLM's over its indexer
    and tail backends too. A backend vLLM's checks cannot decide here is named in ``unverified``."""
    d = plan_with(version, node, tmp_path, probe_cache)
    wrong, unverified = [], {}
    for c in [*d["cells"]]:
        for i in c.get("instances", []):
            b = i["blocks"]
            if c["model"] in KDA_MLA and not b["blocks_source"].startswith(f"vLLM {version} Platform._align_hybrid"):
                wrong.append(f"{c['id']} {i['name']}: blocks_source {b['blocks_source']}")
            for u in b.get("unverified", ()):
                unverified.setdefault(c["model"], set()).add(u)
    assert not wrong, wrong[:5]
    assert "kimi-linear" not in unverified, unverified.get("kimi-linear")  # Kimi: every fact vLLM's
    for c in d["cells"]:  # plan.json says it per cell too
        said = {u.split(": ", 1)[1] for u in c["unverified"]}
        assert {u for i in c.get("instances", []) for u in i["blocks"]["unverified"]} <= said, c["id"]
    p1d1 = next(c for c in d["cells"] if c["id"] == "glm-5.3-flash-4l.p1d1.b128-128.fixed")
    assert {(b["logical"], b["kernel"]) for b in p1d1["blocks"].values()} == {(4608, 4608)}  # 512-aligned
    if (version, node) in CELLS:
        assert len(d["cells"]) == CELLS[version, node]
