"""Fixtures shared by several test modules. Module-scoped, as they were in each module:
every module gets its own copy, so a test that edits one cannot leak into another file. Also the
NIXL fakes the KV digest tests share (:class:`FakeNixl`, :func:`kv_worker`)."""

from __future__ import annotations

import os
import types
from pathlib import Path

import numpy as np
import pytest
from _fakes import build_tokenizer
from fixtures.make_runs import write_all
from hypothesis import settings

from pdsweep.engine import kvdigest as K

# `make test` (CI, every commit) sets PDSWEEP_HYPOTHESIS_PROFILE=per-commit: every property test
# draws the same examples on every run, so a red CI means the commit changed something, not that
# a new random draw found an old bug (stop 30's CI: a 0 TP in cell.json, drawn once). `make
# test-all` (the nightly) keeps Hypothesis's default: a new draw each night explores further.
settings.register_profile("per-commit", derandomize=True)
settings.load_profile(os.environ.get("PDSWEEP_HYPOTHESIS_PROFILE", "default"))


@pytest.fixture(scope="session", autouse=True)
def _history_outside_the_checkout(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Runs made by tests append to a throwaway history store, never results/history.sqlite."""
    import os

    os.environ["PDSWEEP_HISTORY"] = str(tmp_path_factory.mktemp("history") / "history.sqlite")


@pytest.fixture(scope="session", autouse=True)
def _fake_build_runs_this_python() -> None:
    """tests/fake_build/python hands non-vLLM commands to this interpreter (not the PATH's python3)."""
    import os
    import sys

    os.environ["PDSWEEP_REAL_PYTHON"] = sys.executable


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The committed fixture runs (:func:`fixtures.make_runs.write_all`): run name -> run
    directory (``all-pass``, ``mixed``, ``fixed``, ``unfixed``, ``mission``)."""
    return write_all(tmp_path_factory.mktemp("runs"))


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Directory of a small byte-level BPE tokenizer (:func:`_fakes.build_tokenizer`)."""
    return build_tokenizer(tmp_path_factory.mktemp("tok"))


@pytest.fixture(autouse=True)
def _gpu_arch_sm90(monkeypatch: pytest.MonkeyPatch) -> None:
    """Plans of CUDA sweeps compute vLLM's backend for sm90 (Hopper), whatever GPU (or none)
    the test machine has (pdsweep.plan.blocks.target_arch); a test may set another."""
    monkeypatch.setenv("PDSWEEP_GPU_ARCH", "sm90")


def _vllm_descendants() -> dict[int, str]:
    """pid -> command line of this pytest's descendants that look like a (fake) vLLM server."""
    import psutil

    from pdsweep.builds import attnprobe

    # the backend probes plan-only tests share (one per interpreter, closed at exit; run_sweep
    # closes them once its plan is made: tests/test_gpu_reuse.py checks that)
    probes = {p.proc.pid for p in attnprobe._PROBES.values()}
    out: dict[int, str] = {}
    for p in psutil.Process().children(recursive=True):
        if p.pid in probes:
            continue
        try:
            cmd = " ".join(p.cmdline())
        except psutil.Error:
            continue
        if "vllm" in cmd:
            out[p.pid] = cmd
    return out


@pytest.fixture(autouse=True)
def _no_leaked_vllm_process() -> object:
    """Teardown never leaves an orphan: a (fake) vLLM process a test started and left running
    fails that test (named here, not in whichever later test checks for leftovers) and is killed,
    so one leak cannot fail the tests after it."""
    import time

    import psutil

    before = set(_vllm_descendants())
    yield
    deadline = time.monotonic() + 10  # a SIGTERMed server may still be exiting
    while (left := {p: c for p, c in _vllm_descendants().items() if p not in before}) and time.monotonic() < deadline:
        time.sleep(0.2)
    for pid in left:
        try:
            psutil.Process(pid).kill()
        except psutil.Error:
            pass
    assert not left, f"the test left (fake) vLLM processes running (killed now): {left}"


@pytest.fixture(scope="session")
def maintainer_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The 768-combination maintainer sweep of issue 37 as a run (808 cells with references:
    :func:`fixtures.make_runs.write_maintainer`)."""
    from fixtures.make_runs import write_maintainer

    return write_maintainer(tmp_path_factory.mktemp("maintainer"))


def make_hub_snapshot(cache: Path, repo_id: str, files: dict[str, str], incomplete: int = 0) -> Path:
    """One model in a fake HF hub cache laid out as huggingface_hub writes it (``models--org--name``:
    ``blobs/``, ``refs/main``, ``snapshots/<commit>/`` linking blobs); ``incomplete``: that many
    ``blobs/*.incomplete`` (an interrupted download). Returns the snapshot directory."""
    import hashlib

    repo = cache / f"models--{repo_id.replace('/', '--')}"
    commit = hashlib.sha1(repo_id.encode()).hexdigest()
    snap = repo / "snapshots" / commit
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(commit)
    snap.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        blob = repo / "blobs" / hashlib.sha256(f"{repo_id}/{name}/{text}".encode()).hexdigest()
        blob.write_text(text)
        (snap / name).parent.mkdir(parents=True, exist_ok=True)
        (snap / name).unlink(missing_ok=True)
        (snap / name).symlink_to(blob)
    for i in range(incomplete):
        (repo / "blobs" / f"{i:064x}.incomplete").write_text("partial bytes")
    return snap


@pytest.fixture
def hub_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty fake HF hub cache, set as ``HF_HUB_CACHE`` (fill it with :func:`make_hub_snapshot`)."""
    from huggingface_hub import constants  # imported before the env is set: it reads HF_HUB_CACHE once, at import

    cache = tmp_path / "hub"
    cache.mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))  # restored after the test, like the env
    return cache


class FakeNixl:
    """NIXL's ``nixl_agent`` surface vLLM's pull and push workers use (descriptor lists, transfers, their
    state); tests wrap it with :mod:`pdsweep.engine.kvdigest`'s and :mod:`~pdsweep.engine.kvpushdigest`'s wrappers."""

    def get_xfer_descs(self, descs, mem_type=None):
        return object()

    def prep_xfer_dlist(self, agent_name, xfer_list, mem_type=None):
        return len(K._DLISTS) + 100

    def make_prepped_xfer(self, op, local, lids, remote, rids, notif_msg=b""):
        return ("xfer", op, tuple(lids))

    def check_xfer_state(self, handle):
        return "DONE"


def kv_worker(
    base: int, tp_rank: int = 0, agent: str = "agent", memory_type: str = "DRAM", world_size: int = 1
) -> types.SimpleNamespace:
    """A NIXL worker with two regions (K and V) of 10 blocks of 32 B each from address ``base`` (20
    ``src_blocks_data`` rows) and vLLM's own ``NixlBaseConnectorWorker._compute_desc_ids`` and
    ``_logical_to_kernel_block_ids`` (``nixl/base_worker.py``) bound to it."""
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_worker import NixlBaseConnectorWorker
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    w = types.SimpleNamespace(
        _has_mamba=False, _transfer_layer_group_ids=[], num_regions=2, block_len_per_layer=[32, 32],
        region_group_ids=[0, 0], _uses_region_group_mapping=False, _physical_blocks_per_logical_kv_block=1,
        dst_num_blocks={"E": 10}, dst_region_num_blocks={}, engine_id="E", _group_spec_types=(FullAttentionSpec,),
        src_blocks_data=np.array([[base + 32 * i, 32, 0] for i in range(20)], dtype=np.uint64), use_mla=False,
        tp_rank=tp_rank, world_size=world_size, nixl_memory_type=memory_type,
        nixl_wrapper=types.SimpleNamespace(name=agent),
    )  # fmt: skip
    w._compute_desc_ids = types.MethodType(NixlBaseConnectorWorker._compute_desc_ids, w)
    w._logical_to_kernel_block_ids = types.MethodType(NixlBaseConnectorWorker._logical_to_kernel_block_ids, w)
    return w
