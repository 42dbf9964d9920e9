"""What both sides of the transfer benchmark agree on: the byte pattern prefill ranks
write and decode ranks verify (:func:`pattern`), where each region's pages lie in a
rank's buffer (:class:`RankLayout`), the page ids of each request (:class:`Requests`),
and the registered buffer itself (:class:`Buffer`, DRAM or VRAM). Units: bytes."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pdsweep.core.errors import UserError
from pdsweep.plan.geometry import KVGeometry

SENTINEL = 0xFF  # decode memory starts as this; pattern bytes are 0..254, so an unread byte shows
_ALIGN = 4096
_M1 = np.uint64(0xFF51AFD7ED558CCD)
_M2 = np.uint64(0xC4CEB9FE1A85EC53)
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


# ---------------------------------------------------------------- pattern and layout
def pattern(region: int, pages: np.ndarray, start: int, stop: int, seed: int = 0) -> np.ndarray:
    """Bytes ``[start, stop)`` of the TP1 page ``pages`` (prefill page ids) of region
    ``region``: a ``(len(pages), stop - start)`` uint8 array, values 0..254 (never
    :data:`SENTINEL`). Deterministic in (seed, region, page, byte offset)."""
    pages = np.asarray(pages, dtype=np.uint64)
    w0, w1 = start // 4, (stop + 3) // 4
    keys = (np.uint64(seed) << np.uint64(48)) + (np.uint64(region) << np.uint64(24)) + pages
    x = keys[:, None] * _GOLDEN + np.arange(w0, w1, dtype=np.uint64)[None, :]
    x ^= x >> np.uint64(33)
    x *= _M1
    x ^= x >> np.uint64(33)
    x *= _M2
    x ^= x >> np.uint64(33)
    out = x.astype(np.uint32).view(np.uint8)[:, start - 4 * w0 : stop - 4 * w0]
    return np.ascontiguousarray(out % np.uint8(255))


@dataclass(frozen=True)
class RankLayout:
    """Where each region's page pool lies in one rank's buffer (bytes)."""

    tp: int
    rank: int
    offsets: tuple[int, ...]
    page_bytes: tuple[int, ...]
    pool: tuple[int, ...]
    nbytes: int

    def page_addr(self, base: int, region: int, page: np.ndarray | int) -> np.ndarray:
        return base + self.offsets[region] + np.asarray(page, dtype=np.uint64) * self.page_bytes[region]


def rank_layout(geometry: KVGeometry, tp: int, rank: int, attn_pool: int, ssm_pool: int) -> RankLayout:
    """Regions one after another, each ``pool x page_bytes``, 4 KiB aligned."""
    offsets, pages, pools, off = [], [], [], 0
    for reg in geometry.regions:
        n = ssm_pool if reg.per_request else attn_pool
        offsets.append(off)
        pages.append(reg.page_bytes(tp))
        pools.append(n)
        off += -(-n * reg.page_bytes(tp) // _ALIGN) * _ALIGN
    return RankLayout(tp, rank, tuple(offsets), tuple(pages), tuple(pools), off)


@dataclass(frozen=True)
class Requests:
    """Page ids per request: ``*_blocks[q]`` attention blocks, ``*_slots[q]`` SSM slot.
    Prefill ids are shared by all prefill ranks (one scheduler), decode ids by all
    decode ranks; both are random permutations of their pools."""

    prefill_blocks: tuple[tuple[int, ...], ...]
    decode_blocks: tuple[tuple[int, ...], ...]
    prefill_slots: tuple[int, ...]
    decode_slots: tuple[int, ...]
    attn_pool: int
    ssm_pool: int


def make_requests(requests: int, blocks: int, seed: int = 0) -> Requests:
    """``requests`` requests of ``blocks`` blocks each, from pools of
    ``requests * blocks + max(1, blocks // 2)`` blocks and ``requests + 1`` slots."""
    if requests < 1 or blocks < 1:
        raise ValueError(f"requests and blocks must be >= 1 (got {requests}, {blocks})")
    rng = np.random.default_rng(seed)
    attn_pool, ssm_pool = requests * blocks + max(1, blocks // 2), requests + 1
    pb, db = rng.permutation(attn_pool), rng.permutation(attn_pool)
    ps, ds = rng.permutation(ssm_pool), rng.permutation(ssm_pool)

    def split(a: np.ndarray) -> tuple[tuple[int, ...], ...]:
        return tuple(tuple(int(x) for x in a[q * blocks : (q + 1) * blocks]) for q in range(requests))

    prefill_slots, decode_slots = tuple(int(x) for x in ps[:requests]), tuple(int(x) for x in ds[:requests])
    return Requests(split(pb), split(db), prefill_slots, decode_slots, attn_pool, ssm_pool)


# ---------------------------------------------------------------- memory
class Buffer:
    """One registered buffer: host numpy (DRAM) or a torch CUDA tensor (VRAM)."""

    def __init__(self, nbytes: int, device: str, gpu: int = 0):
        self.device, self.gpu = device, gpu
        if device == "cuda":
            import torch

            self.tensor = torch.empty(nbytes, dtype=torch.uint8, device=f"cuda:{gpu}")
            self.addr, self.mem, self.dev = self.tensor.data_ptr(), "VRAM", gpu
            self.host = np.empty(nbytes, dtype=np.uint8)  # staging image
        else:
            self.host = np.empty(nbytes, dtype=np.uint8)
            self.addr, self.mem, self.dev = self.host.ctypes.data, "DRAM", 0
        self.nbytes = nbytes

    def push(self) -> None:
        """Host image -> device (no-op for DRAM)."""
        if self.device == "cuda":
            import torch

            self.tensor.copy_(torch.from_numpy(self.host))
            torch.cuda.synchronize(self.gpu)

    def pull(self) -> np.ndarray:
        """Device -> host image; returns it."""
        if self.device == "cuda":
            import torch

            torch.cuda.synchronize(self.gpu)
            self.host[:] = self.tensor.cpu().numpy()
        return self.host

    def reset(self) -> None:
        if self.device == "cuda":
            self.tensor.fill_(SENTINEL)
        else:
            self.host.fill(SENTINEL)


def check_device(device: str) -> None:
    """Raise ``UserError`` when ``device`` cannot be used here (``cuda`` needs torch with
    CUDA and a visible GPU)."""
    if device == "cpu":
        return
    if device != "cuda":
        raise UserError(f"device must be cpu or cuda, got {device!r}")
    try:
        import torch
    except ImportError:
        raise UserError("--device cuda needs torch with CUDA; torch is not importable") from None
    if not torch.cuda.is_available():
        raise UserError(f"--device cuda needs torch with CUDA; torch {torch.__version__} sees no CUDA device")
