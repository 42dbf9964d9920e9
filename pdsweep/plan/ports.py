"""NIXL side-channel ports each instance binds, per the build's vLLM, and the plan rule
that rejects a cell whose instances' ranges would overlap.

vLLM 0.32 (``nixl/base_scheduler.py`` ``NixlConnectorScheduler.__init__``): one handshake
listener per engine, i.e. per DP rank, serving every TP rank's metadata:
``side_channel_port = VLLM_NIXL_SIDE_CHANNEL_PORT + data_parallel_index`` -> ``dp`` ports.
Older vLLM (monolithic ``nixl_connector.py``): ``VLLM_NIXL_SIDE_CHANNEL_PORT +
data_parallel_rank * tensor_parallel_size``, and each TP worker listened on that
``+ tp_rank`` -> ``dp * tp`` ports. A build whose layout cannot be read is given the
wider one (fail closed).
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path
from typing import Any

from pdsweep.builds.vllmsite import vllm_site
from pdsweep.core.errors import UserError
from pdsweep.plan.builds import build_python
from pdsweep.plan.instance import SIDE_CHANNEL_PORTS

BASE_SCHEDULER = "vllm/distributed/kv_transfer/kv_connector/v1/nixl/base_scheduler.py"
PER_ENGINE_FINGERPRINT = "VLLM_NIXL_SIDE_CHANNEL_PORT\n            + vllm_config.parallel_config.data_parallel_index"


@functools.lru_cache(maxsize=16)
def per_engine_listener(python: str) -> bool:
    """True when the vLLM that ``python`` imports binds one side-channel port per DP rank
    (the 0.32 layout, read from its ``base_scheduler.py``); False when it binds one per
    DP x TP rank or cannot be read."""
    try:
        site, _ = vllm_site(python)
        text = (site / BASE_SCHEDULER).read_text()
    except (UserError, OSError):
        return False
    return PER_ENGINE_FINGERPRINT in text


def side_channel_width(python: str, dp: int, tp: int) -> int:
    """Ports an instance with ``dp`` DP ranks of TP ``tp`` binds from its
    ``VLLM_NIXL_SIDE_CHANNEL_PORT`` on (see the module doc)."""
    return dp if per_engine_listener(python) else dp * tp


def plan_python(ls: Any, build: str) -> str:
    """The interpreter whose vLLM the plan reads for ``build``: the build's own, or this
    one when the build's venv is not made yet (the unfixed baseline is this vLLM with two
    NIXL worker files changed, ``pdsweep.builds.unfix``)."""
    try:
        return build_python(ls, build)
    except UserError:
        return sys.executable


def overlap(cell: Any, ls: Any) -> str | None:
    """Reason an instance of the cell binds more NIXL side-channel ports than its port block
    reserves (:data:`pdsweep.plan.instance.SIDE_CHANNEL_PORTS`: its range would overlap the
    next block), or None."""
    python = plan_python(ls, cell.build)
    roles = [("prefill", 1, cell.prefill_tp)] * cell.num_prefill + [
        ("decode", cell.decode_dp, cell.decode_tp)
    ] * cell.num_decode
    for k, (role, dp, tp) in enumerate(roles):
        width = side_channel_width(python, dp, tp)
        if width > SIDE_CHANNEL_PORTS:
            layout = "one per DP rank" if per_engine_listener(python) else "one per DP x TP rank"
            return (
                f"{role} instance {k} (DP {dp} x TP {tp}) binds {width} NIXL side-channel ports ({layout}, "
                f"vLLM NixlConnectorScheduler side_channel_port in {Path(python).name}'s vLLM), more than the "
                f"{SIDE_CHANNEL_PORTS} reserved per instance: its range would overlap the next instance's"
            )
    return None
