"""The KV integrity digest on the KV cache's own device (torch): 128 bits per region, many regions per op.

Used by :mod:`pdsweep.engine.kvdigest` for memory vLLM registered with NIXL on a CUDA device (the KV
cache tensors ``NixlBaseConnectorWorker.register_kv_caches`` registers, vLLM
``kv_connector/v1/nixl/base_worker.py``; host-staged buffers, ``host_xfer_buffers``, are host memory)
and, with ``PDSWEEP_KV_DIGEST_IMPL=torch``, for host memory too (the CPU dry run). Standard library,
numpy and torch only (the lent device runs it through ``scripts/device_check.py`` without vLLM).

**The digest** (``wsum-128``, ``pdsweep.core.kvlines.TORCH_DIGEST_NAME``) of a region of ``n``
bytes: its words ``x_0..x_{m-1}`` (int32, sign-extended to int64; bytes, when ``n`` or the address is
not a multiple of 4) and two fixed vectors of odd 64-bit weights ``w_k,i`` (:func:`weights`,
splitmix64 of the position): two lanes
``D_k = sum_i x_i * w_k,i mod 2**64``, printed as 32 hex digits. A change of one byte changes one word
by ``d`` with ``d != 0 mod 2**32``; an odd ``w`` is invertible mod ``2**64``, so ``d * w != 0`` and
both lanes change: one changed byte (or word) always changes the digest. Not a cryptographic hash:
two changed words can cancel (probability about ``2**-128`` per lane pair for unrelated changes).
Regions are compared only with regions of the same length (the join in
:mod:`pdsweep.core.kvintegrity` is on address and length), so the length is not mixed in.

**Batched**: regions of one length and word alignment in one registered storage are rows of one strided view (gathered
by one ``index_select`` unless they are consecutive), widened, multiplied by the two weight vectors
and summed per row: a few kernels per (storage, length) group and chunk, one device-to-host copy per
call.
"""

from __future__ import annotations

import bisect
from collections import defaultdict
from typing import TYPE_CHECKING, Any, Iterable

if TYPE_CHECKING:  # numpy, like torch, is imported where used: the device check's GPU-facts probe runs
    import numpy as np  # in a bare python 3.12 venv without either (tests/test_device_check_py312.py)

# words per reduction chunk: on a GPU 64 MiB of int32 (int64 temporaries of 128 MiB); on a CPU 1 MiB, so
# the int64 temporaries stay in cache (16 MiB in 64 KiB regions here: 4055 us/MiB against 8548 at 2**24)
CHUNK_WORDS = {"cuda": 1 << 24, "cpu": 1 << 18}
_MASK = (1 << 64) - 1
_WEIGHTS: dict[tuple[int, str], Any] = {}


def splitmix64(x: np.ndarray) -> np.ndarray:
    """splitmix64 (Steele, Lea, Flood 2014) of each uint64 in ``x``: the weights' generator."""
    import numpy as np

    with np.errstate(over="ignore"):
        z = x + np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


def weights_np(m: int) -> np.ndarray:
    """The (2, m) odd uint64 weights of positions ``0..m-1`` (lane k: splitmix64 of ``2 i + k``, low bit set)."""
    import numpy as np

    i = np.arange(m, dtype=np.uint64)
    return np.stack([splitmix64(2 * i) | np.uint64(1), splitmix64(2 * i + np.uint64(1)) | np.uint64(1)])


def weights(m: int, device: Any) -> Any:
    """:func:`weights_np` as an int64 (2, m) tensor on ``device`` (cached per length and device)."""
    import numpy as np
    import torch

    key = (m, str(device))
    if key not in _WEIGHTS:
        _WEIGHTS[key] = torch.from_numpy(weights_np(m).view(np.int64)).to(device)
    return _WEIGHTS[key]


def reference_digest(data: bytes) -> str:
    """The digest of ``data`` in pure Python (the tests' oracle): int32 words when its length is a
    multiple of 4, else bytes (as :func:`row_view` picks for an aligned region)."""
    import numpy as np

    step = 4 if len(data) % 4 == 0 else 1
    fmt = "<i4" if step == 4 else "u1"
    xs = np.frombuffer(data, dtype=fmt).astype(np.int64).tolist() if data else []
    w = weights_np(len(xs)).tolist()
    lanes = [sum(x * wk for x, wk in zip(xs, w[k])) & _MASK for k in (0, 1)]
    return f"{lanes[0]:016x}{lanes[1]:016x}"


def lanes_of(x: Any, w: Any) -> Any:
    """(n, 2) int64 lanes of the (n, m) int64 words ``x`` with the (2, m) weights ``w``."""
    import torch

    return torch.stack(((x * w[0]).sum(dim=1), (x * w[1]).sum(dim=1)), dim=1)


def hex_lanes(lanes: Any) -> list[str]:
    """32-hex-digit strings of (n, 2) int64 lanes (one device-to-host copy)."""
    return [f"{a & _MASK:016x}{b & _MASK:016x}" for a, b in lanes.cpu().tolist()]


def row_view(flat: Any, offsets: list[int], length: int) -> tuple[Any, Any]:
    """The regions ``[o, o + length)`` of the uint8 tensor ``flat`` as rows of one strided view (row
    stride: the gcd of the offsets' differences; int32 words when ``length`` and every offset are
    multiples of 4, ``flat``'s start being an allocation's, else bytes) and the regions' row indices
    (None when they are the view's rows in order: no gather needed)."""
    import numpy as np
    import torch

    byte_offs = np.asarray(offsets, dtype=np.int64)
    step = 4 if length % 4 == 0 and not (byte_offs % 4).any() else 1
    words = flat[: flat.numel() // 4 * 4].view(torch.int32) if step == 4 else flat  # whatever the storage's size
    offs = byte_offs // step
    lo, m = int(offs.min()), length // step
    g = int(np.gcd.reduce(offs - lo)) or 1
    rel = (offs - lo) // g
    view = words.as_strided((int(rel.max()) + 1, m), (g, 1), words.storage_offset() + lo)
    if len(rel) == view.shape[0] and (rel == np.arange(len(rel))).all():
        return view, None
    return view, torch.from_numpy(rel).to(flat.device)


def digest_tensor_regions(flat: Any, offsets: list[int], length: int) -> list[str]:
    """The digests of the regions ``[o, o + length)`` of the uint8 tensor ``flat`` (module doc): rows
    gathered (``index_select``; consecutive regions are read in place), widened to int64, weighted,
    summed, :data:`CHUNK_WORDS` words at a time."""
    import torch

    view, idx = row_view(flat, offsets, length)
    w = weights(view.shape[1], flat.device)
    per = max(1, CHUNK_WORDS.get(flat.device.type, 1 << 24) // max(1, view.shape[1]))
    parts = []
    for s in range(0, len(offsets), per):
        rows = view[s : s + per] if idx is None else torch.index_select(view, 0, idx[s : s + per])
        parts.append(lanes_of(rows.to(torch.int64), w))
    return hex_lanes(torch.cat(parts))


def storage_bytes(t: Any) -> Any:
    """A flat uint8 tensor over the whole storage of tensor ``t`` (what vLLM registers with NIXL)."""
    import torch

    st = t.untyped_storage()
    return torch.empty(0, dtype=torch.uint8, device=t.device).set_(st, 0, (st.nbytes(),), (1,))


def tensors_of(obj: Any) -> Iterable[Any]:
    """Every tensor in ``obj``: a tensor, or dicts, lists and tuples of them (vLLM's ``kv_caches``:
    one tensor per layer; a Mamba layer's a list of (conv, ssm) state tensors)."""
    if hasattr(obj, "untyped_storage"):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from tensors_of(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from tensors_of(v)


class StorageMap:
    """The storages of registered tensors by address: ``locate(addr, length)`` gives the flat uint8
    tensor and byte offset holding ``[addr, addr + length)``, or None (not registered: the caller falls
    back). ``devices``: the device types seen (``cuda``, ``cpu``)."""

    def __init__(self, tensors: Iterable[Any]) -> None:
        seen: dict[int, Any] = {}
        for t in tensors:
            seen.setdefault(int(t.untyped_storage().data_ptr()), t)
        self.spans = sorted((a, a + int(t.untyped_storage().nbytes()), storage_bytes(t)) for a, t in seen.items())
        self.starts = [s[0] for s in self.spans]
        self.devices = sorted({s[2].device.type for s in self.spans})

    def span_of(self, addr: int, length: int) -> int | None:
        """The index of the span holding ``[addr, addr + length)`` (bisect over the starts), or None."""
        s = bisect.bisect_right(self.starts, addr) - 1
        return s if s >= 0 and addr + length <= self.spans[s][1] else None

    def locate(self, addr: int, length: int) -> tuple[Any, int] | None:
        s = self.span_of(addr, length)
        return None if s is None else (self.spans[s][2], addr - self.spans[s][0])

    def on_device(self, addr: int) -> bool:
        """True when ``addr`` lies in a registered storage that is not host memory."""
        hit = self.locate(addr, 1)
        return hit is not None and hit[0].device.type != "cpu"

    def flip_byte(self, addr: int) -> bool:
        """Invert the byte at ``addr`` in its storage (the byte-flip drill on device); False if unknown."""
        hit = self.locate(addr, 1)
        if hit is None:
            return False
        flat, off = hit
        flat[off] = flat[off] ^ 0xFF
        return True

    def digest_many(self, regions: list[tuple[int, int]]) -> list[str | None]:
        """The digests of ``(addr, length)`` regions, batched per (storage, length, word alignment); None where a region
        is in no registered storage."""
        out: list[str | None] = [None] * len(regions)
        # (span, length, word-aligned) -> (i, offset): a region's digest is its own bytes', never its neighbours'
        groups: dict[tuple[int, int, bool], list[tuple[int, int]]] = defaultdict(list)
        for i, (addr, length) in enumerate(regions):
            if (s := self.span_of(addr, length)) is not None:
                groups[(s, length, (addr - self.starts[s]) % 4 == 0)].append((i, addr - self.starts[s]))
        for (s, length, _), items in groups.items():
            for (i, _), d in zip(items, digest_tensor_regions(self.spans[s][2], [o for _, o in items], length)):
                out[i] = d
        return out
