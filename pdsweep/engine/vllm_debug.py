"""Diagnostics that pdsweep's vLLM plugin installs on request (never in a sweep by default).

``PDSWEEP_DEBUG_MLA_KV=1``: log a digest of the MLA latent cache rows a request uses, on
the side that writes them (prefill: ``CPUMLAImpl.do_kv_cache_update`` of a multi-token
step, rows of positions 0..N-2) and on the side that reads them (decode:
``CPUMLAImpl.forward_mqa``, rows 0..S-2 of the first request's block table), as

    PDSWEEP_KVDIGEST <write|read> layer=<k> rows=<n> sha1=<hex> first=<4 floats>

Equal digests for the same prompt on prefill (write) and decode (read) mean the
transferred bytes sit where decode's block table says; different digests locate a
transfer fault without reading NIXL. Source of the hooks: vLLM
``v1/attention/backends/mla/cpu_mla.py`` (``CPUMLAImpl``).
"""

from __future__ import annotations

import hashlib
import itertools
import logging
from typing import Any

logger = logging.getLogger("vllm.pdsweep.debug")
_ORDER = itertools.count()


def _layer(impl: Any) -> int:
    if not hasattr(impl, "_pdsweep_layer"):
        impl._pdsweep_layer = next(_ORDER)
    return impl._pdsweep_layer


def _digest(rows: Any) -> tuple[str, list[float]]:
    t = rows.float().contiguous()
    return hashlib.sha1(t.numpy().tobytes()).hexdigest()[:16], [round(float(x), 4) for x in t.flatten()[:4]]


def install_mla_kv_digest() -> bool:
    """Wrap ``CPUMLAImpl.do_kv_cache_update`` and ``forward_mqa``, ``MLAAttention.forward_impl``
    and ``MultiHeadLatentAttentionWrapper.forward`` (each wrapper a closure over the method it
    replaces, made by the ``_wrap_*`` factories below); False if vLLM's CPU MLA is absent."""
    try:
        from vllm.v1.attention.backends.mla.cpu_mla import CPUMLAImpl
    except Exception:  # noqa: BLE001
        return False
    from vllm.model_executor.layers.attention.mla_attention import MLAAttention
    from vllm.model_executor.layers.mla import MultiHeadLatentAttentionWrapper as W

    MLAAttention.forward_impl = _wrap_forward_impl(MLAAttention.forward_impl)
    W.forward = _wrap_latent_forward(W.forward)
    CPUMLAImpl.do_kv_cache_update = _wrap_kv_cache_update(CPUMLAImpl.do_kv_cache_update)
    CPUMLAImpl.forward_mqa = _wrap_forward_mqa(CPUMLAImpl.forward_mqa)
    return True


def _wrap_kv_cache_update(upd: Any) -> Any:
    """The write side: digest of the latent rows of positions 0..N-2 a multi-token step wrote."""

    def do_kv_cache_update(self, kv_c_normed, k_pe, kv_cache, slot_mapping, *a, **kw):
        out = upd(self, kv_c_normed, k_pe, kv_cache, slot_mapping, *a, **kw)
        slots = slot_mapping.flatten()
        slots = slots[slots >= 0].long()
        if kv_cache.numel() and slots.numel() > 1:
            flat = kv_cache.view(-1, kv_cache.shape[-1])
            sha, first = _digest(flat[slots[:-1]])
            logger.info(
                "PDSWEEP_KVDIGEST write layer=%d rows=%d sha1=%s first=%s", _layer(self), slots.numel() - 1, sha, first
            )
        return out

    return do_kv_cache_update


def _check_weights(impl: Any, layer: Any) -> None:
    """Once per layer: decode's ``W_UK_T``/``W_UV`` against the live ``kv_b_proj``."""
    import torch

    impl._pdsweep_w_checked = True
    L, N, P, V = impl.kv_lora_rank, impl.num_heads, impl.qk_nope_head_dim, impl.v_head_dim
    with torch.no_grad():
        live = layer.kv_b_proj(torch.eye(L, dtype=layer.W_UK_T.dtype))[0].view(L, N, P + V)
    uk, uv = live.split([P, V], dim=-1)
    logger.info(
        "PDSWEEP_KVDIGEST weights layer=%d W_UK_T%s vs live %.3g; W_UV%s vs live %.3g; "
        "kv_b_proj.weight%s stride %s; scale %.6g",
        _layer(impl),
        tuple(layer.W_UK_T.shape),
        (layer.W_UK_T - uk.permute(1, 2, 0)).abs().max().item(),
        tuple(layer.W_UV.shape),
        (layer.W_UV - uv.transpose(0, 1)).abs().max().item(),
        tuple(layer.kv_b_proj.weight.shape),
        layer.kv_b_proj.weight.stride(),
        impl.scale,
    )


def _wrap_forward_mqa(mqa: Any) -> Any:
    """The read side: digest of rows 0..S-2 of the first decode request's block table, then
    the kernel's output against plain torch attention on the same inputs."""

    def forward_mqa(self, q, kv_cache, attn_metadata, layer):
        import torch

        dec = attn_metadata.decode
        if dec is not None and kv_cache.numel():
            s = int(dec.seq_lens[0])
            bt = dec.block_table[0].long()
            bs = kv_cache.shape[1]
            pos = torch.arange(s - 1)
            rows = bt[pos // bs] * bs + pos % bs
            sha, first = _digest(kv_cache.view(-1, kv_cache.shape[-1])[rows])
            logger.info("PDSWEEP_KVDIGEST read layer=%d rows=%d sha1=%s first=%s", _layer(self), s - 1, sha, first)
        if not getattr(self, "_pdsweep_w_checked", False):
            _check_weights(self, layer)
        out, lse = mqa(self, q, kv_cache, attn_metadata, layer)
        if dec is not None and kv_cache.numel():
            qq = torch.cat(q, dim=-1) if isinstance(q, tuple) else q
            kv = kv_cache.view(-1, kv_cache.shape[-1])[bt[torch.arange(s) // bs] * bs + torch.arange(s) % bs].float()
            att = torch.softmax((qq[0].float() @ kv.T) * self.scale, -1)
            ref = att @ kv[:, : self.kv_lora_rank]
            logger.info(
                "PDSWEEP_KVDIGEST mqa layer=%d seq_len=%d kernel_vs_torch=%.3g q=%s cache=%s stride=%s bt=%s",
                _layer(self),
                s,
                (out[0].float() - ref).abs().max().item(),
                tuple(qq.shape),
                tuple(kv_cache.shape),
                kv_cache.stride(),
                dec.block_table[0, :4].tolist(),
            )
        return out, lse

    return forward_mqa


def _wrap_forward_impl(impl_fwd: Any) -> Any:
    """Sums of the last row of q, the latent, k_pe and the output of each MLA layer step."""

    # mirrors vLLM's MLAAttention.forward_impl (vllm/model_executor/layers/attention/mla_attention.py,
    # 13 parameters): the 6 it reads by name, the rest passed through
    def forward_impl(self, q, k_c_normed, k_pe, kv_cache, attn_metadata, output, *a, **kw):
        res = impl_fwd(self, q, k_c_normed, k_pe, kv_cache, attn_metadata, output, *a, **kw)
        if attn_metadata is not None and q.shape[0] > 0:
            f = lambda t: f"{float(t[-1].double().sum()):.6f}"  # noqa: E731
            logger.info(
                "PDSWEEP_KVDIGEST last-row %s n=%d q=%s kv_c=%s k_pe=%s out=%s",
                self.layer_name,
                q.shape[0],
                f(q),
                f(k_c_normed),
                f(k_pe),
                f(output),
            )
        return res

    return forward_impl


def _wrap_latent_forward(w_fwd: Any) -> Any:
    """Positions and k_pe before RoPE of each latent-attention wrapper step."""

    def w_forward(self, positions, hidden_states, *a, **kw):
        kv = self.kv_a_proj_with_mqa(hidden_states)[0] if self.kv_a_proj_with_mqa is not None else None
        pre = f"{float(kv[-1, self.kv_lora_rank :].double().sum()):.6f}" if kv is not None else "-"
        logger.info(
            "PDSWEEP_KVDIGEST rope %s n=%d positions[-3:]=%s k_pe_pre_rope=%s hidden=%s rope=%s",
            self.prefix,
            positions.shape[0],
            positions[-3:].tolist(),
            pre,
            f"{float(hidden_states[-1].double().sum()):.6f}",
            type(self.rotary_emb).__name__,
        )
        return w_fwd(self, positions, hidden_states, *a, **kw)

    return w_forward


def mq_state() -> list[str]:
    """One line per ``shm_broadcast.MessageQueue`` of this process: its role, ``current_idx``
    and the metadata of every ring chunk (written flag, then one read flag per reader), e.g.
    ``PDSWEEP_MQ pid=7 writer idx=3 n_reader=1 chunks=[10 10 10 11 00 ...]``. Source:
    vLLM ``distributed/device_communicators/shm_broadcast.py`` (``ShmRingBuffer.get_metadata``)."""
    import gc
    import os

    from vllm.distributed.device_communicators.shm_broadcast import MessageQueue

    out = []
    for mq in [o for o in gc.get_objects() if isinstance(o, MessageQueue)]:
        role = "writer" if getattr(mq, "_is_writer", False) else f"reader{getattr(mq, 'local_reader_rank', '?')}"
        buf = getattr(mq, "buffer", None)
        chunks = []
        if buf is not None:
            for i in range(buf.max_chunks):
                with buf.get_metadata(i) as m:
                    chunks.append("".join(str(int(x)) for x in m[: buf.n_reader + 1]))
        out.append(
            f"PDSWEEP_MQ pid={os.getpid()} {role} idx={getattr(mq, 'current_idx', '?')} "
            f"n_reader={getattr(buf, 'n_reader', '?')} chunks=[{' '.join(chunks)}]"
        )
    return out


def install_mq_dump() -> bool:
    """SIGUSR2 logs :func:`mq_state` (the handler runs on the main thread between its polls,
    within vLLM's 5 s shm poll timeout); False off the main thread, where no handler can be set.
    Also installs :func:`install_mq_tripwire` and a thread logging :func:`mq_state` and the
    executor's pending RPC futures every ``PDSWEEP_DEBUG_MQ_DUMP_S`` seconds (default 20)."""
    import os
    import signal
    import threading

    install_mq_tripwire()
    every = float(os.environ.get("PDSWEEP_DEBUG_MQ_DUMP_S", "20") or 20)
    threading.Thread(target=_dump_every, args=(every,), name="pdsweep-mq-dump", daemon=True).start()
    logger.warning("PDSWEEP_MQ debug on in pid=%d (%s)", os.getpid(), threading.current_thread().name)
    if threading.current_thread() is not threading.main_thread():
        return False

    def dump(signum: int, frame: Any) -> None:
        for line in mq_state():
            logger.warning("%s", line)

    signal.signal(signal.SIGUSR2, dump)
    return True


def _dump_every(seconds: float) -> None:
    import gc
    import time

    last: list[str] = []
    while True:
        time.sleep(seconds)
        lines = mq_state()
        for o in gc.get_objects():
            q = getattr(o, "futures_queue", None) if type(o).__name__ == "MultiprocExecutor" else None
            if q is not None:
                lines.append(f"PDSWEEP_MQ executor futures_queue={len(q)}")
        if lines != last:  # a ring that moves is not hung: log only changes
            for line in lines:
                logger.warning("%s", line)
            last = lines


def install_mq_tripwire() -> bool:
    """Log ``PDSWEEP_MQ_RACE`` with both threads' stacks when two threads are inside the same
    ``MessageQueue.enqueue``/``dequeue`` at once. vLLM's ring (``shm_broadcast.MessageQueue``:
    one ``current_idx``, no lock) assumes one writer thread and one reader thread per process;
    two concurrent ``enqueue`` calls write the same chunk and one request is lost."""
    import os
    import sys
    import threading
    import traceback

    from vllm.distributed.device_communicators.shm_broadcast import MessageQueue

    for name in ("enqueue", "dequeue"):
        orig = getattr(MessageQueue, name)

        def wrapper(self: Any, *args: Any, _orig: Any = orig, _name: str = name, **kwargs: Any) -> Any:
            me = threading.get_ident()
            users = self.__dict__.setdefault("_pdsweep_users", {})
            others = [t for t in list(users) if t != me]
            users[me] = _name
            if others:
                frames = sys._current_frames()
                theirs = "".join(traceback.format_stack(frames[others[0]])) if others[0] in frames else "?"
                logger.warning(
                    "PDSWEEP_MQ_RACE pid=%d %s by thread %d while thread %d is in %s\n%s--- the other thread ---\n%s",
                    os.getpid(), _name, me, others[0], users.get(others[0]),
                    "".join(traceback.format_stack()), theirs,
                )  # fmt: skip
            try:
                return _orig(self, *args, **kwargs)
            finally:
                users.pop(me, None)

        setattr(MessageQueue, name, wrapper)
    return True
