"""A sweep's ``integrity:`` section: whether GPU PD cells digest their KV and which fraction of requests
(docs/integrity.md, "GPU sweeps"). CPU sweeps digest every request whatever it says.

```yaml
integrity:
  gpu: true          # opt-in: PD pull cells of a cuda sweep digest KV on the device (torch, wsum-128)
  gpu_sample: 0.25   # fraction of requests digested, 0 < f <= 1 (default: pdsweep.core.kvsample.DEFAULT_GPU_SAMPLE)
```

The plan sets ``PDSWEEP_KV_DIGEST=1`` and ``PDSWEEP_KV_DIGEST_SAMPLE`` on those instances
(:func:`pdsweep.plan.instance.instance_env`), so the gate's ``IntegrityCheck`` applies to them.
"""

from __future__ import annotations

from typing import Any

from pydantic import field_validator

from pdsweep.core.kvsample import DEFAULT_GPU_SAMPLE
from pdsweep.sweepfile.catalogue import Strict as _Strict


class IntegritySpec(_Strict):
    gpu: bool = False  # GPU sweeps: opt-in (the digests cost TTFT there; CPU sweeps always digest)
    # the default keeps the added TTFT under 2 % by an estimate (pdsweep.core.kvsample), not a GPU measurement
    gpu_sample: float = DEFAULT_GPU_SAMPLE

    @field_validator("gpu", mode="before")
    @classmethod
    def _flag(cls, v: Any) -> Any:
        if not isinstance(v, bool):
            raise ValueError(f"{v!r} is no boolean (allowed: true, false)")
        return v

    @field_validator("gpu_sample", mode="before")
    @classmethod
    def _number(cls, v: Any) -> Any:
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            hint = "; YAML reads 1e-3 as text: write 0.001 or 1.0e-3" if isinstance(v, str) else ""
            raise ValueError(f"{v!r} is no number (allowed: 0 < gpu_sample <= 1{hint})")
        return v

    @field_validator("gpu_sample")
    @classmethod
    def _fraction(cls, v: float) -> float:
        if not 0 < v <= 1:
            raise ValueError(f"{v:g} is no fraction of requests (allowed: 0 < gpu_sample <= 1)")
        return v
