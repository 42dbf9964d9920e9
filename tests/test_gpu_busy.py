"""Busy GPUs from nvidia-smi's process list and its memory.used, never total - free (issue 56): the
driver's own reserve (memory.reserved, ~500 MiB to 1.5 GiB per GPU on an idle node) is not use."""

from __future__ import annotations

import os

import pytest
from _fakes import fake_nvidia_smi

from pdsweep.plan.gpus import inventory, visible


@pytest.mark.parametrize("reserved", [500, 1536])
def test_an_idle_node_whose_driver_reserves_memory_is_not_refused(tmp_path, monkeypatch, reserved):
    bin_dir = fake_nvidia_smi(tmp_path / "bin", reserved_mib=reserved)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    inv = inventory()
    assert [(g.used_mib, g.reserved_mib, g.total_mib - g.free_mib) for g in inv.gpus[:1]] == [
        (3, reserved, reserved + 3)
    ]
    gpus, lines = visible(inv, {})
    assert [g.index for g in gpus] == list(range(8)) and lines == []


def test_a_gpu_with_a_foreign_compute_app_is_refused(tmp_path, monkeypatch):
    bin_dir = fake_nvidia_smi(tmp_path / "bin", reserved_mib=1536, busy={2: (4242, "python3", 600)})
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    gpus, lines = visible(inventory(), {})
    assert [g.index for g in gpus] == [0, 1, 3, 4, 5, 6, 7]
    assert lines == ["GPU 2 (GPU-00000002-fake) is in use by pid 4242 python3 (600 MiB): left out of this run"]
