"""Which requests the KV integrity digests cover, and what they cost in TTFT (docs/integrity.md, "Cost").

CPU sweeps digest every transferred request. A GPU sweep opts in per sweep (``integrity: {gpu: true}``,
:class:`pdsweep.sweepfile.integrityspec.IntegritySpec`) and digests a sampled fraction of requests:
``PDSWEEP_KV_DIGEST_SAMPLE`` on every prefill and decode instance. Both sides decide per prefill
request id with :func:`sampled` (CRC-32 of the id, so prefill and decode agree without talking);
a sampled-out request logs one line with no digests and is counted apart (transfer.json
``integrity.sampled_out``), never compared.

The default fraction :data:`DEFAULT_GPU_SAMPLE` is an **estimate** until a GPU measures it
(``scripts/device_check.py``'s digest step prints the measured GB/s and TTFT share): added TTFT
share <= ``fraction x 2 x prefill KV GB/s / digest GB/s`` (:func:`ttft_share`: prefill and decode
each digest a request's KV bytes once; the KV bytes of a request over its prefill time is the rate
prefill writes KV, so the share is bounded by that rate over the digest's). Standard library only:
the lent device imports it without pydantic or vLLM.
"""

from __future__ import annotations

import zlib
from typing import Any

SAMPLE_ENV_VAR = "PDSWEEP_KV_DIGEST_SAMPLE"  # fraction of requests digested (absent: all)
IMPL_ENV_VAR = "PDSWEEP_KV_DIGEST_IMPL"  # "torch": the torch digest on host memory too (the CPU dry run)
SAMPLED_OUT_STATE = "SAMPLED_OUT"  # decode's landed line of a request :func:`sampled` leaves out
TTFT_SHARE_TARGET = 0.02  # issue 58: the digests may add at most 2 % to TTFT
# The estimate behind the default (docs/integrity.md, "Cost"): the torch digest took 8.9x and 14.0x a
# copy's time per byte in two runs of bench/test_integrity_overhead.py (2-core AMD EPYC host at load
# average 6, torch on one CPU thread: 642 and 903 us/MiB against 72 and 65); the larger ratio against an
# H100's ~1.5 TB/s device-to-device copy gives ~107 GB/s, taken as 100 (on a GPU the digest is
# memory-bound: ~84 bytes of traffic per 4-byte word, ~140 GB/s at 3 TB/s). Prefill writing KV at
# ~2.5 GB/s: a dense 8B model (128 KiB of KV per token) at ~20k prompt tokens/s; MLA and hybrid models
# write far less per token.
ESTIMATED_DIGEST_GBPS = 100.0
ESTIMATED_PREFILL_KV_GBPS = 2.5
DEFAULT_GPU_SAMPLE = 0.25  # ttft_share(0.25, 100, 2.5) = 1.25 % (an estimate until measured on a GPU)


def sampled(req: str, fraction: float) -> bool:
    """True when the request with prefill request id ``req`` is digested at ``fraction`` (0 < f <= 1):
    its CRC-32 below ``fraction x 2**32`` (the same answer in every process)."""
    return fraction >= 1 or zlib.crc32(req.encode()) < fraction * 2**32


def parse_fraction(raw: str | None) -> float:
    """:data:`SAMPLE_ENV_VAR`'s value as a fraction; absent or empty: 1. Raises ``ValueError`` outside (0, 1]."""
    if raw is None or not raw.strip():
        return 1.0
    f = float(raw)
    if not 0 < f <= 1:
        raise ValueError(f"{SAMPLE_ENV_VAR}={raw!r}: allowed 0 < fraction <= 1")
    return f


def ttft_share(fraction: float, digest_gbps: float, prefill_kv_gbps: float = ESTIMATED_PREFILL_KV_GBPS) -> float:
    """Upper bound of the mean TTFT the digests add, as a share of TTFT (module doc)."""
    return fraction * 2 * prefill_kv_gbps / digest_gbps


def fraction_for(digest_gbps: float, prefill_kv_gbps: float = ESTIMATED_PREFILL_KV_GBPS) -> float:
    """The largest fraction (at most 1) whose :func:`ttft_share` stays at :data:`TTFT_SHARE_TARGET`."""
    return min(1.0, TTFT_SHARE_TARGET * digest_gbps / (2 * prefill_kv_gbps))


def sampled_apart(offers: list[Any], landed: list[Any]) -> tuple[list[Any], list[Any], dict[str, Any]]:
    """The parsed offer and landed lines (:mod:`pdsweep.core.kvintegrity`) of the requests the digests sampled, and
    ``{"impl": digests named on the lines, "sample": the fraction, "sampled_out": requests left out}``."""
    out = {o["req"] for o in offers if o["sampled_out"]} | {r["req"] for r in landed if r["state"] == SAMPLED_OUT_STATE}
    impls = sorted({x["impl"] for x in offers + landed if x["req"] not in out} or {o["impl"] for o in offers})
    fraction = min((o["sample"] for o in offers), default=1.0)
    keep_o, keep_l = [o for o in offers if o["req"] not in out], [r for r in landed if r["req"] not in out]
    return keep_o, keep_l, {"impl": impls, "sample": fraction, "sampled_out": len(out)}
