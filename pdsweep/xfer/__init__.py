"""NIXL KV-transfer micro-benchmark: per-rank cache geometry (``geometry``), vLLM's
decode-side read plan for fixed and pre-fix builds (``readplan``), and the real
multi-process NIXL benchmark with byte-exact verification: what both sides share
(``memory``: pattern, buffer layout, request page ids), the rank processes (``rank``),
the parent that drives them (``session``) and the entry point with its typed
:class:`~pdsweep.xfer.bench.BenchConfig` and statistics (``bench``).

Reproduces vLLM PR #49297: with prefill TP > decode TP on a hybrid MLA+SSM model the
MLA latent is read once while the TP-sharded SSM state must be read from every
prefill rank of the group.
"""

from .geometry import KVGeometry, Region, kv_geometry
from .readplan import Read, ReadPlan, build_read_plan, tp_ratio

__all__ = ["KVGeometry", "Region", "kv_geometry", "Read", "ReadPlan", "build_read_plan", "tp_ratio"]
