"""The PD proxy's test-only faults, a plain value (no FastAPI import) that a sweep's options
carry to :class:`pdsweep.deploy.proxy.ProxyServer`."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Faults:
    """Test-only faults the PD proxy injects into decode legs (``pdsweep.deploy.proxy._Proxy.decode_kv``);
    each injected one counts in ``pdsweep_proxy_faults_total{fault}``.

    ``drop_kv_transfer_params``: the decode leg goes without the prefill's handle, so decode
    recomputes the prompt (the transfer gate must catch it); ``scramble_kv_block_ids``: every
    handle's block ids reversed, KV arrives wrong (the consistency probe must);
    ``scramble_every`` k: 1 in k requests arriving while another is in flight (the load check
    must); ``stale_kv_transfer_params``: decode gets the previous request's handle (the
    ``stale`` check must); ``decode_delay_s``: sleep before each decode leg, a controlled TTFT
    and E2E slowdown (bench/test_perf_teeth.py), or, with ``decode_delay_every`` k > 1, before
    1 in k decode legs (the 1st, the (k+1)th, ...: the lease-expiry drill, whose other requests
    keep prefill allocating while the held ones wait, :mod:`pdsweep.run.drills`). Raises
    ValueError for ``scramble_every < 0``, ``decode_delay_s < 0`` or ``decode_delay_every < 1``.
    """

    drop_kv_transfer_params: bool = False
    scramble_kv_block_ids: bool = False
    scramble_every: int = 0
    stale_kv_transfer_params: bool = False
    decode_delay_s: float = 0.0
    decode_delay_every: int = 1

    def __post_init__(self) -> None:
        if not self.scramble_every >= 0:
            raise ValueError(f"scramble_every must be >= 0, got {self.scramble_every}")
        if not self.decode_delay_s >= 0:
            raise ValueError(f"decode_delay_s must be >= 0, got {self.decode_delay_s}")
        if not self.decode_delay_every >= 1:
            raise ValueError(f"decode_delay_every must be >= 1, got {self.decode_delay_every}")


NO_FAULTS = Faults()  # the default: a real deployment
