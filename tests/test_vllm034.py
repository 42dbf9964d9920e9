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
