"""The PD proxy's test-only faults (:class:`pdsweep.core.faults.ProxyFaults`), kept off the
forwarding path: :class:`pdsweep.deploy.proxy._Proxy` builds a :class:`FaultInjector` only when
a fault is on, and calls it between the prefill answer and the decode leg."""

from __future__ import annotations

from typing import Any

from prometheus_client import Counter

from pdsweep.core.faults import ProxyFaults


class FaultInjector:
    """Applies ``faults`` to decode legs; counts each injected one in ``counter{fault}``
    (``pdsweep_proxy_faults_total``). One event loop: the counters need no lock."""

    def __init__(self, faults: ProxyFaults, counter: Counter) -> None:
        self.faults, self.counter = faults, counter
        self.inflight = 0  # client requests in the proxy now (scramble_every: only under concurrency)
        self._under_load = 0
        self._decode_legs = 0  # decode legs started (decode_delay_every)
        self._last_kv: Any = None

    def decode_kv(self, kv: Any) -> Any:
        """The ``kv_transfer_params`` the decode leg gets: the prefill's own, unless ``stale``
        hands decode the *previous* request's (vllm 52234's stale-reference case) when it holds
        at least as many blocks per KV group (:func:`covers`; else, and for the first request,
        its own), ``scramble`` scrambles every one (:func:`scrambled`), ``scramble_every`` k
        scrambles 1 in k of the requests that arrive while another is in flight (corruption only
        under concurrency: the sequential probe never sees it)."""
        f = self.faults
        if f.stale_kv_transfer_params:
            prev, self._last_kv = self._last_kv, kv
            if prev is not None and covers(prev, kv):
                kv = prev
                self.counter.labels("stale").inc()
        if f.scramble_kv_block_ids:
            self.counter.labels("scramble").inc()
            return scrambled(kv)
        if f.scramble_every and self.inflight > 1:
            self._under_load += 1
            if self._under_load % f.scramble_every == 0:
                self.counter.labels("scramble_under_load").inc()
                return scrambled(kv)
        return kv

    def delays_decode(self) -> bool:
        """Whether this decode leg sleeps ``faults.decode_delay_s`` first: 1 in
        ``faults.decode_delay_every`` legs, from the first."""
        if not self.faults.decode_delay_s:
            return False
        self._decode_legs += 1
        if (self._decode_legs - 1) % self.faults.decode_delay_every:
            return False
        self.counter.labels("decode_delay").inc()
        return True


def covers(old: Any, new: Any) -> bool:
    """Whether handle ``old`` lists at least as many ``remote_block_ids`` as ``new`` in every KV
    group (flat lists: one group). vLLM asserts it (``base_worker.py`` ``_apply_prefix_caching``,
    ``assert num_decode_blocks <= len(prefill_group)``) and the decode worker dies otherwise, so
    a stale handle that decode can actually read must cover the new request."""

    def groups(kv: Any) -> list[int] | None:
        ids = kv.get("remote_block_ids") if isinstance(kv, dict) else None
        if not isinstance(ids, list):
            return None
        return [len(g) for g in ids] if ids and isinstance(ids[0], list) else [len(ids)]

    a, b = groups(old), groups(new)
    return a is not None and b is not None and len(a) == len(b) and all(x >= y for x, y in zip(a, b))


def scrambled(kv: dict[str, Any] | None) -> dict[str, Any] | None:
    """``kv`` with ``remote_block_ids`` reversed (each group's list for hybrid KV caches):
    decode then reads the right blocks in the wrong order, i.e. KV that arrived wrong.
    Tests only: proves the consistency probe catches corrupted transfers. Keys carry
    their RoPE position, so attention over *full* blocks is order-invariant; what
    corrupts the output is the partial last block landing first (its empty slots read
    as tokens, the first block's tail lost): strongest for prompts of a few blocks."""
    if not kv or not isinstance(kv.get("remote_block_ids"), list):
        return kv
    ids = kv["remote_block_ids"]
    ids = [list(reversed(g)) for g in ids] if ids and isinstance(ids[0], list) else list(reversed(ids))
    return {**kv, "remote_block_ids": ids}
