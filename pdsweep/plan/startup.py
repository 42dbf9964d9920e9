"""Instance startup estimated from model size, for the schedule's duration model.

A ``vllm serve`` startup on GPUs is a fixed part (CUDA/NCCL init, NIXL agent, torch.compile
and CUDA-graph capture: :data:`FIXED_S`) plus loading the weights, each TP rank its
``1/TP`` share at :data:`LOAD_GBPS` (safetensors from the page cache or local NVMe into
GPU memory). The catalogue's ``weights_gb`` (bf16 checkpoint size, GB) gives the size;
without it the flat :data:`pdsweep.plan.schedule.STARTUP_S` of the platform applies.
Measured startups are recorded per run (run.json ``instances.startups``) to refit these.
"""

from __future__ import annotations

from collections.abc import Callable

from pdsweep.plan.expand import Cell
from pdsweep.plan.schedule import STARTUP_S, eval_s
from pdsweep.sweepfile.sweep import LoadedSweep, ModelSpec

FIXED_S = {"cuda": 120.0, "cpu": 60.0}  # seconds before weights: init, compile, graphs
LOAD_GBPS = 2.0  # GB/s per TP rank while loading weights


def startup_s(model: ModelSpec, platform: str, tp: int) -> float:
    """Estimated seconds until one instance of ``model`` at ``tp`` answers /health:
    ``FIXED_S + weights_gb / (tp * LOAD_GBPS)``; the flat ``STARTUP_S[platform]`` when the
    catalogue gives no ``weights_gb``. Raises ``ValueError`` for ``tp < 1``."""
    if tp < 1:
        raise ValueError(f"tp {tp}: a TP size is >= 1")
    if model.weights_gb is None:
        return STARTUP_S[platform]
    return FIXED_S[platform] + model.weights_gb / (tp * LOAD_GBPS)


def cell_startup_s(cell: Cell, ls: LoadedSweep) -> float:
    """A cell's startup: its instances start together, so the slowest one (smallest TP)."""
    model = ls.catalogue.models[cell.model]
    tps = [cell.decode_tp] if cell.kind == "ref" else [cell.prefill_tp, cell.decode_tp]
    return max(startup_s(model, cell.platform, tp) for tp in tps)


def estimator(ls: LoadedSweep) -> Callable[[Cell], float]:
    """Estimated wall time of one cell of ``ls`` (startup by model size + its
    :func:`pdsweep.plan.schedule.eval_s`),
    the ``estimate`` of :func:`pdsweep.plan.schedule.pack` and :mod:`pdsweep.plan.dispatch`."""
    return lambda cell: cell_startup_s(cell, ls) + eval_s(cell)
