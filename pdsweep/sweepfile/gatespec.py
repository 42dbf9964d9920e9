"""A sweep's ``gate:`` section: the settings of the gate's checks and of compare's perf
verdict (frozen into run.json; read back by :mod:`pdsweep.judge.facts`)."""

from __future__ import annotations

from typing import Annotated

from pydantic import Field, field_validator

from pdsweep.sweepfile.catalogue import Strict as _Strict

# gate.perf keys: metric families of pdsweep.judge.perf (ratio thresholds, 0.05 = 5 %);
# engine_cpu_ms (CPU ms of the engine processes per request) is judged only when named
PERF_METRICS = (
    "ttft_ms",
    "tpot_ms",
    "itl_ms",
    "e2el_ms",
    "output_tok_s",
    "req_s",
    "kv_gbps",
    "kv_xfer_ms",
    "engine_cpu_ms",
)


class GateSpec(_Strict):
    require_accuracy: bool = True
    require_consistency: bool = True
    max_failed_transfers: int = Field(default=0, ge=0)
    alpha: float = Field(default=0.05, gt=0, lt=1)  # two-proportion test vs the reference
    require_all_cells: bool = False  # cells needing more GPUs than the host/allocation FAIL (cluster nightlies)
    # compare: per-metric ratio thresholds of the noise-aware verdict (pdsweep.judge.perf); a
    # metric not named gets perf_default
    perf: dict[str, Annotated[float, Field(gt=0, lt=10)]] = {}
    perf_default: float = Field(default=0.10, gt=0, lt=10)
    perf_noisy_fails: bool = False  # compare: a `noisy` metric fails it (default: shown, counted, passes)
    # UCX transports a PD cell must READ over (e.g. [cma]; transfer.json ucx_transports); None: any
    transports: list[str] | None = Field(default=None, min_length=1)
    # ... when the cell's prefill and decode run on different hosts (Slurm nodes with different
    # addresses, pdsweep.plan.crossnode.cross_host), e.g. [tcp] or [rc]; None: such a cell fails
    # the transport check when `transports` is set (one host's cma cannot cross hosts)
    transports_cross_host: list[str] | None = Field(default=None, min_length=1)
    # FLAKY (passed only after a ready_retries redeploy) fails `pdsweep gate --nightly` / a plain gate
    flaky_fails_nightly: bool = True
    flaky_fails_sweep: bool = False

    @field_validator("perf")
    @classmethod
    def _perf_keys(cls, v: dict[str, float]) -> dict[str, float]:
        bad = sorted(set(v) - set(PERF_METRICS))
        if bad:
            raise ValueError(f"gate.perf: unknown metric(s) {bad} (allowed: {', '.join(PERF_METRICS)})")
        return v
